"""This checkout's Triton kernels built for Hopper (sm_90) on the CPU, no GPU needed
(``bench.triton_build``): what the interpreter's tests cannot see, whether each compiles for
the card, spills registers or reads through its tensor memory accelerator."""

from __future__ import annotations

import pytest

from embgeom_ray.core import integer_syrk

pytest.importorskip("triton", reason="Triton (make test installs it) compiles the kernels")


def test_the_kernels_build_for_hopper_and_spill_nothing(tmp_path):
    """This checkout's Triton kernels compiled for sm_90 on this CPU (``bench.triton_build``:
    Triton's compiler and the ptxas of its wheel): every one builds and none spills a
    register. Pass 1's and the types' merge's hold few enough registers for at least a
    quarter of the warps an SM can keep resident (≤ 128 a thread), which hide the latency of
    their reads; the int8 SYRK's configurations read through the tensor memory accelerator
    into their stages."""
    import json
    import os
    import subprocess
    import sys

    from bench.common import REPO

    env = os.environ | {"EMBGEOM_BENCH_RESULTS": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "bench.triton_build"], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    built = json.loads((tmp_path / "triton-build.json").read_text())["kernels"]
    names = sorted(k["kernel"] for k in built)
    syrk = len(integer_syrk.GPU_CONFIGS)
    pass_1 = ["group_pass"] * 2 + ["join", "merge_types"] + ["row_stats"] * 2
    assert names == pass_1 + ["syrk_remainders"] * syrk
    for k in built:
        assert k["stack_bytes"] == 0, k
        if k["kernel"] == "syrk_remainders":  # the stages of both blocks in shared memory
            assert k["shared_bytes"] >= (k["num_stages"] - 1) * (k["BM"] + k["BN"]) * k["BK"], k
        else:
            assert k["registers"] <= 128, k
