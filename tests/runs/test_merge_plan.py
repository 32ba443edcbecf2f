"""A merge's plan and sizing of its sampled stage, which runs as an analysis's does: the same
line (embgeom_ray.sizing.plan.sampled_task_lines) and the same refusal, from the merged
sample's size and the sampled options (no Ray: the cluster is given)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from embgeom_ray.config import build_config
from embgeom_ray.errors import ConfigError
from embgeom_ray.runs import merge
from embgeom_ray.sizing import Cluster, Node, size_reduce
from embgeom_ray.sizing.plan import sample_task_lines, sampled_task_lines

MiB = 1 << 20
PROBE = SimpleNamespace(dim=384, max_positions=128, clip_dims=None)


def _config(**options):
    return build_config(None, {"model": "m", "corpus": "c", "out": "o", **options})


def test_the_merge_plan_has_the_sampled_stage_line() -> None:
    config = _config(sample_size=4096, silhouette_max_points=1024)
    shape = merge.merge_shape(PROBE, list(range(7)), config, 30_522)
    tasks = shape.sampled_tasks()
    assert (tasks.n, tasks.d, tasks.m) == (4096, 384, 1024)  # the merge's options, not defaults
    cluster = Cluster((Node("h", 16 << 30, cpus=2, head=True),))
    lines = merge.describe_merge_plan(shape, size_reduce(shape, 3000, cluster, config.scheduling),
                                      ["r1", "r2"])  # fmt: skip
    assert lines[-1] == sampled_task_lines(shape)[0]
    assert lines[-1].startswith("sampled-stage tasks: a layer's K-means selection ≈ ")
    assert "1,024 × 1,024 distances of a subsample, d = 384" in lines[-1]
    # a sample large enough for Ray tasks (d = 8,192): their line too, as an analysis's
    wide = merge.merge_shape(SimpleNamespace(dim=8192, max_positions=128, clip_dims=None),
                             list(range(7)), config, 30_522)  # fmt: skip
    lines = merge.describe_merge_plan(wide, size_reduce(wide, 300, cluster, config.scheduling),
                                      ["r1", "r2"], cluster)  # fmt: skip
    assert lines[-3:-1] == sample_task_lines(wide, cluster) + sampled_task_lines(wide)
    assert lines[-3].startswith("sample tasks: one Ray task a layer merges that layer's sample")
    # and Ray's object store, as an analysis's (no extraction): every layer's inputs, made by
    # the sample's tasks from the sample put once: 7 · (8·s·d + 16·n) + 12·n·d and what its
    # share tasks return (one split selection on 2 CPUs: 3 seedings of k = 2..15 and the 2
    # refits at k ≤ 60, each 8·n + 8·k·d: 31 MiB) + Q
    assert lines[-1].startswith("object store: ≈ 5.7 GiB at its peak (the sampled stage 5.7 GiB: "
                                "every layer's inputs L·(8·s·d + 16·n) = 3.5 GiB, the fits' "
                                "points ≤ min(C_s, C − 1) · 12·n·d = 384 MiB and what their share "
                                "tasks return 31 MiB, the sample Q = 1.8 GiB;")  # fmt: skip
    # no stage (--sample-size 0): no line
    none = merge.merge_shape(PROBE, list(range(7)), _config(sample_size=0), 30_522)
    assert not any("sampled-stage" in line for line in merge.describe_merge_plan(
        none, size_reduce(none, 3000, cluster, config.scheduling), ["r1", "r2"]))  # fmt: skip


@pytest.fixture
def small_node(monkeypatch) -> None:
    """A private local Ray of one 300 MiB node with 2 CPUs, whose runs saw 3,000 types."""
    from embgeom_ray.distributed import cluster as ray_cluster
    from embgeom_ray.distributed import reducers

    small = Cluster((Node("h", 300 * MiB, cpus=2, head=True),))
    monkeypatch.setattr(ray_cluster, "connect", lambda address: None)
    monkeypatch.setattr(ray_cluster, "read_cluster", lambda: small)
    monkeypatch.setattr(ray_cluster, "started_private_local", lambda: True)
    monkeypatch.setattr(reducers, "seen_type_ids", lambda urls: np.arange(3000))


def test_a_merge_refuses_a_sampled_stage_no_node_holds(small_node) -> None:
    """As an analysis's plan does: the task would wait for ever on this cluster."""
    config = _config(sample_size=4096)
    shape = merge.merge_shape(PROBE, list(range(7)), config, 30_522)
    with pytest.raises(ConfigError, match=r"K-means tasks need ≈ 428 MiB each .* more than the "
                       r"300 MiB of Ray memory of the largest node with a CPU"):  # fmt: skip
        merge.size_merge([], shape, config, echo=lambda line: None)


def test_a_merge_sizes_the_sample_its_runs_hold_not_the_sample_size(small_node) -> None:
    """Runs over corpora smaller than their --sample-size hold fewer points: the merged sample
    has what they have (bottom-k of their union), and the stage is sized, and refused, for
    that, not for --sample-size; without every run's counts, for the options'."""
    config = _config(sample_size=4096)
    runs = [{"uniform_points": 300, "type_uniform_points": 250},
            {"uniform_points": 400, "type_uniform_points": 350}]  # fmt: skip
    shape = merge.merge_shape(PROBE, list(range(7)), config, 30_522, runs)
    assert (shape.sample_points, shape.sample_entries) == (700, 700 + 600)
    assert shape.sampled_tasks().n == 700
    merge.size_merge([], shape, config, echo=lambda line: None)  # fits: nothing refused
    # a run that does not say: the options' sample, refused on this node as before
    unknown = merge.merge_shape(PROBE, list(range(7)), config, 30_522, [runs[0], None])
    assert (unknown.sample_points, unknown.sample_entries) == (4096, 8192)
    with pytest.raises(ConfigError, match="K-means tasks need"):
        merge.size_merge([], unknown, config, echo=lambda line: None)
    # runs whose samples together hold more: --sample-size
    many = [{"uniform_points": 4000, "type_uniform_points": 4000}] * 2
    assert merge.merge_shape(PROBE, list(range(7)), config, 30_522, many).sample_points == 4096


def test_a_merge_of_local_runs_sizes_the_sample_tasks_on_the_jobs_node_whatever_out() -> None:
    """The merged sample is read from the runs: where one is local, its tasks run on the job's
    own node (they read its files), even with --out in object storage, so the plan refuses
    them there, where they would be refused at the stage after the statistics were merged
    (the plan sized them by --out, on any node); runs in object storage, on any node."""
    from embgeom_ray.sizing.decisions import stage_task_refusal

    config = _config(out="s3://bucket/ab")
    wide = SimpleNamespace(dim=8192, max_positions=128, clip_dims=None)
    cluster = Cluster((Node("h", 1 << 30, cpus=2, head=True), Node("w", 64 << 30, cpus=16)))
    local = merge.merge_shape(wide, list(range(7)), config, 128_256, (), ["/d/a", "s3://b/b"])
    assert local.sample_local and local.sample_source == "/d/a"
    refused = stage_task_refusal(local, cluster, ())
    assert refused is not None and "more than the 1.0 GiB of Ray memory of the job's own node" in refused
    remote = merge.merge_shape(wide, list(range(7)), config, 128_256, (), ["s3://b/a", "s3://b/b"])
    assert not remote.sample_local and stage_task_refusal(remote, cluster, ()) is None
