"""Sampled metrics against known answers, brute force and the reference packages."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.metrics import pairwise_distances, silhouette_score

from embgeom_ray.core.kmeans_selection import select_k
from embgeom_ray.core.sampled_metrics import (
    SAMPLED_LAYER_COLUMNS,
    chord_distances,
    cluster_adjusted,
    isoscore_points,
    isoscore_silhouette_correlation,
    lid_mle,
    mean_pairwise_cosine,
    partition_isotropy,
    sampled_layer_metrics,
    sampled_metrics_of_points,
    silhouette_by_labels,
)
from embgeom_ray.core.samples import ActivationSample


@pytest.fixture(scope="module")
def subspace():
    """3000 Gaussian points of a 5-dim subspace, randomly rotated into 384 dims, and its basis."""
    rng = np.random.default_rng(0)
    Q = np.linalg.qr(rng.normal(size=(384, 384)))[0]
    Z = rng.normal(size=(3000, 6))
    return Z, Q


def test_lid_recovers_a_5_dim_subspace_in_384_dims(subspace):
    Z, Q = subspace
    X = Z[:, :5] @ Q[:, :5].T
    per_point = lid_mle(X, k=20, per_point=True)
    lid = float(np.mean(per_point))
    assert abs(lid - 5.0) <= 0.5, lid
    assert per_point.shape == (len(X),)
    # Cai et al.'s released code used squared distances: exactly half
    np.testing.assert_allclose(lid_mle(X, k=20, squared=True), lid / 2, rtol=1e-12)
    # invariant to scale, translation and duplicated points
    np.testing.assert_allclose(lid_mle(7.0 * X + 3.0, k=20), lid, rtol=1e-8)
    np.testing.assert_allclose(lid_mle(np.vstack([X, X[:50]]), k=20), lid, rtol=1e-12)


def test_lid_from_a_shared_distance_matrix_equals_nearest_neighbors(subspace):
    """``distances`` (e.g. the silhouette's matrix) gives the same neighbours, so the same LID."""
    Z, Q = subspace
    X = Z[:1500, :5] @ Q[:, :5].T + 2.0
    D = pairwise_distances(X - X.mean(axis=0))
    ref = lid_mle(X, k=20, per_point=True)
    np.testing.assert_allclose(lid_mle(X, k=20, per_point=True, distances=D), ref, rtol=1e-12)
    assert abs(float(np.mean(ref)) - 5.0) <= 0.5
    np.testing.assert_allclose(
        lid_mle(X, k=20, squared=True, distances=D), lid_mle(X, k=20, squared=True), rtol=1e-12
    )
    # duplicated rows are dropped from the matrix as from the points
    Xd = np.vstack([X, X[:40]])
    Dd = pairwise_distances(Xd)
    np.testing.assert_allclose(lid_mle(Xd, k=20, per_point=True, distances=Dd), ref, rtol=1e-12)
    with pytest.raises(ValueError, match="distances"):
        lid_mle(X, metric="cosine", distances=D)
    with pytest.raises(ValueError, match="distances"):
        lid_mle(X, distances=D[:10, :10])


def test_cosine_lid_on_curved_manifolds(subspace):
    Z, Q = subspace
    # An affine 5-plane off the origin: its directions form a curved 5-dim patch of the sphere
    # (the gnomonic projection), so the cosine LID is 5 as well.
    affine = np.hstack([Z[:, :5], np.full((len(Z), 1), 3.0)]) @ Q[:, :6].T
    assert abs(lid_mle(affine, metric="euclidean") - 5.0) <= 0.5
    assert abs(lid_mle(affine, metric="cosine") - 5.0) <= 0.5
    # A 5-dim subspace through the origin has 4-dim directions (the sphere S⁴).
    linear = Z[:, :5] @ Q[:, :5].T
    assert abs(lid_mle(linear, metric="cosine") - 4.0) <= 0.4
    np.testing.assert_allclose(
        lid_mle(linear, metric="cosine", squared=True), lid_mle(linear, metric="cosine") / 2
    )


def test_isoscore_equals_the_isoscore_package():
    from IsoScore import IsoScore

    rng = np.random.default_rng(1)
    for scales in ([1.0] * 8, [9.0, 3.0, 1.0, 1.0, 0.5, 0.1, 0.1, 0.01], [1.0] + [1e-3] * 7):
        X = rng.normal(size=(500, 8)) * np.array(scales) + 25.0
        ours = isoscore_points(X)
        theirs = float(IsoScore.IsoScore(X))
        # the package takes sqrt(n) in float32: agreement to ~1e-6, not to float64
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7)


def test_silhouette_equals_sklearn():
    rng = np.random.default_rng(2)
    X = np.vstack([rng.normal(size=(80, 5)) + 6 * i for i in range(3)])
    for labels in (np.repeat([0, 1, 2], 80), rng.integers(0, 7, 240)):
        np.testing.assert_allclose(
            silhouette_by_labels(X, labels), silhouette_score(X, labels), rtol=1e-12
        )
    # label filter: equals sklearn on the points whose label occurs at least twice
    tokens = np.concatenate([rng.integers(0, 20, 200), np.arange(100, 140)])
    keep = np.isin(tokens, np.unique(tokens)[np.unique(tokens, return_counts=True)[1] >= 2])
    np.testing.assert_allclose(
        silhouette_by_labels(X, tokens, min_label_count=2),
        silhouette_score(X[keep], tokens[keep]),
        rtol=1e-12,
    )
    assert np.isnan(silhouette_by_labels(X, np.zeros(240)))
    assert np.isnan(silhouette_by_labels(X, np.arange(240)))
    # a shared distance matrix: the same value, with the label filter and the subsample
    D = pairwise_distances(X - X.mean(axis=0))
    for kwargs in ({}, {"min_label_count": 2}, {"min_label_count": 2, "max_points": 150}):
        np.testing.assert_allclose(
            silhouette_by_labels(X, tokens, distances=D, seed=4, **kwargs),
            silhouette_by_labels(X, tokens, seed=4, **kwargs),
            rtol=1e-12,
            err_msg=str(kwargs),
        )
    assert np.isnan(silhouette_by_labels(X, np.zeros(240), distances=D))


def _partition_isotropy_by_definition(W: np.ndarray) -> float:
    """Mu & Viswanath's I(W) over the d eigenvectors of WᵀW, both signs, in log space."""
    from scipy.special import logsumexp

    _, vecs = np.linalg.eigh(W.T @ W)
    proj = W @ vecs
    log_z = np.concatenate([logsumexp(proj, axis=0), logsumexp(-proj, axis=0)])
    return float(np.exp(log_z.min() - log_z.max()))


@pytest.mark.parametrize("offset", [0.0, 3.0, 30.0])
def test_partition_isotropy_of_fewer_points_than_dims_from_the_gram_matrix(offset):
    """The n × n route equals the definition's d × d one, centred or not, also where a common
    offset makes one direction dominate (I ~ e^-30 at an offset of norm 30)."""
    rng = np.random.default_rng(8)
    for n, d in ((10, 40), (39, 40), (40, 40), (60, 200)):
        W = rng.normal(size=(n, d)) * np.linspace(0.05, 0.6, d) + offset / np.sqrt(d)
        for centered in (False, True):
            V = W - W.mean(axis=0) if centered else W
            np.testing.assert_allclose(
                partition_isotropy(W, centered=centered),
                _partition_isotropy_by_definition(V),
                rtol=1e-9,
            )


def test_partition_isotropy_is_one_for_isotropic_sets_and_never_overflows():
    E = np.vstack([np.eye(6), -np.eye(6)])
    assert partition_isotropy(E) == pytest.approx(1.0, abs=1e-12)
    with np.errstate(over="raise", invalid="raise", divide="raise"), warnings.catch_warnings():
        warnings.simplefilter("error")
        # the naive ratio of sums of exp(1000) is inf/inf; log-sum-exp gives the exact 1
        assert partition_isotropy(1000.0 * E) == pytest.approx(1.0, abs=1e-12)
        # centring removes a common offset
        assert partition_isotropy(E + 5.0, centered=True) == pytest.approx(1.0, abs=1e-12)
        assert partition_isotropy(E + 5.0) < 1.0
        # exact answer at norm 1000: log Z(±e1) = 1000, 999 (up to e^-999), log Z(±e2) = 1000
        W = np.array([[1000.0, 0.0], [-999.0, 0.0], [0.0, 1000.0], [0.0, -1000.0]])
        assert partition_isotropy(W) == pytest.approx(np.exp(-1.0), rel=1e-12)
        rng = np.random.default_rng(3)
        V = rng.normal(size=(300, 16)) * np.linspace(0.1, 3, 16)
        V = 1000.0 * V / np.linalg.norm(V, axis=1, keepdims=True)
        for value in (partition_isotropy(V), partition_isotropy(V, centered=True)):
            assert np.isfinite(value) and 0.0 <= value < 1.0


def brute_cos_mean(U: np.ndarray) -> float:
    U = U / np.linalg.norm(U, axis=1, keepdims=True)
    G = U @ U.T
    m = len(U)
    return float((G.sum() - np.trace(G)) / (m * (m - 1)))


def test_cluster_adjusted_equals_brute_force():
    rng = np.random.default_rng(4)
    X = np.vstack([rng.normal(size=(60, 6)) + 10 * i for i in range(3)])
    labels = np.repeat([0, 1, 2], 60)
    tokens = rng.integers(0, 15, 180)
    got = cluster_adjusted(X, labels, tokens)
    inter, intra, iso = [], [], []
    for c in range(3):
        rows = np.flatnonzero(labels == c)
        Xc = X[rows] - X[rows].mean(0)
        t = tokens[rows]
        firsts = [np.flatnonzero(t == v)[0] for v in np.unique(t)]
        inter.append(brute_cos_mean(Xc[firsts]))
        intra.append(
            np.mean([brute_cos_mean(Xc[t == v]) for v in np.unique(t) if (t == v).sum() >= 2])
        )
        iso.append(isoscore_points(X[rows]))
    np.testing.assert_allclose(got.s_inter, np.mean(inter), rtol=1e-10)
    np.testing.assert_allclose(got.s_intra, np.mean(intra), rtol=1e-10)
    np.testing.assert_allclose(got.isoscore, np.mean(iso), rtol=1e-10)
    assert got.n_clusters == 3
    # centring within clusters removes the common direction: adjusted cosines near 0
    assert abs(got.s_inter) < 0.1 and mean_pairwise_cosine(X) > 0.3
    np.testing.assert_allclose(mean_pairwise_cosine(X[:40]), brute_cos_mean(X[:40]), rtol=1e-10)
    # an explicit inter_mask selects the S_inter points
    mask = np.zeros(180, bool)
    mask[[0, 5, 9, 70, 71, 72, 150, 151]] = True
    sel = cluster_adjusted(X, labels, tokens, inter_mask=mask)
    ref = [brute_cos_mean((X[r] - X[r].mean(0))[mask[r]]) for r in np.split(np.arange(180), 3)]
    np.testing.assert_allclose(sel.s_inter, np.mean(ref), rtol=1e-10)


def clustered_sample(seed=5, layers=(0, 4), n_docs=60, t=24, d=12):
    """An ActivationSample of clustered points: 3 clusters set by token id mod 3."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=12.0, size=(len(layers), 3, d)) + 30.0
    sample = ActivationSample(list(layers), d, size=1000, seed=1, type_size=200)
    for start in range(0, n_docs, 10):
        ids = torch.from_numpy(rng.integers(0, 300, size=(10, t)))
        hidden = [
            torch.from_numpy(centres[li][ids.numpy() % 3] + rng.normal(size=(10, t, d)))
            for li in range(len(layers))
        ]
        keep = torch.ones(10, t, dtype=torch.bool)
        docs = torch.arange(start, start + 10)
        sample.update(hidden, ids, keep, docs, torch.zeros(10, dtype=torch.long))
    return sample


def test_sampled_layer_metrics_columns_and_values():
    sample = clustered_sample()
    X = sample.points(4).vectors
    km = select_k(X, k_max=5, seed=0)
    row = sampled_layer_metrics(sample, 4, km, lid_k=10)
    assert list(row) == SAMPLED_LAYER_COLUMNS
    assert all(np.isfinite(v) for v in row.values()), row
    assert row["kmeans_k"] == 3
    np.testing.assert_allclose(row["kmeans_silhouette"], silhouette_score(X, km.labels))
    np.testing.assert_allclose(row["isoscore_sample"], isoscore_points(X))
    np.testing.assert_allclose(row["lid_euclidean"], lid_mle(X, 10))
    np.testing.assert_allclose(row["lid_cosine"], lid_mle(X, 10, metric="cosine"))
    tp = sample.type_points(4).vectors
    assert len(tp) == 200
    np.testing.assert_allclose(row["s_inter_type_uniform"], brute_cos_mean(tp), rtol=1e-10)
    assert row["s_inter_type_uniform"] > 0.3 and abs(row["adjusted_s_inter"]) < 0.1
    assert 0.0 <= row["partition_isotropy"] <= row["partition_isotropy_centered"] <= 1.0
    # from one product of the centred rows (XᵀX = X_cᵀX_c + n μμᵀ): the direct values
    np.testing.assert_allclose(row["partition_isotropy"], partition_isotropy(X), rtol=1e-9)
    np.testing.assert_allclose(
        row["partition_isotropy_centered"], partition_isotropy(X, centered=True), rtol=1e-9
    )
    # silhouette by type (shared distance matrix) against sklearn on the types seen ≥ 2 times
    tok = sample.points(4).token_ids
    _, inv, counts = np.unique(tok, return_inverse=True, return_counts=True)
    keep = counts[inv] >= 2
    assert 100 < keep.sum() < len(X)
    np.testing.assert_allclose(
        row["silhouette_types"], silhouette_score(X[keep], tok[keep]), rtol=1e-10
    )
    # the same row from the layer's arrays (what the job's Ray tasks compute)
    pts = sample.points(4)
    assert sampled_metrics_of_points(pts.vectors, pts.token_ids, tp, km, lid_k=10) == row
    # K-means run here when no result is given
    assert sampled_layer_metrics(sample, 0, lid_k=10)["kmeans_k"] == 3
    with pytest.raises(ValueError, match="labels"):
        sampled_layer_metrics(sample, 4, select_k(X[:50], k_max=3))


def test_isoscore_silhouette_correlation():
    df = pd.DataFrame(
        {
            "layer": range(6),
            "isoscore": [0.1, 0.2, 0.3, np.nan, 0.5, 0.4],
            "kmeans_silhouette": [0.9, 0.7, 0.6, 0.2, 0.1, 0.3],
        }
    )
    ok = df.dropna()
    expected = np.corrcoef(ok["isoscore"], ok["kmeans_silhouette"])[0, 1]
    assert isoscore_silhouette_correlation(df) == pytest.approx(expected, rel=1e-12)
    assert expected < 0
    assert np.isnan(isoscore_silhouette_correlation(df.iloc[:2]))
    with pytest.raises(KeyError):
        isoscore_silhouette_correlation(df, isoscore_column="nope")


@pytest.mark.parametrize("offset", [0.0, 500.0])
def test_chord_distances_from_euclidean_ones_are_those_of_the_unit_vectors(offset):
    """‖u_i − u_j‖ from D (of the points less their mean, as the stage has it) and the norms:
    equal to the unit vectors' own distances, also with a massive common offset (cosines near
    1, chords near 0), and the same nearest neighbours."""
    rng = np.random.default_rng(3)
    X = rng.normal(size=(300, 16)) * rng.uniform(0.5, 3.0, size=(300, 1)) + offset
    X[1] = 2.5 * X[0]  # collinear with the origin: chord 0 between different points
    D = pairwise_distances(X - X.mean(axis=0))
    norms = np.linalg.norm(X, axis=1)
    ours = chord_distances(D, norms)
    ref = pairwise_distances(X / norms[:, None])
    # squared chords agree to rounding (a chord near 0 is the root of rounding either way)
    np.testing.assert_allclose(ours**2, ref**2, rtol=0, atol=1e-14)
    assert np.all(np.diag(ours) == 0) and ours[0, 1] < 1e-6
    off = ~np.eye(len(X), dtype=bool)
    if offset == 0.0:  # directions well apart (but x_0, x_1's tie): the same neighbours
        rest = np.arange(1, len(X))
        apart = off[np.ix_(rest, rest)]
        np.testing.assert_allclose(
            ours[np.ix_(rest, rest)][apart], ref[np.ix_(rest, rest)][apart], rtol=1e-10
        )
        np.testing.assert_array_equal(
            np.argsort(ours[np.ix_(rest, rest)], axis=1)[:, :6],
            np.argsort(ref[np.ix_(rest, rest)], axis=1)[:, :6],
        )
