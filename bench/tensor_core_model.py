"""A model of an H100/H200 tensor core's bf16 products with float32 accumulation, on a CPU.

Khattak & Mikaitis (2025, *Accurate Models of NVIDIA Tensor Cores*, arXiv 2512.07004; their
MATLAB models, ``H100TC.m``) found the H100's bf16 → float32 matrix multiply-accumulate to be a
fused block of 16 products: the products are exact; they and the accumulator are aligned to
the largest of them with 2 extra bits (``neab = 2``), the bits below that dropped (truncation);
the aligned terms are summed exactly and the sum truncated to float32 (round toward zero). A
product of K rows is then K/16 such steps, each feeding its float32 result to the next.

:func:`h100_matmul` follows that model (normal numbers only: no subnormals, no overflow, which
the co-moment's values never reach), vectorised over the output; :func:`split_chunked_gram` is
the candidate the bound rules out (``docs/precision.md``): the shifted rows split into bf16
hi + lo, the four products per chunk of rows on the model, the chunks summed in float64.
"""

from __future__ import annotations

import torch

_F64 = torch.float64
#: products per fused block, and extra alignment bits (H100TC.m: fma = 16, neab = 2)
BLOCK, NEAB = 16, 2


def truncate_to_float32(v: torch.Tensor) -> torch.Tensor:
    """``v`` (float64) rounded toward zero to 24 significant bits (float32's)."""
    _, e = torch.frexp(v)  # |v| in [2^(e−1), 2^e)
    ulp = torch.ldexp(torch.ones_like(v), e - 24)
    return torch.where(v == 0, v, torch.trunc(v / ulp) * ulp)


def h100_matmul(
    a: torch.Tensor, b: torch.Tensor, block: int = BLOCK, neab: int = NEAB
) -> torch.Tensor:
    """a @ b of bf16 matrices (m × K, K × n) as the model computes it, returned in float64
    (every value a float32 number): per block of ``block`` products along K, the products and
    the accumulator aligned to the largest with ``neab`` extra bits, truncated, summed exactly
    and truncated to float32."""
    a64, b64 = a.to(_F64), b.to(_F64).t()
    m, k = a64.shape
    acc = torch.zeros(m, b64.shape[0], dtype=_F64, device=a.device)
    for k0 in range(0, k, block):
        products = a64[:, None, k0 : k0 + block] * b64[None, :, k0 : k0 + block]  # exact
        terms = torch.cat([products, acc[..., None]], dim=-1)
        _, e = torch.frexp(terms.abs().amax(dim=-1, keepdim=True))  # largest < 2^e
        grain = torch.ldexp(torch.ones_like(acc[..., None]), e - 24 - neab)
        aligned = torch.trunc(terms / grain) * grain  # exact in float64: < 2^(26 + neab) grains
        acc = truncate_to_float32(aligned.sum(dim=-1))
    return acc


def split_chunked_gram(xs: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Σ over chunks of ``chunk`` rows of (hi + lo)ᵀ(hi + lo) on the model (hiᵀhi, hiᵀlo,
    loᵀhi, loᵀlo: every product of the bf16 pieces exact), the chunks added in float64.
    ``xs``: the shifted rows (float32 or float64); hi = bf16(xs), lo = bf16(xs − hi)."""
    hi = xs.to(torch.bfloat16)
    lo = (xs.to(_F64) - hi.to(_F64)).to(torch.bfloat16)
    d = xs.shape[1]
    total = torch.zeros(d, d, dtype=_F64, device=xs.device)
    for a in range(0, xs.shape[0], chunk):
        h, low = hi[a : a + chunk], lo[a : a + chunk]
        cross = h100_matmul(h.t(), low)
        total += h100_matmul(h.t(), h) + cross + cross.t() + h100_matmul(low.t(), low)
    return total
