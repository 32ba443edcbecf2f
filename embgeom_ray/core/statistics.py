"""Mergeable sufficient statistics of contextual embeddings: the core of embgeom_ray.

One :class:`EmbeddingStatistics` holds, for each selected layer ``l`` (HF ``hidden_states[l]``):

per token type ``t`` (a token id; :mod:`~embgeom_ray.core.type_moments`)
    ``count`` n_t, ``mean`` μ_t, ``m2`` M2_t = Σ_i ||x_i − μ_t||², and ``unit_sum``
    U_t = Σ_i x_i/||x_i|| (for exact cosine metrics, Ethayarajh 2019);
per layer (:mod:`~embgeom_ray.core.layer_state`)
    ``n``, ``mean`` μ, the d×d co-moment matrix C = Σ_i (x_i − μ)(x_i − μ)ᵀ (covariance C/n,
    IsoScore, PCA spectrum, per-dimension mean/std), how often each dimension is the argmax /
    argmin of a token's vector (Luo 2020, "tails"), and per position p within the window the
    count and mean vector (Luo, Kulmizev & Mao 2021, positional artefacts);
    ``nonfinite``: tokens whose vector had a NaN/inf and were left out of every sum.

The arrays are declared once, in :data:`~embgeom_ray.core.statistics_fields.FIELDS` (name,
shape, dtype, merge rule); update, merge, save, load, the views and partitions all work from
that table. This class composes the two parts, folds batches into them (:meth:`update`, this
module) and reads and writes them (:mod:`~embgeom_ray.core.statistics_io`).

Only token types actually seen occupy memory (a slot table grows by doubling). Everything is
float64: each batch is cast to float64 on its device and shifted by the layer's running mean
c; per type it is reduced centred on the type's own batch mean (two passes), per layer the
co-moment is (X − c)ᵀ(X − c) − n m'm'ᵀ, which cancels only O(||μ_b − μ||²/V) digits instead
of ||μ||²/V. That one product is where the precisions differ (``comoment_precision``):
float64 (:mod:`~embgeom_ray.core.gram`); "bounded", the job's default, within
|ΔC_ab| ≤ 2^−29 √(C_aa C_bb) on int8 matrix units where :func:`integer_product` (CUDA cards
without float64 matrix units; rows shifted by the batch's own mean:
:mod:`~embgeom_ray.core.integer_gram`, ``docs/precision.md``), else float64; float32
(earlier versions' default, no bound). Batch moments are merged into the running ones with
the pairwise update of Chan, Golub & LeVeque (1979)::

    n = n_a + n_b,  δ = μ_b − μ_a,  μ = μ_a + δ n_b/n,
    M2 = M2_a + M2_b + ||δ||² n_a n_b / n,   C = C_a + C_b + δδᵀ n_a n_b / n.

:meth:`EmbeddingStatistics.merge` uses the same update, so folding a corpus batch by batch,
shard by shard or run by run gives the same moments up to float64 rounding, whatever the
order; the result keeps the precision of a two-pass float64 computation even when
||μ||² / V ~ 1e8 (GPT-2's massive activations), where the textbook E||x||² − ||μ||² in float32
is wrong by orders of magnitude.

Partitions (:mod:`~embgeom_ray.core.partitions`). Per-type rows are independent of each other,
so the statistics split exactly by token id: :meth:`EmbeddingStatistics.select` keeps some
layers, the types whose ids lie in [lo, hi) and, optionally, the per-layer moments; the
header's ``partition`` record says which part of which measurement a file holds
(:class:`StatisticsPart`). Parts of one measurement merge with parts that hold the same
:class:`StatisticsPart` (Chan's update per row, as above), and :meth:`EmbeddingStatistics.combine`
puts parts of disjoint token ranges (and layers) back together, exactly: selecting and
combining is a copy.

The type is a sketch in the Apache DataSketches sense (:class:`~embgeom_ray.core.sketch.Sketch`):
``update`` / ``merge`` / ``save``-``load`` (safetensors, no pickle) / read-only numpy views
(:meth:`EmbeddingStatistics.layer`). Metrics are pure functions of those views, in
:mod:`embgeom_ray.core.metrics`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import StatisticsMismatchError
from ..integrity import FileRef, as_ref, open_verified
from . import segment_sums, statistics_io
from .fold_kernels import deviations_and_centred, deviations_and_centred32, float64_rows, fused_on
from .gram import add_gram, add_gram_stacked, integer_blocks
from .group_sums import GroupMatrix, split_sums
from .integer_gram import IntegerGram, deviations_and_residues
from .layer_moments import LayerMoments
from .layer_state import LayerState
from .partitions import StatisticsPart, joint_part, range_key, requested_part
from .sketch import SafetensorsFile, Sketch
from .statistics_fields import FIELDS, LAYER_FIELDS, Field, state_bytes
from .statistics_io import FORMAT, FORMAT_VERSION, READS
from .type_moments import TypeMoments

__all__ = [
    "CPU_ROW_BLOCK",
    "FIELDS",
    "FORMAT",
    "FORMAT_VERSION",
    "GPU_FOLD",
    "INTEGER_PRODUCT",
    "PRECISIONS",
    "SPLIT_SUMS",
    "STACK_LAYERS",
    "EmbeddingStatistics",
    "Field",
    "LayerMoments",
    "StatisticsPart",
    "gpu_fold",
    "integer_product",
    "range_key",
    "split_sums_on",
    "state_bytes",
]

_F64 = torch.float64
#: rows per block of the fold on a CPU: a block's float64 copy (8·d bytes a row) and scratch
#: stay in the cache while every per-row pass runs over it (~1.7x faster than whole batches
#: at d = 384); on a GPU the fold takes the whole batch at once.
CPU_ROW_BLOCK = 1024
#: fold the GPU's way: the whole batch as one block of rows, tails by ``argmax``, the sums by
#: type and position as sparse products (CUDA), no host synchronisation per layer. None: on
#: every device but the CPU; True or False forces the choice (the tests fold on CPUs both ways).
GPU_FOLD: bool | None = None
#: fold consecutive layers of a batch together, their rows stacked (n × G × d), where the fold
#: goes the GPU's way with sparse sums and a float64 or float32 product (not on int8 units)
#: and the layers are finite (:meth:`EmbeddingStatistics._fold_stacked`): each of the fold's
#: launches then serves G layers, where a small-d batch is bound by launches, not arithmetic.
#: None: wherever it applies; False: one layer at a time everywhere (the arithmetic of
#: earlier versions, bit for bit)
STACK_LAYERS: bool | None = None
#: the float64 bytes a stack may hold: per layer about three (n × d) arrays (its rows, unit
#: vectors and gathered means) and the (d × d) product, 8 · (3 n d + d²) bytes; G is the most
#: layers within it, at least 1 (the caching allocator reuses them from batch to batch). Larger
#: batches fold one layer at a time, whose launches their arithmetic already amortises
STACK_BYTES = 256 << 20


def gpu_fold(device: torch.device) -> bool:
    """Whether statistics on ``device`` fold the GPU's way (:data:`GPU_FOLD`)."""
    return device.type != "cpu" if GPU_FOLD is None else GPU_FOLD


#: the co-moment product of ``comoment_precision="bounded"`` on int8 matrix units
#: (:mod:`~embgeom_ray.core.integer_gram`). None: on CUDA devices without float64 matrix units
#: (:data:`FLOAT64_MATRIX_UNITS`), where twelve int8 products beat the float64 one; elsewhere
#: the float64 product is the faster within the bound (a CPU's, and a Hopper GPU's float64
#: tensor cores: docs/precision.md, "Cost, and where it runs"). True or False forces the
#: choice (the tests run it on CPUs, on the CPU's own int8 units).
INTEGER_PRODUCT: bool | None = None
#: CUDA compute capabilities (major, minor) on which the bounded product is the float64 one:
#: 9.0, Hopper (H100, H200), whose float64 tensor cores ran the product 1.6–3× faster than
#: twelve int8 products through ``torch._int_mm`` (an Ampere-generation int8 kernel there):
#: H200, 65,536 rows, 5.6 against 17.2 ms at d = 2,048, 21.1 against 33.3 ms at d = 4,096
FLOAT64_MATRIX_UNITS = frozenset({(9, 0)})
#: comoment_precision values: the product within the stated bound (``docs/precision.md``), the
#: float64 reference, and the float32 product of earlier versions (no bound: its float32 sums
#: over up to 1,024 rows may err by ~1e-5 relative)
PRECISIONS = ("bounded", "float64", "float32")
#: other names accepted for a precision
PRECISION_ALIASES = {"reference": "float64"}


def integer_product(device: torch.device, dim: int) -> bool:
    """Whether the bounded co-moment product runs on int8 matrix units on ``device``
    (:data:`INTEGER_PRODUCT`: by default on CUDA devices whose compute capability is not in
    :data:`FLOAT64_MATRIX_UNITS`; never for d < 17, too narrow for them)."""
    if dim < 17 or _integer_unavailable:
        return False
    if INTEGER_PRODUCT is not None:
        return INTEGER_PRODUCT
    return device.type == "cuda" and _capability(device) not in FLOAT64_MATRIX_UNITS


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of CUDA ``device`` (read once a device)."""
    return tuple(torch.cuda.get_device_capability(device))


_integer_unavailable = False

#: pass 1's per-type and per-position sums in float32 arithmetic within the bound, by the
#: error-free split of :func:`~embgeom_ray.core.group_sums.split_sums` (``docs/precision.md``),
#: instead of float64. None (the default) or False: nowhere (it took 5–15× the float64 sums on
#: a CPU, and on a GPU it reads more bytes than the float64 product of the rows' float64 copy,
#: which the fold makes anyway); True: wherever :func:`split_sums_on` (``bench.fold
#: --split-sums`` measures it; the tests fold with it).
SPLIT_SUMS: bool | None = None


def split_sums_on(precision: str, dtype: torch.dtype) -> bool:
    """Whether pass 1 sums rows of ``dtype`` by the float32 split (:data:`SPLIT_SUMS`): never
    for ``comoment_precision="float64"`` (the reference path keeps float64 everywhere) nor for
    float64 rows."""
    return bool(SPLIT_SUMS) and precision != "float64" and dtype != torch.float64


def _sparse_sums_on(device: torch.device) -> bool:
    """Whether the GPU's fold sums rows by group with :class:`GroupMatrix` (CUDA, and CPUs
    when :data:`GPU_FOLD` forces the GPU's way there: other devices lack sparse CSR)."""
    return gpu_fold(device) and device.type in ("cuda", "cpu")


class _Groups(NamedTuple):
    """One batch's kept rows grouped by token type (the same in every layer).

    The rows are in slot order (``row_slots`` non-decreasing), so every per-type scatter
    (``index_add_``) and gather writes and reads each destination row in one run: about half
    the time of the same scatter over rows in corpus order, on CPUs.
    """

    slots: torch.Tensor  # (u,) slot of each distinct type in the batch, increasing
    inv: torch.Tensor  # (n,) row -> index into ``slots`` (non-decreasing)
    row_slots: torch.Tensor  # (n,) row -> its type's slot (``slots[inv]``, non-decreasing)
    counts: torch.Tensor  # (u,) rows per type
    counts_f: torch.Tensor  # (u,) the same in float64 (cast once a batch, not once a layer)
    pos: torch.Tensor | None  # (n,) position of each row in its window
    pos_counts: torch.Tensor | None  # (P,) rows per position
    pos_counts_f: torch.Tensor | None  # (P,) the same in float64
    by_type: GroupMatrix | None = None  # on GPUs: the sums by type as sparse products
    by_pos: GroupMatrix | None = None  # ... and by position
    largest: int = 0  # with SPLIT_SUMS: the most rows of one type or position (else 0)


def _add_integer_gram(
    upper: torch.Tensor, gram: IntegerGram, kept: torch.Tensor, shift: torch.Tensor
) -> None:
    """``gram.add_upper(upper)``; where the int8 product cannot run (no int8 kernel in this
    torch build or for this device), one warning, the float64 product of the same shifted
    rows instead, and float64 from then on."""
    global _integer_unavailable
    try:
        gram.add_upper(upper)  # ``upper`` holds zeros: the residues went to ``gram``
    except (RuntimeError, NotImplementedError) as e:
        upper.zero_()  # whatever a group added before the failure
        _integer_unavailable = True
        warnings.warn(
            f"the int8 co-moment product failed ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''}); computing it in float64 "
            "(the same bound, slower)",
            RuntimeWarning,
            stacklevel=3,
        )
        add_gram(upper, kept.to(_F64) - shift)


class EmbeddingStatistics(Sketch):
    """Mergeable per-layer, per-token-type moments of hidden states (see module docstring).

    Args:
        layers: the HF hidden-state indices kept, in the order the hidden states are passed
            to :meth:`update` (0 = embedding output).
        dim: hidden size d.
        max_positions: positions 0..max_positions−1 within a window are profiled (at least
            the job's ``max_length``); 0 turns the positional profile off.
        device: where the accumulators live; batches are folded on their own device, which
            should be this one.
        metadata: strings identifying what was measured (model, revision, tokenizer, …);
            :meth:`merge` refuses statistics whose identifying metadata differ.
        initial_types: initial slot capacity (grows by doubling as new types appear).
        max_types: the most distinct types there can be (an extractor's: its tokenizer's
            size), or None for no limit. The doubling stops there, so the per-type arrays
            never hold more slots than there can be types (GPT-2's 50,257 tokens would
            otherwise double to 65,536 slots, Qwen's 151,936 to 262,144: on a GPU every
            slot is allocated).
        clip_dims: dimensions to zero ("clip", Luo 2020; Luo et al. 2021) for exact
            clipped cosine metrics: per type, the sum of unit vectors of the clipped vectors
            x' (x with these dimensions set to 0) is accumulated too. None: not tracked.
        comoment_precision: how the per-batch product (X − c)ᵀ(X − c), the fold's one
            matrix product, is computed (:data:`PRECISIONS`; ``--comoment-precision``):
            "float64" (this class's default, also called "reference"): in float64;
            "bounded" (the job's default): within the stated bound |ΔC_ab| ≤ ε √(C_aa C_bb),
            ε ≤ 2^−29 (``docs/precision.md``), on int8 matrix units where
            :func:`integer_product` (CUDA cards without float64 matrix units; rows shifted
            by the batch's mean, :mod:`~embgeom_ray.core.integer_gram`), else in float64;
            "float32": in float32 on rows shifted by the layer's running mean rounded to
            float32, accumulated in float64 (earlier versions' default: ~1e-6 relative error
            on covariance entries in practice, with no bound). Every other statistic is float64 whatever the choice.
            It is saved in the header; statistics that both hold co-moments merge only with
            the same precision, and statistics without any (e.g. an empty accumulator) take
            the other's.
        partition: which part of a measurement these statistics hold (:class:`StatisticsPart`;
            made by :meth:`select`), None for all of it.

    Attributes:
        type_moments: the per-type moments (:class:`~embgeom_ray.core.type_moments.TypeMoments`).
        layer_state: the per-layer state (:class:`~embgeom_ray.core.layer_state.LayerState`),
            None in a part without it (:attr:`holds_layer_state`).
    """

    FORMAT = FORMAT
    FORMAT_VERSION = FORMAT_VERSION
    READS = READS
    KIND = "statistics"
    HEADER_FIELDS = ("max_positions", "clip_dims", "comoment_precision", "partition")
    MERGE_FIELDS = ("max_positions", "clip_dims", "partition")

    def __init__(
        self,
        layers: Sequence[int],
        dim: int,
        *,
        max_positions: int = 0,
        device: str | torch.device = "cpu",
        metadata: Mapping[str, str] | None = None,
        initial_types: int = 1024,
        clip_dims: Sequence[int] | None = None,
        comoment_precision: str = "float64",
        partition: StatisticsPart | None = None,
        max_types: int | None = None,
    ) -> None:
        self._init_sketch(layers, dim, device, metadata)
        if max_positions < 0:
            raise ValueError(f"max_positions must be >= 0, got {max_positions}")
        self.max_positions = int(max_positions)
        self.clip_dims: list[int] | None = (
            None if clip_dims is None else sorted({int(c) for c in clip_dims})
        )
        comoment_precision = PRECISION_ALIASES.get(comoment_precision, comoment_precision)
        if comoment_precision not in PRECISIONS:
            raise ValueError(
                f"comoment_precision must be one of {', '.join(PRECISIONS)} (or reference), "
                f"got {comoment_precision!r}"
            )
        self.comoment_precision = comoment_precision
        if self.clip_dims and not all(0 <= c < dim for c in self.clip_dims):
            raise ValueError(f"clip_dims {self.clip_dims} outside 0..{dim - 1}")
        if partition is not None:
            where = [partition.of_layers.index(x) for x in self.layers if x in partition.of_layers]
            if len(where) != len(self.layers) or where != sorted(where):
                raise ValueError(
                    f"layers {self.layers} are not a part of the partition's layers "
                    f"{list(partition.of_layers)} in their order"
                )
        self.partition = partition
        n_layers = len(self.layers)
        self.type_moments = TypeMoments(
            n_layers, self.dim, self.device, clip=self.clip_dims is not None,
            capacity=initial_types, max_types=max_types,
        )  # fmt: skip
        self.layer_state = (
            LayerState(n_layers, self.dim, self.max_positions, self.device)
            if self.holds_layer_state
            else None
        )
        self._buffers: dict[str, torch.Tensor] = {}  # per-batch scratch (see _workspace)

    def held_fields(self, among: Sequence[Field] = FIELDS) -> list[Field]:
        """The fields (of ``among``) these statistics hold: clipped sums only with
        ``clip_dims``, per-layer fields only with the per-layer state."""
        return [
            f
            for f in among
            if (self.clip_dims is not None or not f.clip) and (f.per_type or self.holds_layer_state)
        ]

    @property
    def arrays(self) -> dict[str, torch.Tensor]:
        """The arrays of the :meth:`held_fields` by name, live: the per-type ones
        (L, capacity, …; slots in the order the types were first seen,
        ``type_moments.slot_ids``), then the per-layer ones (L, …)."""
        layer = {} if self.layer_state is None else self.layer_state.arrays
        return {**self.type_moments.arrays, **layer}

    _a = arrays  # the name the memory tests read

    # ------------------------------------------------------------- parts
    @property
    def holds_layer_state(self) -> bool:
        """Whether the per-layer fields (n, mean, co-moment, tails, positions) are held."""
        return self.partition is None or self.partition.layer_state

    @property
    def token_range(self) -> tuple[int, int | None]:
        """[lo, hi) of the token ids whose per-type rows are held; (0, None): all."""
        return (0, None) if self.partition is None else self.partition.token_range

    @property
    def of_layers(self) -> tuple[int, ...]:
        """The layers of the whole measurement these statistics are (part of)."""
        return tuple(self.layers) if self.partition is None else self.partition.of_layers

    def _holds_comoment(self) -> bool:
        return self.layer_state is not None and bool(self.layer_state.arrays["n"].any())

    # ---------------------------------------------------------- memory
    @property
    def num_types(self) -> int:
        """Number of distinct token types seen (in any layer)."""
        return self.type_moments.num_types

    def _capacity(self) -> int:
        return self.type_moments.capacity

    def _row_bytes(self) -> int:
        """Bytes of one slot's rows across the per-type arrays."""
        return self.type_moments.row_bytes()

    @property
    def _max_doubling(self) -> int:
        """The capacity the per-type arrays' doubling stops at (:meth:`fit_budget`)."""
        return self.type_moments.max_doubling

    def nbytes(self) -> int:
        """Bytes these statistics hold now: every array as allocated (the per-type arrays
        grow by doubling, so up to twice :func:`state_bytes` of the types seen) and the
        per-batch scratch buffers."""
        layer = 0 if self.layer_state is None else self.layer_state.nbytes()
        scratch = sum(t.numel() * t.element_size() for t in self._buffers.values())
        return self.type_moments.nbytes() + layer + int(scratch)

    def held_bytes(self) -> int:
        """Bytes holding what these statistics have seen: :meth:`nbytes` less the per-type
        slots not assigned (allocated, never written: on a CPU such pages are not even
        resident). What an extractor's ``--worker-memory`` budget is checked against."""
        return self.nbytes() - (self._capacity() - self.num_types) * self._row_bytes()

    def held_bytes_after_merge(self, other: EmbeddingStatistics) -> int:
        """:meth:`held_bytes` once ``other`` is merged in: these, plus one slot's rows for each
        of ``other``'s types not held here (the per-layer state does not grow)."""
        new = self.type_moments.count_new(other.type_moments.slot_ids)
        return self.held_bytes() + new * self._row_bytes()

    def fit_budget(self, budget: int) -> None:
        """Give the per-type arrays now the slots that fit ``budget`` bytes (with the state
        held now), and let them grow past that only by what a batch needs, never doubling.
        Under an extractor's budget the arrays are then allocated once, with no doubling's
        copy, and never reach twice the budget (on a GPU allocated memory is real memory; on
        a CPU a slot's pages are touched only when a type is assigned to it)."""
        fixed = self.held_bytes() - self.num_types * self._row_bytes()
        self.type_moments.fit(max(1, (int(budget) - fixed) // (self._row_bytes() + 8)))

    @torch.inference_mode()  # the arrays may be inference tensors (a fold under inference_mode)
    def clear(self) -> None:
        """Forget everything seen, keeping the allocated arrays: the statistics are empty
        again (as a new object with these options and metadata), and the next types take the
        same slots, zeroed as they are assigned. An extractor that spills or flushes goes on
        in memory already written, with no doublings (each a copy of every per-type array)
        and no fresh pages: a fold into fresh statistics cost 1.2-1.9x one into statistics
        that had seen its types (``bench.vocabulary``; docs/benchmarks.md)."""
        self.type_moments.clear()
        if self.layer_state is not None:
            self.layer_state.clear()

    # --------------------------------------------------------------- update
    @torch.no_grad()
    def update(
        self,
        hidden: Sequence[torch.Tensor] | torch.Tensor,
        token_ids: torch.Tensor,
        keep: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        finite: Sequence[bool] | None = None,
    ) -> None:
        """Fold one batch.

        Args:
            hidden: per selected layer (in ``self.layers`` order) a (B, T, d) tensor, or one
                (L, B, T, d) tensor; any float dtype (bf16/fp16 are cast to float64 before
                anything is squared).
            token_ids: (B, T) integer token ids.
            keep: (B, T) bool, the tokens to count (padding and, by default, special tokens
                already False). None keeps all.
            positions: (B, T) position of each token within its window (default: column
                index). Needed only when ``max_positions > 0``.
            finite: per layer, whether its hidden states are all finite
                (:func:`~embgeom_ray.core.sketch.finite_layers`), when the caller has them.
        """
        if self.token_range != (0, None) or not self.holds_layer_state:
            raise ValueError(
                "a partition of the token ids or without per-layer moments is built by "
                "select() and merge(), not update()"
            )
        hidden, keep = self._batch(hidden, token_ids, keep, positions)
        shape = tuple(token_ids.shape)
        dev = self.device
        rows = keep.to(dev).reshape(-1).nonzero().squeeze(1)  # kept (batch·T) row indices
        if rows.numel() == 0:
            return
        ids = token_ids.to(dev).reshape(-1).index_select(0, rows).long()
        pos = None
        if self.max_positions > 0:
            if positions is None:
                positions = torch.arange(shape[-1], device=dev).expand(shape)
            pos = positions.to(dev).reshape(-1).index_select(0, rows).long()
            low, high = torch.stack(torch.aminmax(pos)).tolist()  # one host synchronisation
            if high >= self.max_positions or low < 0:
                raise ValueError(
                    f"position {high if low >= 0 else low} outside "
                    f"0..{self.max_positions - 1}; raise max_positions to the job's max_length"
                )
        # the grouping of rows by type is the same in every layer: computed once per batch,
        # and the rows are taken in its order
        groups, order = self._group(ids, pos)
        rows = rows.index_select(0, order)
        finite = self._finite_flags(hidden, finite)  # every layer at once: one synchronisation
        positions_b: list[tuple[int, torch.Tensor]] = []  # merged after the layers, at once
        for lo, hi in self._stacks(finite, groups, rows.numel(), hidden[0].dtype):
            if hi - lo > 1:  # layers lo..hi − 1 at once, their rows stacked (n × G × d)
                flat = torch.stack([h.to(dev).reshape(-1, self.dim) for h in hidden[lo:hi]], 1)
                self._fold_stacked(lo, flat.index_select(0, rows), groups)
                continue
            # the model's dtype, into reused scratch (no fresh pages per layer and batch)
            flat = hidden[lo].to(dev).reshape(-1, self.dim)
            kept = torch.index_select(
                flat, 0, rows, out=self._workspace("kept", rows.numel(), flat.dtype)
            )
            self._fold_layer(lo, kept, groups, finite[lo], positions_b)
        self._merge_positions(positions_b, groups)

    def _stacks(
        self, finite: Sequence[bool], g: _Groups, n: int, dtype: torch.dtype
    ) -> list[tuple[int, int]]:
        """The layer slots a batch of ``n`` kept rows folds together, as ranges [lo, hi):
        consecutive finite layers, as many as :data:`STACK_BYTES` holds, where
        :data:`STACK_LAYERS` allows and the fold goes the GPU's way with sparse sums and a
        float64 or float32 product (:meth:`_fold_stacked`); else one layer a range."""
        L, dev = len(self.layers), self.device
        most = max(1, STACK_BYTES // (8 * (3 * n * self.dim + self.dim**2)))
        stacked = (
            STACK_LAYERS is not False
            and most > 1
            and g.by_type is not None
            and not split_sums_on(self.comoment_precision, dtype)
            and not (self.comoment_precision == "bounded" and integer_product(dev, self.dim))
        )
        if not stacked:
            return [(li, li + 1) for li in range(L)]
        out: list[tuple[int, int]] = []
        lo = 0
        while lo < L:
            hi = lo + 1
            if finite[lo]:
                while hi < L and hi - lo < most and finite[hi]:
                    hi += 1
            out.append((lo, hi))
            lo = hi
        return out

    def _fold_stacked(self, lo: int, kept: torch.Tensor, g: _Groups) -> None:
        """:meth:`_fold_layer` of the finite layer slots lo..lo + G − 1 at once, in one block
        (the GPU's way), their kept rows stacked: ``kept`` (n × G × d, the model's dtype). The
        same passes and merges, each of its launches serving the G layers: the tails
        (:meth:`~.layer_state.LayerState.add_tails_stacked`), the float64 rows, the sums by
        type and position as one sparse product of the (n × G·d) rows, the unit-vector sums
        (:meth:`~.type_moments.TypeMoments.add_unit_sums_stacked`), the shifts, the squared
        deviations and shifted rows (one fused kernel), the co-moment products as batched
        products (:func:`~.gram.add_gram_stacked`), and the per-type and per-layer merges
        (:meth:`~.type_moments.TypeMoments.merge_rows_stacked`,
        :meth:`~.layer_state.LayerState.merge_product_stacked`). Each layer's numbers are
        those of its own fold to float64 rounding (the order of a few additions differs:
        tested against the fold of one layer at a time)."""
        n, G, d = kept.shape
        state, types = self.layer_state, self.type_moments
        state.add_tails_stacked(lo, kept)
        # n·G rows of d (the kernel's graph of one layer's rows: no graph more to build)
        x, inv_norms = float64_rows(kept.view(n * G, d))
        x, inv_norms = x.view(n, G, d), inv_norms.view(n, G)
        wide = x.view(n, G * d)
        mean_b = g.by_type.sums(wide).view(-1, G, d)  # the per-type sums of every layer
        if g.by_pos is not None:
            ps = g.by_pos.sums(wide).view(-1, G, d).transpose(0, 1)
            state.merge_positions(slice(lo, lo + G), g.pos_counts, ps, g.pos_counts_f)
        types.add_unit_sums_stacked(lo, x, g.slots, g.by_type, inv_norms=inv_norms)
        if self.clip_dims is not None:
            types.add_unit_sums_stacked(lo, x, g.slots, g.by_type, clip_dims=self.clip_dims)
        x_mean = mean_b.sum(dim=0) / n  # G × d: each layer's batch mean
        mean_b /= g.counts_f.view(-1, 1, 1)
        a = state.arrays
        c = torch.where((a["n"][lo : lo + G] > 0).unsqueeze(1), a["mean"][lo : lo + G], x_mean)
        upper = torch.zeros(G, d, d, dtype=_F64, device=x.device)
        if self.comoment_precision == "float32":
            c = c.to(torch.float32).to(_F64)
            sq, xs = deviations_and_centred32(mean_b, g.inv, x, kept, c.to(torch.float32))
        else:
            sq, xs = deviations_and_centred(mean_b, g.inv, x, c)
        m2_b = torch.zeros(g.slots.numel(), G, dtype=_F64, device=x.device).index_add_(0, g.inv, sq)
        add_gram_stacked(upper, xs)
        types.merge_rows_stacked(lo, g.slots, g.counts, mean_b, m2_b, g.counts_f)
        state.merge_product_stacked(lo, n, c, x_mean - c, upper)

    def _merge_positions(self, sums: list[tuple[int, torch.Tensor]], g: _Groups) -> None:
        """Merge the per-position sums of the layers folded with the batch's own groups: all
        layers at once where every layer is among them (one set of launches a batch instead
        of one a layer; each element's arithmetic the same), else layer by layer."""
        if not sums:
            return
        state = self.layer_state
        if [li for li, _ in sums] == list(range(len(self.layers))):
            stacked = torch.stack([s for _, s in sums])
            state.merge_positions(slice(None), g.pos_counts, stacked, g.pos_counts_f)
            return
        for li, s in sums:
            state.merge_positions(li, g.pos_counts, s, g.pos_counts_f)

    def _group(self, ids: torch.Tensor, pos: torch.Tensor | None) -> tuple[_Groups, torch.Tensor]:
        """(groups of the rows taken in ``order``, ``order``): rows sorted by slot (stable)."""
        uniq, inv = torch.unique(ids, return_inverse=True)
        row_slots, order = torch.sort(self.type_moments.slots_for(uniq)[inv], stable=True)
        return self._groups_of(
            row_slots, None if pos is None else pos.index_select(0, order)
        ), order

    def _groups_of(self, row_slots: torch.Tensor, pos: torch.Tensor | None) -> _Groups:
        """The groups of rows whose slots ``row_slots`` are non-decreasing."""
        slots, inv, counts = torch.unique_consecutive(
            row_slots, return_inverse=True, return_counts=True
        )
        pos_counts = None if pos is None else torch.bincount(pos, minlength=self.max_positions)
        largest = 0
        if SPLIT_SUMS and counts.numel():  # one host synchronisation a batch
            top = counts.max()
            largest = int(top if pos_counts is None else torch.maximum(top, pos_counts.max()))
        counts_f = counts.to(_F64)  # cast once a batch, used in every layer
        pos_f = None if pos_counts is None else pos_counts.to(_F64)
        if not _sparse_sums_on(self.device):
            return _Groups(
                slots, inv, row_slots, counts, counts_f, pos, pos_counts, pos_f, largest=largest
            )
        by_pos = None if pos is None else GroupMatrix.of_labels(pos, pos_counts)
        by_type = GroupMatrix.of_sorted(counts, row_slots.numel(), labels=inv)
        return _Groups(
            slots, inv, row_slots, counts, counts_f, pos, pos_counts, pos_f, by_type, by_pos,
            largest,
        )  # fmt: skip

    def _workspace(self, name: str, n: int, dtype: torch.dtype = _F64) -> torch.Tensor:
        """An (n, d) scratch buffer, reused across batches (no per-batch allocation)."""
        key = f"{name}:{dtype}"
        buf = self._buffers.get(key)
        if buf is None or buf.shape[0] < n:
            buf = torch.empty(max(n, 1024), self.dim, dtype=dtype, device=self.device)
            self._buffers[key] = buf
        return buf[:n]

    def _finite_rows(self, li: int, kept: torch.Tensor, g: _Groups) -> tuple[torch.Tensor, _Groups]:
        """``kept`` and ``g`` without the rows that hold a NaN/inf (counted in ``nonfinite``):
        the exact route, taken for a layer whose batch did not sum to a finite float32 number
        (:func:`~embgeom_ray.core.sketch.finite_layers`)."""
        finite = torch.isfinite(kept).all(dim=1)
        if bool(finite.all()):
            return kept, g
        self.layer_state.arrays["nonfinite"][li] += int((~finite).sum())
        pos = None if g.pos is None else g.pos[finite]
        return kept[finite], self._groups_of(g.row_slots[finite], pos)

    def _row_blocks(self, n: int) -> list[tuple[int, int]]:
        """Row ranges the fold walks through: :data:`CPU_ROW_BLOCK` rows on a CPU, else all
        (:func:`gpu_fold`)."""
        step = max(n, 1) if gpu_fold(self.device) else CPU_ROW_BLOCK
        return [(a, min(a + step, n)) for a in range(0, n, step)]

    def _fold_layer(
        self,
        li: int,
        kept: torch.Tensor,
        g: _Groups,
        finite: bool = True,
        positions_b: list[tuple[int, torch.Tensor]] | None = None,
    ) -> None:
        """Fold the kept rows ``kept`` (n, d, the model's dtype) of layer slot ``li``; unless
        ``finite`` (the layer's batch is known to be finite), rows with a NaN/inf are left out.
        The per-position sums go to ``positions_b`` (merged for every layer at once:
        :meth:`_merge_positions`) where the layer kept the batch's rows, else are merged here.

        Two passes over blocks of rows (:meth:`_row_blocks`), each block converted to float64
        where it is used: (1) tails, per-type sums, unit-vector sums, position sums
        (:meth:`_first_pass`); (2) per type the deviations from the type's batch mean (M2),
        and the co-moment product (:meth:`_second_pass`). On a CPU a block's float64 copy and
        scratch stay in cache across the passes made over it; with one block (a GPU's whole
        batch) pass 2 reuses pass 1's float64 copy. Nothing here waits for the device (no
        value is read back to the host), so a GPU's host queues the layers' kernels ahead of
        them. Then the batch's moments are merged: per type by Chan's update, per layer as
        C_b = X'ᵀX' − n m'm'ᵀ around the shift c (m' = μ_b − c), by the same update with δδᵀ.
        """
        batch_groups = g
        if not finite:
            kept, g = self._finite_rows(li, kept, g)
        n = kept.shape[0]
        if n == 0:
            return
        blocks = self._row_blocks(n)
        fuse = fused_on(kept.device)  # the per-row passes as compiled kernels (fold_kernels)
        mean_b, position_sums, x = self._first_pass(li, kept, g, blocks, fuse)
        x_mean = mean_b.sum(dim=0) / n  # the batch's mean, from its per-type sums
        mean_b /= g.counts_f.unsqueeze(1)
        if position_sums is not None:
            if positions_b is not None and g is batch_groups:  # all layers' at once, later
                positions_b.append((li, position_sums))
            else:
                self.layer_state.merge_positions(li, g.pos_counts, position_sums, g.pos_counts_f)
        c, gram = self._shift(li, kept, x_mean)
        m2_b, upper = self._second_pass(kept, g, blocks, fuse, x, mean_b, c, gram)
        if gram is not None:
            _add_integer_gram(upper, gram, kept, c)
        self.type_moments.merge_rows(
            li, g.slots, g.counts, mean_b, m2_b, self._row_blocks(g.slots.numel()),
            self._workspace, n_b_f=g.counts_f, triton=x is None,  # pass 1 ran in Triton
        )  # fmt: skip
        self.layer_state.merge_product(li, n, c, x_mean - c, upper)  # x_mean − c: m' (small)

    def _first_pass(
        self,
        li: int,
        kept: torch.Tensor,
        g: _Groups,
        blocks: list[tuple[int, int]],
        fuse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Pass 1 of :meth:`_fold_layer` over ``blocks`` of ``kept``: the tails, per type the
        unit-vector sums (added to the statistics) and the rows' sums, per position the rows'
        sums. Returns (the per-type sums (u × d), the per-position sums (P × d) or None, the
        last block's float64 rows, or None where pass 1 ran in Triton:
        :meth:`_first_pass_triton`)."""
        dev, u = kept.device, g.slots.numel()
        if self._triton_sums(kept, g, blocks):
            try:
                return self._first_pass_triton(li, kept, g)
            except Exception as e:  # a kernel Triton could not build: the sparse products
                segment_sums.give_up(e)
        block = blocks[0][1]  # rows of the first (largest) block: the scratch buffers' size
        # tails: 0/1 column sums on a CPU (exact below 2^24 rows), argmax on a GPU
        hits = None if gpu_fold(dev) else self._workspace("hits", block, torch.float32)
        # sums by group: sparse products with the whole batch (GPUs), else index_add_; or in
        # float32 by the error-free split (SPLIT_SUMS)
        split = split_sums_on(self.comoment_precision, kept.dtype)
        sparse = g.by_type is not None and len(blocks) == 1
        if not sparse or split:
            sums = self._workspace("mean_b", u).zero_()  # reused: no fresh pages to fault in
            ps = (
                None
                if g.pos is None
                else torch.zeros(self.max_positions, self.dim, dtype=_F64, device=dev)
            )
        by_type = g.by_type if sparse else None
        types = self.type_moments
        for a, b in blocks:
            k = kept[a:b]
            self.layer_state.add_tails(li, k, None if hits is None else hits[: b - a])
            if fuse:  # one compiled kernel (CUDA): the float64 rows and their 1/||x||
                x, inv_norms = float64_rows(k)
            else:
                x, inv_norms = self._workspace("x", block)[: b - a].copy_(k), None
            if split:  # groups of at most n_max rows: the split's levels (group_sums)
                n_max = min(b - a, g.largest)
                sums += split_sums(k, g.inv[a:b], u, n_max)
                if ps is not None:
                    ps += split_sums(k, g.pos[a:b], self.max_positions, n_max)
            elif sparse:
                sums = g.by_type.sums(x)
                ps = None if g.by_pos is None else g.by_pos.sums(x)
            else:
                sums.index_add_(0, g.inv[a:b], x)
                if ps is not None:
                    ps.index_add_(0, g.pos[a:b], x)
            weights = inv_norms if sparse else None  # only the sparse product takes them
            row_slots = g.row_slots[a:b]
            types.add_unit_sums(
                li, x, g.slots, row_slots, self._workspace, by_type=by_type, inv_norms=weights
            )
            if self.clip_dims is not None:
                types.add_unit_sums(
                    li, x, g.slots, row_slots, self._workspace, clip_dims=self.clip_dims,
                    by_type=by_type,
                )  # fmt: skip
        return sums, ps, x

    def _triton_sums(self, kept: torch.Tensor, g: _Groups, blocks: list[tuple[int, int]]) -> bool:
        """Whether pass 1 runs in Triton (:mod:`~embgeom_ray.core.segment_sums`, where
        :func:`~embgeom_ray.core.segment_sums.on` the device): the GPU's fold of one block
        with sparse sums, float64 sums (not :data:`SPLIT_SUMS`), no ``clip_dims``."""
        return (
            len(blocks) == 1
            and g.by_type is not None
            and self.clip_dims is None
            and not split_sums_on(self.comoment_precision, kept.dtype)
            and segment_sums.on(kept.device)
        )

    def _first_pass_triton(
        self, li: int, kept: torch.Tensor, g: _Groups
    ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        """:meth:`_first_pass` in Triton (:func:`~embgeom_ray.core.segment_sums.group_sums`):
        its kernels read the rows in their own dtype for the per-position sums, then for the
        norms and tails, the per-type sums and the unit-vector sums (added to the statistics
        where they are taken); no float64 copy of the rows is made (pass 2 converts as it
        reads). Where a kernel cannot be built, it raises
        before anything is added to the statistics (the caller then sums the sparse way)."""
        by_type, by_pos = g.by_type, g.by_pos
        ps = None
        if by_pos is not None:  # first: it changes nothing in the statistics if it fails
            ps = segment_sums.group_sums(
                kept, by_pos.keys(), by_pos.crow, by_pos.groups, order=by_pos.col,
                every_group=False,
            ).sums  # fmt: skip
        unit_sums = self.type_moments.arrays["unit_sums"][li]  # added to at the batch's slots
        t = segment_sums.group_sums(  # built (or failing to) before it adds anything
            kept, by_type.keys(), by_type.crow, by_type.groups,
            add_units_to=(unit_sums, g.slots), tails=True,
        )  # fmt: skip
        self.layer_state.add_tail_dims(li, t.argmax, t.argmin)
        return t.sums, ps, None

    def _shift(
        self, li: int, kept: torch.Tensor, x_mean: torch.Tensor
    ) -> tuple[torch.Tensor, IntegerGram | None]:
        """The shift c of layer slot ``li``'s co-moment product, and the product on int8 units
        when the bounded one runs there (:func:`integer_product`), else None.

        Per type, pass 2 runs centred on the type's own batch mean: a type far from the layer
        mean with little spread (GPT-2's first-position massive activations) keeps full
        precision, and identical occurrences give exactly 0 (their means are exact in x, so
        Chan's cross term between batches is 0 too). The co-moment: shift by c, the layer's
        running mean (the batch mean for the first batch): x' = x − c is centred up to the
        between-type spread, so the layer's one-pass co-moment X'ᵀX' − n m'm'ᵀ cancels only
        O(||μ_b − μ||² / V) digits, not ||μ||² / V. In float32 the shift is c rounded to
        float32 (any shift is exact; this one makes x' = x − c one correctly rounded float32
        subtraction of the model's own values); each block's float32 product is added to the
        float64 sum. The bounded product on int8 units (integer_gram) shifts by the batch's
        own mean: its fixed point is relative to each column's largest |x − c|, and its bound
        to the batch's centred co-moment.
        """
        dev = kept.device
        if self.comoment_precision == "bounded" and integer_product(dev, self.dim):
            c = x_mean.clone()
            return c, IntegerGram(kept, c, **integer_blocks(self.dim, gpu_fold(dev)))
        state = self.layer_state.arrays
        c = torch.where(state["n"][li] > 0, state["mean"][li], x_mean)  # a new tensor
        if self.comoment_precision == "float32":
            c = c.to(torch.float32).to(_F64)
        return c, None

    def _second_pass(
        self,
        kept: torch.Tensor,
        g: _Groups,
        blocks: list[tuple[int, int]],
        fuse: bool,
        x: torch.Tensor | None,
        mean_b: torch.Tensor,
        c: torch.Tensor,
        gram: IntegerGram | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pass 2 of :meth:`_fold_layer` over ``blocks`` of ``kept``: per type the squared
        deviations ||x − μ_b,t||² from the batch's type means ``mean_b``, and the upper block
        triangle of X'ᵀX', x' = x − c (:func:`~embgeom_ray.core.gram.add_gram`), or the rows'
        residues put into ``gram`` (the int8 product, summed by the caller). ``x``: pass 1's
        float64 rows, reused when there is one block; None where pass 1 made none (Triton:
        the fused kernels then read the model-dtype rows ``kept`` themselves, converting them
        exactly as they read). Returns (M2 per type of the batch, the upper triangle)."""
        dev, d = kept.device, self.dim
        block = blocks[0][1]
        f32 = self.comoment_precision == "float32"
        c32 = c.to(torch.float32) if f32 else None
        m2_b = torch.zeros(g.slots.numel(), dtype=_F64, device=dev)
        upper = torch.zeros(d, d, dtype=_F64, device=dev)
        for a, b in blocks:
            if len(blocks) > 1:  # one block (a GPU's batch): pass 1's float64 rows are intact
                x = self._workspace("x", block)[: b - a].copy_(kept[a:b])
            elif x is None and (gram is not None or not fuse):  # pass 1 ran in Triton
                x = kept.to(_F64)
            if gram is not None:  # the squared deviations and the rows' residues, piece by piece
                for grp, s, e in gram.pieces(a, b):
                    sq, res = deviations_and_residues(  # one compiled kernel where fused
                        mean_b, g.inv[s:e], x[s - a : e - a], c, grp.scale, grp.moduli,
                        *gram.padding(grp, s, e),
                    )  # fmt: skip
                    m2_b.index_add_(0, g.inv[s:e], sq)
                    gram.put(grp, s, e, res)
                continue
            if fuse:  # one compiled kernel (CUDA) reads x once: no (n × d) scratch
                # without pass 1's float64 copy, the kernel reads the model's rows: each
                # operation with the float64 means or shift promotes them exactly
                src = kept if x is None else x
                if f32:
                    sq, xs = deviations_and_centred32(mean_b, g.inv[a:b], src, kept[a:b], c32)
                else:
                    sq, xs = deviations_and_centred(mean_b, g.inv[a:b], src, c)
            else:
                dev_rows = self._workspace("tmp", block)[: b - a]
                torch.index_select(mean_b, 0, g.inv[a:b], out=dev_rows).sub_(x)
                sq = torch.linalg.vector_norm(dev_rows, dim=1).square_()
                if f32:
                    xs = torch.sub(
                        kept[a:b], c32, out=self._workspace("xs", block, torch.float32)[: b - a]
                    )
                else:
                    xs = x.sub_(c)  # x is not needed any more: centre in place
            m2_b.index_add_(0, g.inv[a:b], sq)
            add_gram(upper, xs)
        return m2_b, upper

    # ---------------------------------------------------------------- merge
    def mismatches(self, other: Sketch, names: Sequence[str] | None = None) -> list[str]:
        """As :meth:`Sketch.mismatches`; also statistics that both hold co-moments must have
        the same ``comoment_precision`` (a merge would mix two accuracies in one matrix)."""
        problems = super().mismatches(other, names)
        if (
            isinstance(other, EmbeddingStatistics)
            and other.comoment_precision != self.comoment_precision
            and self._holds_comoment()
            and other._holds_comoment()
        ):
            problems.append(
                f"comoment_precision {other.comoment_precision!r} != "
                f"{self.comoment_precision!r} (both hold co-moments)"
            )
        return problems

    @torch.no_grad()
    def merge(self, other: EmbeddingStatistics) -> EmbeddingStatistics:
        """Merge ``other`` into ``self`` (in place; returns ``self``). Associative, commutative.

        Each field by its rule (:class:`~embgeom_ray.core.statistics_fields.Field`): Chan's
        update for the moments, sums for the rest (:meth:`TypeMoments.merge
        <embgeom_ray.core.type_moments.TypeMoments.merge>`, :meth:`LayerState.merge
        <embgeom_ray.core.layer_state.LayerState.merge>`). Statistics merge when they measure
        the same thing (:meth:`check_compatible`), parts when they hold the same
        :class:`StatisticsPart`.
        """
        self.check_compatible(other)
        self._adopt_metadata(other)
        if not self._holds_comoment() and other._holds_comoment():
            self.comoment_precision = other.comoment_precision
        blocks = self._row_blocks(other.num_types)
        self.type_moments.merge(other.type_moments, blocks, self._workspace)
        if self.layer_state is not None:
            self.layer_state.merge(other.layer_state)
        return self

    # ------------------------------------------------------------- views
    def layer(self, layer: int) -> LayerMoments:
        """Numpy float64 view of hidden-state layer ``layer`` (an HF index, not a position).

        The types with a count in this layer, sorted by id. A part without the per-layer
        state (:attr:`holds_layer_state` False) shows n = 0 and zero per-layer arrays.
        """
        if layer not in self.layers:
            raise KeyError(f"layer {layer} was not measured; layers are {self.layers}")
        li = self.layers.index(layer)
        arrays = self.arrays
        order = self.type_moments.order()
        sel = order[arrays["counts"][li, : self.num_types][order] > 0]
        views: dict[str, Any] = {
            f.name: np.zeros(f.shape(1, 0, self.dim, self.max_positions)[1:], f.numpy_dtype)
            for f in LAYER_FIELDS
        }
        for f in self.held_fields():
            a = arrays[f.name][li]
            views[f.name] = (a.index_select(0, sel) if f.per_type else a).detach().cpu().numpy()
        for f in LAYER_FIELDS:
            if not f.tail:
                views[f.name] = int(views[f.name])
        return LayerMoments(
            layer=layer,
            type_ids=self.type_moments.slot_ids[sel].cpu().numpy(),
            clip_dims=None if self.clip_dims is None else tuple(self.clip_dims),
            **views,
        )

    def token_count(self) -> int:
        """Tokens counted (in the first layer; every layer counts the same finite tokens).

        For a part without the per-layer state: the tokens of its types (its token range).
        """
        if self.layer_state is not None:
            return int(self.layer_state.arrays["n"][0])
        return int(self.type_moments.arrays["counts"][0, : self.num_types].sum())

    # -------------------------------------------------------- persistence
    def _header_fields(self) -> dict[str, Any]:
        fields = super()._header_fields()
        fields["partition"] = None if self.partition is None else self.partition.to_json()
        return fields

    def state_dict(self) -> dict[str, np.ndarray]:
        """The held :data:`FIELDS` plus ``type_ids``: types sorted by id, unused slots dropped,
        all on CPU (:func:`~embgeom_ray.core.statistics_io.state_arrays`)."""
        return statistics_io.state_arrays(self)

    def to_bytes(self, into: np.ndarray | None = None) -> bytearray | np.ndarray:
        """The safetensors file of :meth:`state_dict` (and :meth:`header`), each array
        gathered straight into its place in the file's buffer
        (:func:`~embgeom_ray.core.statistics_io.to_bytes`; ``into``: a uint8 array to reuse
        as that buffer where it is large enough): serialising holds these statistics plus
        one copy of their arrays, not two (what bounds an extractor spilling under
        ``--worker-memory``)."""
        return statistics_io.to_bytes(self, into)

    @classmethod
    def _empty(cls, header: Mapping[str, Any], version: int, device: Any) -> EmbeddingStatistics:
        return cls(**statistics_io.empty_arguments(header, version), device=device)

    def _set_state(self, arrays: Mapping[str, np.ndarray]) -> None:
        statistics_io.set_state(self, arrays)

    def to(self, device: str | torch.device) -> EmbeddingStatistics:
        """A copy on ``device`` (compact)."""
        return EmbeddingStatistics.from_state(self.header(), self.state_dict(), device=device)

    @classmethod
    def load_part(
        cls,
        path: str | FileRef,
        layers: Sequence[int] | None = None,
        token_range: tuple[int, int | None] = (0, None),
        *,
        layer_state: bool = True,
    ) -> EmbeddingStatistics:
        """``load(path).select(layers, token_range, layer_state=layer_state)``, reading only
        that part's bytes (version 2 and later, :func:`~embgeom_ray.core.statistics_io.read_part`;
        local files and object stores alike), checked against the file's digest where
        ``path`` carries one. Version-1 files are read whole and selected."""
        ref = as_ref(path)
        with open_verified(ref) as f:
            st = SafetensorsFile(f, cls.KIND)
            header = st.header()
            if cls.check_header(header) >= 2:
                part = statistics_io.read_part(st, header, layers, token_range, layer_state)
                return cls.from_state(*part)
            whole = cls.from_bytes(f.read_range(0, f.size()))
        return whole.select(layers, token_range, layer_state=layer_state)

    @classmethod
    def read_header(cls, path: str | FileRef) -> dict[str, Any]:
        """The header of a statistics file (layers, dim, partition, metadata, …), read alone
        (its first bytes)."""
        with open_verified(as_ref(path)) as f:
            header = SafetensorsFile(f, cls.KIND).header()
        cls.check_header(header)
        return header

    @classmethod
    def read_type_ids(cls, path: str | FileRef) -> np.ndarray:
        """The increasing token ids a statistics file holds rows for, read alone (the other
        arrays stay where they are)."""
        ref = as_ref(path)
        with open_verified(ref) as f:
            st = SafetensorsFile(f, cls.KIND)
            if "type_ids" in st.keys():
                return st.array("type_ids")
        return cls.load(ref).state_dict()["type_ids"]

    # ------------------------------------------------------------ partitions
    def _like(
        self, layers: Sequence[int], partition: StatisticsPart | None, initial_types: int = 1
    ) -> EmbeddingStatistics:
        """Empty statistics of the same measurement, holding ``layers`` and ``partition``."""
        return EmbeddingStatistics(
            layers,
            self.dim,
            max_positions=self.max_positions,
            device=self.device,
            metadata=self.metadata,
            initial_types=initial_types,
            clip_dims=self.clip_dims,
            comoment_precision=self.comoment_precision,
            partition=partition,
        )

    def select(
        self,
        layers: Sequence[int] | None = None,
        token_range: tuple[int, int | None] | None = None,
        *,
        layer_state: bool | None = None,
    ) -> EmbeddingStatistics:
        """A copy of the part of these statistics that holds ``layers`` (default: all held;
        kept in this object's order), the per-type rows of the token ids in ``token_range``
        [lo, hi) (hi None: no bound; default: all held; an empty one may lie anywhere) and, if
        ``layer_state`` (default: whether this object holds them), the per-layer fields.

        The copy's :class:`StatisticsPart` records the part; selecting everything gives a whole
        again. Parts of disjoint token ranges go back together with :meth:`combine`, and
        ``a.select(...).merge(b.select(...))`` equals ``a.merge(b).select(...)``.
        """
        lo, hi = self.token_range if token_range is None else token_range
        layer_state = self.holds_layer_state if layer_state is None else bool(layer_state)
        kept, partition = requested_part(self.layers, self.partition, layers, (lo, hi), layer_state)
        part = self._like(kept, partition)
        order = self.type_moments.order()
        ids = self.type_moments.slot_ids[order]
        inside = ids >= lo if hi is None else (ids >= lo) & (ids < hi)
        slots = order[inside]
        lis = torch.tensor([self.layers.index(x) for x in kept], device=self.device)
        arrays = self.arrays
        tensors = {}
        for f in part.held_fields():
            a = arrays[f.name].index_select(0, lis)
            tensors[f.name] = a.index_select(1, slots) if f.per_type else a
        part._fill(ids[inside], tensors)
        return part

    def _fill(self, type_ids: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> None:
        """Set the arrays of these (new, empty) statistics: the per-type rows of the increasing
        ``type_ids`` and the per-layer arrays, from ``tensors`` (one per held field)."""
        t = int(type_ids.numel())
        if t:
            self.type_moments.slots_for(type_ids.to(self.device))  # slots 0..t-1, in id order
        for f in self.held_fields():
            v = tensors[f.name].to(self.device)
            if f.per_type:
                self.type_moments.arrays[f.name][:, :t] = v
            else:
                self.layer_state.arrays[f.name] = v.contiguous()

    @classmethod
    def combine(cls, parts: Sequence[EmbeddingStatistics]) -> EmbeddingStatistics:
        """The statistics that the parts ``parts`` of one measurement were selected from.

        For every layer held by any part, the parts holding it must hold disjoint token
        ranges that join into one range [lo, hi), the same for every layer, and at most one
        of them its per-layer state (then one for every layer). The result holds the union:
        layers in the measurement's order, the joint token range; it is a whole when that is
        everything. Rows are copied, so ``combine(select(...) for each part) == whole``
        exactly. On the first part's device.
        """
        if not parts:
            raise ValueError("combine needs at least one part")
        first = parts[0]
        of_layers = first.of_layers
        for p in parts[1:]:
            problems = first.mismatches(p, ("dim", "max_positions", "clip_dims", "of_layers"))
            if problems:
                raise StatisticsMismatchError(
                    "cannot combine parts of different measurements: " + "; ".join(problems)
                )
        layers = [x for x in of_layers if any(x in p.layers for p in parts)]
        joint, layer_state = joint_part(parts, layers)
        whole = tuple(layers) == of_layers and joint == (0, None) and layer_state
        out = first._like(
            layers,
            None if whole else StatisticsPart(of_layers, joint, layer_state),
            initial_types=sum(p.num_types for p in parts),
        )
        out.comoment_precision = next(
            (p.comoment_precision for p in parts if p._holds_comoment()), first.comoment_precision
        )
        for p in parts:
            out._adopt_metadata(p)
            out._copy_part(p)
        return out

    def _copy_part(self, part: EmbeddingStatistics) -> None:
        """Copy the rows of ``part`` (of a disjoint token range) and, if it holds them, its
        per-layer arrays into these statistics (:meth:`combine`)."""
        dev = self.device
        t = part.num_types
        slots = self.type_moments.slots_for(part.type_moments.slot_ids.to(dev))
        mine, theirs = self.arrays, part.arrays
        for pli, layer in enumerate(part.layers):
            li = self.layers.index(layer)
            for f in self.held_fields():
                if f.per_type:
                    mine[f.name][li].index_copy_(0, slots, theirs[f.name][pli, :t].to(dev))
                elif part.holds_layer_state:
                    mine[f.name][li] = theirs[f.name][pli].to(dev)
