"""Engine-agnostic K-means in numpy float64: k-means|| initialisation, Lloyd on partitions.

Every pass over the data is a *map* of a pure function over partitions of the points
followed by a small reduce on the driver, so the same code runs serially (the default
``map_fn``) or distributed (:mod:`embgeom_ray.distributed.kmeans` passes a Ray-backed ``map_fn`` and
partitions held in Ray's object store):

- k-means|| (Bahmani, Moseley, Vattani, Kumar & Vassilvitskii 2012): start from one uniformly
  random point; for ``rounds`` rounds sample every point x independently with probability
  min(1, ℓ d²(x, C) / φ_X(C)), φ_X(C) = Σ_x d²(x, C), and add the sampled points to C; weight
  each candidate c by the number of points closest to it; reduce the weighted candidates to k
  centres with weighted k-means++ (Arthur & Vassilvitskii 2007), refined by weighted Lloyd on
  the candidates (as Spark MLlib does). Default ℓ = 2k, 5 rounds.
- Lloyd (1982): each partition returns per-centre sums, counts and its inertia
  (:func:`lloyd_partial`); :func:`combine_partials` adds them; new centre = sum / count (an
  empty cluster keeps its centre). Stop when Σ_c ||c_new − c_old||² ≤ tol · mean_j Var(X_j)
  (scikit-learn's convention) or after ``max_iter`` iterations; a final assignment pass gives
  labels and inertia Σ_x min_c ||x − c||² for the returned centres.

The Bernoulli sampling of k-means|| is made independent of the partitioning: point i (global
index) draws u_i ~ U(0, 1] from a generator seeded per round, and is sampled iff
u_i φ ≤ ℓ d²(x_i, C). A partition does not know φ, but φ ≥ its own cost φ_p, so it returns the
superset u_i φ_p ≤ ℓ d²(x_i, C) (about ℓ points) and the driver applies the global φ.

This is the route of samples too large for one process; the model selection over k
(:mod:`embgeom_ray.core.kmeans_selection`) fits ordinary samples in one process from k-means++
chains.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from typing import Any, NamedTuple

import numpy as np

#: Lloyd's iteration limit and relative tolerance (scikit-learn's defaults)
MAX_ITER, TOL = 300, 1e-4

MapFn = Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]]


class Partition(NamedTuple):
    """A contiguous block of rows: ``X`` = rows ``offset .. offset + len(X)`` of the data."""

    offset: int
    X: np.ndarray


@dataclass
class KMeansResult:
    """A K-means fit: centres (k, d), labels (n,), inertia Σ min_c ||x − c||², iterations."""

    centers: np.ndarray
    labels: np.ndarray
    inertia: float
    n_iter: int

    @property
    def k(self) -> int:
        return int(self.centers.shape[0])


def serial_map(fn: Callable[[Any], Any], parts: Sequence[Any]) -> list[Any]:
    """The default ``map_fn``: ``[fn(p) for p in parts]`` in this process."""
    return [fn(p) for p in parts]


def partition(X: np.ndarray, n_parts: int) -> list[Partition]:
    """Split rows of ``X`` into ``n_parts`` (≥ 1, at most n) contiguous :class:`Partition`."""
    n = len(X)
    n_parts = max(1, min(int(n_parts), max(n, 1)))
    bounds = np.linspace(0, n, n_parts + 1).astype(np.int64)
    return [Partition(int(a), X[a:b]) for a, b in pairwise(bounds.tolist())]


def sq_distances(X: np.ndarray, centers: np.ndarray) -> np.ndarray:
    """(n, k) squared Euclidean distances ||x||² − 2 x·c + ||c||², clipped at 0 (float64)."""
    xx = np.einsum("nd,nd->n", X, X)[:, None]
    cc = np.einsum("kd,kd->k", centers, centers)[None, :]
    return np.maximum(xx - 2.0 * (X @ centers.T) + cc, 0.0)


def lloyd_partial(X_part: np.ndarray, centers: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """One partition's Lloyd step: (sums (k, d), counts (k,), inertia).

    With a(x) = argmin_c ||x − c||²: sums_c = Σ_{a(x)=c} x, counts_c = #{x: a(x) = c},
    inertia = Σ_x ||x − c_{a(x)}||² for the given ``centers``.
    """
    X_part = np.asarray(X_part, dtype=np.float64)
    k = centers.shape[0]
    if len(X_part) == 0:
        return np.zeros_like(centers, dtype=np.float64), np.zeros(k, np.int64), 0.0
    d2 = sq_distances(X_part, centers)
    lab = d2.argmin(axis=1)
    onehot = np.zeros((len(X_part), k))
    onehot[np.arange(len(X_part)), lab] = 1.0
    return onehot.T @ X_part, np.bincount(lab, minlength=k), float(d2.min(axis=1).sum())


def combine_partials(
    partials: Iterable[tuple[np.ndarray, np.ndarray, float]],
) -> tuple[np.ndarray, np.ndarray, float]:
    """Reduce :func:`lloyd_partial` results: sums, counts and inertias add."""
    partials = list(partials)
    sums = np.sum([p[0] for p in partials], axis=0)
    counts = np.sum([p[1] for p in partials], axis=0)
    return sums, counts, float(sum(p[2] for p in partials))


# -------------------------------------------------------------- partition steps
def _init_step(part: Partition, centers: np.ndarray, ell: float, seed: int, n_total: int):
    """k-means|| round on a partition: (cost φ_p, candidate points, their ℓ d²/u)."""
    X = np.asarray(part.X, dtype=np.float64)
    d2 = sq_distances(X, centers).min(axis=1)
    cost = float(d2.sum())
    u = 1.0 - np.random.default_rng(seed).random(n_total)[part.offset : part.offset + len(X)]
    sel = u * cost <= ell * d2
    sel &= d2 > 0
    return cost, X[sel], ell * d2[sel] / u[sel]


def _nearest_counts(part: Partition, centers: np.ndarray) -> np.ndarray:
    X = np.asarray(part.X, dtype=np.float64)
    if len(X) == 0:
        return np.zeros(len(centers), np.int64)
    return np.bincount(sq_distances(X, centers).argmin(axis=1), minlength=len(centers))


def _lloyd_step(part: Partition, centers: np.ndarray):
    return lloyd_partial(part.X, centers)


def _assign(part: Partition, centers: np.ndarray) -> tuple[np.ndarray, float]:
    X = np.asarray(part.X, dtype=np.float64)
    if len(X) == 0:
        return np.zeros(0, np.int64), 0.0
    d2 = sq_distances(X, centers)
    lab = d2.argmin(axis=1)
    return lab, float(d2[np.arange(len(X)), lab].sum())


# ----------------------------------------------------------- initialisation
def _weighted_kmeanspp(
    C: np.ndarray, w: np.ndarray, k: int, rng: np.random.Generator
) -> np.ndarray:
    """Greedy k-means++ seeding on weighted points (Arthur & Vassilvitskii 2007).

    First centre drawn ∝ w_c; then each step draws 2 + ⌊ln k⌋ trials ∝ w_c d²(c, chosen) and
    keeps the trial that most lowers Σ_c w_c d²(c, chosen) (the greedy variant scikit-learn uses).
    """
    w = np.asarray(w, dtype=np.float64)
    n = len(C)
    p = w / w.sum() if w.sum() > 0 else np.full(n, 1.0 / n)
    idx = [int(rng.choice(n, p=p))]
    d2 = sq_distances(C, C[idx]).min(axis=1)
    trials = 2 + int(np.log(k))
    for _ in range(1, k):
        pot = w * d2
        if pot.sum() <= 0:  # fewer distinct candidates than k: any remaining one
            rest = np.setdiff1d(np.arange(n), idx)
            nxt = int(rng.choice(rest)) if len(rest) else int(rng.integers(n))
            d2 = np.minimum(d2, sq_distances(C, C[nxt : nxt + 1])[:, 0])
        else:
            cand = rng.choice(n, size=trials, p=pot / pot.sum())
            new_d2 = np.minimum(d2[None, :], sq_distances(C[cand], C))
            best = int((new_d2 * w).sum(axis=1).argmin())
            nxt, d2 = int(cand[best]), new_d2[best]
        idx.append(nxt)
    return C[idx].copy()


def _weighted_lloyd(
    C: np.ndarray, w: np.ndarray, centers: np.ndarray, max_iter: int = 100
) -> np.ndarray:
    """Lloyd on the weighted candidates (local and cheap: ~ℓ·rounds points)."""
    centers = centers.copy()
    for _ in range(max_iter):
        lab = sq_distances(C, centers).argmin(axis=1)
        mass = np.bincount(lab, weights=w, minlength=len(centers))
        onehot = np.zeros((len(C), len(centers)))
        onehot[np.arange(len(C)), lab] = w
        sums = onehot.T @ C
        new = np.where(mass[:, None] > 0, sums / np.maximum(mass, 1e-300)[:, None], centers)
        if np.array_equal(new, centers):
            break
        centers = new
    return centers


def kmeans_parallel_init(
    X: np.ndarray,
    k: int,
    rng: np.random.Generator,
    oversampling: float | None = None,
    rounds: int = 5,
    *,
    map_fn: MapFn | None = None,
    parts: Sequence[Any] | None = None,
) -> np.ndarray:
    """k-means|| initial centres (k, d) (Bahmani et al. 2012; see the module docstring).

    Args:
        X: (n, d) points; the driver draws the first centre from it.
        k: number of centres.
        rng: numpy generator (all randomness comes from it).
        oversampling: ℓ, expected points sampled per round (default 2k).
        rounds: sampling rounds (the paper finds 5 enough; O(log φ) in theory).
        map_fn, parts: how distance passes run (default: serial over one partition of X);
            ``parts`` must hold :class:`Partition` of the same rows as ``X``.
    """
    X = np.asarray(X, dtype=np.float64)
    n = len(X)
    if not 1 <= k <= n:
        raise ValueError(f"k must be in 1..{n} (the number of points), got {k}")
    map_fn = map_fn or serial_map
    parts = parts if parts is not None else [Partition(0, X)]
    ell = float(2 * k if oversampling is None else oversampling)
    C = X[[int(rng.integers(n))]]
    for _ in range(rounds):
        seed = int(rng.integers(2**63))
        res = map_fn(partial(_init_step, centers=C, ell=ell, seed=seed, n_total=n), parts)
        phi = sum(r[0] for r in res)
        if phi <= 0:
            break
        new = [r[1][r[2] >= phi] for r in res]
        C = np.vstack([C, *new])
    if len(C) < k:  # degenerate data: too few candidates, add random points
        extra = rng.choice(n, size=k - len(C), replace=False)
        C = np.vstack([C, X[extra]])
    if len(C) == k:
        return C.copy()
    w = np.sum(map_fn(partial(_nearest_counts, centers=C), parts), axis=0).astype(np.float64)
    return _weighted_lloyd(C, w, _weighted_kmeanspp(C, w, k, rng))


# ------------------------------------------------------------------ fitting
def _lloyd(
    X: np.ndarray,
    centers: np.ndarray,
    max_iter: int,
    tol_abs: float,
    map_fn: MapFn,
    parts: Sequence[Any],
) -> KMeansResult:
    n_iter = 0
    for n_iter in range(1, max_iter + 1):  # noqa: B007 (n_iter is returned)
        sums, counts, _ = combine_partials(map_fn(partial(_lloyd_step, centers=centers), parts))
        new = np.where(counts[:, None] > 0, sums / np.maximum(counts, 1)[:, None], centers)
        shift = float(((new - centers) ** 2).sum())
        centers = new
        if shift <= tol_abs:
            break
    res = map_fn(partial(_assign, centers=centers), parts)
    labels = np.concatenate([r[0] for r in res]) if res else np.zeros(0, np.int64)
    return KMeansResult(centers, labels, float(sum(r[1] for r in res)), n_iter)


def fit(
    X: np.ndarray,
    k: int,
    n_init: int = 1,
    max_iter: int = MAX_ITER,
    tol: float = TOL,
    seed: int = 0,
    map_fn: MapFn | None = None,
    *,
    parts: Sequence[Any] | None = None,
    n_partitions: int = 1,
    oversampling: float | None = None,
    rounds: int = 5,
) -> KMeansResult:
    """K-means with k-means|| initialisation; the best of ``n_init`` runs by inertia.

    Args:
        X: (n, d) points (float64 on the driver).
        k: clusters (1 ≤ k ≤ n).
        n_init: independent initialisations (each k-means|| + Lloyd); the lowest inertia wins.
        max_iter: Lloyd iterations per run.
        tol: stop when Σ_c ||Δc||² ≤ tol · mean_j Var(X_j) (scikit-learn's relative tolerance).
        seed: all randomness derives from ``numpy.random.default_rng(seed)``.
        map_fn: ``map_fn(fn, parts) -> [fn(p) for p in parts]``, computed anywhere (default
            :func:`serial_map`); the Ray layer passes a Ray-backed map.
        parts: partitions as ``map_fn`` understands them (e.g. Ray object refs to
            :class:`Partition`), holding exactly the rows of ``X`` in order. Default: ``X``
            centred on its mean (better conditioned distances) split into ``n_partitions``.
        n_partitions: partitions built when ``parts`` is None.
        oversampling, rounds: k-means|| parameters (:func:`kmeans_parallel_init`).

    Returns:
        :class:`KMeansResult` in the coordinates of ``X``; labels follow ``parts``' order.
    """
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2 or len(X) == 0:
        raise ValueError(f"X must be a non-empty (n, d) array, got shape {X.shape}")
    if not np.isfinite(X).all():
        raise ValueError("X has non-finite values")
    if n_init < 1:
        raise ValueError(f"n_init must be >= 1, got {n_init}")
    shift = np.zeros(X.shape[1])
    if parts is None:
        shift = X.mean(axis=0)
        X = X - shift
        parts = partition(X, n_partitions)
    map_fn = map_fn or serial_map
    tol_abs = float(tol * X.var(axis=0).mean())
    rng = np.random.default_rng(seed)
    best: KMeansResult | None = None
    for _ in range(n_init):
        init = kmeans_parallel_init(X, k, rng, oversampling, rounds, map_fn=map_fn, parts=parts)
        res = _lloyd(X, init, max_iter, tol_abs, map_fn, parts)
        if best is None or res.inertia < best.inertia:
            best = res
    assert best is not None
    best.centers = best.centers + shift
    return best
