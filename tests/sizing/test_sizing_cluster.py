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
    # each node's object store, as Ray reports it (the plan's object-store warning)
    import ray

    stores = {n["NodeID"]: int(n["Resources"]["object_store_memory"]) for n in ray.nodes()}
    assert {n.node_id: n.object_store for n in view.nodes} == stores
    assert all(b >= 75 * 2**20 for b in stores.values())


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
                 "checkpoints: every T = B / (5% · W) s", "a node lost loses at most",
                 "  on a local path: kept to the nodes that see it, checked on every node"):  # fmt: skip
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


def test_where_the_nodes_that_see_a_run_cannot_hold_the_reducers(cluster, tmp_path, monkeypatch):
    """Where the nodes that see a local run cannot hold its reducers, one line says what to
    do, and the marker is removed; a merge of local runs has every node check the merge's
    directory and each run it reads (by its manifest). The job itself on a node that does not
    see its run: tests/distributed/test_pool_growth.py (a real node in a mount namespace)."""
    import ray

    from embgeom_ray.distributed import node_tasks
    from embgeom_ray.distributed.cluster import read_cluster
    from embgeom_ray.distributed.reducers import place_where_seen
    from embgeom_ray.runs.merge import where_seen
    from embgeom_ray.shared_out import write_marker
    from embgeom_ray.sizing import Reduce

    here = ray.get_runtime_context().get_node_id()
    real = node_tasks.nodes_not_seeing

    def only_the_drivers_node_sees(markers, nodes, **kw):
        assert real(markers, nodes, **kw) == {}  # this machine's disk: every node sees it
        return {n: "no .out-check-x in /data/run/groups" for n in nodes if n != here}

    def too_big(nodes):
        assert [n.node_id for n in nodes.nodes] == [here]
        raise ConfigError("--reducer-memory 4.8 GiB is more than the node offers")

    monkeypatch.setattr(node_tasks, "nodes_not_seeing", only_the_drivers_node_sees)
    marker_dir = tmp_path / "refused"
    with pytest.raises(ConfigError) as refused:
        place_where_seen(
            Reduce(2, GiB, 10, "f", "r"), read_cluster(), too_big, str(marker_dir),
            lambda: write_marker(str(marker_dir)), echo=lambda _: None,
        )  # fmt: skip
    message = str(refused.value)
    assert message.startswith(f"the reducers read and write {marker_dir}, and 2 of 3 nodes")
    assert "on the 1 that do: --reducer-memory 4.8 GiB is more than the node offers" in message
    assert message.endswith("or in object storage")
    assert list(marker_dir.iterdir()) == []  # the marker removed

    runs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(f'{{"run": "{name}"}}\n')
        runs.append(str(tmp_path / name))
    checked: list = []
    monkeypatch.setattr(node_tasks, "nodes_not_seeing", lambda m, n, **kw: checked.extend(m) or {})
    plain = Reduce(2, GiB, 10, "f", "r", nodes=["a", "b"])
    assert where_seen(plain, runs, str(tmp_path / "merged"), None, 0, None) == plain
    marker, *inputs = checked
    assert marker["path"].startswith(str(tmp_path / "merged" / ".out-check-"))
    assert inputs == [{"path": f"{r}/manifest.json", "nonce": f'{{"run": "{r[-1]}"}}'} for r in runs]
    assert list((tmp_path / "merged").iterdir()) == []


def test_tasks_reading_a_local_sample_run_on_a_head_without_cpus(cluster, tmp_path):
    """The sampled stage's tasks that read a local run's sample files run on the job's node,
    which sees them, even where it offers Ray no CPU (this head: ``num_cpus=0``); before, they
    went to any node, which may not see the run. A sample in object storage: anywhere."""
    from types import SimpleNamespace

    import ray

    from embgeom_ray.distributed.sample_tasks import placement

    here = ray.get_runtime_context().get_node_id()
    header = {"dim": 4, "size": 10}  # s = 20 entries (10 + 10 type-uniform): 10 · (4·s·d + 48·s)
    assert placement(SimpleNamespace(url="s3://bucket/run/groups/g.sample", header=header)) == {
        "memory": 12_800}
    where = placement(SimpleNamespace(parts=[SimpleNamespace(url=str(tmp_path / "g.sample"))],
                                      header=header))  # fmt: skip
    assert where["num_cpus"] == 0 and where["memory"] == 12_800
    assert where["scheduling_strategy"].node_id == here and not where["scheduling_strategy"].soft

    @ray.remote
    def node() -> str:
        return ray.get_runtime_context().get_node_id()

    assert ray.get(node.options(**where).remote(), timeout=60) == here
