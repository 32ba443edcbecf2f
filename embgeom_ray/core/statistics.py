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

Only token types actually seen occupy memory (a slot table grows by doubling). Everything is
float64: each batch is cast to float64 on its device and shifted by the layer's running mean
c; per type it is reduced centred on the type's own batch mean (two passes), per layer the
co-moment is (X − c)ᵀ(X − c) − n m'm'ᵀ, which cancels only O(||μ_b − μ||²/V) digits instead
of ||μ||²/V (with ``comoment_precision="float32"``, the job's default, that one product runs
in float32 on the shifted rows and is accumulated in float64). Batch moments are merged into
the running ones with the pairwise update of Chan, Golub & LeVeque (1979)::

    n = n_a + n_b,  δ = μ_b − μ_a,  μ = μ_a + δ n_b/n,
    M2 = M2_a + M2_b + ||δ||² n_a n_b / n,   C = C_a + C_b + δδᵀ n_a n_b / n.

:meth:`EmbeddingStatistics.merge` uses the same update, so folding a corpus batch by batch,
shard by shard or run by run gives the same moments up to float64 rounding, whatever the
order; the result keeps the precision of a two-pass float64 computation even when
||μ||² / V ~ 1e8 (GPT-2's massive activations), where the textbook E||x||² − ||μ||² in float32
is wrong by orders of magnitude.

The type is a sketch in the Apache DataSketches sense: ``update`` / ``merge`` /
``save``-``load`` (safetensors, no pickle) / read-only numpy views (:meth:`layer`). Metrics are
pure functions of those views, in :mod:`embgeom_ray.core.metrics`.
"""

from __future__ import annotations

import io
import itertools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from safetensors.numpy import load as st_load_bytes
from safetensors.numpy import save as st_save_bytes

from ..errors import StatisticsMismatchError

FORMAT = "embgeom_ray.statistics"
FORMAT_VERSION = 1
_F64 = torch.float64
#: rows per block of the fold on a CPU: a block's float64 copy (8·d bytes a row) and scratch
#: stay in the cache while every per-row pass runs over it (~1.7x faster than whole batches
#: at d = 384); on a GPU the fold takes the whole batch at once.
CPU_ROW_BLOCK = 1024


@dataclass(frozen=True)
class LayerMoments:
    """Read-only float64 numpy view of one layer's moments, types sorted by token id."""

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
    n_a: torch.Tensor, mean_a: torch.Tensor, n_b: torch.Tensor, mean_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (n, mean, Δm2) of merging rows (n_a, mean_a) with (n_b, mean_b).

    Δm2 = ||δ||² n_a n_b / n is the cross term to add to M2_a + M2_b. Rows with n = 0 stay 0.
    """
    n = n_a + n_b
    n_f = n.to(_F64).clamp_min(1.0)
    delta = mean_b - mean_a
    w_b = (n_b.to(_F64) / n_f).unsqueeze(-1)
    mean = mean_a + delta * w_b
    cross = (delta * delta).sum(-1) * (n_a.to(_F64) * n_b.to(_F64) / n_f)
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


def _column_blocks(d: int, block: int) -> list[int]:
    """Edges of about ``block``-wide column blocks of d columns (at least one block)."""
    k = max(1, round(d / block))
    return [d * i // k for i in range(k + 1)]


def add_gram_upper(upper: torch.Tensor, xs: torch.Tensor, block: int = 96) -> None:
    """Add the upper block triangle of XᵀX (rows of ``xs``, multiplied in its dtype) to ``upper``.

    With the columns split into k blocks X = [X_1 … X_k] of about ``block`` columns, block row
    i is X_iᵀ [X_i … X_k]: (k + 1)/(2k) of the multiply-adds of ``xs.T @ xs`` (62% for
    d = 384, 51% for d = 4096) in k large matrix products, each added to ``upper`` (float64)
    in its own precision. Blocks strictly below the diagonal are left as they are;
    :func:`symmetric_from_upper` makes the matrix.
    """
    for lo, hi in itertools.pairwise(_column_blocks(xs.shape[1], block)):
        upper[lo:hi, lo:] += xs[:, lo:hi].T @ xs[:, lo:]  # block row: (hi − lo, d − lo)


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
    add_gram_upper(upper, xs, block)
    return symmetric_from_upper(upper)


def extreme_counts(x: torch.Tensor, which: str, scratch: torch.Tensor) -> torch.Tensor:
    """How many rows of ``x`` (n × d, finite) have their first maximum (``which="max"``) or
    minimum (``"min"``) in each dimension: ``bincount(x.argmax(1), minlength=d)`` (Luo 2020).

    Computed as the column sums of the 0/1 matrix ``x == rowmax(x)`` (written into the float32
    ``scratch`` of x's shape, whatever x's dtype): vectorised passes, ~4x faster on CPUs than
    the index-tracking ``argmax``. A row whose extreme value is tied between dimensions
    would count twice there; then (rarely: the sums exceed n) the exact argmax is used.
    """
    n, d = x.shape
    ext = x.amax(dim=1, keepdim=True) if which == "max" else x.amin(dim=1, keepdim=True)
    hits = torch.eq(x, ext, out=scratch).sum(dim=0)
    if int(hits.sum()) == n and n < 2**24:  # one extreme per row: exact 0/1 sums
        return hits.to(torch.int64)
    first = x.argmax(dim=1) if which == "max" else x.argmin(dim=1)
    return torch.bincount(first, minlength=d)


class EmbeddingStatistics:
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
        comoment_precision: "float64" (this class's default) or "float32" (the job's
            default, ``--comoment-precision``): the dtype of the per-batch product
            (X − c)ᵀ(X − c), the fold's one matrix product (float32 is ~2x faster on CPUs,
            up to 32x on GPUs with slow float64). The rows are shifted by the layer's running
            mean c (rounded to float32, an exact shift) and the result is accumulated in
            float64, so float32 costs ~1e-6 relative error on covariance entries (IsoScore,
            PCA spectrum, per-dimension std), nothing elsewhere.
    """

    #: metadata keys that must agree for two statistics to be merged.
    IDENTITY_KEYS = ("model_fingerprint", "tokenizer_fingerprint", "keep_special")

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
    ) -> None:
        if not layers:
            raise ValueError("at least one layer is required")
        if len(set(layers)) != len(layers):
            raise ValueError(f"layers must be distinct, got {list(layers)}")
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        if max_positions < 0:
            raise ValueError(f"max_positions must be >= 0, got {max_positions}")
        self.layers: list[int] = [int(x) for x in layers]
        self.dim = int(dim)
        self.max_positions = int(max_positions)
        self.device = torch.device(device)
        self.metadata: dict[str, str] = {str(k): str(v) for k, v in (metadata or {}).items()}
        self.clip_dims: list[int] | None = (
            None if clip_dims is None else sorted({int(c) for c in clip_dims})
        )
        if comoment_precision not in ("float64", "float32"):
            raise ValueError(
                f"comoment_precision must be float64 or float32, got {comoment_precision!r}"
            )
        self.comoment_precision = comoment_precision
        if self.clip_dims and not all(0 <= c < dim for c in self.clip_dims):
            raise ValueError(f"clip_dims {self.clip_dims} outside 0..{dim - 1}")
        n_layers, d, dev = len(self.layers), self.dim, self.device
        cap = max(int(initial_types), 1)
        # token id -> slot (-1: unseen); grown on demand
        self._id_to_slot = torch.full((0,), -1, dtype=torch.int64, device=dev)
        self._slot_ids = torch.empty(0, dtype=torch.int64, device=dev)
        self._counts = torch.zeros(n_layers, cap, dtype=torch.int64, device=dev)
        self._means = torch.zeros(n_layers, cap, d, dtype=_F64, device=dev)
        self._m2 = torch.zeros(n_layers, cap, dtype=_F64, device=dev)
        self._unit_sums = torch.zeros(n_layers, cap, d, dtype=_F64, device=dev)
        n_clip = cap if self.clip_dims is not None else 0
        self._clip_unit_sums = torch.zeros(n_layers, n_clip, d, dtype=_F64, device=dev)
        self._n = torch.zeros(n_layers, dtype=torch.int64, device=dev)
        self._mean = torch.zeros(n_layers, d, dtype=_F64, device=dev)
        self._comoment = torch.zeros(n_layers, d, d, dtype=_F64, device=dev)
        self._argmax = torch.zeros(n_layers, d, dtype=torch.int64, device=dev)
        self._argmin = torch.zeros(n_layers, d, dtype=torch.int64, device=dev)
        p = self.max_positions
        self._pos_counts = torch.zeros(n_layers, p, dtype=torch.int64, device=dev)
        self._pos_means = torch.zeros(n_layers, p, d, dtype=_F64, device=dev)
        self._nonfinite = torch.zeros(n_layers, dtype=torch.int64, device=dev)
        self._buffers: dict[str, torch.Tensor] = {}  # per-batch scratch (see _workspace)

    # ------------------------------------------------------------------ slots
    @property
    def num_types(self) -> int:
        """Number of distinct token types seen (in any layer)."""
        return int(self._slot_ids.numel())

    def _capacity(self) -> int:
        return int(self._counts.shape[1])

    def _grow(self, needed: int) -> None:
        cap = self._capacity()
        if needed <= cap:
            return
        new_cap = max(needed, 2 * cap)
        extra = new_cap - cap

        def pad(t: torch.Tensor) -> torch.Tensor:
            shape = list(t.shape)
            shape[1] = extra
            return torch.cat([t, torch.zeros(shape, dtype=t.dtype, device=t.device)], dim=1)

        self._counts = pad(self._counts)
        self._means = pad(self._means)
        self._m2 = pad(self._m2)
        self._unit_sums = pad(self._unit_sums)
        if self.clip_dims is not None:
            self._clip_unit_sums = pad(self._clip_unit_sums)

    def _slots_for(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots of the distinct token ids ``ids`` (int64, on device), assigning new ones."""
        if ids.numel() == 0:
            return ids
        if int(ids.min()) < 0:
            raise ValueError("token ids must be non-negative")
        top = int(ids.max()) + 1
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
        usum_b: torch.Tensor | None = None,
        clip_usum_b: torch.Tensor | None = None,
    ) -> None:
        """Chan-merge batch (n, mean, M2) per type into ``slots``; add unit sums if given."""
        counts, means, m2 = self._counts[li], self._means[li], self._m2[li]
        n_a = counts.index_select(0, slots)
        n, mean, cross = _chan_merge_mean_m2(n_a, means.index_select(0, slots), n_b, mean_b)
        counts.index_copy_(0, slots, n)
        means.index_copy_(0, slots, mean)
        m2.index_add_(0, slots, m2_b + cross)
        if usum_b is not None:
            self._unit_sums[li].index_add_(0, slots, usum_b)
        if clip_usum_b is not None:
            self._clip_unit_sums[li].index_add_(0, slots, clip_usum_b)

    def _merge_layer(
        self, li: int, n_b: torch.Tensor, mean_b: torch.Tensor, c_b: torch.Tensor
    ) -> None:
        n_a = self._n[li]
        if int(n_b) == 0:
            return
        delta = mean_b - self._mean[li]
        n = n_a + n_b
        w = (n_a.to(_F64) * n_b.to(_F64)) / n.to(_F64)
        self._comoment[li] += c_b + torch.outer(delta, delta) * w
        self._mean[li] += delta * (n_b.to(_F64) / n.to(_F64))
        self._n[li] = n

    def _merge_positions(self, li: int, counts_b: torch.Tensor, sums_b: torch.Tensor) -> None:
        """Merge per-position counts and *sums* (means need no M2: plain weighted update)."""
        n = self._pos_counts[li] + counts_b
        seen = n > 0
        upd = (sums_b - counts_b.to(_F64).unsqueeze(-1) * self._pos_means[li]) / n.to(
            _F64
        ).clamp_min(1.0).unsqueeze(-1)
        self._pos_means[li] = torch.where(seen.unsqueeze(-1), self._pos_means[li] + upd, 0.0)
        self._pos_counts[li] = n

    # --------------------------------------------------------------- update
    @torch.no_grad()
    def update(
        self,
        hidden: Sequence[torch.Tensor] | torch.Tensor,
        token_ids: torch.Tensor,
        keep: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
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
        """
        if isinstance(hidden, torch.Tensor) and hidden.dim() == 4:
            hidden = list(hidden.unbind(0))
        if len(hidden) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} hidden-state tensors, got {len(hidden)}")
        shape = tuple(token_ids.shape)
        if keep is None:
            keep = torch.ones(shape, dtype=torch.bool, device=token_ids.device)
        if tuple(keep.shape) != shape:
            raise ValueError(f"keep mask shape {tuple(keep.shape)} != token_ids shape {shape}")
        for li, h in enumerate(hidden):
            if tuple(h.shape[:-1]) != shape or h.shape[-1] != self.dim:
                raise ValueError(
                    f"hidden state {li} has shape {tuple(h.shape)}, expected {(*shape, self.dim)}"
                )
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
            if int(pos.max()) >= self.max_positions or int(pos.min()) < 0:
                raise ValueError(
                    f"position {int(pos.max())} outside 0..{self.max_positions - 1}; "
                    "raise max_positions to the job's max_length"
                )
        # the grouping of rows by type is the same in every layer: computed once per batch,
        # and the rows are taken in its order
        groups, order = self._group(ids, pos)
        rows = rows.index_select(0, order)
        for li, h in enumerate(hidden):
            kept = h.to(dev).reshape(-1, self.dim).index_select(0, rows)  # the model's dtype
            self._fold_layer(li, kept, groups)

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
        return _Groups(slots, inv, row_slots, counts, pos, pos_counts)

    def _workspace(self, name: str, n: int, dtype: torch.dtype = _F64) -> torch.Tensor:
        """An (n, d) scratch buffer, reused across batches (no per-batch allocation)."""
        key = f"{name}:{dtype}"
        buf = self._buffers.get(key)
        if buf is None or buf.shape[0] < n:
            buf = torch.empty(max(n, 1024), self.dim, dtype=dtype, device=self.device)
            self._buffers[key] = buf
        return buf[:n]

    def _finite_rows(self, li: int, kept: torch.Tensor, g: _Groups) -> tuple[torch.Tensor, _Groups]:
        """``kept`` and ``g`` without the rows that hold a NaN/inf (counted in ``nonfinite``).

        One float32 reduction tells whether anything is NaN/inf; only then are the rows
        found (a finite sum that overflows float32 just takes the exact route).
        """
        if bool(torch.isfinite(kept.sum(dtype=torch.float32))):
            return kept, g
        finite = torch.isfinite(kept).all(dim=1)
        if bool(finite.all()):
            return kept, g
        self._nonfinite[li] += int((~finite).sum())
        pos = None if g.pos is None else g.pos[finite]
        return kept[finite], self._groups_of(g.row_slots[finite], pos)

    def _row_blocks(self, n: int) -> list[tuple[int, int]]:
        """Row ranges the fold walks through: :data:`CPU_ROW_BLOCK` rows on a CPU, else all."""
        step = CPU_ROW_BLOCK if self.device.type == "cpu" else max(n, 1)
        return [(a, min(a + step, n)) for a in range(0, n, step)]

    def _fold_layer(self, li: int, kept: torch.Tensor, g: _Groups) -> None:
        """Fold the kept rows ``kept`` (n, d, the model's dtype) of layer slot ``li``.

        Two passes over blocks of rows (:meth:`_row_blocks`), each block converted to float64
        where it is used: (1) tails, per-type sums, unit-vector sums, position sums; (2) per
        type the deviations from the type's batch mean (M2), and the co-moment product. On a
        CPU a block's float64 copy and scratch stay in cache across the passes made over it.
        """
        kept, g = self._finite_rows(li, kept, g)
        n, d, u = kept.shape[0], self.dim, g.slots.numel()
        if n == 0:
            return
        dev = kept.device
        blocks = self._row_blocks(n)
        block = blocks[0][1]  # rows of the first (largest) block: the scratch buffers' size
        hits = self._workspace("hits", block, torch.float32)  # 0/1 sums, exact below 2^24 rows
        mean_b = torch.zeros(u, d, dtype=_F64, device=dev)
        ps = None if g.pos is None else torch.zeros(self.max_positions, d, dtype=_F64, device=dev)
        for a, b in blocks:
            k = kept[a:b]
            self._argmax[li] += extreme_counts(k, "max", hits[: b - a])
            self._argmin[li] += extreme_counts(k, "min", hits[: b - a])
            x = self._workspace("x", block)[: b - a].copy_(k)  # float64 from here on
            mean_b.index_add_(0, g.inv[a:b], x)
            self._add_unit_sums(self._unit_sums[li], x, g.row_slots[a:b], None)
            if self.clip_dims is not None:
                self._add_unit_sums(self._clip_unit_sums[li], x, g.row_slots[a:b], self.clip_dims)
            if ps is not None:
                ps.index_add_(0, g.pos[a:b], x)
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
        c = self._mean[li].clone() if int(self._n[li]) > 0 else x_mean
        f32 = self.comoment_precision == "float32"
        if f32:
            c = c.to(torch.float32).to(_F64)
            c32 = c.to(torch.float32)
        m2_b = torch.zeros(u, dtype=_F64, device=dev)
        upper = torch.zeros(d, d, dtype=_F64, device=dev)
        for a, b in blocks:
            x = self._workspace("x", block)[: b - a].copy_(kept[a:b])
            dev_rows = self._workspace("tmp", block)[: b - a]
            torch.index_select(mean_b, 0, g.inv[a:b], out=dev_rows).sub_(x)
            m2_b.index_add_(0, g.inv[a:b], torch.linalg.vector_norm(dev_rows, dim=1).square_())
            if f32:
                xs = torch.sub(
                    kept[a:b], c32, out=self._workspace("xs", block, torch.float32)[: b - a]
                )
            else:
                xs = x.sub_(c)  # x is not needed any more: centre in place
            add_gram_upper(upper, xs)
        self._merge_types(li, g.slots, g.counts, mean_b, m2_b)
        m_s = x_mean - c  # mean of x' (small)
        c_b = symmetric_from_upper(upper) - torch.outer(m_s, m_s) * n
        self._merge_layer(li, torch.tensor(n, dtype=torch.int64, device=dev), c + m_s, c_b)

    def _add_unit_sums(
        self,
        sums: torch.Tensor,
        x: torch.Tensor,
        row_slots: torch.Tensor,
        clip_dims: list[int] | None,
    ) -> None:
        """Add Σ x/||x|| per type into ``sums`` (slots × d) straight from the rows ``x`` (each
        to its slot in ``row_slots``); with ``clip_dims``, of x with those dimensions zeroed."""
        unit = self._workspace("tmp", x.shape[0])
        if clip_dims is None:
            norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
            torch.div(x, norms.clamp_min_(torch.finfo(_F64).tiny), out=unit)
        else:
            unit.copy_(x)[:, clip_dims] = 0.0
            norms = torch.linalg.vector_norm(unit, dim=1, keepdim=True)
            unit.div_(norms.clamp_min_(torch.finfo(_F64).tiny))
        sums.index_add_(0, row_slots, unit)

    # ---------------------------------------------------------------- merge
    def check_compatible(self, other: EmbeddingStatistics) -> None:
        """Raise :class:`StatisticsMismatchError` unless ``other`` measures the same thing."""
        problems = []
        if other.layers != self.layers:
            problems.append(f"layers {other.layers} != {self.layers}")
        if other.dim != self.dim:
            problems.append(f"dim {other.dim} != {self.dim}")
        if other.clip_dims != self.clip_dims:
            problems.append(f"clip_dims {other.clip_dims} != {self.clip_dims}")
        if other.max_positions != self.max_positions:
            problems.append(f"max_positions {other.max_positions} != {self.max_positions}")
        for key in self.IDENTITY_KEYS:
            a, b = self.metadata.get(key), other.metadata.get(key)
            if a is not None and b is not None and a != b:
                problems.append(f"{key} {b!r} != {a!r}")
        if problems:
            raise StatisticsMismatchError(
                "cannot merge statistics of different measurements: " + "; ".join(problems)
            )

    @torch.no_grad()
    def merge(self, other: EmbeddingStatistics) -> EmbeddingStatistics:
        """Merge ``other`` into ``self`` (in place; returns ``self``). Associative, commutative."""
        self.check_compatible(other)
        for key, value in other.metadata.items():
            self.metadata.setdefault(key, value)
        t = other.num_types
        if t:
            ids = other._slot_ids.to(self.device)
            slots = self._slots_for(ids)
            for li in range(len(self.layers)):
                self._merge_types(
                    li,
                    slots,
                    other._counts[li, :t].to(self.device),
                    other._means[li, :t].to(self.device),
                    other._m2[li, :t].to(self.device),
                    other._unit_sums[li, :t].to(self.device),
                    None
                    if self.clip_dims is None
                    else other._clip_unit_sums[li, :t].to(self.device),
                )
        for li in range(len(self.layers)):
            self._merge_layer(
                li,
                other._n[li].to(self.device),
                other._mean[li].to(self.device),
                other._comoment[li].to(self.device),
            )
            if self.max_positions:
                sums = other._pos_means[li].to(self.device) * other._pos_counts[li].to(
                    self.device, _F64
                ).unsqueeze(-1)
                self._merge_positions(li, other._pos_counts[li].to(self.device), sums)
        self._argmax += other._argmax.to(self.device)
        self._argmin += other._argmin.to(self.device)
        self._nonfinite += other._nonfinite.to(self.device)
        return self

    # ------------------------------------------------------------- views
    def _order(self) -> torch.Tensor:
        return torch.argsort(self._slot_ids)

    def layer(self, layer: int) -> LayerMoments:
        """Numpy float64 view of hidden-state layer ``layer`` (an HF index, not a position)."""
        if layer not in self.layers:
            raise KeyError(f"layer {layer} was not measured; layers are {self.layers}")
        li = self.layers.index(layer)
        order = self._order()
        counts = self._counts[li, : self.num_types][order]
        present = counts > 0
        sel = order[present]

        def np_(t: torch.Tensor) -> np.ndarray:
            return t.detach().cpu().numpy()

        return LayerMoments(
            layer=layer,
            type_ids=np_(self._slot_ids[sel]),
            counts=np_(self._counts[li, sel]),
            means=np_(self._means[li, sel]),
            m2=np_(self._m2[li, sel]),
            unit_sums=np_(self._unit_sums[li, sel]),
            n=int(self._n[li]),
            mean=np_(self._mean[li]),
            comoment=np_(self._comoment[li]),
            argmax_counts=np_(self._argmax[li]),
            argmin_counts=np_(self._argmin[li]),
            position_counts=np_(self._pos_counts[li]),
            position_means=np_(self._pos_means[li]),
            nonfinite=int(self._nonfinite[li]),
            clip_dims=None if self.clip_dims is None else tuple(self.clip_dims),
            clip_unit_sums=None if self.clip_dims is None else np_(self._clip_unit_sums[li, sel]),
        )

    def token_count(self) -> int:
        """Tokens counted (in the first layer; every layer counts the same finite tokens)."""
        return int(self._n[0])

    # -------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, np.ndarray]:
        """Compact arrays (types sorted by id, unused slots dropped), all on CPU."""
        order = self._order()

        def np_(t: torch.Tensor) -> np.ndarray:
            return np.ascontiguousarray(t.detach().cpu().numpy())

        t = self.num_types
        extra = {}
        if self.clip_dims is not None:
            extra["clip_unit_sums"] = np_(self._clip_unit_sums[:, :t][:, order])
        return extra | {
            "type_ids": np_(self._slot_ids[order]),
            "counts": np_(self._counts[:, :t][:, order]),
            "means": np_(self._means[:, :t][:, order]),
            "m2": np_(self._m2[:, :t][:, order]),
            "unit_sums": np_(self._unit_sums[:, :t][:, order]),
            "n": np_(self._n),
            "mean": np_(self._mean),
            "comoment": np_(self._comoment),
            "argmax_counts": np_(self._argmax),
            "argmin_counts": np_(self._argmin),
            "position_counts": np_(self._pos_counts),
            "position_means": np_(self._pos_means),
            "nonfinite": np_(self._nonfinite),
        }

    def header(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "layers": self.layers,
            "dim": self.dim,
            "max_positions": self.max_positions,
            "clip_dims": self.clip_dims,
            "comoment_precision": self.comoment_precision,
            "metadata": self.metadata,
        }

    def to_bytes(self) -> bytes:
        """Serialize to safetensors bytes (header JSON in the safetensors metadata)."""
        return st_save_bytes(self.state_dict(), metadata={"embgeom_ray": json.dumps(self.header())})

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically to a local path or fsspec URL (temporary name, then rename)."""
        from ..io_utils import atomic_write_bytes

        atomic_write_bytes(str(path), self.to_bytes())

    @classmethod
    def from_bytes(cls, data: bytes, *, device: str | torch.device = "cpu") -> EmbeddingStatistics:
        header = _read_header(data)
        arrays = st_load_bytes(data)
        return cls.from_state(header, arrays, device=device)

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], *, device: str | torch.device = "cpu"
    ) -> EmbeddingStatistics:
        import fsspec

        with fsspec.open(str(path), "rb") as f:
            data = f.read()
        try:
            return cls.from_bytes(data, device=device)
        except StatisticsMismatchError as exc:
            raise StatisticsMismatchError(f"{path}: {exc}") from None

    @classmethod
    def from_state(
        cls,
        header: Mapping[str, Any],
        arrays: Mapping[str, np.ndarray],
        *,
        device: str | torch.device = "cpu",
    ) -> EmbeddingStatistics:
        """Rebuild from :meth:`header` and :meth:`state_dict`, checking the schema."""
        if header.get("format") != FORMAT:
            raise StatisticsMismatchError(
                f"not an embgeom_ray statistics artefact: {header!r:.200}"
            )
        if int(header.get("version", -1)) != FORMAT_VERSION:
            raise StatisticsMismatchError(
                f"statistics format version {header.get('version')} is not supported "
                f"(this embgeom_ray reads version {FORMAT_VERSION})"
            )
        layers, d, p = list(header["layers"]), int(header["dim"]), int(header["max_positions"])
        n_layers = len(layers)
        t = int(np.asarray(arrays["type_ids"]).shape[0])
        expected = {
            "type_ids": (t,),
            "counts": (n_layers, t),
            "means": (n_layers, t, d),
            "m2": (n_layers, t),
            "unit_sums": (n_layers, t, d),
            "n": (n_layers,),
            "mean": (n_layers, d),
            "comoment": (n_layers, d, d),
            "argmax_counts": (n_layers, d),
            "argmin_counts": (n_layers, d),
            "position_counts": (n_layers, p),
            "position_means": (n_layers, p, d),
            "nonfinite": (n_layers,),
        }
        clip_dims = header.get("clip_dims")
        if clip_dims is not None:
            expected["clip_unit_sums"] = (n_layers, t, d)
        for key, shape in expected.items():
            if key not in arrays:
                raise StatisticsMismatchError(f"statistics artefact lacks array {key!r}")
            if tuple(arrays[key].shape) != shape:
                raise StatisticsMismatchError(
                    f"statistics array {key!r} has shape {tuple(arrays[key].shape)}, expected {shape}"
                )
        stats = cls(
            layers,
            d,
            max_positions=p,
            device=device,
            metadata=header.get("metadata"),
            initial_types=max(t, 1),
            clip_dims=clip_dims,
            comoment_precision=header.get("comoment_precision", "float64"),
        )

        def tt(key: str) -> torch.Tensor:
            return torch.from_numpy(np.array(arrays[key])).to(stats.device)

        ids = tt("type_ids").long()
        if t:
            stats._slots_for(ids)  # slots 0..t-1 in id order
            stats._counts[:, :t] = tt("counts")
            stats._means[:, :t] = tt("means")
            stats._m2[:, :t] = tt("m2")
            stats._unit_sums[:, :t] = tt("unit_sums")
            if clip_dims is not None:
                stats._clip_unit_sums[:, :t] = tt("clip_unit_sums")
        stats._n = tt("n").long()
        stats._mean = tt("mean")
        stats._comoment = tt("comoment")
        stats._argmax = tt("argmax_counts").long()
        stats._argmin = tt("argmin_counts").long()
        stats._pos_counts = tt("position_counts").long()
        stats._pos_means = tt("position_means")
        stats._nonfinite = tt("nonfinite").long()
        return stats

    def to(self, device: str | torch.device) -> EmbeddingStatistics:
        """A copy on ``device`` (compact)."""
        return EmbeddingStatistics.from_state(self.header(), self.state_dict(), device=device)


def _read_header(data: bytes) -> dict[str, Any]:
    """The JSON header stored in a safetensors file's metadata."""
    if len(data) < 8:
        raise StatisticsMismatchError("statistics artefact is empty or truncated")
    size = int.from_bytes(data[:8], "little")
    try:
        raw = json.loads(io.BytesIO(data[8 : 8 + size]).read().decode("utf-8"))
        return json.loads(raw["__metadata__"]["embgeom_ray"])
    except (ValueError, KeyError, UnicodeDecodeError) as exc:
        raise StatisticsMismatchError(f"not an embgeom_ray statistics artefact ({exc})") from None
