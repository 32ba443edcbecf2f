"""Faults: a node lost mid-run, a driver killed mid-run. Every token counted exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from embgeom_ray.config import build_config
from embgeom_ray.pipeline import analyze
from tests.conftest import write_jsonl
from tests.test_job_end_to_end import english_documents

pytestmark = pytest.mark.slow

TABLES = ("type_stats", "layers", "dims")


def options(model: str, corpus: str, out: Path) -> dict:
    return {
        "model": model,
        "corpus": corpus,
        "out": str(out),
        "max_length": 64,
        "sample_size": 512,
        "kmeans_k_max": 6,
        "layers": [0, 6],
        "shard_bytes": 2048,
        "num_workers": 2,
        "cpus_per_worker": 1,
    }


def read_tables(out: Path) -> dict[str, pd.DataFrame]:
    return {t: pd.read_parquet(out / f"{t}.parquet") for t in TABLES}


def assert_same_tables(a: dict, b: dict) -> None:
    for name in TABLES:
        pd.testing.assert_frame_equal(a[name], b[name], check_exact=False, rtol=1e-9, atol=0)


def wait_for_checkpoints(out: Path, n: int, timeout: float = 240.0) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        done = len(list((out / "shards").glob("*.json"))) if (out / "shards").exists() else 0
        if done >= n:
            return done
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} shards finished within {timeout} s")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    docs = english_documents(40, 600)
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "c.jsonl", docs)


@pytest.fixture(scope="module")
def clean(tmp_path_factory, corpus, minilm_dir) -> Path:
    """The fault-free run both fault tests are compared with (on a local Ray)."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    out = tmp_path_factory.mktemp("clean") / "run"
    analyze(build_config(None, options(minilm_dir, corpus, out)), echo=lambda *_: None)
    return out


def test_node_lost_mid_run(tmp_path, corpus, minilm_dir, clean):
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()

        faulty_out = tmp_path / "faulty"
        result: dict = {}

        def run() -> None:
            try:
                result["manifest"] = analyze(
                    build_config(None, options(minilm_dir, corpus, faulty_out)),
                    echo=lambda *_: None,
                )
            except BaseException as exc:  # surfaced in the main thread below
                result["error"] = exc

        thread = threading.Thread(target=run)
        thread.start()
        wait_for_checkpoints(faulty_out, 2)
        cluster.remove_node(workers[0], allow_graceful=False)  # a spot node disappears
        cluster.add_node(num_cpus=1)  # the autoscaler brings a new one
        thread.join(timeout=600)
        assert not thread.is_alive(), "the job did not finish after losing a node"
        if "error" in result:
            raise result["error"]
        manifest = result["manifest"]
        assert manifest["status"] == "complete"
        assert manifest["workers"]["workers_lost"] >= 1
        assert_same_tables(read_tables(faulty_out), read_tables(clean))
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_driver_killed_then_resumed(tmp_path, corpus, minilm_dir, clean, ray_local):
    total = len(list((clean / "shards").glob("*.json")))

    out = tmp_path / "killed"
    opts = options(minilm_dir, corpus, out)
    argv = [sys.executable, "-m", "jobs.analyze"]
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    env = dict(os.environ, RAY_ADDRESS="")  # its own local Ray, killed with it
    proc = subprocess.Popen(
        argv,
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        done_before = wait_for_checkpoints(out, 2)
        os.killpg(proc.pid, signal.SIGKILL)  # the driver's machine dies, with its local Ray
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    killed_manifest = pd.read_json(out / "manifest.json", typ="series")
    assert killed_manifest["status"] == "running"  # nothing presents itself as complete
    assert not (out / "layers.parquet").exists()
    done_before = len(list((out / "shards").glob("*.json")))
    assert 2 <= done_before < total

    manifest = analyze(build_config(None, opts), echo=lambda *_: None)
    assert manifest["shards"]["reused_from_checkpoints"] == done_before
    assert manifest["shards"]["computed"] == total - done_before
    assert_same_tables(read_tables(out), read_tables(clean))


def test_pool_fits_actors_on_single_nodes(minilm_dir, tmp_path):
    """Two 1-CPU nodes: one worker gets 1 CPU (not the cluster's 2, which no node has)."""
    import ray
    from ray.cluster_utils import Cluster

    from embgeom_ray.errors import ConfigError
    from embgeom_ray.ray_job import plan_pool

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        opts = {"model": minilm_dir, "corpus": "x", "out": str(tmp_path)}
        assert plan_pool(build_config(None, opts | {"num_workers": 1}), 10).num_cpus == 1
        default = plan_pool(build_config(None, opts), 10)
        assert (default.num_workers, default.num_cpus) == (2, 1)
        with pytest.raises(ConfigError, match="largest node"):
            plan_pool(build_config(None, opts | {"cpus_per_worker": 2}), 10)
    finally:
        ray.shutdown()
        cluster.shutdown()
