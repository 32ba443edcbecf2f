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
- Model selection (Cai et al. 2021, Sec. 4): :func:`select_k` fits k = 2..15 and keeps the k of
  best silhouette (Rousseeuw 1987); k = 1 when that silhouette is below 0.1. While the best k is
  the largest one tried, the range grows geometrically (15 → 30 → 60: k = 16..30, then 31..60)
  up to a cap (:data:`K_CAP`), so a reported k is an interior optimum of the silhouette or is
  flagged as sitting at the cap (``at_cap``). A stability check refits the best k with other
  seeds and reports the mean adjusted Rand index (Hubert & Arabie 1985) with the reported
  clustering. Exact duplicate points are fitted once (:func:`distinct_rows`): a point repeated
  27 times by repeated text is one point of the set, not 27 (each copy gets its point's label).

The Bernoulli sampling of k-means|| is made independent of the partitioning: point i (global
index) draws u_i ~ U(0, 1] from a generator seeded per round, and is sampled iff
u_i φ ≤ ℓ d²(x_i, C). A partition does not know φ, but φ ≥ its own cost φ_p, so it returns the
superset u_i φ_p ≤ ℓ d²(x_i, C) (about ℓ points) and the driver applies the global φ.

Small samples take another route. A sample of n·d ≤ :data:`LOCAL_FIT_MAX_ELEMENTS` numbers
(4096 points up to d = 8192, 256 MiB in float64: the job's default sample of any model up to
that width) fits one worker comfortably, and there one process running scikit-learn's
``KMeans`` (k-means++ initialisation, Lloyd in Cython; :func:`fit_local`) is many times faster
than a map of tiny passes. :func:`select_k` routes by that size. Both routes centre the points
in float64 and score every k with the same function of the same float64 distance matrix
(:func:`silhouette_from_distances`); :func:`select_k` runs the small route's Lloyd iterations
in float32 (the activations are float32 to begin with; the returned inertia is recomputed in
float64). Measured on MiniLM (7 layers, n = 4096, d = 384, k = 2..15, 3 initialisations, one
thread per layer on 2 CPUs): the same k and best silhouette on every layer as in float64, in
~4/5 of the time (13 s instead of 16.5 s).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import pairwise
from typing import Any, NamedTuple

import numpy as np

from ..config import JobConfig
from .kmeanspp import PlusPlus

_OPTIONS = JobConfig.model_fields
#: defaults of the model selection: the job's own option defaults (one home, JobConfig)
KS: range = range(2, _OPTIONS["kmeans_k_max"].default + 1)
K_CAP: int = _OPTIONS["kmeans_k_cap"].default
MIN_SILHOUETTE: float = _OPTIONS["kmeans_min_silhouette"].default
N_INIT: int = _OPTIONS["kmeans_n_init"].default
STABILITY_SEEDS: int = _OPTIONS["kmeans_stability_seeds"].default
SILHOUETTE_MAX_POINTS: int = _OPTIONS["silhouette_max_points"].default
#: dtype of the one-process fits' Lloyd iterations (:func:`select_k`; see the module docstring)
LOCAL_DTYPE: type[np.floating] = np.float32
#: Lloyd's iteration limit and relative tolerance (scikit-learn's defaults; not options)
MAX_ITER, TOL = 300, 1e-4
#: samples with n·d at most this (4096 points × d = 8192, 256 MiB in float64) are fitted in one
#: process by :func:`fit_local`; larger ones by the partitioned k-means|| path (:func:`fit`).
LOCAL_FIT_MAX_ELEMENTS = 4096 * 8192

MapFn = Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]]
#: one K-means fit in one process: ``fit_one(X, k, seed=seed)`` (:func:`fit_local` with the
#: search's ``n_init``, ``max_iter``, ``tol`` and dtype bound)
FitOne = Callable[..., "KMeansResult"]
#: how the one-process fits of one step of :func:`select_k` run: ``map_fits(fit_one, X, specs,
#: initial=...)`` returns ``[fit_one(X, k, seed=s) for k, s in specs]``, in that order, computed
#: anywhere (default :func:`serial_fits`; the Ray layer spreads them over tasks). ``initial``
#: is True for the first range's fits, False for a grown range's and the stability refits.
MapFits = Callable[..., list["KMeansResult"]]


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


@dataclass
class SelectKResult:
    """Cai et al.'s model selection on one point set.

    ``k`` the chosen number of clusters (1 when the best silhouette < ``min_silhouette``);
    ``silhouette`` the best silhouette over the k tried (reported even when k = 1 is chosen;
    NaN when no k could be scored); ``centers``/``labels``/``inertia`` of the chosen k;
    ``silhouettes``/``inertias`` per k tried. ``labels`` has one entry per input row (copies of
    a point share its label); centres, inertias and silhouettes are those of the fits on the
    ``n_distinct`` distinct points.

    ``best_k`` is the k of best silhouette (= ``k`` unless k = 1 was chosen; 1 when no k
    could be scored) and ``best_labels`` its labels (per input row); ``k_searched`` the largest
    k tried (k = 2..``k_searched``; 1 when none could be); ``at_cap`` whether ``best_k`` is that
    largest k and the search could not grow past it (the cap, or n − 1): then the silhouette
    has no interior optimum in the range searched. ``stability`` the mean adjusted Rand index
    between ``best_labels`` and refits of ``best_k`` with other seeds (1: the same partition
    every time; ~0: chance agreement; NaN when not checked).
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


def distinct_rows(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first, inverse): the rows of X that are not exact copies of an earlier row, and the map.

    ``first`` (ascending) indexes the first occurrence of each distinct row, so ``X[first]``
    keeps the input order (and is X itself when no row repeats); ``inverse[i]`` is the position
    in ``X[first]`` of row i's point, so ``X[first][inverse]`` equals X. Rows are equal when
    ``np.unique(X, axis=0)`` finds them equal (every coordinate equal).
    """
    X = np.asarray(X)
    if X.ndim != 2:
        raise ValueError(f"X must be an (n, d) array, got shape {X.shape}")
    if len(X) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    _, first, inverse = np.unique(X, axis=0, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    return first[order].astype(np.int64), rank[np.asarray(inverse).reshape(-1)]


def stability_seed(seed: int, replicate: int) -> int:
    """The seed of the ``replicate``-th refit (1, 2, ...): a 32-bit word of SeedSequence([seed, r])."""
    return int(np.random.SeedSequence([int(seed) % 2**63, int(replicate)]).generate_state(1)[0])


def serial_map(fn: Callable[[Any], Any], parts: Sequence[Any]) -> list[Any]:
    """The default ``map_fn``: ``[fn(p) for p in parts]`` in this process."""
    return [fn(p) for p in parts]


def serial_fits(
    fit_one: FitOne, X: np.ndarray, specs: Sequence[tuple[int, int]], *, initial: bool = True
) -> list[KMeansResult]:
    """The default ``map_fits`` of :func:`select_k`: ``[fit_one(X, k, seed=s) for k, s in specs]``."""
    return [fit_one(X, k, seed=s) for k, s in specs]


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
    n_init: int = N_INIT,
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


def _sklearn_seed(seed: int) -> int:
    """``seed`` as scikit-learn's ``random_state`` (0 ≤ seed < 2³²; larger ones are hashed)."""
    seed = int(seed)
    if 0 <= seed < 2**32:
        return seed
    return int(np.random.default_rng(seed).integers(2**32))


def fit_local(
    X: np.ndarray,
    k: int,
    n_init: int = N_INIT,
    max_iter: int = MAX_ITER,
    tol: float = TOL,
    seed: int = 0,
    *,
    dtype: type[np.floating] = np.float64,
) -> KMeansResult:
    """K-means in this process: ``sklearn.cluster.KMeans`` (k-means++, Lloyd); best of ``n_init``.

    ``KMeans(n_clusters=k, init="k-means++", n_init=n_init, max_iter=max_iter, tol=tol,
    random_state=seed, algorithm="lloyd")`` on ``X`` cast to ``dtype``: greedy k-means++ seeding
    (Arthur & Vassilvitskii 2007; for float32 through :class:`~embgeom_ray.core.kmeanspp.PlusPlus`,
    the same centres with the points' float64 copy made once a fit instead of once a step) and Lloyd (1982) iterations until Σ_c ||Δc||² ≤ tol ·
    mean_j Var(X_j) (the same relative tolerance as :func:`fit`), the lowest inertia of
    ``n_init`` runs. Its OpenMP threads follow ``threadpoolctl`` limits (the Ray layer sets them).
    Returns centres (float64, coordinates of ``X``), labels, inertia Σ_x ||x − c_{a(x)}||² in
    float64 (recomputed from X when ``dtype`` is not float64) and Lloyd iterations of the best run.
    A fit that finds fewer than k distinct clusters (duplicate points) is returned as is, silently.
    """
    import warnings

    from sklearn.cluster import KMeans
    from sklearn.exceptions import ConvergenceWarning

    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2 or len(X) == 0:
        raise ValueError(f"X must be a non-empty (n, d) array, got shape {X.shape}")
    if not np.isfinite(X).all():
        raise ValueError("X has non-finite values")
    if not 1 <= k <= len(X):
        raise ValueError(f"k must be in 1..{len(X)} (the number of points), got {k}")
    if n_init < 1:
        raise ValueError(f"n_init must be >= 1, got {n_init}")
    model = KMeans(
        n_clusters=k,
        init=PlusPlus() if dtype == np.float32 else "k-means++",
        n_init=n_init,
        max_iter=max_iter,
        tol=tol,
        random_state=_sklearn_seed(seed),
        algorithm="lloyd",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(X if dtype == np.float64 else X.astype(dtype))
    centers = np.asarray(model.cluster_centers_, dtype=np.float64)
    labels = np.asarray(model.labels_, dtype=np.int64)
    if dtype == np.float64:
        inertia = float(model.inertia_)
    else:
        r = X - centers[labels]
        inertia = float(np.einsum("nd,nd->", r, r))
    return KMeansResult(centers, labels, inertia, int(model.n_iter_))


def silhouette_from_distances(D: np.ndarray, labels: np.ndarray) -> float:
    """Mean silhouette (Rousseeuw 1987) of ``labels`` from a precomputed distance matrix.

    D: (n, n) distances with a zero diagonal. With S_iC = Σ_{j ∈ C} D_ij, n_C the size of
    cluster C and c(i) the cluster of i: a_i = S_{i,c(i)} / (n_{c(i)} − 1), b_i =
    min_{C ≠ c(i)} S_iC / n_C, s_i = (b_i − a_i) / max(a_i, b_i) (0 for a singleton cluster);
    returns mean_i s_i. Equals ``sklearn.metrics.silhouette_score(D, labels,
    metric="precomputed")``, bit for bit: S is summed in the same order (a weighted
    ``bincount`` of each row by label), but over blocks of rows at once instead of one Python
    call per row (~2/3 of the time at n = 4096). Raises ValueError unless 2 ≤ #labels ≤ n − 1,
    as scikit-learn does.
    """
    D = np.asarray(D, dtype=np.float64)
    labels = np.asarray(labels)
    n = len(labels)
    if D.shape != (n, n) or labels.ndim != 1:
        raise ValueError(f"D must be (n, n) and labels (n,), got {D.shape} and {labels.shape}")
    _, lab, cnt = np.unique(labels, return_inverse=True, return_counts=True)
    lab = lab.reshape(-1)
    n_labels = len(cnt)
    if not 2 <= n_labels <= n - 1:
        raise ValueError(f"the silhouette needs 2 <= #labels <= n - 1, got {n_labels} of {n}")
    S = np.empty((n, n_labels))
    block = max(1, (1 << 20) // n)  # rows per bincount: ~1M distances
    for a in range(0, n, block):
        rows = D[a : a + block]
        flat = np.arange(len(rows))[:, None] * n_labels + lab[None, :]
        S[a : a + len(rows)] = np.bincount(
            flat.ravel(), weights=rows.ravel(), minlength=len(rows) * n_labels
        ).reshape(len(rows), n_labels)
    own = cnt[lab]
    idx = np.arange(n)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = S[idx, lab] / (own - 1)
        S[idx, lab] = np.inf
        b = (S / cnt).min(axis=1)
        s = (b - a) / np.maximum(a, b)
    return float(np.nan_to_num(s).mean())


def silhouette_subsample(n: int, max_points: int | None, seed: int) -> np.ndarray:
    """Sorted indices of at most ``max_points`` of n points (all if None or n ≤ max_points)."""
    if max_points is None or n <= max_points:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=max_points, replace=False))


def grown_ks(top: int, limit: int) -> range:
    """The next range searched when the best k is the largest tried, ``top``: top+1..min(2·top, limit)."""
    return range(top + 1, min(2 * top, limit) + 1)


def select_k(
    X: np.ndarray,
    ks: Iterable[int] = KS,
    min_silhouette: float = MIN_SILHOUETTE,
    *,
    k_cap: int = K_CAP,
    n_init: int = N_INIT,
    max_iter: int = MAX_ITER,
    tol: float = TOL,
    seed: int = 0,
    silhouette_max_points: int | None = SILHOUETTE_MAX_POINTS,
    stability_seeds: int = STABILITY_SEEDS,
    map_fn: MapFn | None = None,
    parts: Sequence[Any] | None = None,
    n_partitions: int = 1,
    local_max_elements: int | None = LOCAL_FIT_MAX_ELEMENTS,
    local_dtype: type[np.floating] = LOCAL_DTYPE,
    map_fits: MapFits | None = None,
) -> SelectKResult:
    """Cai et al. (2021, Sec. 4)'s number of clusters: best silhouette over ``ks``, grown to an optimum.

    For each k (2 ≤ k < n) fit K-means (see below) and score its labels with the mean
    silhouette s = mean_i (b_i − a_i) / max(a_i, b_i) (Rousseeuw 1987; a_i mean distance to
    the own cluster, b_i to the nearest other; = ``sklearn.metrics.silhouette_score``), on at
    most ``silhouette_max_points`` points drawn once with ``seed`` (the Euclidean distance
    matrix is computed once and shared by all k; :func:`silhouette_from_distances`). k* =
    argmax s (the smaller k on a tie). While k* is the largest k tried, K, and K < min(``k_cap``,
    n − 1), the range grows geometrically: k = K+1..min(2K, cap, n − 1) are fitted too
    (:func:`grown_ks`). So k* is an interior optimum of the range searched, or ``at_cap``. With
    an interior optimum in ``ks`` nothing more is fitted: the answer is that of ``ks`` alone. k =
    1 (one cluster: centre = mean) when s(k*) < ``min_silhouette``. Cai et al. use k = 2..15
    (``k_cap`` ≤ max(ks): no growth) and 0.1.

    Exact duplicate rows are fitted once (:func:`distinct_rows`; not when ``parts`` are given:
    the caller de-duplicates before partitioning), and the silhouette is taken over distinct
    points: copies of one point would sit at distance 0 from each other. Labels are returned per
    input row. ``stability_seeds`` > 0 refits k* that many times with seeds
    :func:`stability_seed` (same ``n_init``) and reports the mean adjusted Rand index
    (``sklearn.metrics.adjusted_rand_score``) between each refit's labels and k*'s.

    Which K-means: with neither ``map_fn`` nor ``parts`` given and n·d ≤ ``local_max_elements``
    (default :data:`LOCAL_FIT_MAX_ELEMENTS`; None: never), :func:`fit_local` (scikit-learn's
    KMeans, k-means++, in this process, on the centred X cast to ``local_dtype``: float32 by
    default, see the module docstring); otherwise :func:`fit`
    (k-means|| and Lloyd as a map over partitions: ``map_fn``/``parts``, or ``n_partitions``
    partitions of X mapped serially). Both take ``n_init``, ``max_iter``, ``tol`` and ``seed``;
    the fits differ only as two K-means runs with different random initialisations do.

    The fits of one step (the k of ``ks``; then of each grown range; then the stability
    refits) do not depend on each other: every k is fitted with ``seed``, each refit with its
    own. On the one-process route they run through ``map_fits`` (:data:`MapFits`; default
    :func:`serial_fits`, here, in order), which may spread them over processes
    (:class:`~embgeom_ray.distributed.kmeans.RayFits`): the result is the same whoever fits
    them, provided each fit runs with the same number of threads. The silhouettes are scored
    here, on the one distance matrix.
    """
    from sklearn.metrics import adjusted_rand_score, pairwise_distances

    X = np.asarray(X, dtype=np.float64)
    if stability_seeds < 0:
        raise ValueError(f"stability_seeds must be >= 0, got {stability_seeds}")
    inverse = None
    if parts is None and X.ndim == 2:
        first, inverse = distinct_rows(X)
        if len(first) < len(X):
            X = X[first]
        else:
            inverse = None
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
        parts = partition(Xc, n_partitions)
    else:
        shift, Xc = np.zeros(X.shape[1]), X
    idx = silhouette_subsample(n, silhouette_max_points, seed)
    dist = pairwise_distances(Xc[idx]) if len(idx) >= 3 else None

    fit_one = partial(fit_local, n_init=n_init, max_iter=max_iter, tol=tol, dtype=local_dtype)

    def fit_all(specs: list[tuple[int, int]], initial: bool) -> list[KMeansResult]:
        if local:
            return (map_fits or serial_fits)(fit_one, Xc, specs, initial=initial)
        return [fit(Xc, k, n_init, max_iter, tol, s, map_fn, parts=parts) for k, s in specs]

    fits: dict[int, KMeansResult] = {}
    sil: dict[int, float] = {}

    def search(k_range: Iterable[int], initial: bool = False) -> None:
        new = [k for k in sorted({int(k) for k in k_range}) if 2 <= k < n and k not in fits]
        for k, res in zip(new, fit_all([(k, seed) for k in new], initial), strict=True):
            fits[k] = res
            lab = res.labels[idx]
            n_lab = len(np.unique(lab))
            if dist is None or n_lab < 2 or n_lab >= len(idx):
                sil[k] = float("nan")
            else:
                sil[k] = silhouette_from_distances(dist, lab)

    ks = [int(k) for k in ks]
    search(ks, initial=True)
    limit = min(max(int(k_cap), *ks, 2), n - 1) if ks else 0
    while True:
        scored = {k: s for k, s in sil.items() if np.isfinite(s)}
        best_k = max(scored, key=lambda k: (scored[k], -k)) if scored else None
        top = max(fits, default=1)
        if best_k is None or best_k != top or top >= limit:
            break
        search(grown_ks(top, limit))
    best_s = scored[best_k] if best_k is not None else float("nan")
    inertias = {k: r.inertia for k, r in fits.items()}
    k_searched = max(fits, default=1)
    extra: dict[str, Any] = {"k_searched": k_searched, "n_distinct": n}
    if best_k is not None:
        best_labels = fits[best_k].labels
        extra |= {"best_k": best_k, "best_labels": best_labels}
        extra["at_cap"] = bool(best_k == k_searched and k_searched >= limit)
        if stability_seeds:
            specs = [(best_k, stability_seed(seed, r)) for r in range(1, stability_seeds + 1)]
            refits = fit_all(specs, initial=False)
            aris = [adjusted_rand_score(best_labels, f.labels) for f in refits]
            extra["stability"] = float(np.mean(aris))
    if best_k is None or best_s < min_silhouette:
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
