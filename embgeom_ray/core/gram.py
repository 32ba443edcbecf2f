"""The co-moment's product XᵀX in float64 or float32, in column blocks.

The fold's one matrix product is G = X'ᵀX' of a batch's rows shifted by a centre c,
x'_i = x_i − c (n × d), added to the layer's co-moment (``core/layer_state.py``). G is
symmetric, so only its upper block triangle is multiplied: with the columns split into k blocks
X = [X_1 … X_k], block row i is X_iᵀ [X_i … X_k], (k + 1)/(2k) of the full product's
multiply-adds (62% for d = 384 in blocks of 96, 51% for d = 4,096), in k large matrix products
each added to a float64 sum in its own precision; :func:`symmetric_from_upper` mirrors the
triangle. The same product on int8 matrix units, within a stated bound, is
:mod:`~embgeom_ray.core.integer_gram`.

On a GPU the blocks are few and wide (:func:`gpu_block_width`: :data:`GPU_GRAM_BLOCKS` of
them, none narrower than :data:`GPU_GRAM_MIN_WIDTH` columns, edges at multiples of
:data:`GPU_GRAM_ALIGN` columns): skinny products run far under a GPU's rate. On a CPU fold of
one thread (lanes), float64 rows go to BLAS's symmetric rank-k update ``dsyrk`` instead
(:data:`CPU_SYRK`): the upper triangle alone, element by element.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import numpy as np
import torch

_F64 = torch.float64

#: column blocks of the co-moment product on a GPU: a few wide products (the block triangle
#: of k blocks is (k + 1)/(2k) of the full product's multiply-adds: 9/16 for 8) rather than many
#: skinny ones. On an H100 (``python -m bench.comoment --rows 65536``; docs/benchmarks.md),
#: float64, d = 2,048:
#: 4 blocks 6.20 ms, 8 blocks 5.51 ms; d = 4,096: 22.95 and 21.10 ms.
GPU_GRAM_BLOCKS = 8
#: the GPU blocks' edges at multiples of this many columns: 6 blocks of d = 2,048 (edges at odd
#: columns such as 341) took 18.6 ms on that H100, three times as long as 4 or 8 blocks
GPU_GRAM_ALIGN = 64
#: the narrowest column block on a GPU: d / 8 columns would be 96 at d = 768 (BERT-base) and
#: 48 at d = 384, where blocks of 96 columns took 5.4 times as long as 4 blocks at d = 2,048
#: on an H200 (8,192 rows: 4.9 against 0.91 ms), while blocks of 256 columns (d = 2,048 in 8)
#: ran at the wide blocks' rate on the H100 above. d = 2,048 and 4,096 keep their 8 blocks;
#: d = 768 gets 3, d = 384 gets 2 and d < 384 the full product in one
GPU_GRAM_MIN_WIDTH = 256


def gpu_block_width(d: int) -> int:
    """Columns per block of the GPU's product of d columns: d / :data:`GPU_GRAM_BLOCKS`, and
    at least :data:`GPU_GRAM_MIN_WIDTH` (:func:`_column_blocks` then makes round(d / width)
    blocks, at least one)."""
    return max(-(-d // GPU_GRAM_BLOCKS), GPU_GRAM_MIN_WIDTH)


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
    of that many columns (:func:`_column_blocks`). Rows in ``upper``'s dtype are multiplied
    into it (``addmm_``: BLAS's C += AB, no block-row temporary and no pass to add it; 0.96
    and 0.97 of the time on two CPU threads at d = 384 and 768, 5,120 rows;
    docs/benchmarks.md); float32 rows' block rows are added to it after each product.
    """
    into = xs.dtype == upper.dtype
    for lo, hi in itertools.pairwise(_column_blocks(xs.shape[1], block, align)):
        if into:
            upper[lo:hi, lo:].addmm_(xs[:, lo:hi].T, xs[:, lo:])  # block row: (hi − lo, d − lo)
        else:
            upper[lo:hi, lo:] += xs[:, lo:hi].T @ xs[:, lo:]


#: a CPU's float64 product on one thread (a fold in lanes: docs/operations.md) by BLAS's
#: symmetric rank-k update (``dsyrk``, scipy's OpenBLAS on one thread), the upper triangle
#: element by element, instead of the 96-column block triangle: on the 2-core AVX-512 VM,
#: 1,024 rows, 3.2 against 3.8–4.1 ms at d = 384 and 12.4 against 15.8–16.1 ms at d = 768;
#: the fold 0.91 and 0.88 of its time (docs/benchmarks.md). On more threads torch's own
#: product is the faster (OpenBLAS's one thread took 1.3x the fold beside torch's two).
#: False: the block triangle everywhere (the arithmetic of earlier versions, bit for bit)
CPU_SYRK = True


@functools.cache
def _openblas() -> Any:
    """scipy's BLAS and a threadpoolctl controller of the OpenBLAS libraries loaded (made
    once: scipy's own OpenBLAS is loaded by the import)."""
    from scipy.linalg import blas
    from threadpoolctl import ThreadpoolController

    return blas, ThreadpoolController().select(internal_api="openblas")


def _syrk_upper(upper: torch.Tensor, xs: torch.Tensor) -> None:
    """upper += the upper triangle of XᵀX, X = ``xs`` (n × d float64 rows, CPU), by ``dsyrk``
    on one OpenBLAS thread (12 µs a call to set). ``upper`` (d × d, C order) read as
    column-major is its transpose, whose lower triangle is ``upper``'s upper one; X in C order
    is Xᵀ in column-major order, so neither is copied."""
    blas, openblas = _openblas()
    c = upper.numpy().T
    with openblas.limit(limits=1):
        out = blas.dsyrk(1.0, xs.contiguous().numpy().T, beta=1.0, c=c, lower=1, overwrite_c=1)
    if not np.shares_memory(out, c):  # f2py copied (it should not): write the result back
        c[...] = out


def add_gram(upper: torch.Tensor, xs: torch.Tensor, block: int = 96) -> None:
    """Add the upper block triangle of XᵀX (rows of ``xs``, multiplied in its dtype) to
    ``upper`` (float64, C order) (:func:`add_gram_upper`): on a CPU float64 rows on one
    thread by ``dsyrk`` (:data:`CPU_SYRK`, the upper triangle alone), others in blocks of
    ``block`` columns, on a GPU in blocks of :func:`gpu_block_width` columns with edges at
    multiples of :data:`GPU_GRAM_ALIGN` columns (skinny products run far under a GPU's rate:
    on an H200 at n = 8,192 rows and d = 2,048, float64 blocks of 96 columns take 4.9 ms, the
    full product 1.1 ms; ``python -m bench.comoment``; docs/benchmarks.md).
    :func:`symmetric_from_upper` makes the matrix."""
    d = xs.shape[1]
    if xs.device.type != "cpu":
        add_gram_upper(upper, xs, gpu_block_width(d), GPU_GRAM_ALIGN)
    elif CPU_SYRK and torch.get_num_threads() == 1 and xs.dtype == _F64 and len(xs):
        _syrk_upper(upper, xs)
    else:
        add_gram_upper(upper, xs, block)


def add_gram_stacked(upper: torch.Tensor, xs: torch.Tensor, block: int = 96) -> None:
    """:func:`add_gram` of G layers at once: ``upper`` (G × d × d, float64) gets the upper block
    triangle of each layer's X_gᵀX_g, ``xs`` (n × G × d) the layers' rows stacked, in the same
    column blocks as :func:`add_gram` takes them on the device (:func:`gpu_block_width` on a
    GPU, ``block`` columns elsewhere), each block row of every layer by one batched product."""
    d = xs.shape[2]
    width, align = (gpu_block_width(d), GPU_GRAM_ALIGN) if xs.device.type != "cpu" else (block, 1)
    rows = xs.permute(1, 2, 0)  # G × d × n: each layer's Xᵀ, a view
    cols = xs.transpose(0, 1)  # G × n × d: each layer's X
    into = xs.dtype == upper.dtype
    for lo, hi in itertools.pairwise(_column_blocks(d, width, align)):
        if into:
            upper[:, lo:hi, lo:].baddbmm_(rows[:, lo:hi], cols[:, :, lo:])
        else:
            upper[:, lo:hi, lo:] += torch.bmm(rows[:, lo:hi], cols[:, :, lo:])


def integer_blocks(d: int, gpu: bool) -> dict[str, int]:
    """Column blocks of the product on int8 units (``IntegerGram``'s ``block`` and ``align``):
    on a GPU its few wide ones (as :func:`add_gram`), else blocks of 96 columns; edges at
    multiples of 8 at least (int8 products)."""
    if gpu:
        return {"block": gpu_block_width(d), "align": GPU_GRAM_ALIGN}
    return {"block": 96, "align": 8}


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
