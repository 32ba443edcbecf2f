"""K-means core (serial) and its Ray layer against scikit-learn."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.cluster import KMeans
from sklearn.datasets import load_digits, make_blobs
from sklearn.metrics import pairwise_distances, silhouette_score
from threadpoolctl import threadpool_limits

import embgeom_ray.core.kmeans as kmeans_module
from embgeom_ray.core.kmeans import (
    LOCAL_FIT_MAX_ELEMENTS,
    Partition,
    combine_partials,
    fit,
    fit_local,
    kmeans_parallel_init,
    lloyd_partial,
    partition,
    select_k,
    serial_map,
    silhouette_from_distances,
)


def blobs(n=1500, d=12, centers=5, seed=0, offset=0.0):
    """Well separated unit-variance Gaussian blobs (centres ~ N(0, 8² I), ≥ ~20 apart)."""
    rng = np.random.default_rng(seed)
    C = rng.normal(scale=8.0, size=(centers, d))
    X, y = make_blobs(n, d, centers=C, cluster_std=1.0, random_state=seed)
    return X + offset, y


def test_partial_sums_over_partitions_equal_one_pass():
    X, _ = blobs()
    rng = np.random.default_rng(0)
    C = X[rng.choice(len(X), 5, replace=False)]
    whole = lloyd_partial(X, C)
    parts = combine_partials(lloyd_partial(p.X, C) for p in partition(X, 7))
    np.testing.assert_allclose(parts[0], whole[0], rtol=1e-12)
    np.testing.assert_array_equal(parts[1], whole[1])
    np.testing.assert_allclose(parts[2], whole[2], rtol=1e-12)
    # brute force
    d2 = ((X[:, None, :] - C[None]) ** 2).sum(-1)
    lab = d2.argmin(1)
    np.testing.assert_array_equal(whole[1], np.bincount(lab, minlength=5))
    np.testing.assert_allclose(whole[0][2], X[lab == 2].sum(0), rtol=1e-12)
    np.testing.assert_allclose(whole[2], d2.min(1).sum(), rtol=1e-12)
    assert [p.offset for p in partition(X, 7)] == sorted(p.offset for p in partition(X, 7))
    assert sum(len(p.X) for p in partition(X, 7)) == len(X)


def test_kmeans_parallel_init_is_partition_independent_and_finds_the_blobs():
    X, y = blobs(centers=6, seed=1)
    inits = [
        kmeans_parallel_init(X, 6, np.random.default_rng(3), parts=partition(X, p)) for p in (1, 4)
    ]
    np.testing.assert_allclose(inits[0], inits[1], rtol=1e-9)
    # each blob gets one initial centre (well separated blobs)
    owner = [y[((X - c) ** 2).sum(1).argmin()] for c in inits[0]]
    assert sorted(owner) == list(range(6))


@pytest.mark.parametrize("n_parts", [1, 3])
def test_serial_fit_matches_sklearn_on_blobs(n_parts):
    X, _ = blobs(offset=500.0)
    ours = fit(X, 5, n_init=2, seed=0, n_partitions=n_parts)
    ref = KMeans(5, n_init=2, random_state=0).fit(X)
    assert ours.inertia <= ref.inertia_ * 1.01
    # same partition of the points, centres in the input coordinates
    ref_c = ref.cluster_centers_[np.argsort(ref.cluster_centers_[:, 0])]
    np.testing.assert_allclose(ours.centers[np.argsort(ours.centers[:, 0])], ref_c, rtol=1e-9)
    assert ours.labels.shape == (len(X),)
    np.testing.assert_allclose(((X - ours.centers[ours.labels]) ** 2).sum(), ours.inertia)


def test_select_k_follows_cai_et_al():
    X, _ = blobs(n=800, d=8, centers=4, seed=2)
    res = select_k(X, ks=range(2, 8), seed=0)
    assert res.k == 4
    assert res.silhouette == max(res.silhouettes.values())
    np.testing.assert_allclose(res.silhouette, silhouette_score(X, res.labels), rtol=1e-10)
    # structureless data: best silhouette < 0.1, so one cluster
    Z = np.random.default_rng(0).normal(size=(600, 32))
    one = select_k(Z, ks=range(2, 6), seed=0)
    assert one.k == 1 and one.silhouette < 0.1
    np.testing.assert_allclose(one.centers[0], Z.mean(0))
    assert (one.labels == 0).all()
    # a stricter threshold turns the blobs into one cluster too; the silhouette is still reported
    strict = select_k(X, ks=range(2, 8), min_silhouette=0.99, seed=0)
    assert strict.k == 1 and strict.silhouette == res.silhouette


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


def test_fit_local_is_sklearn_kmeans():
    X, y = blobs(n=900, d=10, centers=4, seed=8, offset=50.0)
    ours = fit_local(X, 4, n_init=3, seed=5)
    ref = KMeans(4, n_init=3, random_state=5, algorithm="lloyd").fit(X)
    np.testing.assert_array_equal(ours.labels, ref.labels_)
    np.testing.assert_allclose(ours.centers, ref.cluster_centers_, rtol=1e-12)
    assert ours.inertia == pytest.approx(ref.inertia_, rel=1e-12) and ours.n_iter == ref.n_iter_
    # the blobs are found: labels are a relabelling of y
    assert len({(a, b) for a, b in zip(ours.labels, y, strict=True)}) == 4
    # float32 Lloyd: same clusters here, inertia recomputed in float64 for the returned centres
    f32 = fit_local(X, 4, n_init=3, seed=5, dtype=np.float32)
    np.testing.assert_array_equal(f32.labels, ours.labels)
    np.testing.assert_allclose(((X - f32.centers[f32.labels]) ** 2).sum(), f32.inertia, rtol=1e-12)
    np.testing.assert_allclose(f32.inertia, ours.inertia, rtol=1e-5)
    with pytest.raises(ValueError, match="k must be"):
        fit_local(X[:3], 4)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_select_k_small_sample_equals_independent_sklearn_computation(dtype):
    """The fast path is Cai et al.'s selection with scikit-learn's KMeans on the centred points.

    float32 is the default (Lloyd on the centred points cast to float32; inertias in float64).
    """
    X, y = blobs(n=1200, d=8, centers=4, seed=9, offset=-30.0)
    assert X.size <= LOCAL_FIT_MAX_ELEMENTS
    ks = range(2, 8)
    kwargs = {} if dtype == np.float32 else {"local_dtype": dtype}
    res = select_k(X, ks=ks, n_init=3, seed=2, **kwargs)
    Xc = X - X.mean(axis=0)
    fits = {k: KMeans(k, n_init=3, random_state=2).fit(Xc.astype(dtype)) for k in ks}
    sils = {k: silhouette_score(X, f.labels_) for k, f in fits.items()}
    assert res.k == max(sils, key=sils.get) == 4
    assert sorted(res.silhouettes) == list(ks)
    for k, f in fits.items():
        np.testing.assert_allclose(res.silhouettes[k], sils[k], rtol=1e-10)
        centers = f.cluster_centers_.astype(np.float64)
        inertia = ((Xc - centers[f.labels_]) ** 2).sum()
        np.testing.assert_allclose(res.inertias[k], inertia, rtol=1e-10)
    np.testing.assert_allclose(res.silhouette, sils[4], rtol=1e-10)
    assert res.silhouette > 0.7
    np.testing.assert_array_equal(res.labels, fits[4].labels_)
    np.testing.assert_allclose(res.centers, fits[4].cluster_centers_ + X.mean(axis=0), rtol=1e-10)
    assert len({(a, b) for a, b in zip(res.labels, y, strict=True)}) == 4  # the true blobs


def test_select_k_routes_by_sample_size(monkeypatch):
    """n·d ≤ local_max_elements: fit_local only; above it (or with a map/partitions): fit only."""
    calls = {"local": 0, "distributed": 0}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(kmeans_module, "fit_local", spy("local", kmeans_module.fit_local))
    monkeypatch.setattr(kmeans_module, "fit", spy("distributed", kmeans_module.fit))
    X, _ = blobs(n=600, d=6, centers=3, seed=10)  # n·d = 3600
    ks = range(2, 6)
    # 4 fits (k = 2..5) and STABILITY_SEEDS = 2 refits of the best k, all on one route
    assert kmeans_module.STABILITY_SEEDS == 2
    expected = {
        3600: {"local": 6, "distributed": 0},  # the threshold itself is small
        3599: {"local": 0, "distributed": 6},
        None: {"local": 0, "distributed": 6},
    }
    results = {}
    for limit, want in expected.items():
        calls.update(local=0, distributed=0)
        results[limit] = select_k(X, ks=ks, n_init=2, seed=0, local_max_elements=limit)
        assert calls == want, limit
        assert results[limit].k == 3
    # an explicit map (the Ray layer's) always takes the partitioned path
    calls.update(local=0, distributed=0)
    mapped = select_k(X, ks=ks, n_init=2, seed=0, map_fn=serial_map)
    assert calls == {"local": 0, "distributed": 6}
    np.testing.assert_allclose(mapped.inertias[4], results[None].inertias[4], rtol=1e-12)
    # both routes find the same clusters on well separated blobs
    np.testing.assert_allclose(results[3600].inertia, results[None].inertia, rtol=1e-9)
    np.testing.assert_allclose(results[3600].silhouette, results[None].silhouette, rtol=1e-9)


# ------------------------------------------------------------------- Ray layer
@pytest.fixture(scope="module")
def local_ray():
    """A local Ray with 2 CPUs for this module (reused, and left running, if one is up)."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            logging_level="ERROR",
            configure_logging=False,
        )
    yield ray
    if started:
        ray.shutdown()


def test_distributed_kmeans_inertia_within_one_percent_of_sklearn(local_ray):
    from embgeom_ray.distributed.kmeans import fit_on_ray, ray_map

    digits = load_digits().data.astype(np.float64)
    blob, _ = blobs(n=2000, d=16, centers=7, seed=4)
    for X, k, n_init in ((blob, 7, 3), (digits, 10, 10)):
        ours = fit_on_ray(X, k, n_init=n_init, seed=0, n_partitions=3)
        ref = KMeans(k, n_init=n_init, random_state=0).fit(X)
        assert ours.inertia <= 1.01 * ref.inertia_, (k, ours.inertia / ref.inertia_)
        assert ours.labels.shape == (len(X),)
        np.testing.assert_allclose(((X - ours.centers[ours.labels]) ** 2).sum(), ours.inertia)
    # the Ray map is just a map
    parts = [local_ray.put(p) for p in partition(blob, 2)]
    assert ray_map(len, parts) == [2, 2]  # a Partition is an (offset, X) pair
    got = ray_map(lambda p: float(p.X.sum()), parts)
    assert got == serial_map(lambda p: float(p.X.sum()), partition(blob, 2))
    assert isinstance(partition(blob, 2)[0], Partition)


@pytest.mark.parametrize("local_max_elements", [LOCAL_FIT_MAX_ELEMENTS, None])
def test_fit_layers_on_ray_equals_serial_selection(local_ray, local_max_elements):
    """Both routes (one task per layer with sklearn; partitions and a Ray map) equal serial."""
    from embgeom_ray.distributed.kmeans import fit_layers_on_ray

    by_layer = {
        0: blobs(n=600, d=6, centers=3, seed=5, offset=100.0)[0],
        3: blobs(n=600, d=6, centers=5, seed=6)[0],
    }
    opts = {"ks": range(2, 7), "n_init": 2, "seed": 1, "local_max_elements": local_max_elements}
    got = fit_layers_on_ray(by_layer, n_partitions=2, **opts)
    assert sorted(got) == [0, 3]
    assert got[0].k == 3 and got[3].k == 5
    for layer, X in by_layer.items():
        with threadpool_limits(1):  # as in the task
            serial = select_k(X, n_partitions=2, **opts)
        assert got[layer].k == serial.k
        np.testing.assert_allclose(got[layer].inertia, serial.inertia, rtol=1e-8)
        np.testing.assert_allclose(got[layer].centers, serial.centers, rtol=1e-8)
        np.testing.assert_allclose(got[layer].silhouette, serial.silhouette, rtol=1e-8)
        assert got[layer].labels.shape == (len(X),)


def test_fit_layers_on_ray_routes_each_layer_by_its_size(local_ray):
    """A tiny threshold: layer 1 (n·d = 2400) one sklearn task, layer 2 (4800) the k-means|| map.

    On structureless data with few Lloyd steps the two algorithms give different clusters, so
    equality with the serial run of each route shows which one ran.
    """
    from embgeom_ray.distributed.kmeans import fit_layers_on_ray, submit_layers_on_ray

    rng = np.random.default_rng(11)
    by_layer = {1: rng.normal(size=(400, 6)), 2: rng.normal(size=(800, 6)) + 3.0}
    opts = {"ks": range(2, 5), "n_init": 1, "max_iter": 2, "seed": 3, "min_silhouette": 0.0}
    got = fit_layers_on_ray(by_layer, local_max_elements=3000, n_partitions=3, **opts)
    with threadpool_limits(1):
        small_local = select_k(by_layer[1], local_max_elements=3000, **opts)
        small_kmpar = select_k(by_layer[1], local_max_elements=None, n_partitions=3, **opts)
    large_kmpar = select_k(by_layer[2], local_max_elements=None, n_partitions=3, **opts)
    large_local = select_k(by_layer[2], local_max_elements=10**9, **opts)
    for mine, other in ((small_local, small_kmpar), (large_kmpar, large_local)):
        assert not np.allclose(list(mine.inertias.values()), list(other.inertias.values()))
    for layer, ref in ((1, small_local), (2, large_kmpar)):
        np.testing.assert_array_equal(got[layer].labels, ref.labels)
        np.testing.assert_allclose(got[layer].centers, ref.centers, rtol=1e-9)
        for k in opts["ks"]:
            np.testing.assert_allclose(got[layer].inertias[k], ref.inertias[k], rtol=1e-9)
            np.testing.assert_allclose(got[layer].silhouettes[k], ref.silhouettes[k], rtol=1e-9)
    # the non-blocking form gives the same, as object refs
    refs = submit_layers_on_ray(by_layer, local_max_elements=3000, n_partitions=3, **opts)
    again = dict(zip(refs, local_ray.get(list(refs.values())), strict=True))
    for layer in by_layer:
        np.testing.assert_array_equal(again[layer].labels, got[layer].labels)


# ------------------------------------------------- model selection a reader can trust
@pytest.fixture(scope="module")
def many_blobs():
    """24 well separated blobs of 25 points in 10 dims: the true k lies beyond k = 2..15."""
    return blobs(n=600, d=10, centers=24, seed=12)


def test_select_k_grows_past_the_default_range_to_an_interior_optimum(many_blobs):
    X, y = many_blobs
    res = select_k(X, seed=0)  # the defaults: k = 2..15, grown up to the cap (60)
    assert kmeans_module.KS == range(2, 16) and kmeans_module.K_CAP == 60
    assert res.k == res.best_k == 24 and not res.at_cap
    # 15 was the best of 2..15, so 16..30 were searched; 24 is interior there: no more
    assert res.k_searched == 30 and sorted(res.silhouettes) == list(range(2, 31))
    assert max(res.silhouettes, key=res.silhouettes.get) == 24
    assert res.silhouettes[15] == max(res.silhouettes[k] for k in range(2, 16))
    # the true blobs, found again by every refit with another seed
    assert len(set(zip(res.labels, y, strict=True))) == 24
    assert res.stability == pytest.approx(1.0, abs=1e-12)
    # the same answer as searching k = 2..30 at once (each k's fit depends on k and seed only)
    direct = select_k(X, ks=range(2, 31), k_cap=2, seed=0, stability_seeds=0)
    assert direct.k == 24 and np.isnan(direct.stability)
    np.testing.assert_array_equal(direct.labels, res.labels)
    assert direct.silhouettes == res.silhouettes


def test_select_k_flags_a_best_k_at_the_cap(many_blobs):
    X, _ = many_blobs
    # 2..15, then 16..24: the best k is the cap itself, so no interior optimum is known
    capped = select_k(X, k_cap=24, seed=0, stability_seeds=0)
    assert capped.best_k == capped.k == capped.k_searched == 24 and capped.at_cap
    assert sorted(capped.silhouettes) == list(range(2, 25))
    # a cap at most k_max is Cai et al.'s fixed range: nothing grows, and k = 15 is flagged
    fixed = select_k(X, k_cap=15, seed=0, stability_seeds=0)
    assert fixed.k == fixed.k_searched == 15 and fixed.at_cap
    assert sorted(fixed.silhouettes) == list(range(2, 16))
    # n - 1 bounds the search as the cap does
    tiny = select_k(X[:7], ks=range(2, 4), seed=0, stability_seeds=0)
    assert tiny.k_searched <= 6


def test_select_k_interior_optimum_is_the_answer_of_the_range_alone():
    X, _ = blobs(n=800, d=8, centers=4, seed=2)
    grown = select_k(X, ks=range(2, 8), seed=0)
    fixed = select_k(X, ks=range(2, 8), k_cap=7, seed=0)
    assert grown.k == fixed.k == 4 and not grown.at_cap and not fixed.at_cap
    assert sorted(grown.silhouettes) == list(range(2, 8)) and grown.k_searched == 7
    np.testing.assert_array_equal(grown.labels, fixed.labels)
    assert grown.silhouette == fixed.silhouette and grown.stability == 1.0
    # structureless points: the best of the rejected k is reported, k = 1 chosen, and refits
    # with other seeds agree far less than on blobs
    Z = np.random.default_rng(0).normal(size=(400, 16))
    noise = select_k(Z, ks=range(2, 6), k_cap=5, seed=0, stability_seeds=3)
    assert noise.k == 1 and noise.best_k in range(2, 6)
    assert noise.best_labels is not None and len(np.unique(noise.best_labels)) == noise.best_k
    assert noise.stability < 0.9


def test_select_k_fits_each_distinct_point_once(many_blobs):
    """Planted exact duplicates: the fit, k and silhouette are those of the distinct points."""
    X, _ = blobs(n=300, d=6, centers=3, seed=3)
    rng = np.random.default_rng(1)
    copies = rng.choice(300, size=120)  # some points repeated up to several times
    order = rng.permutation(420)
    Xd = np.vstack([X, X[copies]])[order]
    first, inverse = kmeans_module.distinct_rows(Xd)
    np.testing.assert_array_equal(Xd[first][inverse], Xd)
    assert len(first) == 300 and np.all(np.diff(first) > 0)
    dup = select_k(Xd, ks=range(2, 6), seed=0)
    ref = select_k(Xd[first], ks=range(2, 6), seed=0)
    assert dup.k == ref.k == 3 and dup.n_distinct == 300
    assert dup.silhouettes == ref.silhouettes and dup.stability == ref.stability
    np.testing.assert_array_equal(dup.labels, ref.labels[inverse])
    np.testing.assert_array_equal(dup.best_labels, ref.best_labels[inverse])
    np.testing.assert_allclose(dup.centers, ref.centers, rtol=1e-12)
    # the silhouette is sklearn's over the distinct points
    np.testing.assert_allclose(
        dup.silhouette, silhouette_score(Xd[first], dup.labels[first]), rtol=1e-10
    )
    # without duplicates nothing changes: the rows are their own distinct rows
    np.testing.assert_array_equal(kmeans_module.distinct_rows(X)[0], np.arange(300))


def test_fit_layers_on_ray_fits_distinct_points_on_both_routes(local_ray):
    """Duplicated rows: the partitioned route de-duplicates before partitioning, as serial."""
    from embgeom_ray.distributed.kmeans import fit_layers_on_ray

    X, _ = blobs(n=300, d=6, centers=3, seed=4)
    Xd = np.vstack([X, X[:90]])
    opts = {"ks": range(2, 5), "n_init": 2, "seed": 1, "stability_seeds": 1}
    ref = select_k(X, **opts)
    for limit in (LOCAL_FIT_MAX_ELEMENTS, None):
        got = fit_layers_on_ray({0: Xd}, local_max_elements=limit, n_partitions=2, **opts)[0]
        assert got.k == ref.k == 3 and got.n_distinct == 300
        assert got.labels.shape == (390,) and got.best_labels.shape == (390,)
        np.testing.assert_array_equal(got.labels[300:], got.labels[:90])
        np.testing.assert_allclose(got.silhouette, ref.silhouette, rtol=1e-8)
        assert got.stability == pytest.approx(1.0)


# ------------------------------------------------- a layer's fits spread over tasks
def _fit_where(X, k, seed):
    """A stand-in ``fit_one`` that says which process fitted (k, seed)."""
    import os

    return (os.getpid(), k, seed, float(X.sum()))


def test_balanced_shares_split_by_k():
    from embgeom_ray.distributed.kmeans import balanced_shares

    specs = [(k, 0) for k in range(16, 31)]
    for shares in (1, 2, 3, 4, 15, 40):
        groups = balanced_shares(specs, shares)
        assert len(groups) == min(shares, len(specs))
        assert sorted(i for g in groups for i in g) == list(range(len(specs)))
        assert all(g == sorted(g) and g for g in groups)
        cost = [sum(specs[i][0] for i in g) for g in groups]
        assert cost[0] == max(cost)  # the caller keeps the costliest share
        # Graham's bound for LPT: within 4/3 of the perfect split (and of the largest fit)
        assert max(cost) <= 4 / 3 * max(sum(k for k, _ in specs) / len(groups), 30)
    # 15 fits of k = 16..30 in 2 shares: 180 against 165 (LPT), where the two halves by count
    # (16..23 and 24..30) would cost 156 against 189
    assert sorted(sum(specs[i][0] for i in g) for g in balanced_shares(specs, 2)) == [165, 180]
    assert balanced_shares([], 3) == []


def test_fit_shares_follow_the_cluster_cpus():
    from embgeom_ray.distributed.kmeans import fit_shares

    assert fit_shares(7, 1, cpus=2) == (1, 2)  # this machine: the grown ranges in 2 shares
    assert fit_shares(7, 1, cpus=32) == (4, 32)
    assert fit_shares(33, 2, cpus=16) == (1, 8)
    assert fit_shares(3, 4, cpus=2) == (1, 1)  # fewer CPUs than a task takes: never split


def test_ray_fits_keep_the_order_and_use_other_processes(local_ray):
    import os

    from embgeom_ray.distributed.kmeans import RayFits

    X = np.arange(12.0).reshape(4, 3)
    specs = [(k, 100 + k) for k in range(2, 9)]
    got = RayFits(initial_shares=3, later_shares=1)(_fit_where, X, specs, initial=True)
    assert [(k, s) for _, k, s, _ in got] == specs
    assert all(total == float(X.sum()) for *_, total in got)  # every task saw the points
    pids = {pid for pid, *_ in got}
    assert os.getpid() in pids and len(pids) >= 2  # the caller's share and the tasks'
    # one share: all fitted here, no task
    alone = RayFits(initial_shares=3, later_shares=1)(_fit_where, X, specs, initial=False)
    assert {pid for pid, *_ in alone} == {os.getpid()}


def test_select_k_with_fits_over_tasks_equals_one_process(local_ray, many_blobs):
    """The grown search (2..15, 16..30) and the refits, spread over Ray tasks: the same result."""
    from embgeom_ray.distributed.kmeans import RayFits

    X, _ = many_blobs
    with threadpool_limits(1):  # the tasks run one thread each, as RayFits' default
        ref = select_k(X, seed=0, stability_seeds=2)
        got = select_k(X, seed=0, stability_seeds=2, map_fits=RayFits(2, 3, threads=1))
    assert got.k == ref.k == 24 and got.k_searched == ref.k_searched == 30
    assert got.silhouettes == ref.silhouettes and got.inertias == ref.inertias
    assert got.stability == ref.stability == pytest.approx(1.0)
    np.testing.assert_array_equal(got.labels, ref.labels)
    np.testing.assert_array_equal(got.centers, ref.centers)
