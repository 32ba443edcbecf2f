"""Two failures at once, on a real cluster of two nodes (``ray start --head``, then ``ray start
--address``: tests/ray_processes.py starts and kills them, never ``ray stop``); the job's
driver in a process of its own joined with ``--address``, as in
tests/distributed/test_pool_growth.py. Each run's tables must equal the float64 reference
(tests/reference.py):

1. the job's own process and the worker node are killed (SIGKILL) at once, after the run has
   checkpointed some groups; the same command, run again, resumes on the head alone (the
   node still missing);
2. a node joins again; in a run with ``--reducers 2``, the worker node is killed while its
   extractor holds shards it has not checkpointed, and a reducer is killed as the reduce
   reads its first group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import write_jsonl
from tests.distributed.test_pool_growth import REPO, TwoNodeRay, cluster  # noqa: F401 (fixture)
from tests.ray_processes import kill_marked
from tests.reference import reference_tables
from tests.runs.test_job_end_to_end import assert_tables_close, english_documents

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

#: the job as ``python -m jobs.analyze`` runs it, with hooks (argv: the options as JSON, a
#: directory for the markers it writes, whether to kill a reducer, whether to wait for the
#: worker node): it writes ``worker-folded`` once an extractor of another node than its own
#: has folded a shard, then holds that report up to 5 s, until the test, which kills the node
#: meanwhile, writes ``node-killed`` (or kills this process); until then, its own node's extractor is slowed (the tiny model's shards would
#: all be gone before the worker's extractor has loaded it); with the reducer hook, it kills
#: reducer 0 as the reduce first waits for it to load.
DRIVER = """
import json, sys, time
from pathlib import Path

import ray

from embgeom_ray.config import build_config
from embgeom_ray.distributed import actor_pool, reducers
from embgeom_ray.runs.pipeline import analyze

options, marks, kill_reducer = json.loads(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1"
wait = sys.argv[4] == "1"
real_run, real_get = actor_pool.run_shards, reducers.PartitionedStatistics._get
held, deadline = [], time.monotonic() + 90


def run_shards(*args, on_folded=None, **kwargs):
    here = ray.get_runtime_context().get_node_id()

    def folded(report):
        on_folded(report)
        if report.node_id != here and not held:
            held.append(report)
            (marks / "worker-folded").write_text(report.node_id)
            end = time.monotonic() + 5  # the test kills the node (or this process) now
            while not (marks / "node-killed").exists() and time.monotonic() < end:
                time.sleep(0.05)
        elif wait and not held and time.monotonic() < deadline:
            time.sleep(1.0)  # shards left for the worker node's extractor

    return real_run(*args, on_folded=folded, **kwargs)


def get(self, r, ref, method, *args):
    if kill_reducer and method == "load" and not (marks / "reducer-killed").exists():
        (marks / "reducer-killed").write_text(str(r))
        ray.kill(self.actors[r], no_restart=True)
    return real_get(self, r, ref, method, *args)


actor_pool.run_shards = run_shards
reducers.PartitionedStatistics._get = get
analyze(build_config(None, options), echo=print)
"""


def start_driver(
    ray: TwoNodeRay, options: dict, marks: Path, kill_reducer: bool = False, wait: bool = True
):
    marks.mkdir(parents=True, exist_ok=True)
    log = marks / "driver.log"
    argv = [sys.executable, "-c", DRIVER, json.dumps(options), str(marks),
            "1" if kill_reducer else "0", "1" if wait else "0"]  # fmt: skip
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=ray.env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    return proc, log


def wait_for(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no {path.name} (driver {proc.poll()}):\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the job did not end within {timeout} s:\n{log.read_text()[-3000:]}")
    assert proc.returncode == 0, log.read_text()[-3000:]


def kill_node(ray: TwoNodeRay) -> None:
    """The worker node dies: every process of it SIGKILLed, as a spot node goes. Its Ray
    workers too, found as the node's descendants before the kill: they are not in the
    group of ``ray start`` and their names (``ray::Extractor``…) do not hold the node's
    directory, so neither ``killpg`` nor :func:`kill_marked` reached them, and an extractor
    kept folding the driver's shards and flushed them after its raylet was gone (once the
    driver's hold ended right after the kill, with no fault left for the run to recover)."""
    import psutil

    node = ray.nodes.pop()
    tree = psutil.Process(node.proc.pid).children(recursive=True)
    os.killpg(node.proc.pid, signal.SIGKILL)
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    node.proc.wait(timeout=30)
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, alive  # nothing of the node left to answer the driver
    kill_marked(node.markers[-1:], node.proc.pid)


def tables(out: Path) -> dict[str, pd.DataFrame]:
    return {t: pd.read_parquet(out / f"{t}.parquet") for t in ("type_stats", "layers", "dims")}


def test_two_failures_at_once_on_a_real_cluster(cluster, tmp_path_factory):  # noqa: F811
    from tests.tiny_models import make_tiny_bert

    tmp = tmp_path_factory.mktemp("two-faults")
    model = make_tiny_bert(tmp / "model")
    docs = [d.encode("ascii", "ignore").decode() for d in english_documents(40, 700)]
    docs = [d for d in docs if d.strip()]
    corpus = write_jsonl(tmp / "c.jsonl", docs)
    reference = reference_tables(model, docs, max_length=32)
    options = {
        "model": model, "corpus": corpus, "address": cluster.address, "device": "cpu",
        "cpus_per_worker": 1, "max_length": 32, "shard_bytes": 1024, "no_report": True,
        "sample_size": 0, "comoment_precision": "float64",
    }  # fmt: skip
    # the worker node: every node of this cluster lives in the fixture's base directory, so
    # each node's own markers are its temp dir
    cluster.join()
    cluster.nodes[-1].markers.append(str(cluster.base / "w"))

    # 1. the driver and the worker node killed at once, after checkpoints; resumed without it
    out = tmp / "resumed"
    opts = options | {"out": str(out), "checkpoint_interval": 0}
    proc, log = start_driver(cluster, opts, tmp / "marks-1")
    wait_for(tmp / "marks-1" / "worker-folded", proc, log)
    groups = out / "groups"
    deadline = time.monotonic() + 60
    while len(list(groups.glob("*-n1.json"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)  # the job's own process
    kill_node(cluster)  # and the worker node, at once
    proc.wait(timeout=30)
    done = len(list(groups.glob("*.json")))
    assert done >= 2 and json.loads((out / "manifest.json").read_text())["status"] == "running"
    proc, log = start_driver(cluster, opts, tmp / "marks-1b", wait=False)
    finish(proc, log)
    manifest = json.loads((out / "manifest.json").read_text())
    shards = manifest["shards"]
    assert shards["reused_from_checkpoints"] == done
    assert shards["reused_from_checkpoints"] + shards["computed"] == shards["total"]
    assert "resuming" in log.read_text()
    assert_tables_close(tables(out), reference, rtol=1e-5, cos_atol=1e-6)

    # 2. a node joins again; the worker node and a reducer killed in one run
    cluster.join()
    cluster.nodes[-1].markers.append(str(cluster.base / "w"))
    out = tmp / "node-and-reducer"
    opts = options | {"out": str(out), "reducers": 2, "checkpoint_interval": 3600}
    proc, log = start_driver(cluster, opts, tmp / "marks-2", kill_reducer=True)
    wait_for(tmp / "marks-2" / "worker-folded", proc, log)
    kill_node(cluster)  # its extractor holds the shard it folded, unflushed
    (tmp / "marks-2" / "node-killed").write_text("")  # the driver's hold ends
    finish(proc, log)
    assert (tmp / "marks-2" / "reducer-killed").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["workers"]["workers_lost"] >= 1 and manifest["workers"]["shards_requeued"] >= 1
    assert sum(manifest["reducers"]["restarts"]) >= 1
    assert_tables_close(tables(out), reference, rtol=1e-5, cos_atol=1e-6)
