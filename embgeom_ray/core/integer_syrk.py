"""The bounded product's int8 products in one Triton kernel: a symmetric rank-k update modulo
each modulus, its upper tiles only, the remainders written as bytes.

:class:`~embgeom_ray.core.integer_gram.IntegerGram` needs, per group of rows and per modulus
m_k, the remainders of R_kᵀR_k modulo m_k, R_k the (d × n) int8 residues of the fixed-point
rows (Ozaki scheme II; ``docs/precision.md``). Through ``torch._int_mm`` that is N moduli × k
column blocks products, each into an int32 (d × d) buffer, then N ``remainder`` passes: on
Hopper ``_int_mm`` runs an Ampere-generation kernel (``cutlass_80_tensorop_i16832gemm_s8``)
far below the card's int8 rate. Here one launch does it all (:func:`remainders`):

* the grid is (tile row, tile column, modulus); a program whose tile lies wholly below the
  diagonal returns at once, so only the upper tile triangle is multiplied;
* each program accumulates R_k[a-tile] R_k[b-tile]ᵀ over the rows in int32 with ``tl.dot``
  (the card's int8 matrix instructions: ``wgmma`` s8 × s8 → s32 on sm90), exact since
  |Σ| ≤ n 2^14 ≤ 2^30 for n ≤ 2^16 rows (:data:`~embgeom_ray.core.integer_gram.MAX_ROWS`);
* the residues' blocks are read through tensor descriptors (on sm90 the tensor memory
  accelerator, ``cp.async.bulk.tensor``, into shared memory, ``num_stages`` blocks ahead):
  with a tensor of pointers instead, each thread held 64-bit addresses for its share of both
  blocks, and every configuration compiled for sm90 to 255 registers with 824–1,912 bytes
  spilled a thread and no pipelined reads (129 ``ld.global``); now 93–169 registers, nothing
  spilled, 64–144 KiB of shared memory for the stages (``python -m bench.triton_build``);
* its epilogue takes the remainder modulo m_k and stores one byte an entry: N bytes a
  matrix entry leave the kernel, where ``_int_mm`` wrote 4 and the remainder pass read them.

Integer sums are exact in any order, so the bytes equal those of ``torch._int_mm`` (or its
float64 emulation) bit for bit on any device; the tests run the kernel on a CPU under
Triton's interpreter (``TRITON_INTERPRET=1``) and compare. Tiles below the diagonal are left as
the caller's zeroed buffer has them (zero remainders: a zero matrix entry), those of a diagonal
tile's lower half are the product's own values; only the upper triangle is read afterwards.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

#: on a GPU the residues' columns are padded to a multiple of this (every tile size divides it)
COLUMN_ALIGN = 256
#: ... and their rows (the products' inner size) to a multiple of this (every row step does)
ROW_ALIGN = 128
#: the tile configurations tried on a GPU, (BM, BN, BK, warps, stages), the best kept per width
#: (Triton's autotuner, on the first batch of each width)
GPU_CONFIGS: tuple[tuple[int, int, int, int, int], ...] = (
    (128, 128, 128, 8, 4),
    (128, 256, 128, 8, 3),
    (128, 128, 64, 4, 4),
    (256, 128, 128, 8, 3),
)
#: the tile of the interpreter (CPU tests): small, so that few programs run in Python
INTERPRETER_CONFIG = (32, 32, 32, 1, 1)


def interpreted() -> bool:
    """Whether Triton runs its kernels in its interpreter (``TRITON_INTERPRET=1``: on CPU
    tensors, with numpy; the tests' way)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def alignment() -> tuple[int, int]:
    """(columns, rows): what the residues' shape must be a multiple of for :func:`remainders`:
    :data:`COLUMN_ALIGN` and :data:`ROW_ALIGN` on a GPU, the interpreter's tile on a CPU."""
    if interpreted():
        return INTERPRETER_CONFIG[1], INTERPRETER_CONFIG[2]
    return COLUMN_ALIGN, ROW_ALIGN


@functools.cache
def importable() -> bool:
    """Whether Triton can be imported here (it comes with CUDA builds of torch)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _has_tensor_descriptors() -> bool:
    """Whether this Triton has host-side tensor descriptors (``triton.tools.tensor_descriptor``),
    which the kernel reads its blocks through; without them the int8 product runs by
    ``torch._int_mm``."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


def available(device: torch.device) -> bool:
    """Whether :func:`remainders` runs on ``device``: CUDA with a Triton that has tensor
    descriptors, or a CPU under Triton's interpreter."""
    if not importable() or not _has_tensor_descriptors():
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreted())


@functools.cache
def _kernel(interpret: bool) -> Callable[..., Any]:
    """The jitted kernel (autotuned over :data:`GPU_CONFIGS` on a GPU); built once a process
    (and once for the interpreter: ``triton.jit`` reads ``TRITON_INTERPRET`` when it wraps)."""
    import triton
    import triton.language as tl

    @triton.jit
    def syrk_remainders(
        a_desc,  # tensor descriptor of the (N·D, K) int8 residues, blocks of (BM, BK)
        b_desc,  # ... the same residues, blocks of (BN, BK)
        out_ptr,  # (N, D, D) uint8 remainders, contiguous, zeroed
        mod_ptr,  # (N,) int32 moduli
        D,
        K,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if (pid_n + 1) * BN <= pid_m * BM:  # wholly below the diagonal
            return
        k = tl.program_id(2)
        row_a = k * D + pid_m * BM  # the tiles' first rows in the (N·D, K) residues
        row_b = k * D + pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.int32)
        for step in range(0, K, BK):  # the card's tensor memory accelerator reads each block
            a = a_desc.load([row_a, step])
            b = b_desc.load([row_b, step])
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
        m = tl.load(mod_ptr + k)
        rem = acc % m  # C's remainder: the sign of acc
        rem = tl.where(rem < 0, rem + m, rem)
        rows_a = pid_m * BM + tl.arange(0, BM)
        rows_b = pid_n * BN + tl.arange(0, BN)
        out = out_ptr + k.to(tl.int64) * D * D + rows_a.to(tl.int64)[:, None] * D + rows_b[None, :]
        tl.store(out, rem.to(tl.uint8))

    if interpret:
        return syrk_remainders

    def block_shapes(nargs: dict[str, Any]) -> None:  # each configuration's blocks
        nargs["a_desc"].block_shape = [nargs["BM"], nargs["BK"]]
        nargs["b_desc"].block_shape = [nargs["BN"], nargs["BK"]]

    configs = [
        triton.Config(
            {"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s, pre_hook=block_shapes
        )
        for bm, bn, bk, w, s in GPU_CONFIGS
    ]
    return triton.autotune(configs=configs, key=["D"])(syrk_remainders)


@functools.cache
def _moduli_tensor(moduli: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The moduli as an int32 device vector, copied there once (read only)."""
    return torch.tensor(list(moduli), dtype=torch.int32, device=device)


def remainders(residues: torch.Tensor, moduli: Sequence[int]) -> torch.Tensor:
    """(N, D, D) uint8: (R_kᵀR_k) mod m_k on the upper tile triangle (0 below it), for the
    residues ``residues`` (N, D, K) int8 (D and K multiples of :func:`alignment`'s, K ≤ 2^16),
    one launch (module docstring)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    n_mod, d, k = residues.shape
    cols, rows = alignment()
    if n_mod != len(moduli) or d % cols or k % rows:
        raise ValueError(
            f"residues of shape {tuple(residues.shape)} for {len(moduli)} moduli: columns must "
            f"be a multiple of {cols}, rows of {rows}"
        )
    residues = residues.contiguous()
    out = torch.zeros((n_mod, d, d), dtype=torch.uint8, device=residues.device)
    if k == 0:
        return out
    mods = _moduli_tensor(tuple(moduli), residues.device)
    interpret = interpreted()
    kernel = _kernel(interpret)
    flat = residues.view(n_mod * d, k)
    if interpret:
        bm, bn, bk, _, _ = INTERPRETER_CONFIG
        a = TensorDescriptor.from_tensor(flat, [bm, bk])
        b = TensorDescriptor.from_tensor(flat, [bn, bk])
        kernel[(d // bm, d // bn, n_mod)](a, b, out, mods, d, k, BM=bm, BN=bn, BK=bk)
    else:  # the autotuner's pre-hook sets the blocks of each configuration
        a = TensorDescriptor.from_tensor(flat, [1, 1])
        b = TensorDescriptor.from_tensor(flat, [1, 1])
        grid = lambda meta: (d // meta["BM"], d // meta["BN"], n_mod)  # noqa: E731
        kernel[grid](a, b, out, mods, d, k)
    return out


def best_config() -> dict[str, int] | None:
    """The tile configuration the autotuner kept on this GPU (for the benchmarks), or None."""
    if interpreted() or _kernel.cache_info().currsize == 0:
        return None
    best = getattr(_kernel(False), "best_config", None)
    if best is None:
        return None
    return {**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages}
