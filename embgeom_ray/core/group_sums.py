"""Sums of a batch's rows by group (token type, position) as sparse matrix products, for GPUs.

The fold adds each batch's float64 rows into per-group sums: Σ_{i ∈ t} x_i per token type t,
Σ_{i ∈ t} x_i/‖x_i‖ (unit vectors) and Σ_{i at p} x_i per position p. On a CPU
``index_add_`` over rows sorted by group is the fastest way. On a GPU ``index_add_`` is an
atomic scatter of every element; the same sums as one product of a sparse (groups × n) 0/1
matrix in CSR form with the (n × d) rows — G = S X, S_{t,i} = w_i if row i is in group t —
are ~1.5x faster (H200, n = 65,536 rows, d = 2,048, 32,738 types: 0.76 ms against 1.14 ms;
``python -m bench.fold --scatter``, docs/benchmarks.md), and take per-row weights w_i
(1/‖x_i‖ for the unit vectors) without writing the weighted rows first. The fold uses them where it folds
the GPU's way (``statistics.gpu_fold``) on CUDA.

:func:`split_sums` takes the same sums in float32 arithmetic only, within a stated bound and
in any order, by an error-free split of the values (docs/precision.md). The fold does not use
it: on a CPU it took 5–15× the float64 ``index_add_`` (``bench.fold --scatter-only``), and on a
GPU it reads more bytes than the float64 product of the rows' float64 copy, which the fold makes
anyway (``bash bench/gpu.sh``, step ``sums``, measures it there).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class GroupMatrix:
    """The CSR structure of S (``groups`` × n): group g holds rows ``col[crow[g]:crow[g+1]]``."""

    crow: torch.Tensor  # (groups + 1,) int64
    col: torch.Tensor  # (n,) int64, increasing within each group
    groups: int
    in_order: bool = False  # col is 0..n − 1: the rows are in group order
    labels: torch.Tensor | None = None  # (n,) int64: each row's group, where the maker had it
    #: the unweighted product's values (ones), made once a dtype: a batch's matrices serve
    #: every layer, so one fill a batch, not one a layer
    _ones: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)
    _keys: list[torch.Tensor] = field(default_factory=list, repr=False, compare=False)

    @classmethod
    def of_sorted(
        cls, counts: torch.Tensor, n: int, labels: torch.Tensor | None = None
    ) -> GroupMatrix:
        """n rows already in group order, ``counts[g]`` of them in group g (``labels``: each
        row's group, non-decreasing, where the caller has it)."""
        crow = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        arange = torch.arange(n, device=counts.device)
        return cls(crow, arange, counts.numel(), in_order=True, labels=labels)

    @classmethod
    def of_labels(cls, labels: torch.Tensor, counts: torch.Tensor) -> GroupMatrix:
        """Row i in group ``labels[i]`` (any order); ``counts = bincount(labels, minlength)``."""
        order = torch.sort(labels, stable=True).indices  # each group's rows in row order
        crow = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        return cls(crow, order, counts.numel(), labels=labels)

    def keys(self) -> torch.Tensor:
        """(n,) int64, non-decreasing: the group of each stored entry, in CSR order (the rows
        ``col`` point to); made on first use (one gather a batch), from ``labels`` or
        ``crow``."""
        if not self._keys:
            if self.labels is None:
                groups = torch.arange(self.groups, device=self.crow.device)
                n = self.col.numel()
                keys = torch.repeat_interleave(groups, self.crow.diff(), output_size=n)
            else:
                keys = self.labels if self.in_order else self.labels[self.col]
            self._keys.append(keys)
        return self._keys[0]

    def sums(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """(groups × d): row g is Σ_{i in g} w_i x_i (w = 1 without ``weights``) of ``x`` (n × d)."""
        n = self.col.numel()
        if weights is None:
            values = self._ones.get(x.dtype)
            if values is None:
                values = self._ones[x.dtype] = torch.ones(n, dtype=x.dtype, device=x.device)
        else:  # the weight of the row each stored entry refers to
            values = weights if self.in_order else weights[self.col]
        with warnings.catch_warnings():  # "sparse CSR tensor support is in beta state"
            warnings.simplefilter("ignore", UserWarning)
            s = torch.sparse_csr_tensor(
                self.crow, self.col, values, (self.groups, n), dtype=x.dtype
            )
        return s @ x


#: the split sums' target: a group's mean errs by at most 2^-SPLIT_BITS of its column's largest
#: |x| in the batch (:func:`split_sums`)
SPLIT_BITS = 36
_U32 = 2.0**-24  # float32's unit roundoff


def split_levels(n_max: int, bits: int = SPLIT_BITS) -> int:
    """The levels L of :func:`split_sums` for groups of at most ``n_max`` rows: the smallest L
    with n_max · 2^-24 · ρ^L ≤ 2^-bits, ρ = 2^(⌈log2 n_max⌉ − 22) (each level takes
    22 − ⌈log2 n_max⌉ bits of every value exactly). ValueError for n_max > 2^20, where a level
    takes two bits or fewer."""
    c = max(int(n_max) - 1, 0).bit_length()  # ⌈log2 n_max⌉
    if c > 20:
        raise ValueError(f"split sums need groups of at most 2^20 rows, got {n_max}")
    rest = -24 + c  # log2 of the remainder's relative error bound, before any level
    levels = 0
    while rest > -bits:
        rest += c - 22
        levels += 1
    return levels


def split_sums(
    x: torch.Tensor,
    labels: torch.Tensor,
    groups: int,
    n_max: int | None = None,
    bits: int = SPLIT_BITS,
) -> torch.Tensor:
    """(groups × d) float64: row g is Σ_{i: labels[i] = g} x_i, in float32 arithmetic only, by
    an error-free split of every value onto a per-column grid (Rump, Ogita & Oishi 2008,
    *Accurate floating-point summation part I*, Lemma 3.3: ExtractScalar).

    ``x`` (n × d): bf16, fp16 or float32 rows (exact in float32); ``n_max``: a bound on any
    group's rows (default n). Per level and column a, with m_a = max_i |r_ia| < 2^e_a (the
    remainder r, x at first) and σ_a = 2^(e_a + ⌈log2 n_max⌉ + 1) ≥ 2 n_max m_a::

        hi = fl(fl(σ_a + r) − σ_a),   r ← r − hi   (both exact),

    hi is a multiple of 2^-24 σ_a and |hi| ≤ σ_a/(2 n_max) (1 + 4 n_max 2^-24), so every
    partial sum of a group's hi is a multiple of 2^-24 σ_a below σ_a: exact in float32, in any
    order (``index_add_``'s atomics on a GPU included), and |r| ≤ ρ m_a afterwards,
    ρ = 2^(⌈log2 n_max⌉ − 22). After L = :func:`split_levels` levels the remainder's float32
    sum errs by at most (n_g − 1) 2^-24 Σ_i |r_i| ≤ n_g² 2^-24 ρ^L M_a (M_a = max_i |x_ia|),
    and the L + 1 exact float32 sums are added in float64, so a group's mean errs by at most

        |Δμ_g,a| ≤ (n_g 2^-24 ρ^L + (L + 1) 2^-53) M_a ≤ (2^-bits + (L + 1) 2^-53) M_a.

    Needs |x| < 2^(125 − ⌈log2 n_max⌉) (σ finite). Costs L + 1 float32 scatters and L split
    passes: for ``bits`` = 36, L = 2 at n_max ≤ 2^10 rows, 5 at 2^16.
    """
    if x.dtype == torch.float64:
        raise ValueError("split_sums takes rows of at most float32 precision")
    n, d = x.shape
    levels = split_levels(n if n_max is None else n_max, bits)
    c = max((n if n_max is None else int(n_max)) - 1, 0).bit_length()
    r = x.to(torch.float32).clone()
    out = torch.zeros(groups, d, dtype=torch.float64, device=x.device)
    part = torch.empty(groups, d, dtype=torch.float32, device=x.device)
    hi = torch.empty_like(r)
    for _ in range(levels):
        _, e = torch.frexp(r.abs().amax(dim=0))  # m_a < 2^e_a (e_a = 0 for m_a = 0)
        sigma = torch.ldexp(torch.ones_like(r[0]), e + (c + 1))
        torch.add(r, sigma, out=hi).sub_(sigma)
        r.sub_(hi)
        out += part.zero_().index_add_(0, labels, hi)
    out += part.zero_().index_add_(0, labels, r)
    return out
