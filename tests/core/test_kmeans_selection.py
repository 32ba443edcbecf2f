"""K-means model selection (a scan of k scored by silhouette) against independent computations."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.cluster import KMeans
from sklearn.datasets import make_blobs
from sklearn.metrics import (
    adjusted_rand_score,
    pairwise_distances,
    silhouette_samples,
    silhouette_score,
)
from threadpoolctl import threadpool_limits

import embgeom_ray.core.kmeans_selection as selection
from embgeom_ray.core.distinct import distinct_rows
from embgeom_ray.core.kmeans import serial_map
from embgeom_ray.core.kmeans_selection import (
    K_DENSE,
    LOCAL_FIT_MAX_ELEMENTS,
    N_INIT,
    N_INIT_SCAN,
    chain_trials,
    decision_support,
    default_n_init,
    fit_many,
    plus_plus_chain,
    point_silhouettes,
    scan_ks,
    select_k,
    silhouette_from_distances,
)


def blobs(n=1500, d=12, centers=5, seed=0, offset=0.0):
    """Well separated unit-variance Gaussian blobs (centres ~ N(0, 8² I), ≥ ~20 apart)."""
    rng = np.random.default_rng(seed)
    C = rng.normal(scale=8.0, size=(centers, d))
    X, y = make_blobs(n, d, centers=C, cluster_std=1.0, random_state=seed)
    return X + offset, y


def reference_chain(X: np.ndarray, k: int, seed, trials: int) -> list[int]:
    """Greedy k-means++ written out point by point (the same draws from the same generator):
    each candidate is the winner of an exponential race, argmin_x E_x / D²(x), which is x with
    probability D²(x) / Σ D²."""
    rng = np.random.default_rng(seed)
    n = len(X)
    ids = [int(rng.integers(n))]
    closest = np.array([float(((x - X[ids[0]]) ** 2).sum()) for x in X])
    while len(ids) < k:
        E = rng.standard_exponential((trials, n))
        with np.errstate(divide="ignore"):
            cands = [int(np.argmin(e / closest)) for e in E]
        after = [np.minimum(closest, ((X - X[c]) ** 2).sum(axis=1)) for c in cands]
        best = int(np.argmin([a.sum() for a in after]))
        ids.append(cands[best])
        closest = after[best]
    return ids


def test_scan_ks_is_every_k_to_15_then_a_ten_percent_grid():
    assert scan_ks(60) == [*range(2, 16), 17, 19, 21, 24, 27, 30, 33, 37, 41, 46, 51, 57, 60]
    assert scan_ks(15) == list(range(2, 16))  # Cai et al.'s range
    assert scan_ks(20) == [*range(2, 16), 17, 19, 20]  # k_max itself is always fitted
    assert scan_ks(4) == [2, 3, 4] and scan_ks(1) == []
    for k_max in range(2, 200):
        ks = scan_ks(k_max)
        assert ks[-1] == k_max and ks == sorted(set(ks))
        assert all(b <= np.ceil(1.1 * a) for a, b in pairwise(ks[13:]))


def test_plus_plus_chain_is_greedy_kmeans_plus_plus_and_each_prefix_is_a_seeding():
    X, _ = blobs(n=300, d=5, centers=6, seed=3, offset=40.0)
    Xc = X - X.mean(axis=0)
    trials = chain_trials(20)
    chain = plus_plus_chain(Xc, 20, (0, 1), trials)
    assert chain.tolist() == reference_chain(Xc, 20, (0, 1), trials)
    assert len(set(chain.tolist())) == 20
    for j in (1, 2, 7, 19):  # the prefix property: the chain of j centres is the first j
        assert plus_plus_chain(Xc, j, (0, 1), trials).tolist() == chain[:j].tolist()
    # the first six centres land one in each blob (greedy D² seeding on separated blobs)
    _, y = blobs(n=300, d=5, centers=6, seed=3)
    assert sorted(y[chain[:6]]) == list(range(6))
    # fewer distinct points than centres asked for: it stops when every point is a centre
    assert len(plus_plus_chain(Xc[:4], 10, 0, trials)) == 4


def test_race_draws_with_probability_proportional_to_d2():
    from embgeom_ray.core.kmeans_selection import _draw

    d2 = np.array([0.0, 1.0, 2.0, 5.0, 0.0, 2.0])
    picks = _draw(d2, 200_000, np.random.default_rng(0))
    share = np.bincount(picks, minlength=len(d2)) / len(picks)
    np.testing.assert_allclose(share, d2 / d2.sum(), atol=4e-3)  # never a point at D² = 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fit_many_is_lloyd_from_those_centres(dtype):
    """scikit-learn's Lloyd from the given centres, and a plain numpy Lloyd, agree with each
    fit of a batch; a fit alone gives what it gives in the batch."""
    X, y = blobs(n=900, d=10, centers=4, seed=8, offset=50.0)
    Xc = X - X.mean(0)
    ids = np.array([np.flatnonzero(y == c)[5] for c in range(4)])  # a point of each blob
    rng = np.random.default_rng(3)
    inits = [ids, rng.choice(900, 4, replace=False), rng.choice(900, 7, replace=False), ids[:2]]
    got = fit_many(Xc, inits, dtype=dtype)
    for init, res in zip(inits, got, strict=True):
        ref = KMeans(len(init), init=Xc[init].astype(dtype), n_init=1, algorithm="lloyd")
        ref.fit(Xc.astype(dtype))
        assert adjusted_rand_score(res.labels, ref.labels_) == 1.0  # the same partition
        np.testing.assert_allclose(
            res.inertia, ((Xc - res.centers[res.labels]) ** 2).sum(), rtol=1e-12
        )
        alone = fit_many(Xc, [init], dtype=dtype)[0]
        np.testing.assert_array_equal(alone.labels, res.labels)
        assert alone.inertia == res.inertia and alone.n_iter == res.n_iter
    res = got[0]  # canonical labels: cluster j is the j-th to appear
    assert [res.labels[np.flatnonzero(res.labels == c)[0]] for c in range(4)] == [0, 1, 2, 3]
    assert (np.diff([np.flatnonzero(res.labels == c)[0] for c in range(4)]) > 0).all()
    centers = Xc[ids].copy()  # Lloyd by hand, float64
    for _ in range(100):
        lab = ((Xc[:, None, :] - centers[None]) ** 2).sum(-1).argmin(1)
        centers = np.stack([Xc[lab == c].mean(0) for c in range(4)])
    assert adjusted_rand_score(res.labels, lab) == 1.0


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 300),
    st.integers(1, 12),
    st.integers(1, 12),
    st.integers(0, 2**32 - 1),
)
def test_adjusted_rand_index_is_sklearns(n, ka, kb, seed):
    """The stability's adjusted Rand index equals scikit-learn's, bit for bit: random
    labellings of n points, with arbitrary label values (negative, gaps), one labelling a
    relabelling of the other, and the degenerate cases (no points, one cluster, all apart)."""
    rng = np.random.default_rng(seed)
    a = rng.integers(-3, ka, n) * 7
    b = rng.integers(0, kb, n) + 100
    cases = [(a, b), (a, -a + 5), (a, np.zeros(n, int)), (np.arange(n), b), (b, b)]
    for x, y in cases:
        assert selection.adjusted_rand_index(x, y) == adjusted_rand_score(x, y)


def test_point_silhouettes_are_sklearns_and_the_support_counts_resamples():
    rng = np.random.default_rng(7)
    X = np.vstack([rng.normal(size=(100, 5)) + 4 * i for i in range(3)])
    D = pairwise_distances(X)
    labelings = [np.repeat([5, 9, 2], 100), rng.integers(0, 2, 300), np.arange(300) % 7, np.zeros(300)]
    per_point = point_silhouettes(D, labelings)
    assert per_point.shape == (300, 4)
    for j, labels in enumerate(labelings[:3]):
        np.testing.assert_allclose(
            per_point[:, j], silhouette_samples(D, labels, metric="precomputed"), atol=2e-6
        )
    assert np.isnan(per_point[:, 3]).all()  # one label: no silhouette
    # the three blobs win every resample by far: full support for k = 3 and for k >= 2
    ks = [3, 2, 7, 1]
    assert decision_support(per_point, ks, 3, 0.1, seed=0) == (1.0, 1.0)
    # with a threshold above every silhouette, k = 1 is decided in every resample too
    assert decision_support(per_point, ks, 1, 0.99, seed=0) == (1.0, 1.0)
    # two labellings of nearly equal silhouettes: the resamples split between them
    a = rng.normal(0.2, 0.05, size=400)
    tied = np.column_stack([a, a + rng.normal(0, 0.05, size=400)])
    k_support, structure = decision_support(tied, [2, 5], 2, 0.1, seed=1)
    assert 0.2 < k_support < 0.8 and structure == 1.0
    # near the threshold: the k >= 2 decision itself is not settled
    low = np.column_stack([rng.normal(0.1, 0.1, size=400)])
    k_support, structure = decision_support(low, [4], 4 if low.mean() >= 0.1 else 1, 0.1, seed=1)
    assert 0.1 < structure < 0.9 and k_support == structure


def test_silhouette_from_distances_equals_sklearn():
    rng = np.random.default_rng(7)
    X = np.vstack([rng.normal(size=(100, 5)) + 4 * i for i in range(3)])
    D = pairwise_distances(X)
    cases = {
        "three blobs": np.repeat([5, 9, 2], 100),
        "two labels": rng.integers(0, 2, 300),
        "many labels, singletons": np.concatenate(
            [rng.integers(0, 150, 250), 1000 + np.arange(50)]
        ),
        "n - 1 labels": np.concatenate([[0, 0], np.arange(1, 299)]),
    }
    for name, labels in cases.items():
        ref = silhouette_score(D, labels, metric="precomputed")
        np.testing.assert_allclose(
            silhouette_from_distances(D, labels), ref, rtol=1e-12, err_msg=name
        )
    assert silhouette_from_distances(D, cases["three blobs"]) > 0.5
    for bad in (np.zeros(300), np.arange(300)):
        with pytest.raises(ValueError, match="labels"):
            silhouette_from_distances(D, bad)


def test_silhouette_from_distances_of_scored_points_is_their_blocks_to_the_bit():
    """``scored``: the silhouette of the block D[scored][:, scored], bit for bit, from D's rows
    (the other columns summed into a bin of their own), over several blocks of rows."""
    rng = np.random.default_rng(11)
    X = np.vstack([rng.normal(size=(400, 6)) + 3 * i for i in range(3)])
    D = pairwise_distances(X - X.mean(axis=0))
    labels = rng.integers(0, 40, len(X))
    for scored in (
        np.sort(rng.choice(len(X), 900, replace=False)),  # ~1M / 1,200 rows a block: 2 blocks
        np.arange(len(X))[::3],
        np.arange(len(X) - 1),
    ):
        block = D[np.ix_(scored, scored)]
        ref = silhouette_from_distances(block, labels[scored])
        got = silhouette_from_distances(D, labels[scored], scored)
        assert np.float64(got).tobytes() == np.float64(ref).tobytes()
        np.testing.assert_allclose(
            got, silhouette_score(block, labels[scored], metric="precomputed"), rtol=1e-12
        )
    with pytest.raises(ValueError, match="labels"):
        silhouette_from_distances(D, labels[:10], np.arange(11))


def test_select_k_equals_an_independent_scan_with_sklearn():
    """Every k of the scan: an inertia within 0.5% of scikit-learn's KMeans(n_init=10), and no
    higher in the median over k; the best k's inertia and silhouette are those of its labels
    (scikit-learn's silhouette_score); the best silhouette's k is reported."""
    X, y = blobs(n=1200, d=8, centers=4, seed=9, offset=-30.0)
    assert X.size <= LOCAL_FIT_MAX_ELEMENTS
    res = select_k(X, k_max=20, seed=2)
    Xc = X - X.mean(axis=0)
    assert sorted(res.silhouettes) == scan_ks(20) == sorted(res.inertias)
    ratios = []
    for k in scan_ks(20):
        lab = KMeans(k, n_init=10, random_state=0).fit(Xc).labels_
        sk = sum(((Xc[lab == c] - Xc[lab == c].mean(0)) ** 2).sum() for c in range(k))
        ratios.append(res.inertias[k] / sk)
    assert max(ratios) <= 1.005 and np.median(ratios) <= 1 + 1e-9, ratios
    best = res.best_labels
    np.testing.assert_allclose(res.silhouettes[res.best_k], silhouette_score(X, best), rtol=1e-5)
    np.testing.assert_allclose(
        res.inertia, sum(((X[best == c] - X[best == c].mean(0)) ** 2).sum() for c in range(4)),
        rtol=1e-10,
    )  # fmt: skip
    assert res.k == res.best_k == max(res.silhouettes, key=res.silhouettes.get) == 4
    assert res.silhouette > 0.7 and not res.at_cap and res.k_searched == 20
    assert len({(a, b) for a, b in zip(res.labels, y, strict=True)}) == 4  # the true blobs
    means = np.stack([X[res.labels == c].mean(0) for c in range(4)])  # Lloyd's fixed point
    np.testing.assert_allclose(res.centers, means, rtol=1e-5, atol=1e-4)
    assert res.stability == pytest.approx(1.0)
    assert res.k_support == res.structure_support == 1.0  # no resample doubts four blobs
    # structureless data: best silhouette < 0.1, so one cluster (the best k still reported)
    Z = np.random.default_rng(0).normal(size=(600, 32))
    one = select_k(Z, k_max=6, seed=0, stability_seeds=3)
    assert one.k == 1 and one.silhouette < 0.1 and one.best_k in range(2, 7)
    np.testing.assert_allclose(one.centers[0], Z.mean(0))
    assert (one.labels == 0).all() and len(np.unique(one.best_labels)) == one.best_k
    assert one.stability < 0.9  # refits from other chains agree far less than on blobs
    # a stricter threshold turns the blobs into one cluster too; the silhouette is still reported
    strict = select_k(X, k_max=20, n_init=2, min_silhouette=0.99, seed=2)
    assert strict.k == 1 and strict.silhouette == res.silhouette


def test_n_init_defaults_to_3_for_a_scan_past_15_in_one_process_else_10(monkeypatch):
    """Unset, n_init is 3 where the downward starts bring larger k's partitions down (a scan
    past K_DENSE fitted in one process) and 10 elsewhere (Cai et al.'s range; the partitioned
    route, which has no warm or downward starts); given, it is used."""
    assert (N_INIT_SCAN, N_INIT) == (3, 10)
    assert default_n_init(K_DENSE + 1, local=True) == 3
    assert default_n_init(K_DENSE, local=True) == 10 == default_n_init(60, local=False)
    seen = []
    real = selection._local_scan

    def spy(Xc, sqd, ks, n_init, *args):
        seen.append((max(ks), n_init))
        return real(Xc, sqd, ks, n_init, *args)

    monkeypatch.setattr(selection, "_local_scan", spy)
    X, _ = blobs(n=300, d=6, centers=3, seed=1)
    select_k(X, k_max=20, stability_seeds=0)
    select_k(X, k_max=15, stability_seeds=0)
    select_k(X, k_max=20, n_init=5, stability_seeds=0)
    assert seen == [(20, 3), (15, 10), (20, 5)]


@pytest.fixture(scope="module")
def many_blobs():
    """24 well separated blobs of 25 points in 10 dims: the true k lies beyond k = 2..15."""
    return blobs(n=600, d=10, centers=24, seed=12)


def test_select_k_finds_structure_beyond_15_without_a_growth_rule(many_blobs):
    """The default scan reaches k = 60 whatever the silhouettes of 2..15 say: k = 24 is found,
    an interior optimum; the curve of every k fitted is reported."""
    X, y = many_blobs
    res = select_k(X, seed=0)
    assert selection.K_MAX == 60 and res.k_searched == 60
    assert res.k == res.best_k == 24 and not res.at_cap
    assert sorted(res.silhouettes) == scan_ks(60)
    assert [row["k"] for row in res.curve()] == scan_ks(60)
    assert len(set(zip(res.labels, y, strict=True))) == 24
    assert res.stability == pytest.approx(1.0, abs=1e-12)
    # a scan ending at 24 has its best k at its end: flagged
    capped = select_k(X, k_max=24, seed=0, stability_seeds=0)
    assert capped.best_k == capped.k == capped.k_searched == 24 and capped.at_cap
    assert np.isnan(capped.stability)
    # Cai et al.'s range: k = 15 is the best of 2..15, at the end of the scan
    fixed = select_k(X, k_max=15, seed=0, stability_seeds=0)
    assert fixed.k == fixed.k_searched == 15 and fixed.at_cap
    # n - 1 bounds the scan
    assert select_k(X[:7], seed=0, stability_seeds=0).k_searched == 6


def test_select_k_depends_on_the_points_not_on_their_last_bits(many_blobs):
    """Rounding-level noise on the points (as another batching of the forward gives): the same
    k, labels and stability, and silhouettes and inertias equal to ~1e-9."""
    X, _ = many_blobs
    Z = np.random.default_rng(3).normal(size=(500, 16)) @ np.diag(np.linspace(1, 3, 16))
    for points in (X, Z):
        a = select_k(points, seed=5, stability_seeds=2)
        noisy = points * (1 + 1e-7 * np.random.default_rng(4).standard_normal(points.shape))
        b = select_k(noisy, seed=5, stability_seeds=2)
        assert (a.k, a.best_k, a.at_cap, a.stability) == (b.k, b.best_k, b.at_cap, b.stability)
        np.testing.assert_array_equal(a.labels, b.labels)
        for k in a.silhouettes:
            np.testing.assert_allclose(b.silhouettes[k], a.silhouettes[k], rtol=1e-6)
            np.testing.assert_allclose(b.inertias[k], a.inertias[k], rtol=1e-6)


def test_select_k_fits_each_point_once_by_content_key():
    """Repeats of a point (by content key, with their last bits perturbed) are one point: the
    fit, k and silhouettes are those of the distinct points; each repeat gets its point's label."""
    X, _ = blobs(n=300, d=6, centers=3, seed=3)
    rng = np.random.default_rng(1)
    copies = rng.choice(300, size=120)
    order = rng.permutation(420)
    keys = np.concatenate([np.arange(300), copies])[order] * 7 + 11
    rows = np.vstack([X, X[copies] * (1 + 1e-9 * rng.standard_normal((120, 6)))])[order]
    first, inverse = distinct_rows(rows, keys)
    assert len(first) == 300 and np.all(np.diff(first) > 0)
    dup = select_k(rows, k_max=6, seed=0, groups=keys)
    ref = select_k(rows[first], k_max=6, seed=0)
    assert dup.k == ref.k == 3 and dup.n_distinct == 300
    assert dup.silhouettes == ref.silhouettes and dup.stability == ref.stability
    np.testing.assert_array_equal(dup.labels, ref.labels[inverse])
    np.testing.assert_array_equal(dup.best_labels, ref.best_labels[inverse])
    np.testing.assert_allclose(
        dup.silhouette, silhouette_score(rows[first], dup.labels[first]), rtol=1e-5
    )
    # by bits alone the perturbed repeats would be separate points
    assert select_k(rows, k_max=6, seed=0).n_distinct == 420


def test_select_k_routes_by_sample_size(monkeypatch):
    """n·d ≤ local_max_elements: Lloyd from seedings and warm starts in this process; above it
    (or with a map): k-means|| over partitions. 4 k of the scan and 1 refit either way."""
    calls = {"local": 0, "partitioned": 0}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(selection, "fit_many", spy("local", selection.fit_many))
    monkeypatch.setattr(selection, "fit_partitioned", spy("partitioned", selection.fit_partitioned))
    X, _ = blobs(n=600, d=6, centers=3, seed=10)  # n·d = 3600
    expected = {  # local: one batch of every k's seedings, one of refits; partitioned: one fit each
        3600: {"local": 2, "partitioned": 0},
        3599: {"local": 0, "partitioned": 5},
        None: {"local": 0, "partitioned": 5},
    }
    results = {}
    opts = {"k_max": 5, "seed": 0, "stability_seeds": 1, "n_init": 1}
    for limit, want in expected.items():
        calls.update(local=0, partitioned=0)
        results[limit] = select_k(X, local_max_elements=limit, **opts)
        assert calls == want, limit
        assert results[limit].k == 3
    calls.update(local=0, partitioned=0)
    mapped = select_k(X, map_fn=serial_map, **opts)
    assert calls == {"local": 0, "partitioned": 5}
    np.testing.assert_allclose(mapped.inertias[4], results[None].inertias[4], rtol=1e-12)
    # both routes find the same clusters on well separated blobs
    np.testing.assert_allclose(results[3600].inertia, results[None].inertia, rtol=1e-9)
    np.testing.assert_allclose(results[3600].silhouette, results[None].silhouette, rtol=1e-9)


# ------------------------------------------------------------------- Ray layer
def test_fit_layers_on_ray_equals_serial_selection_on_both_routes(ray_local):
    from embgeom_ray.distributed.kmeans import fit_layers_on_ray

    by_layer = {
        0: blobs(n=600, d=6, centers=3, seed=5, offset=100.0)[0],
        3: blobs(n=600, d=6, centers=5, seed=6)[0],
    }
    for limit in (LOCAL_FIT_MAX_ELEMENTS, None):
        opts = {"k_max": 6, "n_init": 2, "seed": 1, "local_max_elements": limit}
        got = fit_layers_on_ray(by_layer, n_partitions=2, **opts)
        assert sorted(got) == [0, 3] and got[0].k == 3 and got[3].k == 5
        for layer, X in by_layer.items():
            with threadpool_limits(1):  # as in the task
                serial = select_k(X, n_partitions=2, **opts)
            assert got[layer].k == serial.k
            np.testing.assert_allclose(got[layer].inertia, serial.inertia, rtol=1e-8)
            np.testing.assert_allclose(got[layer].centers, serial.centers, rtol=1e-8)
            np.testing.assert_allclose(got[layer].silhouette, serial.silhouette, rtol=1e-8)


def test_fit_layers_on_ray_fits_each_point_once_on_both_routes(ray_local):
    """Repeated rows by content key: both routes de-duplicate as serial does."""
    from embgeom_ray.distributed.kmeans import fit_layers_on_ray

    X, _ = blobs(n=300, d=6, centers=3, seed=4)
    rows = np.vstack([X, X[:90] * (1 + 1e-10)])
    keys = np.concatenate([np.arange(300), np.arange(90)])
    opts = {"k_max": 4, "n_init": 2, "seed": 1, "stability_seeds": 1}
    ref = select_k(X, **opts)
    for limit in (LOCAL_FIT_MAX_ELEMENTS, None):
        got = fit_layers_on_ray(
            {0: rows}, groups={0: keys}, local_max_elements=limit, n_partitions=2, **opts
        )[0]
        assert got.k == ref.k == 3 and got.n_distinct == 300
        assert got.labels.shape == (390,) and got.best_labels.shape == (390,)
        np.testing.assert_array_equal(got.labels[300:], got.labels[:90])
        np.testing.assert_allclose(got.silhouette, ref.silhouette, rtol=1e-8)
        assert got.stability == pytest.approx(1.0)


def _fit_where(X, inits):
    """A stand-in ``fit`` that says which process fitted which centres."""
    import os

    return [(os.getpid(), len(ids), int(ids[0]), float(X.sum())) for ids in inits]


def test_balanced_shares_split_by_k():
    from embgeom_ray.distributed.kmeans import balanced_shares

    costs = list(range(16, 31))
    for shares in (1, 2, 3, 4, 15, 40):
        groups = balanced_shares(costs, shares)
        assert len(groups) == min(shares, len(costs))
        assert sorted(i for g in groups for i in g) == list(range(len(costs)))
        assert all(g == sorted(g) and g for g in groups)
        cost = [sum(costs[i] for i in g) for g in groups]
        assert cost[0] == max(cost)  # the caller keeps the costliest share
        # Graham's bound for LPT: within 4/3 of the perfect split (and of the largest fit)
        assert max(cost) <= 4 / 3 * max(sum(costs) / len(groups), 30)
    assert sorted(sum(costs[i] for i in g) for g in balanced_shares(costs, 2)) == [165, 180]
    assert balanced_shares([], 3) == []


def test_fit_shares_follow_the_cluster_cpus():
    from embgeom_ray.distributed.kmeans import fit_shares

    assert fit_shares(7, 1, cpus=2) == (1, 2)
    assert fit_shares(7, 1, cpus=32) == (4, 32)
    assert fit_shares(33, 2, cpus=16) == (1, 8)
    assert fit_shares(3, 4, cpus=2) == (1, 1)  # fewer CPUs than a task takes: never split


def test_ray_fits_keep_the_order_and_use_other_processes(ray_local):
    import os

    from embgeom_ray.distributed.kmeans import RayFits

    X = np.arange(12.0).reshape(4, 3)
    inits = [np.arange(100 + k, 100 + 2 * k) for k in range(2, 9)]
    got = RayFits(initial_shares=3, later_shares=1)(_fit_where, X, inits, initial=True)
    assert [(k, first) for _, k, first, _ in got] == [(len(i), int(i[0])) for i in inits]
    assert all(total == float(X.sum()) for *_, total in got)  # every task saw the points
    pids = {pid for pid, *_ in got}
    assert os.getpid() in pids and len(pids) >= 2  # the caller's share and the tasks'
    alone = RayFits(initial_shares=3, later_shares=1)(_fit_where, X, inits, initial=False)
    assert {pid for pid, *_ in alone} == {os.getpid()}


def test_ray_fits_do_not_wait_for_ever_on_share_tasks_ray_cannot_start(ray_local, monkeypatch):
    """Free memory read as the step splits may be gone when its share tasks ask for it (other
    selections took it, each waiting for its own shares): a share that never starts must not
    hold its selection for ever. Here each asks more memory than any node has: the selection
    fits every group itself, in order, and cancels the tasks."""
    import os
    import threading

    from embgeom_ray.distributed import kmeans

    monkeypatch.setattr(kmeans, "share_task_bytes", lambda n, d, ks: 1 << 42)  # no node holds 4 TiB
    monkeypatch.setattr(kmeans.ray, "available_resources", lambda: {"CPU": 8.0, "memory": 1e18})
    monkeypatch.setattr(kmeans, "SHARE_WAIT_MIN_S", 0.5, raising=False)
    X = np.arange(12.0).reshape(4, 3)
    inits = [np.arange(100 + k, 100 + 2 * k) for k in range(2, 9)]
    got = []
    call = threading.Thread(target=lambda: got.append(
        kmeans.RayFits(initial_shares=3)(_fit_where, X, inits)), daemon=True)  # fmt: skip
    call.start()
    call.join(timeout=60)
    assert not call.is_alive(), "RayFits waited for share tasks Ray could never start"
    assert [(k, first) for _, k, first, _ in got[0]] == [(len(i), int(i[0])) for i in inits]
    assert {pid for pid, *_ in got[0]} == {os.getpid()}


def test_select_k_with_fits_over_tasks_equals_one_process(ray_local, many_blobs):
    from embgeom_ray.distributed.kmeans import RayFits

    X, _ = many_blobs
    with threadpool_limits(1):  # the tasks run one thread each, as RayFits' default
        ref = select_k(X, k_max=30, seed=0, stability_seeds=2)
        got = select_k(X, k_max=30, seed=0, stability_seeds=2, map_fits=RayFits(2, 3, threads=1))
    assert got.k == ref.k == 24
    assert got.silhouettes == ref.silhouettes and got.inertias == ref.inertias
    assert got.stability == ref.stability == pytest.approx(1.0)
    np.testing.assert_array_equal(got.labels, ref.labels)
    np.testing.assert_array_equal(got.centers, ref.centers)
