"""Cai et al. (2021)'s number of clusters of a point set: a K-means scan of every k, scored by silhouette.

:func:`select_k` is a function of the point set and the seed alone: whatever the silhouettes
turn out to be, the same k are fitted and scored, every k = 2..15 and then a 10% grid up to
``k_max`` (:func:`scan_ks`), so the reported k never depends on where a search happened to
stop, and points that differ only by the forward's rounding (another batching of the same
corpus) give the same fits. How:

- **The point set** is the sample's distinct points (:func:`~embgeom_ray.core.distinct.distinct_rows`:
  one per content key, then one per bit pattern), centred on their float64 mean.
- **Each k's partition is the lowest inertia of many fits** (the protocol of Cai et al., who
  kept the best of scikit-learn's 10 k-means++ seedings), every fit Lloyd (1982) as
  scikit-learn's ``KMeans(algorithm="lloyd")`` runs it, in float32 distances with float64 sums
  (:mod:`embgeom_ray.core.lloyd`: all of a step's fits at once), stopped at scikit-learn's
  relative tolerance. The fits of k:

  - *seedings* (every k ≤ 15, Cai et al.'s range): ``n_init`` greedy k-means++ seedings
    (:func:`plus_plus`: Arthur & Vassilvitskii 2007, scikit-learn's greedy variant, each step
    keeping the best of 2 + ⌊ln k_max⌋ candidates drawn ∝ D²). Seeding c of k is the first k
    centres of *chain* c (:func:`plus_plus_chain`, drawn from ``numpy.random.default_rng([seed,
    c])``), so one chain seeds every k at the cost of one seeding of 15. The seedings of
    every k are fitted at once (their Lloyd steps share one product with the points);
  - *warm starts* (every k after the first, in increasing order): ``n_init`` seedings that keep
    the centres of the previous k's partition (the lowest inertia found for it) and add the
    missing centres by the same greedy k-means++ steps, D² measured from each point's centre
    in that partition (start j of k drawn from ``default_rng([seed, 2, k, j])``). They start
    where the previous k ended, so they converge in a few cheap iterations, and they carry the
    best partition found so far from k to k;
  - a *downward* start (every k but the largest, in decreasing order, after the others): the
    next k's partition less the centres whose points would cost least to give to their
    next-nearest centres (:func:`_merged_start`), so that a better partition found at a
    larger k carries back down.

  Of all of k's fits the lowest inertia wins (the first on a tie; labels are canonical, so a
  partition found by several fits is labelled the same whichever wins). Above k = 15 the
  warm and downward starts alone are fitted. ``n_init`` (:func:`default_n_init`) is 10 for a
  scan that ends at 15 (scikit-learn's 10 seedings, Cai et al.'s protocol) and 3 for one that
  goes on (the default, to k = 60): there the downward starts bring every larger k's
  partition down to 15 (with 10 seedings and 10 warm starts, the downward start was the
  lowest inertia at 57 of the 98 (layer, k ≤ 15) pairs of MiniLM's demo sample), and 3
  seedings and 3 warm starts with them reach scikit-learn's 10 seedings at every k ≤ 15 on
  MiniLM, in a little over half the time (``tests/core/test_kmeans_selection_minilm.py``,
  docs/benchmarks.md).
- **The silhouette** (Rousseeuw 1987) of each k's partition is taken on one Euclidean distance
  matrix of at most ``silhouette_max_points`` points drawn once with ``seed``, every k's at
  once (:func:`point_silhouettes`: the per-point silhouettes from one float32 product of the
  matrix with every partition's indicators). k* = argmax (the smaller k on a tie); k = 1 (one
  cluster) when s(k*) < ``min_silhouette`` (0.1, Cai et al.); ``at_cap`` when k* is the
  largest k scanned (the curve has no interior optimum within the scan). Cai et al. scan
  k = 2..15 (``k_max=15``).
- **Support of the decision** (:func:`decision_support`): the share of
  :data:`SUPPORT_RESAMPLES` bootstrap resamples of the silhouette's points (each point's
  silhouette at every k held fixed, the curve recomputed as their mean over the resample)
  whose decision is the reported one (``k_support``: the same k, or k = 1 again), and whose
  k = 1 vs k ≥ 2 decision is (``structure_support``). Near 1: another sample of the same text
  would very likely decide the same; near 0.5 or below: the decision rests on silhouettes
  that the sample does not separate.
- **Stability**: ``stability_seeds`` more k-means++ seedings (seeds :func:`stability_seed`)
  are fitted at k*; ``stability`` is the mean adjusted Rand index (Hubert & Arabie 1985)
  between their partitions and the reported one (1: the same partition every time).

What repeats and near-repeats do to the silhouette: a clump of points that are nearly the
same (the same token in nearly the same context) sits at distance ~0 from itself, so a k large
enough to give each clump its own cluster scores a silhouette near 1 on those points. On a
sample with many such clumps the curve keeps rising with k; exact repeats are removed by the
distinct points, near-repeats are not (docs/outputs.md, "K-means").

Samples too large for one process (n·d > ``LOCAL_FIT_MAX_ELEMENTS``, or partitions given)
fit each k with ``n_init`` k-means|| initialisations and Lloyd as a map over partitions
(:func:`embgeom_ray.core.kmeans.fit`) instead, without warm starts; the scan and the scoring
are the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import pairwise
from typing import Any

import numpy as np

from .distinct import distinct_rows
from .kmeans import MAX_ITER, TOL, KMeansResult, MapFn, partition
from .kmeans import fit as fit_partitioned
from .lloyd import Points, Start, canonical, cluster_sums, lloyd_many
from .options import SampledOptions

_DEFAULTS = SampledOptions()
#: the largest k fitted (``kmeans_k_max``)
K_MAX: int = _DEFAULTS.kmeans_k_max
#: every k = 2..K_DENSE is fitted (Cai et al.'s range), from fresh seedings and warm starts;
#: above it the scan grows by K_GROWTH, from warm starts
K_DENSE = 15
#: the factor between consecutive k fitted above K_DENSE (:func:`scan_ks`)
K_GROWTH = 1.1
#: below this best silhouette, k = 1 (Cai et al. 2021; ``kmeans_min_silhouette``)
MIN_SILHOUETTE: float = _DEFAULTS.kmeans_min_silhouette
#: k-means++ seedings per k ≤ K_DENSE, and warm starts per k after the first, of a scan that
#: ends at K_DENSE or below (Cai et al.'s protocol: scikit-learn's 10 seedings), and
#: initialisations per k of the partitioned route (``kmeans_n_init`` unset: :func:`default_n_init`)
N_INIT = 10
#: the same for a scan that goes above K_DENSE, fitted in one process: each k ≤ K_DENSE also
#: starts from the next k's partition, which carries the larger k's partitions down; with
#: those, 3 seedings and 3 warm starts reach scikit-learn's 10 seedings (docs/benchmarks.md)
N_INIT_SCAN = 3
#: seedings fitted at the chosen k for the stability check (``kmeans_stability_seeds``)
STABILITY_SEEDS: int = _DEFAULTS.kmeans_stability_seeds
#: points a silhouette is computed on, a subsample drawn once when there are more
#: (``silhouette_max_points``)
SILHOUETTE_MAX_POINTS: int = _DEFAULTS.silhouette_max_points
#: bootstrap resamples behind ``k_support`` and ``structure_support`` (:func:`decision_support`)
SUPPORT_RESAMPLES = 200
#: a k decision is robust when at least this share of the bootstrap resamples take it: below,
#: the sample does not settle it (``kmeans_k_support``; ``jobs.compare`` then treats a moved k
#: as not comparable, the report says so). The registry's and docs/outputs.md's texts spell it,
#: checked by tests/core/test_metric_registry.py
ROBUST_SUPPORT = 0.9
#: dtype of the one-process fits' distances (float32: the activations' own precision)
LOCAL_DTYPE: type[np.floating] = np.float32
#: samples with n·d at most this (4096 points × d = 8192, 256 MiB in float64) are fitted in one
#: process; larger ones by the partitioned k-means|| path
LOCAL_FIT_MAX_ELEMENTS = 4096 * 8192
#: the seeds of the warm starts: ``default_rng([seed, WARM, k, j])``
WARM = 2
#: the seed of the support's resamples: ``default_rng([seed, SUPPORT])``
SUPPORT = 0x5B

#: fits from given initial centres: ``fit(X, inits)`` → ``[Lloyd from X[ids] for ids in
#: inits]`` (:func:`fit_many` with the scan's ``max_iter``, ``tol`` and dtype bound)
FitMany = Callable[..., list[KMeansResult]]
#: how the seedings' fits of :func:`select_k` run: ``map_fits(fit, X, inits, initial=...)``
#: returns ``fit(X, inits)``, computed anywhere, in any groups of ``inits`` (default
#: :func:`serial_fits`; the Ray layer spreads them over tasks). A fit's cost grows with
#: ``len(ids)`` (its k). ``initial`` is True for the scan's seedings, False for the refits.
MapFits = Callable[..., list[KMeansResult]]


@dataclass
class SelectKResult:
    """Cai et al.'s model selection on one point set (see the module docstring).

    ``k`` the chosen number of clusters (1 when the best silhouette < ``min_silhouette``);
    ``silhouette`` the best silhouette over the scan (reported even when k = 1 is chosen;
    NaN when no k could be scored); ``centers``/``labels``/``inertia`` of the chosen k;
    ``silhouettes``/``inertias`` per k scanned (the curve). ``labels`` has one entry per input
    row (copies of a point share its label); centres, inertias and silhouettes are those of
    the fits on the ``n_distinct`` distinct points.

    ``best_k`` is the k of best silhouette (= ``k`` unless k = 1 was chosen; 1 when no k
    could be scored) and ``best_labels`` its labels (per input row); ``k_searched`` the largest
    k scanned (the k of :func:`scan_ks` up to it; 1 when none could be); ``at_cap`` whether
    ``best_k`` is that largest k: the silhouette has no interior optimum in the scan.
    ``stability`` the mean adjusted Rand index between ``best_labels`` and refits of ``best_k``
    from other seedings (NaN when not checked). ``k_support`` and ``structure_support``: the
    shares of bootstrap resamples that take ``k``, and that take the same k = 1 vs k ≥ 2
    decision (:func:`decision_support`; NaN when no k could be scored). ``partitions``: per k
    scanned, the labels (int32) of the ``n_distinct`` distinct points.
    """

    k: int
    silhouette: float
    centers: np.ndarray
    labels: np.ndarray
    inertia: float
    silhouettes: dict[int, float] = field(default_factory=dict)
    inertias: dict[int, float] = field(default_factory=dict)
    best_k: int = 1
    best_labels: np.ndarray | None = None
    k_searched: int = 1
    at_cap: bool = False
    stability: float = float("nan")
    n_distinct: int = 0
    k_support: float = float("nan")
    structure_support: float = float("nan")
    partitions: dict[int, np.ndarray] = field(default_factory=dict)

    def expanded(self, inverse: np.ndarray) -> SelectKResult:
        """This result, fitted on distinct points, with labels for every row: ``labels[inverse]``.

        ``inverse`` maps each row to its distinct point (:func:`distinct_rows`).
        """
        inverse = np.asarray(inverse, dtype=np.int64)
        return replace(
            self,
            labels=np.asarray(self.labels)[inverse],
            best_labels=None if self.best_labels is None else self.best_labels[inverse],
        )

    def curve(self) -> list[dict[str, Any]]:
        """The scan as rows ``{k, silhouette, inertia}`` for every k fitted, ascending."""
        return [
            {
                "k": k,
                "silhouette": self.silhouettes.get(k, float("nan")),
                "inertia": self.inertias[k],
            }
            for k in sorted(self.inertias)
        ]


def scan_ks(k_max: int, dense: int = K_DENSE, growth: float = K_GROWTH) -> list[int]:
    """The k fitted by :func:`select_k` up to ``k_max``: every k = 2..``dense``, then
    k_{i+1} = max(k_i + 1, ⌈growth · k_i⌉) up to ``k_max``, which is always fitted (at the
    defaults: 2..15, 17, 19, 21, 24, 27, 30, 33, 37, 41, 46, 51, 57, 60).

    Above Cai et al.'s 2..15 the silhouette of neighbouring k differs by about as much as
    that of two initialisations of one k, so a 10% grid resolves the curve as finely as the
    fits can, at a third of the cost of every k (Σ k = 582 instead of 1,829 to k = 60).
    """
    k_max = int(k_max)
    ks = list(range(2, min(int(dense), k_max) + 1))
    k = ks[-1] if ks else 2
    while k < k_max:
        k = min(k_max, max(k + 1, math.ceil(growth * k - 1e-9)))
        ks.append(k)
    return [k for k in ks if k >= 2]


def default_n_init(top: int, local: bool) -> int:
    """``n_init`` of :func:`select_k` when not given: :data:`N_INIT_SCAN` for a scan fitted in
    one process that goes above :data:`K_DENSE` (largest k ``top``), else :data:`N_INIT`."""
    return N_INIT_SCAN if local and top > K_DENSE else N_INIT


def stability_seed(seed: int, replicate: int) -> int:
    """The seed of the ``replicate``-th refit (1, 2, ...): a 32-bit word of SeedSequence([seed, r])."""
    return int(np.random.SeedSequence([int(seed) % 2**63, int(replicate)]).generate_state(1)[0])


class SquaredDistances:
    """Squared Euclidean distances from chosen points to every point of X (float64): rows of
    ``‖x_i‖² + ‖x_j‖² − 2 G_ij`` from the Gram matrix G = X Xᵀ when one is given (the
    silhouettes' matrix, computed once per layer), else from products with X."""

    def __init__(self, X: np.ndarray, gram: np.ndarray | None = None) -> None:
        self.X = np.asarray(X, dtype=np.float64)
        self.gram = gram
        self.sq_norms = np.einsum("ij,ij->i", self.X, self.X)

    @property
    def n(self) -> int:
        return len(self.X)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """(len(ids), n) squared distances from points ``ids``, clipped at 0, exactly 0 to
        themselves."""
        ids = np.asarray(ids, dtype=np.int64)
        dots = self.gram[ids] if self.gram is not None else self.X[ids] @ self.X.T
        out = self.sq_norms[ids, None] - 2.0 * dots + self.sq_norms[None, :]
        np.maximum(out, 0.0, out=out)
        out[np.arange(len(ids)), ids] = 0.0
        return out


def _draw(d2: np.ndarray, trials: int, rng: np.random.Generator) -> np.ndarray:
    """``trials`` indices drawn with replacement with probability ∝ d2, by exponential races:
    draw i is argmin_x E_ix / d2(x) with E_ix ~ Exp(1), which is x with probability
    d2(x) / Σ d2. Each draw depends on the ratios of the points' d2, not on a running sum of
    them, so rounding-level changes of d2 change it only at a near-tie of two ratios."""
    E = rng.standard_exponential((trials, len(d2)))
    with np.errstate(divide="ignore"):
        return (E / d2[None, :]).argmin(axis=1)


def plus_plus(
    dist: SquaredDistances,
    m: int,
    seed: Any,
    trials: int,
    d2: np.ndarray | None = None,
) -> np.ndarray:
    """Indices of m greedy k-means++ centres (Arthur & Vassilvitskii 2007; scikit-learn's greedy
    variant): each step draws ``trials`` candidates with probability ∝ D²(x), the squared
    distance to the nearest centre so far (:func:`_draw`), and keeps the candidate that leaves
    the smallest potential Σ_x D²(x). ``d2``: the points' D² to centres chosen before (a warm
    start's); None: the first centre is drawn uniformly. All randomness from
    ``numpy.random.default_rng(seed)``, the same draws per step whatever m: the first j
    centres of m are the j centres of the same seed. Stops early when the potential is 0."""
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    if d2 is None:
        first = int(rng.integers(dist.n))
        ids.append(first)
        d2 = dist.rows(np.array([first]))[0]
    else:
        d2 = np.asarray(d2, dtype=np.float64).copy()
    while len(ids) < m and d2.sum() > 0:
        cand = _draw(d2, trials, rng)
        after = np.minimum(d2[None, :], dist.rows(cand))
        best = int(after.sum(axis=1).argmin())
        ids.append(int(cand[best]))
        d2 = after[best]
    return np.asarray(ids, dtype=np.int64)


def plus_plus_chain(X: np.ndarray, k: int, seed: Any, trials: int) -> np.ndarray:
    """Indices of k greedy k-means++ centres of X (:func:`plus_plus` from a uniform first
    centre), each a prefix of the next: the first j indices are the chain of j centres with the
    same seed. Stops early when every point is a centre (potential 0)."""
    return plus_plus(SquaredDistances(X), min(int(k), len(X)), seed, trials)


def _int_seed(seed: Any) -> int:
    """A chain's seed (an int or a tuple of ints) as one int, for the partitioned route."""
    return int(np.random.SeedSequence(seed).generate_state(1)[0])


def chain_trials(k_max: int) -> int:
    """Candidates per k-means++ step of every chain: 2 + ⌊ln k_max⌋ (scikit-learn's rule for
    the largest k, used for all k so that chains have the prefix property)."""
    return 2 + int(np.log(max(int(k_max), 2)))


def fit_many(
    X: np.ndarray | Points,
    inits: Sequence[np.ndarray],
    *,
    max_iter: int = MAX_ITER,
    tol: float = TOL,
    dtype: type[np.floating] = LOCAL_DTYPE,
) -> list[KMeansResult]:
    """Lloyd from the centres ``X[ids]`` for each ``ids`` of ``inits``, all at once
    (:func:`~embgeom_ray.core.lloyd.lloyd_many`: scikit-learn's Lloyd, distances in ``dtype``,
    sums and inertias in float64); canonical labels, results in order. ``X`` may be the
    :class:`~embgeom_ray.core.lloyd.Points` of the points already. Each result is that of its
    start alone, whatever the other starts."""
    points = X if isinstance(X, Points) else Points(X, dtype)
    starts = [Start(points.X[np.asarray(ids, dtype=np.int64)]) for ids in inits]
    return lloyd_many(points, starts, max_iter=max_iter, tol=tol)


def serial_fits(
    fit: FitMany, X: np.ndarray, inits: Sequence[np.ndarray], *, initial: bool = True
) -> list[KMeansResult]:
    """The default ``map_fits`` of :func:`select_k`: ``fit(X, inits)`` in this process."""
    return fit(X, inits)


def silhouette_from_distances(
    D: np.ndarray, labels: np.ndarray, scored: np.ndarray | None = None
) -> float:
    """Mean silhouette (Rousseeuw 1987) of ``labels`` from a precomputed distance matrix.

    D: (n, n) distances with a zero diagonal. With S_iC = Σ_{j ∈ C} D_ij, n_C the size of
    cluster C and c(i) the cluster of i: a_i = S_{i,c(i)} / (n_{c(i)} − 1), b_i =
    min_{C ≠ c(i)} S_iC / n_C, s_i = (b_i − a_i) / max(a_i, b_i) (0 for a singleton cluster);
    returns mean_i s_i. Equals ``sklearn.metrics.silhouette_score(D, labels,
    metric="precomputed")``, bit for bit: S is summed in the same order (a weighted
    ``bincount`` of each row by label), but over blocks of rows at once instead of one Python
    call per row. Raises ValueError unless 2 ≤ #labels ≤ n − 1, as scikit-learn does.

    ``scored``: sorted indices of the points scored, ``labels`` theirs; the value is that of
    ``D[np.ix_(scored, scored)]``, bit for bit, without gathering that block: each scored
    row of D is summed whole, the columns of the other points into a bin of their own, so
    that every S_iC adds the same entries in the same order (a half-sample's types' silhouette,
    87% of its points: 15.5 → 9 ms; the layer's, 63 → 32 ms).
    """
    D = np.asarray(D, dtype=np.float64)
    labels = np.asarray(labels)
    n = len(labels)
    N = len(D) if scored is not None else n
    if D.shape != (N, N) or labels.ndim != 1 or (scored is not None and len(scored) != n):
        raise ValueError(f"D must be (n, n) and labels (n,), got {D.shape} and {labels.shape}")
    _, lab, cnt = np.unique(labels, return_inverse=True, return_counts=True)
    lab = lab.reshape(-1)
    n_labels = len(cnt)
    if not 2 <= n_labels <= n - 1:
        raise ValueError(f"the silhouette needs 2 <= #labels <= n - 1, got {n_labels} of {n}")
    # each column's bin: its label, or (outside ``scored``) bin n_labels, dropped
    bins, width = (lab, n_labels) if scored is None else (np.full(N, n_labels), n_labels + 1)
    if scored is not None:
        bins[scored] = lab
    S = np.empty((n, n_labels))
    block = min(n, max(1, (1 << 20) // N))  # rows per bincount: ~1M distances
    # each block's bins (row r, column's bin) = r · width + bin: the same for every block,
    # made once (half of a block's time when made for each: 10.7 → 5.7 ms at n = 2,048)
    flat = (np.arange(block)[:, None] * width + bins[None, :]).ravel()
    for a in range(0, n, block):
        rows = D[a : a + block] if scored is None else D[scored[a : a + block]]
        m = len(rows)
        S[a : a + m] = np.bincount(
            flat[: m * N], weights=rows.ravel(), minlength=m * width
        ).reshape(m, width)[:, :n_labels]
    own = cnt[lab]
    idx = np.arange(n)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = S[idx, lab] / (own - 1)
        S[idx, lab] = np.inf
        b = np.divide(S, cnt, out=S).min(axis=1)
        s = (b - a) / np.maximum(a, b)
    return float(np.nan_to_num(s).mean())


def silhouette_subsample(n: int, max_points: int | None, seed: int) -> np.ndarray:
    """Sorted indices of at most ``max_points`` of n points (all if None or n ≤ max_points)."""
    if max_points is None or n <= max_points:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=max_points, replace=False))


def point_silhouettes(D: np.ndarray, labels: Sequence[np.ndarray]) -> np.ndarray:
    """(n, len(labels)) per-point silhouettes (Rousseeuw 1987) of each labelling of the n points
    of the distance matrix D, from one product of D (float32) with every labelling's indicators.

    With S_iC = Σ_{j ∈ C} D_ij, n_C the size of cluster C and c(i) the cluster of i:
    a_i = S_{i,c(i)} / (n_{c(i)} − 1), b_i = min_{C ≠ c(i)} S_iC / n_C,
    s_i = (b_i − a_i) / max(a_i, b_i), 0 for a singleton cluster; a column is NaN unless its
    labelling has 2 ≤ #labels ≤ n − 1. Each column's mean is ``sklearn.metrics.silhouette_score``
    of that labelling (:func:`silhouette_from_distances`) to float32 rounding of the sums
    (~1e-6 relative).
    """
    D = np.asarray(D)
    n = len(D)
    blocks = [
        np.unique(np.asarray(lab), return_inverse=True, return_counts=True)[1:] for lab in labels
    ]
    width = sum(len(cnt) for _, cnt in blocks)
    ind = np.zeros((n, width), dtype=np.float32)
    at = 0
    for inv, cnt in blocks:
        ind[np.arange(n), at + inv.reshape(-1)] = 1.0
        at += len(cnt)
    S = np.asarray(D, dtype=np.float32) @ ind
    out = np.full((n, len(blocks)), np.nan)
    rows = np.arange(n)
    at = 0
    for j, (inv, cnt) in enumerate(blocks):
        inv, q = inv.reshape(-1), len(cnt)
        block, at = S[:, at : at + q].astype(np.float64), at + q
        if not 2 <= q <= n - 1:
            continue
        own = cnt[inv]
        with np.errstate(divide="ignore", invalid="ignore"):
            a = block[rows, inv] / (own - 1)
            block[rows, inv] = np.inf
            b = (block / cnt).min(axis=1)
            out[:, j] = np.nan_to_num(np.where(own > 1, (b - a) / np.maximum(a, b), 0.0))
    return out


def decision_support(
    per_point: np.ndarray,
    ks: Sequence[int],
    k: int,
    min_silhouette: float,
    seed: int,
    resamples: int = SUPPORT_RESAMPLES,
) -> tuple[float, float]:
    """(k_support, structure_support) of the decision ``k`` taken on the silhouette curve
    ``per_point.mean(axis=0)`` (columns: ``ks``; :func:`point_silhouettes`).

    ``resamples`` bootstrap resamples of the rows (the points) from
    ``numpy.random.default_rng([seed, SUPPORT])``, each point's silhouettes held fixed: each
    resample's curve is their mean over the resampled points, and its decision is taken as
    :func:`select_k` takes it (the k of the best silhouette, the smaller on a tie; 1 when that
    silhouette is below ``min_silhouette``). ``k_support`` is the share of resamples deciding
    ``k``, ``structure_support`` the share deciding k = 1 vs k ≥ 2 as ``k`` does. NaN for both
    when no column is finite.
    """
    per_point = np.asarray(per_point, dtype=np.float64)
    scored = np.isfinite(per_point).all(axis=0)
    if not scored.any() or resamples < 1:
        return float("nan"), float("nan")
    P, ks_s = per_point[:, scored], np.asarray(ks)[scored]
    n = len(P)
    rng = np.random.default_rng([int(seed) % 2**63, SUPPORT])
    weights = rng.multinomial(n, np.full(n, 1.0 / n), size=resamples).astype(np.float64)
    curves = weights @ P / n
    best = curves.argmax(axis=1)
    decided = np.where(curves[np.arange(resamples), best] < min_silhouette, 1, ks_s[best])
    return float(np.mean(decided == k)), float(np.mean((decided == 1) == (k == 1)))


def select_k(
    X: np.ndarray,
    k_max: int = K_MAX,
    min_silhouette: float = MIN_SILHOUETTE,
    *,
    n_init: int | None = None,
    max_iter: int = MAX_ITER,
    tol: float = TOL,
    seed: int = 0,
    silhouette_max_points: int | None = SILHOUETTE_MAX_POINTS,
    stability_seeds: int = STABILITY_SEEDS,
    groups: np.ndarray | None = None,
    map_fn: MapFn | None = None,
    parts: Sequence[Any] | None = None,
    n_partitions: int = 1,
    local_max_elements: int | None = LOCAL_FIT_MAX_ELEMENTS,
    local_dtype: type[np.floating] = LOCAL_DTYPE,
    map_fits: MapFits | None = None,
    shared: tuple[np.ndarray, np.ndarray] | None = None,
) -> SelectKResult:
    """Cai et al. (2021, Sec. 4)'s number of clusters: the best silhouette of a scan of k = 2..``k_max``.

    See the module docstring for the method. Args:
        X: (n, d) points (one row per sampled occurrence).
        k_max: the largest k fitted (the k of :func:`scan_ks` up to min(k_max, n − 1) are).
        min_silhouette: below this best silhouette, k = 1 (one cluster, centre = mean).
        n_init: k-means++ seedings per k ≤ 15 and warm starts per k after the first (the
            partitioned route: k-means|| initialisations per k); the lowest inertia wins.
            None: :func:`default_n_init` (3 for a scan above k = 15 in one process, else 10).
        max_iter, tol: Lloyd's iteration limit and scikit-learn's relative tolerance.
        seed: all randomness (seedings, silhouette subsample, resamples, refits) derives from it.
        silhouette_max_points: points the silhouettes are taken on (None: all).
        stability_seeds: refits of the best k for ``stability`` (0: none).
        groups: (n,) keys of the rows' content (the sample's content keys): rows with equal
            keys are one point; None: rows are one point when bit-identical
            (:func:`~embgeom_ray.core.distinct.distinct_rows`). Not with ``parts``: the caller
            de-duplicates before partitioning.
        map_fn, parts, n_partitions: the partitioned route (:func:`~embgeom_ray.core.kmeans.fit`),
            taken when either is given or n·d > ``local_max_elements`` (None: always).
        local_dtype: the dtype of the one-process fits' distances.
        map_fits: where the one-process seedings' fits run (:data:`MapFits`; default
            :func:`serial_fits`): the result is the same wherever they run, provided each runs
            with the same threads. The warm starts run here.
        shared: (Gram matrix, Euclidean distances) of the centred distinct points, when
            already computed (:func:`distinct_distances`; the sampled metrics read the same
            distances).

    Returns:
        :class:`SelectKResult` with labels per input row.
    """
    X = np.asarray(X, dtype=np.float64)
    if stability_seeds < 0:
        raise ValueError(f"stability_seeds must be >= 0, got {stability_seeds}")
    if n_init is not None and n_init < 1:
        raise ValueError(f"n_init must be >= 1, got {n_init}")
    X, inverse = (X, None) if parts is not None or X.ndim != 2 else _distinct_points(X, groups)
    n = len(X)
    local = (
        map_fn is None
        and parts is None
        and local_max_elements is not None
        and X.ndim == 2
        and X.size <= local_max_elements
    )
    if parts is None:
        shift = X.mean(axis=0)
        Xc = X - shift
        parts = [] if local else partition(Xc, n_partitions)
    else:
        shift, Xc = np.zeros(X.shape[1]), X
    top = min(int(k_max), n - 1)
    ks = scan_ks(top)
    n_init = default_n_init(top, local) if n_init is None else int(n_init)
    idx = silhouette_subsample(n, silhouette_max_points, seed)
    if shared is not None and local and len(idx) == n:
        gram, dist = shared
    else:
        gram = Xc @ Xc.T if local and len(idx) == n and ks else None
        dist = _distances(Xc, idx, gram) if len(idx) >= 3 and ks else None
    trials = chain_trials(top)
    fit = partial(fit_many, max_iter=max_iter, tol=tol, dtype=local_dtype)
    map_fits = map_fits or serial_fits
    if local:
        sqd = SquaredDistances(Xc, gram)
        fits = _local_scan(
            Xc, sqd, ks, n_init, seed, trials, fit, map_fits, max_iter, tol, local_dtype
        )
    else:
        jobs = [((int(seed) % 2**63, c), k) for k in ks for c in range(n_init)]
        fits = _lowest_inertia(
            jobs,
            [
                fit_partitioned(Xc, k, 1, max_iter, tol, _int_seed(s), map_fn, parts=parts)
                for s, k in jobs
            ],
        )
    scanned = sorted(fits)
    per_point = (
        point_silhouettes(dist, [fits[k].labels[idx] for k in scanned])
        if dist is not None
        else None
    )
    sil = {
        k: float(per_point[:, j].mean()) if per_point is not None else float("nan")
        for j, k in enumerate(scanned)
    }
    best_k, best_s = _best_silhouette(sil)
    chosen = 1 if best_k is None or best_s < min_silhouette else best_k
    extra: dict[str, Any] = {
        "k_searched": max(fits, default=1),
        "n_distinct": n,
        "partitions": {k: fits[k].labels.astype(np.int32) for k in scanned},
    }
    if best_k is not None:
        best_labels = fits[best_k].labels
        at_cap = best_k == extra["k_searched"]
        extra |= {"best_k": best_k, "best_labels": best_labels, "at_cap": at_cap}
        support = decision_support(per_point, scanned, chosen, min_silhouette, seed)
        extra |= {"k_support": support[0], "structure_support": support[1]}
        if stability_seeds:
            seeds = [stability_seed(seed, r) for r in range(1, stability_seeds + 1)]
            if local:
                chains = [plus_plus(sqd, best_k, s, trials) for s in seeds]
                refits = map_fits(fit, Xc, chains, initial=False)
            else:
                refits = [
                    fit_partitioned(Xc, best_k, 1, max_iter, tol, _int_seed(s), map_fn, parts=parts)
                    for s in seeds
                ]
            extra["stability"] = _stability(best_labels, refits)
    inertias = {k: r.inertia for k, r in fits.items()}
    if chosen == 1:
        center = Xc.mean(axis=0, keepdims=True)
        inertia = float(((Xc - center) ** 2).sum())
        out = SelectKResult(
            1, best_s, center + shift, np.zeros(n, np.int64), inertia, sil, inertias, **extra
        )
    else:
        r = fits[best_k]
        out = SelectKResult(
            best_k, best_s, r.centers + shift, r.labels, r.inertia, sil, inertias, **extra
        )
    return out if inverse is None else out.expanded(inverse)


def _distinct_points(
    X: np.ndarray, groups: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """X's distinct points (:func:`distinct_rows` with ``groups``) and each row's point: X
    and None when every row is its own point."""
    first, inverse = distinct_rows(X, groups)
    return (X[first], inverse) if len(first) < len(X) else (X, None)


def distinct_distances(
    X: np.ndarray, groups: np.ndarray | None, max_points: int | None
) -> tuple[np.ndarray, np.ndarray] | None:
    """(Gram matrix, Euclidean distances) of the distinct points of X (:func:`distinct_rows`
    with ``groups``) centred on their mean, as :func:`select_k` and
    :func:`~embgeom_ray.core.sampled_metrics.sampled_metrics_of_points` compute them (the
    distances equal ``sklearn.metrics.pairwise_distances``'); None when there are more than
    ``max_points`` of them (the silhouettes then take a subsample) or fewer than 3."""
    Xd, _ = _distinct_points(np.asarray(X, dtype=np.float64), groups)
    if max_points is None or not 3 <= len(Xd) <= max_points:
        return None
    Xc = Xd - Xd.mean(axis=0)
    gram = Xc @ Xc.T
    return gram, _distances(Xc, np.arange(len(Xc)), gram)


def _distances(Xc: np.ndarray, idx: np.ndarray, gram: np.ndarray | None) -> np.ndarray:
    """Euclidean distances between the points ``idx`` of Xc, as
    ``sklearn.metrics.pairwise_distances`` computes them (√ of ‖x‖² + ‖y‖² − 2 x·y clipped at
    0, a zero diagonal), from ``gram`` (Xc Xcᵀ) when it covers every point."""
    if gram is None:
        from sklearn.metrics import pairwise_distances

        return pairwise_distances(Xc[idx])
    sq = np.einsum("ij,ij->i", Xc, Xc)  # scikit-learn's row_norms(Xc, squared=True)
    D = -2.0 * gram
    D += sq[:, None]
    D += sq[None, :]
    np.maximum(D, 0.0, out=D)
    np.fill_diagonal(D, 0.0)
    return np.sqrt(D, out=D)


def _local_scan(
    Xc: np.ndarray,
    sqd: SquaredDistances,
    ks: Sequence[int],
    n_init: int,
    seed: int,
    trials: int,
    fit: FitMany,
    map_fits: MapFits,
    max_iter: int,
    tol: float,
    dtype: type[np.floating],
) -> dict[int, KMeansResult]:
    """Per k of ``ks``, in order, the lowest-inertia fit of its warm starts (every k after the
    first) and of its seedings (k ≤ :data:`K_DENSE`); then, k in reverse, of the next k's
    partition less its cheapest centres (see the module docstring)."""
    dense = [k for k in ks if k <= K_DENSE]
    top = max(dense, default=0)
    chains = [plus_plus(sqd, top, (int(seed) % 2**63, c), trials) for c in range(n_init)]
    points = Points(Xc, dtype, sqd.gram)
    # every seeding of every k at once (they depend on the chains alone): their Lloyd steps
    # share one product with the points
    seeds = [(k, ch[:k]) for k in dense for ch in chains]
    seeded = map_fits(fit, points, [ids for _, ids in seeds], initial=True) if seeds else []
    fits: dict[int, KMeansResult] = {}
    prev: KMeansResult | None = None
    for k in ks:
        if prev is not None and k > prev.k:
            starts = _warm_starts(Xc, sqd, prev, k, n_init, seed, trials)
            warm = lloyd_many(points, starts, max_iter=max_iter, tol=tol)
            fits = _lowest_inertia([(None, k)] * len(warm), warm, fits)
        mine = [res for (j, _), res in zip(seeds, seeded, strict=True) if j == k]
        fits = _lowest_inertia([(None, k)] * len(mine), mine, fits)
        prev = fits.get(k, prev)
    for k, above in reversed(list(pairwise(ks))):
        if above in fits and fits[above].k > k:
            start = _merged_start(points, fits[above], k)
            down = lloyd_many(points, [start], max_iter=max_iter, tol=tol)
            fits = _lowest_inertia([(None, k)], down, fits)
    return fits


def _merged_start(points: Points, fit: KMeansResult, k: int) -> Start:
    """A warm start of k clusters from ``fit``: its centres less the fit.k − k whose points
    would cost least to give to their next-nearest centres (Σ over their points of the rise in
    squared distance), each point given to its nearest centre left, and their means."""
    C = fit.centers
    d2 = points.sq_norms[:, None] - 2.0 * (points.X @ C.T) + np.einsum("ij,ij->i", C, C)[None, :]
    two = np.partition(d2, 1, axis=1)[:, :2]
    rise = np.bincount(fit.labels, weights=two[:, 1] - two[:, 0], minlength=fit.k)
    keep = np.sort(np.argsort(rise, kind="stable")[fit.k - k :])
    labels = canonical(d2[:, keep].argmin(axis=1), k)
    sums = cluster_sums(points.X, labels, k)
    cnt = np.bincount(labels, minlength=k).astype(np.float64)
    return Start(sums / cnt[:, None], labels, sums, sums @ points.X.T)


def _warm_starts(
    Xc: np.ndarray,
    sqd: SquaredDistances,
    prev: KMeansResult,
    k: int,
    n_init: int,
    seed: int,
    trials: int,
) -> list[Start]:
    """``n_init`` starts of k centres: ``prev``'s centres, and k − prev.k more by greedy
    k-means++ (:func:`plus_plus`) from each point's D² to its centre in ``prev``; start j
    from ``default_rng([seed, WARM, k, j])``. Each carries ``prev``'s labels, sums and the
    products of every point with them."""
    sums = cluster_sums(Xc, prev.labels, prev.k)
    dots = sums @ Xc.T
    cnt = np.bincount(prev.labels, minlength=prev.k).astype(np.float64)
    rows = np.arange(len(Xc))
    own = dots[prev.labels, rows] / cnt[prev.labels]
    sq = np.einsum("ij,ij->i", sums, sums) / (cnt * cnt)
    d2 = np.maximum(sqd.sq_norms - 2.0 * own + sq[prev.labels], 0.0)
    starts = []
    for j in range(n_init):
        new = plus_plus(sqd, k - prev.k, (int(seed) % 2**63, WARM, k, j), trials, d2)
        starts.append(Start(np.vstack([prev.centers, Xc[new]]), prev.labels, sums, dots))
    return starts


def _lowest_inertia(
    jobs: Sequence[tuple[Any, int]],
    results: Sequence[KMeansResult],
    fits: dict[int, KMeansResult] | None = None,
) -> dict[int, KMeansResult]:
    """Per k of ``jobs`` (in their order), the fit of lowest inertia among its fits (the
    first on a tie), after those already in ``fits``."""
    fits = {} if fits is None else fits
    for (_, k), res in zip(jobs, results, strict=True):
        if k not in fits or res.inertia < fits[k].inertia:
            fits[k] = res
    return fits


def _best_silhouette(sil: dict[int, float]) -> tuple[int | None, float]:
    """k* = argmax of the finite silhouettes (the smaller k on a tie) and s(k*); (None, NaN)
    when none is finite."""
    scored = {k: s for k, s in sil.items() if np.isfinite(s)}
    best_k = max(scored, key=lambda k: (scored[k], -k)) if scored else None
    return best_k, scored[best_k] if best_k is not None else float("nan")


def _stability(labels: np.ndarray, refits: Sequence[KMeansResult]) -> float:
    """Mean adjusted Rand index (Hubert & Arabie 1985) between ``labels`` and each refit's."""
    return float(np.mean([adjusted_rand_index(labels, f.labels) for f in refits]))


def adjusted_rand_index(a: np.ndarray, b: np.ndarray) -> float:
    """The adjusted Rand index (Hubert & Arabie 1985) of two labellings of the same points.

    From the pairs of points: tp together in both, fp together in b only, fn in a only, tn in
    neither; ARI = 2 (tp·tn − fn·fp) / ((tp + fn)(fn + tn) + (tp + fp)(fp + tn)), 1 where no
    pair disagrees. With the contingency table n_ij and its margins a_i, b_j of n points:
    tp = Σ n_ij² − n, fp = Σ b_j² − Σ n_ij², fn = Σ a_i² − Σ n_ij², tn = n² − the others
    (ordered pairs), in Python integers: ``sklearn.metrics.adjusted_rand_score``'s value, bit
    for bit, without importing scikit-learn (~1.2 s of a sampled-stage worker's start).
    """
    a, b = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"two labellings of the same points, got {a.shape} and {b.shape}")
    n = len(a)
    ia = np.unique(a, return_inverse=True)[1].reshape(-1)
    ib = np.unique(b, return_inverse=True)[1].reshape(-1)
    width = int(ib.max()) + 1 if n else 1
    cells = np.bincount(ia * width + ib).astype(np.int64)
    squares = int((cells * cells).sum())
    sq_a = int((np.bincount(ia).astype(np.int64) ** 2).sum())
    sq_b = int((np.bincount(ib).astype(np.int64) ** 2).sum())
    tp, fp, fn = squares - n, sq_b - squares, sq_a - squares
    tn = n * n - fp - fn - squares
    if fn == 0 and fp == 0:
        return 1.0
    return 2.0 * (tp * tn - fn * fp) / ((tp + fn) * (fn + tn) + (tp + fp) * (fp + tn))
