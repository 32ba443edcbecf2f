"""k-means++ with the float64 copy made once a fit (embgeom_ray.core.kmeanspp) is scikit-learn's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.cluster import KMeans
from sklearn.cluster._kmeans import _kmeans_plusplus
from sklearn.metrics.pairwise import _euclidean_distances
from sklearn.utils.extmath import row_norms
from threadpoolctl import threadpool_limits

from embgeom_ray.core.kmeans import fit_local
from embgeom_ray.core.kmeanspp import PlusPlus, squared_norms, upcast_batch_size
from embgeom_ray.inputs.demo_corpus import python_docs_documents


@pytest.fixture(scope="module")
def minilm_points(minilm_dir) -> np.ndarray:
    """MiniLM's layer-3 hidden states of ~1,500 tokens of English prose, centred, float32 (as
    KMeans.fit hands them to its seeding)."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    model = AutoModel.from_pretrained(minilm_dir).eval()
    docs = python_docs_documents()[:12]
    enc = tok(docs, truncation=True, max_length=128, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**enc, output_hidden_states=True).hidden_states[3]
    X = hidden[enc["attention_mask"].bool()].double().numpy()
    assert len(X) > 1000
    return (X - X.mean(axis=0)).astype(np.float32)


def offset_points(n=1500, d=48, seed=3) -> np.ndarray:
    """Points 10⁴ from the origin in one direction (float32 keeps ~3 digits of their spread)."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    X[:, 0] += 1e4
    return X.astype(np.float32)


def sklearn_seeds(X: np.ndarray, k: int, seed: int, inits: int) -> list[np.ndarray]:
    rs = np.random.RandomState(seed)
    w = np.ones(len(X), dtype=X.dtype)
    return [_kmeans_plusplus(X, k, row_norms(X, squared=True), w, rs)[0] for _ in range(inits)]


def our_seeds(X: np.ndarray, k: int, seed: int, inits: int) -> list[np.ndarray]:
    rs, pp = np.random.RandomState(seed), PlusPlus()
    return [pp(X, k, rs) for _ in range(inits)]


@pytest.mark.parametrize("k", [2, 3, 9, 15, 31])
def test_seeds_equal_sklearns_bit_for_bit_on_minilm(minilm_points, k):
    """Three seedings from one random state (as KMeans's n_init = 3 runs them), the random
    state's draws and the centres chosen both the same."""
    with threadpool_limits(1):
        for seed in (0, 11):
            ours, ref = our_seeds(minilm_points, k, seed, 3), sklearn_seeds(minilm_points, k, seed, 3)
            for a, b in zip(ours, ref, strict=True):
                np.testing.assert_array_equal(a, b)


def test_seeds_equal_sklearns_on_offset_and_duplicated_points():
    X = offset_points()
    dup = np.repeat(offset_points(n=40, d=8, seed=5), 30, axis=0)  # 40 points 30 times each
    for data in (X, dup):
        for k in (2, 6, 40):
            for a, b in zip(our_seeds(data, k, 4, 2), sklearn_seeds(data, k, 4, 2), strict=True):
                np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("n", [50, 4096])
def test_distances_are_sklearns_upcast_distances(n):
    """For n = 4,096 and d = 96 the points are copied in chunks (sklearn's batch size), the
    last one short; for n = 50 in one."""
    rng = np.random.default_rng(n)
    X = (rng.normal(size=(n, 96)) * 3 + 7).astype(np.float32)
    assert (upcast_batch_size(4, n, 96) < n) == (n == 4096)
    pp = PlusPlus()
    pp._prepare(X)
    ids = np.array([0, 17, n - 1, 17])
    np.testing.assert_array_equal(pp.distances(ids), _euclidean_distances(X[ids], X, squared=True))
    np.testing.assert_array_equal(squared_norms(X.astype(np.float64)), row_norms(X.astype(np.float64), squared=True))


def test_kmeans_with_plusplus_is_kmeans_with_kmeanspp(minilm_points):
    """The whole fit (seeding, Lloyd, the best of three) unchanged; and fit_local's float32
    route, which uses it, gives scikit-learn's labels."""
    X = minilm_points
    with threadpool_limits(1):
        for k in (4, 12):
            ref = KMeans(k, init="k-means++", n_init=3, random_state=2, algorithm="lloyd").fit(X)
            ours = KMeans(k, init=PlusPlus(), n_init=3, random_state=2, algorithm="lloyd").fit(X)
            np.testing.assert_array_equal(ours.cluster_centers_, ref.cluster_centers_)
            np.testing.assert_array_equal(ours.labels_, ref.labels_)
            assert ours.inertia_ == ref.inertia_ and ours.n_iter_ == ref.n_iter_
            local = fit_local(X.astype(np.float64), k, n_init=3, seed=2, dtype=np.float32)
            np.testing.assert_array_equal(local.labels, ref.labels_)


def test_float64_points_are_refused():
    with pytest.raises(TypeError, match="float32"):
        PlusPlus()(np.zeros((5, 2)), 2, np.random.RandomState(0))
