"""Pass 1 of the GPU fold in Triton: the per-group float64 sums, the unit-vector sums and the
tails, read from the model's own rows, without a float64 copy of them; and the per-type Chan
merge after pass 2 in one kernel (:func:`merge_types`).

The GPU fold's pass 1 (``statistics.EmbeddingStatistics._first_pass``) otherwise writes the
batch's rows in float64 and reads that copy once per sum: the per-type sums, the unit-vector
sums and the per-position sums are three sparse products (``group_sums.GroupMatrix``), and
the tails two more reads of the rows. On bf16 rows, with pass 2's read of the copy, that is
about 62 bytes of traffic a value (``docs/precision.md``). Here (:func:`group_sums`) the
kernels read each row of a grouping in its own dtype (2 bytes a value in bf16) and write only
the sums:

* rows are taken in group order (the fold's rows are already in type order; the positions
  through the grouping's permutation), in chunks of R consecutive rows;
* where the unit vectors or the tails are wanted, one launch (``row_stats``) takes each row's
  Σ x² in float64 (its weight w_i = 1/max(‖x_i‖, tiny), as ``fold_kernels.float64_rows``) and
  its first argmax and argmin dimension, a few rows a program, walking their columns;
* the sums (``group_pass``): one program a chunk and block of columns adds the chunk's rows
  one after another in float64 (and w_i x_i), reading each row's block once (coalesced: the
  program's columns are contiguous) and the next row before it adds the current one. Where a
  group's rows in the chunk end, their sum is stored at the group's row of the output (its
  unit-vector sum added to its row of the statistics) when the group lies wholly in the
  chunk, else in a carry buffer (at most two pieces a chunk);
* a last, small launch (``join``) adds each group's pieces across chunks, in chunk order, in
  the program of the chunk where the group ends.

With pass 2 reading the model's rows too (``fold_kernels``: its compiled kernel converts as it
reads), the fold's passes move about 24 bytes a value instead of 62 (the rows read three
times at 2 bytes, pass 2's 18): at d = 2,048 and 65,536 rows about 3.2 GB instead of 8.3,
≥ 0.7 ms at an H200's 4.8 TB/s. Not yet measured on a GPU.

Every sum is taken in float64 from the exact float64 values of the rows (bf16, fp16 and
float32 convert exactly), in row order within a chunk and chunk order across chunks: the results
are the same from run to run, and differ from the sparse product's only in the order of the
additions (float64 rounding). No atomics. Each kernel compiles for Hopper (sm_90) with at most
64 registers a thread and no spills (``python -m bench.triton_build``, run on any machine).

The fold uses it where :func:`on` the device (:data:`TRITON_SUMS`), one layer at a time (not in
the stacked fold of small batches); the tests run it on a CPU in Triton's interpreter
(``TRITON_INTERPRET=1``) against ``GroupMatrix``'s sums of the float64 rows, the eager tails,
and the fold without it (``tests/core/test_segment_sums.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from embgeom_ray.core.integer_syrk import importable, interpreted

#: where the fold's pass 1 runs here: False (default) nowhere, until a GPU measures it against
#: the float64 copy and sparse products (``bash bench/gpu.sh``, step ``fold``:
#: ``--products triton-sums``); None on CUDA where Triton imports; True wherever
#: :func:`available` (the tests: a CPU under Triton's interpreter)
TRITON_SUMS: bool | None = False
#: (rows a chunk R, columns a program, warps) of the sums on a GPU, not tuned on one yet (a
#: chunk's rows are summed one after another, each a coalesced read of 2·BLOCK_D bytes in bf16)
GPU_CONFIG = (64, 256, 4)
#: (rows a program, columns a step, warps) of the rows' norms and tails on a GPU
GPU_ROW_CONFIG = (2, 256, 4)
#: ... and in the interpreter (CPU tests): small, so that groups cross chunks and rows cross
#: column blocks
INTERPRETER_CONFIG = (16, 32, 1)
INTERPRETER_ROW_CONFIG = (16, 16, 1)
#: (types a program, columns a step, warps) of the per-type merge (:func:`merge_types`) on a
#: GPU, and in the interpreter
GPU_MERGE_CONFIG = (2, 256, 4)
INTERPRETER_MERGE_CONFIG = (4, 16, 1)

_F64 = torch.float64


def available(device: torch.device) -> bool:
    """Whether :func:`group_sums` runs on ``device``: CUDA with Triton, or a CPU under Triton's
    interpreter."""
    if not importable():
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreted())


def on(device: torch.device) -> bool:
    """Whether the fold's pass 1 runs in :func:`group_sums` on ``device`` (:data:`TRITON_SUMS`;
    never again in this process once a kernel could not be built: :func:`give_up`)."""
    if TRITON_SUMS is False or _unavailable or not available(device):
        return False
    return TRITON_SUMS is True or device.type == "cuda"


_unavailable = False


def give_up(error: Exception) -> None:
    """After ``error`` from :func:`group_sums` or :func:`merge_types` (a kernel Triton could
    not build for this card or version): one warning, and :func:`on` is False from then on
    (the fold's sparse products and eager merge instead: the same statistics)."""
    global _unavailable
    _unavailable = True
    first = str(error).splitlines()[0][:200] if str(error) else ""
    warnings.warn(
        f"the fold's Triton kernels failed ({type(error).__name__}: {first}); folding with "
        "sparse products and an eager merge instead (the same statistics)",
        RuntimeWarning,
        stacklevel=3,
    )


def _configs() -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    if interpreted():
        return INTERPRETER_CONFIG, INTERPRETER_ROW_CONFIG
    return GPU_CONFIG, GPU_ROW_CONFIG


def _kernels() -> tuple[Callable[..., Any], ...]:
    """(rows' norms and tails, sums, join, the per-type merge):
    :mod:`~embgeom_ray.core.segment_sums_kernels`."""
    from embgeom_ray.core import segment_sums_kernels as k

    return k.row_stats, k.group_pass, k.join, k.merge_types


class GroupSums(NamedTuple):
    """What :func:`group_sums` returns."""

    sums: torch.Tensor  # (groups, d) float64: Σ_{i in g} x_i
    argmax: torch.Tensor | None  # (n,) int64: each row's first argmax dimension, group order
    argmin: torch.Tensor | None  # (n,) int64: ... and argmin


def group_sums(
    rows: torch.Tensor,
    keys: torch.Tensor,
    starts: torch.Tensor,
    groups: int,
    *,
    order: torch.Tensor | None = None,
    add_units_to: tuple[torch.Tensor, torch.Tensor] | None = None,
    tails: bool = False,
    every_group: bool = True,
) -> GroupSums:
    """Per-group float64 sums of ``rows`` (n × d, any float dtype), in two launches (module
    docstring).

    Args:
        keys: (n,) int64, non-decreasing: the group of each row taken in group order.
        starts: (groups + 1,) int64: group g holds positions starts[g]..starts[g+1] − 1 of
            that order (a CSR row pointer, ``GroupMatrix.crow``).
        order: (n,) int64: the row at each position of group order (None: row i is at i).
        add_units_to: (target, at): each group g's sum of unit vectors
            Σ_{i in g} x_i/max(‖x_i‖, tiny) is added to row ``at[g]`` of ``target`` (float64,
            d columns of unit stride; ``at`` (groups,) int64, no row twice), as
            ``target.index_add_(0, at, sums)`` would add it, without writing the sums first.
        tails: also each row's first argmax and argmin dimension (in group order).
        every_group: every group 0..groups − 1 has rows (the output is not zeroed first).
    """
    n, d = rows.shape
    dev = rows.device
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    (r, block_d, warps), (rb, row_block_d, row_warps) = _configs()
    chunks = max(1, -(-n // r))
    sums = (torch.empty if every_group else torch.zeros)(groups, d, dtype=_F64, device=dev)
    argmax = torch.empty(n, dtype=torch.int64, device=dev) if tails else None
    argmin = torch.empty(n, dtype=torch.int64, device=dev) if tails else None
    if n == 0:
        return GroupSums(sums, argmax, argmin)
    units, at = (sums, keys) if add_units_to is None else add_units_to  # unused without
    if units.dtype != _F64 or units.shape[1] != d or units.stride(1) != 1:
        raise ValueError("add_units_to takes a float64 target of d columns, unit stride")
    weighted = add_units_to is not None
    order_or_keys = keys if order is None else order  # a pointer the kernels need not read
    row_stats, group_pass, join, _ = _kernels()
    interpret = interpreted()
    inv_norms = sums  # unused unless weighted
    if weighted or tails:
        inv_norms = torch.empty(n, dtype=_F64, device=dev)
        row_stats[(-(-n // rb),)](
            rows, order_or_keys, inv_norms, keys if argmax is None else argmax,
            keys if argmin is None else argmin, n, d, rows.stride(0),
            RB=rb, BLOCK_D=row_block_d, IN_ORDER=order is None, TAILS=tails,
            **({} if interpret else {"num_warps": row_warps}),
        )  # fmt: skip
    carry = torch.empty(chunks, 2, 2, d, dtype=_F64, device=dev)
    extra = {} if interpret else {"num_warps": warps}
    grid = (chunks, -(-d // block_d))
    group_pass[grid](
        rows, order_or_keys, keys, sums, units, at, inv_norms, carry,
        n, d, rows.stride(0), units.stride(0),
        R=r, BLOCK_D=block_d, IN_ORDER=order is None, WEIGHTED=weighted, **extra,
    )  # fmt: skip
    if chunks > 1:
        join[grid](
            keys, starts, sums, units, at, carry, n, d, units.stride(0),
            R=r, BLOCK_D=block_d, WEIGHTED=weighted, **extra,
        )  # fmt: skip
    return GroupSums(sums, argmax, argmin)


def merge_types(
    means: torch.Tensor,
    counts: torch.Tensor,
    m2: torch.Tensor,
    slots: torch.Tensor,
    n_b: torch.Tensor,
    mean_b: torch.Tensor,
    m2_b: torch.Tensor,
) -> None:
    """Chan's update of the running per-type moments (``counts``, ``means``, ``m2`` of one
    layer: (capacity,), (capacity, d), (capacity,)) at ``slots`` (u,) by a batch's (``n_b``,
    ``mean_b``, ``m2_b``), in place, in one launch: what
    :meth:`~embgeom_ray.core.type_moments.TypeMoments.merge_rows` computes in six (two
    gathers, the merge's terms, two scatters and the M2 added), each type's row read and
    written once (24 bytes a value instead of about 56)::

        n = n_a + n_b,  δ = μ_b − μ_a,  μ = μ_a + δ n_b/n,  M2 = M2_a + (M2_b + ‖δ‖² n_a n_b/n)

    (Chan, Golub & LeVeque 1979), with ‖δ‖² summed in float64 by column blocks; rows with
    n = 0 stay 0. No slot twice in ``slots``.
    """
    u, d = mean_b.shape
    if u == 0:
        return
    if means.stride(1) != 1 or mean_b.stride(1) != 1:
        raise ValueError("merge_types takes means and mean_b of unit column stride")
    tb, block_d, warps = INTERPRETER_MERGE_CONFIG if interpreted() else GPU_MERGE_CONFIG
    merge = _kernels()[3]
    merge[(-(-u // tb),)](
        means, counts, m2, slots, n_b, mean_b, m2_b, u, d, means.stride(0), mean_b.stride(0),
        TB=tb, BLOCK_D=block_d, **({} if interpreted() else {"num_warps": warps}),
    )  # fmt: skip
