"""The extractor pool grows onto a node that joins a real cluster mid-run; and a run on a
local directory that a node joining it does not see (its own disk mounted there).

A Ray of two nodes made as a user makes one, with token authentication: ``ray start --head``
with 1 CPU, then, after the job has started, ``ray start --address`` for a second node of 1
CPU (tests/ray_processes.py starts and stops them, never ``ray stop``). The job runs on CPUs
with no ``--num-workers``, as a driver process of its own joined with ``--address``: it starts
with the one extractor the head holds and starts another on the second node when it joins.
Its counts and tables equal those of one process folding every shard once (float64
products: to 1e-9 relative); its manifest records the pool's growth. The node that joins does
not see the directory of the module's second test (its own disk mounted there), which then
runs on that node.

The job's driver is ``DRIVER`` below: the job as ``jobs.analyze`` runs it, with hooks that tell
the test when to add the node (the extraction has started: the job is sized and its pool
asked for, on the head alone) and slow the head's extractor until the second one has folded
a shard, so that the tiny model's shards are not all gone before the second node's extractor
has loaded it.
"""

from __future__ import annotations

import json
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import write_jsonl
from tests.ray_processes import (
    NODE_PORTS,
    RayNode,
    can_hide_directories,
    free_ports,
    marked_pids,
    node_args,
    ray_env,
    start_ray_node,
)
from tests.runs.test_job_end_to_end import english_documents

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 180

#: the job as ``python -m jobs.analyze`` runs it (argv: the options as JSON, the file to write
#: when the extraction starts, the seconds to slow each of the first node's shards by)
DRIVER = """
import json, sys, time
from pathlib import Path

from embgeom_ray.config import build_config
from embgeom_ray.distributed import actor_pool
from embgeom_ray.runs.pipeline import analyze

options, marker, slow = json.loads(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
actor_pool.POOL_POLL_S = 1.0  # the test's node is seen within a second of joining
real = actor_pool.run_shards
nodes, deadline = set(), time.monotonic() + 120


def run_shards(*args, on_folded=None, **kwargs):
    left = [len(args[4])]  # the shards

    def folded(report):
        on_folded(report)
        nodes.add(report.node_id)
        left[0] -= 1
        if slow and len(nodes) == 1 and time.monotonic() < deadline:
            # shards left for the joining node's extractor; the last few last longer, for a
            # machine so loaded that the node takes long to start
            time.sleep(slow if left[0] > 8 else 5 * slow)

    marker.write_text("extracting")  # sized, its pool starting: the test adds a node now
    return real(*args, on_folded=folded, **kwargs)


actor_pool.run_shards = run_shards
analyze(build_config(None, options), echo=lambda *_: None)
"""


@dataclass
class TwoNodeRay:
    """A head of 1 CPU started by the fixture, and the second node :meth:`join` starts."""

    address: str
    env: dict[str, str]
    base: Path
    work: Path
    nodes: list[RayNode] = field(default_factory=list)
    #: the directory each joined node does not see, by its ``ray start``'s pid
    hiding: dict[int, Path] = field(default_factory=dict)

    def join(self, hidden: Path | None = None) -> RayNode:
        """``ray start --address`` for a node of 1 CPU (not waited for: the job sees it
        join); ``hidden``: a local directory the node does not see (its own disk mounted
        there: :func:`~tests.ray_processes.hiding_command`)."""
        args = ["--address", self.address, *node_args(self.base / "w", free_ports(NODE_PORTS), cpus=1)]
        node = start_ray_node(
            args, self.env, self.work / "worker.log", [str(self.base)], self.work, hidden
        )
        self.nodes.append(node)
        if hidden is not None:
            self.hiding[node.proc.pid] = hidden
        return node


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[TwoNodeRay]:
    # Ray's unix sockets live under --temp-dir, their paths limited to ~107 bytes: short
    base = Path(tempfile.mkdtemp(prefix="egpool-", dir="/tmp"))
    work = tmp_path_factory.mktemp("pool")
    env = ray_env(secrets.token_hex(32))
    gcs, client, *ports = free_ports(2 + NODE_PORTS)
    args = ["--head", "--port", str(gcs), "--include-dashboard", "false",
            "--ray-client-server-port", str(client), *node_args(base / "h", ports, cpus=1)]  # fmt: skip
    head = start_ray_node(args, env, work / "head.log", [str(base)], work)
    ray = TwoNodeRay(f"127.0.0.1:{gcs}", env, base, work, [head])
    try:
        address_file = base / "h" / "ray_current_cluster"  # written once the head is up
        deadline = time.monotonic() + 120
        while not address_file.is_file() or not address_file.read_text().strip():
            if head.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray start --head did not come up:\n{head.log.read_text()}")
            time.sleep(0.2)
        yield ray
    finally:
        for node in ray.nodes:  # both drain at once; then each is waited for
            if node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)
        for node in reversed(ray.nodes):
            node.stop()
        left = marked_pids([str(base)])
        shutil.rmtree(base, ignore_errors=True)
        assert not left, f"Ray processes of the test's nodes still running: {left}"


#: a client that waits until Ray lists exactly N live nodes (argv: address, N, seconds)
WAIT_FOR_NODES = """
import os, sys, time

import ray

ray.init(address=sys.argv[1], log_to_driver=False)
count, end = int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while sum(n["Alive"] for n in ray.nodes()) != count and time.monotonic() < end:
    time.sleep(0.2)
alive = sum(n["Alive"] for n in ray.nodes())
print(alive, flush=True)
os._exit(0 if alive == count else 1)  # no shutdown to wait for
"""


def wait_for_nodes(
    ray: TwoNodeRay, count: int, timeout_s: float = 120, joining: RayNode | None = None
) -> bool:
    """Until Ray lists exactly ``count`` live nodes (a client of its own, in a process of its
    own). False, at once, if the ``joining`` node's ``ray start`` exits first."""
    client = subprocess.Popen(
        [sys.executable, "-c", WAIT_FOR_NODES, ray.address, str(count), str(timeout_s)],
        env=ray.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s + 60
    while client.poll() is None and time.monotonic() < deadline:
        if joining is not None and joining.proc.poll() is not None:
            client.kill()
            client.wait()
            return False
        time.sleep(0.2)
    if client.poll() is None:
        client.kill()
    _, err = client.communicate()
    assert client.returncode == 0, f"Ray did not list {count} live nodes:\n{err[-2000:]}"
    return True


def join_listed(ray: TwoNodeRay, count: int, hidden: Path | None = None) -> RayNode:
    """:meth:`TwoNodeRay.join`, then wait until Ray lists ``count`` live nodes. A ``ray start``
    that gives up is started once more: it waits 30 s, a constant of Ray's, for its raylet to
    register, which a machine loaded by the other tests can take longer than."""
    node = ray.join(hidden=hidden)
    if wait_for_nodes(ray, count, joining=node):
        return node
    ray.nodes.remove(node)
    node.markers = []  # its own process group only (the markers name the head's too)
    node.stop()
    node = ray.join(hidden=hidden)
    wait_for_nodes(ray, count)
    return node


def run_job(ray: TwoNodeRay, options: dict, *, slow: float = 0.0, on_start=None) -> dict:
    """The job in a driver process of its own joined to ``ray`` (``--address``); ``on_start``
    is called once its extraction has started. Returns its manifest."""
    marker = Path(options["out"] + ".extracting")
    argv = [sys.executable, "-c", DRIVER, json.dumps(options), str(marker), str(slow)]
    log = Path(options["out"] + ".log")
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=ray.env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            if on_start is not None and marker.is_file():
                on_start, _ = None, on_start()
            time.sleep(0.1)
        if proc.poll() is None:
            proc.kill()
            pytest.fail(f"the job did not end within {JOB_TIMEOUT_S} s:\n{log.read_text()}")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == 0, log.read_text()
    return json.loads((Path(options["out"]) / "manifest.json").read_text()) | {
        "_log": log.read_text()
    }


TABLES = {"type_stats": ["layer", "token_id"], "layers": ["layer"], "dims": ["layer", "dim"],
          "positions": ["layer", "position"]}  # fmt: skip


def one_process(options: dict) -> tuple[dict[str, pd.DataFrame], dict[str, int]]:
    """Every shard of the job's plan folded once, in order, in this process with one thread
    (as a 1-CPU extractor), and the exact tables of those statistics as the job's driver
    makes them (:class:`~embgeom_ray.runs.finish.StatisticsHere`); and the counts."""
    import torch

    from embgeom_ray.config import build_config
    from embgeom_ray.counts import Counts
    from embgeom_ray.inputs.corpus import CorpusSpec, plan_shards
    from embgeom_ray.inputs.extractor import ShardProcessor
    from embgeom_ray.inputs.model_loading import load_tokenizer, resolve_identity, resolve_layers
    from embgeom_ray.runs.finish import StatisticsHere

    config = build_config(None, options)
    identity, _ = resolve_identity(config.model, None, False)
    layers = resolve_layers(None, identity.num_layers)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        proc = ShardProcessor(config.extraction, layers, {})
        stats, sample, counts = proc.new_statistics(), proc.new_sample(), Counts()
        for shard in plan_shards(CorpusSpec(config.corpus), config.shard_bytes).shards:
            counts.add(proc.fold_shard(shard, stats, sample))
    finally:
        torch.set_num_threads(threads)
    tables = StatisticsHere(stats).tables(load_tokenizer(config.model, None, False), config.tables)
    names = ("documents", "windows", "tokens", "padded_tokens", "batches")
    return tables, {name: getattr(counts, name) for name in names}


@pytest.fixture(scope="module")
def hidden_runs(tmp_path_factory) -> Path | None:
    """The local directory :func:`test_a_run_on_a_disk_one_node_does_not_see` runs in, which
    the node that joins in :func:`test_the_pool_grows_onto_a_node_that_joins` does not see
    (its own disk mounted there), so that the second test runs on that node rather than
    stopping it and starting one more (a ``ray start`` and two clients waiting for the
    nodes); None where mount namespaces are not available."""
    if not can_hide_directories():
        return None
    runs = tmp_path_factory.mktemp("hidden-disk") / "runs"
    runs.mkdir()
    return runs


def test_the_pool_grows_onto_a_node_that_joins(cluster, tmp_path_factory, hidden_runs):
    from tests.tiny_models import make_tiny_bert

    tmp = tmp_path_factory.mktemp("growth")
    model = make_tiny_bert(tmp / "model")
    # 79 documents of the Python reference (up to 1,200 characters): ~80 shards of 1 KiB
    corpus = write_jsonl(tmp / "c.jsonl", english_documents(79, 1200))
    options = {
        "model": model, "corpus": corpus, "address": cluster.address, "device": "cpu",
        "cpus_per_worker": 1, "max_length": 32, "shard_bytes": 1024, "no_report": True,
        # the exact tables only: the sample's invariance to workers is
        # tests/runs/test_job_end_to_end.py's and test_sharding_invariance.py's
        "sample_size": 0, "comoment_precision": "float64",
    }  # fmt: skip

    t0 = time.monotonic()
    # the joining node does not see hidden_runs (the next test's), which this run does not use
    two = run_job(cluster, options | {"out": str(tmp / "two")}, slow=0.4,
                  on_start=lambda: cluster.join(hidden=hidden_runs))  # fmt: skip
    print(f"the run that grew took {time.monotonic() - t0:.1f} s")
    workers = two["workers"]
    assert two["status"] == "complete"
    assert (workers["num_workers"], workers["largest_workers"]) == (1, 2)
    assert workers["workers_added"] == 1 and workers["workers_lost"] == 0
    assert workers["max_workers"] is None  # no --num-workers: as many as the shards want
    started = workers["extractors"]
    assert len({e["node_id"] for e in started}) == 2, started  # both nodes ran an extractor
    assert started[0]["requested_s"] < started[1]["requested_s"]  # the second when it joined
    assert all(e["shards"] > 0 for e in started)
    assert sum(e["shards"] for e in started) == two["shards"]["total"]
    assert "extractors: 2 (+1 on node " in two["_log"]

    # every shard counted once: the counts and tables of one process folding every shard once
    # (a run on the head alone was one more job, its driver, Ray client and extractor)
    want, counts = one_process(options | {"out": str(tmp / "unused")})
    assert {name: two["counts"][name] for name in counts} == counts
    for name, keys in TABLES.items():
        got = pd.read_parquet(tmp / "two" / f"{name}.parquet").sort_values(keys)
        expected = want[name].sort_values(keys)
        assert list(got.columns) == list(expected.columns), name
        pd.testing.assert_frame_equal(got.reset_index(drop=True), expected.reset_index(drop=True),
                                      check_exact=False, rtol=1e-9, atol=0, obj=name)  # fmt: skip


@pytest.mark.skipif(not can_hide_directories(), reason="needs mount namespaces (unshare)")
def test_a_run_on_a_disk_one_node_does_not_see(cluster, tmp_path_factory, hidden_runs):
    """A node joins that does not see the run's local directory (its own empty disk mounted
    there, in a mount namespace of its own): its extractor's check turns the run to the
    driver as the one writer, and the reducers (``--reducers 2``), which read the groups and
    write the artefact there, are kept off that node, pinned to the nodes that see the run.
    Before, a reducer placed there failed on the first group it read. The tables equal one
    process's. The node is the one that joined in the test before, if it did (it does not
    see this directory); else one joins now."""
    from tests.tiny_models import make_tiny_bert

    tmp = tmp_path_factory.mktemp("hidden")
    model = make_tiny_bert(tmp / "model")
    corpus = write_jsonl(tmp / "c.jsonl", english_documents(40, 700))
    runs = hidden_runs  # the hidden node's own disk is mounted here
    live = [node for node in cluster.nodes[1:] if node.proc.poll() is None]
    if [cluster.hiding.get(node.proc.pid) for node in live] != [runs]:
        for earlier in cluster.nodes[1:]:  # the head and the hidden node alone
            earlier.markers = []  # its own processes only (the markers name every node's)
            earlier.stop()
        wait_for_nodes(cluster, 1)
        join_listed(cluster, 2, hidden=runs)
    options = {
        "model": model, "corpus": corpus, "address": cluster.address, "device": "cpu",
        "cpus_per_worker": 1, "max_length": 32, "shard_bytes": 1024, "no_report": True,
        "sample_size": 0, "comoment_precision": "float64", "reducers": 2,
    }  # fmt: skip
    out = runs / "run"
    run = run_job(cluster, options | {"out": str(out)}, slow=0.4)
    assert run["status"] == "complete"
    reduce = run["sizing"]["reduce"]
    # the hidden node, by the reduce's reason that names it (the other nodes see this disk)
    reason = reduce["reason"].split("; on the ", 1)[1]
    hidden = reason.split("(node ", 1)[1][:8]
    assert f"nodes that see {out} only: 1 of " in reason  # that node alone
    assert f" nodes do not see {out} (node {hidden}: no .out-check-" in reason
    extractors = run["workers"]["extractors"]
    assert any(e["node_id"].startswith(hidden) for e in extractors), extractors
    checkpoints = run["sizing"]["checkpoints"]
    assert checkpoints["writers"] == "driver"
    assert checkpoints["writers_reason"].startswith(f"the extractor on node {hidden} does not see")
    assert reduce["pinned"] and reduce["count"] == 2
    assert not any(n.startswith(hidden) for n in reduce["nodes"] + run["reducers"]["nodes"])
    assert run["reducers"]["nodes"] == reduce["nodes"]
    # reducers started beside the extractors, placed before the check, were stopped
    assert run["sizing"]["reducers"]["early"] >= 1
    assert run["reducers"]["started_during_extraction"] == 0
    want, counts = one_process(options | {"out": str(tmp / "unused")})
    assert {name: run["counts"][name] for name in counts} == counts
    for name, keys in TABLES.items():
        got = pd.read_parquet(out / f"{name}.parquet").sort_values(keys)
        expected = want[name].sort_values(keys)
        pd.testing.assert_frame_equal(got.reset_index(drop=True), expected.reset_index(drop=True),
                                      check_exact=False, rtol=1e-9, atol=0, obj=name)  # fmt: skip
