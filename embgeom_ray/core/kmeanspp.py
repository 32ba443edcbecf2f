"""scikit-learn's greedy k-means++ seeding, with its float64 copy of the points made once a fit.

:func:`~embgeom_ray.core.kmeans.fit_local` runs ``sklearn.cluster.KMeans`` on float32 points.
Its k-means++ seeding (Arthur & Vassilvitskii 2007, greedy: 2 + ⌊ln k⌋ candidates a step, the
one that lowers the potential most kept; ``sklearn.cluster._kmeans._kmeans_plusplus``) takes,
at every step, the squared distances of the candidates to all n points, and for float32 points
scikit-learn computes them in float64 (``sklearn.metrics.pairwise._euclidean_distances_upcast``):
it copies the n points to float64 in chunks and recomputes their squared norms *at every step*.
For the job's model selection (n = 4,096, d = 384, k = 2..15, 3 initialisations: ~440 steps a
layer) those copies were most of the seeding's time in a profile of ``select_k``.
``python -m bench.sampled_stage --baseline none`` times both seedings (``docs/benchmarks.md``,
2-core CPU VMs: ``select_k`` 8% faster with this one).

:class:`PlusPlus` is the same algorithm as a ``KMeans(init=...)`` callable: the same draws from
the same random state in the same order, the same float32 arithmetic on the potentials, and the
distances computed as scikit-learn computes them (chunks of the same size, ``-2 · a @ bᵀ + ‖a‖²
+ ‖b‖²`` in float64, rounded to float32, clipped at 0), but from one float64 copy of the points
and their squared norms, made once per fit and shared by the ``n_init`` seedings. The centres,
and hence the clusters, are bit for bit those of ``init="k-means++"`` (tested against the
installed scikit-learn on MiniLM activations and offset data). For points in float64 there is
no copy to save: :func:`~embgeom_ray.core.kmeans.fit_local` uses ``init="k-means++"`` there.

BSD-3-Clause: the seeding loop follows scikit-learn's ``_kmeans_plusplus`` (© the scikit-learn
developers).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def upcast_batch_size(n_x: int, n_y: int, d: int) -> int:
    """The rows per chunk scikit-learn's ``_euclidean_distances_upcast`` uses for dense
    (n_x × d) and (n_y × d) float32 inputs: memory ~10% of the inputs and output, ≥ 10 MiB."""
    maxmem = max(((n_x + n_y) * d + n_x * n_y) / 10, 10 * 2**17)
    tmp = 2 * d
    return max(int((-tmp + math.sqrt(tmp**2 + 4 * maxmem)) / 2), 1)


def squared_norms(X: np.ndarray) -> np.ndarray:
    """‖x_i‖² of every row, as scikit-learn's ``row_norms(X, squared=True)`` computes it."""
    return np.einsum("ij,ij->i", X, X)


class PlusPlus:
    """``KMeans(init=PlusPlus())``: scikit-learn's k-means++ for float32 points, the float64
    copy of the points made once per fit (module docstring). Not thread-safe; one per fit."""

    def __init__(self) -> None:
        self._points: np.ndarray | None = None
        self._x64 = np.empty((0, 0))
        self._norms = np.empty(0)

    def _prepare(self, X: np.ndarray) -> None:
        if self._points is not X:  # KMeans hands the same (centred) array to every seeding
            self._points = X
            self._x64 = X.astype(np.float64)
            self._norms = squared_norms(self._x64)

    def distances(self, ids: np.ndarray) -> np.ndarray:
        """Squared distances (float32) of points ``ids`` to all points, as scikit-learn's
        ``_euclidean_distances(X[ids], X, squared=True)`` gives them for float32 X."""
        x64, norms = self._x64, self._norms
        n, d = x64.shape
        out = np.empty((len(ids), n), dtype=np.float32)
        batch = upcast_batch_size(len(ids), n, d)
        for a in range(0, len(ids), batch):
            rows = x64[ids[a : a + batch]]
            rows_sq = squared_norms(rows)[:, None]
            for b in range(0, n, batch):
                dist = -2 * (rows @ x64[b : b + batch].T)
                dist += rows_sq
                dist += norms[None, b : b + batch]
                out[a : a + batch, b : b + batch] = dist.astype(np.float32, copy=False)
        np.maximum(out, 0, out=out)
        return out

    def __call__(self, X: np.ndarray, n_clusters: int, random_state: Any) -> np.ndarray:
        if X.dtype != np.float32:
            raise TypeError(f"PlusPlus seeds float32 points, got {X.dtype} (use init='k-means++')")
        self._prepare(X)
        n_samples, n_features = X.shape
        sample_weight = np.ones(n_samples, dtype=X.dtype)  # KMeans.fit without weights
        centers = np.empty((n_clusters, n_features), dtype=X.dtype)
        n_local_trials = 2 + int(np.log(n_clusters))
        center_id = random_state.choice(n_samples, p=sample_weight / sample_weight.sum())
        centers[0] = X[center_id]
        closest_dist_sq = self.distances(np.array([center_id]))
        current_pot = closest_dist_sq @ sample_weight
        for c in range(1, n_clusters):
            rand_vals = random_state.uniform(size=n_local_trials) * current_pot
            candidate_ids = np.searchsorted(np.cumsum(sample_weight * closest_dist_sq), rand_vals)
            np.clip(candidate_ids, None, closest_dist_sq.size - 1, out=candidate_ids)
            distance_to_candidates = self.distances(candidate_ids)
            np.minimum(closest_dist_sq, distance_to_candidates, out=distance_to_candidates)
            candidates_pot = distance_to_candidates @ sample_weight.reshape(-1, 1)
            best_candidate = np.argmin(candidates_pot)
            current_pot = candidates_pot[best_candidate]
            closest_dist_sq = distance_to_candidates[best_candidate]
            centers[c] = X[candidate_ids[best_candidate]]
        return centers
