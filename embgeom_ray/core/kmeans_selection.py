"""Cai et al. (2021)'s number of clusters of a point set: a K-means scan of every k, scored by silhouette.

:func:`select_k` is a function of the point set and the seed alone: whatever the silhouettes
turn out to be, the same k are fitted and scored, every k = 2..15 and then a 10% grid up to
``k_max`` (:func:`scan_ks`), so the reported k never depends on where a search happened to
stop, and points that differ only by the forward's rounding (another batching of the same
corpus) give the same fits. How:

- **The point set** is the sample's distinct points (:func:`~embgeom_ray.core.distinct.distinct_rows`:
  one per content key, then one per bit pattern), centred on their float64 mean.
- **Initialisations** are greedy k-means++ *chains* (Arthur & Vassilvitskii 2007; the greedy
  variant of scikit-learn: each step draws ``trials`` candidates ∝ D² and keeps the one that
  lowers the potential most). With a fixed number of candidates per step, 2 + ⌊ln k_max⌋,
  the seeding of k centres is the first k centres of the seeding of k_max
  (:func:`plus_plus_chain`): one chain per initialisation seeds every k at the cost of one
  seeding of k_max. Chain c draws from ``numpy.random.default_rng([seed, c])``.
- **Each fit** is Lloyd (1982) from a chain's first k centres: scikit-learn's ``KMeans`` with
  that ``init`` and ``n_init=1`` (Lloyd in ``dtype``, float32 by default: the activations are
  float32 to begin with), stopped at scikit-learn's relative tolerance; its inertia
  Σ_x ||x − c(x)||² is recomputed in float64. Of a k's ``n_init`` chains the lowest inertia
  wins (:func:`fit_from_centres`).
- **The silhouette** (Rousseeuw 1987; :func:`silhouette_from_distances`) of each k's fit is
  taken on one Euclidean distance matrix of at most ``silhouette_max_points`` points drawn
  once with ``seed``. k* = argmax (the smaller k on a tie); k = 1 (one cluster) when
  s(k*) < ``min_silhouette`` (0.1, Cai et al.); ``at_cap`` when k* is the largest k scanned
  (the curve has no interior optimum within the scan). Cai et al. scan k = 2..15
  (``k_max=15``).
- **Stability**: ``stability_seeds`` more chains (seeds :func:`stability_seed`) are fitted at
  k*; ``stability`` is the mean adjusted Rand index (Hubert & Arabie 1985) between their
  partitions and the reported one (1: the same partition every time).

What repeats and near-repeats do to the silhouette: a clump of points that are nearly the
same (the same token in nearly the same context) sits at distance ~0 from itself, so a k large
enough to give each clump its own cluster scores a silhouette near 1 on those points. On a
sample with many such clumps the curve keeps rising with k; exact repeats are removed by the
distinct points, near-repeats are not (docs/outputs.md, "K-means").

Samples too large for one process (n·d > ``LOCAL_FIT_MAX_ELEMENTS``, or partitions given)
fit each k with k-means|| and Lloyd as a map over partitions
(:func:`embgeom_ray.core.kmeans.fit`) instead of chains; the scan and the scoring are the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .distinct import distinct_rows
from .kmeans import MAX_ITER, TOL, KMeansResult, MapFn, fit, partition
from .options import SampledOptions

_DEFAULTS = SampledOptions()
#: the largest k fitted (``kmeans_k_max``)
K_MAX: int = _DEFAULTS.kmeans_k_max
#: every k = 2..K_DENSE is fitted (Cai et al.'s range); above it the scan grows by K_GROWTH
K_DENSE = 15
#: the factor between consecutive k fitted above K_DENSE (:func:`scan_ks`)
K_GROWTH = 1.1
#: below this best silhouette, k = 1 (Cai et al. 2021; ``kmeans_min_silhouette``)
MIN_SILHOUETTE: float = _DEFAULTS.kmeans_min_silhouette
#: k-means++ chains (initialisations) per k; the lowest inertia wins (``kmeans_n_init``)
N_INIT: int = _DEFAULTS.kmeans_n_init
#: chains fitted at the chosen k for the stability check (``kmeans_stability_seeds``)
STABILITY_SEEDS: int = _DEFAULTS.kmeans_stability_seeds
#: points a silhouette is computed on, a subsample drawn once when there are more
#: (``silhouette_max_points``)
SILHOUETTE_MAX_POINTS: int = _DEFAULTS.silhouette_max_points
#: dtype of the one-process fits' Lloyd iterations
LOCAL_DTYPE: type[np.floating] = np.float32
#: samples with n·d at most this (4096 points × d = 8192, 256 MiB in float64) are fitted in one
#: process from k-means++ chains; larger ones by the partitioned k-means|| path
LOCAL_FIT_MAX_ELEMENTS = 4096 * 8192

#: one fit from given initial centres: ``fit_one(X, init_ids)`` → :class:`KMeansResult`
#: (:func:`fit_from_centres` with the scan's ``max_iter``, ``tol`` and dtype bound)
FitOne = Callable[[np.ndarray, np.ndarray], KMeansResult]
#: how the fits of one step of :func:`select_k` run: ``map_fits(fit_one, X, inits,
#: initial=...)`` returns ``[fit_one(X, ids) for ids in inits]`` in that order, computed
#: anywhere (default :func:`serial_fits`; the Ray layer spreads them over tasks). A fit's cost
#: grows with ``len(ids)`` (its k). ``initial`` is True for the scan, False for the refits.
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
    k scanned (k = 2..``k_searched``; 1 when none could be); ``at_cap`` whether ``best_k`` is
    that largest k: the silhouette has no interior optimum in the scan. ``stability`` the mean
    adjusted Rand index between ``best_labels`` and refits of ``best_k`` from other chains
    (NaN when not checked).
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

    def curve(self) -> list[dict[str, Any]]:
        """The scan as rows ``{k, silhouette, inertia}`` for every k fitted, ascending."""
        return [
            {"k": k, "silhouette": self.silhouettes.get(k, float("nan")), "inertia": self.inertias[k]}
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


def stability_seed(seed: int, replicate: int) -> int:
    """The seed of the ``replicate``-th refit (1, 2, ...): a 32-bit word of SeedSequence([seed, r])."""
    return int(np.random.SeedSequence([int(seed) % 2**63, int(replicate)]).generate_state(1)[0])


def plus_plus_chain(X: np.ndarray, k: int, seed: Any, trials: int) -> np.ndarray:
    """Indices of k greedy k-means++ centres of X (float64), each a prefix of the next.

    First centre uniform; then each step draws ``trials`` candidates with probability ∝
    D²(x) = min over chosen centres of ||x − c||² (inverse-CDF of the cumulative D²) and keeps
    the candidate whose addition leaves the smallest potential Σ_x D²(x) (Arthur &
    Vassilvitskii 2007; scikit-learn's greedy variant). All randomness from
    ``numpy.random.default_rng(seed)``; the number of draws per step does not depend on k, so
    the first j indices are the chain of j centres with the same seed. Stops early when every
    point is a centre (potential 0).
    """
    X = np.asarray(X, dtype=np.float64)
    n = len(X)
    k = min(int(k), n)
    rng = np.random.default_rng(seed)
    norms = np.einsum("ij,ij->i", X, X)

    def sq_dist(ids: np.ndarray) -> np.ndarray:
        return np.maximum(norms[ids, None] - 2.0 * (X[ids] @ X.T) + norms[None, :], 0.0)

    ids = [int(rng.integers(n))]
    closest = sq_dist(np.array(ids))[0]
    closest[ids[0]] = 0.0
    potential = float(closest.sum())
    while len(ids) < k and potential > 0:
        draws = rng.uniform(size=trials) * potential
        cand = np.minimum(np.searchsorted(np.cumsum(closest), draws), n - 1)
        after = np.minimum(closest[None, :], sq_dist(cand))
        after[np.arange(len(cand)), cand] = 0.0
        pots = after.sum(axis=1)
        best = int(np.argmin(pots))
        ids.append(int(cand[best]))
        closest, potential = after[best], float(pots[best])
    return np.asarray(ids, dtype=np.int64)


def _int_seed(seed: Any) -> int:
    """A chain's seed (an int or a tuple of ints) as one int, for the partitioned route."""
    return int(np.random.SeedSequence(seed).generate_state(1)[0])


def chain_trials(k_max: int) -> int:
    """Candidates per k-means++ step of every chain: 2 + ⌊ln k_max⌋ (scikit-learn's rule for
    the largest k, used for all k so that chains have the prefix property)."""
    return 2 + int(np.log(max(int(k_max), 2)))


def fit_from_centres(
    X: np.ndarray,
    init_ids: np.ndarray,
    *,
    max_iter: int = MAX_ITER,
    tol: float = TOL,
    dtype: type[np.floating] = LOCAL_DTYPE,
) -> KMeansResult:
    """Lloyd from the centres ``X[init_ids]``: ``sklearn.cluster.KMeans(n_clusters=k,
    init=X[init_ids], n_init=1, max_iter, tol, algorithm="lloyd")`` on X cast to ``dtype``.

    Returns centres (float64), labels, the inertia Σ_x ||x − c(x)||² computed in float64 from
    X, and Lloyd's iterations. OpenMP threads follow ``threadpoolctl`` limits.
    """
    import warnings

    from sklearn.cluster import KMeans
    from sklearn.exceptions import ConvergenceWarning

    X = np.asarray(X, dtype=np.float64)
    init_ids = np.asarray(init_ids, dtype=np.int64)
    Xf = X.astype(dtype)
    model = KMeans(
        n_clusters=len(init_ids), init=Xf[init_ids], n_init=1, max_iter=max_iter, tol=tol,
        algorithm="lloyd",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(Xf)
    centers = np.asarray(model.cluster_centers_, dtype=np.float64)
    labels = np.asarray(model.labels_, dtype=np.int64)
    r = X - centers[labels]
    return KMeansResult(centers, labels, float(np.einsum("nd,nd->", r, r)), int(model.n_iter_))


def serial_fits(
    fit_one: FitOne, X: np.ndarray, inits: Sequence[np.ndarray], *, initial: bool = True
) -> list[KMeansResult]:
    """The default ``map_fits`` of :func:`select_k`: ``[fit_one(X, ids) for ids in inits]``."""
    return [fit_one(X, ids) for ids in inits]


def silhouette_from_distances(D: np.ndarray, labels: np.ndarray) -> float:
    """Mean silhouette (Rousseeuw 1987) of ``labels`` from a precomputed distance matrix.

    D: (n, n) distances with a zero diagonal. With S_iC = Σ_{j ∈ C} D_ij, n_C the size of
    cluster C and c(i) the cluster of i: a_i = S_{i,c(i)} / (n_{c(i)} − 1), b_i =
    min_{C ≠ c(i)} S_iC / n_C, s_i = (b_i − a_i) / max(a_i, b_i) (0 for a singleton cluster);
    returns mean_i s_i. Equals ``sklearn.metrics.silhouette_score(D, labels,
    metric="precomputed")``, bit for bit: S is summed in the same order (a weighted
    ``bincount`` of each row by label), but over blocks of rows at once instead of one Python
    call per row. Raises ValueError unless 2 ≤ #labels ≤ n − 1, as scikit-learn does.
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


def select_k(
    X: np.ndarray,
    k_max: int = K_MAX,
    min_silhouette: float = MIN_SILHOUETTE,
    *,
    n_init: int = N_INIT,
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
) -> SelectKResult:
    """Cai et al. (2021, Sec. 4)'s number of clusters: the best silhouette of a scan of k = 2..``k_max``.

    See the module docstring for the method. Args:
        X: (n, d) points (one row per sampled occurrence).
        k_max: the largest k fitted (the k of :func:`scan_ks` up to min(k_max, n − 1) are).
        min_silhouette: below this best silhouette, k = 1 (one cluster, centre = mean).
        n_init: k-means++ chains (initialisations) per k; the lowest inertia wins.
        max_iter, tol: Lloyd's iteration limit and scikit-learn's relative tolerance.
        seed: all randomness (chains, silhouette subsample, refits) derives from it.
        silhouette_max_points: points the silhouettes are taken on (None: all).
        stability_seeds: refits of the best k for ``stability`` (0: none).
        groups: (n,) keys of the rows' content (the sample's content keys): rows with equal
            keys are one point; None: rows are one point when bit-identical
            (:func:`~embgeom_ray.core.distinct.distinct_rows`). Not with ``parts``: the caller
            de-duplicates before partitioning.
        map_fn, parts, n_partitions: the partitioned route (:func:`~embgeom_ray.core.kmeans.fit`),
            taken when either is given or n·d > ``local_max_elements`` (None: always).
        local_dtype: the dtype of the one-process fits' Lloyd iterations.
        map_fits: where the one-process fits run (:data:`MapFits`; default :func:`serial_fits`):
            the result is the same wherever they run, provided each runs with the same threads.

    Returns:
        :class:`SelectKResult` with labels per input row.
    """
    from functools import partial

    from sklearn.metrics import pairwise_distances

    X = np.asarray(X, dtype=np.float64)
    if stability_seeds < 0:
        raise ValueError(f"stability_seeds must be >= 0, got {stability_seeds}")
    if n_init < 1:
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
        parts = partition(Xc, n_partitions)
    else:
        shift, Xc = np.zeros(X.shape[1]), X
    top = min(int(k_max), n - 1)
    ks = scan_ks(top)
    idx = silhouette_subsample(n, silhouette_max_points, seed)
    dist = pairwise_distances(Xc[idx]) if len(idx) >= 3 and ks else None
    fits_at = partial(
        _fits_at, Xc, local=local, trials=chain_trials(top), map_fits=map_fits or serial_fits,
        fit_one=partial(fit_from_centres, max_iter=max_iter, tol=tol, dtype=local_dtype),
        max_iter=max_iter, tol=tol, map_fn=map_fn, parts=parts,
    )  # fmt: skip
    jobs = [((int(seed) % 2**63, c), k) for k in ks for c in range(n_init)]
    fits = _lowest_inertia(jobs, fits_at(jobs, True) if jobs else [])
    sil = _silhouettes(fits, idx, dist)
    best_k, best_s = _best_silhouette(sil)
    extra: dict[str, Any] = {"k_searched": max(fits, default=1), "n_distinct": n}
    if best_k is not None:
        best_labels = fits[best_k].labels
        at_cap = best_k == extra["k_searched"]
        extra |= {"best_k": best_k, "best_labels": best_labels, "at_cap": at_cap}
        if stability_seeds:
            refit_jobs = [(stability_seed(seed, r), best_k) for r in range(1, stability_seeds + 1)]
            extra["stability"] = _stability(best_labels, fits_at(refit_jobs, False))
    inertias = {k: r.inertia for k, r in fits.items()}
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


def _distinct_points(
    X: np.ndarray, groups: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """X's distinct points (:func:`distinct_rows` with ``groups``) and each row's point: X
    and None when every row is its own point."""
    first, inverse = distinct_rows(X, groups)
    return (X[first], inverse) if len(first) < len(X) else (X, None)


def _fits_at(
    Xc: np.ndarray,
    jobs: Sequence[tuple[Any, int]],
    initial: bool,
    *,
    local: bool,
    trials: int,
    fit_one: FitOne,
    map_fits: MapFits,
    max_iter: int,
    tol: float,
    map_fn: MapFn | None,
    parts: Sequence[Any],
) -> list[KMeansResult]:
    """One fit of Xc per (chain seed, k) of ``jobs``, in order: from that chain's first k
    centres (:func:`plus_plus_chain`, each chain seeded once to its largest k) by
    ``map_fits(fit_one, ...)`` when ``local``, else by the partitioned
    :func:`~embgeom_ray.core.kmeans.fit` over ``parts``."""
    if not local:
        return [fit(Xc, k, 1, max_iter, tol, _int_seed(s), map_fn, parts=parts) for s, k in jobs]
    lengths: dict[Any, int] = {}
    for s, k in jobs:
        lengths[s] = max(lengths.get(s, 0), k)
    chains = {s: plus_plus_chain(Xc, k, s, trials) for s, k in lengths.items()}
    inits = [chains[s][:k] for s, k in jobs]
    return map_fits(fit_one, Xc, inits, initial=initial)


def _lowest_inertia(
    jobs: Sequence[tuple[Any, int]], results: Sequence[KMeansResult]
) -> dict[int, KMeansResult]:
    """Per k of ``jobs`` (in their order), the fit of lowest inertia among its chains (the
    first on a tie)."""
    fits: dict[int, KMeansResult] = {}
    for (_, k), res in zip(jobs, results, strict=True):
        if k not in fits or res.inertia < fits[k].inertia:
            fits[k] = res
    return fits


def _silhouettes(
    fits: dict[int, KMeansResult], idx: np.ndarray, dist: np.ndarray | None
) -> dict[int, float]:
    """Per k, the silhouette of its fit's labels on the subsample ``idx`` from its distance
    matrix ``dist`` (:func:`silhouette_from_distances`); NaN without a matrix or unless the
    subsample holds 2 ≤ #labels < len(idx)."""
    sil: dict[int, float] = {}
    for k, res in fits.items():
        lab = res.labels[idx]
        n_lab = len(np.unique(lab))
        if dist is None or n_lab < 2 or n_lab >= len(idx):
            sil[k] = float("nan")
        else:
            sil[k] = silhouette_from_distances(dist, lab)
    return sil


def _best_silhouette(sil: dict[int, float]) -> tuple[int | None, float]:
    """k* = argmax of the finite silhouettes (the smaller k on a tie) and s(k*); (None, NaN)
    when none is finite."""
    scored = {k: s for k, s in sil.items() if np.isfinite(s)}
    best_k = max(scored, key=lambda k: (scored[k], -k)) if scored else None
    return best_k, scored[best_k] if best_k is not None else float("nan")


def _stability(labels: np.ndarray, refits: Sequence[KMeansResult]) -> float:
    """Mean adjusted Rand index (Hubert & Arabie 1985) between ``labels`` and each refit's."""
    from sklearn.metrics import adjusted_rand_score

    return float(np.mean([adjusted_rand_score(labels, f.labels) for f in refits]))
