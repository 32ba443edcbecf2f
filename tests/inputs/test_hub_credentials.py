"""The hub token goes where it is needed and is written nowhere.

- :func:`use_hub_credentials` sets a token the node lacks, and never replaces the node's own;
  the driver's runtime environment (which Ray shows in its dashboard and writes to its logs)
  carries the other ``HF_*`` variables but not the token; an extractor actor's body sets the
  token it is given before it loads the model.
- A whole job, run as users run it (``python -m jobs.analyze`` in a fresh process, its private
  Ray's files under a directory of this test's), with ``HF_TOKEN`` set: the token is in none of
  the run directory's files (manifest, tables, statistics, report), the job's output, or any
  file Ray wrote (its logs included).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from embgeom_ray.inputs.hub_credentials import hub_credentials, use_hub_credentials
from tests.conftest import SHORT_DOCS, write_jsonl

REPO = Path(__file__).resolve().parents[2]


def test_credentials_fill_in_and_never_replace(monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_driver")
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    assert hub_credentials() == {"HF_TOKEN": "hf_driver"}
    monkeypatch.delenv("HF_TOKEN")
    use_hub_credentials({"HF_TOKEN": "hf_driver", "PATH": "/nowhere"})
    assert os.environ["HF_TOKEN"] == "hf_driver" and os.environ["PATH"] != "/nowhere"
    monkeypatch.setenv("HF_TOKEN", "hf_node")
    use_hub_credentials({"HF_TOKEN": "hf_driver"})
    assert os.environ["HF_TOKEN"] == "hf_node"


def test_the_token_is_not_in_the_runtime_env(monkeypatch) -> None:
    from embgeom_ray.distributed.cluster import _driver_runtime_env

    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", "hf_secret")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env_vars = (_driver_runtime_env() or {}).get("env_vars", {})
    assert env_vars.get("HF_HUB_OFFLINE") == "1"
    assert "hf_secret" not in repr(env_vars)


def test_an_extractor_sets_the_token_it_is_given(monkeypatch, minilm_dir) -> None:
    from embgeom_ray.distributed.actor_pool import ShardExtract
    from embgeom_ray.inputs.options import ExtractionOptions

    monkeypatch.delenv("HF_TOKEN", raising=False)
    seen = {}

    def loading(*args, **kwargs):
        seen["token"] = os.environ.get("HF_TOKEN")
        raise RuntimeError("stop here")

    monkeypatch.setattr("embgeom_ray.distributed.actor_pool.ShardProcessor", loading)
    options = ExtractionOptions(model=minilm_dir, corpus="c.jsonl")
    actor = ShardExtract(options.model_dump(), [0], {}, 1, None, {"HF_TOKEN": "hf_given"})
    assert seen["token"] == "hf_given"  # set before the model is loaded
    assert isinstance(actor.error, RuntimeError)


@pytest.mark.slow
def test_a_job_writes_the_token_nowhere(minilm_dir, tmp_path) -> None:
    token = "hf_" + secrets.token_hex(16)
    corpus = write_jsonl(tmp_path / "short.jsonl", SHORT_DOCS)
    out = tmp_path / "run"
    # Ray's files (sockets included) under a short path of this test's own
    ray_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    try:
        _check_job(token, minilm_dir, corpus, out, ray_dir)
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)


def _check_job(token: str, minilm_dir: str, corpus: str, out: Path, ray_dir: Path) -> None:
    env = os.environ | {"HF_TOKEN": token, "RAY_TMPDIR": str(ray_dir), "HF_HUB_OFFLINE": "1",
                        "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}  # fmt: skip
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.analyze", "--model", minilm_dir, "--corpus", corpus,
         "--out", str(out), "--max-length", "32", "--sample-size", "48", "--kmeans-k-max", "3",
         "--num-workers", "1", "--verbose"],
        cwd=REPO, env=env, capture_output=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert (out / "report.html").is_file()
    secret = token.encode()
    assert secret not in proc.stdout + proc.stderr
    written = [p for p in out.rglob("*") if p.is_file()]
    assert len(written) >= 8
    assert [p for p in written if secret in p.read_bytes()] == []
    ray_files = [p for p in ray_dir.rglob("*") if p.is_file() and not p.is_symlink()]
    assert any(p.name.endswith(".log") or p.name.endswith(".out") for p in ray_files)
    leaked = []
    for p in ray_files:
        try:
            if secret in p.read_bytes():
                leaked.append(p)
        except OSError:  # sockets, files removed while Ray shut down
            continue
    assert leaked == [], leaked
