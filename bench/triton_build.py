"""This checkout's Triton kernels built for an NVIDIA GPU on any machine, no GPU needed.

Triton's front end, its GPU passes and the ``ptxas`` its wheel ships turn each kernel into the
card's machine code; ``cuobjdump`` (also in the wheel) reads back each one's registers a
thread, its stack (bytes spilled from registers to local memory) and its shared memory. Built:
the fold's pass 1 and per-type merge (``core/segment_sums_kernels.py``: the rows' norms and
tails, the sums of the types and of the positions, the join, the merge) at their GPU
configurations, and the int8 SYRK
(``core/integer_syrk.py``) at each configuration its autotuner tries.

A kernel that does not compile for the card fails here rather than on a lent GPU; one that
spills or holds many registers (few resident warps to hide memory latency) shows here too.
What it does not tell: the speed (``bash bench/gpu.sh`` on the card).

    python -m bench.triton_build [--arch 90] [--dtype bf16]

``tests/core/test_triton_build.py`` runs it (sm_90, bf16) and checks that no kernel spills.
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before Triton wraps the kernels: compiled, not run

import argparse
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.common import save


def build(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], arch: int,
          warps: int, stages: int = 3) -> dict[str, Any]:  # fmt: skip
    """``fn`` compiled for sm_``arch``: its resource usage (module docstring)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    options = {"num_warps": warps, "num_stages": stages}
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", str(cubin)],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
    fields = dict(
        item.split(":", 1) for line in usage.splitlines() if "REG:" in line for item in line.split()
    )
    return {
        "kernel": fn.__name__, **constexprs, "num_warps": warps, "num_stages": stages,
        "registers": int(fields["REG"]), "stack_bytes": int(fields["STACK"]),
        "shared_bytes": int(kernel.metadata.shared),
    }  # fmt: skip


def segment_sums_kernels(arch: int, dtype: str) -> list[dict[str, Any]]:
    """The fold's pass 1 at :data:`~embgeom_ray.core.segment_sums.GPU_CONFIG` and
    ``GPU_ROW_CONFIG``: each kernel as the fold launches it (the types' rows in order, with
    their weights and tails; the positions' through their permutation, without); and the
    types' merge at ``GPU_MERGE_CONFIG``."""
    from embgeom_ray.core import segment_sums
    from embgeom_ray.core import segment_sums_kernels as k

    (r, block_d, warps), (rb, row_block_d, row_warps) = (
        segment_sums.GPU_CONFIG, segment_sums.GPU_ROW_CONFIG,
    )  # fmt: skip
    rows = {"rows_ptr": f"*{dtype}", "order_ptr": "*i64"}
    sizes = {"n": "i32", "d": "i32"}
    out = []
    for in_order, extra in ((True, True), (False, False)):
        out.append(build(
            k.row_stats,
            {**rows, "inv_norms_ptr": "*fp64", "amax_ptr": "*i64", "amin_ptr": "*i64", **sizes,
             "stride_row": "i32", "RB": "constexpr", "BLOCK_D": "constexpr",
             "IN_ORDER": "constexpr", "TAILS": "constexpr"},
            {"RB": rb, "BLOCK_D": row_block_d, "IN_ORDER": in_order, "TAILS": extra},
            arch, row_warps,
        ))  # fmt: skip
        out.append(build(
            k.group_pass,
            {**rows, "keys_ptr": "*i64", "sums_ptr": "*fp64", "units_ptr": "*fp64",
             "unit_rows_ptr": "*i64", "inv_norms_ptr": "*fp64", "carry_ptr": "*fp64", **sizes,
             "stride_row": "i32", "stride_units": "i32", "R": "constexpr",
             "BLOCK_D": "constexpr", "IN_ORDER": "constexpr", "WEIGHTED": "constexpr"},
            {"R": r, "BLOCK_D": block_d, "IN_ORDER": in_order, "WEIGHTED": extra},
            arch, warps,
        ))  # fmt: skip
    out.append(build(
        k.join,
        {"keys_ptr": "*i64", "starts_ptr": "*i64", "sums_ptr": "*fp64", "units_ptr": "*fp64",
         "unit_rows_ptr": "*i64", "carry_ptr": "*fp64", **sizes, "stride_units": "i32",
         "R": "constexpr", "BLOCK_D": "constexpr", "WEIGHTED": "constexpr"},
        {"R": r, "BLOCK_D": block_d, "WEIGHTED": True},
        arch, warps,
    ))  # fmt: skip
    tb, merge_block_d, merge_warps = segment_sums.GPU_MERGE_CONFIG
    out.append(build(
        k.merge_types,
        {"means_ptr": "*fp64", "counts_ptr": "*i64", "m2_ptr": "*fp64", "slots_ptr": "*i64",
         "n_b_ptr": "*i64", "mean_b_ptr": "*fp64", "m2_b_ptr": "*fp64", "u": "i32", "d": "i32",
         "stride_means": "i32", "stride_b": "i32", "TB": "constexpr", "BLOCK_D": "constexpr"},
        {"TB": tb, "BLOCK_D": merge_block_d},
        arch, merge_warps,
    ))  # fmt: skip
    return out


def syrk_kernels(arch: int) -> list[dict[str, Any]]:
    """The int8 SYRK at each of its autotuner's configurations
    (:data:`~embgeom_ray.core.integer_syrk.GPU_CONFIGS`)."""
    from embgeom_ray.core import integer_syrk

    fn = integer_syrk._kernel(False).fn  # the autotuner's kernel
    out = []
    for bm, bn, bk, warps, stages in integer_syrk.GPU_CONFIGS:
        signature = {
            "a_desc": f"tensordesc<i8[{bm}, {bk}]>", "b_desc": f"tensordesc<i8[{bn}, {bk}]>",
            "out_ptr": "*u8", "mod_ptr": "*i32", "D": "i32", "K": "i32",
            "BM": "constexpr", "BN": "constexpr", "BK": "constexpr",
        }  # fmt: skip
        out.append(build(fn, signature, {"BM": bm, "BN": bn, "BK": bk}, arch, warps, stages))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90: Hopper")
    p.add_argument("--dtype", default="bf16", help="the model's rows: bf16, fp16, fp32, fp64")
    p.add_argument("--no-syrk", action="store_true", help="pass 1's kernels only")
    p.add_argument("--name", default="triton-build")
    args = p.parse_args(argv)
    import triton

    built = segment_sums_kernels(args.arch, args.dtype)
    if not args.no_syrk:
        built += syrk_kernels(args.arch)
    for row in built:
        print(row, flush=True)
    save(args.name, {"command": "python -m bench.triton_build", "args": vars(args),
                     "triton": triton.__version__, "kernels": built})  # fmt: skip


if __name__ == "__main__":
    main()
