"""The memory of the sampled stage's per-layer Ray tasks (embgeom_ray.sizing.sampled_tasks): the
formula against the arrays the code allocates and against a process's peak RSS, the refusal
of a task that no node holds, the plan's line."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from bench.sampled_task_memory import points
from embgeom_ray.core.kmeans_selection import distinct_distances, scan_ks, select_k
from embgeom_ray.core.lloyd import Points
from embgeom_ray.core.options import SampledOptions
from embgeom_ray.core.tables import sampled_options, sampled_row, sampled_selection
from embgeom_ray.distributed.sampled_stage import capped, stage_tasks, task_memory_cap
from embgeom_ray.errors import ConfigError
from embgeom_ray.sizing import Cluster, Node, Shape
from embgeom_ray.sizing.decisions import sampled_task_refusal
from embgeom_ray.sizing.sampled_tasks import (
    SampledTasks,
    kmeans_task_bytes,
    kmeans_task_terms,
    metrics_task_bytes,
    metrics_task_terms,
)

MiB = 1 << 20


def test_terms_are_the_arrays_the_code_allocates() -> None:
    n, d = 200, 16
    X, _, _ = points(n, d)
    terms = kmeans_task_terms(n, d, 4096, 60)
    gram, D = distinct_distances(X, None, 4096)
    # the Gram matrix, the distances and point_silhouettes' float32 copy: 20 n²
    assert terms["matrices"] == gram.nbytes + D.nbytes + D.astype(np.float32).nbytes == 20 * n * n
    km = select_k(X, silhouette_max_points=4096)
    # the indicators and their product with the distances: (n, Σ k) float32 each
    width = sum(len(np.unique(p)) for p in km.partitions.values())
    assert width == sum(scan_ks(60)) == 582
    assert terms["silhouettes"] == 2 * 4 * n * width
    Xc = X - X.mean(axis=0)
    assert terms["points"] >= 2 * Xc.nbytes + Points(Xc).Xf.nbytes  # two centred copies, float32
    # a subsample of m < n points: scikit-learn's m × m distances and their float32 copy
    assert kmeans_task_terms(n, d, 50, 60)["matrices"] == 12 * 50 * 50
    metrics = metrics_task_terms(n, d, 4096, 20, own_distances=False)
    assert metrics["matrices"] == 20 * n * n  # chord distances, the types' block and its sums
    assert metrics_task_terms(n, d, 4096, 20, own_distances=True)["matrices"] == 28 * n * n


def test_formula_bounds_the_traced_allocations() -> None:
    """tracemalloc sees numpy's arrays (not BLAS's buffers: the RSS test below does): the peak
    of each task's work lies within its formula, and not far below it."""
    n, d = 256, 16
    X, tokens, types = points(n, d)
    kmeans_options, row_options = sampled_options(SampledOptions(), n)
    sampled_selection(X[:64], None, sampled_options(SampledOptions(), 64)[0])  # libraries
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        km, D = sampled_selection(X, None, kmeans_options)
        selection = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        sampled_row(X, tokens, types, km, [], groups=None, distances=D, **row_options)
        metrics = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert 0.5 <= selection / kmeans_task_bytes(n, d, 4096, 60) <= 1.0
    assert 0.5 <= metrics / metrics_task_bytes(n, d, 4096, 20, False) <= 1.0


@pytest.mark.slow
def test_formula_bounds_the_peak_rss_of_a_process() -> None:
    """Each task's peak RSS growth in a fresh process of one BLAS thread, as a task runs
    (bench.sampled_task_memory's measurement), is within its formula and at least half of it
    (n = 1,024, d = 64: 0.88–0.92 and 0.79–0.85 measured)."""
    import os

    from bench.sampled_task_memory import ONE_THREAD

    code = (
        "import json; from bench.sampled_task_memory import measure; "
        "print(json.dumps([measure(t, 1024, 64, 4096) for t in ('kmeans', 'metrics')]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True,
        env=os.environ | ONE_THREAD, timeout=120, check=True,
    )  # fmt: skip
    kmeans, metrics = json.loads(out.stdout.strip().splitlines()[-1])
    assert kmeans["formula"] == kmeans_task_bytes(1024, 64, 4096, 60)
    assert metrics["formula"] == metrics_task_bytes(1024, 64, 4096, 20, False)
    assert 0.5 <= kmeans["ratio"] <= 1.0
    assert 0.5 <= metrics["ratio"] <= 1.0


def test_refusal_names_the_silhouette_points_that_fit() -> None:
    tasks = SampledTasks(4096, 384, 4096, 60, None, 20)
    assert (tasks.kmeans, tasks.metrics) == (449_298_432, 427_032_576)
    most = 256 * MiB
    line = tasks.refusal(most, "the largest node")
    assert line is not None and "K-means tasks need ≈ 428 MiB each" in line
    m = tasks.fitting_m(most)
    assert m is not None and f"lower --silhouette-max-points (at most {m:,} fits)" in line
    assert tasks.with_m(m).largest <= most < tasks.with_m(m + 1).largest
    assert tasks.refusal(tasks.largest, "the largest node") is None
    # the points alone do not fit: only --sample-size helps
    assert "lower --sample-size (its points alone" in tasks.refusal(1 * MiB, "the largest node")


def test_stage_start_refuses_a_task_no_node_with_a_cpu_holds() -> None:
    """Each task asks Ray for one CPU beside its memory: a head of ``--num-cpus 0``
    (cluster.yaml's) runs none, however large, so it does not let a task through that no
    node with a CPU holds (it waited for ever); where no node with a CPU is known (an
    autoscaler's workers gone), the autoscaler starts one for the tasks: nothing refused."""
    tasks = stage_tasks(4096, 384, SampledOptions())
    assert tasks.largest == 449_298_432
    nodes = [
        {"NodeID": "w", "Alive": True, "Resources": {"CPU": 2.0, "memory": 300 * MiB}},
        {"NodeID": "x", "Alive": False, "Resources": {"CPU": 2.0, "memory": 1 << 40}},  # gone
        {"NodeID": "h", "Alive": True, "Resources": {"memory": 1 << 40}},  # no CPU
    ]
    with pytest.raises(ConfigError, match="300 MiB of Ray memory of the largest node with a "
                       "CPU; lower --silhouette-max-points") as refused:  # fmt: skip
        task_memory_cap(tasks, nodes, can_start=0, free={})
    # the stage sizes the points drawn (the plan, --sample-size: the most there can be)
    assert "(n = 4,096 points drawn of d = 384," in str(refused.value)
    # the autoscaler starts one
    assert task_memory_cap(tasks, nodes, can_start=tasks.largest, free={}) is None
    assert task_memory_cap(tasks, nodes[1:], can_start=0, free={}) is None
    # the metrics task that computes its distances itself asks for 8 n² more
    own = stage_tasks(4096, 384, SampledOptions(), own_distances=True)
    assert own.metrics - tasks.metrics == 8 * 4096 * 4096


def test_tasks_ask_for_the_memory_live_actors_leave_free(capsys) -> None:
    """Other actors (another job's; the job's own reducers are stopped before the stage)
    may hold a node's Ray memory: `embgeom merge` on a node of 6 GiB where another
    job's actor held 5.7 GiB waited at "sampled metrics 0/7" for ever. The tasks now ask for
    the most a node with a CPU has free (0: none) and say so; they ask for their peak where
    a node has it free, where Ray does not say, or where the autoscaler may start a node."""
    tasks = stage_tasks(4096, 384, SampledOptions())
    nodes = [
        {"NodeID": "w", "Alive": True, "Resources": {"CPU": 2.0, "memory": 6 << 30}},
        {"NodeID": "h", "Alive": True, "Resources": {"memory": 64 << 30}},  # no CPU
    ]
    free = {"w": 300.0 * MiB, "h": 60.0 * 2**30}
    assert task_memory_cap(tasks, nodes, can_start=0, free=free) == 300 * MiB
    err = capsys.readouterr().err
    assert "the sampled stage's per-layer tasks need ≈ 428 MiB each at their peak; a node with a CPU has at most 300 MiB" in err
    assert (capped(tasks.kmeans, 300 * MiB), capped(tasks.metrics, None)) == (
        300 * MiB, tasks.metrics)  # fmt: skip
    assert task_memory_cap(tasks, nodes, can_start=0, free={"w": 0.0}) == 0  # none asked
    assert task_memory_cap(tasks, nodes, can_start=0, free={"w": float(tasks.largest)}) is None
    assert task_memory_cap(tasks, nodes, can_start=0, free={}) is None
    assert task_memory_cap(tasks, nodes, can_start=tasks.largest, free={"w": 0.0}) is None
    assert capsys.readouterr().err.count("warning:") == 1


def test_layers_tasks_ask_for_at_most_the_cap(monkeypatch) -> None:
    """submit_layers_on_ray (a layer's K-means task, also from a task of a sample the Ray
    tasks read) asks for its peak, or the stage's cap where that is less."""
    import ray

    from embgeom_ray.distributed import kmeans

    asked = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(kmeans, "call_on_ray", lambda *a, memory=0, **k: asked.append(memory))
    X = np.random.default_rng(0).standard_normal((100, 8))
    kmeans.submit_layers_on_ray({0: X}, shares=(1, 1))
    kmeans.submit_layers_on_ray({0: X}, shares=(1, 1), memory_cap=1000)
    kmeans.submit_layers_on_ray({0: X}, shares=(1, 1), memory_cap=0)
    assert asked == [kmeans_task_bytes(100, 8, 4096, 60), 1000, 0]


def test_plan_refuses_and_reports_the_tasks() -> None:
    shape = Shape(layers=7, dim=384, positions=128, vocab=30_522, sample_entries=8192,
                  sample_points=4096)  # fmt: skip
    small = Cluster((Node("h", 300 * MiB, cpus=2, head=True),))
    line = sampled_task_refusal(shape, small)
    assert line is not None and "of Ray memory of the largest node with a CPU" in line
    assert "(n = 4,096 points (--sample-size, the most a layer can hold) of d = 384," in line
    roomy = Cluster((Node("h", 16 << 30, cpus=2, head=True),))
    assert sampled_task_refusal(shape, roomy) is None
    # a head of --num-cpus 0 runs no task, whatever its memory; with no node with a CPU live
    # yet (an autoscaler's workers) nothing is known, and nothing refused
    cpuless_head = Cluster((Node("h", 16 << 30, head=True), Node("w", 300 * MiB, cpus=8)))
    line = sampled_task_refusal(shape, cpuless_head)
    assert line is not None and "300 MiB of Ray memory of the largest node with a CPU" in line
    assert sampled_task_refusal(shape, Cluster((Node("h", 300 * MiB, head=True),))) is None
    assert shape.sampled_tasks().kmeans == 449_298_432
    no_sample = Shape(layers=7, dim=384, positions=128, vocab=30_522)
    assert no_sample.sampled_tasks() is None
    options = SampledOptions(silhouette_max_points=1024)
    assert Shape(layers=1, dim=384, positions=1, vocab=1, sample_points=4096, sampled=options
                 ).sampled_tasks().kmeans == kmeans_task_bytes(4096, 384, 1024, 60)  # fmt: skip


def test_call_on_ray_asks_ray_for_the_memory_given(monkeypatch) -> None:
    """The stage's tasks go through call_on_ray, which passes ``memory`` to Ray's options (and
    asks for none where it is 0: the tasks that hold little)."""
    from embgeom_ray.distributed import kmeans

    asked = []

    class Task:
        def options(self, **options):
            asked.append(options)
            return self

        def remote(self, *args, **kwargs):
            return "ref"

    monkeypatch.setattr(kmeans, "_capped_call", Task())
    kmeans.call_on_ray(len, [1], memory=449_298_432, returns=2)
    kmeans.call_on_ray(len, [1])
    assert asked == [{"num_cpus": 1, "num_returns": 2, "memory": 449_298_432},
                     {"num_cpus": 1, "num_returns": 1}]  # fmt: skip


def test_plan_json_and_plan_give_what_each_task_asks_for() -> None:
    """--plan-json's ``sizing.sampled_tasks`` (the manifest's too) and --plan's line: MiniLM at
    the default sample, 428 and 407 MiB; absent without the stage (--sample-size 0)."""
    from embgeom_ray.config import build_config
    from embgeom_ray.sizing import CorpusShape, size_job
    from embgeom_ray.sizing.plan import describe_plan

    options = build_config(None, {"model": "m", "corpus": "c", "out": "o", "device": "cpu"})
    minilm = Shape(layers=7, dim=384, positions=128, vocab=30_522, hidden_states=7,
                   intermediate=1536, heads=12, weight_bytes=90 * MiB, sample_entries=8192,
                   sample_points=4096)  # fmt: skip
    cluster = Cluster((Node("h", 16 << 30, cpus=2, head=True),))
    corpus = CorpusShape("c", 1, 10**6, 1)
    sizing = size_job(minilm, corpus, cluster, options.scheduling)
    assert json.loads(json.dumps(sizing.to_json()))["sampled_tasks"] == {
        "kmeans_memory": 449_298_432, "metrics_memory": 427_032_576}  # fmt: skip
    lines = describe_plan(sizing, corpus, checkpoint_interval=None, total_layers=7)
    assert "sampled-stage tasks: a layer's K-means selection ≈ 428 MiB and its metrics ≈ 407 " \
        "MiB at their peak (n × n distances, n = 4,096, d = 384;" in "\n".join(lines)
    none = Shape(layers=7, dim=384, positions=128, vocab=30_522, sample_entries=0)
    assert "sampled_tasks" not in size_job(none, corpus, cluster, options.scheduling).to_json()


def test_plan_counts_the_node_types_an_autoscaler_may_start() -> None:
    """A live worker too small for a task, on a cluster whose autoscaler may start a larger
    node type: the stage's own check counts that type (task_memory_cap), so the plan, of an
    analysis or a merge, must not refuse what the run then does."""
    from embgeom_ray.sizing import NodeGroup
    from embgeom_ray.sizing.decisions import stage_task_refusal

    shape = Shape(layers=7, dim=384, positions=128, vocab=30_522, sample_entries=8192,
                  sample_points=4096)  # fmt: skip
    live = Cluster((Node("h", 16 << 30, head=True), Node("w", 300 * MiB, cpus=2)))
    large = NodeGroup("large", cpus=8, memory=32 << 30, max_count=4)
    assert sampled_task_refusal(shape, live, [large]) is None
    assert stage_task_refusal(shape, live, [large]) is None
    # a type of no CPU, or none may start (max_count 0), or none said: the live nodes decide
    for groups in ([NodeGroup("gpu0", cpus=0, memory=32 << 30, max_count=4)],
                   [NodeGroup("none", cpus=8, memory=32 << 30, max_count=0)], None, ()):
        assert "300 MiB of Ray memory" in sampled_task_refusal(shape, live, groups)
    # no live node with a CPU, a known type too small: refused, as the stage would
    head_only = Cluster((Node("h", 16 << 30, head=True),))
    small = NodeGroup("small", cpus=2, memory=300 * MiB, max_count=None)
    assert "300 MiB of Ray memory" in sampled_task_refusal(shape, head_only, [small])


def test_fit_share_tasks_ask_for_their_peak_and_fit_in_free_memory(monkeypatch) -> None:
    """RayFits' share tasks ask Ray for share_task_bytes of their fits, and a step is split
    into no more tasks than Ray's free memory holds (else a share could wait for memory its
    selection holds while the selection waits for it). Measured: 81–87% of the formula."""
    from embgeom_ray.distributed import kmeans
    from embgeom_ray.sizing.sampled_tasks import share_step_bytes, share_task_bytes

    n, d = 4096, 384
    inits = [np.arange(k) for k in range(2, 16) for _ in range(3)]  # the default seedings
    asked, free = [], {"CPU": 8.0, "memory": 1e12}

    def submit(fn, f, X, group, cpus, memory):
        asked.append((sorted(len(i) for i in group), memory))
        return tuple(len(i) for i in group)  # a stand-in ref: what ray.get gives below

    monkeypatch.setattr(kmeans.ray, "available_resources", lambda: free)
    monkeypatch.setattr(kmeans.ray, "put", lambda X: X)
    monkeypatch.setattr(kmeans.ray, "get", lambda ref: list(ref))
    monkeypatch.setattr(kmeans.ray, "wait", lambda refs, num_returns, timeout: (refs, []))
    monkeypatch.setattr(kmeans, "call_on_ray", submit)
    fits = kmeans.RayFits(initial_shares=3)(lambda X, group: [len(i) for i in group],
                                            np.zeros((n, d)), inits)  # fmt: skip
    assert fits == [len(i) for i in inits]
    assert len(asked) == 2 and all(m == share_task_bytes(n, d, ks) for ks, m in asked)
    # 12·n·d + Σ (8·n·k + 8·n) + 4 MiB
    ks = asked[0][0]
    assert asked[0][1] == 12 * n * d + sum(8 * n * k + 8 * n for k in ks) + (4 << 20)
    # the whole step bounds a share: at MiniLM's default sample 34.5 MiB, 29.1 MiB measured
    assert share_step_bytes(n, d, 60, None, 2) == share_task_bytes(n, d, [len(i) for i in inits]
                                                                   ) == 36_143_104  # fmt: skip
    # Ray's free memory holds one share task: one; none: every fit here
    asked.clear()
    free["memory"] = float(share_step_bytes(n, d, 60, None, 2))
    kmeans.RayFits(initial_shares=3)(lambda X, group: [len(i) for i in group], np.zeros((n, d)), inits)
    assert len(asked) == 1
    asked.clear()
    free["memory"] = 0.0
    kmeans.RayFits(initial_shares=3)(lambda X, group: [len(i) for i in group], np.zeros((n, d)), inits)
    assert asked == []
