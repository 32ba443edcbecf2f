"""Mergeable sufficient statistics of contextual embeddings: the core of embgeom_ray.

One :class:`EmbeddingStatistics` holds, for each selected layer ``l`` (HF ``hidden_states[l]``):

per token type ``t`` (a token id)
    ``count`` n_t, ``mean`` μ_t, ``m2`` M2_t = Σ_i ||x_i − μ_t||², and ``unit_sum``
    U_t = Σ_i x_i/||x_i|| (for exact cosine metrics, Ethayarajh 2019);
per layer
    ``n``, ``mean`` μ, the d×d co-moment matrix C = Σ_i (x_i − μ)(x_i − μ)ᵀ (covariance C/n,
    IsoScore, PCA spectrum, per-dimension mean/std), how often each dimension is the argmax /
    argmin of a token's vector (Luo 2020, "tails"), and per position p within the window the
    count and mean vector (Kulmizev, Mao & Luo 2021, positional artefacts);
    ``nonfinite``: tokens whose vector had a NaN/inf and were left out of every sum.

The arrays are declared once, in :data:`FIELDS` (name, shape, dtype, merge rule); update,
merge, save, load, the views and partitions all work from that table.

Only token types actually seen occupy memory (a slot table grows by doubling). Everything is
float64: each batch is cast to float64 on its device and shifted by the layer's running mean
c; per type it is reduced centred on the type's own batch mean (two passes), per layer the
co-moment is (X − c)ᵀ(X − c) − n m'm'ᵀ, which cancels only O(||μ_b − μ||²/V) digits instead
of ||μ||²/V. That one product is where the precisions differ (``comoment_precision``):
float64; "bounded", the job's default, within |ΔC_ab| ≤ 2^−29 √(C_aa C_bb) on int8 matrix
units where :func:`integer_product` (CUDA; rows shifted by the batch's own mean:
:mod:`~embgeom_ray.core.integer_gram`, ``docs/precision.md``), else float64; float32 (earlier
versions' default, no bound). Batch moments are merged into
the running ones with the pairwise update of Chan, Golub & LeVeque (1979)::

    n = n_a + n_b,  δ = μ_b − μ_a,  μ = μ_a + δ n_b/n,
    M2 = M2_a + M2_b + ||δ||² n_a n_b / n,   C = C_a + C_b + δδᵀ n_a n_b / n.

:meth:`EmbeddingStatistics.merge` uses the same update, so folding a corpus batch by batch,
shard by shard or run by run gives the same moments up to float64 rounding, whatever the
order; the result keeps the precision of a two-pass float64 computation even when
||μ||² / V ~ 1e8 (GPT-2's massive activations), where the textbook E||x||² − ||μ||² in float32
is wrong by orders of magnitude.

Partitions. Per-type rows are independent of each other, so the statistics split exactly by
token id: :meth:`EmbeddingStatistics.select` keeps some layers, the types whose ids lie in
[lo, hi) and, optionally, the per-layer moments; the header's ``partition`` record says which
part of which measurement a file holds (:class:`Partition`). Parts of one measurement merge
with parts that hold the same :class:`Partition` (Chan's update per row, as above), and
:meth:`EmbeddingStatistics.combine` puts parts of disjoint token ranges (and layers) back
together, exactly: selecting and combining is a copy.

The type is a sketch in the Apache DataSketches sense (:class:`~embgeom_ray.core.sketch.Sketch`):
``update`` / ``merge`` / ``save``-``load`` (safetensors, no pickle) / read-only numpy views
(:meth:`EmbeddingStatistics.layer`). Metrics are pure functions of those views, in
:mod:`embgeom_ray.core.metrics`.
"""

from __future__ import annotations

import itertools
import json
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import StatisticsMismatchError
from .fold_kernels import (
    deviations_and_centred,
    deviations_and_centred32,
    deviations_and_residues,
    float64_rows,
    fused_on,
)
from .group_sums import GroupMatrix
from .integer_gram import IntegerGram
from .sketch import HEADER_KEY, Sketch, check_array, safetensors_into

#: the ``format`` of the header (this name since the first version; see :data:`_READS`).
FORMAT = "embgeom_ray.statistics"
#: version 2 adds the header's ``partition`` record; version 1 files (no record) are wholes.
FORMAT_VERSION = 2
#: format names and versions read.
_READS = {FORMAT: frozenset({1, 2})}
_F64 = torch.float64
_I64 = torch.int64
#: rows per block of the fold on a CPU: a block's float64 copy (8·d bytes a row) and scratch
#: stay in the cache while every per-row pass runs over it (~1.7x faster than whole batches
#: at d = 384); on a GPU the fold takes the whole batch at once.
CPU_ROW_BLOCK = 1024
#: fold the GPU's way: the whole batch as one block of rows, tails by ``argmax``, the sums by
#: type and position as sparse products (CUDA), no host synchronisation per layer. None: on
#: every device but the CPU; True or False forces the choice (the tests fold on CPUs both ways).
GPU_FOLD: bool | None = None


def gpu_fold(device: torch.device) -> bool:
    """Whether statistics on ``device`` fold the GPU's way (:data:`GPU_FOLD`)."""
    return device.type != "cpu" if GPU_FOLD is None else GPU_FOLD


#: the co-moment product of ``comoment_precision="bounded"`` on int8 matrix units
#: (:mod:`~embgeom_ray.core.integer_gram`). None: on CUDA devices, where it is the fast product
#: within the bound; elsewhere the float64 product is (a CPU's float64 product beats twelve
#: int8 products and their residues). True or False forces the choice (the tests run it on
#: CPUs, on the CPU's own int8 units).
INTEGER_PRODUCT: bool | None = None
#: comoment_precision values: the product within the stated bound (``docs/precision.md``), the
#: float64 reference, and the float32 product of earlier versions (no bound: its float32 sums
#: over up to 1,024 rows may err by ~1e-5 relative)
PRECISIONS = ("bounded", "float64", "float32")
#: other names accepted for a precision
PRECISION_ALIASES = {"reference": "float64"}


def integer_product(device: torch.device, dim: int) -> bool:
    """Whether the bounded co-moment product runs on int8 matrix units on ``device``
    (:data:`INTEGER_PRODUCT`; never for d < 17, too narrow for them)."""
    wanted = device.type == "cuda" if INTEGER_PRODUCT is None else INTEGER_PRODUCT
    return wanted and dim >= 17 and not _integer_unavailable


_integer_unavailable = False


def _sparse_sums_on(device: torch.device) -> bool:
    """Whether the GPU's fold sums rows by group with :class:`GroupMatrix` (CUDA, and CPUs
    when :data:`GPU_FOLD` forces the GPU's way there: other devices lack sparse CSR)."""
    return gpu_fold(device) and device.type in ("cuda", "cpu")

# merge rules of the fields (see Field.merge)
SUM = "sum"
TYPE_MOMENTS = "type_moments"
LAYER_MOMENTS = "layer_moments"
POSITION_MEANS = "position_means"


@dataclass(frozen=True)
class Field:
    """One array of :class:`EmbeddingStatistics`: the single declaration of its name, shape,
    dtype and merge rule.

    ``name`` is the array's name in files and the :class:`LayerMoments` attribute. Its shape
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
    dtype: torch.dtype
    merge: str
    clip: bool = False

    def shape(self, n_layers: int, n_types: int, dim: int, max_positions: int) -> tuple[int, ...]:
        size = {"d": dim, "P": max_positions}
        lead = (n_layers, n_types) if self.per_type else (n_layers,)
        return (*lead, *(size[s] for s in self.tail))

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype({_F64: np.float64, _I64: np.int64}[self.dtype])


#: every array of the statistics (see :class:`Field`), per type first.
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


@dataclass(frozen=True)
class Partition:
    """Which part of a measurement a statistics object holds (the header's ``partition``).

    Attributes:
        of_layers: the whole measurement's layers, in order; the part holds its own
            ``layers``, a subset of these.
        token_range: (lo, hi): the part holds the per-type rows of the token ids t with
            lo ≤ t < hi; hi None: no upper bound, so (0, None) is every token id.
        layer_state: whether the part holds the per-layer fields (n, mean, co-moment, tails,
            positions, nonfinite) of its layers; a part without them reads as n = 0 there.

    A statistics object that holds everything has no partition (``None``); version-1 files
    are such wholes.
    """

    of_layers: tuple[int, ...]
    token_range: tuple[int, int | None] = (0, None)
    layer_state: bool = True

    def __post_init__(self) -> None:
        lo, hi = self.token_range
        if lo < 0 or (hi is not None and hi < lo):
            raise ValueError(f"token range [{lo}, {hi}) is not a range of token ids")

    def to_json(self) -> dict[str, Any]:
        return {
            "of_layers": list(self.of_layers),
            "token_range": list(self.token_range),
            "layer_state": self.layer_state,
        }

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> Partition:
        lo, hi = record["token_range"]
        return cls(
            tuple(int(x) for x in record["of_layers"]),
            (int(lo), None if hi is None else int(hi)),
            bool(record["layer_state"]),
        )


def state_bytes(layers: int, dim: int, types: int, positions: int, clip: int = 0) -> int:
    """Bytes of the statistics of ``layers`` layers, hidden size ``dim``, ``types`` token
    types seen, ``positions`` positions, ``clip`` clipped dimensions (float64/int64 arrays):
    8 · (L · (V · (2d + 2) + d² + 3d + P · (d + 1) + 2) + V), plus L · V · d · 8 with clipping.
    With ``types = 0``: the fixed per-layer state every statistics object holds."""
    d, v = dim, types
    per_layer = v * (2 * d + 2) + d * d + 3 * d + positions * (d + 1) + 2
    return 8 * (layers * per_layer + v) + (8 * layers * v * d if clip else 0)


def range_key(token_range: tuple[int, int | None]) -> tuple[int, float]:
    """Sort key of token ranges: by lo, then hi (None: unbounded, last)."""
    lo, hi = token_range
    return lo, math.inf if hi is None else hi


def _range_text(token_range: tuple[int, int | None]) -> str:
    lo, hi = token_range
    return f"[{lo}, {'∞' if hi is None else hi})"


@dataclass(frozen=True)
class LayerMoments:
    """Read-only float64 numpy view of one layer's moments, types sorted by token id.

    Its attributes are the :data:`FIELDS` of one layer (types with a count in this layer only).
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


def _chan_merge_mean_m2(
    n_a: torch.Tensor,
    mean_a: torch.Tensor,
    n_b: torch.Tensor,
    mean_b: torch.Tensor,
    scratch: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (n, mean, Δm2) of merging rows (n_a, mean_a) with (n_b, mean_b).

    Δm2 = ||δ||² n_a n_b / n is the cross term to add to M2_a + M2_b. Rows with n = 0 stay 0.
    The mean is computed in place in ``mean_a`` and δ in ``scratch`` (a buffer of mean_a's
    shape): fresh (u, d) temporaries of a large batch cost page faults at every call (7x
    slower at u = 4,000 types, d = 512). Three passes over the rows: δ = mean_b − mean_a,
    mean_a += δ · n_b/n (one ``addcmul_``) and ||δ|| (one reduction).
    """
    n = n_a + n_b
    n_f = n.to(_F64).clamp_min(1.0)
    w_b = (n_b.to(_F64) / n_f).unsqueeze(-1)
    w_ab = n_a.to(_F64) * n_b.to(_F64) / n_f
    delta = torch.sub(mean_b, mean_a, out=scratch)
    mean = mean_a.addcmul_(delta, w_b)
    cross = torch.linalg.vector_norm(delta, dim=-1).square_() * w_ab
    return n, mean, cross


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
    pos: torch.Tensor | None  # (n,) position of each row in its window
    pos_counts: torch.Tensor | None  # (P,) rows per position
    by_type: GroupMatrix | None = None  # on GPUs: the sums by type as sparse products
    by_pos: GroupMatrix | None = None  # ... and by position


def _column_blocks(d: int, block: int, align: int = 1) -> list[int]:
    """Edges of about ``block``-wide column blocks of d columns (at least one block), the inner
    edges rounded to multiples of ``align`` columns (blocks that would be empty are dropped)."""
    k = max(1, round(d / block))
    if align == 1:
        return [d * i // k for i in range(k + 1)]
    inner = {min(d, align * round(d * i / k / align)) for i in range(1, k)}
    return sorted(inner - {0, d} | {0, d})


def add_gram_upper(
    upper: torch.Tensor, xs: torch.Tensor, block: int = 96, align: int = 1
) -> None:
    """Add the upper block triangle of XᵀX (rows of ``xs``, multiplied in its dtype) to ``upper``.

    With the columns split into k blocks X = [X_1 … X_k] of about ``block`` columns, block row
    i is X_iᵀ [X_i … X_k]: (k + 1)/(2k) of the multiply-adds of ``xs.T @ xs`` (62% for
    d = 384, 51% for d = 4096) in k large matrix products, each added to ``upper`` (float64)
    in its own precision. Blocks strictly below the diagonal are left as they are;
    :func:`symmetric_from_upper` makes the matrix. ``align``: the blocks' edges at multiples
    of that many columns (:func:`_column_blocks`).
    """
    for lo, hi in itertools.pairwise(_column_blocks(xs.shape[1], block, align)):
        upper[lo:hi, lo:] += xs[:, lo:hi].T @ xs[:, lo:]  # block row: (hi − lo, d − lo)


#: column blocks of the co-moment product on a GPU: a few wide products (the block triangle
#: of k blocks is (k + 1)/(2k) of the full product's multiply-adds: 9/16 for 8) rather than many
#: skinny ones. On an H100 (``python -m bench.comoment --rows 65536``; docs/benchmarks.md),
#: float64, d = 2,048:
#: 4 blocks 6.20 ms, 8 blocks 5.51 ms; d = 4,096: 22.95 and 21.10 ms.
GPU_GRAM_BLOCKS = 8
#: the GPU blocks' edges at multiples of this many columns: 6 blocks of d = 2,048 (edges at odd
#: columns such as 341) took 18.6 ms on that H100, three times as long as 4 or 8 blocks
GPU_GRAM_ALIGN = 64


def add_gram(upper: torch.Tensor, xs: torch.Tensor, block: int = 96) -> None:
    """Add the upper block triangle of XᵀX (rows of ``xs``, multiplied in its dtype) to
    ``upper`` (float64) (:func:`add_gram_upper`): on a CPU in blocks of ``block`` columns, on a
    GPU in :data:`GPU_GRAM_BLOCKS` blocks with edges at multiples of :data:`GPU_GRAM_ALIGN`
    columns (skinny products run far under a GPU's rate: on an H200 at n = 8,192 rows and
    d = 2,048, float64 blocks of 96 columns take 4.9 ms, the full product 1.1 ms;
    ``python -m bench.comoment``; docs/benchmarks.md). :func:`symmetric_from_upper` makes the
    matrix."""
    d = xs.shape[1]
    if xs.device.type != "cpu":
        add_gram_upper(upper, xs, -(-d // GPU_GRAM_BLOCKS), GPU_GRAM_ALIGN)
    else:
        add_gram_upper(upper, xs, block)


def symmetric_from_upper(upper: torch.Tensor) -> torch.Tensor:
    """The symmetric matrix whose upper triangle (diagonal included) is ``upper``'s."""
    upper = torch.triu(upper)  # diagonal blocks too: the result is exactly symmetric
    return upper + torch.triu(upper, diagonal=1).T


def gram(xs: torch.Tensor, block: int = 96) -> torch.Tensor:
    """XᵀX (d × d, float64) of the rows of ``xs`` (n × d), multiplied in ``xs``'s dtype.

    XᵀX is symmetric, so only its upper block triangle is multiplied
    (:func:`add_gram_upper`) and the lower triangle is mirrored. Pass float32 rows (already
    centred) for the ``comoment_precision="float32"`` product.
    """
    d = xs.shape[1]
    upper = torch.zeros(d, d, dtype=_F64, device=xs.device)
    add_gram(upper, xs, block)
    return symmetric_from_upper(upper)


def extreme_counts(
    x: torch.Tensor,
    which: str,
    scratch: torch.Tensor | None = None,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """How many rows of ``x`` (n × d, finite) have their first maximum (``which="max"``) or
    minimum (``"min"``) in each dimension: ``bincount(x.argmax(1), minlength=d)`` (Luo 2020).

    With a float32 ``scratch`` of x's shape (the fold passes one on CPUs), computed as the
    column sums of the 0/1 matrix ``x == rowmax(x)``: vectorised passes, ~4x faster on CPUs
    than the index-tracking ``argmax``. A row whose extreme value is tied between dimensions
    would count twice there; then (the sums exceed n: in bf16, with 8 significant bits, a
    tie somewhere in a block of 1,024 rows is the rule) only the tied rows are taken back
    and counted by their exact argmax.
    Without ``scratch`` (on GPUs, where ``argmax`` is one read of x in its own dtype instead
    of four passes, two of them over a float32 matrix, and a host synchronisation), the
    argmax itself, counted by ``index_add_`` (``bincount`` would synchronise with the host
    on CUDA to size its output); both give ties to the first dimension. With ``into`` (an
    int64 vector of d), the counts are added into it and it is returned.
    """
    n, d = x.shape
    if into is None:
        into = torch.zeros(d, dtype=torch.int64, device=x.device)
    if scratch is None:
        first = x.argmax(dim=1) if which == "max" else x.argmin(dim=1)
        return into.index_add_(0, first, torch.ones_like(first))
    if n >= 2**24:  # float32 sums of 0/1 values are exact below 2^24
        return extreme_counts(x, which, into=into)
    ext = x.amax(dim=1, keepdim=True) if which == "max" else x.amin(dim=1, keepdim=True)
    eq = torch.eq(x, ext, out=scratch)
    hits = eq.sum(dim=0)
    if int(hits.sum()) == n:  # one extreme per row: exact 0/1 sums
        return into.add_(hits.to(torch.int64))
    tied = (eq.sum(dim=1) > 1).nonzero().squeeze(1)  # the rows counted more than once
    into.add_(hits.to(torch.int64)).sub_(eq.index_select(0, tied).sum(dim=0).to(torch.int64))
    return extreme_counts(x.index_select(0, tied), which, into=into)


def _add_integer_gram(
    upper: torch.Tensor, gram: IntegerGram, kept: torch.Tensor, shift: torch.Tensor
) -> None:
    """``gram.add_upper(upper)``; where the int8 product cannot run (no int8 kernel in this
    torch build or for this device), one warning, the float64 product of the same shifted
    rows instead, and float64 from then on."""
    global _integer_unavailable
    try:
        total = torch.zeros_like(upper)
        gram.add_upper(total)
    except (RuntimeError, NotImplementedError) as e:
        _integer_unavailable = True
        warnings.warn(
            f"the int8 co-moment product failed ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''}); computing it in float64 "
            "(the same bound, slower)",
            RuntimeWarning,
            stacklevel=3,
        )
        add_gram(upper, kept.to(_F64) - shift)
        return
    upper += total


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
        clip_dims: dimensions to zero ("clip", Luo 2020; Kulmizev et al. 2021) for exact
            clipped cosine metrics: per type, the sum of unit vectors of the clipped vectors
            x' (x with these dimensions set to 0) is accumulated too. None: not tracked.
        comoment_precision: how the per-batch product (X − c)ᵀ(X − c), the fold's one
            matrix product, is computed (:data:`PRECISIONS`; ``--comoment-precision``):
            "float64" (this class's default, also called "reference"): in float64;
            "bounded" (the job's default): within the stated bound |ΔC_ab| ≤ ε √(C_aa C_bb),
            ε ≤ 2^−29 (``docs/precision.md``), on int8 matrix units where
            :func:`integer_product` (CUDA; rows shifted by the batch's mean,
            :mod:`~embgeom_ray.core.integer_gram`), else in float64; "float32": in float32
            on rows shifted by the layer's running mean rounded to float32, accumulated in
            float64 (earlier versions' default: ~1e-6 relative error on covariance entries in
            practice, with no bound). Every other statistic is float64 whatever the choice.
            It is saved in the header; statistics that both hold co-moments merge only with
            the same precision, and statistics without any (e.g. an empty accumulator) take
            the other's.
        partition: which part of a measurement these statistics hold (:class:`Partition`;
            made by :meth:`select`), None for all of it.
    """

    FORMAT = FORMAT
    FORMAT_VERSION = FORMAT_VERSION
    READS = _READS
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
        partition: Partition | None = None,
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
        dev = self.device
        # token id -> slot (-1: unseen); grown on demand
        self._id_to_slot = torch.full((0,), -1, dtype=_I64, device=dev)
        self._slot_ids = torch.empty(0, dtype=_I64, device=dev)
        cap = max(int(initial_types), 1)
        shape = (len(self.layers), cap, self.dim, self.max_positions)
        #: the arrays of :data:`FIELDS` held (per-type ones with ``cap`` slots), by name
        self._a: dict[str, torch.Tensor] = {
            f.name: torch.zeros(f.shape(*shape), dtype=f.dtype, device=dev) for f in self._fields()
        }
        self._buffers: dict[str, torch.Tensor] = {}  # per-batch scratch (see _workspace)
        self._max_doubling = 1 << 62  # capacity the doubling stops at (see fit_budget)

    def _fields(self, among: Sequence[Field] = FIELDS) -> list[Field]:
        """The fields (of ``among``) these statistics hold: clipped sums only with
        ``clip_dims``, per-layer fields only with the per-layer state."""
        return [
            f
            for f in among
            if (self.clip_dims is not None or not f.clip) and (f.per_type or self.holds_layer_state)
        ]

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
        return self.holds_layer_state and bool(self._a["n"].any())

    # ------------------------------------------------------------------ slots
    @property
    def num_types(self) -> int:
        """Number of distinct token types seen (in any layer)."""
        return int(self._slot_ids.numel())

    def _capacity(self) -> int:
        return int(self._a["counts"].shape[1])

    def nbytes(self) -> int:
        """Bytes these statistics hold now: every array as allocated (the per-type arrays
        grow by doubling, so up to twice :func:`state_bytes` of the types seen) and the
        per-batch scratch buffers."""
        arrays = [*self._a.values(), *self._buffers.values(), self._slot_ids]
        return int(sum(t.numel() * t.element_size() for t in arrays))

    def _row_bytes(self) -> int:
        """Bytes of one slot's rows across the per-type arrays."""
        return sum(
            t.element_size() * t.numel() // max(t.shape[1], 1)
            for f in self._fields(TYPE_FIELDS)
            for t in (self._a[f.name],)
        )

    def held_bytes(self) -> int:
        """Bytes holding what these statistics have seen: :meth:`nbytes` less the per-type
        slots not assigned (allocated, never written: on a CPU such pages are not even
        resident). What an extractor's ``--worker-memory`` budget is checked against."""
        return self.nbytes() - (self._capacity() - self.num_types) * self._row_bytes()

    def fit_budget(self, budget: int) -> None:
        """Give the per-type arrays now the slots that fit ``budget`` bytes (with the state
        held now), and let them grow past that only by what a batch needs, never doubling.
        Under an extractor's budget the arrays are then allocated once, with no doubling's
        copy, and never reach twice the budget (on a GPU allocated memory is real memory; on
        a CPU a slot's pages are touched only when a type is assigned to it)."""
        fixed = self.held_bytes() - self.num_types * self._row_bytes()
        self._max_doubling = max(1, (int(budget) - fixed) // (self._row_bytes() + 8))
        self._grow(self._max_doubling)

    @torch.inference_mode()  # the arrays may be inference tensors (a fold under inference_mode)
    def clear(self) -> None:
        """Forget everything seen, keeping the allocated arrays: the statistics are empty
        again (as a new object with these options and metadata), and the next types take the
        same slots, zeroed as they are assigned. An extractor that spills or flushes goes on
        in memory already written, with no doublings (each a copy of every per-type array)
        and no fresh pages: a fold into fresh statistics cost 1.2-1.9x one into statistics
        that had seen its types (``bench.vocabulary``; docs/benchmarks.md)."""
        self._id_to_slot[self._slot_ids] = -1
        self._slot_ids = self._slot_ids[:0]
        for f in self._fields(LAYER_FIELDS):
            self._a[f.name].zero_()

    def _grow(self, needed: int) -> None:
        cap = self._capacity()
        if needed <= cap:
            return
        new_cap = max(needed, min(2 * cap, max(cap, self._max_doubling)))
        for f in self._fields(TYPE_FIELDS):
            # a field at a time: the old and the grown array. The new slots are not zeroed
            # here but when they are assigned (:meth:`_slots_for`): capacity never used is
            # never touched (no zeroing, no pages faulted in)
            t = self._a[f.name]
            grown = torch.empty((t.shape[0], new_cap, *t.shape[2:]), dtype=t.dtype, device=t.device)
            used = self.num_types  # slots beyond it hold nothing yet
            grown[:, :used].copy_(t[:, :used])
            self._a[f.name] = grown

    def _slots_for(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots of the distinct token ids ``ids`` (int64, on device), assigning new ones."""
        if ids.numel() == 0:
            return ids
        low, high = torch.stack(torch.aminmax(ids)).tolist()  # one host synchronisation
        if low < 0:
            raise ValueError("token ids must be non-negative")
        top = high + 1
        if top > self._id_to_slot.numel():
            size = max(top, 2 * self._id_to_slot.numel())
            grown = torch.full((size,), -1, dtype=torch.int64, device=self.device)
            grown[: self._id_to_slot.numel()] = self._id_to_slot
            self._id_to_slot = grown
        slots = self._id_to_slot[ids]
        new = slots < 0
        if bool(new.any()):
            new_ids = ids[new]
            start = self.num_types
            new_slots = torch.arange(start, start + new_ids.numel(), device=self.device)
            self._grow(start + new_ids.numel())
            for f in self._fields(TYPE_FIELDS):  # the new slots start from zero
                self._a[f.name][:, start : start + new_ids.numel()].zero_()
            self._id_to_slot[new_ids] = new_slots
            self._slot_ids = torch.cat([self._slot_ids, new_ids])
            slots = self._id_to_slot[ids]
        return slots

    # ------------------------------------------------------------- merging
    def _merge_types(
        self,
        li: int,
        slots: torch.Tensor,
        n_b: torch.Tensor,
        mean_b: torch.Tensor,
        m2_b: torch.Tensor,
    ) -> None:
        """Chan-merge batch (n, mean, M2) per type (``TYPE_MOMENTS``) into ``slots``.

        In blocks of rows (:meth:`_row_blocks`) through reused scratch (the ``merge``
        workspace, two rows of d per type of a block): no fresh (types × d) temporaries,
        whose pages are faulted in at every call, and a block stays in cache."""
        counts, means, m2 = self._a["counts"][li], self._a["means"][li], self._a["m2"][li]
        for a, b in self._row_blocks(slots.numel()):
            s = slots[a:b]
            work = self._workspace("merge", 2 * (b - a)).view(2, b - a, self.dim)
            n_a = counts.index_select(0, s)
            mean_a = torch.index_select(means, 0, s, out=work[0])
            n, mean, cross = _chan_merge_mean_m2(n_a, mean_a, n_b[a:b], mean_b[a:b], work[1])
            counts.index_copy_(0, s, n)
            means.index_copy_(0, s, mean)
            m2.index_add_(0, s, m2_b[a:b] + cross)

    def _merge_layer(
        self, li: int, n_b: torch.Tensor | int, mean_b: torch.Tensor, c_b: torch.Tensor
    ) -> None:
        """Chan-merge (n, mean, co-moment) of layer slot ``li`` (``LAYER_MOMENTS``). The fold
        passes ``n_b`` as a Python int: neither a copy to the device nor a read back."""
        a = self._a
        n_a = a["n"][li]
        if int(n_b) == 0:
            return
        if isinstance(n_b, torch.Tensor):
            nb = n_b.to(_F64)
        else:  # a device scalar by a fill (no copy from the host): ``float / tensor`` would
            # be computed as a reciprocal times the float, n_b/n = 1 then off by an ulp
            nb = torch.full((), float(n_b), dtype=_F64, device=n_a.device)
        delta = mean_b - a["mean"][li]
        n = n_a + n_b
        w = (n_a.to(_F64) * nb) / n.to(_F64)
        a["comoment"][li] += c_b + torch.outer(delta, delta) * w
        a["mean"][li] += delta * (nb / n.to(_F64))  # n_b/n correctly rounded: 1 into empty
        a["n"][li] = n

    def _merge_positions(self, li: int, counts_b: torch.Tensor, sums_b: torch.Tensor) -> None:
        """Merge per-position counts and *sums* (``POSITION_MEANS``: means need no M2, a plain
        weighted update)."""
        counts, means = self._a["position_counts"], self._a["position_means"]
        n = counts[li] + counts_b
        seen = n > 0
        upd = sums_b - counts_b.to(_F64).unsqueeze(-1) * means[li]
        upd /= n.to(_F64).clamp_min(1.0).unsqueeze(-1)
        means[li] = torch.where(seen.unsqueeze(-1), means[li] + upd, 0.0)
        counts[li] = n

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
        for li, h in enumerate(hidden):
            # the model's dtype, into reused scratch (no fresh pages per layer and batch)
            flat = h.to(dev).reshape(-1, self.dim)
            kept = torch.index_select(
                flat, 0, rows, out=self._workspace("kept", rows.numel(), flat.dtype)
            )
            self._fold_layer(li, kept, groups, finite[li])

    def _group(self, ids: torch.Tensor, pos: torch.Tensor | None) -> tuple[_Groups, torch.Tensor]:
        """(groups of the rows taken in ``order``, ``order``): rows sorted by slot (stable)."""
        uniq, inv = torch.unique(ids, return_inverse=True)
        row_slots, order = torch.sort(self._slots_for(uniq)[inv], stable=True)
        return self._groups_of(
            row_slots, None if pos is None else pos.index_select(0, order)
        ), order

    def _groups_of(self, row_slots: torch.Tensor, pos: torch.Tensor | None) -> _Groups:
        """The groups of rows whose slots ``row_slots`` are non-decreasing."""
        slots, inv, counts = torch.unique_consecutive(
            row_slots, return_inverse=True, return_counts=True
        )
        pos_counts = None if pos is None else torch.bincount(pos, minlength=self.max_positions)
        if not _sparse_sums_on(self.device):
            return _Groups(slots, inv, row_slots, counts, pos, pos_counts)
        by_pos = None if pos is None else GroupMatrix.of_labels(pos, pos_counts)
        by_type = GroupMatrix.of_sorted(counts, row_slots.numel())
        return _Groups(slots, inv, row_slots, counts, pos, pos_counts, by_type, by_pos)

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
        self._a["nonfinite"][li] += int((~finite).sum())
        pos = None if g.pos is None else g.pos[finite]
        return kept[finite], self._groups_of(g.row_slots[finite], pos)

    def _row_blocks(self, n: int) -> list[tuple[int, int]]:
        """Row ranges the fold walks through: :data:`CPU_ROW_BLOCK` rows on a CPU, else all
        (:func:`gpu_fold`)."""
        step = max(n, 1) if gpu_fold(self.device) else CPU_ROW_BLOCK
        return [(a, min(a + step, n)) for a in range(0, n, step)]

    def _fold_layer(self, li: int, kept: torch.Tensor, g: _Groups, finite: bool = True) -> None:
        """Fold the kept rows ``kept`` (n, d, the model's dtype) of layer slot ``li``; unless
        ``finite`` (the layer's batch is known to be finite), rows with a NaN/inf are left out.

        Two passes over blocks of rows (:meth:`_row_blocks`), each block converted to float64
        where it is used: (1) tails, per-type sums, unit-vector sums, position sums; (2) per
        type the deviations from the type's batch mean (M2), and the co-moment product. On a
        CPU a block's float64 copy and scratch stay in cache across the passes made over it;
        with one block (a GPU's whole batch) pass 2 reuses pass 1's float64 copy. Nothing here
        waits for the device (no value is read back to the host), so a GPU's host queues the
        layers' kernels ahead of them.
        """
        if not finite:
            kept, g = self._finite_rows(li, kept, g)
        n, d, u = kept.shape[0], self.dim, g.slots.numel()
        if n == 0:
            return
        dev = kept.device
        blocks = self._row_blocks(n)
        block = blocks[0][1]  # rows of the first (largest) block: the scratch buffers' size
        # tails: 0/1 column sums on a CPU (exact below 2^24 rows), argmax on a GPU
        hits = None if gpu_fold(dev) else self._workspace("hits", block, torch.float32)
        fuse = fused_on(dev)  # the per-row passes as compiled kernels (fold_kernels)
        # sums by group: sparse products with the whole batch (GPUs), else index_add_
        sparse = g.by_type is not None and len(blocks) == 1
        if not sparse:
            mean_b = self._workspace("mean_b", u).zero_()  # reused: no fresh pages to fault in
            ps = (
                None
                if g.pos is None
                else torch.zeros(self.max_positions, d, dtype=_F64, device=dev)
            )
        for a, b in blocks:
            k = kept[a:b]
            scratch = None if hits is None else hits[: b - a]
            extreme_counts(k, "max", scratch, into=self._a["argmax_counts"][li])
            extreme_counts(k, "min", scratch, into=self._a["argmin_counts"][li])
            if fuse:  # one compiled kernel (CUDA): the float64 rows and their 1/||x||
                x, inv_norms = float64_rows(k)
            else:
                x, inv_norms = self._workspace("x", block)[: b - a].copy_(k), None
            if sparse:
                mean_b = g.by_type.sums(x)
                ps = None if g.by_pos is None else g.by_pos.sums(x)
            else:
                mean_b.index_add_(0, g.inv[a:b], x)
                if ps is not None:
                    ps.index_add_(0, g.pos[a:b], x)
            by_type = g.by_type if sparse else None
            weights = inv_norms if sparse else None  # only the sparse product takes them
            self._add_unit_sums(self._a["unit_sums"][li], x, g, a, None, by_type, weights)
            if self.clip_dims is not None:
                self._add_unit_sums(self._a["clip_unit_sums"][li], x, g, a, self.clip_dims, by_type)
        x_mean = mean_b.sum(dim=0) / n  # the batch's mean, from its per-type sums
        mean_b /= g.counts.to(_F64).unsqueeze(1)
        if ps is not None:
            self._merge_positions(li, g.pos_counts, ps)

        # Per type, a second pass over the batch, centred on the type's own batch mean: a type
        # far from the layer mean with little spread (GPT-2's first-position massive
        # activations) keeps full precision, and identical occurrences give exactly 0 (their
        # means are exact in x, so Chan's cross term between batches is 0 too).
        # The co-moment: shift by c, the layer's running mean (the batch mean for the first
        # batch): x' = x − c is centred up to the between-type spread, so the layer's one-pass
        # co-moment X'ᵀX' − n m'm'ᵀ cancels only O(||μ_b − μ||² / V) digits, not ||μ||² / V.
        # In float32 the shift is c rounded to float32 (any shift is exact; this one makes
        # x' = x − c one correctly rounded float32 subtraction of the model's own values);
        # each block's float32 product is added to the float64 sum.
        # The bounded product on int8 units (integer_gram) shifts by the batch's own mean: its
        # fixed point is relative to each column's largest |x − c|, and its bound to the
        # batch's centred co-moment.
        integer = self.comoment_precision == "bounded" and integer_product(dev, d)
        c = torch.where(self._a["n"][li] > 0, self._a["mean"][li], x_mean)  # a new tensor
        if integer:
            c = x_mean.clone()
            gram = IntegerGram(kept, c, **self._gram_blocks(dev))
        f32 = self.comoment_precision == "float32"
        if f32:
            c = c.to(torch.float32).to(_F64)
            c32 = c.to(torch.float32)
        m2_b = torch.zeros(u, dtype=_F64, device=dev)
        upper = torch.zeros(d, d, dtype=_F64, device=dev)
        for a, b in blocks:
            if len(blocks) > 1:  # one block (a GPU's batch): pass 1's float64 rows are intact
                x = self._workspace("x", block)[: b - a].copy_(kept[a:b])
            if integer:  # the squared deviations and the rows' residues, piece by piece
                for grp, s, e in gram.pieces(a, b):
                    sq, res = deviations_and_residues(  # one compiled kernel where fused
                        mean_b, g.inv[s:e], x[s - a : e - a], c, grp.scale, grp.moduli,
                        *gram.padding(grp, s, e),
                    )  # fmt: skip
                    m2_b.index_add_(0, g.inv[s:e], sq)
                    gram.put(grp, s, e, res)
                continue
            if fuse:  # one compiled kernel (CUDA) reads x once: no (n × d) scratch
                if f32:
                    sq, xs = deviations_and_centred32(mean_b, g.inv[a:b], x, kept[a:b], c32)
                else:
                    sq, xs = deviations_and_centred(mean_b, g.inv[a:b], x, c)
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
        if integer:
            _add_integer_gram(upper, gram, kept, c)
        self._merge_types(li, g.slots, g.counts, mean_b, m2_b)
        m_s = x_mean - c  # mean of x' (small)
        c_b = symmetric_from_upper(upper) - torch.outer(m_s, m_s) * n
        self._merge_layer(li, n, c + m_s, c_b)

    def _gram_blocks(self, device: torch.device) -> dict[str, int]:
        """Column blocks of the integer product: the GPU's few wide ones (as :func:`add_gram`),
        else blocks of 96 columns; edges at multiples of 8 at least (int8 products)."""
        if gpu_fold(device):
            return {"block": -(-self.dim // GPU_GRAM_BLOCKS), "align": GPU_GRAM_ALIGN}
        return {"block": 96, "align": 8}

    def _add_unit_sums(
        self,
        sums: torch.Tensor,
        x: torch.Tensor,
        g: _Groups,
        a: int,
        clip_dims: list[int] | None,
        by_type: GroupMatrix | None,
        inv_norms: torch.Tensor | None = None,
    ) -> None:
        """Add Σ x/||x|| per type into ``sums`` (slots × d) straight from the rows ``x`` (rows
        a.. of the groups ``g``); with ``clip_dims``, of x with those dimensions zeroed. With
        ``by_type`` (the whole batch), as one sparse product weighted by 1/||x||, added to the
        batch's slots; else every unit vector is written and added to its slot. ``inv_norms``:
        the rows' 1/max(||x||, tiny) when already computed (:func:`float64_rows`; only with
        ``by_type`` and without ``clip_dims``)."""
        # scratch only where rows are written (the sparse product with 1/||x|| writes none)
        unit = None if clip_dims is None and by_type is not None else self._workspace("tmp", len(x))
        if clip_dims is None:
            src = x
        else:
            src = unit.copy_(x)
            src[:, clip_dims] = 0.0
        if inv_norms is None:
            norms = torch.linalg.vector_norm(src, dim=1, keepdim=True)
            norms.clamp_min_(torch.finfo(_F64).tiny)
            if by_type is not None:
                inv_norms = norms.squeeze(1).reciprocal_()
        if by_type is not None:
            sums.index_add_(0, g.slots, by_type.sums(src, inv_norms))
        else:
            sums.index_add_(0, g.row_slots[a : a + x.shape[0]], torch.div(src, norms, out=unit))

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

        Each field by its rule (:class:`Field`): Chan's update for the moments, sums for the
        rest. Statistics merge when they measure the same thing (:meth:`check_compatible`),
        parts when they hold the same :class:`Partition`.
        """
        self.check_compatible(other)
        self._adopt_metadata(other)
        if not self._holds_comoment() and other._holds_comoment():
            self.comoment_precision = other.comoment_precision
        dev = self.device
        t = other.num_types
        if t:
            slots = self._slots_for(other._slot_ids.to(dev))
            rows = {f.name: other._a[f.name][:, :t].to(dev) for f in self._fields(TYPE_FIELDS)}
            for li in range(len(self.layers)):
                self._merge_types(li, slots, rows["counts"][li], rows["means"][li], rows["m2"][li])
            for f in self._fields(TYPE_FIELDS):
                if f.merge == SUM:
                    self._a[f.name].index_add_(1, slots, rows[f.name])
        if self.holds_layer_state:
            o = {f.name: other._a[f.name].to(dev) for f in LAYER_FIELDS}
            for li in range(len(self.layers)):
                self._merge_layer(li, o["n"][li], o["mean"][li], o["comoment"][li])
                if self.max_positions:
                    counts = o["position_counts"][li]
                    sums = o["position_means"][li] * counts.to(_F64).unsqueeze(-1)
                    self._merge_positions(li, counts, sums)
            for f in LAYER_FIELDS:
                if f.merge == SUM:
                    self._a[f.name] += o[f.name]
        return self

    # ------------------------------------------------------------- views
    def _order(self) -> torch.Tensor:
        return torch.argsort(self._slot_ids)

    def layer(self, layer: int) -> LayerMoments:
        """Numpy float64 view of hidden-state layer ``layer`` (an HF index, not a position).

        The types with a count in this layer, sorted by id. A part without the per-layer
        state (:attr:`holds_layer_state` False) shows n = 0 and zero per-layer arrays.
        """
        if layer not in self.layers:
            raise KeyError(f"layer {layer} was not measured; layers are {self.layers}")
        li = self.layers.index(layer)
        order = self._order()
        sel = order[self._a["counts"][li, : self.num_types][order] > 0]
        views: dict[str, Any] = {
            f.name: np.zeros(f.shape(1, 0, self.dim, self.max_positions)[1:], f.numpy_dtype)
            for f in LAYER_FIELDS
        }
        for f in self._fields():
            a = self._a[f.name][li]
            views[f.name] = (a.index_select(0, sel) if f.per_type else a).detach().cpu().numpy()
        for f in LAYER_FIELDS:
            if not f.tail:
                views[f.name] = int(views[f.name])
        return LayerMoments(
            layer=layer,
            type_ids=self._slot_ids[sel].cpu().numpy(),
            clip_dims=None if self.clip_dims is None else tuple(self.clip_dims),
            **views,
        )

    def token_count(self) -> int:
        """Tokens counted (in the first layer; every layer counts the same finite tokens).

        For a part without the per-layer state: the tokens of its types (its token range).
        """
        if self.holds_layer_state:
            return int(self._a["n"][0])
        return int(self._a["counts"][0, : self.num_types].sum())

    # -------------------------------------------------------- persistence
    def _header_fields(self) -> dict[str, Any]:
        fields = super()._header_fields()
        fields["partition"] = None if self.partition is None else self.partition.to_json()
        return fields

    def state_dict(self) -> dict[str, np.ndarray]:
        """The held :data:`FIELDS` plus ``type_ids``: types sorted by id, unused slots dropped,
        all on CPU."""
        order = self._order()
        t = self.num_types
        out = {"type_ids": self._slot_ids[order]}
        for f in self._fields():
            a = self._a[f.name]
            out[f.name] = a[:, :t][:, order] if f.per_type else a
        return {k: np.ascontiguousarray(v.detach().cpu().numpy()) for k, v in out.items()}

    def to_bytes(self, into: np.ndarray | None = None) -> bytearray | np.ndarray:
        """The safetensors file of :meth:`state_dict` (and :meth:`header`), each array
        gathered straight into its place in the file's buffer
        (:func:`~embgeom_ray.core.sketch.safetensors_into`; ``into``: a uint8 array to reuse
        as that buffer where it is large enough): serialising holds these statistics plus
        one copy of their arrays, not two (what bounds an extractor spilling under
        ``--worker-memory``)."""
        order = self._order()
        t = self.num_types
        sources = {"type_ids": (self._slot_ids, False)}
        sources |= {f.name: (self._a[f.name], f.per_type) for f in self._fields()}
        specs = {}
        for name, (a, per_type) in sources.items():
            shape = (t,) if name == "type_ids" else ((a.shape[0], t, *a.shape[2:]) if per_type else tuple(a.shape))  # fmt: skip
            specs[name] = (a.dtype, shape)

        def fill(name: str, out: torch.Tensor) -> None:
            a, per_type = sources[name]
            if name == "type_ids":
                out.copy_(a.index_select(0, order))
            elif per_type and a.device == out.device:
                torch.index_select(a[:, :t], 1, order, out=out)
            elif per_type:
                out.copy_(a[:, :t].index_select(1, order))
            else:
                out.copy_(a)

        return safetensors_into(specs, fill, {HEADER_KEY: json.dumps(self.header())}, into)

    @classmethod
    def _empty(cls, header: Mapping[str, Any], version: int, device: Any) -> EmbeddingStatistics:
        """Empty statistics with the header's fields (version 1: a whole, no partition)."""
        record = header.get("partition") if version >= 2 else None
        return cls(
            [int(x) for x in header["layers"]],
            int(header["dim"]),
            max_positions=int(header.get("max_positions", 0)),
            device=device,
            metadata=header.get("metadata"),
            initial_types=1,
            clip_dims=header.get("clip_dims"),
            comoment_precision=header.get("comoment_precision", "float64"),
            partition=None if record is None else Partition.from_json(record),
        )

    def _set_state(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Fill from :meth:`state_dict`'s arrays, each checked against :data:`FIELDS`."""
        t = int(np.asarray(arrays["type_ids"]).shape[0]) if "type_ids" in arrays else 0
        ids = check_array(arrays, "type_ids", (t,), np.int64, self.KIND)
        lo, hi = self.token_range
        if t and ((np.diff(ids) <= 0).any() or ids[0] < lo or (hi is not None and ids[-1] >= hi)):
            raise StatisticsMismatchError(
                f"statistics type_ids are not increasing ids in {_range_text((lo, hi))}"
            )
        shape = (len(self.layers), t, self.dim, self.max_positions)
        if t:
            self._slots_for(torch.from_numpy(np.array(ids)).to(self.device))  # slots 0..t-1
        # one field at a time, and the per-type rows copied straight from the (read-only)
        # arrays into their slots: a reader holds the arrays read and these statistics, not a
        # third copy of everything
        for f in self._fields():
            a = check_array(arrays, f.name, f.shape(*shape), f.numpy_dtype, self.KIND)
            if f.per_type:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # a read-only view, copied
                    self._a[f.name][:, :t] = torch.from_numpy(np.asarray(a)).to(self.device)
            else:
                self._a[f.name] = torch.from_numpy(np.array(a)).to(self.device).contiguous()

    def _fill(self, type_ids: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> None:
        """Set the arrays of these (new, empty) statistics: the per-type rows of the increasing
        ``type_ids`` and the per-layer arrays, from ``tensors`` (one per held field)."""
        t = int(type_ids.numel())
        if t:
            self._slots_for(type_ids.to(self.device))  # slots 0..t-1, in id order
        for f in self._fields():
            v = tensors[f.name].to(self.device)
            if f.per_type:
                self._a[f.name][:, :t] = v
            else:
                self._a[f.name] = v.contiguous()

    def to(self, device: str | torch.device) -> EmbeddingStatistics:
        """A copy on ``device`` (compact)."""
        return EmbeddingStatistics.from_state(self.header(), self.state_dict(), device=device)

    # ------------------------------------------------------------ partitions
    def _like(
        self, layers: Sequence[int], partition: Partition | None, initial_types: int = 1
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

        The copy's :class:`Partition` records the part; selecting everything gives a whole
        again. Parts of disjoint token ranges go back together with :meth:`combine`, and
        ``a.select(...).merge(b.select(...))`` equals ``a.merge(b).select(...)``.
        """
        want = set(self.layers if layers is None else (int(x) for x in layers))
        unknown = sorted(want - set(self.layers))
        if unknown:
            raise ValueError(f"layers {unknown} are not held; layers are {self.layers}")
        kept = [x for x in self.layers if x in want]
        lo, hi = self.token_range if token_range is None else token_range
        own_lo, own_hi = self.token_range
        outside = lo < own_lo or (own_hi is not None and (hi is None or hi > own_hi))
        if outside and lo != hi:  # an empty range is within any part (no rows)
            raise ValueError(
                f"token range {_range_text((lo, hi))} is not within the held "
                f"{_range_text(self.token_range)}"
            )
        layer_state = self.holds_layer_state if layer_state is None else bool(layer_state)
        if layer_state and not self.holds_layer_state:
            raise ValueError("these statistics hold no per-layer moments to select")
        whole = tuple(kept) == self.of_layers and (lo, hi) == (0, None) and layer_state
        part = self._like(kept, None if whole else Partition(self.of_layers, (lo, hi), layer_state))
        order = self._order()
        ids = self._slot_ids[order]
        inside = ids >= lo if hi is None else (ids >= lo) & (ids < hi)
        slots = order[inside]
        lis = torch.tensor([self.layers.index(x) for x in kept], device=self.device)
        tensors = {}
        for f in part._fields():
            a = self._a[f.name].index_select(0, lis)
            tensors[f.name] = a.index_select(1, slots) if f.per_type else a
        part._fill(ids[inside], tensors)
        return part

    @classmethod
    def load_part(
        cls,
        path: str,
        layers: Sequence[int] | None = None,
        token_range: tuple[int, int | None] = (0, None),
        *,
        layer_state: bool = True,
    ) -> EmbeddingStatistics:
        """``load(path).select(layers, token_range, layer_state=layer_state)``, reading only
        that part's bytes when ``path`` is a local file of a whole.

        Files store the types sorted by id (:meth:`state_dict`), so a token range is one
        contiguous run of rows: each per-type array is read as ``[layer, a:b]`` slices and each
        per-layer array only for the kept layers (safetensors' lazy slices). What a reducer
        holds while reading a checkpoint group is then its part, not the group. Remote URLs and
        files that are themselves parts are read whole and selected.
        """
        from safetensors import safe_open

        from ..io_utils import is_local, local_path

        url = str(path)
        if is_local(url):
            with safe_open(local_path(url), framework="numpy") as f:
                header = cls._open_header(f, url)
                if cls.check_header(header) >= 2:
                    return cls._read_part(f, header, layers, token_range, layer_state)
        return cls.load(url).select(layers, token_range, layer_state=layer_state)

    @classmethod
    def read_header(cls, path: str) -> dict[str, Any]:
        """The header of a statistics file (layers, dim, partition, metadata, …), read alone
        from a local file, else from the loaded file."""
        from safetensors import safe_open

        from ..io_utils import is_local, local_path

        url = str(path)
        if is_local(url):
            with safe_open(local_path(url), framework="numpy") as f:
                header = cls._open_header(f, url)
            cls.check_header(header)
            return header
        return cls.load(url).header()

    @classmethod
    def _open_header(cls, f: Any, url: str) -> dict[str, Any]:
        """The JSON header of an open safetensors file (``safe_open``), or a one-line error."""
        try:
            return json.loads((f.metadata() or {})[HEADER_KEY])
        except (KeyError, ValueError) as exc:
            raise StatisticsMismatchError(
                f"{url}: not an embgeom_ray {cls.KIND} artefact ({exc})"
            ) from None

    @classmethod
    def read_type_ids(cls, path: str) -> np.ndarray:
        """The increasing token ids a statistics file holds rows for, read alone from a local
        file (the other arrays stay on disk), else from the loaded file."""
        from safetensors import safe_open

        from ..io_utils import is_local, local_path

        url = str(path)
        if is_local(url):
            with safe_open(local_path(url), framework="numpy") as f:
                if "type_ids" in f.keys():
                    return f.get_tensor("type_ids")
        return cls.load(url).state_dict()["type_ids"]

    @classmethod
    def _read_part(
        cls,
        f: Any,
        header: dict[str, Any],
        layers: Sequence[int] | None,
        token_range: tuple[int, int | None],
        layer_state: bool,
    ) -> EmbeddingStatistics:
        """The part of an open safetensors file (:meth:`load_part`): of a whole, or of a part
        that holds what is asked (a token range within its own, an empty range anywhere, layers
        it holds, per-layer fields only if it holds them)."""
        record = header.get("partition")
        held_part = None if record is None else Partition.from_json(record)
        held = [int(x) for x in header["layers"]]
        of_layers = list(held_part.of_layers) if held_part else held
        want = set(held if layers is None else (int(x) for x in layers))
        unknown = sorted(want - set(held))
        if unknown:
            raise ValueError(f"layers {unknown} are not held; layers are {held}")
        kept = [x for x in held if x in want]
        lis = [held.index(x) for x in kept]
        if held_part is not None:
            (own_lo, own_hi), empty = held_part.token_range, token_range[0] == token_range[1]
            lo, hi = token_range
            if not empty and (lo < own_lo or (own_hi is not None and (hi is None or hi > own_hi))):
                raise ValueError(
                    f"token range {_range_text(token_range)} is not within the held "
                    f"{_range_text(held_part.token_range)}"
                )
            if layer_state and not held_part.layer_state:
                raise ValueError("this part holds no per-layer moments to read")
        lo, hi = token_range
        ids = f.get_tensor("type_ids")
        a = int(np.searchsorted(ids, lo, "left"))
        b = len(ids) if hi is None else int(np.searchsorted(ids, hi, "left"))
        arrays = {"type_ids": ids[a:b]}
        clip = header.get("clip_dims") is not None
        for field in FIELDS:
            if (field.clip and not clip) or (not field.per_type and not layer_state):
                continue
            lazy = f.get_slice(field.name)
            shape = lazy.get_shape()
            if field.per_type and a == b:  # no row in the range (safetensors refuses [n:n])
                arrays[field.name] = np.empty((len(lis), 0, *shape[2:]), field.numpy_dtype)
                continue
            rows = [lazy[li : li + 1, a:b] if field.per_type else lazy[li : li + 1] for li in lis]
            empty = (0, b - a, *shape[2:]) if field.per_type else (0, *shape[1:])
            arrays[field.name] = (
                np.concatenate(rows) if rows else np.empty(empty, field.numpy_dtype)
            )
        whole = kept == of_layers and (lo, hi) == (0, None) and layer_state
        part = None if whole else Partition(tuple(of_layers), (lo, hi), layer_state).to_json()
        return cls.from_state(header | {"layers": kept, "partition": part}, arrays)

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
        joint, layer_state = _joint_part(parts, layers)
        whole = tuple(layers) == of_layers and joint == (0, None) and layer_state
        out = first._like(
            layers,
            None if whole else Partition(of_layers, joint, layer_state),
            initial_types=sum(p.num_types for p in parts),
        )
        out.comoment_precision = next(
            (p.comoment_precision for p in parts if p._holds_comoment()), first.comoment_precision
        )
        dev = out.device
        for p in parts:
            out._adopt_metadata(p)
            t = p.num_types
            slots = out._slots_for(p._slot_ids.to(dev))
            for pli, layer in enumerate(p.layers):
                li = out.layers.index(layer)
                for f in out._fields():
                    if f.per_type:
                        out._a[f.name][li].index_copy_(0, slots, p._a[f.name][pli, :t].to(dev))
                    elif p.holds_layer_state:
                        out._a[f.name][li] = p._a[f.name][pli].to(dev)
        return out


def _joint_part(
    parts: Sequence[EmbeddingStatistics], layers: Sequence[int]
) -> tuple[tuple[int, int | None], bool]:
    """(token range, whether per-layer moments are held) of the union of ``parts``, after
    checking that for each of ``layers`` the parts holding it have disjoint token ranges that
    join into one range, the same for every layer, and that one of them (for every layer) or
    none (for every layer) holds its per-layer moments."""
    joint: tuple[int, int | None] | None = None
    states = []
    for layer in layers:
        holders = [p for p in parts if layer in p.layers]
        spans = sorted((p.token_range for p in holders), key=range_key)
        for (_, hi_a), (lo_b, _) in itertools.pairwise(spans):
            if hi_a is None or hi_a > lo_b:
                raise StatisticsMismatchError(
                    f"parts holding layer {layer} overlap in token ids "
                    f"({', '.join(_range_text(s) for s in spans)})"
                )
            if hi_a < lo_b:
                raise StatisticsMismatchError(
                    f"parts holding layer {layer} leave token ids [{hi_a}, {lo_b}) out"
                )
        span = (spans[0][0], spans[-1][1])
        if joint is not None and span != joint:
            raise StatisticsMismatchError(
                f"layer {layer}'s parts hold token ids {_range_text(span)}, "
                f"layer {layers[0]}'s {_range_text(joint)}"
            )
        joint = span
        states.append(sum(p.holds_layer_state for p in holders))
    if joint is None or max(states) > 1 or min(states) != max(states):
        raise StatisticsMismatchError(
            "each layer's per-layer moments must come from one part (or, for every "
            "layer, from none); parts holding them, by layer: "
            + ", ".join(f"{x}: {s}" for x, s in zip(layers, states, strict=True))
        )
    return joint, states[0] == 1
