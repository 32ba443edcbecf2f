"""One layer's moments as read-only float64 numpy arrays: what every metric reads.

:meth:`EmbeddingStatistics.layer <embgeom_ray.core.statistics.EmbeddingStatistics.layer>`
makes a :class:`LayerMoments` from the torch tensors it folds; the metrics
(:mod:`~embgeom_ray.core.metrics`, :mod:`~embgeom_ray.core.partials`,
:mod:`~embgeom_ray.core.rogue`, :mod:`~embgeom_ray.core.tables`) read nothing else. Kept apart
from the statistics so that a process that only reads moments, tables or samples (the
sampled stage's and the report's Ray task workers, a reducer's summaries) does not import
torch for them: ~1 s of CPU and ~180 MB resident a process.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LayerMoments:
    """Read-only float64 numpy view of one layer's moments, types sorted by token id.

    Its attributes are the :data:`~embgeom_ray.core.statistics_fields.FIELDS` of one layer
    (types with a count in this layer only).
    """

    layer: int
    type_ids: np.ndarray  # (T,) int64, sorted
    counts: np.ndarray  # (T,) int64
    means: np.ndarray  # (T, d)
    m2: np.ndarray  # (T,)  Σ ||x − μ_t||²
    unit_sums: np.ndarray  # (T, d)  Σ x/||x||
    n: int
    mean: np.ndarray  # (d,)
    comoment: np.ndarray  # (d, d)  Σ (x − μ)(x − μ)ᵀ
    argmax_counts: np.ndarray  # (d,) int64
    argmin_counts: np.ndarray  # (d,) int64
    position_counts: np.ndarray  # (P,) int64
    position_means: np.ndarray  # (P, d)
    nonfinite: int
    clip_dims: tuple[int, ...] | None = None
    clip_unit_sums: np.ndarray | None = None  # (T, d) Σ x'/||x'||, x' = x with clip_dims zeroed

    @property
    def dim(self) -> int:
        return int(self.mean.shape[0])

    @property
    def covariance(self) -> np.ndarray:
        """Population covariance C / n."""
        return self.comoment / max(self.n, 1)
