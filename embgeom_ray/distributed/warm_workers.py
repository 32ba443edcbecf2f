"""Task workers started, and their libraries imported, while the extractor runs.

After the extraction, the sampled-metrics stage runs one K-means task and one metrics task per
layer, and the report three figure tasks (:mod:`~embgeom_ray.distributed.sampled_stage`,
:mod:`~embgeom_ray.distributed.node_tasks`). Ray starts a fresh worker process for each of them
that it cannot give an idle one, and the first task on each spends seconds importing torch
(Lloyd's sums and the neighbour search, through the tables module), pandas and, for the
report, matplotlib before it computes anything (~1.6 s of CPU for the stage's imports on the
2-core VM of docs/benchmarks.md). The stage's default path imports neither scikit-learn nor
SciPy (another ~1.2 s a worker): only samples past ``--silhouette-max-points`` and the
functions' use without a distance matrix do.

On a private local Ray (the job owns the machine: :func:`~embgeom_ray.distributed.cluster.connect`
started it, with Ray's idle-worker killing held off so that these workers live until the
stage), :func:`warm_task_workers` starts those processes once the first extractor is ready:
one task per CPU the extractors leave free (``count``: the pipeline's ``warm_workers_wanted``),
each holding no CPU (so it does not wait for a CPU Ray has given the extractor), lowers its
process to nice 19 and imports :data:`MODULES`. Ray then gives the stage's tasks to these idle
workers. ``python -m bench.warm_workers`` measures the whole job with and without them
(``docs/benchmarks.md``, 2-core CPU VMs). Where the extractors hold every CPU, warming workers
anyway was tried: the imports' CPU time came out of the forward, about as much as the stage
gained, so no worker is warmed there.

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
and a warm-up that fails only leaves its worker cold. Each warm worker holds the imported
libraries from the extraction's start instead of the stage's: 387 MiB resident, 240 MiB of
it private, against 79 MiB for a fresh Ray worker (``docs/design.md``, "Processes and their
memory").
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

log = logging.getLogger(__name__)

#: what the stage's and the report's first tasks would import
MODULES: tuple[str, ...] = (
    "embgeom_ray.core.kmeans",
    "embgeom_ray.core.tables",
    "embgeom_ray.distributed.kmeans",
    "embgeom_ray.report.plots",
)
#: the nice value of a warm worker's process (19: the lowest priority)
NICENESS = 19


def warm_up(modules: tuple[str, ...] = MODULES, niceness: int = NICENESS) -> dict[str, Any]:
    """Lower this process's priority to ``niceness`` and import ``modules``; returns the pid,
    the nice value reached and the modules that failed to import (left for the real task to
    report)."""
    try:
        nice = os.nice(max(0, niceness - os.nice(0)))
    except OSError:  # not permitted here: import at the priority we have
        nice = os.nice(0)
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:
            failed.append(name)
    return {"pid": os.getpid(), "nice": nice, "failed": failed}


def warm_task_workers(count: int) -> list[Any]:
    """Start ``count`` Ray task workers that run :func:`warm_up` (no CPU held); returns their
    ObjectRefs (nothing needs to wait for them). A failure to submit them is logged and
    ignored: the job's tasks then start their own workers."""
    if count <= 0:
        return []
    import ray

    try:
        task = ray.remote(warm_up).options(num_cpus=0, max_retries=0)
        return [task.remote() for _ in range(count)]
    except Exception as exc:  # an optimisation only: never fail the job over it
        log.warning("could not warm task workers (%s); the tasks will start their own", exc)
        return []
