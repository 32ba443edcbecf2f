"""Metrics that need points: pure functions of the sampled occurrences (numpy float64).

The exact, moment-based metrics are in :mod:`embgeom_ray.core.metrics`; these run on the bounded
samples of :class:`~embgeom_ray.core.samples.ActivationSample` (uniform: the ``size`` occurrences
of smallest key; type-uniform: one random occurrence per sampled token type), with the K-means
model selection of :mod:`embgeom_ray.core.kmeans_selection` / :mod:`embgeom_ray.distributed.kmeans`.

Cosine means over pairs use unit-vector sums: for unit vectors u_1..u_m with U = Σ u_i, the
mean cosine over the m(m − 1) ordered pairs i ≠ j is (||U||² − m) / (m(m − 1)), exact.

Repeated points (repeated text: occurrences whose model input was the same, by the sample's
content keys, :mod:`embgeom_ray.core.distinct`) are handled per metric (see
:func:`sampled_metrics_of_points`): the geometry of the point set (clusters, silhouettes, LID)
counts each distinct point once; occurrence averages that estimate an exact, corpus-wide
quantity count every occurrence. Each layer's main metrics carry a standard error from
half-samples of its points (:func:`half_sample_se`), for comparisons between runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np
import pandas as pd

from . import metric_registry as registry
from .distinct import distinct_rows
from .kmeans_selection import SILHOUETTE_MAX_POINTS
from .metrics import isoscore_from_covariance
from .neighbours import (
    NeighbourTable,
    chord_distances,
    chord_error,
    euclidean_error,
    knn_distances,
    neighbour_table,
    neighbour_tables_of_points,
    smallest_per_row,
)
from .options import SampledOptions
from .partials import group_sums, mean_cosine_from_unit_sum

if TYPE_CHECKING:
    from .kmeans_selection import SelectKResult
    from .samples import ActivationSample

#: the metrics that get a half-sample standard error (column ``<metric>_se``), declared in
#: :mod:`~embgeom_ray.core.metric_registry`
SE_METRICS = registry.SE_METRICS

#: the ``layers.parquet`` columns :func:`sampled_layer_metrics` returns, in order: the
#: registry's sampled section, then the standard errors
SAMPLED_LAYER_COLUMNS = [
    *registry.columns(registry.LAYERS, registry.SAMPLED_SECTION),
    *registry.SE_COLUMNS,
]

_DEFAULTS = SampledOptions()
#: defaults of the sampled metrics: their option group's (:class:`~.options.SampledOptions`)
LID_K: int = _DEFAULTS.lid_k
CLUSTER_MIN_SIZE: int = _DEFAULTS.cluster_min_size
S_INTER_DRAWS: int = _DEFAULTS.s_inter_draws
SE_REPLICATES: int = _DEFAULTS.sampled_se_replicates


def _as_points(X: np.ndarray, name: str = "X") -> np.ndarray:
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2:
        raise ValueError(f"{name} must be an (n, d) array, got shape {X.shape}")
    if not np.isfinite(X).all():
        raise ValueError(f"{name} has non-finite values")
    return X


def _unit_rows(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(unit vectors of the non-zero rows, mask of those rows)."""
    norms = np.linalg.norm(X, axis=1)
    ok = norms > 0
    return X[ok] / norms[ok, None], ok


def mean_pairwise_cosine(X: np.ndarray) -> float:
    """Mean cosine over ordered pairs i ≠ j: (||Σ u_i||² − m) / (m(m − 1)), u_i = x_i/||x_i||.

    Zero rows are left out; NaN when fewer than 2 remain.
    """
    u, _ = _unit_rows(_as_points(X))
    m = len(u)
    if m < 2:
        return float("nan")
    s = u.sum(axis=0)
    return float(mean_cosine_from_unit_sum(s @ s, m))


def isoscore_points(X: np.ndarray) -> float:
    """IsoScore (Rudman et al. 2022) of a point cloud: of its sample covariance's spectrum.

    :func:`embgeom_ray.core.metrics.isoscore_from_covariance` of X_cᵀX_c (float64), X_c the
    centred points: (PR − 1)/(d − 1), PR the participation ratio, which equals Rudman et
    al.'s form from the eigenvalues. Equals ``IsoScore.IsoScore(X)`` (which takes √d in
    float32, so to ~1e-6). NaN for fewer than 2 points.

    With fewer points m than dimensions d, the m × m Gram matrix X_c X_cᵀ gives it instead of
    the d × d X_cᵀ X_c: the same non-zero eigenvalues, so the same PR, and a smaller product
    (a cluster of a half-sample has a few hundred points); the dimension in (PR − 1)/(d − 1)
    stays d.
    """
    X = _as_points(X)
    m, d = X.shape
    if m < 2 or d < 2:
        return float("nan")
    Xc = X - X.mean(axis=0)
    if m >= d:
        return isoscore_from_covariance(Xc.T @ Xc)
    # the Gram matrix's value is (PR − 1)/(m − 1): rescale to d dimensions
    return isoscore_from_covariance(Xc @ Xc.T) * (m - 1) / (d - 1)


def _knn_from_distances(D: np.ndarray, keep: np.ndarray, m: int) -> np.ndarray:
    """(len(keep), m) indices into ``keep`` of the m smallest D[keep_i, keep_j] (unordered)."""
    n = len(keep)
    if n == len(D):  # no duplicates: partial sort of D as is, then renumber rows and columns
        pos = np.empty(n, np.int64)
        pos[keep] = np.arange(n)
        return pos[_smallest_per_row(D, m)[keep]]
    return _smallest_per_row(D[np.ix_(keep, keep)], m)


def _smallest_per_row(D: np.ndarray, m: int) -> np.ndarray:
    """(rows, m) column indices of the m smallest entries of each row of D (unordered)."""
    return smallest_per_row(D, m)


def lid_mle(
    X: np.ndarray,
    k: int = LID_K,
    metric: Literal["euclidean", "cosine"] = "euclidean",
    squared: bool = False,
    *,
    per_point: bool = False,
    distances: np.ndarray | None = None,
    divide_by_k: bool = False,
) -> float | np.ndarray:
    """Local intrinsic dimension, Levina & Bickel (2005)'s MLE averaged over points.

    For each point x with distances T_1 ≤ … ≤ T_k to its k nearest other points (exact kNN),
    m̂(x) = [ (1/(k − 1)) Σ_{j<k} log(T_k / T_j) ]⁻¹; returns mean_x m̂(x) (or the per-point
    values with ``per_point=True``; their median is a summary robust to the long right tail
    of m̂). Exact duplicate points are removed first: the estimator assumes distinct points
    (a copy at distance 0 makes log(T_k / T_j) infinite), so each point counts once.

    ``metric="euclidean"``: T = ||x − y||. ``metric="cosine"``: T = the chord distance
    ||x/||x|| − y/||y|||| = √(2 − 2 cos(x, y)) between directions (zero vectors dropped), a
    true metric locally proportional to the angle; it measures the dimension of the set of
    directions (a 5-dim subspace through the origin has 4-dim directions). Note that
    1 − cos = chord²/2 is a *squared* distance: using it as T halves the estimate.

    ``squared=True`` uses T² instead of T: every log ratio doubles, so the estimate is exactly
    half of the default one. ``divide_by_k=True`` divides the sum of the k − 1 log ratios by k
    instead of k − 1 (the mean over j = 1..k, whose last term log(T_k/T_k) is 0). Cai et al.
    (2021)'s released code does both, m̂_Cai(x) = [ (1/k) Σ_{j≤k} log(T_k² / T_j²) ]⁻¹ =
    k/(2(k − 1)) m̂(x) (:func:`lid_cai`): "multiply by 2" is 5% off at k = 20. Say which
    convention a reported number uses. k = 20 is the default (Levina & Bickel report
    estimates stable for k ≈ 10–20). Reference: Levina & Bickel, "Maximum Likelihood
    Estimation of Intrinsic Dimension", NIPS 2004/2005.

    The k nearest neighbours come from ``sklearn.neighbors.NearestNeighbors`` (brute force), or,
    with ``distances`` (an (n, n) matrix of the Euclidean distances between the rows of ``X``,
    e.g. ``sklearn.metrics.pairwise_distances`` of X or of X minus its mean, already computed
    for a silhouette), from a partial sort of its rows: the same neighbours up to ties within
    rounding. T is recomputed from the points either way. Per-point values are in the order
    of ``np.unique(X, axis=0)``.
    """
    X = _as_points(X)
    if k < 2:
        raise ValueError(f"k must be >= 2, got {k}")
    if metric == "cosine":
        if distances is not None:
            raise ValueError("distances are Euclidean: give them with metric='euclidean' only")
        X, _ = _unit_rows(X)
    elif metric != "euclidean":
        raise ValueError(f"metric must be 'euclidean' or 'cosine', got {metric!r}")
    if distances is not None and np.shape(distances) != (len(X), len(X)):
        raise ValueError(f"distances must be ({len(X)}, {len(X)}), got {np.shape(distances)}")
    X, first = np.unique(X, axis=0, return_index=True)
    n = len(X)
    if n <= k:
        return np.full(n, np.nan) if per_point else float("nan")
    if distances is None:
        from sklearn.neighbors import NearestNeighbors

        nn = NearestNeighbors(n_neighbors=k + 1, algorithm="brute").fit(X)
        idx = nn.kneighbors(X, return_distance=False)
    else:
        idx = _knn_from_distances(np.asarray(distances, dtype=np.float64), first, k + 1)
    rows = np.arange(n)[:, None]
    # drop the point itself (or, should a tie hide it, the farthest of the k + 1)
    is_self = idx == rows
    drop = np.where(is_self.any(axis=1), is_self.argmax(axis=1), k)
    keep = np.ones_like(idx, dtype=bool)
    keep[np.arange(n), drop] = False
    idx = idx[keep].reshape(n, k)
    # exact distances (no ||x||² − 2x·y + ||y||² cancellation), sorted; blocks of rows keep
    # the (rows, k, d) differences in cache
    T = np.empty((n, k))
    block = max(1, (1 << 20) // (k * X.shape[1]))
    for a in range(0, n, block):
        T[a : a + block] = np.linalg.norm(X[idx[a : a + block]] - X[a : a + block, None, :], axis=2)
    T.sort(axis=1)
    m_hat = lid_from_knn_distances(T, squared=squared, divide_by_k=divide_by_k)
    return m_hat if per_point else float(np.nanmean(m_hat))


def lid_from_knn_distances(
    T: np.ndarray, *, squared: bool = False, divide_by_k: bool = False
) -> np.ndarray:
    """Per-point Levina–Bickel m̂ from each point's sorted kNN distances T (n, k), as in :func:`lid_mle`.

    m̂ = [ (1/(k − 1)) Σ_{j<k} log(T_k / T_j) ]⁻¹ (T² with ``squared``, 1/k with
    ``divide_by_k``); NaN where the sum is not positive.
    """
    k = T.shape[1]
    if k < 2:
        raise ValueError(f"k must be >= 2, got {k}")
    if squared:
        T = T**2
    logs = np.log(T[:, -1:] / T[:, :-1]).sum(axis=1) / (k if divide_by_k else k - 1)
    with np.errstate(divide="ignore"):
        return np.where(logs > 0, 1.0 / logs, np.nan)


def lid_cai(
    X: np.ndarray,
    k: int = LID_K,
    *,
    per_point: bool = False,
    distances: np.ndarray | None = None,
) -> float | np.ndarray:
    """LID in the convention of Cai et al. (2021)'s released code, for exact comparisons.

    m̂_Cai(x) = [ (1/k) Σ_{j=1..k} log(T_k² / T_j²) ]⁻¹ with T_1 ≤ … ≤ T_k the Euclidean
    distances to the k nearest other points: squared distances, and the mean over the k
    neighbours (the last log ratio is 0), i.e. :func:`lid_mle` with ``squared=True,
    divide_by_k=True``; returns mean_x m̂_Cai(x) (or the per-point values). Equal to
    k / (2(k − 1)) times the Levina–Bickel estimate of :func:`lid_mle`. Duplicates are removed
    first, as in :func:`lid_mle`.
    """
    return lid_mle(
        X, k, "euclidean", squared=True, per_point=per_point, distances=distances, divide_by_k=True
    )


def silhouette_by_labels(
    X: np.ndarray,
    labels: np.ndarray,
    *,
    max_points: int | None = None,
    seed: int = 0,
    min_label_count: int = 1,
    metric: str = "euclidean",
    distances: np.ndarray | None = None,
) -> float:
    """Mean silhouette (Rousseeuw 1987) of ``labels`` on ``X``: ``sklearn.metrics.silhouette_score``.

    s_i = (b_i − a_i) / max(a_i, b_i), a_i = mean distance to the points of i's label, b_i =
    smallest mean distance to another label's points (s_i = 0 for a singleton label). Used
    with K-means labels and with token-type labels (Mickus et al. 2024). Points whose label
    occurs fewer than ``min_label_count`` times are left out first; then at most
    ``max_points`` points are drawn with ``seed``. NaN unless 2 ≤ #labels ≤ n − 1. Points are
    taken as given: a copy of a point counts (at distance 0 from it);
    :func:`sampled_metrics_of_points` passes distinct points.

    ``distances``: the (n, n) matrix of ``metric`` distances between the rows of ``X``, if
    already computed; the silhouette is then taken on its rows and columns of the selected
    points (:func:`embgeom_ray.core.kmeans_selection.silhouette_from_distances`, the same value).
    """
    from sklearn.metrics import silhouette_score

    from .kmeans_selection import silhouette_from_distances

    X = _as_points(X)
    labels = np.asarray(labels)
    if labels.shape != (len(X),):
        raise ValueError(f"labels must be ({len(X)},), got {labels.shape}")
    if distances is not None and np.shape(distances) != (len(X), len(X)):
        raise ValueError(f"distances must be ({len(X)}, {len(X)}), got {np.shape(distances)}")
    sel = _silhouette_selection(labels, max_points, seed, min_label_count)
    if sel is None:
        return float("nan")
    labels = labels[sel]
    if distances is not None:
        return silhouette_from_distances(_block(np.asarray(distances), sel), labels)
    return float(silhouette_score(X[sel], labels, metric=metric))


def _silhouette_selection(
    labels: np.ndarray, max_points: int | None, seed: int, min_label_count: int
) -> np.ndarray | None:
    """The points :func:`silhouette_by_labels` scores (sorted indices), None if it is NaN."""
    sel = np.arange(len(labels))
    if min_label_count > 1:
        _, inv, cnt = np.unique(labels, return_inverse=True, return_counts=True)
        sel = sel[cnt[inv.reshape(-1)] >= min_label_count]
    if max_points is not None and len(sel) > max_points:
        idx = np.sort(np.random.default_rng(seed).choice(len(sel), max_points, replace=False))
        sel = sel[idx]
    n_labels = len(np.unique(labels[sel]))
    if n_labels < 2 or n_labels > len(sel) - 1:
        return None
    return sel


def _silhouettes_of_rows(
    pts: _PointSet,
    rows: np.ndarray,
    labellings: Mapping[str, tuple[np.ndarray, int]],
    max_points: int | None,
    seed: int,
) -> dict[str, float]:
    """:func:`silhouette_by_labels` of the points ``rows`` (sorted) of ``pts`` for each
    labelling (name -> (labels of ``rows``, ``min_label_count``)), from one distance matrix.

    The scored points of each are drawn as :func:`silhouette_by_labels` draws them; their
    distances are blocks of one block of the point set's matrix, that of the union of the
    scored points (a half-sample's K-means labelling scores all of its points, its types'
    labelling a subset, whose sums are taken from the first's rows, not from a second
    gather: :func:`~.kmeans_selection.silhouette_from_distances` with ``scored``; the same
    entries in the same order), or, without a matrix, of one
    ``pairwise_distances`` of that union (of at most ``max_points``
    points: the two silhouettes of a half-sample of up to 2 · ``max_points`` points share
    it), else one matrix per labelling (each of at most ``max_points`` points). With
    ``max_points`` None and no matrix: scikit-learn's ``silhouette_score`` (chunked).
    """
    from .kmeans_selection import silhouette_from_distances

    sels = {
        name: _silhouette_selection(labels, max_points, seed, min_count)
        for name, (labels, min_count) in labellings.items()
    }
    out = {name: float("nan") for name, sel in sels.items() if sel is None}
    sels = {name: sel for name, sel in sels.items() if sel is not None}
    if pts.dist is None and max_points is None:
        for name, sel in sels.items():
            out[name] = silhouette_by_labels(pts.X[rows[sel]], labellings[name][0][sel])
        return out

    def matrix_of(points: np.ndarray) -> np.ndarray:
        from sklearn.metrics import pairwise_distances

        P = pts.X[points]
        return pairwise_distances(P - P.mean(axis=0))

    union = np.unique(np.concatenate(list(sels.values()))) if sels else np.arange(0)
    if pts.dist is not None:  # one gather from the n × n matrix, each block from that one
        D_union = _block(pts.dist, rows[union]) if len(sels) else None
    else:
        shared = len(union) <= max_points
        D_union = matrix_of(rows[union]) if shared and len(sels) else None
    for name, sel in sels.items():
        labels = labellings[name][0][sel]
        if D_union is None:
            out[name] = silhouette_from_distances(matrix_of(rows[sel]), labels)
        elif len(sel) == len(union):
            out[name] = silhouette_from_distances(D_union, labels)
        else:  # the block of D_union, summed from its rows (bit for bit)
            scored = np.searchsorted(union, sel)
            out[name] = silhouette_from_distances(D_union, labels, scored)
    return out


def partition_isotropy(W: np.ndarray, centered: bool = False) -> float:
    """Partition-function isotropy I(W) (Mu & Viswanath 2018, "All-but-the-Top").

    I(W) = min_c Z(c) / max_c Z(c), Z(c) = Σ_w exp(cᵀw), c over the unit eigenvectors of WᵀW
    and their negatives (both signs: an eigenvector's sign is arbitrary). Computed with
    log Z(c) = logsumexp_w(cᵀw), I = exp(min log Z − max log Z), so it never overflows (it may
    underflow to 0 for very anisotropic sets). ``centered=True`` first subtracts the mean
    vector (the paper's post-processing view). 1 for an isotropic symmetric set; in [0, 1].

    With no more points n than dimensions d, from the n × n Gram matrix WWᵀ = Σ_i λ_i u_i u_iᵀ
    instead of the d × d WᵀW: its eigenvectors c_i = Wᵀu_i/√λ_i (λ_i > 0) have projections
    Wc_i = √λ_i u_i, and the d − rank others are orthogonal to every w, so Z(±c) = n. An
    eigendecomposition of n instead of d and no product with the eigenvectors: at n = 4,096,
    d = 8,192 (a 70B model's default sample) 15 s instead of 101 s on one core, equal to
    4e-14 (``bench.sampled_stage``'s synthetic points); at n = d, the products saved.
    """
    W = _as_points(W, "W")
    n, d = W.shape
    if n == 0:
        return float("nan")
    if centered:
        W = W - W.mean(axis=0)
    if n > d:
        return _partition_isotropy_of(W, W.T @ W)
    lam, U = np.linalg.eigh(W @ W.T)
    # eigenvalues within rounding of 0 (n ε λ_max: e.g. the centred points' direction of the
    # all-ones vector) are 0: their √ would be ~1e-8 · √λ_max of noise
    zero = lam <= n * np.finfo(float).eps * lam[-1]
    lam[zero] = 0.0
    proj = U[:, ~zero] * np.sqrt(lam[~zero])  # Wc for every c with λ > 0
    null = [np.log(n)] if d > n - zero.sum() else []  # directions orthogonal to every w
    log_z = np.concatenate([_log_sum_exp(proj), _log_sum_exp(-proj), null])
    return float(np.exp(log_z.min() - log_z.max()))


def _partition_isotropy_of(W: np.ndarray, WtW: np.ndarray) -> float:
    """:func:`partition_isotropy` of the points W given WᵀW (d × d)."""
    _, vecs = np.linalg.eigh(WtW)
    proj = W @ vecs  # (n, d): cᵀw for every eigenvector c
    log_z = np.concatenate([_log_sum_exp(proj), _log_sum_exp(-proj)])
    return float(np.exp(log_z.min() - log_z.max()))


def _log_sum_exp(P: np.ndarray) -> np.ndarray:
    """log Σ_i exp(P_ij) per column j of a finite P, shifted by the column's maximum m_j:
    m_j + log Σ_i exp(P_ij − m_j) (``scipy.special.logsumexp(P, axis=0)`` to rounding, in a
    third of its time)."""
    m = P.max(axis=0)
    shifted = P - m
    np.exp(shifted, out=shifted)
    return np.log(shifted.sum(axis=0)) + m


class ClusterAdjusted(NamedTuple):
    """Cluster-adjusted metrics (:func:`cluster_adjusted`) and the clusters behind them."""

    s_inter: float  # Cai et al.'s: unweighted means over all clusters
    s_intra: float
    isoscore: float
    n_clusters: int
    s_inter_weighted: float = float("nan")  # size-weighted, clusters of >= min_size points
    s_intra_weighted: float = float("nan")
    isoscore_weighted: float = float("nan")
    clusters_used: int = 0  # clusters in the weighted means
    clusters_left_out: int = 0  # clusters below min_size
    s_inter_draws_mean: float = float("nan")  # exact mean of s_inter over all draws
    s_inter_draws_std: float = float("nan")  # its spread over random draws


def _mean(values: Sequence[float], weights: Sequence[float] | None = None) -> float:
    """(Weighted) mean of the finite values; NaN if none."""
    vals = np.asarray(values, dtype=np.float64)
    ok = np.isfinite(vals)
    if weights is None:
        return float(vals[ok].mean()) if ok.any() else float("nan")
    w = np.asarray(weights, dtype=np.float64)
    if w[ok].sum() <= 0:
        return float("nan")
    return float(np.sum(vals[ok] * w[ok]) / w[ok].sum())


def _one_per_type(inv: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Rows of smallest key within each group of ``inv``: one random occurrence per type."""
    order = np.lexsort((keys, inv))
    g = inv[order]
    return order[np.r_[True, g[1:] != g[:-1]]]


def cluster_adjusted(
    X: np.ndarray,
    labels: np.ndarray,
    token_ids: np.ndarray,
    inter_mask: np.ndarray | None = None,
    *,
    min_size: int = CLUSTER_MIN_SIZE,
    weighted_clusters: Sequence[int] | np.ndarray | None = None,
    draws: int = 0,
    seed: int = 0,
) -> ClusterAdjusted:
    """Cai et al. (2021, Sec. 4)'s cluster-adjusted S_inter, S_intra and IsoScore, and variants.

    Inside each cluster C (points with the same label) subtract the cluster mean μ_C, then
    with u = (x − μ_C)/||x − μ_C|| (points equal to μ_C left out):

    - S_inter(C) = mean cosine over pairs of *different* types, one occurrence per type:
      (||Σ u||² − m)/(m(m − 1)) over the m selected occurrences. ``inter_mask`` selects them;
      by default the first occurrence of each type within C in row order (the samples' rows are
      in random-key order, so that is a uniformly random occurrence);
    - S_intra(C) = unweighted mean over types t with n_t ≥ 2 in C of the mean cosine between
      t's occurrences, (||U_t||² − n_t)/(n_t(n_t − 1)), U_t = Σ_{x of type t in C} u;
    - IsoScore(C) = :func:`isoscore_points` of C's points (IsoScore is translation invariant).

    ``s_inter``, ``s_intra``, ``isoscore`` are Cai's definition: the unweighted mean over the
    clusters where each is defined (NaN if none), whatever their size. Small clusters weigh as
    much as large ones there, and are biased: n centred points of equal norm have Σ u = 0, so
    their mean pairwise cosine is exactly −1/(n − 1) (a cluster of two types, one occurrence
    each, gives S_inter = −1); IsoScore of a cluster of fewer points than dimensions is bounded
    by its rank. So also:

    - ``*_weighted``: Σ_C n_C v(C) / Σ_C n_C over the clusters with n_C ≥ ``min_size`` points
      (or the cluster ids ``weighted_clusters``) where v(C) is defined: the value of the
      cluster of a uniformly random point; ``clusters_used`` / ``clusters_left_out`` count the
      clusters in / out of these means (by size);
    - ``s_inter_draws_mean``: the exact mean of ``s_inter`` over every one-occurrence-per-type
      draw (each type's occurrence uniform over its occurrences in C, independently): with
      Ū_t = U_t / n_t the mean unit vector of type t in C and m types,
      E[S_inter(C)] = (||Σ_t Ū_t||² − Σ_t ||Ū_t||²)/(m(m − 1)), averaged over clusters as
      ``s_inter`` is (without ``inter_mask``);
    - ``s_inter_draws_std``: the standard deviation (ddof = 1) of ``s_inter`` over ``draws``
      random draws (generator seeded with ``seed``): how far one draw, such as ``s_inter``,
      may fall from the mean (NaN for fewer than 2 draws).

    Points are taken as given (:func:`sampled_metrics_of_points` passes distinct points).
    """
    X = _as_points(X)
    labels = np.asarray(labels)
    token_ids = np.asarray(token_ids)
    if labels.shape != (len(X),) or token_ids.shape != (len(X),):
        raise ValueError("labels and token_ids must have one entry per row of X")
    if inter_mask is not None:
        inter_mask = np.asarray(inter_mask, dtype=bool)
        if inter_mask.shape != (len(X),):
            raise ValueError("inter_mask must have one entry per row of X")
    if min_size < 1:
        raise ValueError(f"min_size must be >= 1, got {min_size}")
    rng = np.random.default_rng(seed)
    clusters = np.unique(labels)
    sizes, inters, intras, isos, expected = [], [], [], [], []
    drawn = np.full((len(clusters), max(draws, 0)), np.nan)
    for ci, c in enumerate(clusters):
        rows = np.flatnonzero(labels == c)
        sizes.append(len(rows))
        inter, intra, iso, mean_inter = _one_cluster(
            X[rows], token_ids[rows], None if inter_mask is None else inter_mask[rows],
            rng, drawn[ci],
        )  # fmt: skip
        inters.append(inter)
        intras.append(intra)
        isos.append(iso)
        expected.append(mean_inter)
    if weighted_clusters is None:
        used = np.asarray(sizes) >= min_size
    else:
        used = np.isin(clusters, np.asarray(weighted_clusters))
    w = np.where(used, np.asarray(sizes, dtype=np.float64), 0.0)
    draw_means = [_mean(drawn[:, r]) for r in range(drawn.shape[1])]
    nan = float("nan")
    return ClusterAdjusted(
        _mean(inters),
        _mean(intras),
        _mean(isos),
        len(clusters),
        _mean(inters, w),
        _mean(intras, w),
        _mean(isos, w),
        int(used.sum()),
        int(len(clusters) - used.sum()),
        _mean(expected) if inter_mask is None else nan,
        float(np.std(draw_means, ddof=1)) if len(draw_means) >= 2 else nan,
    )


def _one_cluster(
    X: np.ndarray,
    token_ids: np.ndarray,
    inter_mask: np.ndarray | None,
    rng: np.random.Generator,
    drawn: np.ndarray,
) -> tuple[float, float, float, float]:
    """S_inter, S_intra, IsoScore and the draws' mean S_inter of one cluster's points X
    (:func:`cluster_adjusted`'s definitions; NaN where undefined), and into ``drawn`` the
    S_inter of ``len(drawn)`` random one-occurrence-per-type draws from ``rng`` (left as
    they are with fewer than two types)."""
    nan = float("nan")
    Xc = X - X.mean(axis=0)
    u, ok = _unit_rows(Xc)
    tok = token_ids[ok]
    types, first, inv, cnt = np.unique(
        tok, return_index=True, return_inverse=True, return_counts=True
    )
    inv = inv.reshape(-1)
    pick = first if inter_mask is None else np.flatnonzero(inter_mask[ok])
    m = len(pick)
    if m >= 2:
        s = u[pick].sum(axis=0)
        inter = mean_cosine_from_unit_sum(s @ s, m)
    else:
        inter = nan
    sums = group_sums(u, inv, len(types))
    multi = cnt >= 2
    if multi.any():
        n_t = cnt[multi].astype(np.float64)
        u2 = np.einsum("td,td->t", sums[multi], sums[multi])
        intra = float(np.mean(mean_cosine_from_unit_sum(u2, n_t)))
    else:
        intra = nan
    iso = isoscore_points(X) if len(X) >= 2 else nan
    n_types = len(types)
    if n_types < 2:
        return inter, intra, iso, nan
    means = sums / cnt[:, None]
    total = means.sum(axis=0)
    own = float(np.einsum("td,td->", means, means))
    for r in range(len(drawn)):
        s = u[_one_per_type(inv, rng.random(len(inv)))].sum(axis=0)
        drawn[r] = mean_cosine_from_unit_sum(s @ s, n_types)
    return inter, intra, iso, (float(total @ total) - own) / (n_types * (n_types - 1))


def half_sample_se(
    n: int,
    statistic: Callable[[np.ndarray], Mapping[str, float]],
    replicates: int,
    seed: int = 0,
) -> dict[str, float]:
    """Standard errors by the delete-d jackknife with d = n − ⌊n/2⌋ (half-samples).

    Each of ``replicates`` draws a subset S of m = ⌊n/2⌋ of the n points without replacement
    (``numpy.random.default_rng(seed)``) and evaluates ``statistic(S)`` (sorted indices ->
    metric values). With θ_S those values, SE = √( m/(n − m) · Var_S θ_S ), Var_S the sample
    variance (ddof = 1) over the replicates with a finite value: the delete-d jackknife variance
    (Shao & Wu 1989, "A general theory for jackknife variance estimation"), over random
    subsets instead of all of them. For a mean of n values it is s²/n in expectation, the usual
    variance of a mean; unlike the delete-1 jackknife it is consistent for non-smooth
    statistics such as the median (d ∝ n). Half-samples rather than the bootstrap, because a
    bootstrap sample repeats points, and repeated points are exactly what the sampled metrics
    drop (LID) or sit at distance 0 (silhouettes). NaN for a metric with fewer than 2 finite
    replicates, or when ``replicates`` < 2 or n < 4. The cost is ``replicates`` evaluations of
    the statistic on n/2 points.
    """
    m = n // 2
    if replicates < 2 or m < 2:
        return {}
    rng = np.random.default_rng(seed)
    values: dict[str, list[float]] = {}
    for _ in range(replicates):
        S = np.sort(rng.choice(n, size=m, replace=False))
        for key, v in statistic(S).items():
            values.setdefault(key, []).append(float(v))
    out = {}
    for key, vals in values.items():
        v = np.asarray(vals)
        v = v[np.isfinite(v)]
        out[key] = float(np.sqrt(m / (n - m) * v.var(ddof=1))) if len(v) >= 2 else float("nan")
    return out


def sampled_layer_metrics(
    sample: ActivationSample,
    layer: int,
    kmeans_result: SelectKResult | None = None,
    **options: Any,
) -> dict[str, float | int | bool]:
    """The sampled ``layers.parquet`` columns of one layer (:data:`SAMPLED_LAYER_COLUMNS`).

    :func:`sampled_metrics_of_points` (``options``: its keyword arguments) of the uniform
    sample of ``layer`` (rows of ``sample.points(layer)``) and, when the sample has a
    type-uniform part of ≥ 2 types, the type-uniform vectors
    ``sample.type_points(layer).vectors``. ``kmeans_result`` is
    :func:`embgeom_ray.core.kmeans_selection.select_k`'s result for these rows (e.g. from
    :func:`embgeom_ray.distributed.kmeans.fit_layers_on_ray`); None runs ``select_k`` here.
    """
    pts = sample.points(layer)
    if kmeans_result is not None and np.shape(kmeans_result.labels) != (len(pts.vectors),):
        raise ValueError(
            f"kmeans_result has {np.shape(kmeans_result.labels)[0]} labels but layer {layer}'s "
            f"sample has {len(pts.vectors)} points: fit K-means on sample.points({layer}).vectors"
        )
    type_vectors = None
    if sample.type_uniform and sample.num_types >= 2:
        type_vectors = sample.type_points(layer).vectors
    return sampled_metrics_of_points(
        pts.vectors, pts.token_ids, type_vectors, kmeans_result, **options
    )


class _PointSet(NamedTuple):
    """A layer's distinct points and what is computed once for them and their half-samples."""

    X: np.ndarray  # (n, d) distinct rows
    token_ids: np.ndarray  # (n,)
    best_labels: np.ndarray | None  # (n,) the labels of the best-silhouette k
    dist: np.ndarray | None  # (n, n) Euclidean distances of the rows
    chord: np.ndarray | None  # (n, n) Euclidean distances of the rows' unit vectors
    euclid_nn: NeighbourTable | None = None  # the rows' neighbours by ``dist``
    chord_nn: NeighbourTable | None = None  # the unit vectors' neighbours by ``chord``


def _summaries(per_point: np.ndarray) -> tuple[float, float]:
    """(mean, median) of the finite per-point values; NaN if none."""
    ok = per_point[np.isfinite(per_point)]
    return (float(ok.mean()), float(np.median(ok))) if len(ok) else (float("nan"),) * 2


#: rows of the matrix :func:`_block` gathers at once: 64 rows of n = 4,096 float64 distances
#: (2 MiB) are taken whole, then their columns while they are in cache
BLOCK_ROWS = 64


def _block(D: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """D[rows][:, rows] (D itself when ``rows`` are all of its rows, in order).

    ``D[np.ix_(rows, rows)]``'s entries (a copy), gathered :data:`BLOCK_ROWS` rows at a time:
    each slab of whole rows is read once, contiguously, and its columns taken from the cache,
    where the one fancy index reads every entry from memory (one thread, 2,048 of 4,096
    points, a half-sample's: 11–19 against 16–23 ms; 3,600 of them 36–45 against 45–59 ms)."""
    if len(rows) == len(D):
        return D
    rows = np.asarray(rows, dtype=np.intp)
    out = np.empty((len(rows), len(rows)), dtype=D.dtype)
    for a in range(0, len(rows), BLOCK_ROWS):
        np.take(D[rows[a : a + BLOCK_ROWS]], rows, axis=1, out=out[a : a + BLOCK_ROWS])
    return out


def _lid_knn(
    pts: _PointSet, lid_k: int, S: np.ndarray | None, metric: Literal["euclidean", "cosine"]
) -> np.ndarray | None:
    """Sorted kNN distances (:func:`~.neighbours.knn_distances`) of the points S (None: all)
    from the point set's table for ``metric``; None without a table or with too few points."""
    table = pts.euclid_nn if metric == "euclidean" else pts.chord_nn
    m = len(pts.X) if S is None else len(S)
    if table is None or m <= lid_k:
        return None
    return knn_distances(table, lid_k, S)


def _point_set_metrics(
    pts: _PointSet,
    lid_k: int,
    max_points: int | None,
    min_type_count: int,
    seed: int,
    *,
    kmeans_silhouette: bool,
    S: np.ndarray | None = None,
    lid_cai_too: bool = False,
) -> dict[str, float]:
    """Silhouettes and LIDs of a set of distinct points (a layer's, or its half-sample S).

    S: sorted indices of a half-sample (None: all points). The LIDs come from the point
    set's neighbour tables when it has them (:func:`lid_mle`'s values on X[S], their distances
    within 1e-11 relative: see :mod:`.neighbours`), else from :func:`lid_mle`; the silhouettes from blocks of its
    distance matrix, or of one matrix of the points they score (:func:`_silhouettes_of_rows`:
    the values of :func:`silhouette_by_labels` on X[S]).
    ``lid_cai_too`` adds ``lid_euclidean_cai`` (:func:`lid_cai`) from the same neighbours.
    """
    rows = np.arange(len(pts.X)) if S is None else np.asarray(S)
    X = pts.X if S is None else pts.X[S]
    row: dict[str, float] = {}
    T_e = _lid_knn(pts, lid_k, S, "euclidean")
    if T_e is not None:
        lid_e = lid_from_knn_distances(T_e)
        if lid_cai_too:
            cai = lid_from_knn_distances(T_e, squared=True, divide_by_k=True)
            row["lid_euclidean_cai"] = float(np.nanmean(cai))
    else:
        D = None if pts.dist is None else _block(pts.dist, rows)
        lid_e = lid_mle(X, lid_k, "euclidean", per_point=True, distances=D)
        if lid_cai_too:
            row["lid_euclidean_cai"] = float(lid_cai(X, lid_k, distances=D))
    T_c = _lid_knn(pts, lid_k, S, "cosine")
    if T_c is not None:
        lid_c = lid_from_knn_distances(T_c)
    elif pts.chord is None:
        lid_c = lid_mle(X, lid_k, "cosine", per_point=True)
    else:  # the chord distances are the Euclidean distances of the unit vectors
        U, _ = _unit_rows(X)
        lid_c = lid_mle(U, lid_k, "euclidean", per_point=True, distances=_block(pts.chord, rows))
    row |= dict(
        zip(("lid_euclidean", "lid_euclidean_median"), _summaries(lid_e), strict=True)
    ) | dict(zip(("lid_cosine", "lid_cosine_median"), _summaries(lid_c), strict=True))

    labellings = {"silhouette_types": (pts.token_ids[rows], min_type_count)}
    if kmeans_silhouette and pts.best_labels is not None:
        labellings["kmeans_silhouette"] = (pts.best_labels[rows], 1)
    row |= _silhouettes_of_rows(pts, rows, labellings, max_points, seed)
    if kmeans_silhouette and pts.best_labels is None:
        row["kmeans_silhouette"] = float("nan")
    return row


def _standard_errors(
    pts: _PointSet,
    labels: np.ndarray,
    weighted_clusters: np.ndarray,
    type_vectors: np.ndarray | None,
    replicates: int,
    seed: int,
    occurrences: np.ndarray | None = None,
    **options: Any,
) -> dict[str, float]:
    """``<metric>_se`` of :data:`SE_METRICS` (:func:`half_sample_se`), NaN where not computed.

    Half-samples of the distinct points (K-means labels, and the clusters entering the
    weighted means, held fixed) for the silhouettes, LIDs and cluster-adjusted cosines and
    IsoScores; of the type-uniform sample's types for ``s_inter_type_uniform``; of the
    sampled ``occurrences`` (duplicates included) for ``isoscore_sample``. The partition
    isotropies have none (an eigendecomposition and a d-direction log-sum-exp per replicate:
    ~1.4 s per layer at d = 384).
    """

    def points_statistic(S: np.ndarray) -> dict[str, float]:
        adj = cluster_adjusted(
            pts.X[S], labels[S], pts.token_ids[S], weighted_clusters=weighted_clusters
        )
        return _point_set_metrics(pts, S=S, kmeans_silhouette=True, seed=seed, **options) | {
            "adjusted_s_inter": adj.s_inter,
            "adjusted_s_intra": adj.s_intra,
            "adjusted_s_inter_weighted": adj.s_inter_weighted,
            "adjusted_s_intra_weighted": adj.s_intra_weighted,
            "adjusted_isoscore": adj.isoscore,
            "adjusted_isoscore_weighted": adj.isoscore_weighted,
        }

    rng_seeds = np.random.SeedSequence([int(seed) % 2**63, 0x5E]).generate_state(3)
    se = half_sample_se(len(pts.X), points_statistic, replicates, int(rng_seeds[0]))
    if occurrences is not None:  # an occurrence average: half-samples of the occurrences
        se |= half_sample_se(
            len(occurrences),
            lambda S: {"isoscore_sample": isoscore_points(occurrences[S])},
            replicates,
            int(rng_seeds[2]),
        )
    if type_vectors is not None:
        se |= half_sample_se(
            len(type_vectors),
            lambda S: {"s_inter_type_uniform": mean_pairwise_cosine(type_vectors[S])},
            replicates,
            int(rng_seeds[1]),
        )
    return {f"{m}_se": se.get(m, float("nan")) for m in SE_METRICS}


def sampled_metrics_of_points(
    X: np.ndarray,
    token_ids: np.ndarray,
    type_vectors: np.ndarray | None = None,
    kmeans_result: SelectKResult | None = None,
    *,
    lid_k: int = LID_K,
    silhouette_max_points: int | None = SILHOUETTE_MAX_POINTS,
    min_type_count: int = 2,
    seed: int = 0,
    cluster_min_size: int = CLUSTER_MIN_SIZE,
    s_inter_draws: int = S_INTER_DRAWS,
    se_replicates: int = SE_REPLICATES,
    groups: np.ndarray | None = None,
    distances: np.ndarray | None = None,
) -> dict[str, float | int | bool]:
    """The sampled ``layers.parquet`` columns (:data:`SAMPLED_LAYER_COLUMNS`) of one layer's points.

    On the uniform sample X (n, d) with the token id of each row and ``groups``, the rows'
    content keys (:attr:`~embgeom_ray.core.samples.SamplePoints.content_keys`; None: rows are
    the same point only when bit-identical). Repeated points are handled per metric:

    - the geometry of the point set (K-means and its silhouette, cluster-adjusted metrics,
      ``silhouette_types``, LIDs) uses each *distinct* point once
      (:func:`embgeom_ray.core.distinct.distinct_rows` with ``groups``; the first row of each
      point in the sample's canonical order stands for it): copies would sit at distance ~0
      (LID undefined, silhouettes and clusters pulled toward the repeated text);
    - occurrence averages that estimate a corpus-wide, exact quantity (``isoscore_sample``,
      ``partition_isotropy*``, the sampled cosines of :func:`~.rogue.sampled_clipped_cosines`,
      ``s_inter_type_uniform``) count every occurrence, copies included, as the exact metrics
      do;
    - ``sample_duplicate_points``: n − the number of distinct points.

    The columns:

    - ``kmeans_k``, ``kmeans_silhouette``: Cai et al.'s k and the best silhouette over the k
      tried (:func:`embgeom_ray.core.kmeans_selection.select_k`; reported even when k = 1 is chosen);
      ``kmeans_best_k`` the k of that silhouette, ``kmeans_k_searched`` the largest k fitted
      (the scan's k up to it are: :func:`~embgeom_ray.core.kmeans_selection.scan_ks`),
      ``kmeans_k_at_cap`` whether the best k is that largest k (no interior optimum in the
      scan), ``kmeans_stability`` the mean adjusted Rand index of refits from other seedings,
      ``kmeans_k_support`` / ``kmeans_structure_support`` the shares of bootstrap resamples
      that take the reported k / its k = 1 vs k ≥ 2 decision
      (:func:`~embgeom_ray.core.kmeans_selection.decision_support`). ``kmeans_result`` is its result for these rows; None
      runs ``select_k`` here, in this process (same ``seed``, ``silhouette_max_points`` and
      ``groups``, its other defaults).
    - ``adjusted_s_inter``, ``adjusted_s_intra``, ``adjusted_isoscore`` (Cai's unweighted
      means), ``adjusted_*_weighted`` (size-weighted over clusters of ≥ ``cluster_min_size``
      points; ``adjusted_clusters_used``/``_left_out``), ``adjusted_s_inter_draws_mean``/``_std``
      (over ``s_inter_draws`` draws): :func:`cluster_adjusted` with the K-means labels (one
      cluster when k = 1: the layer mean is subtracted).
    - ``s_inter_type_uniform``: Cai's S_inter, the mean cosine between the occurrences of the
      type-uniform sample ``type_vectors`` (one random occurrence per type, different types),
      unadjusted; NaN without one. The sample stores one occurrence per type (a min-hash per
      type), so it is one draw; its ``_se`` measures how far another draw could fall.
    - ``isoscore_sample``: :func:`isoscore_points` of X.
    - ``lid_euclidean``, ``lid_cosine`` (means over points), ``lid_euclidean_median``,
      ``lid_cosine_median``: :func:`lid_mle` with k = ``lid_k``, true (not squared) distances;
      ``lid_euclidean_cai``: :func:`lid_cai` (Cai et al.'s convention: squared distances,
      divided by k), for comparisons with the paper.
    - ``silhouette_types``: :func:`silhouette_by_labels` with token-type labels, over the
      distinct points whose type has ≥ ``min_type_count`` of them (Mickus et al. 2024).
    - ``partition_isotropy``, ``partition_isotropy_centered``: :func:`partition_isotropy` of X.
    - ``<metric>_se`` for :data:`SE_METRICS`: half-sample (delete-d jackknife) standard errors
      over ``se_replicates`` half-samples (:func:`half_sample_se`; K-means labels held fixed);
      NaN when ``se_replicates`` < 2.

    When the distinct points number at most ``silhouette_max_points``, their Euclidean distance
    matrix (``sklearn.metrics.pairwise_distances`` of them minus their mean, or ``distances``,
    the same matrix computed for the K-means selection:
    :func:`~embgeom_ray.core.kmeans_selection.distinct_distances`) and that of their
    unit vectors are computed once and shared by the silhouettes, the LIDs and the
    half-samples (the same values: see :func:`lid_mle`'s ``distances``): a half-sample's
    silhouettes take its block of the matrix, and its LIDs read its points' nearest
    neighbours from one table per matrix (:mod:`.neighbours`: each point's 3(``lid_k`` + 1)
    nearest points and their distances, taken from the matrix within 1e-11 relative of the
    points' own, else computed from the points) instead of searching the block again. With more
    distinct points than that, no n × n matrix is held: the same two tables are built a block
    of rows at a time (:func:`~.neighbours.neighbour_tables_of_points`), and each silhouette
    takes one matrix of the points it scores (a half-sample's two share one).
    """
    X = _as_points(X)
    token_ids = np.asarray(token_ids)
    if token_ids.shape != (len(X),):
        raise ValueError(f"token_ids must be ({len(X)},), got {token_ids.shape}")
    if lid_k < 2:
        raise ValueError(f"lid_k must be >= 2, got {lid_k}")
    kmeans_result = _kmeans_of(X, kmeans_result, seed, silhouette_max_points, groups)
    labels = np.asarray(kmeans_result.labels)
    first, _ = distinct_rows(X, groups)
    pts = _distinct_point_set(
        X[first], token_ids[first], kmeans_result.best_labels, first, lid_k, silhouette_max_points,
        distances,
    )  # fmt: skip
    options = {
        "lid_k": lid_k,
        "max_points": silhouette_max_points,
        "min_type_count": min_type_count,
    }
    adj = cluster_adjusted(
        pts.X, labels[first], pts.token_ids, min_size=cluster_min_size, draws=s_inter_draws,
        seed=seed,
    )  # fmt: skip
    row: dict[str, Any] = (
        _kmeans_columns(kmeans_result)
        | _adjusted_columns(adj)
        | _occurrence_columns(X, type_vectors)
        | {"sample_duplicate_points": int(len(X) - len(pts.X))}
    )
    row |= _point_set_metrics(pts, kmeans_silhouette=False, seed=seed, lid_cai_too=True, **options)
    clusters, sizes = np.unique(labels[first], return_counts=True)
    row |= _standard_errors(
        pts,
        labels[first],
        clusters[sizes >= cluster_min_size],
        None if type_vectors is None else _as_points(type_vectors, "type_vectors"),
        se_replicates,
        seed,
        X,
        **options,
    )
    return {k: row[k] for k in SAMPLED_LAYER_COLUMNS}


def _kmeans_of(
    X: np.ndarray,
    kmeans_result: SelectKResult | None,
    seed: int,
    silhouette_max_points: int | None,
    groups: np.ndarray | None,
) -> SelectKResult:
    """``kmeans_result``, checked to label every row of X, or (None)
    :func:`~embgeom_ray.core.kmeans_selection.select_k` of X run here."""
    from .kmeans_selection import select_k

    if kmeans_result is None:
        kmeans_result = select_k(
            X, seed=seed, silhouette_max_points=silhouette_max_points, groups=groups
        )
    labels = np.asarray(kmeans_result.labels)
    if labels.shape != (len(X),):
        raise ValueError(
            f"kmeans_result has {labels.shape[0]} labels for {len(X)} points: fit K-means on X"
        )
    return kmeans_result


def _distinct_point_set(
    Xd: np.ndarray,
    token_ids: np.ndarray,
    best_labels: np.ndarray | None,
    first: np.ndarray,
    lid_k: int,
    max_points: int | None,
    distances: np.ndarray | None = None,
) -> _PointSet:
    """The :class:`_PointSet` of the distinct points Xd (rows ``first`` of the sample, with
    their ``token_ids``; ``best_labels`` per sample row).

    With 2 ≤ len(Xd) ≤ ``max_points`` it holds their Euclidean distances (of Xd minus its
    mean; ``distances`` when already computed) and, when no point is zero, those of their unit
    vectors (from the first: :func:`~.neighbours.chord_distances`), and with more than
    ``lid_k`` points each matrix's neighbour table (:func:`~.neighbours.neighbour_table`).
    With more points than ``max_points`` it holds no matrix, but the same two tables, built
    a block of rows at a time (:func:`~.neighbours.neighbour_tables_of_points`)."""
    dist = chord = euclid_nn = chord_nn = None
    if max_points is not None and 2 <= len(Xd) <= max_points:
        if distances is None:
            from sklearn.metrics import pairwise_distances

            distances = pairwise_distances(Xd - Xd.mean(axis=0))
        dist = distances
        U, nonzero = _unit_rows(Xd)
        chord = chord_distances(dist, np.linalg.norm(Xd, axis=1)) if nonzero.all() else None
        if len(Xd) > lid_k:  # the lists' distances from the matrices where they are exact
            P = Xd - Xd.mean(axis=0)  # the points the matrix is of
            euclid_nn = neighbour_table(Xd, dist, lid_k, euclidean_error(P, Xd))
            chord_nn = (
                None if chord is None else neighbour_table(U, chord, lid_k, chord_error(P, Xd, dist))
            )
    elif len(Xd) > lid_k:
        euclid_nn, chord_nn = neighbour_tables_of_points(Xd, lid_k)
    best = None if best_labels is None else np.asarray(best_labels)[first]
    return _PointSet(Xd, token_ids, best, dist, chord, euclid_nn, chord_nn)


def _kmeans_columns(result: SelectKResult) -> dict[str, Any]:
    """The ``kmeans_*`` columns of :func:`sampled_metrics_of_points` from ``select_k``'s result
    (``kmeans_silhouette``: the best silhouette of the scan)."""
    return {
        "kmeans_k": int(result.k),
        "kmeans_silhouette": float(result.silhouette),
        "kmeans_best_k": int(result.best_k),
        "kmeans_k_searched": int(result.k_searched),
        "kmeans_k_at_cap": bool(result.at_cap),
        "kmeans_stability": float(result.stability),
        "kmeans_k_support": float(result.k_support),
        "kmeans_structure_support": float(result.structure_support),
    }


def _adjusted_columns(adj: ClusterAdjusted) -> dict[str, Any]:
    """The ``adjusted_*`` columns of :func:`sampled_metrics_of_points`: :func:`cluster_adjusted`'s
    values under their column names."""
    return {
        "adjusted_s_inter": adj.s_inter,
        "adjusted_s_intra": adj.s_intra,
        "adjusted_isoscore": adj.isoscore,
        "adjusted_s_inter_weighted": adj.s_inter_weighted,
        "adjusted_s_intra_weighted": adj.s_intra_weighted,
        "adjusted_isoscore_weighted": adj.isoscore_weighted,
        "adjusted_clusters_used": adj.clusters_used,
        "adjusted_clusters_left_out": adj.clusters_left_out,
        "adjusted_s_inter_draws_mean": adj.s_inter_draws_mean,
        "adjusted_s_inter_draws_std": adj.s_inter_draws_std,
    }


def _occurrence_columns(X: np.ndarray, type_vectors: np.ndarray | None) -> dict[str, float]:
    """The occurrence averages, every row of the sample X counted (copies included):
    ``isoscore_sample`` and ``partition_isotropy*`` of X, ``s_inter_type_uniform`` the mean
    pairwise cosine of ``type_vectors`` (NaN without them); NaN partition isotropies for
    an empty X.

    With more rows n than dimensions, one product X_cᵀX_c of the centred rows
    serves all three: IsoScore's covariance, the centred partition isotropy's WᵀW, and, plus
    n μμᵀ, the uncentred one's (XᵀX = X_cᵀX_c + n μμᵀ): one product of n · d² instead of
    three (2.7 s each at n = 8,192, d = 4,096 on one core).
    """
    row = {
        "s_inter_type_uniform": (
            float("nan") if type_vectors is None else mean_pairwise_cosine(type_vectors)
        )
    }
    n, d = X.shape
    if n <= max(d, 1):  # the n × n Gram matrices (partition_isotropy, isoscore_points)
        return row | {
            "isoscore_sample": isoscore_points(X),
            "partition_isotropy": partition_isotropy(X) if n else float("nan"),
            "partition_isotropy_centered": (
                partition_isotropy(X, centered=True) if n else float("nan")
            ),
        }
    X = _as_points(X)
    mu = X.mean(axis=0)
    Xc = X - mu
    C = Xc.T @ Xc
    return row | {
        "isoscore_sample": isoscore_from_covariance(C) if d >= 2 else float("nan"),
        "partition_isotropy": _partition_isotropy_of(X, C + n * np.outer(mu, mu)),
        "partition_isotropy_centered": _partition_isotropy_of(Xc, C),
    }


def isoscore_silhouette_correlation(
    layers_df: pd.DataFrame,
    isoscore_column: str = "isoscore",
    silhouette_column: str = "kmeans_silhouette",
) -> float:
    """Pearson r across layers (rows) between IsoScore and silhouette (Mickus et al. 2024).

    r = Σ (a_l − ā)(b_l − b̄) / √(Σ (a_l − ā)² Σ (b_l − b̄)²) over rows where both are finite;
    Mickus et al. find isotropy and cluster structure at odds (negative r). NaN with fewer than
    3 such rows or a constant column. Works on ``layers.parquet`` of one or several runs.
    """
    for col in (isoscore_column, silhouette_column):
        if col not in layers_df.columns:
            raise KeyError(f"layers table has no column {col!r}")
    a = layers_df[isoscore_column].to_numpy(dtype=np.float64)
    b = layers_df[silhouette_column].to_numpy(dtype=np.float64)
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    if len(a) < 3 or np.std(a) == 0 or np.std(b) == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])
