"""The job sizes itself on a simulated cluster (``ray.cluster_utils.Cluster``: nodes of
different memory, fake GPUs of a named accelerator type): Ray's view is read as given, the
reducers land where the policy places them, ``--plan`` prints the decisions the run then
records, and what cannot fit is refused before anything is written."""

from __future__ import annotations

import json

import pytest

from embgeom_ray.config import build_config
from embgeom_ray.errors import ConfigError
from tests.conftest import write_jsonl
from tests.ray_processes import free_ports

pytestmark = [pytest.mark.slow, pytest.mark.own_ray_cluster, pytest.mark.timeout(600)]

GiB = 2**30


@pytest.fixture(scope="module")
def cluster():
    """A head of 6 GiB and no CPUs, a CPU node of 5 GiB and a GPU node of 3 GiB with two fake
    H100s (Ray's ``memory`` resources as given here)."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    (port,) = free_ports(1)
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "memory": 6 * GiB, "gcs_server_port": port, "include_dashboard": False},
    )
    c.add_node(num_cpus=2, memory=5 * GiB)
    c.add_node(num_cpus=1, num_gpus=2, memory=3 * GiB, resources={"accelerator_type:H100": 2})
    try:
        ray.init(address=c.address, log_to_driver=False)
        c.wait_for_nodes()
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def test_ray_view_of_the_cluster(cluster):
    from embgeom_ray.distributed.cluster import read_cluster

    view = read_cluster()
    got = sorted((n.head, n.memory, n.cpus, n.gpus, n.gpu_type) for n in view.nodes)
    assert got == [
        (False, 3 * GiB, 1, 2, "H100"),
        (False, 5 * GiB, 2, 0, None),
        (True, 6 * GiB, 0, 0, None),
    ]
    gpu_node = next(n for n in view.nodes if n.gpus)
    assert gpu_node.gpu_memory == 80 * 10**9


def test_plan_is_what_the_run_records_and_reducers_land_where_placed(cluster, tmp_path):
    """``--plan`` and then the run, on the same cluster: the run's manifest holds the plan's
    decisions; its two reducers run on the nodes the policy placed them on (the two with the
    most memory left: the CPU node, then the head less the job's own share)."""
    from embgeom_ray.runs.pipeline import analyze
    from tests.runs.test_job_end_to_end import english_documents
    from tests.tiny_models import make_tiny_bert

    model = make_tiny_bert(str(tmp_path / "model"))
    corpus = write_jsonl(tmp_path / "c.jsonl", english_documents(12, 300))
    # a sample of 16 points: drawn and sized (Q), too small for the sampled metrics' tasks
    # (MIN_SAMPLE_POINTS; those are tested in tests/core/test_sampled_metrics.py)
    opts = {"model": model, "corpus": corpus, "out": str(tmp_path / "run"), "device": "cpu",
            "reducers": 2, "sample_size": 16, "kmeans_k_max": 3, "no_report": True,
            "shard_bytes": 1024, "max_length": 32}  # fmt: skip
    lines: list[str] = []
    planned = analyze(build_config(None, opts | {"plan": True}), echo=lines.append)
    assert not (tmp_path / "run").exists()  # the plan writes nothing
    text = "\n".join(lines)
    for what in ("extractors:", "memory each:", "reducers: 2 actor(s)", "token ranges:",
                 "driver (the job's own process)", "flush:", "checkpoint groups on disk:",
                 "artefact:", "tables (before compression):",
                 "checkpoints: every T = B / (5% · W) s", "a node lost loses at most"):  # fmt: skip
        assert what in text, what
    manifest = analyze(build_config(None, opts), echo=lambda *_: None)
    recorded = dict(manifest["sizing"])
    reduce = recorded.pop("reduce")
    checkpoints = recorded.pop("checkpoints")  # measured by the run, by the plan's rule
    assert checkpoints["share"] == 0.05 and checkpoints["flushes"] >= 1
    # the simulated nodes share this machine's disk: each extractor wrote its own groups
    assert checkpoints["writers"] == "extractors", checkpoints
    assert recorded == json.loads(json.dumps(planned))
    # the CPU node hosts the extractors (the head has no CPUs, the GPU node's actors would
    # need CUDA: --device cpu), each asking Ray for what the plan says
    assert manifest["workers"]["memory_bytes"] == planned["extractors"]["memory"]
    assert manifest["memory"]["extractor_peak_private_bytes"] <= planned["extractors"]["memory"]
    # the reducers: two, started with the extractors where both fit, on the nodes placed
    assert manifest["reducers"]["count"] == 2 == reduce["count"]
    assert manifest["reducers"]["started_during_extraction"] == planned["reducers"]["early"] == 2
    assert reduce["nodes"] == planned["reducers"]["early_nodes"]
    assert manifest["reducers"]["nodes"] == reduce["nodes"]
    budget = manifest["reducers"]["memory_budget_bytes"]
    # the budget for the types seen, within what the reducers started early asked for
    assert budget == reduce["memory"] <= planned["reducers"]["memory"]
    assert all(p <= budget for p in manifest["memory"]["reducer_peak_private_bytes"])
    # placed one at a time where most memory is left: the head (6 GiB less the job's own
    # 1.5 GiB) before the CPU node (5 GiB less the extractor's), then by what is left
    from embgeom_ray.distributed.cluster import read_cluster
    from embgeom_ray.sizing import DRIVER_ALLOWANCE_BYTES, DRIVER_BASE_BYTES

    nodes = {n.node_id: n for n in read_cluster().nodes}
    room = {i: n.memory - (DRIVER_BASE_BYTES + DRIVER_ALLOWANCE_BYTES if n.head else 0)
            for i, n in nodes.items()}  # fmt: skip
    cpu_node = next(i for i, n in nodes.items() if n.cpus == 2)
    room[cpu_node] -= planned["extractors"]["memory"]
    for node in reduce["nodes"]:
        assert room[node] == max(room.values())
        room[node] -= budget


def test_what_cannot_fit_is_refused_before_anything_is_written(cluster, tmp_path):
    from embgeom_ray.runs.pipeline import analyze
    from tests.tiny_models import make_tiny_bert

    model = make_tiny_bert(str(tmp_path / "model"))
    corpus = write_jsonl(tmp_path / "c.jsonl", ["the cat sat on the mat"] * 4)
    out = tmp_path / "run"
    base = {"model": model, "corpus": corpus, "out": str(out), "device": "cpu", "max_length": 32}
    for extra, match in (
        ({"reducer_memory": "8GiB"}, "--reducer-memory .* more than any node"),
        ({"worker_memory": "7GiB"}, "--worker-memory .* more than any node"),
        ({"reducers": 40}, "--reducers 40: each needs"),
        ({"cpus_per_worker": 4}, "--cpus-per-worker 4 exceeds"),
    ):
        with pytest.raises(ConfigError, match=match):
            analyze(build_config(None, base | extra), echo=lambda *_: None)
        with pytest.raises(ConfigError, match=match):  # --plan says the same
            analyze(build_config(None, base | extra | {"plan": True}), echo=lambda *_: None)
        assert not out.exists()


def test_each_node_checks_that_it_sees_a_local_run(cluster, tmp_path):
    """:func:`nodes_not_seeing` asks every node but the driver's, one pinned task each: on this
    machine the simulated nodes share its disk and see the marker; once it is gone (a disk
    that only the driver's node mounts, seen from the others), each other node says why."""
    import ray

    from embgeom_ray.distributed.node_tasks import nodes_not_seeing
    from embgeom_ray.shared_out import file_marker, remove_marker, write_marker

    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    here = ray.get_runtime_context().get_node_id()
    marker = write_marker(str(tmp_path / "run" / "groups"))
    manifest = tmp_path / "manifest.json"
    manifest.write_text('{"status": "complete"}')
    read = file_marker(str(manifest))
    assert nodes_not_seeing([marker, read], nodes) == {}
    manifest.write_text('{"status": "running"}')  # what the nodes read is not what was read
    others = nodes_not_seeing([marker, read], nodes)
    assert sorted(others) == sorted(n for n in nodes if n != here) and len(others) == 2
    assert all("differs from the job's" in why for why in others.values())
    remove_marker(marker)
    hidden = nodes_not_seeing([marker], nodes)
    assert sorted(hidden) == sorted(n for n in nodes if n != here) and len(hidden) == 2
    name = marker["path"].rsplit("/", 1)[1]
    assert all(why == f"no {name} in {tmp_path / 'run' / 'groups'}" for why in hidden.values())


def test_reducers_run_only_where_the_local_run_is_seen(cluster, tmp_path, monkeypatch):
    """A run on a local path that only the driver's node sees (its own disk): the reducers,
    which read the groups and write the artefact there, are sized again on that node and
    pinned to it; those started beside the extractors, placed before the check, are stopped.
    The tables equal those of the reduce in the job's own process. Where the nodes that see
    the run cannot hold the reduce, one line says what to do."""
    import pandas as pd
    import ray

    from embgeom_ray.distributed import node_tasks
    from embgeom_ray.distributed.cluster import read_cluster
    from embgeom_ray.distributed.reducers import place_where_seen
    from embgeom_ray.run_dir import TABLES
    from embgeom_ray.runs.pipeline import analyze
    from embgeom_ray.shared_out import write_marker
    from embgeom_ray.sizing import Reduce
    from tests.runs.test_job_end_to_end import english_documents
    from tests.tiny_models import make_tiny_bert

    here = ray.get_runtime_context().get_node_id()
    real = node_tasks.nodes_not_seeing
    asked: list[list[str]] = []

    def only_the_drivers_node_sees(markers, nodes, **kw):
        assert real(markers, nodes, **kw) == {}  # this machine's disk: every node sees it
        asked.append(list(nodes))
        return {n: "no .out-check-x in /data/run/groups" for n in nodes if n != here}

    monkeypatch.setattr(node_tasks, "nodes_not_seeing", only_the_drivers_node_sees)
    model = make_tiny_bert(str(tmp_path / "model"))
    corpus = write_jsonl(tmp_path / "c.jsonl", english_documents(12, 300))
    opts = {"model": model, "corpus": corpus, "device": "cpu", "sample_size": 16,
            "kmeans_k_max": 3, "no_report": True, "shard_bytes": 1024, "max_length": 32}  # fmt: skip
    lines: list[str] = []
    out = tmp_path / "run"
    manifest = analyze(build_config(None, opts | {"out": str(out), "reducers": 2}), echo=lines.append)
    assert len(asked) == 1 and len(asked[0]) == 3
    (line,) = [x for x in lines if x.startswith("reducers: on the 1 nodes that see")]
    assert "2 of 3 nodes do not see" in line and "no .out-check-x in /data/run/groups" in line
    reduce = manifest["sizing"]["reduce"]
    assert reduce["pinned"] and reduce["count"] == 2 and reduce["nodes"] == [here, here]
    assert manifest["reducers"]["nodes"] == [here, here]
    assert manifest["reducers"]["started_during_extraction"] == 0
    assert not list(out.rglob(".out-check-*"))  # the markers removed
    whole = tmp_path / "whole"
    analyze(build_config(None, opts | {"out": str(whole), "reducers": 1}), echo=lambda *_: None)
    written = [n for n in TABLES if (whole / f"{n}.parquet").exists()]
    assert written == [n for n in TABLES if (out / f"{n}.parquet").exists()]
    assert {"type_stats", "layers", "dims"} <= set(written)
    for name in written:
        pd.testing.assert_frame_equal(
            pd.read_parquet(out / f"{name}.parquet"), pd.read_parquet(whole / f"{name}.parquet"),
            check_exact=False, rtol=1e-9, atol=0,
        )  # fmt: skip

    def too_big(nodes):
        assert [n.node_id for n in nodes.nodes] == [here]
        raise ConfigError("--reducer-memory 4.8 GiB is more than the node offers")

    view = read_cluster()
    marker_dir = tmp_path / "refused"
    with pytest.raises(ConfigError) as refused:
        place_where_seen(
            Reduce(2, GiB, 10, "f", "r", nodes=[]), view, too_big, str(marker_dir),
            lambda: write_marker(str(marker_dir)),
            echo=lambda _: None,
        )  # fmt: skip
    message = str(refused.value)
    assert message.startswith(f"the reducers read and write {marker_dir}, and 2 of 3 nodes")
    assert "on the 1 that do: --reducer-memory 4.8 GiB is more than the node offers" in message
    assert message.endswith("or in object storage")
    assert list(marker_dir.iterdir()) == []  # the marker removed

    # a merge of local runs: every node checks the output directory and each run it reads
    from embgeom_ray.runs.merge import where_seen

    checked: list = []
    monkeypatch.setattr(node_tasks, "nodes_not_seeing", lambda m, n, **kw: checked.extend(m) or {})
    plain = Reduce(2, GiB, 10, "f", "r", nodes=["a", "b"])
    assert where_seen(plain, [str(out), str(whole)], str(tmp_path / "merged"), None, 0, None) == plain
    marker, *inputs = checked
    assert marker["path"].startswith(str(tmp_path / "merged" / ".out-check-"))
    assert [m["path"] for m in inputs] == [str(out / "manifest.json"), str(whole / "manifest.json")]
    assert inputs[0]["nonce"] == (out / "manifest.json").read_text().strip()
