"""Sampled metrics that hold up (issue 19): duplicates, small clusters, draws, LID summaries,
like-for-like clipping and standard errors, on constructed data whose answer is known."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.spatial.distance import cdist
from sklearn.metrics import silhouette_score

from embgeom_ray.core.kmeans_selection import select_k
from embgeom_ray.core.rogue import sampled_clipped_cosines
from embgeom_ray.core.sampled_metrics import (
    SAMPLED_LAYER_COLUMNS,
    SE_METRICS,
    cluster_adjusted,
    half_sample_se,
    isoscore_points,
    lid_cai,
    lid_mle,
    partition_isotropy,
    sampled_metrics_of_points,
    silhouette_by_labels,
)
from tests import reference as ref
from tests.core.test_sampled_metrics import brute_cos_mean, clustered_sample

# ------------------------------------------------------------------ duplicates


@pytest.fixture(scope="module")
def planted():
    """A clustered sample's layer 4, and the same points with 150 planted exact copies."""
    sample = clustered_sample()
    pts = sample.points(4)
    X, tok = pts.vectors, pts.token_ids
    rng = np.random.default_rng(8)
    copies = rng.choice(len(X), size=150)  # some rows copied several times
    Xdup = np.vstack([X, X[copies]])
    tokdup = np.concatenate([tok, tok[copies]])
    tv = sample.type_points(4).vectors
    opts = {"lid_k": 10, "se_replicates": 3, "s_inter_draws": 5}
    row = sampled_metrics_of_points(X, tok, tv, **opts)
    dup = sampled_metrics_of_points(Xdup, tokdup, tv, **opts)
    return X, tok, Xdup, tokdup, row, dup


GEOMETRY = [
    c
    for c in SAMPLED_LAYER_COLUMNS
    if c.startswith(("kmeans_", "adjusted_", "lid_", "silhouette_types"))
]


def test_duplicates_are_counted_and_handled_per_metric(planted):
    X, tok, Xdup, tokdup, row, dup = planted
    assert row["sample_duplicate_points"] == 0 and dup["sample_duplicate_points"] == 150
    # the geometry of the point set: each distinct point once, so exactly the undisturbed values
    assert len(GEOMETRY) >= 30
    for column in GEOMETRY:
        np.testing.assert_array_equal(dup[column], row[column], err_msg=column)
    # silhouette by type: sklearn over the distinct points whose type has >= 2 of them
    _, inv, counts = np.unique(tok, return_inverse=True, return_counts=True)
    keep = counts[inv] >= 2
    np.testing.assert_allclose(
        dup["silhouette_types"], silhouette_score(X[keep], tok[keep]), rtol=1e-10
    )
    # kept, the copies (at distance 0 from their point) would raise it
    naive = silhouette_by_labels(Xdup, tokdup, min_label_count=2)
    assert naive > dup["silhouette_types"] + 0.01
    # occurrence averages estimate corpus-wide quantities: every occurrence counts
    assert dup["isoscore_sample"] == isoscore_points(Xdup) != row["isoscore_sample"]
    np.testing.assert_allclose(dup["partition_isotropy"], partition_isotropy(Xdup), rtol=1e-9)
    # the K-means labels of copies are their point's
    km = select_k(Xdup, seed=0)
    np.testing.assert_array_equal(km.labels[len(X) :], km.labels[: len(X)][_copies(X, Xdup)])


def _copies(X: np.ndarray, Xdup: np.ndarray) -> np.ndarray:
    """Index in X of each appended copy (brute force)."""
    extra = Xdup[len(X) :]
    return np.array([np.flatnonzero((X == e).all(axis=1))[0] for e in extra])


# ------------------------------------------------------ cluster-adjusted metrics


def tiny_two_type_cluster():
    """Cluster 0: three types at (2, 0), (−1, 1), (−1, −1) around a far centre (S_inter
    −√2/3); cluster 1: the two types '+' and '−' at ±e1 around another (S_inter −1)."""
    d = 6
    e = np.eye(d)
    c0, c1 = 50.0 * e[2] + 20.0 * e[3], -40.0 * e[4]
    X = np.array([c0 + 2 * e[0], c0 - e[0] + e[1], c0 - e[0] - e[1], c1 + 3 * e[0], c1 - 3 * e[0]])
    labels = np.array([0, 0, 0, 1, 1])
    tokens = np.array([10, 11, 12, 20, 21])
    return X, labels, tokens


def test_tiny_cluster_weighted_and_unweighted_exact_values():
    X, labels, tokens = tiny_two_type_cluster()
    a, b = -np.sqrt(2) / 3, -1.0
    got = cluster_adjusted(X, labels, tokens, min_size=1, draws=4)
    # Cai's unweighted mean: the two-point cluster weighs as much as the other
    assert got.s_inter == pytest.approx((a + b) / 2, rel=1e-12)
    # size-weighted (3 and 2 points)
    assert got.s_inter_weighted == pytest.approx((3 * a + 2 * b) / 5, rel=1e-12)
    iso = [isoscore_points(X[:3]), isoscore_points(X[3:])]
    assert got.isoscore == pytest.approx(np.mean(iso), rel=1e-12)
    assert got.isoscore_weighted == pytest.approx((3 * iso[0] + 2 * iso[1]) / 5, rel=1e-12)
    assert np.isnan(got.s_intra) and np.isnan(got.s_intra_weighted)  # no type twice
    assert (got.n_clusters, got.clusters_used, got.clusters_left_out) == (2, 2, 0)
    # one occurrence per type: every draw is the same one
    assert got.s_inter_draws_mean == pytest.approx(got.s_inter, rel=1e-12)
    assert got.s_inter_draws_std == 0.0
    # a minimum size of 3 leaves the two-point cluster out of the weighted means only
    big = cluster_adjusted(X, labels, tokens, min_size=3)
    assert big.s_inter == got.s_inter
    assert big.s_inter_weighted == pytest.approx(a, rel=1e-12)
    assert big.isoscore_weighted == pytest.approx(iso[0], rel=1e-12)
    assert (big.clusters_used, big.clusters_left_out) == (1, 1)
    # or by naming the clusters that enter
    named = cluster_adjusted(X, labels, tokens, weighted_clusters=[1])
    assert named.s_inter_weighted == pytest.approx(b, rel=1e-12)


def test_s_inter_draws_mean_is_exact_over_every_draw():
    """Enumerate all one-occurrence-per-type draws of a cluster: their mean is the closed form."""
    rng = np.random.default_rng(9)
    tokens = np.array([1, 1, 1, 2, 2, 3, 3, 4, 2])
    X = rng.normal(size=(9, 5)) + 4.0
    Xc = X - X.mean(axis=0)
    groups = [np.flatnonzero(tokens == t) for t in np.unique(tokens)]
    values = [brute_cos_mean(Xc[list(pick)]) for pick in itertools.product(*groups)]
    assert len(values) == 3 * 3 * 2 * 1
    got = cluster_adjusted(X, np.zeros(9), tokens, draws=4000, seed=3)
    np.testing.assert_allclose(got.s_inter_draws_mean, np.mean(values), rtol=1e-12)
    # Cai's single draw: the first occurrence of each type
    firsts = [g[0] for g in groups]
    np.testing.assert_allclose(got.s_inter, brute_cos_mean(Xc[firsts]), rtol=1e-12)
    # the spread of one draw, by Monte Carlo (4000 draws: ~1% relative error)
    np.testing.assert_allclose(got.s_inter_draws_std, np.std(values), rtol=0.06)
    assert np.isnan(cluster_adjusted(X, np.zeros(9), tokens, draws=1).s_inter_draws_std)


# ------------------------------------------------------------------------- LID


def test_lid_median_recovers_the_dimension_where_the_mean_follows_the_tail():
    """2000 points of a 3-dim subspace of R^60 plus 100 isolated points: the isolated points'
    nearest neighbours are all about equally far, so their estimates are huge (the tail)."""
    rng = np.random.default_rng(10)
    Q = np.linalg.qr(rng.normal(size=(60, 60)))[0]
    X = rng.normal(size=(2000, 3)) @ Q[:, :3].T
    far = 6.0 * rng.normal(size=(100, 60))
    per_point = lid_mle(np.vstack([X, far]), k=20, per_point=True)
    median, mean = float(np.median(per_point)), float(np.mean(per_point))
    assert abs(median - 3.0) <= 0.35, median
    assert mean > median + 2.0, (mean, median)
    # the uniform 2-sphere, curved, rotated into 60 dims: median about 2
    S = rng.normal(size=(3000, 3))
    S = (S / np.linalg.norm(S, axis=1, keepdims=True)) @ Q[:, 3:6].T
    assert abs(float(np.median(lid_mle(S, k=20, per_point=True))) - 2.0) <= 0.25


def test_lid_cai_equals_the_released_formula():
    """m̂(x) = [ (1/k) Σ_{j=1..k} log(T_k² / T_j²) ]⁻¹, from an explicit distance matrix."""
    rng = np.random.default_rng(11)
    X = rng.normal(size=(300, 3)) @ rng.normal(size=(3, 8)) + 1.0
    k = 12
    D = cdist(X, X)
    np.fill_diagonal(D, np.inf)
    T2 = np.sort(D, axis=1)[:, :k] ** 2
    per_point = k / np.log(T2[:, -1:] / T2).sum(axis=1)
    np.testing.assert_allclose(lid_cai(X, k), per_point.mean(), rtol=1e-10)
    np.testing.assert_allclose(
        np.sort(lid_cai(X, k, per_point=True)), np.sort(per_point), rtol=1e-10
    )
    # k / (2 (k − 1)) times the Levina–Bickel estimate: "times 2" is 1/(k − 1) off
    np.testing.assert_allclose(lid_cai(X, k), k / (2 * (k - 1)) * lid_mle(X, k), rtol=1e-12)


def test_row_lid_columns(planted):
    X, _, _, _, row, _ = planted
    per_point = lid_mle(X, 10, per_point=True)
    np.testing.assert_allclose(row["lid_euclidean"], per_point.mean(), rtol=1e-12)
    np.testing.assert_allclose(row["lid_euclidean_median"], np.median(per_point), rtol=1e-12)
    cosine = lid_mle(X, 10, metric="cosine", per_point=True)
    np.testing.assert_allclose(row["lid_cosine_median"], np.median(cosine), rtol=1e-12)
    np.testing.assert_allclose(row["lid_euclidean_cai"], lid_cai(X, 10), rtol=1e-12)


# -------------------------------------------------------------------- clipping


def test_sampled_clipping_is_compared_over_the_same_points():
    rng = np.random.default_rng(12)
    X = rng.normal(size=(400, 10)) + np.r_[8.0, np.zeros(9)]
    tok = rng.integers(0, 40, 400)
    none = sampled_clipped_cosines(X, tok, [])
    for name in ("anisotropy", "s_inter", "s_intra"):
        assert none[f"{name}_clipped"] == none[f"{name}_sampled"]  # nothing to clip
    got = sampled_clipped_cosines(X, tok, [0])
    _, aniso, s_inter, s_intra = ref.brute_force_cosines(X, tok)
    np.testing.assert_allclose(
        [got["anisotropy_sampled"], got["s_inter_sampled"], got["s_intra_sampled"]],
        [aniso, s_inter, s_intra],
        rtol=1e-9,
    )
    clipped = X.copy()
    clipped[:, 0] = 0.0
    _, aniso_c, s_inter_c, s_intra_c = ref.brute_force_cosines(clipped, tok)
    np.testing.assert_allclose(
        [got["anisotropy_clipped"], got["s_inter_clipped"], got["s_intra_clipped"]],
        [aniso_c, s_inter_c, s_intra_c],
        rtol=1e-9,
    )
    assert got["anisotropy_clipped"] < got["anisotropy_sampled"] - 0.3  # the offset dimension


# ------------------------------------------------------------- standard errors


def test_half_sample_se_of_a_mean_and_a_median():
    v = np.random.default_rng(13).normal(size=2000)
    se = half_sample_se(
        len(v), lambda S: {"mean": v[S].mean(), "median": np.median(v[S])}, 400, seed=1
    )
    np.testing.assert_allclose(se["mean"], v.std(ddof=1) / np.sqrt(len(v)), rtol=0.12)
    # the median's asymptotic SE, √(π/2) σ/√n
    np.testing.assert_allclose(se["median"], np.sqrt(np.pi / 2 / len(v)), rtol=0.2)
    assert half_sample_se(len(v), lambda S: {"mean": 0.0}, 1) == {}
    assert np.isnan(half_sample_se(len(v), lambda S: {"x": np.nan}, 5)["x"])


def test_standard_error_columns(planted):
    _, _, _, _, row, _ = planted
    for m in SE_METRICS:
        assert np.isfinite(row[f"{m}_se"]) and row[f"{m}_se"] > 0, m
    X, tok = planted[0], planted[1]
    off = sampled_metrics_of_points(X, tok, lid_k=10, se_replicates=0, s_inter_draws=5)
    assert all(np.isnan(off[f"{m}_se"]) for m in SE_METRICS)
    # the metrics themselves do not depend on their standard errors
    for column in (c for c in GEOMETRY if not c.endswith("_se")):
        np.testing.assert_array_equal(off[column], row[column], err_msg=column)
