"""The K-means model selection on real activations against scikit-learn's ``KMeans(n_init=10)``.

MiniLM's hidden states of a bottom-k sample of real English (sentences of the Python Language
Reference's prose, a third of them repeated, as tests/runs/test_sharding_invariance.py builds
them), every layer, each layer's distinct points by content key, centred. For every k of Cai
et al.'s range (2..15) scikit-learn fits the same points with its protocol (10 k-means++
seedings, the lowest inertia kept); ours must reach an inertia within 0.5% of it at every k and
no higher in the median over k, and take the decision (k = 1 or k ≥ 2, and the best k) that
scikit-learn's partitions give, unless at a k that decides it ours is another partition of
lower inertia: the protocol's own objective then prefers ours. Layer 6 of this sample is issue
50's case: at k = 2 a balanced partition (silhouette 0.05) and one with a small cluster
(silhouette 0.29) lie within 0.02% of each other; scikit-learn's 10 seedings keep the
balanced one and decide k = 1, ours find the small cluster's, of lower inertia, and decide
k = 2. Both of the scan's defaults are checked: Cai et al.'s range alone (k_max = 15, 10
seedings per k) and the job's (k_max = 60, 3 seedings and 3 warm starts per k, each k also
started from the next k's partition), whose decision on 2..15 is compared. The sample is
drawn once a session and shared with tests/core/test_sampled_metrics_minilm.py (the
``minilm_points`` fixture: tests/shared_runs.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.cluster import KMeans
from sklearn.metrics import pairwise_distances, silhouette_score
from threadpoolctl import threadpool_limits

from embgeom_ray.core.distinct import distinct_rows
from embgeom_ray.core.kmeans_selection import MIN_SILHOUETTE, select_k

pytestmark = pytest.mark.slow

KS = list(range(2, 16))


def inertia(X: np.ndarray, labels: np.ndarray) -> float:
    return float(
        sum(((X[labels == c] - X[labels == c].mean(0)) ** 2).sum() for c in np.unique(labels))
    )


def sklearn_scan(Xc: np.ndarray) -> dict[int, np.ndarray]:
    """scikit-learn's partition of every k: KMeans(n_init=10), the lowest inertia of 10 seedings."""
    return {k: KMeans(k, n_init=10, random_state=0).fit(Xc.astype(np.float32)).labels_ for k in KS}


def decision(sil: dict[int, float]) -> tuple[int, int]:
    best = max(sil, key=lambda k: (sil[k], -k))
    return (best if sil[best] >= MIN_SILHOUETTE else 1), best


@pytest.fixture(scope="module")
def sklearn_partitions(minilm_points):
    """layer -> (the distinct points centred, scikit-learn's partition of every k of KS)."""
    out = {}
    with threadpool_limits(1):
        for layer, (X, keys, _) in minilm_points.items():
            first, _ = distinct_rows(X, keys)
            Xc = X[first] - X[first].mean(0)
            out[layer] = (Xc, sklearn_scan(Xc))
    return out


@pytest.mark.parametrize(
    "k_max", [15, 60], ids=["cai-range-10-seedings", "job-default-scan-3-seedings"]
)
def test_every_layer_reaches_sklearns_inertia_and_takes_its_decision(
    minilm_points, sklearn_partitions, k_max
):
    """At k_max = 15 the scan is Cai et al.'s range and fits 10 seedings per k; at the job's
    default k_max = 60 it fits 3 seedings and 3 warm starts per k, and each k ≤ 15 also
    starts from the next k's partition (default_n_init). Either way every k ≤ 15 reaches
    scikit-learn's 10 seedings, and the decision taken on Cai et al.'s range is theirs."""
    competing, differ = None, {}
    with threadpool_limits(1):
        for layer, (X, keys, _) in minilm_points.items():
            Xc, theirs = sklearn_partitions[layer]
            ours = select_k(X, k_max=k_max, groups=keys, stability_seeds=0)
            ratios = np.array([ours.inertias[k] / inertia(Xc, theirs[k]) for k in KS])
            assert ratios.max() <= 1.005, (layer, dict(zip(KS, ratios.round(5), strict=True)))
            assert np.median(ratios) <= 1.0, (layer, np.median(ratios))
            for k in KS:  # our inertias are those of our partitions
                np.testing.assert_allclose(
                    ours.inertias[k], inertia(Xc, ours.partitions[k]), rtol=1e-9
                )
            # the decision on scikit-learn's partitions, scored the same way
            D = pairwise_distances(Xc)
            sil = {k: silhouette_score(D, theirs[k], metric="precomputed") for k in KS}
            for k in KS:
                np.testing.assert_allclose(
                    ours.silhouettes[k], silhouette_score(D, ours.partitions[k], metric="precomputed"),
                    rtol=1e-5, atol=1e-7,
                )  # fmt: skip
            k_theirs, best_theirs = decision(sil)
            k_ours, best_ours = decision({k: ours.silhouettes[k] for k in KS})
            if (k_ours, best_ours) != (k_theirs, best_theirs):  # a better partition decides
                deciding = {best_ours, best_theirs}
                better = [
                    k for k in deciding if ours.inertias[k] < inertia(Xc, theirs[k]) * (1 - 1e-9)
                ]
                assert better, (layer, k_ours, best_ours, k_theirs, best_theirs)
                differ[layer] = (k_ours, k_theirs, better)
            if layer == 6:  # issue 50's case: two partitions of k = 2 compete
                small = [
                    np.bincount(lab).min() / len(lab) for lab in (ours.partitions[2], theirs[2])
                ]
                competing = (
                    small,
                    ours.inertias[2] / inertia(Xc, theirs[2]),
                    sil[2],
                    ours.silhouettes[2],
                )
    # the small cluster's partition (ours) has the lower inertia by < 0.1% and a silhouette
    # over 0.25, the balanced one (scikit-learn's) one under 0.1: k = 2 against k = 1
    (ours_small, theirs_small), ratio, sil_theirs, sil_ours = competing
    assert ours_small < 0.15 < 0.25 < theirs_small and 0.999 < ratio < 1.0
    assert sil_ours > 0.25 > 0.1 > sil_theirs
    assert differ[6][:2] == (2, 1) and 2 in differ[6][2], differ
    # elsewhere the k = 1 vs k >= 2 decision is scikit-learn's; a best k may differ, where ours
    # is a partition of lower inertia at the k that decides (layers 0 and 2 here: near-ties)
    assert all((k == 1) == (k_sk == 1) for layer, (k, k_sk, _) in differ.items() if layer != 6)
