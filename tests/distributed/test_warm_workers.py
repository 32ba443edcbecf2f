"""Task workers warmed while the extractor runs (embgeom_ray.distributed.warm_workers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from embgeom_ray.config import JobConfig
from embgeom_ray.distributed import cluster, warm_workers
from embgeom_ray.distributed.warm_workers import MODULES, warm_up
from embgeom_ray.report.figure_groups import FIGURE_GROUPS
from embgeom_ray.runs import pipeline

ROOT = Path(__file__).resolve().parents[2]


def in_thread(fn, *args):
    """``fn(*args)`` in a thread of its own: Linux applies a nice value per thread, so the
    test process itself keeps its priority."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(value=fn(*args)))
    t.start()
    t.join()
    return out["value"]


@pytest.mark.skipif(sys.platform != "linux", reason="nice values are per thread on Linux only")
def test_warm_up_lowers_priority_and_imports():
    name = "embgeom_ray.core.neighbours"
    sys.modules.pop(name, None)
    result = in_thread(warm_up, (name, "no_such_module_embgeom"), 19)
    assert result["pid"] == os.getpid()
    assert result["nice"] == 19
    assert result["failed"] == ["no_such_module_embgeom"]  # left for the real task to report
    assert name in sys.modules
    assert os.nice(0) < 19  # this thread was not lowered


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_warm_up_imports_at_idle_priority_in_a_thread_of_its_own():
    name = "embgeom_ray.core.neighbours"
    sys.modules.pop(name, None)
    seen: dict = {}
    real = os.sched_setscheduler

    def spy(pid, policy, param):  # the policy asked for, and the thread asking
        seen.update(policy=policy, thread=threading.get_ident())
        return real(pid, policy, param)

    os.sched_setscheduler = spy
    try:
        result = in_thread(warm_up, (name,), 19, True)
    finally:
        os.sched_setscheduler = real
    assert result["idle"] is True and result["failed"] == []
    assert name in sys.modules
    assert seen["policy"] == os.SCHED_IDLE
    assert seen["thread"] != threading.get_ident()
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # this thread keeps its policy


def test_the_warm_modules_are_what_the_stage_imports():
    # every module exists (a rename would leave the workers cold without an error)
    failed = in_thread(warm_up, MODULES, 0)["failed"]
    assert failed == []


def _module_of(fn) -> str:
    """The module a Ray worker imports to deserialise ``fn`` (a Ray remote function's own)."""
    return getattr(fn, "_function", fn).__module__


def test_the_task_workers_modules_import_no_torch():
    """What the sampled stage's and the report's task workers import before they compute
    (the warm-up's modules, the modules of the functions Ray runs there and of the objects
    they get) loads no torch: ~1 s of CPU and ~180 MB resident a worker. Torch comes only
    where a task calls a kernel of its own (the stage's, at their first call: hence the
    explicit ``"torch"`` of ``STAGE_MODULES``), never through an import."""
    from embgeom_ray.core import tables
    from embgeom_ray.distributed import kmeans, sample_tasks
    from embgeom_ray.report import plots

    remote = [tables.sampled_row, tables.sampled_selection, kmeans._apply,
              kmeans._select_k_task, kmeans._capped_call, sample_tasks.select_k_of,
              sample_tasks._layer_inputs, sample_tasks._layer_pieces, plots.draw_figures,
              warm_workers.warm_up]  # fmt: skip
    modules = sorted(
        {m for m in MODULES if m.startswith("embgeom_ray.")}
        | {_module_of(fn) for fn in remote}
        | {"embgeom_ray.core.kmeans", "embgeom_ray.core.lloyd",  # ray_map's functions
           "embgeom_ray.core.kmeans_selection", "embgeom_ray.distributed.sampled_stage"}
    )  # fmt: skip
    assert set(MODULES) - set(modules) == {"torch"}  # the one library named for itself
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))"
    )
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300, check=True)  # fmt: skip
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [], modules


#: a layer of the sampled stage as its tasks run it (default options), in a fresh process:
#: the top-level packages it imports
STAGE_IMPORTS = """
import json, sys
import numpy as np
from embgeom_ray.core.options import SampledOptions
from embgeom_ray.core.tables import sampled_options, sampled_row, sampled_selection
rng = np.random.default_rng(0)
X = (rng.normal(size=(600, 24)) + 3.0 * rng.integers(0, 4, 600)[:, None]).astype(np.float32)
X[300:320] = X[:20]  # repeated points
tokens, types = rng.integers(0, 40, 600), rng.normal(size=(200, 24)).astype(np.float32)
kmeans_options, row_options = sampled_options(SampledOptions(), 600)
before = set(sys.modules)
km, D = sampled_selection(X, None, kmeans_options)
row = sampled_row(X, tokens, types, km, [0], distances=D, **row_options)
assert D is not None and np.isfinite(row["lid_euclidean"]) and np.isfinite(row["silhouette_types"])
print(json.dumps(sorted({m.split(".")[0] for m in set(sys.modules) - before})))
"""


def test_the_stage_imports_no_more_than_the_warm_modules_and_not_scikit_learn():
    """A layer's two tasks (default options, the distinct points' matrix shared) import
    neither scikit-learn nor SciPy (~1.2 s of each fresh worker's start), and nothing heavy
    that the warm workers' :data:`MODULES` would not have imported."""
    env = os.environ | {"PYTHONPATH": str(ROOT)}

    def packages(code: str) -> set[str]:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=300, check=True)  # fmt: skip
        return set(json.loads(done.stdout.strip().splitlines()[-1]))

    stage = packages(STAGE_IMPORTS)
    assert "embgeom_ray" in stage  # the task's own modules were imported here
    assert not stage & {"sklearn", "scipy"}, stage
    warm = packages(
        "import json, sys; from embgeom_ray.distributed.warm_workers import MODULES, warm_up; "
        "warm_up(MODULES, 0); print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    assert stage <= warm, stage - warm


def config(**kw) -> JobConfig:
    return JobConfig(model="m", corpus="c", out="o", **kw)


@pytest.mark.parametrize(
    ("cpus", "kw", "expected"),
    [
        (2, {}, 2),  # the default CPU run: the extractor holds every CPU, warmed at idle priority
        (16, {}, 16),  # a GPU machine
        (64, {}, 7 * 2 + len(FIGURE_GROUPS) - 1),  # no more than the tasks
        (64, {"sample_size": 0}, len(FIGURE_GROUPS) - 1),
        (64, {"sample_size": 0, "no_report": True}, 0),
        (2, {"no_warm_workers": True}, 0),
    ],
)
def test_warm_workers_wanted(monkeypatch, cpus, kw, expected):
    import ray

    monkeypatch.setattr(cluster, "started_private_local", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": float(cpus)})
    assert pipeline.warm_workers_wanted(config(**kw), 7) == expected
    monkeypatch.setattr(cluster, "started_private_local", lambda: False)
    assert pipeline.warm_workers_wanted(config(**kw), 7) == 0


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({}, (*warm_workers.STAGE_MODULES, "embgeom_ray.report.plots")),
        ({"no_report": True}, warm_workers.STAGE_MODULES),  # no matplotlib for nothing
        ({"sample_size": 0}, ("embgeom_ray.report.plots",)),
    ],
)
def test_a_run_warms_what_its_tasks_import(monkeypatch, kw, expected):
    import ray

    calls = []
    monkeypatch.setattr(cluster, "started_private_local", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(pipeline, "warm_task_workers", lambda *a, **k: calls.append((a, k)))
    pipeline.warm_for_run(config(**kw), 7)
    assert calls == [((2,), {"after_s": warm_workers.AFTER_S, "modules": expected})]
    assert set(MODULES) == set(warm_workers.STAGE_MODULES + warm_workers.REPORT_MODULES)


def test_idle_cpus_from_the_machines_cpu_times():
    assert warm_workers.idle_cpus((1000.0, 400.0, 2), (1200.0, 500.0, 2)) == pytest.approx(1.0)
    assert warm_workers.idle_cpus((1000.0, 400.0, 4), (1100.0, 400.0, 4)) == 0.0
    assert warm_workers.idle_cpus(None, (1.0, 1.0, 1)) is None  # not Linux: unknown
    assert warm_workers.idle_cpus((5.0, 1.0, 2), (5.0, 1.0, 2)) is None  # no time passed
    times = warm_workers.cpu_times()
    if sys.platform == "linux":
        total, idle, cpus = times
        assert 0 <= idle <= total and cpus == os.cpu_count()
        busy_until = time.monotonic() + 0.3  # this process busy: at most cpus - 1 idle
        while time.monotonic() < busy_until:
            pass
        assert warm_workers.idle_cpus(times, warm_workers.cpu_times()) <= cpus - 0.5


@pytest.mark.parametrize(("idle", "submitted"), [(0.2, 0), (1.5, 2)])
def test_warm_ups_only_where_cpus_were_idle(ray_local, monkeypatch, idle, submitted):
    """The warm-ups are submitted after ``after_s`` only where the machine had idle CPUs then:
    where other work keeps it busy, imports at idle priority would get no CPU time."""
    samples = iter([(0.0, 0.0, 2), (100.0, 50.0 * idle, 2)])
    monkeypatch.setattr(warm_workers, "cpu_times", lambda: next(samples))
    monkeypatch.setattr(warm_workers, "_PENDING", [])
    # nothing to import, and the tests' Ray's workers left at their priority
    monkeypatch.setattr(warm_workers, "MODULES", ())
    monkeypatch.setattr(warm_workers, "NICENESS", 0)
    warm_workers.warm_task_workers(2, after_s=0.05)
    deadline = time.monotonic() + 10
    while len(warm_workers._PENDING) < submitted and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    assert len(warm_workers._PENDING) == submitted
    assert len(warm_workers.await_warm_workers(60)) == submitted


def test_not_private_when_ray_was_started_by_someone_else(ray_local):
    # the tests' Ray was not started by connect(): never warm workers on it
    assert not cluster.started_private_local()


#: one process on the private local Ray its ``connect`` starts, in two parts (one Ray start
#: and one process for both tests below: each took ~15 s of the suite alone, most of it the
#: process's imports and its Ray's start). First, the warm workers of an extraction outlive an
#: idle spell and take the next 1-CPU tasks (their JSON on a line); then a warm-up still
#: importing when nobody waits for it any more has its worker lost ("done" once the owner has
#: heard of it).
SCRIPT = """
import json, os, signal, time
import ray
from embgeom_ray.distributed import warm_workers
from embgeom_ray.distributed.cluster import connect, started_private_local
from embgeom_ray.distributed.warm_workers import await_warm_workers, warm_task_workers

connect(None)
assert started_private_local()
cpus = int(ray.cluster_resources()["CPU"])

@ray.remote(num_cpus=cpus)
class Holder:  # the extractor: every CPU held
    def ready(self):
        return os.getpid()

holder = Holder.remote()
ray.get(holder.ready.remote())
warm_task_workers(cpus)
warm = await_warm_workers(120)
ray.kill(holder)
time.sleep(2)  # idle past Ray's default 1 s, with more workers than CPUs while the actor lived

@ray.remote(num_cpus=1)
def task():
    time.sleep(0.5)
    return os.getpid(), os.nice(0)

after = ray.get([task.remote() for _ in range(cpus)])
print(json.dumps({"warm": warm, "after": after}), flush=True)

# a warm-up whose worker is lost while it imports
warm_workers.MODULES = ("slow_import_embgeom",)  # imports until its worker is killed
warm_workers.warm_task_workers(2)
deadline = time.monotonic() + 60
while len(os.listdir("pids")) < 2 and time.monotonic() < deadline:
    time.sleep(0.1)
assert warm_workers.await_warm_workers(0.2) == []  # still importing: not waited for
for pid in os.listdir("pids"):
    os.kill(int(pid), signal.SIGKILL)
time.sleep(3)  # the owner hears of the lost workers
print("done", flush=True)
"""


@pytest.fixture(scope="module")
def private_ray_script(tmp_path_factory) -> subprocess.CompletedProcess:
    """:data:`SCRIPT` run in a fresh process (no ``RAY_ADDRESS``: its own private Ray), in a
    directory holding ``pids/`` and ``slow_import_embgeom.py``, a module whose import writes
    its process's id there and then sleeps."""
    work = tmp_path_factory.mktemp("warm-workers")
    (work / "pids").mkdir()
    (work / "slow_import_embgeom.py").write_text(
        "import os, time\nopen(os.path.join('pids', str(os.getpid())), 'w').close()\n"
        "time.sleep(120)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(work)])
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, cwd=work, timeout=240)  # fmt: skip


@pytest.mark.slow
def test_stage_tasks_run_on_the_warm_workers(private_ray_script):
    """On the private local Ray the warm workers outlive an idle spell and take the next
    1-CPU tasks, which run at their lowered priority."""
    proc = private_ray_script
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith('{"warm": ')]
    out = json.loads(line)
    warm_pids = {w["pid"] for w in out["warm"]}
    assert len(warm_pids) == len(out["warm"]) >= 1
    assert all(w["nice"] == 19 and w["failed"] == [] for w in out["warm"])
    if hasattr(os, "SCHED_IDLE"):
        assert all(w["idle"] for w in out["warm"])
    assert {pid for pid, _ in out["after"]} <= warm_pids
    assert all(nice == 19 for _, nice in out["after"])


# That the warm-up is decided once, when the first of two extractors has loaded its model, from
# the pool's plan (and that on the tests' Ray, not private, nothing is warmed) is checked on the
# two-worker run of tests/runs/test_job_end_to_end.py::test_one_and_two_workers_agree (one job
# fewer than a run of its own here).


@pytest.mark.slow
def test_a_warm_up_whose_worker_is_lost_prints_nothing(private_ray_script):
    """A warm-up still importing when the stage stopped waiting for it, whose worker is then
    lost (killed by the kernel's OOM killer, say), is read when it fails: Ray prints no
    "Unhandled error" on the driver's stderr (as it did in CI under the API's echo=None)."""
    proc = private_ray_script
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done" in proc.stdout.splitlines()
    assert "Unhandled error" not in proc.stderr, proc.stderr[-3000:]
