"""The sampled metrics of a layer with more distinct points than ``--silhouette-max-points``,
on real activations (MiniLM over repeated English sentences, the sample of
tests/core/test_kmeans_selection_minilm.py).

Past the cap the metrics hold no n × n matrix: the layer's neighbour tables are built a block
of rows at a time (:func:`embgeom_ray.core.neighbours.neighbour_tables_of_points`) and each
half-sample's silhouettes take one matrix of the points they score. The LIDs and their
standard errors must equal those of the same points under the cap (their tables from the
matrices), and the silhouettes scikit-learn's ``silhouette_score`` on the points drawn.
"""

from __future__ import annotations

import numpy as np
import pytest

from embgeom_ray.core import neighbours
from embgeom_ray.core.distinct import distinct_rows
from embgeom_ray.core.kmeans_selection import select_k
from embgeom_ray.core.sampled_metrics import sampled_metrics_of_points, silhouette_by_labels

pytestmark = pytest.mark.slow

LIDS = [
    "lid_euclidean", "lid_euclidean_median", "lid_cosine", "lid_cosine_median",
]  # fmt: skip


@pytest.mark.parametrize("layer", [1, 6])
def test_a_layer_past_the_cap_takes_the_lids_of_the_matrices(minilm_points, layer, monkeypatch):
    X, keys, tok = minilm_points[layer]
    first, _ = distinct_rows(X, keys)
    n = len(first)
    km = select_k(X, k_max=4, seed=0, groups=keys)
    opts = {"groups": keys, "se_replicates": 4, "seed": 3}
    under = sampled_metrics_of_points(X, tok, None, km, silhouette_max_points=n, **opts)
    monkeypatch.setattr(neighbours, "BLOCK_BYTES", 8 * n * 100)  # blocks of 100 rows
    cap = n // 2 + 10  # under the distinct points, above a half-sample's
    past = sampled_metrics_of_points(X, tok, None, km, silhouette_max_points=cap, **opts)
    for key in [*LIDS, "lid_euclidean_cai", *(f"{m}_se" for m in LIDS)]:
        np.testing.assert_allclose(past[key], under[key], rtol=1e-12, err_msg=key)
    want = silhouette_by_labels(X[first], tok[first], max_points=cap, seed=3, min_label_count=2)
    np.testing.assert_allclose(past["silhouette_types"], want, rtol=1e-9)
    assert np.isfinite(past["silhouette_types_se"]) and np.isfinite(past["kmeans_silhouette_se"])
