"""The arrays of :class:`~embgeom_ray.core.statistics.EmbeddingStatistics`, declared once.

Each array is a :class:`Field`: its name (in files and in the
:class:`~embgeom_ray.core.layer_moments.LayerMoments` view), shape, dtype and merge rule. Per
layer l and token type t (Ethayarajh 2019; Luo 2020; Luo, Kulmizev & Mao 2021):

per type (``core/type_moments.py``)
    n_t, μ_t, M2_t = Σ_i ||x_i − μ_t||², U_t = Σ_i x_i/||x_i|| and, with ``clip_dims``, the
    same sum of the clipped vectors x' (those dimensions set to 0);
per layer (``core/layer_state.py``)
    n, μ, C = Σ_i (x_i − μ)(x_i − μ)ᵀ, the argmax/argmin counts per dimension ("tails"), the
    count and mean vector per position, and the tokens left out as non-finite.

Update, merge, save, load, the views and the partitions all work from :data:`FIELDS`; the
merge rules are those of Chan, Golub & LeVeque (1979) for the moments (``TYPE_MOMENTS``,
``LAYER_MOMENTS``), count-weighted means for the positions and sums for the rest.
:func:`state_bytes` is what the arrays take. Nothing here needs torch (dtypes are numpy's; the
tensors take torch's of the same name): the memory formulas
(:mod:`~embgeom_ray.sizing.formulas`) read this in processes that hold no statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

_F64 = np.dtype(np.float64)
_I64 = np.dtype(np.int64)

# merge rules of the fields (see Field.merge)
SUM = "sum"
TYPE_MOMENTS = "type_moments"
LAYER_MOMENTS = "layer_moments"
POSITION_MEANS = "position_means"


@dataclass(frozen=True)
class Field:
    """One array of :class:`~embgeom_ray.core.statistics.EmbeddingStatistics`: the single
    declaration of its name, shape, dtype and merge rule.

    ``name`` is the array's name in files and the
    :class:`~embgeom_ray.core.layer_moments.LayerMoments` attribute. Its shape
    is (L, T, *tail) for a per-type field (one row per token type seen, ``per_type``) and
    (L, *tail) for a per-layer one, where L is the number of layers held, T of types and
    ``tail`` is spelled with ``"d"`` (hidden size) and ``"P"`` (``max_positions``). ``merge``:

    - ``SUM``: added (per type, row by row);
    - ``TYPE_MOMENTS``: (counts, means, m2) per type, Chan, Golub & LeVeque's update;
    - ``LAYER_MOMENTS``: (n, mean, comoment) per layer, the same update with δδᵀ;
    - ``POSITION_MEANS``: (position_counts, position_means): count-weighted means.

    ``clip``: present only when clipped cosines are tracked (``clip_dims``).
    """

    name: str
    per_type: bool
    tail: tuple[str, ...]
    dtype: np.dtype  # numpy's; a tensor's is torch's of the same name (torch_dtype)
    merge: str
    clip: bool = False

    def shape(self, n_layers: int, n_types: int, dim: int, max_positions: int) -> tuple[int, ...]:
        size = {"d": dim, "P": max_positions}
        lead = (n_layers, n_types) if self.per_type else (n_layers,)
        return (*lead, *(size[s] for s in self.tail))

    @property
    def numpy_dtype(self) -> np.dtype:
        return self.dtype

    @property
    def torch_dtype(self) -> Any:
        """torch's dtype of the same name (``torch.float64``, ``torch.int64``), for the
        tensors that hold the field (torch is already imported where there are any)."""
        import torch

        return getattr(torch, self.dtype.name)


#: every array of the statistics (see :class:`Field`), per type first: the order of the
#: arrays in memory, in :meth:`~embgeom_ray.core.statistics.EmbeddingStatistics.state_dict`
#: and in files.
FIELDS: tuple[Field, ...] = (
    Field("counts", True, (), _I64, TYPE_MOMENTS),  # n_t
    Field("means", True, ("d",), _F64, TYPE_MOMENTS),  # μ_t
    Field("m2", True, (), _F64, TYPE_MOMENTS),  # M2_t = Σ ||x − μ_t||²
    Field("unit_sums", True, ("d",), _F64, SUM),  # U_t = Σ x/||x||
    Field("clip_unit_sums", True, ("d",), _F64, SUM, clip=True),  # Σ x'/||x'||, clipped x'
    Field("n", False, (), _I64, LAYER_MOMENTS),
    Field("mean", False, ("d",), _F64, LAYER_MOMENTS),  # μ
    Field("comoment", False, ("d", "d"), _F64, LAYER_MOMENTS),  # C = Σ (x − μ)(x − μ)ᵀ
    Field("argmax_counts", False, ("d",), _I64, SUM),
    Field("argmin_counts", False, ("d",), _I64, SUM),
    Field("position_counts", False, ("P",), _I64, POSITION_MEANS),
    Field("position_means", False, ("P", "d"), _F64, POSITION_MEANS),
    Field("nonfinite", False, (), _I64, SUM),
)
TYPE_FIELDS = tuple(f for f in FIELDS if f.per_type)
LAYER_FIELDS = tuple(f for f in FIELDS if not f.per_type)


def state_bytes(layers: int, dim: int, types: int, positions: int, clip: int = 0) -> int:
    """Bytes of the statistics of ``layers`` layers, hidden size ``dim``, ``types`` token
    types seen, ``positions`` positions, ``clip`` clipped dimensions (float64/int64 arrays):
    8 · (L · (V · (2d + 2) + d² + 3d + P · (d + 1) + 2) + V), plus L · V · d · 8 with clipping.
    With ``types = 0``: the fixed per-layer state every statistics object holds."""
    d, v = dim, types
    per_layer = v * (2 * d + 2) + d * d + 3 * d + positions * (d + 1) + 2
    return 8 * (layers * per_layer + v) + (8 * layers * v * d if clip else 0)


#: the bytes of a block in which the arrays are streamed to a file or the object store
#: (:class:`~embgeom_ray.core.statistics_io.StreamedStatistics`): held beside them while they
#: are written, so the memory formulas count it with :func:`state_bytes`
STREAM_BLOCK_BYTES = 64 * 2**20
