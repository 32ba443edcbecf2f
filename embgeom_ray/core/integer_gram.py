"""The co-moment product on integer matrix units, within a stated bound (Ozaki scheme II).

The fold's one matrix product is G = X'ᵀX' of a batch's rows shifted by their mean,
x'_i = x_i − c (n × d). In float64 it is exact to rounding but runs on the GPU's float64
units; bf16 or float32 tensor-core products are fast but accumulate in float32 with truncation,
whose error grows with the number of rows and cannot be bounded to 1e-6 at useful row counts
(``docs/precision.md``). This module computes G with int8 products, whose int32 sums are exact
on every device, following Ozaki, Uchino & Imamura's scheme II (arXiv 2504.08009):

1. **Fixed point.** Per column a, with M_a = max_i |x'_ia| < 2^E_a, the rows are scaled by
   2^{e_a}, e_a = B − 1 − E_a, and rounded to integers x̃_ia (|x̃| ≤ 2^{B−1}, B = :data:`BITS`).
   This is the only rounding: |x'_ia − 2^{−e_a} x̃_ia| ≤ 2^{1−B} M_a.
2. **Residues.** The integer Gram G̃ = X̃ᵀX̃ (|G̃_ab| ≤ n 2^{2B−2}) is computed modulo
   pairwise coprime moduli m_k ≤ 256 (:data:`MODULI`) whose product exceeds 4 n 2^{2B−2}:
   the residues R_k = X̃ mod m_k, balanced into [−m_k/2, m_k/2), are int8, and R_kᵀR_k is one
   int8 matrix product with int32 sums, exact (|sum| ≤ n 2^{14} ≤ 2^{30} for n ≤ 2^{16}).
3. **Reconstruction.** G̃ follows exactly from its residues (Chinese remainder theorem, in
   Garner's mixed-radix form with balanced digits), evaluated in float64 (relative rounding
   ≤ N·2^{−53}), and G ≈ 2^{−e_a−e_b} G̃_ab.

Only the upper block triangle is multiplied (:func:`upper_blocks`): each product is a block of
a symmetric R_kᵀR_k.

**The bound.** With A_a = Σ_i x'_ia² (i.e. G_aa):

    |G_ab − 2^{−e_a−e_b} G̃_ab| ≤ 2^{1−B} (M_a Σ_i |x'_ib| + M_b Σ_i |x'_ia|) + n 2^{2−2B} M_a M_b
                               ≤ ε_n √(A_a A_b),   ε_n = 2^{2−B} √n (1 + 2^{−B} √n),

since M_a ≤ √A_a and Σ_i |x'_ib| ≤ √(n A_b). Rows are taken in groups of at most
:data:`MAX_ROWS` = 2^16 (each with its own scales), so ε ≤ 2^{−29} ≈ 1.9e-9 with B = 39,
whatever the data: massive activations only make M_a large, and M_a ≤ √A_a always. Summed over
groups and batches (Cauchy–Schwarz) and merged with Chan's update the co-moment keeps
|ΔC_ab| ≤ ε √(C_aa C_bb) (:func:`bound`; ``docs/precision.md`` has the whole argument).

Nothing here depends on how the device accumulates: integer sums are exact in any order, so
the CPU (``torch._int_mm`` on its own int8 units, or :func:`emulated_int8_matmul`) computes
bit for bit what a GPU's tensor cores compute. Twelve int8 products replace one float64
product: a gain where int8 runs ~30x faster than float64 (A100, L40S, consumer cards), less on
H100/H200, whose float64 matrix units run at 1/30 of their int8 rate.
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from . import integer_syrk
from .fold_kernels import run_fused, squared_deviations_eager

_F64 = torch.float64
#: bits of the fixed-point rows: |x̃| ≤ 2^(BITS−1)
BITS = 39
#: pairwise coprime moduli ≤ 256 (their balanced residues are int8), largest first
MODULI: tuple[int, ...] = (256, 255, 253, 251, 247, 241, 239, 233, 229, 227, 223, 211)
#: rows per group (each group its own column scales): int32 sums of n products of int8
#: residues stay below 2^30, and √n = 2^8 in the bound
MAX_ROWS = 1 << 16
#: columns of the narrowest block a product takes (``torch._int_mm`` on CUDA: more than 16)
MIN_BLOCK = 24
#: the residues' rows are zero-padded to a multiple of this: the int8 products' inner size
#: and leading dimensions (cuBLASLt's int8 kernels want multiples of 4 to 16 bytes)
ROW_ALIGN = 16


def moduli_for(rows: int, bits: int = BITS) -> tuple[int, ...]:
    """The fewest of :data:`MODULI` whose product M exceeds 4 · rows · 2^(2·bits − 2): twice
    the range of the integer Gram, so that its balanced residues determine it."""
    need = 4 * max(int(rows), 1) * (1 << (2 * bits - 2))
    product = 1
    for k, m in enumerate(MODULI):
        product *= m
        if product > need:
            return MODULI[: k + 1]
    raise ValueError(f"{len(MODULI)} moduli cannot hold the Gram of {rows} rows of {bits} bits")


def bound(rows: int, bits: int = BITS) -> float:
    """ε_n = 2^(2−B) √n (1 + 2^−B √n): |ΔG_ab| ≤ ε_n √(G_aa G_bb) for a group of n rows."""
    root = math.sqrt(max(int(rows), 1))
    return 2.0 ** (2 - bits) * root * (1.0 + 2.0**-bits * root)


def column_scales(absmax: torch.Tensor, bits: int = BITS) -> torch.Tensor:
    """2^(e_a) per column (float64), e_a = bits − 1 − E_a with absmax_a < 2^(E_a): the scaled
    column lies in [−2^(bits−1), 2^(bits−1)]. A zero column gets 1; e_a is kept within
    ±960 (a column whose largest value is below 2^−920 loses precision, none other)."""
    _, exponent = torch.frexp(absmax.to(_F64))  # absmax = f · 2^E, f in [0.5, 1)
    # a column below 2^-920 (no hidden state's) would need a scale beyond float64's range
    e = torch.where(absmax > 0, bits - 1 - exponent, torch.zeros_like(exponent)).clamp(-960, 960)
    return torch.ldexp(torch.ones_like(absmax, dtype=_F64), e)


def residues_eager(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    moduli: tuple[int, ...],
    rows: int = 0,
    cols: int = 0,
) -> torch.Tensor:
    """(N, d, n) int8: the balanced residues of x̃ = round((x − c) · scale) modulo each of the
    N ``moduli``, for the rows ``x`` (n × d, float64), transposed (the products' operands are
    rows of it); zero-padded to (N, ``cols``, ``rows``) where those are larger (zero rows add
    nothing to a product; int8 products want aligned strides). One modulus at a time: eagerly
    (a CPU, or a GPU without compiled kernels) the float64 temporaries are (d × n), not N of
    them.

    r = x̃ − m ⌊x̃/m + ½⌋ ∈ [−m/2, m/2): exact in float64, since |x̃| ≤ 2^38 keeps x̃/m within
    2^−20 of its value, and for odd m the quotient is at least 1/(2m) from a half-integer (for
    m = 256 it is exact)."""
    z = torch.round((x - shift) * scale).t()  # (d, n) integers, |z| ≤ 2^(B−1)
    n, d = x.shape
    pad = (0, max(rows - n, 0), 0, max(cols - d, 0))
    out = []
    for m in moduli:
        r = (z - m * torch.floor(z * (1.0 / m) + 0.5)).to(torch.int8)
        out.append(torch.nn.functional.pad(r, pad) if any(pad) else r)
    return torch.stack(out)


@functools.cache
def inverse_table(moduli: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """inv[j][k] = m_j^(−1) mod m_k (j < k; 0 elsewhere)."""
    return tuple(tuple(pow(mj, -1, mk) if j < k else 0 for k, mk in enumerate(moduli))
                 for j, mj in enumerate(moduli))  # fmt: skip


def garner_eager(
    remainders: torch.Tensor,
    moduli: tuple[int, ...],
    inv: tuple[tuple[int, ...], ...] | None = None,
) -> torch.Tensor:
    """The integers G with G ≡ remainders[k] (mod m_k) and |G| < M/2 (M = Π m_k), in float64.

    Garner's algorithm with balanced digits: G = v_1 + m_1 (v_2 + m_2 (v_3 + …)),
    v_k ∈ [−m_k/2, m_k/2), each digit from exact float64 arithmetic on integers below 2^17;
    the final Horner sum rounds only where a partial sum passes 2^53, so its relative error is
    below N · 2^−53 (and small values are exact). ``remainders``: (N, …) integers in [0, m_k)
    (any integer dtype or float64); ``inv``: :func:`inverse_table` of the moduli (passed by the
    compiled kernel, which cannot trace its modular inverses)."""
    inv = inverse_table(moduli) if inv is None else inv
    digits: list[torch.Tensor] = []
    for k, m in enumerate(moduli):
        t = remainders[k].to(_F64)
        for j in range(k):
            t = (t - digits[j]) * float(inv[j][k])
            t = t - m * torch.floor(t / m)
        digits.append(torch.where(t >= (m + 1) // 2, t - m, t))
    value = digits[-1]
    for k in range(len(moduli) - 2, -1, -1):
        value = value * float(moduli[k]) + digits[k]
    return value


def emulated_int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch._int_mm`` emulated: the int32 product of int8 matrices, as a float64 product of
    their values (exact: every partial sum is an integer below 2^53)."""
    return (a.to(_F64) @ b.to(_F64)).to(torch.int32)


#: the products of every modulus and tile in one Triton kernel with the remainders in its
#: epilogue (:mod:`~embgeom_ray.core.integer_syrk`) instead of ``torch._int_mm`` a block and
#: modulus. False (the default until a card has measured it: ``bash bench/gpu.sh``,
#: docs/precision.md) keeps ``_int_mm``; None: wherever it runs (CUDA with Triton); True forces
#: it wherever it runs (also CPU tests under Triton's interpreter)
TRITON_SYRK: bool | None = False


def triton_syrk_on(device: torch.device) -> bool:
    """Whether the products run as :func:`~embgeom_ray.core.integer_syrk.remainders` on
    ``device`` (:data:`TRITON_SYRK`)."""
    if TRITON_SYRK is False:
        return False
    return integer_syrk.available(device) and (TRITON_SYRK or device.type == "cuda")


def _triton_failed(error: Exception) -> None:
    """One warning, and ``torch._int_mm``'s products from then on in this process."""
    global TRITON_SYRK
    TRITON_SYRK = False
    warnings.warn(
        f"the Triton int8 kernel failed ({type(error).__name__}: "
        f"{str(error).splitlines()[0][:200] if str(error) else ''}); multiplying with "
        "torch._int_mm instead (the same numbers, slower)",
        RuntimeWarning,
        stacklevel=4,
    )


#: the int8 × int8 → int32 product (``torch._int_mm``: cuBLASLt's IMMA kernels on CUDA, oneDNN's
#: VNNI kernels on CPUs); tests may put :func:`emulated_int8_matmul` in its place
int8_matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch._int_mm


def upper_blocks(d: int, block: int, align: int) -> list[int]:
    """Edges of the column blocks of the product's upper block triangle: about ``block`` wide,
    inner edges at multiples of ``align`` (≥ 8: ``torch._int_mm`` takes widths that are
    multiples of 8), every block at least :data:`MIN_BLOCK` wide (a narrow last block joins
    the one before)."""
    k = max(1, round(d / block))
    inner = {min(d, align * round(d * i / k / align)) for i in range(1, k)}
    edges = sorted(inner - {0, d} | {0, d})
    while len(edges) > 2 and edges[-1] - edges[-2] < MIN_BLOCK:
        del edges[-2]
    while len(edges) > 2 and edges[1] - edges[0] < MIN_BLOCK:
        del edges[1]
    return edges


def _products(res: torch.Tensor, edges: Sequence[int]) -> torch.Tensor:
    """The upper block triangle of RᵀR (int32, d × d) of one modulus' residues ``res``
    (d × n int8, a row per column of X, n a multiple of :data:`ROW_ALIGN`)."""
    d = res.shape[0]
    out = torch.zeros(d, d, dtype=torch.int32, device=res.device)
    for lo, hi in itertools.pairwise(edges):
        out[lo:hi, lo:] = int8_matmul(res[lo:hi], res[lo:].t())
    return out


@dataclass
class _Group:
    """Rows [start, stop) of the batch with their own column scales and residues."""

    start: int
    stop: int
    scale: torch.Tensor  # (d,) float64, 2^e per column
    moduli: tuple[int, ...]
    row_align: int = ROW_ALIGN
    residues: torch.Tensor | None = None  # (N, d_pad, rows_pad) int8, once filled

    @property
    def rows_pad(self) -> int:
        """The group's rows rounded up to ``row_align`` (the residues' row length)."""
        return -(-(self.stop - self.start) // self.row_align) * self.row_align


class IntegerGram:
    """The upper block triangle of X'ᵀX' (x' = x − c) of a batch's rows, by Ozaki scheme II.

    ``rows``: the kept rows (n × d, the model's dtype) whose shifted Gram is wanted; ``shift``
    c (d,) float64. The column scales come from each group's column extremes (one read of the
    rows); the residues of each piece of rows are handed in by the fold
    (:meth:`pieces`, :meth:`put`: the fold computes them in the pass that reads the rows
    anyway), and :meth:`add_upper` multiplies and reconstructs. ``block`` and ``align``: the
    column blocks (:func:`upper_blocks`) of ``torch._int_mm``'s products; where the products
    run in one Triton kernel (:func:`triton_syrk_on`) the residues are padded to its tiles
    instead (:func:`~embgeom_ray.core.integer_syrk.alignment`).
    """

    def __init__(
        self, rows: torch.Tensor, shift: torch.Tensor, *, block: int = 96, align: int = 8
    ) -> None:
        n, d = rows.shape
        self.n, self.dim = int(n), int(d)
        self.triton = triton_syrk_on(rows.device)
        cols, row_align = integer_syrk.alignment() if self.triton else (8, ROW_ALIGN)
        self.d_pad = max(MIN_BLOCK, -(-self.dim // cols) * cols)
        self.shift = shift.to(_F64)
        self.edges = upper_blocks(self.d_pad, block, max(8, align))
        self.groups: list[_Group] = []
        for start in range(0, self.n, MAX_ROWS):
            stop = min(start + MAX_ROWS, self.n)
            low, high = torch.aminmax(rows[start:stop], dim=0)
            # fl(x − c) is monotone in x: no row's shifted value exceeds these in magnitude
            absmax = torch.maximum(high.to(_F64) - self.shift, self.shift - low.to(_F64))
            self.groups.append(
                _Group(start, stop, column_scales(absmax), moduli_for(stop - start), row_align)
            )

    def pieces(self, a: int, b: int) -> Iterator[tuple[_Group, int, int]]:
        """(group, s, e): the rows [s, e) of [a, b) that lie in one group, in order."""
        for g in self.groups:
            s, e = max(a, g.start), min(b, g.stop)
            if s < e:
                yield g, s, e

    def padding(self, g: _Group, s: int, e: int) -> tuple[int, int]:
        """(rows, cols) to pad the residues of rows [s, e) to: the group's padded shape when
        they are the whole group (a GPU's batch: the kernel writes them in place), else none
        (:meth:`put` copies them into the group's buffer)."""
        return (g.rows_pad, self.d_pad) if (s, e) == (g.start, g.stop) else (0, 0)

    def put(self, g: _Group, s: int, e: int, residues: torch.Tensor) -> None:
        """The residues (N, d, e − s) of rows [s, e) of group ``g`` (padded as
        :meth:`padding` says): taken as they are when they hold the whole group, else copied
        into the group's zeroed buffer."""
        shape = (len(g.moduli), self.d_pad, g.rows_pad)
        if tuple(residues.shape) == shape:
            g.residues = residues
            return
        if g.residues is None:
            g.residues = torch.zeros(shape, dtype=torch.int8, device=residues.device)
        g.residues[:, : self.dim, s - g.start : e - g.start] = residues

    def add_upper(self, upper: torch.Tensor) -> None:
        """Add the upper block triangle of X'ᵀX' (float64, within :func:`bound` of each
        group's rows) into ``upper`` (d × d float64)."""
        d = self.dim
        for g in self.groups:
            if g.residues is None:
                raise RuntimeError("residues of some rows were never put")
            remainders = None
            if self.triton:  # every modulus and upper tile in one launch
                try:
                    remainders = integer_syrk.remainders(g.residues, g.moduli)
                except Exception as e:  # any failure to build or run it: _int_mm instead
                    _triton_failed(e)
                    self.triton = False
            if remainders is None:
                remainders = torch.empty(
                    (len(g.moduli), self.d_pad, self.d_pad), dtype=torch.uint8, device=upper.device
                )
                for k, m in enumerate(g.moduli):
                    p = _products(g.residues[k], self.edges)
                    remainders[k] = torch.remainder(p, m).to(torch.uint8)
            g.residues = None  # the int8 copies are no longer needed
            value = garner(remainders, g.moduli)[:d, :d]
            inv = g.scale.reciprocal()  # powers of two: the products below are exact
            upper.addcmul_(value, torch.outer(inv, inv))


def garner(remainders: torch.Tensor, moduli: Sequence[int]) -> torch.Tensor:
    """:func:`garner_eager`, as one compiled kernel where the fold's kernels are fused
    (:func:`garner_reconstruct`)."""
    moduli = tuple(moduli)
    return garner_reconstruct(remainders, moduli, inverse_table(moduli))


# ------------------------------------------------- the fused kernels (fold_kernels.run_fused)


def deviations_and_residues_eager(
    means: torch.Tensor,
    inv: torch.Tensor,
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    moduli: tuple[int, ...],
    rows: int = 0,
    cols: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`~embgeom_ray.core.fold_kernels.squared_deviations_eager`, the int8 residues of
    the shifted rows in fixed point, (N, d, n) zero-padded to (N, ``cols``, ``rows``)): the
    second pass of the fold with the integer co-moment product (:func:`residues_eager`)."""
    sq = squared_deviations_eager(means, inv, x)
    return sq, residues_eager(x, shift, scale, moduli, rows, cols)


def deviations_and_residues(
    means: torch.Tensor,
    inv: torch.Tensor,
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    moduli: tuple[int, ...],
    rows: int = 0,
    cols: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`deviations_and_residues_eager`, fused where
    :func:`~embgeom_ray.core.fold_kernels.fused_on`: one read of the float64 rows writes a
    number per row and N bytes per value."""
    return run_fused(  # type: ignore[return-value]
        deviations_and_residues_eager, means, inv, x, shift, scale, moduli, rows, cols
    )


def garner_reconstruct(
    remainders: torch.Tensor, moduli: tuple[int, ...], inv: tuple[tuple[int, ...], ...]
) -> torch.Tensor:
    """:func:`garner_eager`, fused where :func:`~embgeom_ray.core.fold_kernels.fused_on`: the
    N remainder matrices are read once and the float64 Gram written once."""
    return run_fused(garner_eager, remainders, moduli, inv)  # type: ignore[return-value,arg-type]


def residues(*args: object) -> torch.Tensor:
    """:func:`residues_eager` (the same arguments) alone, fused where
    :func:`~embgeom_ray.core.fold_kernels.fused_on` (the product without the fold's
    deviations: ``bench.comoment``)."""
    return run_fused(residues_eager, *args)  # type: ignore[return-value,arg-type]
