"""Task workers started, and their libraries imported, while the extractor runs.

After the extraction, the sampled-metrics stage runs one K-means task and one metrics task per
layer, and the report three figure tasks (:mod:`~embgeom_ray.distributed.sampled_stage`,
:mod:`~embgeom_ray.distributed.node_tasks`). Ray starts a fresh worker process for each of them
that it cannot give an idle one, and the first task on each spends seconds importing torch
(for the stage only: Lloyd's cluster sums, ``index_add_``, and the neighbour lists' ``topk``
import it at their first call; the modules of the stage and of the figures import none),
pandas and, for the report, matplotlib before it computes anything (~1.6 s of CPU for the
stage's imports on the 2-core VM of docs/benchmarks.md). The stage's default path imports neither scikit-learn nor
SciPy (another ~1.2 s a worker): only samples past ``--silhouette-max-points`` and the
functions' use without a distance matrix do.

On a private local Ray (the job owns the machine: :func:`~embgeom_ray.distributed.cluster.connect`
started it, with Ray's idle-worker killing held off so that these workers live until the stage),
:func:`warm_task_workers` starts those processes while the first extractors load their model: one
task per CPU of the machine, no more than the stage's and the figures' tasks (``count``: the
pipeline's ``warm_workers_wanted``), each importing what those tasks will (:func:`modules_for`: no
matplotlib for a run with ``--no-report``) and holding no CPU (so it does not wait for a CPU Ray has
given an extractor). Each lowers its process to nice 19 and imports the run's modules in a thread of
Linux's ``SCHED_IDLE`` policy, the scheduler's lowest weight (3, against 15 at nice 19 and 36 at
Ray's nice 15), which runs mostly where no other thread wants the CPU: the imports use the CPU time
the extractors leave, mostly while they load their model. The policy ends with that thread, so the
tasks the worker runs later run at nice 19. Ray then gives the stage's tasks to these idle workers;
the stage first waits for warm-ups still importing (:func:`await_warm_workers`, at most
:data:`AWAIT_S`), since a task that found every worker busy warming would get a fresh one that
imports everything again beside them.

The warm-ups are submitted :data:`AFTER_S` after the first extractors are asked for
(``after_s``), not before: Ray starts as many task workers as the machine has CPUs with
itself, and an extractor takes one of those where it can; a warm-up that took it first would
leave the extractor to start a process of its own before it loads its model. Measured on the
demo job, whose one extractor holds both CPUs of a 2-core VM (docs/benchmarks.md): the stage's
first tasks no longer wait ~2 s for their imports, and the job ends ~2.5 s sooner, though the
extraction takes ~0.5–0.9 s longer (the warm-ups' imports outlast the model's loading, and
what is left of them takes the CPU the forward leaves). Warmed at nice 19 once the extractor
was ready (the rule while only the CPUs the extractors left free were warmed), the imports
came out of the forward's CPU time: no gain. ``python -m bench.warm_workers`` measures the
whole job with and without them.

They are submitted only where the machine had CPU time to spare over those :data:`AFTER_S`
seconds: at least :data:`MIN_IDLE_CPUS` of its CPUs idle on average (:func:`idle_cpus`, from
Linux's ``/proc/stat``). Where other work keeps every CPU busy, imports at idle priority get no
CPU time before the stage, and the warm workers' own start (a Ray worker process at nice 15,
before its task lowers it) comes out of the extractor's. On the 2-core VM the demo job saw
0.75–0.77 CPUs idle in that window (warmed); beside one busy process (another job, a test suite's
other worker), 0.02, where warming had made the job slower: its extraction 36.7–37.0 s
against 33.3–33.5 s without, its stage 30.9–31.6 s against 32.6 s.

The priority stays with the process: the stage's and the report's tasks then run at nice 19 as
well, which changes nothing while they have the cores to themselves (the driver waits for them)
and lets the driver go first where it works beside them (the report's PCA views). Linux applies
a nice value per thread; threads the task later starts (BLAS, OpenMP, torch) inherit it.
Actors never inherit it: since Ray 2.0 an actor always gets a worker process of its own, never
one that has run a task (ray-project/ray#28773), so extractors and reducers keep the nice value
Ray starts every worker process with: 15 (the raylet's ``worker_niceness``; only a job's
supervisor gets 0), against the driver's and Ray's own processes' 0. A warm worker at 19 thus
weighs 15 against an extractor's 36 in Linux's scheduler (about 30% of a CPU they both want,
where it would be about 1.5% against a process at 0). Where the kernel groups processes by
session (``sched_autogroup``, on by default in Debian and Ubuntu kernels), nice values only
order the processes of one group: the job's processes against each other, not against other
sessions' (an extractor at 15 ran the same bare forward at the same rate as one at 0,
alternated, on the shared 2-core machine).

Nothing depends on the warm-up: a task that finds no idle worker gets a fresh one, as before,
and a warm-up that fails (or a kernel that refuses ``SCHED_IDLE``: it imports at nice 19) only
leaves its worker cold; its error is read as it comes (nothing is printed). Each warm worker
holds the imported libraries from the extraction's start instead of the stage's: 387 MiB
resident, 240 MiB of it private, against 79 MiB for a fresh Ray worker (``docs/design.md``,
"Processes and their memory").
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

#: what the sampled stage's first tasks would import: its modules (no torch), and torch, which
#: two of its kernels import at their first call (:func:`~embgeom_ray.core.lloyd.cluster_sums`,
#: :func:`~embgeom_ray.core.neighbours.smallest_per_row`: 1.6–5× and 2.5–6× faster than
#: numpy's equals, docs/benchmarks.md)
STAGE_MODULES: tuple[str, ...] = (
    "embgeom_ray.core.kmeans",
    "embgeom_ray.core.tables",
    "embgeom_ray.core.sampled_metrics",
    "embgeom_ray.distributed.kmeans",
    "torch",
)
#: what the report's figure tasks would import (matplotlib, pandas, the figure modules; no
#: torch)
REPORT_MODULES: tuple[str, ...] = ("embgeom_ray.report.plots",)
#: what the stage's and the report's first tasks would import
MODULES: tuple[str, ...] = STAGE_MODULES + REPORT_MODULES


def modules_for(sampled: bool, report: bool) -> tuple[str, ...]:
    """What a run's warm workers import: the sampled stage's modules where it has a sample
    (``--sample-size`` > 0), the report's where it draws one (not ``--no-report``). A run
    without a report warmed matplotlib and the figure modules for nothing: ~0.4 s of CPU a
    worker (two on a 2-core machine), idle priority or not."""
    return (STAGE_MODULES if sampled else ()) + (REPORT_MODULES if report else ())
#: the nice value of a warm worker's process (19: the lowest priority)
NICENESS = 19
#: the longest the sampled stage waits for warm-ups still importing (seconds): about one
#: worker's imports on a core of its own
AWAIT_S = 3.0
#: seconds between asking for the first extractors and submitting the warm-ups: time for Ray
#: to give each extractor one of the task workers it started beforehand (a lease on a local
#: Ray takes ~0.1 s)
AFTER_S = 0.5
#: the CPUs that must have been idle, on average over those :data:`AFTER_S` seconds, for the
#: warm-ups to be submitted: on a machine whose CPUs other work keeps busy, imports at idle
#: priority get no CPU time, and starting their processes would take the extractors' (see
#: :func:`idle_cpus`). The demo job saw 0.75–0.77 on the 2-core VM, and 0.02 beside one busy
#: process: a quarter of a CPU leaves a margin both ways
MIN_IDLE_CPUS = 0.25


def warm_up(
    modules: tuple[str, ...] = MODULES, niceness: int = NICENESS, idle: bool = False
) -> dict[str, Any]:
    """Lower this process's priority to ``niceness`` and import ``modules``; returns the pid,
    the nice value reached, whether the imports ran at idle priority and the modules that
    failed to import (left for the real task to report). ``idle``: import in a thread of
    Linux's ``SCHED_IDLE`` policy (the scheduler's lowest weight: it runs mostly on CPU time
    no other thread wants); the policy ends with that thread, so the process's later tasks
    run at ``niceness``."""
    try:
        nice = os.nice(max(0, niceness - os.nice(0)))
    except OSError:  # not permitted here: import at the priority we have
        nice = os.nice(0)
    failed: list[str] = []
    at_idle = [False]

    def imports() -> None:
        if idle and hasattr(os, "SCHED_IDLE"):
            try:  # this thread only (Linux: a policy is per thread)
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
                at_idle[0] = True
            except OSError:
                pass
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:
                failed.append(name)

    if idle:
        thread = threading.Thread(target=imports, name="warm-up", daemon=True)
        thread.start()
        thread.join()
    else:
        imports()
    return {"pid": os.getpid(), "nice": nice, "idle": at_idle[0], "failed": failed}


#: the warm-ups submitted and not yet awaited (:func:`await_warm_workers`): the Ray job that
#: submitted them, and their refs
_PENDING: list[tuple[str, Any]] = []


def _read_outcome(future: Any) -> None:
    """Read a warm-up's outcome as it comes: a warm-up's error that nobody read (its worker
    lost while it imported, after :func:`await_warm_workers` stopped waiting for it) would
    be printed by Ray as an "Unhandled error" on the driver's stderr, though nothing of the
    job's depends on it."""
    exc = future.exception()
    if exc is not None:
        log.debug("a warm-up failed (%s); its worker stays cold", exc)


#: the machine's CPU ticks in all and idle, and its CPUs (:func:`cpu_times`)
CpuTimes = tuple[float, float, int]


def cpu_times() -> CpuTimes | None:
    """The machine's CPU time since boot, in all and idle (idle and waiting for I/O), summed
    over its CPUs, in clock ticks, and how many CPUs (Linux's ``/proc/stat``); None where there
    is no such file."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        fields = [float(v) for v in lines[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    # user nice system idle iowait irq softirq steal (guest time is in user and nice already)
    return sum(fields[:8]), sum(fields[3:5]), max(cpus, 1)


def idle_cpus(before: CpuTimes | None, after: CpuTimes | None) -> float | None:
    """How many of the machine's CPUs were idle on average between two :func:`cpu_times`;
    None where either is unknown or no time passed."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    return (after[1] - before[1]) / (after[0] - before[0]) * after[2]


def warm_task_workers(
    count: int, after_s: float = 0.0, modules: tuple[str, ...] | None = None
) -> None:
    """Start ``count`` Ray task workers that run :func:`warm_up` of ``modules`` (:data:`MODULES`
    where None; a run's: :func:`modules_for`), no CPU held, their imports at idle priority: now,
    or ``after_s`` seconds from now (a daemon thread submits them then),
    and then only where at least :data:`MIN_IDLE_CPUS` of the machine's CPUs were idle on
    average over those seconds (:func:`idle_cpus`; always where that is unknown). Their refs
    are kept for :func:`await_warm_workers`. A failure to submit them is logged and ignored:
    the job's tasks then start their own workers."""
    if count <= 0:
        return
    import ray

    job = ray.get_runtime_context().get_job_id()

    def submit() -> None:
        if after_s > 0:
            before = cpu_times()
            time.sleep(after_s)
            idle = idle_cpus(before, cpu_times())
            if idle is not None and idle < MIN_IDLE_CPUS:
                log.debug("not warming task workers: %.2f CPUs idle, other work keeps the "
                          "machine busy", idle)  # fmt: skip
                return
        try:
            task = ray.remote(warm_up).options(num_cpus=0, max_retries=0)
            wanted = MODULES if modules is None else modules
            refs = [task.remote(wanted, NICENESS, True) for _ in range(count)]
            for ref in refs:  # a warm-up's failure is read here, never reported by Ray
                ref.future().add_done_callback(_read_outcome)
            _PENDING.extend((job, ref) for ref in refs)
        except Exception as exc:  # an optimisation only: never fail the job over it
            log.warning("could not warm task workers (%s); the tasks will start their own", exc)

    if after_s > 0:
        threading.Thread(target=submit, name="warm-task-workers", daemon=True).start()
    else:
        submit()


def await_warm_workers(timeout: float = AWAIT_S) -> list[dict[str, Any]]:
    """Wait up to ``timeout`` seconds for this Ray job's warm-ups still running, before the
    tasks they are for are submitted (a task that finds every worker busy warming gets a fresh
    one, which imports everything again beside them); forget every warm-up submitted (one still
    importing goes on, its outcome read when it comes: :func:`_read_outcome`). Returns what the
    finished ones returned (:func:`warm_up`); a warm-up whose worker was lost is left out."""
    if not _PENDING:
        return []
    import ray

    job = ray.get_runtime_context().get_job_id() if ray.is_initialized() else None
    refs = [ref for j, ref in _PENDING if j == job]
    _PENDING.clear()
    if not refs:
        return []
    try:
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    except Exception as exc:  # an optimisation only
        log.warning("could not wait for the warm task workers (%s)", exc)
        return []
    finished = []
    for ref in done:
        try:
            finished.append(ray.get(ref))
        except Exception:  # its worker was lost: that one stays cold (see _read_outcome)
            continue
    return [r for r in finished if isinstance(r, dict)]
