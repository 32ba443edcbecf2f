"""K-means fits (k-means||, Lloyd over partitions; serial and on Ray) against scikit-learn."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.cluster import KMeans
from sklearn.datasets import load_digits, make_blobs

from embgeom_ray.core.kmeans import (
    Partition,
    combine_partials,
    fit,
    kmeans_parallel_init,
    lloyd_partial,
    partition,
    serial_map,
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
