"""How Ray schedules the sampled stage's tasks on C CPUs, load-free: sleeps of measured lengths.

A stage's wall time on a machine shared with other work is mostly the waits for a core (its
tasks run at nice 19), so the order of its tasks is measured apart from their arithmetic:
each layer's work is replayed as sleeps (its K-means selection, and its metrics with their
standard errors), the per-layer seconds of ``python -m bench.sampled_stage`` (the ``current``
side of ``--times``, a results JSON; default: 7 layers measured on the 2-core VM), divided by
``--scale``, on a local Ray of ``--cpus`` CPUs through :func:`~embgeom_ray.distributed.kmeans.call_on_ray`,
as the stage submits them:

  (a) one task a layer (selection then metrics), layers in order;
  (b) two tasks a layer, each layer's metrics submitted after the next C layers' selections
      and reading its selection's two results, as
      :func:`embgeom_ray.distributed.sampled_stage.add_sampled_metrics` submits them.

Printed: each way's makespan scaled back (× ``--scale``), alternately ``--repeats`` times,
and the CPU's bound (the layers' total / C).

    python -m bench.sampled_schedule [--times bench/results/sampled_stage.json] [--cpus 2]
        [--scale 4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.common import median, save

#: (selection, metrics with SEs) seconds of MiniLM layers 0–6, one thread, CPU time
#: (``python -m bench.sampled_stage --baseline none --repeats 1 --clock cpu``, 2026-11-28)
DEFAULT_TIMES = [
    (4.12, 1.85), (4.06, 2.70), (5.19, 2.32), (5.49, 2.41), (5.37, 2.45), (5.37, 2.40), (4.69, 2.38),
]  # fmt: skip


def _selection(seconds: float) -> tuple[str, bytes]:
    time.sleep(seconds)
    return "selection", b"distances"


def _metrics(seconds: float, selection: str, distances: bytes) -> str:
    time.sleep(seconds)
    return "row"


def _layer(seconds: float) -> str:
    time.sleep(seconds)
    return "row"


def one_task_a_layer(times: list[tuple[float, float]]) -> float:
    import ray

    from embgeom_ray.distributed.kmeans import call_on_ray

    t0 = time.perf_counter()
    ray.get([call_on_ray(_layer, s + m) for s, m in times])
    return time.perf_counter() - t0


def two_tasks_a_layer(times: list[tuple[float, float]], lag: int) -> float:
    import ray

    from embgeom_ray.distributed.kmeans import call_on_ray

    t0 = time.perf_counter()
    rows, after = [], []
    for s, m in times:
        after.append((m, *call_on_ray(_selection, s, returns=2)))
        if len(after) > lag:
            rows.append(call_on_ray(_metrics, *after.pop(0)))
    rows += [call_on_ray(_metrics, *pending) for pending in after]
    ray.get(rows)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--times", default=None, help="a bench.sampled_stage results JSON")
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--scale", type=float, default=4.0, help="sleep the seconds / this")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--name", default="sampled_schedule")
    args = p.parse_args(argv)
    times = DEFAULT_TIMES
    if args.times:
        results = json.loads(Path(args.times).read_text())["results"]
        times = [
            (r["seconds"]["current"]["select_k"], r["seconds"]["current"]["total"]) for r in results
        ]
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    cpus = int(ray.available_resources().get("CPU", args.cpus))
    scaled = [(s / args.scale, m / args.scale) for s, m in times]
    try:
        one_task_a_layer([(0.0, 0.0)] * 2 * cpus)  # the workers started
        secs: dict[str, list[float]] = {"one_task_a_layer": [], "two_tasks_a_layer": []}
        for _ in range(args.repeats):
            secs["one_task_a_layer"].append(one_task_a_layer(scaled) * args.scale)
            secs["two_tasks_a_layer"].append(two_tasks_a_layer(scaled, cpus) * args.scale)
    finally:
        if started:
            ray.shutdown()
    out = {name: median(ts) for name, ts in secs.items()}
    bound = sum(s + m for s, m in times) / cpus
    print(
        f"{len(times)} layers on {cpus} CPUs: one task a layer {out['one_task_a_layer']:.2f} s, "
        f"two tasks a layer {out['two_tasks_a_layer']:.2f} s, the CPU's bound {bound:.2f} s"
    )
    save(
        args.name,
        {
            "command": "python -m bench.sampled_schedule",
            "args": vars(args),
            "times": times,
            "cpus": cpus,
            "seconds": out,
            "bound": bound,
        },
    )


if __name__ == "__main__":
    main()
