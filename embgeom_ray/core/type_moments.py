"""The per-type part of the statistics: moments of every token type seen, in slots that grow.

Per layer l and token type t (a token id), :class:`TypeMoments` holds the count n_t, the mean
μ_t, M2_t = Σ_i ||x_i − μ_t||² and the unit-vector sum U_t = Σ_i x_i/||x_i|| (exact cosine
metrics, Ethayarajh 2019), and with ``clip_dims`` the same sum of the clipped vectors x' (those
dimensions set to 0; Luo 2020, Luo et al. 2021): the per-type :data:`FIELDS
<embgeom_ray.core.statistics_fields.FIELDS>`.

Only types actually seen occupy memory: each array has one row (slot) per type, in the order
the types were first seen, and a table maps token ids to slots. The arrays grow by doubling,
or, under a byte budget, once to the budget's slots and past them only by what a batch needs
(:meth:`TypeMoments.fit`); new slots are zeroed only when assigned, so capacity never used is
never touched (on a CPU its pages are not even resident). :meth:`TypeMoments.clear` forgets
every type and keeps the memory.

A batch's (or another sketch's) moments (n_b, μ_b, M2_b) per type are merged into the held
(n_a, μ_a, M2_a) with the pairwise update of Chan, Golub & LeVeque (1979)::

    n = n_a + n_b,  δ = μ_b − μ_a,  μ = μ_a + δ n_b/n,  M2 = M2_a + M2_b + ||δ||² n_a n_b / n,

and the unit-vector sums are added.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from . import segment_sums
from .fold_kernels import fused_on, run_fused
from .group_sums import GroupMatrix
from .statistics_fields import SUM, TYPE_FIELDS

_F64 = torch.float64
_I64 = torch.int64

#: ``workspace(name, rows)``: an (rows, d) float64 scratch buffer called ``name``, reused
#: across batches (the statistics' own, so that every scratch buffer is counted in one place)
Workspace = Callable[[str, int], torch.Tensor]


def chan_merge_mean_m2(
    n_a: torch.Tensor,
    mean_a: torch.Tensor,
    n_b: torch.Tensor,
    mean_b: torch.Tensor,
    scratch: torch.Tensor,
    n_b_f: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (n, mean, Δm2) of merging rows (n_a, mean_a) with (n_b, mean_b) (``n_b_f``:
    n_b in float64 where the caller has it: a batch's counts serve every layer).

    Δm2 = ||δ||² n_a n_b / n is the cross term to add to M2_a + M2_b. Rows with n = 0 stay 0.
    The mean is computed in place in ``mean_a`` and δ in ``scratch`` (a buffer of mean_a's
    shape): fresh (u, d) temporaries of a large batch cost page faults at every call (7x
    slower at u = 4,000 types, d = 512). Three passes over the rows: δ = mean_b − mean_a,
    mean_a += δ · n_b/n (one ``addcmul_``) and ||δ|| (one reduction).
    """
    n = n_a + n_b
    n_f = n.to(_F64).clamp_min(1.0)
    nb_f = n_b.to(_F64) if n_b_f is None else n_b_f
    w_b = (nb_f / n_f).unsqueeze(-1)
    w_ab = n_a.to(_F64) * nb_f / n_f
    delta = torch.sub(mean_b, mean_a, out=scratch)
    mean = mean_a.addcmul_(delta, w_b)
    cross = torch.linalg.vector_norm(delta, dim=-1).square_() * w_ab
    return n, mean, cross


def chan_merge_eager(
    n_a: torch.Tensor,
    mean_a: torch.Tensor,
    n_b: torch.Tensor,
    mean_b: torch.Tensor,
    n_b_f: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`chan_merge_mean_m2` without scratch or in-place writes: (n, the merged means,
    Δm2), fresh tensors, for one compiled kernel on a GPU (its caching allocator makes fresh
    outputs cheap there; on CPUs the in-place form avoids fresh pages). The same formulas."""
    n = n_a + n_b
    n_f = n.to(_F64).clamp_min(1.0)
    w_b = (n_b_f / n_f).unsqueeze(-1)
    w_ab = n_a.to(_F64) * n_b_f / n_f
    delta = mean_b - mean_a
    mean = mean_a + delta * w_b
    cross = torch.linalg.vector_norm(delta, dim=-1).square() * w_ab
    return n, mean, cross


class TypeMoments:
    """Per-type moments of ``n_layers`` layers of hidden size ``dim`` (module docstring).

    Attributes:
        fields: the per-type fields held (``clip_unit_sums`` only with ``clip``).
        arrays: those fields' arrays by name, (L, capacity, *tail) each; slots
            0..:attr:`num_types` − 1 hold the types seen, the rest is allocated, never written.
        slot_ids: (num_types,) int64, the token id of each slot.
        max_doubling: the capacity the doubling stops at (:meth:`fit`).
    """

    def __init__(
        self,
        n_layers: int,
        dim: int,
        device: torch.device,
        *,
        clip: bool,
        capacity: int,
        max_types: int | None = None,
    ) -> None:
        self.dim, self.device = dim, device
        self.fields = [f for f in TYPE_FIELDS if clip or not f.clip]
        # token id -> slot (-1: unseen); grown on demand
        self._id_to_slot = torch.full((0,), -1, dtype=_I64, device=device)
        self.slot_ids = torch.empty(0, dtype=_I64, device=device)
        #: the most distinct types there can be (None: no limit); no capacity exceeds it
        self.max_types = None if max_types is None else max(int(max_types), 1)
        cap = max(min(int(capacity), self.max_types or int(capacity)), 1)
        self.arrays: dict[str, torch.Tensor] = {
            f.name: torch.zeros(f.shape(n_layers, cap, dim, 0), dtype=f.torch_dtype, device=device)
            for f in self.fields
        }
        self.max_doubling = self.max_types or 1 << 62

    # ------------------------------------------------------------------ slots
    @property
    def num_types(self) -> int:
        """Number of distinct token types seen (in any layer)."""
        return int(self.slot_ids.numel())

    @property
    def capacity(self) -> int:
        """Slots allocated."""
        return int(self.arrays["counts"].shape[1])

    def nbytes(self) -> int:
        """Bytes of the arrays as allocated and of the slots' ids."""
        arrays = [*self.arrays.values(), self.slot_ids]
        return int(sum(t.numel() * t.element_size() for t in arrays))

    def row_bytes(self) -> int:
        """Bytes of one slot's rows across the arrays."""
        return sum(
            t.element_size() * t.numel() // max(t.shape[1], 1) for t in self.arrays.values()
        )

    def order(self) -> torch.Tensor:
        """The slots in increasing token id."""
        return torch.argsort(self.slot_ids)

    def fit(self, slots: int) -> None:
        """Allocate ``slots`` slots now (at most :attr:`max_types`) and stop the doubling
        there: past them the arrays grow only by what is needed."""
        slots = min(slots, self.max_types or slots)
        self.max_doubling = slots
        self.grow(slots)

    def clear(self) -> None:
        """Forget every type, keeping the arrays (the next types take the same slots)."""
        self._id_to_slot[self.slot_ids] = -1
        self.slot_ids = self.slot_ids[:0]

    def grow(self, needed: int) -> None:
        """At least ``needed`` slots: twice the capacity (at most :attr:`max_doubling`), or
        ``needed`` if more."""
        cap = self.capacity
        if needed <= cap:
            return
        new_cap = max(needed, min(2 * cap, max(cap, self.max_doubling)))
        for name, t in self.arrays.items():
            # a field at a time: the old and the grown array. The new slots are not zeroed
            # here but when they are assigned (:meth:`slots_for`): capacity never used is
            # never touched (no zeroing, no pages faulted in)
            grown = torch.empty((t.shape[0], new_cap, *t.shape[2:]), dtype=t.dtype, device=t.device)
            used = self.num_types  # slots beyond it hold nothing yet
            grown[:, :used].copy_(t[:, :used])
            self.arrays[name] = grown

    def count_new(self, ids: torch.Tensor) -> int:
        """How many of the distinct token ids ``ids`` hold no slot here (what
        :meth:`slots_for` would assign)."""
        if ids.numel() == 0:
            return 0
        ids = ids.to(self.device)
        known = ids < self._id_to_slot.numel()
        held = self._id_to_slot[ids[known]] >= 0
        return int(ids.numel() - held.sum())

    def slots_for(self, ids: torch.Tensor) -> torch.Tensor:
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
            self.grow(start + new_ids.numel())
            for a in self.arrays.values():  # the new slots start from zero
                a[:, start : start + new_ids.numel()].zero_()
            self._id_to_slot[new_ids] = new_slots
            self.slot_ids = torch.cat([self.slot_ids, new_ids])
            slots = self._id_to_slot[ids]
        return slots

    # ---------------------------------------------------------------- merging
    def merge_rows(
        self,
        li: int,
        slots: torch.Tensor,
        n_b: torch.Tensor,
        mean_b: torch.Tensor,
        m2_b: torch.Tensor,
        blocks: Sequence[tuple[int, int]],
        workspace: Workspace,
        n_b_f: torch.Tensor | None = None,
        triton: bool = False,
    ) -> None:
        """Chan-merge (n, mean, M2) per type into ``slots`` of layer slot ``li`` (``n_b_f``:
        ``n_b`` in float64, when the caller has it).

        In the row ranges ``blocks`` through reused scratch (the ``merge`` workspace, two rows
        of d per type of a block): no fresh (types × d) temporaries, whose pages are faulted
        in at every call, and a block stays in cache. With ``triton`` (the GPU fold whose pass
        1 ran in Triton), one launch in place
        (:func:`~embgeom_ray.core.segment_sums.merge_types`)."""
        a = self.arrays
        counts, means, m2 = a["counts"][li], a["means"][li], a["m2"][li]
        if triton:
            try:
                segment_sums.merge_types(means, counts, m2, slots, n_b, mean_b, m2_b)
                return
            except Exception as e:  # a kernel Triton could not build (before it wrote)
                segment_sums.give_up(e)
        for lo, hi in blocks:
            s = slots[lo:hi]
            work = workspace("merge", 2 * (hi - lo)).view(2, hi - lo, self.dim)
            n_a = counts.index_select(0, s)
            mean_a = torch.index_select(means, 0, s, out=work[0])
            nb_f = None if n_b_f is None else n_b_f[lo:hi]
            if fused_on(means.device):  # one compiled kernel (CUDA): fresh outputs, no scratch
                nb_f = n_b[lo:hi].to(_F64) if nb_f is None else nb_f
                n, mean, cross = run_fused(chan_merge_eager, n_a, mean_a, n_b[lo:hi], mean_b[lo:hi], nb_f)
            else:
                n, mean, cross = chan_merge_mean_m2(
                    n_a, mean_a, n_b[lo:hi], mean_b[lo:hi], work[1], nb_f
                )
            counts.index_copy_(0, s, n)
            means.index_copy_(0, s, mean)
            m2.index_add_(0, s, m2_b[lo:hi] + cross)

    def merge_rows_stacked(
        self,
        lo: int,
        slots: torch.Tensor,
        n_b: torch.Tensor,
        mean_b: torch.Tensor,
        m2_b: torch.Tensor,
        n_b_f: torch.Tensor,
    ) -> None:
        """:meth:`merge_rows` of layer slots ``lo``..lo + G − 1 at once, in one block: a batch
        of ``n_b`` rows per type (the same in every layer), its means ``mean_b`` (u × G × d) and
        ``m2_b`` (u × G); the merge's terms (:func:`chan_merge_eager`, broadcast over the
        layers) one compiled kernel where fused, and each array read and written once for all
        the layers."""
        a = self.arrays
        G = mean_b.shape[1]
        counts, means, m2 = (a[name][lo : lo + G] for name in ("counts", "means", "m2"))
        n_a = counts.index_select(1, slots)
        mean_a = means.index_select(1, slots)
        n, mean, cross = run_fused(
            chan_merge_eager, n_a, mean_a, n_b, mean_b.transpose(0, 1), n_b_f
        )
        counts.index_copy_(1, slots, n)
        means.index_copy_(1, slots, mean)
        m2.index_add_(1, slots, m2_b.T + cross)

    def add_unit_sums_stacked(
        self,
        lo: int,
        x: torch.Tensor,
        slots: torch.Tensor,
        by_type: GroupMatrix,
        *,
        inv_norms: torch.Tensor | None = None,
        clip_dims: list[int] | None = None,
    ) -> None:
        """:meth:`add_unit_sums` of layer slots ``lo``..lo + G − 1 at once from their rows
        stacked, ``x`` (n × G × d, float64; ``inv_norms`` (n × G) their 1/‖x‖ where known),
        by one sparse product (``by_type``) of the unit vectors, written first: a row's weight
        differs between layers, where the product takes one weight a row."""
        n, G, d = x.shape
        src = x
        if clip_dims is not None:
            src = x.clone()
            src[:, :, clip_dims] = 0.0
        if inv_norms is None or clip_dims is not None:
            norms = torch.linalg.vector_norm(src, dim=2)
            inv_norms = norms.clamp_min_(torch.finfo(_F64).tiny).reciprocal_()
        unit = src * inv_norms.unsqueeze(2)
        sums = by_type.sums(unit.view(n, G * d)).view(-1, G, d)
        name = "unit_sums" if clip_dims is None else "clip_unit_sums"
        self.arrays[name][lo : lo + G].index_add_(1, slots, sums.transpose(0, 1))

    def merge(
        self,
        other: TypeMoments,
        blocks: Sequence[tuple[int, int]],
        workspace: Workspace,
    ) -> None:
        """Merge ``other``'s types (of the same layers and fields): the moments by Chan's
        update (:meth:`merge_rows` in the row ranges ``blocks`` of its types), the sums
        added."""
        t = other.num_types
        if not t:
            return
        slots = self.slots_for(other.slot_ids.to(self.device))
        rows = {f.name: other.arrays[f.name][:, :t].to(self.device) for f in self.fields}
        for li in range(rows["counts"].shape[0]):
            self.merge_rows(
                li, slots, rows["counts"][li], rows["means"][li], rows["m2"][li], blocks, workspace
            )
        for f in self.fields:
            if f.merge == SUM:
                self.arrays[f.name].index_add_(1, slots, rows[f.name])

    def add_unit_sums(
        self,
        li: int,
        x: torch.Tensor,
        slots: torch.Tensor,
        row_slots: torch.Tensor,
        workspace: Workspace,
        *,
        clip_dims: list[int] | None = None,
        by_type: GroupMatrix | None = None,
        inv_norms: torch.Tensor | None = None,
    ) -> None:
        """Add Σ x/||x|| per type to layer slot ``li``'s ``unit_sums`` straight from the rows
        ``x``, whose slots are ``row_slots``; with ``clip_dims``, of x with those dimensions
        zeroed, to ``clip_unit_sums``. Each unit vector is x · w, w = 1/max(||x||, tiny) (a
        product: half a division's time on a CPU, and the same to float64 rounding). With
        ``by_type`` (the whole batch's groups, of the batch's distinct ``slots``), as one
        sparse product weighted by w, added to those slots; else every unit vector is
        written and added to its slot. ``inv_norms``: the rows' w when already computed
        (:func:`float64_rows <embgeom_ray.core.fold_kernels.float64_rows>`; not with
        ``clip_dims``)."""
        sums = self.arrays["unit_sums" if clip_dims is None else "clip_unit_sums"][li]
        # scratch only where rows are written (the sparse product with 1/||x|| writes none)
        unit = None if clip_dims is None and by_type is not None else workspace("tmp", len(x))
        if clip_dims is None:
            src = x
        else:
            src = unit.copy_(x)
            src[:, clip_dims] = 0.0
        if inv_norms is None:
            norms = torch.linalg.vector_norm(src, dim=1, keepdim=True)
            inv_norms = norms.clamp_min_(torch.finfo(_F64).tiny).reciprocal_().squeeze(1)
        if by_type is not None:
            sums.index_add_(0, slots, by_type.sums(src, inv_norms))
        else:
            sums.index_add_(0, row_slots, torch.mul(src, inv_norms.unsqueeze(1), out=unit))
