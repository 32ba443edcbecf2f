"""Reducer actors (distributed/reducers.py): statistics partitioned by token id and layer.

The tables built from R reducers' partial sums must equal the tables of the unpartitioned merge
to float64 rounding, for any R, also when a reducer is lost mid-run; the partitioned artefact
loads back into the whole statistics exactly; and the job with ``--reducers`` gives the same
tables as without.
"""

from __future__ import annotations

import shutil
import time

import numpy as np
import pandas as pd
import pytest
import torch

from embgeom_ray.config import JobConfig
from embgeom_ray.core.statistics import EmbeddingStatistics
from embgeom_ray.core.tables import build_tables, build_tables_from
from embgeom_ray.distributed.reducers import (
    PartitionedStatistics,
    PartitionPlan,
    pinned_node,
    reducers_for,
    seen_type_ids,
)
from embgeom_ray.errors import ConfigError
from embgeom_ray.run_dir import RunDir, load_statistics_part, statistics_type_ids
from embgeom_ray.runs.finish import RunStatistics, StatisticsHere
from tests.conftest import start_local_ray
from tests.core.test_partials import Tokenizer, assert_tables_close
from tests.core.test_statistics import assert_same_state

LAYERS = (0, 2, 5)
D, VOCAB = 6, 40


def test_partition_plan_covers_every_id_and_layer_once():
    plan = PartitionPlan.of(3, 100, [0, 2, 5, 6])
    assert plan.ranges == ((0, 34), (34, 68), (68, None))
    assert plan.state_layers == ((0, 6), (2,), (5,))
    assert [plan.owner(x) for x in (0, 2, 5, 6)] == [0, 1, 2, 0]
    # more reducers than layers: some hold per-type rows only
    plan = PartitionPlan.of(4, 10, [3])
    assert plan.ranges == ((0, 3), (3, 6), (6, 9), (9, None))
    assert plan.state_layers == ((3,), (), (), ())
    with pytest.raises(ValueError):
        PartitionPlan.of(0, 10, [3])


def test_balanced_plan_gives_every_reducer_the_same_number_of_seen_types():
    """Frequent low ids (a BPE vocabulary) would load the first even range: the balanced
    plan cuts at quantiles of the ids seen."""
    seen = np.array([*range(0, 50), *range(1000, 1010), 5000, 9000])  # 62 ids
    plan = PartitionPlan.balanced(3, seen, [0, 4])
    assert plan.ranges == ((0, 21), (21, 42), (42, None))
    held = [sum(lo <= t and (hi is None or t < hi) for t in seen) for lo, hi in plan.ranges]
    assert held == [21, 21, 20]
    assert plan.state_layers == ((0,), (4,), ())
    assert (
        PartitionPlan.balanced(4, np.array([3, 7]), [1]).ranges
        == PartitionPlan.of(4, 8, [1]).ranges
    )


def test_a_pinned_reducer_restarts_on_another_node_that_sees_the_run_only_when_its_own_is_gone():
    nodes = ["a", "b", "a"]  # reducers 0 and 2 on node a, reducer 1 on node b
    assert [pinned_node(nodes, r, {"a", "b"}) for r in range(3)] == ["a", "b", "a"]
    assert [pinned_node(nodes, r, {"b", "x"}) for r in range(3)] == ["b", "b", "b"]
    assert [pinned_node(nodes, r, {"a"}) for r in range(3)] == ["a", "a", "a"]
    assert pinned_node(nodes, 1, {"x"}) == "b"  # none left: its own, which Ray refuses


def test_reducer_memory_gives_the_fewest_reducers_that_fit():
    """``--reducer-memory``: the fewest R whose largest reducer (⌈V/R⌉ types' rows and ⌈L/R⌉
    layers' state, 8-byte numbers) fits three times over in the budget beside the process's
    own 512 MiB; too small a budget for even one layer's state is refused with what it takes."""
    base = 512 * 2**20

    def need(r: int, layers: int, d: int, types: int, positions: int) -> int:
        share = -(-types // r)
        rows = 8 * (layers * share * (2 * d + 2) + share)
        state = 8 * -(-layers // r) * (d * d + 3 * d + positions * (d + 1) + 2)
        return base + 3 * (rows + state)

    for layers, d, types, positions in [(2, 384, 500, 48), (33, 4096, 66_000, 128), (7, 64, 3, 8)]:
        for r_want in (1, 2, 3, 5):
            budget = need(r_want, layers, d, types, positions)
            got = reducers_for(budget, layers, d, types, positions)
            assert got <= r_want and need(got, layers, d, types, positions) <= budget
            if got > 1:
                assert need(got - 1, layers, d, types, positions) > budget
    assert reducers_for(need(1, 2, 384, 500, 48), 2, 384, 500, 48) == 1
    assert reducers_for(need(2, 2, 384, 500, 48), 2, 384, 500, 48) == 2
    one_layer = base + 3 * 8 * (384 * 384 + 3 * 384 + 48 * 385 + 2)
    with pytest.raises(ConfigError, match=f"{one_layer:,} bytes"):
        reducers_for(one_layer - 1, 2, 384, 0, 48)


def test_a_reducer_memory_no_node_offers_is_refused(tmp_path, ray_local):
    urls, _ = group_files(tmp_path, False, 0.0)
    with pytest.raises(ConfigError, match="more than any node"):
        PartitionedStatistics(PartitionPlan.of(2, VOCAB, LAYERS), urls, memory=2**60)


def group_files(
    tmp_path, clip: bool, offset: float, seed: int = 7, groups: int = 3
) -> tuple[list[str], EmbeddingStatistics]:
    """Three checkpoint groups (one extractor flush each) as files, and their merge in order."""
    rng = np.random.default_rng(seed)
    urls, whole = [], None
    for g in range(groups):
        stats = EmbeddingStatistics(
            list(LAYERS), D, max_positions=8, clip_dims=[1] if clip else None,
            metadata={"model_fingerprint": "m"},
        )  # fmt: skip
        h = rng.normal(size=(len(LAYERS), 6, 8, D)) + offset
        h[1, ..., 1] += 25.0
        ids = np.minimum(rng.geometric(0.08, size=(6, 8)) - 1, VOCAB + 3)  # a few ids ≥ V
        keep = rng.random((6, 8)) > 0.1
        stats.update(torch.as_tensor(h), torch.as_tensor(ids), torch.as_tensor(keep))
        url = str(tmp_path / f"group-{g}.safetensors")
        stats.save(url)
        urls.append(url)
        whole = stats if whole is None else whole.merge(EmbeddingStatistics.load(url))
    return urls, whole


@pytest.fixture(scope="module")
def reducer_sets(tmp_path_factory, _ray_session):
    """Reducers over :func:`group_files` by (reducers, clip, offset, balanced plan), started
    once for the module: each reducer is a fresh process that imports torch and pandas (Ray
    never gives an actor a worker that ran a task), so the tests that only read reducers share
    them. A test that kills one leaves it restored (``PartitionedStatistics`` restarts it)."""
    import ray

    made: dict[tuple, tuple[list[str], EmbeddingStatistics, PartitionedStatistics]] = {}

    def get(reducers: int, clip: bool, offset: float, balanced: bool):
        key = (reducers, clip, offset, balanced)
        if key not in made:
            if not ray.is_initialized():
                start_local_ray()
            urls, whole = group_files(tmp_path_factory.mktemp("groups"), clip, offset)
            plan = (
                PartitionPlan.balanced(reducers, whole.state_dict()["type_ids"], LAYERS)
                if balanced
                else PartitionPlan.of(reducers, VOCAB, LAYERS)
            )
            made[key] = urls, whole, PartitionedStatistics(plan, urls)
        return made[key]

    try:
        yield get
    finally:
        for *_, parts in made.values():
            parts.close()


@pytest.mark.parametrize(("reducers", "clip", "offset", "balanced"), [(1, False, 0.0, False), (2, True, 1e4, True), (3, True, 0.0, False), (5, False, 0.0, True)])  # fmt: skip
def test_reducers_give_the_tables_of_the_whole(
    tmp_path, reducer_sets, reducers, clip, offset, balanced
):
    urls, whole, parts = reducer_sets(reducers, clip, offset, balanced)
    options = JobConfig(model="m", corpus="c", out="o", min_count=2).tables
    seen = np.unique(np.concatenate([EmbeddingStatistics.read_type_ids(u) for u in urls]))
    np.testing.assert_array_equal(seen, whole.state_dict()["type_ids"])
    assert parts.plan == (
        PartitionPlan.balanced(reducers, seen, LAYERS)
        if balanced
        else PartitionPlan.of(reducers, VOCAB, LAYERS)
    )
    got = parts.tables(Tokenizer, options)
    in_process = StatisticsHere(whole)  # the whole's tables: build_tables
    assert_tables_close(got, in_process.tables(Tokenizer, options))
    # each layer analysed on its owner: bit for bit what the driver computed from the state
    here = build_tables_from(
        parts.layer_states(), lambda la, mean: parts.summaries(la, mean, 2), Tokenizer, options
    )
    for name in ("type_stats", "layers", "dims", "positions"):
        pd.testing.assert_frame_equal(got[name], here[name], check_exact=True)
    assert parts.token_count() == whole.token_count()
    assert parts.nonfinite() == {x: whole.layer(x).nonfinite for x in LAYERS}
    # the finishing steps ask the same of both (RunStatistics), and get the same answers
    members = {n for n in vars(RunStatistics) if not n.startswith("_")}
    members |= set(RunStatistics.__annotations__)
    assert all(hasattr(parts, n) and hasattr(in_process, n) for n in members)
    assert (in_process.layers, in_process.token_count(), in_process.nonfinite()) == (
        parts.layers, parts.token_count(), parts.nonfinite()
    )  # fmt: skip
    assert not in_process.partitioned
    assert (in_process.describe(), in_process.peak_memory()) == (None, [])
    assert parts.partitioned and parts.describe()["count"] == reducers
    assert len(parts.peak_memory()) == reducers
    # the partitioned artefact loads back into the whole, exactly
    run = RunDir(str(tmp_path / "run"))
    run.save_artefacts(parts)
    assert run.has_statistics()
    back = run.load_statistics()
    assert back.partition is None
    assert_same_state(back, whole)


def test_a_lost_reducer_is_restored_and_the_tables_are_the_same(reducer_sets):
    import ray

    urls, whole, parts = reducer_sets(3, True, 0.0, False)
    options = JobConfig(model="m", corpus="c", out="o", min_count=2).tables
    ray.kill(parts.actors[1])  # holds a token range and layer 2's state
    got = parts.tables(Tokenizer, options)
    assert parts.restarts == [0, 1, 0]
    # lost while loading: restored once, the groups read once (not twice)
    dead = parts.actors[0]
    ray.kill(dead)
    with pytest.raises(ray.exceptions.RayActorError):  # wait until it is gone
        for _ in range(100):
            ray.get(dead.peak_memory.remote())
            time.sleep(0.1)
    assert parts._get(0, dead.load.remote(urls), "load") is None
    assert parts.restarts == [1, 1, 0]
    assert_tables_close(parts.tables(Tokenizer, options), got)
    assert_tables_close(got, build_tables(whole, Tokenizer, options))


def test_reducers_started_before_the_plan_give_the_same_tables(tmp_path, ray_local):
    """Reducers started before the plan is known (as the job starts its ``--reducers`` while
    the extractors run) get it before reading: the same tables as reducers started with it.
    One of them lost before it got its plan is started again; started ones beyond R end."""
    import ray

    from embgeom_ray.distributed.reducers import start_reducers

    urls, whole = group_files(tmp_path, True, 1e4)
    options = JobConfig(model="m", corpus="c", out="o", min_count=2).tables
    started = start_reducers(4)
    assert ray.get(started[3].peak_memory.remote())["rss"] > 0  # running, no plan yet
    ray.kill(started[1])
    plan = PartitionPlan.balanced(3, whole.state_dict()["type_ids"], LAYERS)
    parts = PartitionedStatistics(plan, urls, started=started)
    try:
        assert parts.actors[0] is started[0] and parts.actors[2] is started[2]
        assert parts.restarts == [0, 1, 0] and parts.describe()["started_during_extraction"] == 3
        assert parts.read == [3, 3, 3]
        assert_tables_close(
            parts.tables(Tokenizer, options), build_tables(whole, Tokenizer, options)
        )
        with pytest.raises(ray.exceptions.RayActorError):  # the fourth was not needed
            for _ in range(100):
                ray.get(started[3].peak_memory.remote())
                time.sleep(0.1)
    finally:
        parts.close()


def test_reducers_checkpoint_and_a_lost_one_replays_only_what_follows(tmp_path, ray_local):
    """Reducers checkpoint their partitions (here after every group); a reducer lost after
    loading comes back from its checkpoint without reading a group again, and reducers
    started over a longer list of groups (a resumed driver) read only the groups their
    checkpoints do not cover; a checkpoint of another plan is not used. Tables as the whole's."""
    import ray

    urls, whole = group_files(tmp_path, True, 1e4)
    options = JobConfig(model="m", corpus="c", out="o", min_count=2).tables
    want = build_tables(whole, Tokenizer, options)
    plan = PartitionPlan.of(3, VOCAB, LAYERS)
    ckpt = {"checkpoint_dir": str(tmp_path / "reducers"), "checkpoint_seconds": 0.0}
    first = PartitionedStatistics(plan, urls[:2], **ckpt)
    try:
        assert first.restored == [0, 0, 0] and first.read == [2, 2, 2]
    finally:
        first.close()
    files = sorted(p.name for p in (tmp_path / "reducers").iterdir())
    assert "reducer-0001.2.rows.safetensors" in files and "reducer-0001.1.rows.safetensors" not in files  # fmt: skip
    parts = PartitionedStatistics(plan, urls, **ckpt)
    try:
        assert parts.restored == [2, 2, 2] and parts.read == [1, 1, 1]
        ray.kill(parts.actors[1])
        assert_tables_close(parts.tables(Tokenizer, options), want)
        assert parts.restarts == [0, 1, 0]
        assert parts.describe()["sources_restored_from_checkpoints"] == [2, 3, 2]
        assert parts.describe()["sources_read"] == [1, 0, 1]
    finally:
        parts.close()
    other = PartitionedStatistics(PartitionPlan.of(2, VOCAB, LAYERS), urls, **ckpt)
    try:
        assert other.restored == [0, 0] and other.read == [3, 3]
        assert_tables_close(other.tables(Tokenizer, options), want)
    finally:
        other.close()


def test_a_whole_artefact_replaces_a_partitioned_one(tmp_path, reducer_sets):
    _, whole, parts = reducer_sets(2, True, 1e4, True)
    run = RunDir(str(tmp_path / "run"))
    assert run.save_artefacts(parts) == ["statistics/"]
    assert run.save_artefacts(whole) == ["statistics.safetensors"]
    assert not (tmp_path / "run" / "statistics").exists()
    assert_same_state(run.load_statistics(), whole)


def test_a_partitioned_artefact_is_intact_only_as_its_digests_record(tmp_path, reducer_sets):
    """``RunDir.statistics_intact`` (what lets a stopped re-tabulation start again from the
    artefact) of a ``statistics/`` directory: its index's recorded digest, then every part's
    bytes as the index records them; nothing recorded, a flipped bit or a part missing: no."""
    _, _, parts = reducer_sets(2, True, 1e4, True)
    out = tmp_path / "run"
    recorded = {"statistics/index.json": parts.save(str(out / "statistics"))}
    assert RunDir(str(out), recorded).statistics_intact()
    assert not RunDir(str(out)).statistics_intact()  # no digest to check it against
    files = sorted(p for p in (out / "statistics").iterdir() if p.name != "index.json")
    assert len(files) == 4  # each reducer's rows and per-layer state
    data = files[-1].read_bytes()
    files[-1].write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert not RunDir(str(out), recorded).statistics_intact()
    files[-1].write_bytes(data)
    assert RunDir(str(out), recorded).statistics_intact()
    files[-1].unlink()
    assert not RunDir(str(out), recorded).statistics_intact()


def test_a_partitioned_artefact_reads_back_any_part(tmp_path, reducer_sets):
    """``load_statistics_part`` on a ``statistics/`` directory cut by 3 reducers gives, for
    parts cut anywhere else (other ranges, layer subsets, per-layer state or not), exactly
    what selecting them from the whole gives, reading only the files that meet the part."""
    urls, whole, parts = reducer_sets(3, True, 0.0, False)
    parts.save(str(tmp_path / "statistics"))
    directory = str(tmp_path / "statistics")
    np.testing.assert_array_equal(statistics_type_ids(directory), whole.state_dict()["type_ids"])
    for layers, token_range, state in [
        (None, (0, None), True),  # everything: a whole again
        ([2, 5], (5, 20), False),  # across the cut at 14
        ([0], (13, 15), True),
        (None, (30, None), False),  # the last file's range and beyond V
        ([5], (0, 0), True),  # per-layer state only
        (None, (50, 60), False),  # no row there
    ]:
        got = load_statistics_part(directory, layers, token_range, layer_state=state)
        want = whole.select(layers, token_range, layer_state=state)
        assert got.partition == want.partition, (layers, token_range, state)
        assert_same_state(got, want)
    # a file reads the same way (load_part)
    assert_same_state(
        load_statistics_part(urls[0], [2], (3, 9), layer_state=False),
        EmbeddingStatistics.load(urls[0]).select([2], (3, 9), layer_state=False),
    )


def test_reducers_merge_runs_cut_into_other_partitions(tmp_path, reducer_sets):
    """The merge of runs partition by partition: one run's artefact cut by 3 reducers, the
    other whole; 2 reducers with other ranges read their parts of both and give the tables
    (and, saved and read back, the statistics) of the merge of everything. (The first run is
    a reducer set of the module's, not 3 reducers of its own; the other, a group of other
    numbers.)"""
    urls, _, first = reducer_sets(3, True, 0.0, False)
    (other,), _ = group_files(tmp_path, True, 0.0, seed=8, groups=1)
    whole = EmbeddingStatistics.load(urls[0])  # the fixture's merge is left as it is
    for url in [*urls[1:], other]:
        whole = whole.merge(EmbeddingStatistics.load(url))
    options = JobConfig(model="m", corpus="c", out="o", min_count=2).tables
    assert first.plan == PartitionPlan.of(3, VOCAB, LAYERS)
    first.save(str(tmp_path / "a" / "statistics"))
    sources = [str(tmp_path / "a" / "statistics"), other]
    seen = seen_type_ids(sources)
    np.testing.assert_array_equal(seen, whole.state_dict()["type_ids"])
    merged = PartitionedStatistics(PartitionPlan.balanced(2, seen, LAYERS), sources)
    try:
        assert merged.plan.ranges[0][1] not in (14, 27)  # cut elsewhere than the first run
        assert_tables_close(merged.tables(Tokenizer, options), build_tables(whole, Tokenizer, options))
        run = RunDir(str(tmp_path / "merged"))
        run.save_artefacts(merged)
        assert_same_state(run.load_statistics(), whole, rtol=1e-12, comoment_rtol=1e-12)
    finally:
        merged.close()


def test_closed_reducers_wait_for_their_memory_only_before_the_stage(monkeypatch):
    """``close(wait=True)`` (finish_run, before the sampled stage) waits until Ray has the
    reducers' memory back; the callers' ``close()`` on an error's or a SIGTERM's way out
    waited too (up to 2 s asking busy reducers what they hold, then the memory's wait),
    delaying the exit that ``ray job stop`` allows a few seconds. Closed, they are asked
    nothing more, and closing again stops nothing."""
    from embgeom_ray.distributed import reducers

    stops: list[tuple[list[str], float]] = []
    monkeypatch.setattr(reducers, "stop_reducers", lambda a, w=0.0: stops.append((list(a), w)))
    for wait, waited in ((False, 0.0), (True, reducers.STOP_WAIT_S)):
        merged = object.__new__(PartitionedStatistics)
        merged.actors, merged.closed = ["r0", "r1"], False
        merged.close(wait=wait)
        merged.close(wait=wait)
        assert [s for s in stops if s[0]] == [(["r0", "r1"], waited)]  # again: none stopped
        with pytest.raises(RuntimeError, match="stopped"):
            merged.peak_memory()
        stops.clear()


def test_the_reducers_stop_waits_for_their_memory_not_for_another_jobs(ray_local, monkeypatch):
    """``stop_reducers`` waits until Ray's view of the nodes has the reducers' memory back
    (the sampled stage sizes its tasks by it). The view is each node's free memory, which
    other jobs take too: one taking some after the view was read held every stop to the end
    of its wait (30 s in the job; measured on a local Ray). It now ends soon after the
    reducers are gone."""
    from embgeom_ray.distributed import reducers, sample_tasks

    each = 64 * 2**20
    real = sample_tasks.free_memory
    first, second = reducers.start_reducers(2, memory=each)  # their starts overlap
    (node, _), _ = ray_local.get([first.held.remote(), second.held.remote()])
    before = real()[node]
    reducers.stop_reducers([first], 20.0)
    assert real()[node] >= before + each  # back in the view when the stop returns

    reads: list[int] = []

    def taken() -> dict[str, float]:  # another job's actor takes 256 MiB once it was read
        reads.append(1)
        return {n: b - (0 if len(reads) == 1 else 4 * each) for n, b in real().items()}

    monkeypatch.setattr(sample_tasks, "free_memory", taken)
    t0 = time.monotonic()
    reducers.stop_reducers([second], 20.0)
    assert time.monotonic() - t0 < reducers.SETTLED_S + 5, len(reads)


def alive_reducers() -> set[str]:
    """The ids of this Ray job's reducer actors not dead (Ray's own actor table)."""
    import ray
    from ray._private.state import actors

    job = ray.get_runtime_context().get_job_id()
    return {i for i, a in actors().items() if a["ActorClassName"] == "Reducer"
            and a["State"] != "DEAD" and a["JobID"] == job}  # fmt: skip


@pytest.mark.slow
def test_the_job_with_reducers_equals_the_job_without(tmp_path, ray_local, minilm_dir, monkeypatch):
    from embgeom_ray.runs import finish
    from embgeom_ray.runs.pipeline import analyze
    from tests.runs.test_job_end_to_end import LIGHT_SAMPLED, english_documents, run_job

    # the reducers are stopped, and Ray has their memory back, before the sampled stage
    # starts (they lived through it, holding a node's Ray memory its tasks asked for); the
    # module's other reducers (reducer_sets) are not the jobs'
    stage, at_stage, others = finish.add_sampled_metrics, [], alive_reducers()

    def recording(*args, **kwargs):
        at_stage.append((alive_reducers() - others, ray_local.available_resources().get("memory"),
                         ray_local.cluster_resources().get("memory")))  # fmt: skip
        return stage(*args, **kwargs)

    monkeypatch.setattr(finish, "add_sampled_metrics", recording)

    docs = english_documents(8, 400)  # 3 KB: 2 shards of 2 KB, so 2 checkpoint groups
    opts = {"max_length": 48, "shard_bytes": 2048, "layers": [0, 6], "sample_size": 128}
    opts["comoment_precision"] = "float64"
    opts |= LIGHT_SAMPLED  # the sampled stage is the same with and without reducers
    _, one = run_job(tmp_path, minilm_dir, docs, "r1", "c.jsonl", **opts)
    # reducers checkpoint after every group, and the checkpoints are kept (for the resume below)
    ckpt = {"checkpoint_interval": 0, "keep_checkpoints": True}
    manifest, three = run_job(
        tmp_path, minilm_dir, docs, "r3", "c.jsonl", reducers=3, **opts, **ckpt
    )
    assert "statistics/" in manifest["outputs"]["artefacts"]
    (alive, free, total), *_ = at_stage[1:]  # the job with reducers
    assert alive == set() and free == total, at_stage
    assert manifest["reducers"]["memory_budget_bytes"] > 0  # each had asked Ray for memory
    groups = manifest["shards"]["checkpoint_groups"]
    assert groups > 1 and manifest["reducers"]["sources_read"] == [groups] * 3
    assert manifest["reducers"]["count"] == 3 and manifest["reducers"]["restarts"] == [0, 0, 0]
    assert manifest["reducers"]["state_layers"] == [[0], [6], []]
    # the three reducers were started while the extractors ran
    assert manifest["reducers"]["started_during_extraction"] == 3
    peaks = manifest["memory"]["reducer_peak_rss_bytes"]
    assert len(peaks) == 3 and all(50 * 2**20 < p < 8 * 2**30 for p in peaks)
    assert manifest["memory"]["driver_peak_rss_bytes"] > 100 * 2**20
    assert manifest["memory"]["extractor_peak_rss_bytes"] > 100 * 2**20
    # the private heap (Linux RssAnon, sampled) is part of the resident set
    for who in ("driver", "extractor"):
        private = manifest["memory"][f"{who}_peak_private_bytes"]
        assert 10 * 2**20 < private <= manifest["memory"][f"{who}_peak_rss_bytes"]
    assert all(0 < p <= r for p, r in zip(manifest["memory"]["reducer_peak_private_bytes"],
                                          peaks, strict=True))  # fmt: skip
    for name in ("type_stats", "layers", "dims", "positions", "samples"):
        a, b = one[name], three[name]
        if name == "samples":
            a, b = a.drop(columns=["vector"]), b.drop(columns=["vector"])
        pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-9, atol=1e-12)
    # two extractions (their own flushes): the same statistics to rounding
    whole = RunDir(str(tmp_path / "r1")).load_statistics()
    assert_same_state(RunDir(str(tmp_path / "r3")).load_statistics(), whole, 1e-12, 1e-12)
    # a driver lost after the reduce: the rerun resumes, and the reducers come back from their
    # checkpoints without reading a group again
    out = tmp_path / "r3"
    for path in [out / "manifest.json", *out.glob("*.parquet")]:
        path.unlink()
    shutil.rmtree(out / "statistics")
    again = analyze(JobConfig(**(manifest["config"] | {"overwrite": False})), echo=lambda *_: None)
    tables = {name: pd.read_parquet(out / f"{name}.parquet") for name in ("type_stats", "layers", "dims")}  # fmt: skip
    assert again["shards"]["computed"] == 0
    assert again["reducers"]["sources_restored_from_checkpoints"] == [groups] * 3
    assert again["reducers"]["started_during_extraction"] == 0  # nothing left to extract
    assert again["reducers"]["sources_read"] == [0, 0, 0]
    assert at_stage[2][0] == set(), at_stage  # the resumed run's reducers stopped too
    for name in ("type_stats", "layers", "dims"):
        pd.testing.assert_frame_equal(tables[name], three[name], check_exact=False, rtol=1e-12)
    # a table option changed: the partitioned run is re-tabled on reducers (never whole in the
    # job's process), to the exact tables of the one-process run's statistics
    from transformers import AutoTokenizer

    config = JobConfig(**(again["config"] | {"overwrite": False, "min_count": 3}))
    m3 = analyze(config, echo=lambda *_: None)
    assert m3["reducers"]["count"] == 3 and "statistics/" in m3["outputs"]["artefacts"]
    assert m3["config"]["min_count"] == 3 and m3["shards"]["computed"] == 0
    got = pd.read_parquet(out / "layers.parquet")
    want = build_tables(whole, AutoTokenizer.from_pretrained(minilm_dir), config.tables)["layers"]
    assert not got["norm_variance_corr"].equals(three["layers"]["norm_variance_corr"])
    pd.testing.assert_frame_equal(
        got[list(want.columns)], want, check_exact=False, rtol=1e-9, atol=1e-12
    )
    # --reducer-memory: as many reducers as the budget needs for the types seen (here 2). The
    # run resumes r3's checkpoint groups (copied without its outputs and reducer checkpoints):
    # the reduce is sized from the types the groups hold, as after an extraction
    types = one["type_stats"]["token_id"].nunique()
    per_layer = 384 * 384 + 3 * 384 + 48 * 385 + 2
    share = -(-types // 2)
    budget = 512 * 2**20 + 3 * (8 * (2 * share * (2 * 384 + 2) + share) + 8 * per_layer)
    rm = tmp_path / "rm"
    shutil.copytree(out, rm, ignore=shutil.ignore_patterns("manifest.json", "*.parquet", "statistics", "reducers"))  # fmt: skip
    options = manifest["config"] | {"out": str(rm), "reducers": None, "reducer_memory": budget}
    m2 = analyze(JobConfig(**(options | {"overwrite": False})), echo=lambda *_: None)
    two = {name: pd.read_parquet(rm / f"{name}.parquet") for name in ("type_stats", "layers", "dims")}  # fmt: skip
    assert m2["shards"]["computed"] == 0 and m2["shards"]["checkpoint_groups"] == groups
    assert m2["reducers"]["count"] == 2 and m2["reducers"]["memory_budget_bytes"] == budget
    assert m2["config"]["reducer_memory"] == budget and "statistics/" in m2["outputs"]["artefacts"]
    for name in ("type_stats", "layers", "dims"):
        pd.testing.assert_frame_equal(two[name], one[name], check_exact=False, rtol=1e-9, atol=1e-12)  # fmt: skip
