"""Nearest-neighbour tables: one kNN search per point set, reused by its subsets (half-samples).

The LID of :mod:`embgeom_ray.core.sampled_metrics` needs, for each point, the distances
T_1 ≤ … ≤ T_k to its k nearest other points. The sampled stage takes it on a layer's distinct
points and on ``se_replicates`` half-samples of them (for the standard errors), in two metrics.
Instead of a k-smallest search of each half-sample's (m, m) block of the distance matrix, a
:class:`NeighbourTable` keeps, for every point of the full set, its K ≥ k + 1 nearest points
(itself included) ordered by the distance matrix, and their distances ||x_i − x_j||: computed
from the points as :func:`~.sampled_metrics.lid_mle` does, or taken from the matrix where a
bound on its error (its product's cancellation) is within :data:`MATRIX_RTOL` relative of the
value, as in the sampled stage (:func:`neighbour_table`'s ``error``).

For a subset S, the k + 1 nearest points of i ∈ S *within S* are the first k + 1 entries of
i's list that lie in S, whenever the list holds at least k + 1 of them: every point of S
nearer to i than the last of those is itself in the list. Rows with fewer (for a half-sample
and K = 3(k + 1), a binomial tail of ~0.5 %) are searched directly in their row of the
distance matrix restricted to S. So the neighbours, and the sorted distances T, are those of
a search on S itself, up to ties between equal distances (which either search may break
either way, as ``torch.topk`` and ``np.argpartition`` do).

A point set too large for its n × n matrices (more points than ``--silhouette-max-points``)
gets both tables without them (:func:`neighbour_tables_of_points`): one pass over the
Euclidean distance matrix a block of rows at a time, each block's chord distances derived
from it (:func:`chord_distances`); the rows a subset's search reaches past the lists are then
computed from the points.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

#: the length K of each point's list, in units of k + 1 (see the module docstring)
LIST_FACTOR = 3


#: bytes of one block of distance rows in :func:`neighbour_tables_of_points` (and the other
#: (rows, n) arrays of the same block: its chord distances, the top-k scratch)
BLOCK_BYTES = 32 << 20


#: the relative error a list's distance may have where :func:`neighbour_table` takes it from
#: the distance matrix (given ``error``); past it, the distance is computed from the points
MATRIX_RTOL = 1e-11
_EPS = float(np.finfo(np.float64).eps)

#: a bound on |D_ij − the points' own distance| at the entries (rows[a], idx[a, b]) of D,
#: whose values there are ``values``: ``error(rows, idx, values)`` -> (len(rows), K)
ErrorBound = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


class NeighbourTable(NamedTuple):
    """Each point's nearest points by a distance matrix, nearest first, with their distances."""

    X: np.ndarray  # (n, d) distinct points, float64
    D: np.ndarray | None  # (n, n) the distance matrix the lists follow; None: from ``P``
    idx: np.ndarray  # (n, K) indices of the K nearest points (the point itself included)
    dist: np.ndarray  # (n, K) ||x_i − x_idx[i, j]||, from the points or within MATRIX_RTOL
    rank: np.ndarray  # (n,) each row's position in np.unique(X, axis=0)'s order
    P: np.ndarray | None = None  # with D None: the points whose Euclidean distances D holds


def euclidean_rows(
    P: np.ndarray, sq: np.ndarray, rows: np.ndarray, cols: np.ndarray | None = None
) -> np.ndarray:
    """(len(rows), len(cols)) Euclidean distances between points ``rows`` and ``cols`` of P
    (None: all), as ``sklearn.metrics.pairwise_distances`` computes them: √max(‖p_i‖² + ‖p_j‖²
    − 2 p_i·p_j, 0), with ``sq`` = ‖p‖² per row and 0 where a row meets itself. Give P
    centred (less the points' mean): the product's cancellation grows with ‖p‖²/D²."""
    Pc = P if cols is None else P[cols]
    sq_c = sq if cols is None else sq[cols]
    D = P[rows] @ Pc.T
    D *= -2.0
    D += sq[rows, None]
    D += sq_c[None, :]
    np.maximum(D, 0.0, out=D)
    np.sqrt(D, out=D)
    col_ids = np.arange(len(P)) if cols is None else np.asarray(cols)
    D[np.asarray(rows)[:, None] == col_ids[None, :]] = 0.0
    return D


def chord_distances(
    D: np.ndarray, norms: np.ndarray, row_norms: np.ndarray | None = None
) -> np.ndarray:
    """Chord distances ||u_i − u_j|| of the unit vectors u = x/||x|| of non-zero points, from
    their Euclidean distances D and norms r: with 2 x_i·x_j = r_i² + r_j² − D_ij²,
    ||u_i − u_j||² = 2 − 2 cos_ij = (D_ij² − (r_i − r_j)²) / (r_i r_j), clipped at 0.

    D (n, n) with ``norms`` (n,), a zero diagonal out; or a block of its rows (m, n) with
    ``row_norms`` (m,) those rows' norms (the caller zeroes where a row meets itself). A pass
    over D instead of a product of the unit vectors (on MiniLM's distinct points, n = 4,096:
    within 1e-13 relative of ``pairwise_distances`` of the unit vectors, the same
    neighbours). D may be of the points less any one vector (their mean).
    """
    r = np.asarray(norms, dtype=np.float64)
    square = row_norms is None
    r_rows = r if square else np.asarray(row_norms, dtype=np.float64)
    C = np.empty(D.shape)
    rows = max(1, (1 << 16) // max(len(r), 1))  # blocks of rows that stay in cache
    for a in range(0, len(r_rows), rows):
        b = slice(a, a + rows)
        gap = r_rows[b, None] - r[None, :]
        gap *= gap
        block = np.multiply(D[b], D[b], out=C[b])
        block -= gap
        gap = r_rows[b, None] * r[None, :]
        block /= gap
        np.maximum(block, 0.0, out=block)
        np.sqrt(block, out=block)
    if square:
        np.fill_diagonal(C, 0.0)
    return C


def exact_distances(X: np.ndarray, rows: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """(len(rows), K) ||x_rows[i] − x_idx[i, j]||: the norm of the differences (no cancellation).

    In blocks of rows that keep the (rows, K, d) differences in cache; each value is the same
    float whatever the block (the norm reduces one contiguous row of d differences). The
    operations of ``np.linalg.norm(diff, axis=2)`` (sqrt of the ``add.reduce`` of the squares),
    done in place in the gathered block: the same floats, in ~2/3 of the time (one gather, no
    temporaries: 0.32 s → 0.22 s for 4,096 × 63 pairs at d = 384 on one core).
    """
    K = idx.shape[1]
    out = np.empty(idx.shape)
    block = max(1, (1 << 20) // (max(K, 1) * X.shape[1]))
    for a in range(0, len(rows), block):
        diff = X[idx[a : a + block]]  # a copy (fancy indexing): ours to overwrite
        diff -= X[rows[a : a + block], None, :]
        np.multiply(diff, diff, out=diff)
        np.sqrt(np.add.reduce(diff, axis=2), out=out[a : a + block])
    return out


def smallest_per_row(D: np.ndarray, m: int, *, ordered: bool = False) -> np.ndarray:
    """(rows, m) column indices of the m smallest entries of each row of D.

    ``torch.topk`` over blocks of rows (~4x faster than ``np.argpartition`` on a 4096 × 4096
    matrix); nearest first with ``ordered``, else in no particular order. Ties between equal
    entries may pick either column, as with argpartition.
    """
    import torch

    D = np.ascontiguousarray(D)
    with warnings.catch_warnings():  # D may be read-only (from Ray's object store): only read
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        Dt = torch.from_numpy(D)
    out = np.empty((len(D), m), np.int64)
    for a in range(0, len(D), 1024):  # row blocks bound the (rows, m) outputs' scratch
        top = torch.topk(Dt[a : a + 1024], m, dim=1, largest=False, sorted=ordered)
        out[a : a + 1024] = top.indices.numpy()
    return out


def neighbour_table(
    X: np.ndarray, D: np.ndarray, k: int, error: ErrorBound | None = None
) -> NeighbourTable | None:
    """The :class:`NeighbourTable` of the distinct points X (n, d) for kNN searches up to k.

    D: the (n, n) distance matrix to order by (e.g. Euclidean distances of X minus its mean,
    with a zero diagonal); lists of K = min(n, ``LIST_FACTOR``·(k + 1)) points. None when X
    has repeated rows (the LID drops copies first; the table's searches assume none).

    The lists' distances are computed from the points (:func:`exact_distances`), or, given
    ``error`` (a bound on D's error at each entry against the points' own distance:
    :func:`euclidean_error`, :func:`chord_error`), taken from D where that bound is within
    :data:`MATRIX_RTOL` of the value, and computed from the points only elsewhere: where the
    matrix's product cancels (near-duplicate points, a point and itself). On MiniLM's demo
    sample (n = 4,096, d = 384) the bound held at every entry of both tables but each point's
    own, the mean LIDs moved by ≤ 2e-15, and the two tables took 0.13–0.17 s a layer instead
    of 0.36–0.47 s.
    """
    X = np.asarray(X, dtype=np.float64)
    n = len(X)
    if D.shape != (n, n):
        raise ValueError(f"D must be ({n}, {n}), got {D.shape}")
    rank = _unique_rank(X)
    if rank is None:
        return None
    rows = np.arange(n)
    idx = smallest_per_row(D, list_length(n, k), ordered=True)
    if error is None:
        return NeighbourTable(X, D, idx, exact_distances(X, rows, idx), rank)
    dist = np.take_along_axis(D, idx, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        far = error(rows, idx, dist) <= MATRIX_RTOL * dist  # False where NaN (0 / 0)
    r, c = np.nonzero(~far)
    if len(r):
        dist[r, c] = exact_distances(X, r, idx[r, c][:, None])[:, 0]
    return NeighbourTable(X, D, idx, dist, rank)


def _product_terms(P: np.ndarray, X: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """(‖p‖² per row of P, ‖x‖ per row of X, (2d + 8)·ε): the terms of the matrix's error
    bounds (:func:`euclidean_error`, :func:`chord_error`)."""
    return np.einsum("nd,nd->n", P, P), np.linalg.norm(X, axis=1), (2 * P.shape[1] + 8) * _EPS


def euclidean_error(P: np.ndarray, X: np.ndarray) -> ErrorBound:
    """The error bound of :func:`neighbour_table` for D = :func:`euclidean_rows`'s distances
    of the points P = X less one vector (e.g. their mean), against ||x_i − x_j||.

    D_ij² = ‖p_i‖² + ‖p_j‖² − 2 p_i·p_j in float64: the product and the squared norms each
    err by at most γ_d ≈ d·ε of ‖p_i‖² + ‖p_j‖² (Higham, "Accuracy and Stability of Numerical
    Algorithms", §3.1), the sums by a few ε more, so |δ(D²)| ≤ (2d + 8)·ε·(‖p_i‖² + ‖p_j‖²);
    P less X errs by ε per coordinate, so P's differences are X's within ε·(‖x_i‖ + ‖x_j‖);
    and δD ≈ δ(D²) / (2D)."""
    sq, norms, c = _product_terms(P, X)

    def bound(rows: np.ndarray, idx: np.ndarray, values: np.ndarray) -> np.ndarray:
        d2 = c * (sq[rows][:, None] + sq[idx])
        return d2 / (2.0 * values) + _EPS * (norms[rows][:, None] + norms[idx] + values)

    return bound


def chord_error(P: np.ndarray, X: np.ndarray, D: np.ndarray) -> ErrorBound:
    """The error bound of :func:`neighbour_table` for C = :func:`chord_distances` of D (the
    Euclidean distances of P = X less one vector) and X's norms r, against ||u_i − u_j|| of
    the unit vectors u = x/‖x‖.

    C² = (D² − (r_i − r_j)²) / (r_i r_j): D² errs as in :func:`euclidean_error` (plus
    2D·ε·(r_i + r_j) from P's rounding), the difference and the quotient by a few ε of
    D² + (r_i − r_j)² and of C²; and δC ≈ δ(C²) / (2C)."""
    sq, r, c = _product_terms(P, X)

    def bound(rows: np.ndarray, idx: np.ndarray, values: np.ndarray) -> np.ndarray:
        Dv = D[rows[:, None], idx]
        ri, rj = r[rows][:, None], r[idx]
        d2 = c * (sq[rows][:, None] + sq[idx]) + 2.0 * Dv * _EPS * (ri + rj)
        c2 = (d2 + 4.0 * _EPS * (Dv * Dv + (ri - rj) ** 2)) / (ri * rj)
        return (c2 + 4.0 * _EPS * values * values) / (2.0 * values) + _EPS * values

    return bound


def list_length(n: int, k: int) -> int:
    """K, the length of each point's list in a table of n points for searches up to k."""
    return min(n, LIST_FACTOR * (k + 1))


def _unique_rank(X: np.ndarray) -> np.ndarray | None:
    """Each row's position in ``np.unique(X, axis=0)``'s order (rows compared lexicographically);
    None if X has repeated rows.

    When no two rows share their first coordinate, that order is the first coordinate's and no
    row repeats: one argsort of n numbers instead of np.unique's sort of whole rows (2.2 s for
    8,192 rows of 4,096 dimensions). Otherwise np.unique's own.
    """
    n = len(X)
    order = np.argsort(X[:, 0], kind="stable") if X.ndim == 2 and X.shape[1] else None
    if order is not None and n > 1 and (np.diff(X[order, 0]) != 0).all():
        first = order
    else:
        _, first = np.unique(X, axis=0, return_index=True)
        if len(first) < n:
            return None
    rank = np.empty(n, np.int64)
    rank[first] = np.arange(n)
    return rank


def neighbour_tables_of_points(
    X: np.ndarray, k: int
) -> tuple[NeighbourTable | None, NeighbourTable | None]:
    """(Euclidean, chord) :class:`NeighbourTable` of the distinct points X (n, d), without an
    (n, n) matrix: the tables :func:`neighbour_table` builds from ``pairwise_distances`` of X
    less its mean and from :func:`chord_distances` of it (the table of the unit vectors),
    up to ties within rounding.

    One pass over the Euclidean distance matrix in blocks of rows of at most
    :data:`BLOCK_BYTES` (:func:`euclidean_rows` of the centred points: 2 n² d flops); each
    block's chord distances come from it, and each row keeps its K nearest in both. Memory:
    the centred points, the unit vectors and their centred copy (3 · 8 n d bytes), three
    (rows, n) blocks, the lists (2 · 16 n K bytes). Subsets whose lists run short compute
    their rows from the points (``P``). The chord table is None when a point is zero or two
    points share a direction; both are None when X has repeated rows.
    """
    X = np.asarray(X, dtype=np.float64)
    n = len(X)
    rank = _unique_rank(X)
    if rank is None:
        return None, None
    Xc = X - X.mean(axis=0)
    sq = np.einsum("nd,nd->n", Xc, Xc)
    norms = np.linalg.norm(X, axis=1)
    U = X / norms[:, None] if (norms > 0).all() else None
    # two points on one ray from the origin share a unit vector: no chord table (as above)
    rank_u = None if U is None else _unique_rank(U)
    chord = rank_u is not None
    K = list_length(n, k)
    idx_e = np.empty((n, K), np.int64)
    idx_c = np.empty((n, K), np.int64)
    block = max(1, BLOCK_BYTES // (8 * n))
    for a in range(0, n, block):
        rows = np.arange(a, min(a + block, n))
        D = euclidean_rows(Xc, sq, rows)
        idx_e[rows] = smallest_per_row(D, K, ordered=True)
        if chord:
            C = chord_distances(D, norms, norms[rows])
            C[np.arange(len(rows)), rows] = 0.0
            idx_c[rows] = smallest_per_row(C, K, ordered=True)
    all_rows = np.arange(n)
    euclid = NeighbourTable(X, None, idx_e, exact_distances(X, all_rows, idx_e), rank, Xc)
    if not chord:
        return euclid, None
    dist_c = exact_distances(U, all_rows, idx_c)
    # the unit vectors less their mean: the same distances, less cancellation in the product
    return euclid, NeighbourTable(U, None, idx_c, dist_c, rank_u, U - U.mean(axis=0))


def _distance_rows(table: NeighbourTable, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """The table's distances between points ``rows`` and ``cols``: its matrix's block, or
    (without one) computed from its points ``P``."""
    if table.D is not None:
        return table.D[np.ix_(rows, cols)]
    P = table.P
    return euclidean_rows(P, np.einsum("nd,nd->n", P, P), rows, cols)


def knn_distances(table: NeighbourTable, k: int, S: np.ndarray | None = None) -> np.ndarray:
    """(m, k) sorted distances T_1 ≤ … ≤ T_k of each point of S to its k nearest others in S.

    S: sorted indices of a subset of the table's points (None: all of them); rows in the
    order of ``np.unique(X[S], axis=0)``, as :func:`~.sampled_metrics.lid_mle` returns its
    per-point values. The k + 1 nearest (by the table's matrix) less the point itself (or,
    should a tie hide it, the farthest of them); needs n(S) > k.
    """
    n = len(table.X)
    rows = np.arange(n) if S is None else np.asarray(S, dtype=np.int64)
    rows = rows[np.argsort(table.rank[rows], kind="stable")]  # np.unique's order
    m = len(rows)
    if m <= k:
        raise ValueError(f"a kNN search for k = {k} needs more than {k} points, got {m}")
    cand = table.idx[rows]  # (m, K)
    if S is None:
        ok = np.ones(cand.shape, dtype=bool)
    else:
        member = np.zeros(n, dtype=bool)
        member[rows] = True
        ok = member[cand]
    ok &= np.cumsum(ok, axis=1) <= k + 1  # the first k + 1 members of each list
    full = ok.sum(axis=1) == k + 1
    nn = np.empty((m, k + 1), np.int64)
    T = np.empty((m, k + 1))
    nn[full] = cand[full][ok[full]].reshape(-1, k + 1)
    T[full] = table.dist[rows[full]][ok[full]].reshape(-1, k + 1)
    if not full.all():  # lists too short within S: search those rows directly
        short = rows[~full]
        cols = np.sort(rows)
        found = cols[smallest_per_row(_distance_rows(table, short, cols), k + 1, ordered=True)]
        nn[~full] = found
        T[~full] = exact_distances(table.X, short, found)
    # drop the point itself (or, should a tie hide it, the farthest of the k + 1)
    is_self = nn == rows[:, None]
    drop = np.where(is_self.any(axis=1), is_self.argmax(axis=1), k)
    keep = np.ones(nn.shape, dtype=bool)
    keep[np.arange(m), drop] = False
    T = T[keep].reshape(m, k)
    T.sort(axis=1)
    return T
