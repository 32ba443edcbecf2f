"""Metrics that need points: pure functions of the sampled occurrences (numpy float64).

The exact, moment-based metrics are in :mod:`embgeom_ray.core.metrics`; these run on the bounded
samples of :class:`~embgeom_ray.core.samples.ActivationSample` (uniform: the ``size`` occurrences
of smallest key; type-uniform: one random occurrence per sampled token type), with the K-means
model selection of :mod:`embgeom_ray.core.kmeans` / :mod:`embgeom_ray.distributed.kmeans`.

Cosine means over pairs use unit-vector sums: for unit vectors u_1..u_m with U = Σ u_i, the
mean cosine over the m(m − 1) ordered pairs i ≠ j is (||U||² − m) / (m(m − 1)), exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, NamedTuple

import numpy as np
import pandas as pd
from scipy.special import logsumexp

from ..config import JobConfig
from .kmeans import SILHOUETTE_MAX_POINTS
from .metrics import isoscore_from_covariance, mean_cosine_from_unit_sum

if TYPE_CHECKING:
    from .kmeans import SelectKResult
    from .samples import ActivationSample

#: the ``layers.parquet`` columns :func:`sampled_layer_metrics` returns, in order.
SAMPLED_LAYER_COLUMNS = [
    "kmeans_k", "kmeans_silhouette", "adjusted_s_inter", "adjusted_s_intra",
    "adjusted_isoscore", "s_inter_type_uniform", "isoscore_sample", "lid_euclidean",
    "lid_cosine", "silhouette_types", "partition_isotropy", "partition_isotropy_centered",
]  # fmt: skip

#: default neighbours of the LID estimate (the job's ``--lid-k``)
LID_K: int = JobConfig.model_fields["lid_k"].default


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

    :func:`embgeom_ray.core.metrics.isoscore_from_covariance` on cov(X) (float64): with λ the
    eigenvalues, n = d, λ̂ = √n λ/||λ||, δ = ||λ̂ − 1|| / √(2(n − √n)),
    k = (n − δ²(n − √n))²/n, IsoScore = (k − 1)/(n − 1). Equals ``IsoScore.IsoScore(X)``
    (which takes √n in float32, so to ~1e-6). NaN for fewer than 2 points.
    """
    X = _as_points(X)
    if len(X) < 2 or X.shape[1] < 2:
        return float("nan")
    Xc = X - X.mean(axis=0)
    return isoscore_from_covariance(Xc.T @ Xc / (len(X) - 1))


def _knn_from_distances(D: np.ndarray, keep: np.ndarray, m: int) -> np.ndarray:
    """(len(keep), m) indices into ``keep`` of the m smallest D[keep_i, keep_j] (unordered)."""
    n = len(keep)
    if n == len(D):  # no duplicates: partial sort of D as is, then renumber rows and columns
        pos = np.empty(n, np.int64)
        pos[keep] = np.arange(n)
        return pos[_smallest_per_row(D, m)[keep]]
    return _smallest_per_row(D[np.ix_(keep, keep)], m)


def _smallest_per_row(D: np.ndarray, m: int) -> np.ndarray:
    """(rows, m) column indices of the m smallest entries of each row of D (unordered).

    ``torch.topk`` over blocks of rows: ~4x faster than ``np.argpartition`` on a 4096 × 4096
    matrix; ties between equal distances may pick either column, as with argpartition.
    """
    import torch

    Dt = torch.from_numpy(np.ascontiguousarray(D))
    out = np.empty((len(D), m), np.int64)
    for a in range(0, len(D), 1024):  # row blocks bound the (rows, m) outputs' scratch
        top = torch.topk(Dt[a : a + 1024], m, dim=1, largest=False, sorted=False)
        out[a : a + 1024] = top.indices.numpy()
    return out


def lid_mle(
    X: np.ndarray,
    k: int = 20,
    metric: Literal["euclidean", "cosine"] = "euclidean",
    squared: bool = False,
    *,
    per_point: bool = False,
    distances: np.ndarray | None = None,
) -> float | np.ndarray:
    """Local intrinsic dimension, Levina & Bickel (2005)'s MLE averaged over points.

    For each point x with distances T_1 ≤ … ≤ T_k to its k nearest other points (exact kNN),
    m̂(x) = [ (1/(k − 1)) Σ_{j<k} log(T_k / T_j) ]⁻¹; returns mean_x m̂(x) (or the per-point
    values with ``per_point=True``). Duplicate points are removed first (the estimator
    assumes distinct points).

    ``metric="euclidean"``: T = ||x − y||. ``metric="cosine"``: T = the chord distance
    ||x/||x|| − y/||y|||| = √(2 − 2 cos(x, y)) between directions (zero vectors dropped), a
    true metric locally proportional to the angle; it measures the dimension of the set of
    directions (a 5-dim subspace through the origin has 4-dim directions). Note that
    1 − cos = chord²/2 is a *squared* distance: using it as T halves the estimate.

    ``squared=True`` uses T² instead of T, the convention of Cai et al. (2021)'s released
    code: every log ratio doubles, so the estimate is exactly half of the default one. Say
    which convention a reported number uses. k = 20 is the default (Levina & Bickel report
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
    if squared:
        T = T**2
    logs = np.log(T[:, -1:] / T[:, :-1]).sum(axis=1) / (k - 1)
    with np.errstate(divide="ignore"):
        m_hat = np.where(logs > 0, 1.0 / logs, np.nan)
    return m_hat if per_point else float(np.nanmean(m_hat))


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
    ``max_points`` points are drawn with ``seed``. NaN unless 2 ≤ #labels ≤ n − 1.

    ``distances``: the (n, n) matrix of ``metric`` distances between the rows of ``X``, if
    already computed; the silhouette is then taken on its rows and columns of the selected
    points (:func:`embgeom_ray.core.kmeans.silhouette_from_distances`, the same value).
    """
    from sklearn.metrics import silhouette_score

    from .kmeans import silhouette_from_distances

    X = _as_points(X)
    labels = np.asarray(labels)
    if labels.shape != (len(X),):
        raise ValueError(f"labels must be ({len(X)},), got {labels.shape}")
    if distances is not None and np.shape(distances) != (len(X), len(X)):
        raise ValueError(f"distances must be ({len(X)}, {len(X)}), got {np.shape(distances)}")
    sel = np.arange(len(X))
    if min_label_count > 1:
        _, inv, cnt = np.unique(labels, return_inverse=True, return_counts=True)
        sel = sel[cnt[inv.reshape(-1)] >= min_label_count]
    if max_points is not None and len(sel) > max_points:
        idx = np.sort(np.random.default_rng(seed).choice(len(sel), max_points, replace=False))
        sel = sel[idx]
    labels = labels[sel]
    n_labels = len(np.unique(labels))
    if n_labels < 2 or n_labels > len(sel) - 1:
        return float("nan")
    if distances is not None:
        D = np.asarray(distances)
        return silhouette_from_distances(D if len(sel) == len(D) else D[np.ix_(sel, sel)], labels)
    return float(silhouette_score(X[sel], labels, metric=metric))


def partition_isotropy(W: np.ndarray, centered: bool = False) -> float:
    """Partition-function isotropy I(W) (Mu & Viswanath 2018, "All-but-the-Top").

    I(W) = min_c Z(c) / max_c Z(c), Z(c) = Σ_w exp(cᵀw), c over the unit eigenvectors of WᵀW
    and their negatives (both signs: an eigenvector's sign is arbitrary). Computed with
    log Z(c) = logsumexp_w(cᵀw), I = exp(min log Z − max log Z), so it never overflows (it may
    underflow to 0 for very anisotropic sets). ``centered=True`` first subtracts the mean
    vector (the paper's post-processing view). 1 for an isotropic symmetric set; in [0, 1].
    """
    W = _as_points(W, "W")
    if len(W) == 0:
        return float("nan")
    if centered:
        W = W - W.mean(axis=0)
    _, vecs = np.linalg.eigh(W.T @ W)
    proj = W @ vecs  # (n, d): cᵀw for every eigenvector c
    log_z = np.concatenate([logsumexp(proj, axis=0), logsumexp(-proj, axis=0)])
    return float(np.exp(log_z.min() - log_z.max()))


class ClusterAdjusted(NamedTuple):
    """Cluster-adjusted metrics (unweighted means over clusters) and the clusters used."""

    s_inter: float
    s_intra: float
    isoscore: float
    n_clusters: int


def cluster_adjusted(
    X: np.ndarray,
    labels: np.ndarray,
    token_ids: np.ndarray,
    inter_mask: np.ndarray | None = None,
) -> ClusterAdjusted:
    """Cai et al. (2021, Sec. 4)'s cluster-adjusted S_inter, S_intra and IsoScore.

    Inside each cluster C (points with the same label) subtract the cluster mean μ_C, then
    with u = (x − μ_C)/||x − μ_C|| (points equal to μ_C left out):

    - S_inter(C) = mean cosine over pairs of *different* types, one occurrence per type:
      (||Σ u||² − m)/(m(m − 1)) over the m selected occurrences. ``inter_mask`` selects them;
      by default the first occurrence of each type within C in row order (the samples' rows are
      in random-key order, so that is a uniformly random occurrence);
    - S_intra(C) = unweighted mean over types t with n_t ≥ 2 in C of the mean cosine between
      t's occurrences, (||U_t||² − n_t)/(n_t(n_t − 1)), U_t = Σ_{x of type t in C} u;
    - IsoScore(C) = :func:`isoscore_points` of C's points (IsoScore is translation invariant).

    Each is the unweighted mean over the clusters where it is defined (NaN if none).
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
    inters, intras, isos = [], [], []
    clusters = np.unique(labels)
    for c in clusters:
        rows = np.flatnonzero(labels == c)
        Xc = X[rows] - X[rows].mean(axis=0)
        u, ok = _unit_rows(Xc)
        tok = token_ids[rows][ok]
        types, first, inv, cnt = np.unique(
            tok, return_index=True, return_inverse=True, return_counts=True
        )
        if inter_mask is None:
            pick = first
        else:
            pick = np.flatnonzero(inter_mask[rows][ok])
        m = len(pick)
        if m >= 2:
            s = u[pick].sum(axis=0)
            inters.append(mean_cosine_from_unit_sum(s @ s, m))
        multi = cnt >= 2
        if multi.any():
            sums = np.zeros((len(types), X.shape[1]))
            np.add.at(sums, inv, u)
            n_t = cnt[multi].astype(np.float64)
            u2 = np.einsum("td,td->t", sums[multi], sums[multi])
            intras.append(float(np.mean(mean_cosine_from_unit_sum(u2, n_t))))
        if len(rows) >= 2:
            isos.append(isoscore_points(X[rows]))

    def mean(values: Sequence[float]) -> float:
        vals = np.asarray(values, dtype=np.float64)
        vals = vals[np.isfinite(vals)]
        return float(vals.mean()) if len(vals) else float("nan")

    return ClusterAdjusted(mean(inters), mean(intras), mean(isos), len(clusters))


def sampled_layer_metrics(
    sample: ActivationSample,
    layer: int,
    kmeans_result: SelectKResult | None = None,
    *,
    lid_k: int = LID_K,
    silhouette_max_points: int | None = SILHOUETTE_MAX_POINTS,
    min_type_count: int = 2,
    seed: int = 0,
) -> dict[str, float | int]:
    """The sampled ``layers.parquet`` columns of one layer (:data:`SAMPLED_LAYER_COLUMNS`).

    :func:`sampled_metrics_of_points` of the uniform sample of ``layer`` (rows of
    ``sample.points(layer)``) and, when the sample has a type-uniform part of ≥ 2 types, the
    type-uniform vectors ``sample.type_points(layer).vectors``. ``kmeans_result`` is
    :func:`embgeom_ray.core.kmeans.select_k`'s result for these rows (e.g. from
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
        pts.vectors,
        pts.token_ids,
        type_vectors,
        kmeans_result,
        lid_k=lid_k,
        silhouette_max_points=silhouette_max_points,
        min_type_count=min_type_count,
        seed=seed,
    )


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
) -> dict[str, float | int]:
    """The sampled ``layers.parquet`` columns (:data:`SAMPLED_LAYER_COLUMNS`) of one layer's points.

    On the uniform sample X (n, d) with the token id of each row:

    - ``kmeans_k``, ``kmeans_silhouette``: Cai et al.'s k and the best silhouette over the k
      tried (:func:`embgeom_ray.core.kmeans.select_k`; reported even when k = 1 is chosen).
      ``kmeans_result`` is its result for these rows; None runs ``select_k`` here, in this
      process (same ``seed`` and ``silhouette_max_points``, its other defaults).
    - ``adjusted_s_inter``, ``adjusted_s_intra``, ``adjusted_isoscore``: :func:`cluster_adjusted`
      with the K-means labels (one cluster when k = 1: the layer mean is subtracted).
    - ``s_inter_type_uniform``: Cai's S_inter, the mean cosine between the occurrences of the
      type-uniform sample ``type_vectors`` (one random occurrence per type, different types),
      unadjusted; NaN without one.
    - ``isoscore_sample``: :func:`isoscore_points` of X.
    - ``lid_euclidean``, ``lid_cosine``: :func:`lid_mle` with k = ``lid_k``, true (not squared)
      distances.
    - ``silhouette_types``: :func:`silhouette_by_labels` with token-type labels, over the
      points whose type occurs ≥ ``min_type_count`` times in X (Mickus et al. 2024).
    - ``partition_isotropy``, ``partition_isotropy_centered``: :func:`partition_isotropy` of X.

    When X has at most ``silhouette_max_points`` points, the Euclidean distance matrix of X
    (``sklearn.metrics.pairwise_distances`` of X minus its mean) is computed once and shared by
    ``silhouette_types`` and ``lid_euclidean`` (the same values: see their ``distances``).
    """
    from sklearn.metrics import pairwise_distances

    from .kmeans import select_k

    X = _as_points(X)
    token_ids = np.asarray(token_ids)
    if token_ids.shape != (len(X),):
        raise ValueError(f"token_ids must be ({len(X)},), got {token_ids.shape}")
    if kmeans_result is None:
        kmeans_result = select_k(X, seed=seed, silhouette_max_points=silhouette_max_points)
    labels = np.asarray(kmeans_result.labels)
    if labels.shape != (len(X),):
        raise ValueError(
            f"kmeans_result has {labels.shape[0]} labels for {len(X)} points: fit K-means on X"
        )
    dist = None
    if silhouette_max_points is not None and 2 <= len(X) <= silhouette_max_points:
        dist = pairwise_distances(X - X.mean(axis=0))
    adj = cluster_adjusted(X, labels, token_ids)
    s_inter_tu = float("nan")
    if type_vectors is not None:
        s_inter_tu = mean_pairwise_cosine(type_vectors)
    row = {
        "kmeans_k": int(kmeans_result.k),
        "kmeans_silhouette": float(kmeans_result.silhouette),
        "adjusted_s_inter": adj.s_inter,
        "adjusted_s_intra": adj.s_intra,
        "adjusted_isoscore": adj.isoscore,
        "s_inter_type_uniform": s_inter_tu,
        "isoscore_sample": isoscore_points(X),
        "lid_euclidean": float(lid_mle(X, lid_k, "euclidean", distances=dist)),
        "lid_cosine": float(lid_mle(X, lid_k, "cosine")),
        "silhouette_types": silhouette_by_labels(
            X,
            token_ids,
            max_points=silhouette_max_points,
            seed=seed,
            min_label_count=min_type_count,
            distances=dist,
        ),
        "partition_isotropy": partition_isotropy(X) if len(X) else float("nan"),
        "partition_isotropy_centered": (
            partition_isotropy(X, centered=True) if len(X) else float("nan")
        ),
    }
    return {k: row[k] for k in SAMPLED_LAYER_COLUMNS}


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
