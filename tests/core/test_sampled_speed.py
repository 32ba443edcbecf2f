"""The shared computations of the sampled stage against direct, from-scratch ones.

The stage computes one kNN table per layer and metric and reuses it for the half-samples of
the standard errors, takes silhouettes on blocks of one distance matrix, sums groups with
``bincount`` and takes the IsoScore of fewer points than dimensions from the Gram matrix. Each
is checked here against the slow, obvious computation on the same points.
"""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import pairwise_distances

from embgeom_ray.core import neighbours
from embgeom_ray.core.distinct import distinct_rows
from embgeom_ray.core.kmeans_selection import select_k
from embgeom_ray.core.metrics import isoscore_from_covariance
from embgeom_ray.core.neighbours import knn_distances, neighbour_table
from embgeom_ray.core.partials import group_sums
from embgeom_ray.core.sampled_metrics import (
    SE_METRICS,
    cluster_adjusted,
    half_sample_se,
    isoscore_points,
    lid_cai,
    lid_from_knn_distances,
    lid_mle,
    mean_pairwise_cosine,
    sampled_metrics_of_points,
    silhouette_by_labels,
)


def clustered_points(n: int = 360, d: int = 24, seed: int = 0):
    """n points in 3 anisotropic clusters in d dims, with 12 exact copies and repeated types."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=4.0, size=(3, d))
    scales = rng.uniform(0.2, 2.0, size=d)
    X = centres[rng.integers(0, 3, n)] + rng.normal(size=(n, d)) * scales + 5.0
    X[-12:] = X[:12]  # repeated text: identical vectors
    token_ids = rng.integers(0, n // 4, n)
    token_ids[-12:] = token_ids[:12]
    return X, token_ids


def test_knn_from_the_table_equals_a_fresh_search_on_every_subset(monkeypatch):
    X, _ = clustered_points()
    X = X[distinct_rows(X)[0]]
    k = 10
    table = neighbour_table(X, pairwise_distances(X - X.mean(axis=0)), k)
    assert table is not None and table.idx.shape == (len(X), neighbours.LIST_FACTOR * (k + 1))
    rng = np.random.default_rng(1)
    subsets = [None, *(np.sort(rng.choice(len(X), m, replace=False)) for m in (174, 174, 60))]
    for S in subsets:
        Xs = X if S is None else X[S]
        ref = lid_mle(Xs, k, per_point=True)  # sklearn's NearestNeighbors on X[S] itself
        T = knn_distances(table, k, S)
        np.testing.assert_allclose(lid_from_knn_distances(T), ref, rtol=1e-12)
        np.testing.assert_allclose(
            lid_from_knn_distances(T, squared=True, divide_by_k=True),
            lid_cai(Xs, k, per_point=True),
            rtol=1e-12,
        )
    # lists of only k + 1: most rows of a subset search their row of D directly
    monkeypatch.setattr(neighbours, "LIST_FACTOR", 1)
    short = neighbour_table(X, pairwise_distances(X), k)
    for S in subsets[1:]:
        np.testing.assert_allclose(
            lid_from_knn_distances(knn_distances(short, k, S)),
            lid_mle(X[S], k, per_point=True),
            rtol=1e-12,
        )
    with pytest.raises(ValueError, match="more than"):
        knn_distances(table, k, np.arange(k))
    assert (
        neighbour_table(np.vstack([X, X[:1]]), pairwise_distances(np.vstack([X, X[:1]])), k) is None
    )


def near_duplicates(n: int = 400, d: int = 32, seed: int = 5) -> np.ndarray:
    """Points with a massive offset (norms ~1e3 after centring, one coordinate of the mean
    ~1e4) and pairs 1e-7 apart: there the matrix's product cancels every digit."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    X[:, 0] *= 1e3
    X[:, 1] += 1e4
    X[n // 2 : n // 2 + 40] = X[:40] + 1e-7 * rng.normal(size=(40, d))
    return X


@pytest.mark.parametrize("metric", ["euclidean", "chord"])
def test_the_matrix_error_bounds_hold_and_its_distances_are_kept_only_within_them(metric):
    """:func:`neighbours.euclidean_error` and :func:`neighbours.chord_error` bound the matrix's
    distances against the points' own (the same matrices the stage computes: of the points
    less their mean); a table given them keeps a matrix distance only within
    :data:`neighbours.MATRIX_RTOL` of the points' own, and computes the others from the
    points, bit for bit :func:`neighbours.exact_distances`."""
    X = near_duplicates()
    P = X - X.mean(axis=0)
    D = pairwise_distances(P)
    norms = np.linalg.norm(X, axis=1)
    if metric == "euclidean":
        Y, M, error = X, D, neighbours.euclidean_error(P, X)
    else:
        Y = X / norms[:, None]
        M = neighbours.chord_distances(D, norms)
        error = neighbours.chord_error(P, X, D)
    n = len(X)
    rows = np.arange(n)
    idx = np.tile(rows, (n, 1))  # every entry
    exact = neighbours.exact_distances(Y, rows, idx)
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = error(rows, idx, M)
    off = ~np.eye(n, dtype=bool)
    assert (np.abs(M - exact)[off] <= bound[off]).all()  # a bound
    near = np.zeros((n, n), dtype=bool)  # the near-duplicate pairs
    near[np.arange(n // 2, n // 2 + 40), np.arange(40)] = True
    near |= near.T
    assert (np.abs(M - exact)[near] > 1e-3 * exact[near]).all()  # the matrix is wrong there
    table = neighbour_table(Y, M, 10, error)
    plain = neighbour_table(Y, M, 10)
    assert table is not None and plain is not None
    np.testing.assert_array_equal(table.idx, plain.idx)
    np.testing.assert_allclose(table.dist, plain.dist, rtol=neighbours.MATRIX_RTOL, atol=0)
    own = table.dist == plain.dist  # the entries computed from the points
    assert own[:, 0].all()  # each point itself (distance 0)
    pairs = near[rows[:, None], table.idx]
    assert pairs.any() and own[pairs].all()  # every near-duplicate pair in the lists
    assert (table.dist[~own] == np.take_along_axis(M, table.idx, axis=1)[~own]).all()
    assert (~own).mean() > 0.8  # the rest from the matrix


def test_exact_distances_are_the_norms_of_the_differences_bit_for_bit():
    """The in-place passes give np.linalg.norm's floats, across blocks and with an offset."""
    rng = np.random.default_rng(3)
    X = rng.normal(size=(700, 48)) + 1e4  # a massive offset: the differences cancel it
    rows = rng.permutation(700)[:650]
    idx = rng.integers(0, 700, size=(650, 33))  # 650 rows: several blocks of 1M / (33 · 48)
    got = neighbours.exact_distances(X, rows, idx)
    want = np.linalg.norm(X[idx] - X[rows, None, :], axis=2)
    assert got.shape == (650, 33) and np.array_equal(got, want)
    assert np.array_equal(neighbours.exact_distances(X, rows[:1], idx[:1]), want[:1])


def test_group_sums_are_add_at_bit_for_bit():
    rng = np.random.default_rng(2)
    u = rng.normal(size=(500, 17))
    g = rng.integers(0, 40, 500)
    ref = np.zeros((45, 17))
    np.add.at(ref, g, u)
    np.testing.assert_array_equal(group_sums(u, g, 45), ref)


@pytest.mark.parametrize("m", [5, 23, 24, 60])
def test_isoscore_of_fewer_points_than_dims_from_the_gram_matrix(m):
    X, _ = clustered_points(n=m, d=24, seed=m)
    X = X[:m] * np.linspace(0.5, 3.0, 24)  # anisotropic
    Xc = X - X.mean(axis=0)
    ref = isoscore_from_covariance(Xc.T @ Xc / (m - 1))
    np.testing.assert_allclose(isoscore_points(X), ref, rtol=1e-10)


@pytest.mark.parametrize(
    "max_points",
    [
        4096,  # the point set's matrices and tables
        250,  # 348 distinct points: tables by blocks; each half-sample's silhouettes, one matrix
        120,  # half-samples of 174: each silhouette subsampled to 120 points, its own matrix
    ],
)
def test_sampled_metrics_and_half_sample_ses_equal_direct_computations(max_points, monkeypatch):
    """Every LID, silhouette and cluster-adjusted value, and their half-sample SEs, from scratch.

    The reference recomputes each half-sample's metrics on X[S] alone (sklearn's kNN search
    and silhouette_score, no shared matrix or table), with the replicates' seeds of
    ``sampled_metrics_of_points``: a wrong row, column or neighbour in the sharing shows.
    With fewer ``max_points`` than points the layer's tables are built a few rows at a time.
    """
    monkeypatch.setattr(neighbours, "BLOCK_BYTES", 8 * 348 * 50)  # blocks of 50 rows
    X, tok = clustered_points()
    rng = np.random.default_rng(3)
    type_vectors = rng.normal(size=(80, X.shape[1])) + 1.0
    km = select_k(X, k_max=5, seed=0)
    opts = {"lid_k": 10, "cluster_min_size": 20, "se_replicates": 6, "seed": 4}
    row = sampled_metrics_of_points(
        X, tok, type_vectors, km, silhouette_max_points=max_points, **opts
    )

    first, _ = distinct_rows(X)
    Xd, tokd = X[first], tok[first]
    labels, best = np.asarray(km.labels)[first], np.asarray(km.best_labels)[first]
    assert row["sample_duplicate_points"] == 12 and row["kmeans_k"] == 3

    def direct(S: np.ndarray) -> dict[str, float]:
        Xs = Xd[S]
        out = {}
        for name, metric in (("lid_euclidean", "euclidean"), ("lid_cosine", "cosine")):
            per_point = lid_mle(Xs, 10, metric, per_point=True)
            out[name] = float(np.nanmean(per_point))
            out[f"{name}_median"] = float(np.nanmedian(per_point))
        cap = {"max_points": max_points, "seed": 4}
        out["silhouette_types"] = silhouette_by_labels(Xs, tokd[S], min_label_count=2, **cap)
        out["kmeans_silhouette"] = silhouette_by_labels(Xs, best[S], **cap)
        clusters, sizes = np.unique(labels, return_counts=True)
        adj = cluster_adjusted(Xs, labels[S], tokd[S], weighted_clusters=clusters[sizes >= 20])
        for key in ("s_inter", "s_intra", "isoscore"):
            out[f"adjusted_{key}"] = getattr(adj, key)
            out[f"adjusted_{key}_weighted"] = getattr(adj, f"{key}_weighted")
        return out

    full = direct(np.arange(len(Xd)))
    for key in ("lid_euclidean", "lid_euclidean_median", "lid_cosine", "lid_cosine_median"):
        np.testing.assert_allclose(row[key], full[key], rtol=1e-12, err_msg=key)
    np.testing.assert_allclose(row["silhouette_types"], full["silhouette_types"], rtol=1e-10)
    np.testing.assert_allclose(row["lid_euclidean_cai"], lid_cai(Xd, 10), rtol=1e-12)

    seeds = np.random.SeedSequence([4, 0x5E]).generate_state(3)
    ref = half_sample_se(len(Xd), direct, 6, int(seeds[0]))
    ref |= half_sample_se(
        len(X), lambda S: {"isoscore_sample": isoscore_points(X[S])}, 6, int(seeds[2])
    )
    ref |= half_sample_se(
        len(type_vectors),
        lambda S: {"s_inter_type_uniform": mean_pairwise_cosine(type_vectors[S])},
        6,
        int(seeds[1]),
    )
    assert set(ref) == set(SE_METRICS)
    for key in SE_METRICS:
        assert np.isfinite(row[f"{key}_se"]) and row[f"{key}_se"] > 0, key
        np.testing.assert_allclose(row[f"{key}_se"], ref[key], rtol=1e-9, err_msg=key)


@pytest.mark.parametrize("offset", [0.0, 1e3])
def test_tables_built_by_blocks_equal_those_of_the_matrices(offset, monkeypatch):
    """:func:`neighbours.neighbour_tables_of_points` (no n × n matrix, blocks of 37 rows):
    the lists and exact distances of the tables of ``pairwise_distances`` and of the chord
    matrix, also with a massive common offset; subsets' kNN distances equal a fresh search,
    also where every row's list runs short and its row is computed from the points."""
    from embgeom_ray.core.sampled_metrics import chord_distances

    X, _ = clustered_points()
    X = X[distinct_rows(X)[0]] + offset
    n, k = len(X), 10
    monkeypatch.setattr(neighbours, "BLOCK_BYTES", 8 * n * 37)
    euclid, chord = neighbours.neighbour_tables_of_points(X, k)
    D = pairwise_distances(X - X.mean(axis=0))
    U = X / np.linalg.norm(X, axis=1)[:, None]
    want_e = neighbour_table(X, D, k)
    want_c = neighbour_table(U, chord_distances(D, np.linalg.norm(X, axis=1)), k)
    for got, want in ((euclid, want_e), (chord, want_c)):
        assert got is not None and got.D is None
        np.testing.assert_array_equal(got.rank, want.rank)
        np.testing.assert_allclose(got.dist, want.dist, rtol=1e-12)
        # the same neighbours up to ties within rounding: equal sets where distances differ
        np.testing.assert_array_equal(np.sort(got.idx[:, :-1], 1), np.sort(want.idx[:, :-1], 1))
    rng = np.random.default_rng(2)
    subsets = [None, *(np.sort(rng.choice(n, m, replace=False)) for m in (174, 60))]
    monkeypatch.setattr(neighbours, "LIST_FACTOR", 1)
    short_e, short_c = neighbours.neighbour_tables_of_points(X, k)
    for S in subsets:
        Xs = X if S is None else X[S]
        for table, short, metric in ((euclid, short_e, "euclidean"), (chord, short_c, "cosine")):
            ref = lid_mle(Xs, k, metric, per_point=True)
            for t in (table, short):
                np.testing.assert_allclose(
                    lid_from_knn_distances(knn_distances(t, k, S)), ref, rtol=1e-9
                )
    dup = np.vstack([X, X[:1]])
    assert neighbours.neighbour_tables_of_points(dup, k) == (None, None)
    X[4] = 0.0
    assert neighbours.neighbour_tables_of_points(X, k)[1] is None  # no direction for 0


def test_table_ranks_are_np_uniques_order():
    """A table's ``rank`` is each row's position in np.unique(X, axis=0): from the first
    coordinate alone when it has no ties, else from whole rows (ties, signed zeros)."""
    rng = np.random.default_rng(5)
    X = rng.normal(size=(200, 6))
    tied = X.copy()
    tied[:, 0] = np.round(tied[:, 0])  # many rows share their first coordinate
    tied[:2, 0] = [0.0, -0.0]
    for P in (X, tied):
        _, first = np.unique(P, axis=0, return_index=True)
        table = neighbour_table(P, pairwise_distances(P), 5)
        np.testing.assert_array_equal(table.rank[first], np.arange(len(P)))
        assert (
            neighbour_table(P[[*range(200), 7]], pairwise_distances(P[[*range(200), 7]]), 5) is None
        )


def test_lid_k_below_2_is_refused_on_every_path():
    X, tok = clustered_points(n=60)
    km = select_k(X, k_max=3, seed=0)
    with pytest.raises(ValueError, match="lid_k must be >= 2"):
        sampled_metrics_of_points(X, tok, None, km, lid_k=1)
    with pytest.raises(ValueError, match="k must be >= 2"):
        lid_from_knn_distances(np.ones((5, 1)))


def test_repeated_directions_take_the_cosine_lid_without_a_table():
    """Two distinct points on one ray (x and 2x) share a unit vector: LID drops the copy."""
    X, tok = clustered_points(n=200)
    X[5] = 2.0 * X[4]
    km = select_k(X, k_max=3, seed=0)
    row = sampled_metrics_of_points(X, tok, None, km, lid_k=10, se_replicates=0)
    Xd = X[distinct_rows(X)[0]]
    np.testing.assert_allclose(row["lid_cosine"], lid_mle(Xd, 10, "cosine"), rtol=1e-12)
    np.testing.assert_allclose(row["lid_euclidean"], lid_mle(Xd, 10), rtol=1e-12)
