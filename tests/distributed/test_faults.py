"""Faults: a node lost mid-run, an actor killed holding unflushed shards, a driver killed
mid-run, a checkpoint group half written. Every token counted exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from embgeom_ray.config import build_config
from embgeom_ray.core.statistics import EmbeddingStatistics
from embgeom_ray.core.tables import MIN_SAMPLE_POINTS
from embgeom_ray.counts import Counts
from embgeom_ray.distributed.actor_pool import FoldReport
from embgeom_ray.inputs.corpus import CorpusSpec, plan_shards
from embgeom_ray.inputs.extractor import ShardProcessor
from embgeom_ray.run_dir import RunDir
from embgeom_ray.runs.checkpoints import CheckpointStore
from embgeom_ray.runs.pipeline import analyze
from tests.conftest import start_local_ray, write_jsonl
from tests.runs.test_job_end_to_end import english_documents

pytestmark = pytest.mark.slow

TABLES = ("type_stats", "layers", "dims")
#: the runs' sample: 16 points a layer, fewer than the sampled metrics need
SAMPLE = 16
assert SAMPLE < MIN_SAMPLE_POINTS


def options(model: str, corpus: str, out: Path, **extra) -> dict:
    return {
        "model": model,
        "corpus": corpus,
        "out": str(out),
        "max_length": 64,
        # a sample below MIN_SAMPLE_POINTS: drawn, checkpointed, requeued and merged like any
        # other, and compared between the runs point by point (assert_same_sample), but no
        # sampled-metrics task runs (~7 s a job: those metrics are a function of the sample,
        # checked in tests/core and tests/runs/test_job_end_to_end.py)
        "sample_size": SAMPLE,
        "no_report": True,  # the report is tested elsewhere (tests/report/test_report.py)
        "layers": [0, 6],
        "shard_bytes": 2048,
        # one extractor: each run's fault (a lost actor, node or driver) does not depend on
        # how many there are, and every extractor is ~6 CPU-seconds of imports and loading
        "num_workers": 1,
        "cpus_per_worker": 1,
        # the exact product, so a resumed run equals an uninterrupted one to 1e-9 (the float32
        # default's product depends on the batch order through its shift: ~1e-8)
        "comoment_precision": "float64",
        # the fault tests look into the checkpoint groups of complete runs
        "keep_checkpoints": True,
    } | extra


def read_tables(out: Path) -> dict[str, pd.DataFrame]:
    return {t: pd.read_parquet(out / f"{t}.parquet") for t in TABLES}


def assert_same_tables(a: dict, b: dict) -> None:
    for name in TABLES:
        pd.testing.assert_frame_equal(a[name], b[name], check_exact=False, rtol=1e-9, atol=0)


def assert_same_sample(out: Path, clean: Path) -> None:
    """The same sample as the run ``clean``, uniform and type-uniform: the same keys and token
    ids in every layer, the same vectors to float32 rounding of another batching."""
    ours, theirs = RunDir(str(out)).load_sample(), RunDir(str(clean)).load_sample()
    assert list(ours.layers) == list(theirs.layers) and ours.type_uniform and theirs.type_uniform
    for layer in ours.layers:
        for a, b in ((ours.points(layer), theirs.points(layer)),
                     (ours.type_points(layer), theirs.type_points(layer))):  # fmt: skip
            assert len(a.keys) == SAMPLE
            np.testing.assert_array_equal(a.keys, b.keys)
            np.testing.assert_array_equal(a.token_ids, b.token_ids)
            np.testing.assert_allclose(a.vectors, b.vectors, rtol=1e-6, atol=1e-6)


def done_shards(out: Path) -> set[str]:
    return CheckpointStore(str(out)).done_shards() if out.exists() else set()


def wait_for_checkpoints(out: Path, n: int, timeout: float = 240.0) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        done = len(done_shards(out))
        if done >= n:
            return done
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} shards finished within {timeout} s")


def on_each_fold(monkeypatch, hook: Callable[[FoldReport], None]) -> None:
    """Call ``hook`` in the driver each time an extractor has folded a shard."""
    from embgeom_ray.distributed import actor_pool as ray_job

    real = ray_job.run_shards

    def run_shards(*args, on_folded=None, **kwargs):
        def folded(report: FoldReport) -> None:
            if on_folded is not None:
                on_folded(report)
            hook(report)

        return real(*args, on_folded=folded, **kwargs)

    monkeypatch.setattr(ray_job, "run_shards", run_shards)


def wait_until_gone(pid: int, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return
        if "\nState:\tZ" in status:  # dead, not yet reaped
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} still alive {timeout} s after SIGKILL")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    # 20 documents of 600 characters (10 KB): 6 shards of 2 KB, enough for an actor to hold
    # three unflushed shards with a fourth in flight, and for a driver killed after two
    docs = english_documents(20, 600)
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "c.jsonl", docs)


@pytest.fixture(scope="module")
def actor_lost(tmp_path_factory, corpus, minilm_dir) -> dict:
    """One extractor, on a local Ray, killed holding three folded, unflushed shards and a
    fourth in flight (checkpoint interval 3600 s: one checkpoint, at the end). The run that
    :func:`test_actor_lost_with_unflushed_shards_matches_one_process` checks against one
    process folding every shard once (statistics to 1e-9 relative, counts and the sample's
    keys exactly), and so the run the other fault tests are compared with (:func:`clean`)."""
    import ray

    if not ray.is_initialized():
        start_local_ray()
    killed: list[FoldReport] = []

    def kill_actor(report: FoldReport) -> None:
        if not killed and report.unflushed == 3:
            killed.append(report)
            os.kill(report.pid, signal.SIGKILL)
            wait_until_gone(report.pid)

    out = tmp_path_factory.mktemp("actor-lost") / "run"
    opts = options(minilm_dir, corpus, out, checkpoint_interval=3600)
    config = build_config(None, opts)
    with pytest.MonkeyPatch.context() as mp:
        on_each_fold(mp, kill_actor)
        manifest = analyze(config, echo=lambda *_: None)
    return {"out": out, "config": config, "manifest": manifest, "killed": killed}


@pytest.fixture(scope="module")
def clean(actor_lost) -> Path:
    """The run the fault tests are compared with: :func:`actor_lost`'s, which its test finds
    equal to one process folding every shard once. (Its tables are those of a fault-free run,
    of one worker or two: they agree to 1e-9 with the float64 product,
    tests/runs/test_job_end_to_end.py; a fault-free run of its own here was one more job.)"""
    return actor_lost["out"]


def test_actor_lost_with_unflushed_shards_matches_one_process(actor_lost, ray_local):
    """The only actor is killed holding three folded, unflushed shards and a fourth in flight:
    all four are redone by its replacement, and the totals equal one process folding every
    shard once."""
    killed, manifest, config = actor_lost["killed"], actor_lost["manifest"], actor_lost["config"]
    run = actor_lost["out"]
    assert len(killed) == 1
    assert manifest["workers"]["workers_lost"] == 1
    assert manifest["workers"]["shards_requeued"] == 4  # 3 folded + the one in flight
    assert manifest["workers"]["checkpoints"] == manifest["shards"]["checkpoint_groups"] == 1

    stats, sample, counts = one_process(config)
    for name in ("documents", "windows", "tokens", "padded_tokens", "batches"):
        assert manifest["counts"][name] == getattr(counts, name), name
    ours = EmbeddingStatistics.load(run / "statistics.safetensors")
    for layer in config.layers:
        a, b = ours.layer(layer), stats.layer(layer)
        np.testing.assert_array_equal(a.type_ids, b.type_ids)
        np.testing.assert_array_equal(a.counts, b.counts)
        assert a.n == b.n == counts.tokens
        for field in ("means", "m2", "unit_sums", "mean", "comoment", "position_means"):
            np.testing.assert_allclose(getattr(a, field), getattr(b, field), rtol=1e-9, atol=1e-9)
        np.testing.assert_array_equal(a.argmax_counts, b.argmax_counts)
    our_sample = RunDir(str(run)).load_sample()
    for layer in config.layers:
        a, b = our_sample.points(layer), sample.points(layer)
        np.testing.assert_array_equal(a.keys, b.keys)
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_allclose(a.vectors, b.vectors, rtol=1e-6, atol=1e-6)


def one_process(config):
    """Every shard of the plan folded once, in order, in this process with one thread (as
    the 1-CPU actor), into one statistics object."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        proc = ShardProcessor(config.extraction, config.layers, {})
        stats, sample, counts = proc.new_statistics(), proc.new_sample(), Counts()
        for shard in plan_shards(CorpusSpec(config.corpus), config.shard_bytes).shards:
            counts.add(proc.fold_shard(shard, stats, sample))
    finally:
        torch.set_num_threads(threads)
    return stats, sample, counts


def test_driver_killed_then_resumed(tmp_path, corpus, minilm_dir, clean, ray_local):
    """Checkpoint interval 0: one group per shard. The driver is killed, the rerun resumes
    with nothing done twice and the same tables as an uninterrupted run. One group is as if
    the driver had died after writing its statistics but before its JSON (and a write of
    its was cut short): that group is redone, its stale files are cleaned, and nothing is
    counted twice. The extractors write the groups themselves (a local run on one node: each
    sees the run's directory)."""
    total = json.loads((clean / "manifest.json").read_text())["shards"]["total"]

    out = tmp_path / "killed"
    opts = options(minilm_dir, corpus, out, checkpoint_interval=0)
    argv = [sys.executable, "-m", "jobs.analyze"]
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else []
        else:
            argv += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    env = dict(os.environ, RAY_ADDRESS="")  # its own local Ray, killed with it
    proc = subprocess.Popen(
        argv,
        cwd=Path(__file__).resolve().parents[2],
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
    done_before = len(done_shards(out))
    assert 2 <= done_before < total
    # the last group: its statistics written, its JSON not; a write cut short beside it
    store = CheckpointStore(str(out))
    victim = store.completed_groups()[-1]
    (out / "groups" / f"{victim.group_id}.json").unlink()
    (out / "groups" / ".tmp-crashed-write").write_bytes(b"partial")
    assert len(done_shards(out)) == done_before - 1
    kept = done_before - 1

    manifest = analyze(build_config(None, opts), echo=lambda *_: None)
    assert manifest["shards"]["reused_from_checkpoints"] == kept
    assert manifest["shards"]["computed"] == total - kept
    names = [p.name for p in (out / "groups").iterdir()]
    assert not [n for n in names if n.startswith(".")]
    stems = {n.split(".")[0] for n in names}
    assert {f"{s}.json" for s in stems} <= set(names)  # no statistics without their JSON
    groups = store.completed_groups()
    assert len(groups) == total and all(len(g.shard_ids) == 1 for g in groups)
    assert len(done_shards(out)) == total
    assert manifest["counts"] == json.loads((clean / "manifest.json").read_text())["counts"]
    assert_same_tables(read_tables(out), read_tables(clean))
    # a local run on one node: every extractor saw the run's directory and wrote its own
    # groups (the driver committed them), before the kill and after it
    checkpoints = manifest["sizing"]["checkpoints"]
    assert checkpoints["writers"] == "extractors", checkpoints
    assert checkpoints["writers_reason"].startswith(f"every extractor's node sees {out}")
    assert_same_sample(out, clean)


# the tests on a simulated cluster, last: the tests' local Ray is shut down for it


@pytest.fixture(scope="module")
def two_nodes():
    """A simulated cluster: a head with no CPU and two nodes of 1 CPU (started once for the
    tests that need it, which run last in this module; the tests' local Ray is shut down for
    it). A test that removes a node adds another of 1 CPU: two 1-CPU nodes stay alive."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def join(cluster) -> None:
    """This process's Ray on ``cluster`` (after a test's local Ray, if one ran in between)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()


@pytest.mark.own_ray_cluster
def test_node_lost_mid_run(tmp_path, corpus, minilm_dir, clean, two_nodes, monkeypatch):
    """A node disappears while its actor holds two shards it has not checkpointed yet."""
    import ray

    cluster = two_nodes
    lost: list[FoldReport] = []

    def lose_node(report: FoldReport) -> None:
        if not lost and report.unflushed >= 2:
            lost.append(report)
            node = next(w for w in cluster.worker_nodes if w.node_id == report.node_id)
            cluster.remove_node(node, allow_graceful=False)  # a spot node disappears
            cluster.add_node(num_cpus=1)  # the autoscaler brings a new one

    on_each_fold(monkeypatch, lose_node)
    try:
        join(cluster)
        faulty_out = tmp_path / "faulty"
        opts = options(minilm_dir, corpus, faulty_out, checkpoint_interval=3600)
        manifest = analyze(build_config(None, opts), echo=lambda *_: None)
        assert lost, "no actor folded two shards"
        assert manifest["status"] == "complete"
        assert manifest["workers"]["workers_lost"] >= 1
        assert manifest["workers"]["shards_requeued"] >= 2
        assert manifest["counts"] == json.loads((clean / "manifest.json").read_text())["counts"]
        assert_same_tables(read_tables(faulty_out), read_tables(clean))
        assert_same_sample(faulty_out, clean)
    finally:
        ray.shutdown()


@pytest.mark.own_ray_cluster
def test_pool_fits_actors_on_single_nodes(minilm_dir, tmp_path, two_nodes):
    """Two 1-CPU nodes: one worker gets 1 CPU (not the cluster's 2, which no node has)."""
    import ray

    from embgeom_ray.distributed.actor_pool import plan_pool
    from embgeom_ray.errors import ConfigError

    try:
        join(two_nodes)
        assert sum(n["Alive"] for n in ray.nodes()) == 3  # the head and two 1-CPU nodes
        opts = {"model": minilm_dir, "corpus": "x", "out": str(tmp_path)}
        assert plan_pool(build_config(None, opts | {"num_workers": 1}).scheduling, 10).num_cpus == 1
        default = plan_pool(build_config(None, opts).scheduling, 10)
        assert (default.num_workers, default.num_cpus) == (2, 1)
        with pytest.raises(ConfigError, match="largest node"):
            plan_pool(build_config(None, opts | {"cpus_per_worker": 2}).scheduling, 10)
    finally:
        ray.shutdown()
