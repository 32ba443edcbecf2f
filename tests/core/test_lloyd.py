"""Many Lloyd fits at once (core/lloyd.py) against Lloyd written out by hand and scikit-learn."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.cluster import KMeans
from sklearn.metrics import adjusted_rand_score

from embgeom_ray.core.lloyd import Points, Start, canonical, cluster_sums, lloyd_many


def lloyd_by_hand(X: np.ndarray, centers: np.ndarray, iters: int = 300) -> np.ndarray:
    """Plain float64 Lloyd to its fixed point (no tolerance): the labels."""
    lab = None
    for _ in range(iters):
        new = ((X[:, None, :] - centers[None]) ** 2).sum(-1).argmin(1)
        if lab is not None and (new == lab).all():
            break
        lab = new
        centers = np.stack([X[lab == c].mean(0) for c in range(len(centers))])
    return lab


@pytest.fixture(scope="module")
def points():
    rng = np.random.default_rng(5)
    C = rng.normal(scale=3.0, size=(6, 8))
    X = np.vstack([rng.normal(size=(150, 8)) + c for c in C])
    return X - X.mean(0)


def test_cold_fits_are_lloyd_and_independent_of_their_batch(points):
    X = points
    rng = np.random.default_rng(1)
    inits = [X[rng.choice(len(X), k, replace=False)] for k in (2, 3, 3, 5, 8, 8, 8)]
    P = Points(X, np.float64)
    batch = lloyd_many(P, [Start(c) for c in inits], tol=0.0)
    for init, res in zip(inits, batch, strict=True):
        assert adjusted_rand_score(res.labels, lloyd_by_hand(X, init)) == 1.0
        sk = KMeans(len(init), init=init, n_init=1, tol=0.0).fit(X)
        assert adjusted_rand_score(res.labels, sk.labels_) == 1.0
        np.testing.assert_allclose(res.inertia, sk.inertia_, rtol=1e-9)
        alone = lloyd_many(P, [Start(init)], tol=0.0)[0]
        np.testing.assert_array_equal(alone.labels, res.labels)
        assert alone.inertia == res.inertia and alone.n_iter == res.n_iter
        np.testing.assert_array_equal(res.labels, canonical(res.labels, res.k))


def test_warm_starts_update_from_the_gram_matrix_as_lloyd_does(points):
    """A warm start (a partition's labels, sums and products with the points, plus new
    centres) gives the partition of cold Lloyd from the same centres."""
    X = points
    gram = X @ X.T
    P = Points(X, np.float64, gram)
    prev = lloyd_many(P, [Start(X[[0, 200, 400]])], tol=0.0)[0]
    sums = cluster_sums(X, prev.labels, prev.k)
    dots = sums @ X.T
    rng = np.random.default_rng(2)
    starts = [
        Start(
            np.vstack([prev.centers, X[rng.choice(len(X), m, replace=False)]]),
            prev.labels,
            sums,
            dots,
        )
        for m in (1, 2, 3, 3, 5)
    ]
    warm = lloyd_many(P, starts, tol=0.0)
    cold = lloyd_many(P, [Start(s.centers) for s in starts], tol=0.0)
    for w, c, s in zip(warm, cold, starts, strict=True):
        assert w.k == len(s.centers)
        np.testing.assert_array_equal(w.labels, c.labels)
        np.testing.assert_allclose(w.inertia, c.inertia, rtol=1e-12)
        assert adjusted_rand_score(w.labels, lloyd_by_hand(X, s.centers)) == 1.0


def test_an_empty_cluster_takes_the_farthest_point(points):
    """Two centres at the same place: one is left empty and, as in scikit-learn, takes the point
    farthest from its centre; the fit still has k clusters."""
    X = points
    init = np.vstack([X[:3], X[2:3]])  # the last centre repeats the third
    res = lloyd_many(Points(X, np.float64), [Start(init)], tol=0.0)[0]
    assert res.k == 4 and len(np.unique(res.labels)) == 4
    np.testing.assert_allclose(
        res.inertia,
        sum(((X[res.labels == c] - X[res.labels == c].mean(0)) ** 2).sum() for c in range(4)),
    )
