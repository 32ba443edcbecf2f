"""What the job puts in Ray's object store at its peak (embgeom_ray.sizing.object_store): each
phase's formula, --plan's line and warning, --plan-json's ``object_store``."""

from __future__ import annotations

import json

from embgeom_ray.sizing import Cluster, CorpusShape, Node, Shape, size_job
from embgeom_ray.sizing.checkpoints import DRIVER, EXTRACTORS
from embgeom_ray.sizing.object_store import (
    after_extraction,
    extraction_bytes,
    pieces_bytes,
    selection_slots,
    share_results_bytes,
    stage_bytes,
)
from embgeom_ray.sizing.plan import describe_plan, object_store_lines

MiB = 1 << 20
MINILM = Shape(layers=7, dim=384, positions=128, vocab=30_522, hidden_states=7,
               intermediate=1536, heads=12, weight_bytes=90 * MiB, sample_entries=8192,
               sample_points=4096)  # fmt: skip


def _options():
    from embgeom_ray.config import build_config

    return build_config(None, {"model": "m", "corpus": "c", "out": "o", "device": "cpu"})


def test_the_sampled_stage_holds_every_layers_inputs_and_c_plus_one_matrices() -> None:
    """MiniLM's demo on 2 CPUs: 7 layers' inputs (8·s·d + 16·n each), 3 of the 128 MiB distance
    matrices, one selection's points for their fit tasks; measured 520 MiB (docs/sizing.md)."""
    stage = stage_bytes(7, 4096, 8192, 384, 2, hands_distances=True, sample_on_tasks=False,
                        sample=10**9)  # fmt: skip
    assert stage.inputs == 7 * (8 * 8192 * 384 + 16 * 4096) == 176_619_520
    assert stage.distances == 3 * 8 * 4096**2 == 402_653_184
    assert stage.fit_points == 1 * (12 * 4096 * 384 + 8 * 4096)  # C − 1 = 1 splits at once
    assert stage.sample == 0 and stage.on_driver_node == stage.inputs
    assert stage.total == 598_179_840
    # more CPUs than layers: every layer's matrix may wait; a sample Ray tasks handle: the
    # metrics compute their own distances, the inputs are made where the tasks run
    assert stage_bytes(7, 4096, 8192, 384, 64, True, False, 0).distances == 7 * 8 * 4096**2
    tasks = stage_bytes(81, 4096, 8192, 8192, 64, False, True, 21 << 30)
    assert tasks.distances == 0 and tasks.sample == tasks.on_driver_node == 21 << 30
    assert tasks.inputs == 81 * (8 * 8192 * 8192 + 16 * 4096)


def test_extraction_and_table_phases() -> None:
    # a spill held until its flush; where the job writes the groups, the flush's piece and
    # sample come through the store too
    assert extraction_bytes(4, 100, 10, spills=False, job_writes=False) == 0
    assert extraction_bytes(4, 100, 10, spills=True, job_writes=False) == 400
    assert extraction_bytes(4, 100, 10, spills=True, job_writes=True) == 4 * 210
    assert pieces_bytes(8192, 384, 1000, on_tasks=True) == 2 * 8192 * (4 * 384 + 96) + 1000
    assert pieces_bytes(8192, 384, 1000, on_tasks=False) == 0


def test_plan_json_and_plan_line_and_the_warning() -> None:
    corpus = CorpusShape("c", 1, 10**6, 1)
    roomy = Cluster((Node("h", 16 << 30, cpus=2, head=True, object_store=6 << 30),))
    sizing = size_job(MINILM, corpus, roomy, _options().scheduling)
    store = json.loads(json.dumps(sizing.to_json()))["object_store"]
    # one split selection's share tasks return F = 3 seedings of each k = 2..15 and S = 2
    # refits at k_max = 60, each fit n labels and k centres
    returned = (sum(3 * (8 * 4096 + 8 * k * 384) for k in range(2, 16))
                + 2 * (8 * 4096 + 8 * 60 * 384))  # fmt: skip
    assert store["peak_bytes"] == store["sampled_stage_bytes"] == 598_179_840 + returned
    assert store["sampled_stage_distances_bytes"] == 402_653_184
    assert store["sampled_stage_fit_results_bytes"] == returned
    assert store["sampled_stage_partitions_bytes"] == 0  # n·d within one process's fit
    # every term of the stage's figure, so that tooling can tell them apart
    assert store["sampled_stage_bytes"] == sum(
        store[f"sampled_stage_{k}_bytes"]
        for k in ("inputs", "distances", "fit_points", "fit_results", "partitions", "sample")
    )
    assert store["sampled_stage_fit_points_bytes"] == 12 * 4096 * 384 + 8 * 4096
    assert store["extraction_bytes"] == 0  # nothing spills: no statistics budget
    lines = "\n".join(describe_plan(sizing, corpus, checkpoint_interval=None, total_layers=7,
                                    checkpoint_writers=EXTRACTORS))  # fmt: skip
    assert "object store: ≈ 573 MiB at its peak (the sampled stage 573 MiB: every layer's " \
        "inputs L·(8·s·d + 16·n) = 168 MiB, ≤ C + 1 distance matrices 8·n² = 384 MiB" in lines
    assert "warning: Ray's object store" not in lines
    # where the job's own process writes the groups, each flush (S(V) + F and the sample)
    # comes to it through the store
    handed = object_store_lines(sizing, DRIVER)[0]
    assert handed.startswith("object store: ≈ 1.3 GiB at its peak (")
    assert "extraction N·(spills, flushes handed over) = 1.3 GiB" in handed
    small = Cluster((Node("h", 16 << 30, cpus=2, head=True, object_store=256 * MiB),))
    warned = object_store_lines(size_job(MINILM, corpus, small, _options().scheduling),
                                EXTRACTORS)
    assert warned[1] == (
        "  warning: Ray's object store: ≈ 573 MiB at its peak (sampled stage), more than the "
        "256 MiB of the cluster's object stores: Ray spills the rest to disk (slower, not "
        "fatal); lower --sample-size or --sample-type-size, or measure fewer --layers")
    # a worker's store holds the total, the job's own node not the inputs it puts
    split = Cluster((Node("h", 16 << 30, cpus=2, head=True, object_store=100 * MiB),
                     Node("w", 16 << 30, cpus=2, object_store=6 << 30)))  # fmt: skip
    warned = object_store_lines(size_job(MINILM, corpus, split, _options().scheduling),
                                EXTRACTORS)
    assert "what the job's own process puts there for the sampled stage alone (168 MiB) more " \
        "than its node's 100 MiB" in warned[1]
    # Ray does not say (0): nothing warned
    unknown = Cluster((Node("h", 16 << 30, cpus=2, head=True),))
    assert len(object_store_lines(size_job(MINILM, corpus, unknown, _options().scheduling),
                                  DRIVER)) == 1


def test_an_extraction_peak_warns_with_what_changes_the_extraction() -> None:
    """A node too small for the whole statistics: the extractor spills past σ, and its spills
    make the peak; the warning names what changes them, not the sample (which was 573 MiB of
    the 1.1 GiB); where the job's own process writes the groups, the shared --out."""
    corpus = CorpusShape("c", 1, 10**6, 1)
    small = Cluster((Node("h", 5 << 30, cpus=2, head=True, object_store=200 * MiB),))
    sizing = size_job(MINILM, corpus, small, _options().scheduling)
    assert sizing.pool.statistics is not None  # it spills
    line, warning = object_store_lines(sizing, EXTRACTORS)
    assert "extraction N·(spills, flushes handed over) = 1.1 GiB" in line
    assert "at its peak (extraction), more than the 200 MiB" in warning
    assert warning.endswith("the extractors spill their statistics past their budget σ there: "
                            "measure fewer --layers, or give each more memory (fewer "
                            "--num-workers, nodes with more)")  # fmt: skip
    assert "--sample-size" not in warning
    warning = object_store_lines(sizing, DRIVER)[1]
    assert warning.endswith("an --out every extractor's node sees has them write their own groups")


def test_no_total_warning_before_an_autoscalers_workers_join() -> None:
    """cluster.yaml's head (--num-cpus 0) alone: the workers that will run the stage, and
    their stores, have not joined, so the head's store is not "the cluster's"; what the job's
    own process puts on its node is still compared with the head's."""
    corpus = CorpusShape("c", 1, 10**6, 1)
    head_only = Cluster((Node("h", 16 << 30, cpus=0, head=True, object_store=200 * MiB),))
    sizing = size_job(MINILM, corpus, head_only, _options().scheduling)
    lines = object_store_lines(sizing, EXTRACTORS)
    assert len(lines) == 1 and lines[0].startswith("object store: ≈ 424 MiB at its peak"), lines
    tiny = Cluster((Node("h", 16 << 30, cpus=0, head=True, object_store=100 * MiB),))
    warned = object_store_lines(size_job(MINILM, corpus, tiny, _options().scheduling), EXTRACTORS)
    assert "the sampled stage alone (168 MiB) more than its node's 100 MiB" in warned[1]


def test_the_selections_that_split_are_those_their_nodes_hold_and_partitioned_fits_split_none() -> None:
    """C_s: each node's CPUs, at most as many as its Ray memory holds selections (each asks
    for its peak); the distance matrices' lag is the CPUs free (C). A layer too large for one
    process is fitted by the partitioned route: no shares, its points put whole and in
    partitions, every layer's at once."""
    cluster = Cluster((Node("a", 1000, cpus=8), Node("b", 250, cpus=4), Node("c", 10**6, cpus=0),
                       Node("d", 0, cpus=2)))  # fmt: skip
    assert selection_slots(cluster, 100) == 8 + 2 + 0 + 2
    # 3 selections at once, 9 CPUs free beside them: each may split its fits
    stage = stage_bytes(7, 4096, 8192, 384, 12, True, False, 0, slots=3, share_results=5)
    assert stage.fit_points == 3 * (12 * 4096 * 384 + 8 * 4096) and stage.fit_results == 3 * 5
    # as many selections as CPUs: one CPU must fall idle first, C − 1 at most
    full = stage_bytes(7, 4096, 8192, 384, 4, True, False, 0, slots=4, share_results=5)
    assert full.fit_points == 3 * (12 * 4096 * 384 + 8 * 4096) and full.fit_results == 3 * 5
    assert stage.distances == 7 * 8 * 4096**2  # C + 1 = 13 > L
    big = stage_bytes(7, 8192, 16384, 8192, 12, False, True, 0, slots=12, share_results=5,
                      partitioned=True)  # fmt: skip
    assert big.fit_points == big.fit_results == 0 and big.partitions == 7 * 16 * 8192 * 8192
    assert big.total == big.inputs + big.partitions
    assert share_results_bytes(4096, 384, 60, None, 2) == (
        sum(3 * (8 * 4096 + 8 * k * 384) for k in range(2, 16)) + 2 * (8 * 4096 + 8 * 60 * 384))
    # the plan's: MiniLM's selections ask 428 MiB; a node of 64 CPUs and 1 GiB runs 2 at once,
    # and both split (62 CPUs free: RayFits splits where one is); with 64 GiB, 7 layers on 64
    # CPUs: all 7 split
    two = after_extraction(MINILM, Cluster((Node("h", 1 << 30, cpus=64, head=True),)), 0, False)
    assert two.stage.fit_points == 2 * (12 * 4096 * 384 + 8 * 4096)
    roomy = after_extraction(MINILM, Cluster((Node("h", 64 << 30, cpus=64, head=True),)), 0, False)
    assert roomy.stage.fit_points == 7 * (12 * 4096 * 384 + 8 * 4096)
    # n = 8,192 of d = 8,192: past one process's fit (n·d > 4,096 · 8,192)
    wide = Shape(layers=7, dim=8192, positions=128, vocab=30_522, sample_entries=16_384,
                 sample_points=8192)  # fmt: skip
    parts = after_extraction(wide, Cluster((Node("h", 1 << 40, cpus=64, head=True),)), 0, False)
    assert parts.stage.partitions == 7 * 16 * 8192 * 8192 and parts.stage.fit_points == 0


def test_sample_tasks_that_read_local_files_return_the_inputs_on_the_jobs_node() -> None:
    """Where Ray tasks make the stage's inputs from a sample read from local files (a local
    --out; a merge of a local run), they are pinned to the job's own node
    (sample_tasks.placement), and what they return, every layer's inputs, is stored there
    beside the sample Q; from object storage they run anywhere, and that node holds Q alone."""
    wide = dict(layers=7, dim=8192, positions=128, vocab=30_522, sample_entries=16_384,
                sample_points=8192)  # fmt: skip
    cluster = Cluster((Node("h", 1 << 40, cpus=64, head=True),))
    here = after_extraction(Shape(**wide, store="/runs/r"), cluster, 0, False).stage
    anywhere = after_extraction(Shape(**wide, store="s3://b/r"), cluster, 0, False).stage
    assert here.sample and anywhere.sample == here.sample  # Ray tasks make the inputs
    assert anywhere.on_driver_node == anywhere.sample
    assert here.on_driver_node == here.inputs + here.sample
    merged = Shape(**wide, store="s3://b/ab", sample_source="/runs/a")  # a merge's local run
    assert after_extraction(merged, cluster, 0, False).stage.on_driver_node == here.on_driver_node
