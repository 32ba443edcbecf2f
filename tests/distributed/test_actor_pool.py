"""The scheduler follows the cluster: extractors start where nodes join and are not replaced
where nodes left, and every shard is checkpointed exactly once. Extractors without a model
(tests/distributed/fake_extractors.py) on the tests' local Ray, and a scripted view of the
cluster (the nodes the scheduler reads): the scheduler's part alone, in seconds. A real
cluster that gains a node mid-run: tests/distributed/test_pool_growth.py."""

from __future__ import annotations

import _thread
import itertools
import os
import signal
import threading
import time

import pytest

from embgeom_ray.distributed.actor_pool import FoldReport, Growth, PoolPlan, _Scheduler
from embgeom_ray.distributed.options import SchedulingOptions
from embgeom_ray.inputs.corpus import Shard
from embgeom_ray.sizing import Cluster, Extractor, Node
from tests.distributed.fake_extractors import FakeExtractActor

GiB = 2**30


def gone(pid: int, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if "\nState:\tZ" in open(f"/proc/{pid}/status").read():
                return
        except FileNotFoundError:
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} still alive {timeout} s after SIGKILL")


def test_the_pool_grows_as_nodes_join_and_shrinks_as_they_leave(ray_local):
    """One node of 1 CPU: one extractor. Two more nodes join after its second shard: two
    more extractors start. One of them is killed and its node leaves: the pool goes on with
    two, none started in its place; its shards are folded again by the others, and every
    shard is in exactly one flush."""
    import ray

    shards = [Shard(f"s{i:03d}", "corpus.jsonl", "jsonl", i, i + 1, 0) for i in range(60)]
    nodes = [Node("n0", 8 * GiB, cpus=1)]

    def start():
        # the first extractor slow, so that the ones added find shards left
        delay = 0.3 if not pool.extractors and not starts else 0.05
        starts.append(delay)
        return FakeExtractActor.options(num_cpus=0).remote(delay)

    def on_folded(report: FoldReport) -> None:
        folds.append(report)
        if len(folds) == 2:  # two nodes join
            nodes.extend(Node(f"n{k}", 8 * GiB, cpus=1) for k in (1, 2))
        elif not killed and pool.largest_workers == 3 and report.pid != folds[0].pid:
            killed.append(report)
            del nodes[-1]  # its node leaves
            os.kill(report.pid, signal.SIGKILL)
            gone(report.pid)

    pool = PoolPlan(num_workers=1, num_gpus=0.0, num_cpus=1)
    starts: list[float] = []
    folds: list[FoldReport] = []
    killed: list[FoldReport] = []
    groups, lines, asked = [], [], []
    growth = Growth(
        Extractor(cpus=1), None, read=lambda: Cluster(tuple(nodes)), ask=asked.append,
        say=lines.append, poll_s=0.05,
    )  # fmt: skip
    config = SchedulingOptions(checkpoint_interval=3600)  # each flushes when the queue drains
    _Scheduler(config, pool, start, shards, groups.append, on_folded, lambda _: None,
               growth=growth).run()  # fmt: skip

    flushed = sorted(s for g in groups for s in g.shard_ids)
    assert flushed == [s.shard_id for s in shards]  # each exactly once
    assert killed, "no added extractor folded a shard while three ran"
    assert len(starts) == 3  # none started in place of the one lost: its node had left
    assert (pool.num_workers, pool.largest_workers, pool.workers_added) == (1, 3, 2)
    assert (pool.workers_lost, pool.workers_waiting) == (1, 0)
    assert pool.shards_requeued >= 1
    here = ray.get_runtime_context().get_node_id()
    assert [e["node_id"] for e in pool.extractors] == [here] * 3
    assert [e["lost_s"] is not None for e in pool.extractors].count(True) == 1
    assert sum(e["shards"] for e in pool.extractors) == len(shards)
    assert all(e["requested_s"] <= e["ready_s"] for e in pool.extractors)
    grew = [line for line in lines if "+1 on node" in line]
    shrank = [line for line in lines if "-1: lost on node" in line]
    assert len(grew) == 2 and grew[-1].startswith("extractors: 3 (+1")
    assert len(shrank) == 1 and shrank[0].startswith("extractors: 2 (-1")
    # the autoscaler asked for room for the shards' pool at first (one node held one of 60),
    # asked again only when that changed (smaller as they ran out, larger when the lost
    # extractor's shards came back), and the request cleared at the end
    assert asked[0] == [{"CPU": 1.0}] * 60
    sizes = [len(a) for a in asked]
    assert all(a != b for a, b in itertools.pairwise(sizes))
    assert 0 < sizes[-2] < 60 and sizes[-1] == 0


def test_an_extractor_waiting_for_a_node_does_not_hold_the_job_up(ray_local):
    """``--num-workers 2`` where the nodes hold one: the second is asked for and waits (here:
    it asks for a resource no node has); the first runs every shard and the job ends,
    ending the one still waiting."""
    shards = [Shard(f"s{i}", "corpus.jsonl", "jsonl", i, i + 1, 0) for i in range(4)]
    started = []

    def start():
        started.append(1)
        if len(started) == 1:
            return FakeExtractActor.options(num_cpus=0).remote(0.01)
        return FakeExtractActor.options(num_cpus=0, resources={"no_such_node": 1}).remote(0.01)

    pool = PoolPlan(num_workers=2, num_gpus=0.0, num_cpus=1)
    groups = []
    # the view says two nodes: the second extractor is asked for, and cannot be placed
    view = Cluster((Node("a", GiB, cpus=1), Node("b", GiB, cpus=1)))
    growth = Growth(Extractor(cpus=1), 2, read=lambda: view, say=lambda _: None, poll_s=0.05)
    _Scheduler(SchedulingOptions(), pool, start, shards, groups.append, lambda _: None,
               lambda _: None, growth=growth).run()  # fmt: skip
    assert sorted(s for g in groups for s in g.shard_ids) == [s.shard_id for s in shards]
    assert len(started) == 2 and pool.num_workers == 2
    assert (pool.largest_workers, pool.workers_waiting) == (1, 1)


def test_the_job_says_once_that_no_node_holds_an_extractor(ray_local):
    """``--device cuda`` on a cluster of CPU nodes: the extractor asked for waits for a node
    with a GPU to join. Some seconds in (``wait_notice_s``), one line says what it asks for
    and that no node holds one; not before, and only once."""
    import pytest

    shards = [Shard(f"s{i}", "corpus.jsonl", "jsonl", i, i + 1, 0) for i in range(2)]
    view = Cluster((Node("head", 8 * GiB, cpus=4, head=True), Node("a", 8 * GiB, cpus=8)))
    lines: list[str] = []
    said: list[float] = []
    t0 = time.monotonic()

    def say(line: str) -> None:
        lines.append(line)
        said.append(time.monotonic() - t0)

    growth = Growth(Extractor(cpus=1, gpus=1, memory=2 * GiB), 1, read=lambda: view, say=say,
                    poll_s=0.05, wait_notice_s=0.5)  # fmt: skip
    pool = PoolPlan(num_workers=1, num_gpus=1.0, num_cpus=1)

    def start():  # cannot be placed, as a GPU actor on CPU nodes
        return FakeExtractActor.options(num_cpus=0, resources={"no_such_node": 1}).remote(0.01)

    # ended as Ctrl-C would, 20 polls after the line is due: no other line came by then.
    # interrupt_main does nothing where SIGINT is not Python's: a test process started in the
    # background by a non-interactive shell (`make test &`) inherits it ignored
    caller = signal.signal(signal.SIGINT, signal.default_int_handler)
    stop = threading.Timer(1.5, _thread.interrupt_main)
    stop.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            _Scheduler(SchedulingOptions(), pool, start, shards, lambda _: None, lambda _: None,
                       lambda _: None, growth=growth).run()  # fmt: skip
    finally:
        stop.cancel()
        signal.signal(signal.SIGINT, caller)
    assert len(lines) == 1 and 0.5 <= said[0] < 1.5, (lines, said)
    assert lines[0].startswith("extractors: none running 1 s into the extraction: each asks "
                               "for 1 GPU, 1 CPU and 2.0 GiB, and no node of the cluster (2 "
                               "nodes (1 head), 12 CPUs"), lines[0]  # fmt: skip
    assert "waits for a node that does to join" in lines[0]


def test_on_requested_comes_once_when_the_first_pool_is_asked_for(ray_local):
    """The warm-ups' hook (runs/pipeline.py): called once, with the pool, once the first
    pool's extractors are asked for and before any has loaded (its ``ready`` answered), not
    again when the pool grows."""
    shards = [Shard(f"s{i}", "corpus.jsonl", "jsonl", i, i + 1, 0) for i in range(6)]
    nodes = [Node("n0", 8 * GiB, cpus=1)]
    events: list[tuple[str, int]] = []
    pool = PoolPlan(num_workers=1, num_gpus=0.0, num_cpus=1)

    def start():
        events.append(("start", len(events)))
        return FakeExtractActor.options(num_cpus=0).remote(0.05)

    def on_folded(report: FoldReport) -> None:
        if len(nodes) == 1:  # a node joins: the pool grows
            nodes.append(Node("n1", 8 * GiB, cpus=1))

    growth = Growth(Extractor(cpus=1), None, read=lambda: Cluster(tuple(nodes)),
                    say=lambda _: None, poll_s=0.05)  # fmt: skip
    _Scheduler(
        SchedulingOptions(checkpoint_interval=3600), pool, start, shards, lambda _: None,
        on_folded, lambda _: None, lambda p: events.append(("ready", p.largest_workers)),
        growth=growth, on_requested=lambda p: events.append(("requested", len(p.extractors))),
    ).run()  # fmt: skip
    names = [name for name, _ in events]
    assert names.count("requested") == 1 and names.count("ready") == 1
    assert names.count("start") == 2  # the pool grew: requested was not called again
    assert names.index("start") < names.index("requested") < names.index("ready")
    assert ("requested", 0) in events  # no extractor had loaded when it came


def test_where_the_autoscaler_cannot_be_asked_extractors_wait_as_its_demand(ray_local):
    """``--num-workers 3``, the nodes holding one, and the autoscaler's request failing (as
    on a Ray Client connection): all three are asked for at once, the two no node holds
    waiting (here: for a resource no node has) as the demand that would bring nodes."""
    shards = [Shard(f"s{i}", "corpus.jsonl", "jsonl", i, i + 1, 0) for i in range(4)]
    started, asked = [], []

    def start():
        started.append(1)
        extra = {} if len(started) == 1 else {"resources": {"no_such_node": 1}}
        return FakeExtractActor.options(num_cpus=0, **extra).remote(0.01)

    def ask(bundles) -> bool:
        asked.append(bundles)
        return False  # request_resources failed

    pool = PoolPlan(num_workers=3, num_gpus=0.0, num_cpus=1)
    growth = Growth(Extractor(cpus=1), 3, read=lambda: Cluster((Node("a", GiB, cpus=1),)),
                    ask=ask, say=lambda _: None, poll_s=0.05)  # fmt: skip
    _Scheduler(SchedulingOptions(), pool, start, shards, lambda _: None, lambda _: None,
               lambda _: None, growth=growth).run()  # fmt: skip
    assert len(asked) == 1  # asked once, not again after it failed (nor to clear)
    assert len(started) == 3 and pool.num_workers == 3
    assert (pool.largest_workers, pool.workers_waiting) == (1, 2)


def test_the_autoscalers_node_groups_as_ray_shows_them(ray_local):
    """The cluster config an autoscaler reports to Ray's GCS (here written there by the test,
    as cluster.yaml's would read): its node groups, and the most extractors they hold; none
    reported, nothing tells."""
    import ray
    from ray.core.generated import autoscaler_pb2
    from ray.experimental import internal_kv

    from embgeom_ray.distributed.cluster import read_autoscaler_groups
    from embgeom_ray.sizing import NodeGroup, extractors_possible

    assert read_autoscaler_groups() is None  # a local Ray: no autoscaler reports one
    config = autoscaler_pb2.ClusterConfig()
    for name, resources, most in (("head.cpu", {"CPU": 0}, 1),
                                  ("worker.gpu", {"CPU": 8, "GPU": 1, "memory": 24 * GiB}, 8)):  # fmt: skip
        group = config.node_group_configs.add(name=name, max_count=most)
        group.resources.update(resources)
    key = ray._raylet.GCS_AUTOSCALER_CLUSTER_CONFIG_KEY.encode()
    namespace = ray._raylet.GCS_AUTOSCALER_STATE_NAMESPACE.encode()
    internal_kv._internal_kv_put(key, config.SerializeToString(), namespace=namespace)
    try:
        groups = read_autoscaler_groups()
    finally:
        internal_kv._internal_kv_del(key, namespace=namespace)
    assert groups == (
        NodeGroup("head.cpu", cpus=0, gpus=0, memory=0, max_count=1),
        NodeGroup("worker.gpu", cpus=8, gpus=1, memory=24 * GiB, max_count=8),
    )
    assert extractors_possible(groups, Extractor(cpus=1, gpus=1, memory=4 * GiB)) == 8
    assert read_autoscaler_groups() is None


def test_from_an_extractor_that_does_not_see_the_run_the_driver_writes(ray_local, tmp_path):
    """A local run whose extractors write their own flushes: the first extractor's node sees
    the run, the second's does not (its check, embgeom_ray/shared_out.py, says why). From the
    second's start on, the flushes come to the driver: ``on_unseen`` is told once, with that
    node, and every shard is still in exactly one group."""
    import functools

    from embgeom_ray.distributed import actor_pool
    from embgeom_ray.runs.checkpoints import write_group
    from tests.distributed import fake_extractors

    assert fake_extractors.WRITTEN == actor_pool.WRITTEN
    shards = [Shard(f"s{i:02d}", "corpus.jsonl", "jsonl", i, i + 1, 0) for i in range(60)]
    started: list[int] = []

    def start():
        started.append(1)
        why = None if len(started) == 1 else "no .out-check-x in /run/groups"
        return FakeExtractActor.options(num_cpus=0).remote(0.05, why)

    pool = PoolPlan(num_workers=2, num_gpus=0.0, num_cpus=1)
    groups, told = [], []
    view = Cluster((Node("a", GiB, cpus=1), Node("b", GiB, cpus=1)))
    growth = Growth(Extractor(cpus=1), 2, read=lambda: view, say=lambda _: None, poll_s=0.05)
    writer = functools.partial(write_group, str(tmp_path / "run"))
    config = SchedulingOptions(checkpoint_interval=3600)  # each flushes when the queue drains
    _Scheduler(config, pool, start, shards, groups.append, lambda _: None, lambda _: None,
               growth=growth, checkpoint_writer=writer,
               on_unseen=lambda node, why: told.append((node, why, len(groups)))).run()  # fmt: skip
    here = __import__("ray").get_runtime_context().get_node_id()
    (node, why, before), = told
    assert (node, why) == (here, "no .out-check-x in /run/groups")
    assert sorted(s for g in groups for s in g.shard_ids) == [s.shard_id for s in shards]
    assert all(g.last for g in groups)  # each flushed when the queue drained
    # every flush asked after the second extractor started came here, its own among them
    # (those before, if any, the first one wrote)
    assert len(groups) > before and all(g.written is None for g in groups[before:])
    assert all(g.written is not None for g in groups[:before])


def test_a_flushs_peak_memory_is_the_extractors_peak_where_it_is_the_larger(ray_local, tmp_path):
    """An extractor reports its peak memory with each shard's result and with each flush's:
    a flush holds its statistics and their serialised copy (the memory formula's second
    copy), and no shard follows the last flush to report that peak. Before, the manifest's
    extractor peak left out the flushes', the last one's always. Whether the extractor writes
    its flush or hands it to the driver."""
    import functools

    from embgeom_ray.runs.checkpoints import write_group

    shards = [Shard(f"s{i:02d}", "corpus.jsonl", "jsonl", i, i + 1, 0) for i in range(6)]
    view = Cluster((Node("a", GiB, cpus=1),))
    for writer in (None, functools.partial(write_group, str(tmp_path / "run"))):
        growth = Growth(Extractor(cpus=1), 1, read=lambda: view, say=lambda _: None, poll_s=0.05)
        pool = PoolPlan(num_workers=1, num_gpus=0.0, num_cpus=1)
        groups: list = []
        _Scheduler(SchedulingOptions(checkpoint_interval=3600), pool,
                   lambda: FakeExtractActor.options(num_cpus=0).remote(0.01, None, 5 << 30),
                   shards, groups.append, lambda _: None, lambda _: None, growth=growth,
                   checkpoint_writer=writer).run()  # fmt: skip
        assert len(groups) == 1 and groups[0].last  # the one flush, when the queue drained
        assert pool.extractor_peak_private_bytes == 5 << 30, writer


def test_under_a_ceiling_an_extractor_flushes_before_a_shard_would_pass_it(ray_local):
    """An extractor decides to flush only between shards, so without more its oldest unflushed
    shard ages to the interval plus a shard. Under the sized interval's ceiling (here 1 s,
    the interval itself an hour), it also flushes where one more shard of the mean length
    (0.3 s) would age the oldest past the ceiling: groups of about three shards, none held
    past the ceiling by more than a shard's jitter, where without it one group at the drain."""
    shards = [Shard(f"s{i:02d}", "corpus.jsonl", "jsonl", i, i + 1, 0) for i in range(12)]
    view = Cluster((Node("a", GiB, cpus=1),))
    config = SchedulingOptions(checkpoint_interval=3600)

    def run(ceiling: float | None) -> tuple[list, list[FoldReport]]:
        groups, folds = [], []
        growth = Growth(Extractor(cpus=1), 1, read=lambda: view, say=lambda _: None, poll_s=0.05)
        pool = PoolPlan(num_workers=1, num_gpus=0.0, num_cpus=1)
        _Scheduler(config, pool, lambda: FakeExtractActor.options(num_cpus=0).remote(0.3),
                   shards, groups.append, folds.append, lambda _: None, growth=growth,
                   ceiling=ceiling).run()  # fmt: skip
        assert sorted(s for g in groups for s in g.shard_ids) == [s.shard_id for s in shards]
        return groups, folds

    groups, folds = run(1.0)
    assert all(0.3 <= f.seconds < 1.0 for f in folds)  # each shard timed, dispatch to result
    assert len(groups) >= 4 and max(len(g.shard_ids) for g in groups) <= 3
    assert all(g.age_s <= 1.0 + 0.3 for g in groups)  # the ceiling, and at most a shard's jitter
    assert not any(g.last for g in groups[:-1])
    groups, _ = run(None)
    assert len(groups) == 1 and groups[0].last and groups[0].age_s >= 12 * 0.3


def test_a_host_tiers_piece_goes_through_the_object_store_a_block_at_a_time(ray_local, tmp_path):
    """Where the driver writes the groups, a host tier's statistics travel a block at a time:
    each block put in Ray's object store (BlockRefs), fetched one at a time as the group is
    written, into the file their bytes whole would have made."""
    import torch

    from embgeom_ray.core.statistics import EmbeddingStatistics
    from embgeom_ray.core.statistics_io import StreamedStatistics
    from embgeom_ray.counts import Counts
    from embgeom_ray.distributed.actor_pool import BlockRefs, GroupResult
    from embgeom_ray.inputs.corpus import ShardPlan
    from embgeom_ray.runs.checkpoints import CheckpointStore

    stats = EmbeddingStatistics([0, 1], 16, max_positions=4)
    g = torch.Generator().manual_seed(3)
    stats.update(torch.randn(2, 8, 4, 16, generator=g) + 1e4, torch.randint(0, 300, (8, 4), generator=g))
    piece = BlockRefs.put(StreamedStatistics(stats, 1000))
    assert len(piece.refs) > 5 and piece.size == len(stats.to_bytes())
    shards = [Shard("s0", "c.jsonl", "jsonl", 0, 1, 0)]
    store = CheckpointStore(str(tmp_path / "run"))
    store.start("fp", {}, ShardPlan(shards, "fp", 1, ["c.jsonl"]), overwrite=False)
    group = GroupResult(["s0"], [piece], None, Counts(documents=1))
    saved = store.save_group(group.shard_ids, group.pieces(), group.sample, group.counts)
    written = tmp_path / "run" / "groups" / f"{saved.group_id}.safetensors"
    assert written.read_bytes() == bytes(stats.to_bytes())


def test_an_extractor_with_a_host_tier_flushes_the_same_group_either_way(ray_local, tmp_path):
    """The extractor's own flush (the actor's body, in this process) with a host tier: where
    it writes the group itself and where it hands the pieces to the job's own process (the
    tier's statistics then go through the object store a block at a time), the group's files
    are the same bytes, those of the statistics the tier held; and after either flush the tier
    is empty and folds on."""
    import functools

    import numpy as np

    from embgeom_ray.config import build_config
    from embgeom_ray.core.statistics import EmbeddingStatistics
    from embgeom_ray.counts import Counts
    from embgeom_ray.distributed import actor_pool
    from embgeom_ray.distributed.actor_pool import GroupResult, ShardExtract
    from embgeom_ray.inputs.corpus import CorpusSpec, plan_shards
    from embgeom_ray.runs.checkpoints import CheckpointStore, GroupFiles, write_group
    from tests.conftest import write_jsonl
    from tests.tiny_models import make_tiny_bert

    model = make_tiny_bert(tmp_path / "bert")
    words = ["cat", "dog", "sat", "mat", "the", "ran", "blue", "sky", "tree", "sun", "on", "a"]
    rng = np.random.default_rng(4)
    texts = [" ".join(rng.choice(words, size=12)) + f" w{i}" for i in range(200)]
    corpus = write_jsonl(tmp_path / "c.jsonl", texts)
    plan = plan_shards(CorpusSpec(corpus), 2048)
    assert len(plan.shards) >= 3
    files = {}
    for writer in ("extractor", "driver"):
        cfg = build_config(None, {"model": model, "corpus": corpus, "out": str(tmp_path / writer),
                                  "statistics_memory": "64KiB", "host_statistics_memory": "64MiB",
                                  "max_length": 16})  # fmt: skip
        actor = ShardExtract(cfg.extraction.model_dump(), [0, 2], {}, 1)
        assert actor.processor.host_budget == 64 << 20
        store = CheckpointStore(str(tmp_path / writer))
        store.start("fp", {}, plan, overwrite=False)
        for shard in plan.shards[:2]:
            actor.process(actor_pool.dataclasses.asdict(shard))
        assert actor.stats.merges >= 2  # the spills went to the tier
        actor.stats.host.absorb(actor.stats.current)  # what the flush's take does first
        actor.stats.current.clear()
        held = bytes(actor.stats.host.merged.to_bytes())
        if writer == "extractor":
            ids, _, _, counts = actor.flush(functools.partial(write_group, str(tmp_path / writer)))
            written = GroupFiles.from_json(counts.pop(actor_pool.WRITTEN))
            group = store.commit_group(written, Counts())
        else:
            ids, pieces, sample, counts = actor.flush()
            assert isinstance(pieces[-1], actor_pool.BlockRefs)
            result = GroupResult(ids, pieces, sample, Counts())
            group = store.save_group(ids, result.pieces(), result.sample, Counts())
        files[writer] = (tmp_path / writer / "groups" / f"{group.group_id}.safetensors").read_bytes()
        assert files[writer] == held
        assert actor.stats.host.merged.num_types == 0  # released after the write
        actor.process(actor_pool.dataclasses.asdict(plan.shards[2]))
        assert actor.stats.nbytes() > 0
    assert files["extractor"] == files["driver"]
    assert EmbeddingStatistics.from_bytes(files["driver"]).token_count() > 0


def test_a_flush_hands_the_freed_heap_back_before_it_serialises(ray_local, tmp_path, monkeypatch):
    """The flush first returns what the heap keeps of the freed batches (glibc's malloc_trim),
    then serialises the statistics, so that the copy is not made beside that memory (on the
    V = 128,256 model of ``bench.self_sized`` the extractor's peak fell below what it asks:
    docs/sizing.md). After the flush the next shard releases again (what the serialisation
    freed)."""
    import numpy as np

    from embgeom_ray.config import build_config
    from embgeom_ray.distributed import actor_pool
    from embgeom_ray.distributed.actor_pool import ShardExtract
    from embgeom_ray.inputs.corpus import CorpusSpec, plan_shards
    from tests.conftest import write_jsonl
    from tests.tiny_models import make_tiny_bert

    model = make_tiny_bert(tmp_path / "bert")
    rng = np.random.default_rng(5)
    texts = [" ".join(rng.choice(["cat", "dog", "sat", "on", "a", "mat"], size=10)) for _ in range(40)]
    corpus = write_jsonl(tmp_path / "c.jsonl", texts)
    plan = plan_shards(CorpusSpec(corpus), 1024)
    assert len(plan.shards) >= 2
    cfg = build_config(None, {"model": model, "corpus": corpus, "out": str(tmp_path / "run"),
                              "max_length": 16})  # fmt: skip
    actor = ShardExtract(cfg.extraction.model_dump(), [0, 2], {}, 1)
    events: list[str] = []
    monkeypatch.setattr(actor_pool, "release_freed_memory", lambda: events.append("release"))
    actor.process(actor_pool.dataclasses.asdict(plan.shards[0]))
    assert events == []  # no flush yet: folding keeps the heap for the next batch
    take = actor.stats.take_streamed

    def taking() -> list:
        events.append("serialise")
        return take()

    monkeypatch.setattr(actor.stats, "take_streamed", taking)
    ids, pieces, _, _ = actor.flush()
    assert ids == [plan.shards[0].shard_id] and pieces
    assert events == ["release", "serialise"]
    actor.process(actor_pool.dataclasses.asdict(plan.shards[1]))
    assert events == ["release", "serialise", "release"]


@pytest.mark.parametrize("writer", ["driver", "extractors"])
def test_a_group_is_committed_only_once_its_shards_copies_matched(
    ray_local, tmp_path, monkeypatch, writer
):
    """Extractors reading another node's copy (each result carries its digest): the driver's
    checks (slow here, in their thread) are all done before the group holding their shards is
    committed, whether the driver writes the group or the extractor wrote its files itself
    (the commit, the group's JSON, is what a resume reads: checkpoints.py)."""
    import functools

    from embgeom_ray.distributed import actor_pool
    from embgeom_ray.runs.checkpoints import write_group
    from tests.distributed import fake_extractors

    assert fake_extractors.COPY == actor_pool.COPY
    checked: list[str] = []

    def check_copy(shard, copy, cancel):
        assert copy["host"] == "node-b" and not cancel.is_set()
        time.sleep(0.05)  # its group's flush comes back first
        checked.append(shard.shard_id)

    def on_group(group) -> None:
        assert set(group.shard_ids) <= set(checked), "a group committed before its checks"
        groups.append(group)

    monkeypatch.setattr(actor_pool, "check_copy", check_copy)
    shards = [Shard(f"s{i:02d}", "corpus.jsonl", "jsonl", i, i + 1, 0) for i in range(8)]
    pool = PoolPlan(num_workers=2, num_gpus=0.0, num_cpus=1)
    groups: list = []
    view = Cluster((Node("a", GiB, cpus=1), Node("b", GiB, cpus=1)))
    growth = Growth(Extractor(cpus=1), 2, read=lambda: view, say=lambda _: None, poll_s=0.05)
    write = functools.partial(write_group, str(tmp_path / "run")) if writer == "extractors" else None
    config = SchedulingOptions(checkpoint_interval=0)  # a group a shard
    _Scheduler(config, pool, lambda: FakeExtractActor.options(num_cpus=0).remote(0.0, None, 0, "node-b"),
               shards, on_group, lambda _: None, lambda _: None, growth=growth,
               checkpoint_writer=write).run()  # fmt: skip
    assert sorted(s for g in groups for s in g.shard_ids) == [s.shard_id for s in shards]
    assert sorted(checked) == [s.shard_id for s in shards]
    assert all((g.written is not None) == (writer == "extractors") for g in groups)


def test_a_lost_extractors_reading_of_another_copy_is_still_checked(ray_local, monkeypatch):
    """An extractor on a node whose copy is other (its check fails, slowly) is lost before its
    flush; its shard is read again on another node, whose check passes. Its first check is
    not dropped by the second (a check is kept for every reading): the run ends with its
    error, whichever finishes first, and no group is committed."""
    from embgeom_ray.distributed import actor_pool
    from embgeom_ray.errors import CorpusError

    redone = threading.Event()

    def check_copy(shard, copy, cancel):
        if copy["host"] == "node-a":
            assert redone.wait(60), "the shard was not read again"
            raise CorpusError(f"{shard.shard_id}: node-a's copy is other")

    def on_folded(report: FoldReport) -> None:
        folds.append(report)
        if len(folds) == 2:
            redone.set()

    monkeypatch.setattr(actor_pool, "check_copy", check_copy)
    started: list[int] = []

    def start():
        started.append(1)
        first = len(started) == 1
        host = "node-a" if first else "node-b"
        return FakeExtractActor.options(num_cpus=0).remote(0.0, None, 0, host, first)

    shards = [Shard("s00", "corpus.jsonl", "jsonl", 0, 1, 0)]
    pool = PoolPlan(num_workers=1, num_gpus=0.0, num_cpus=1)
    groups: list = []
    folds: list[FoldReport] = []
    view = Cluster((Node("a", GiB, cpus=1),))
    growth = Growth(Extractor(cpus=1), 1, read=lambda: view, say=lambda _: None, poll_s=0.05)
    scheduler = _Scheduler(SchedulingOptions(checkpoint_interval=3600), pool, start, shards,
                           groups.append, on_folded, lambda _: None, growth=growth)  # fmt: skip
    with pytest.raises(CorpusError, match="s00: node-a's copy is other"):
        scheduler.run()
    assert groups == [] and len(folds) == 2 and pool.workers_lost == 1
    assert scheduler.checks_cancelled.is_set()
