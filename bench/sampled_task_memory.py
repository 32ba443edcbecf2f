"""The sampled stage's per-layer tasks' peak memory against their formulas.

The formulas: :mod:`embgeom_ray.sizing.sampled_tasks`.

For every n of ``--sizes``, d of ``--dims`` and m of ``--max-points``, each task runs in a fresh
process (one BLAS/OpenMP thread, as the stage's Ray tasks run), whose libraries (scikit-learn,
torch) are loaded and warmed on 64 points first, as a Ray worker's are after its first task:
the K-means selection (:func:`~embgeom_ray.core.tables.sampled_selection`) of n synthetic
points of d dimensions (12 Gaussian clusters, float32 values as float64, as a sample's; n / 4
token types), then, in another process, the metrics (:func:`~embgeom_ray.core.tables.sampled_row`)
reading the selection's distances, as the stage's second task does. The number is the peak
RSS growth of the task (Linux: ``/proc/self/clear_refs`` resets VmHWM to VmRSS, then VmHWM
after the task, less VmRSS before: BLAS's buffers too, which tracemalloc misses). Printed:
each measurement, the formula and their ratio (docs/sizing.md, "The processes and their
memory"). ``--one TASK N D M`` measures one point in this process and prints it as JSON;
one process may measure several (:func:`measure`), each from a trimmed heap.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np

ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def points(n: int, d: int, seed: int = 0) -> tuple[Any, Any, Any]:
    """n points of 12 clusters in d dimensions (float32 values as float64), their token ids
    (n / 4 types) and a type-uniform sample of n / 2 of them."""
    import numpy as np

    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(12, d)) * 3
    X = (centres[rng.integers(12, size=n)] + rng.normal(size=(n, d))).astype(np.float32)
    X = X.astype(np.float64)
    return X, rng.integers(0, max(2, n // 4), size=n), X[: n // 2].copy()


def _rss(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def peak_growth(run: Any) -> tuple[int, Any]:
    """(peak RSS growth in bytes while ``run()`` runs, its result), from a heap that has
    handed its free memory back (glibc's ``malloc_trim``: an earlier task's freed arrays would
    otherwise be reused unseen)."""
    import gc

    from embgeom_ray.inputs.malloc_tuning import release_freed_memory

    gc.collect()
    release_freed_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = _rss("VmRSS")
    out = run()
    return _rss("VmHWM") - base, out


def measure(task: str, n: int, d: int, m: int) -> dict[str, Any]:
    """One task's peak RSS growth and formula, in this process (a fresh one)."""
    import sklearn.metrics  # noqa: F401  the worker's libraries, loaded before its tasks
    import torch  # noqa: F401

    from embgeom_ray.core.options import SampledOptions
    from embgeom_ray.core.tables import sampled_options, sampled_row, sampled_selection
    from embgeom_ray.sizing.sampled_tasks import kmeans_task_bytes, metrics_task_bytes

    options = SampledOptions(silhouette_max_points=m)
    X, tokens, types = points(64, d, 1)  # warm: BLAS, the libraries' first calls
    small = sampled_options(options, 64)
    km, D = sampled_selection(X, None, small[0])
    sampled_row(X, tokens, types, km, [], groups=None, distances=D, **small[1])
    X, tokens, types = points(n, d)
    kmeans_options, row_options = sampled_options(options, n)
    if task == "share":
        growth, formula = measure_share(X, options)
    elif task == "kmeans":
        growth, _ = peak_growth(lambda: sampled_selection(X, None, kmeans_options))
        formula = kmeans_task_bytes(n, d, m, options.kmeans_k_max, options.kmeans_n_init)
    else:
        km, D = sampled_selection(X, None, kmeans_options)
        growth, _ = peak_growth(
            lambda: sampled_row(X, tokens, types, km, [], groups=None, distances=D, **row_options)
        )
        formula = metrics_task_bytes(n, d, m, row_options["lid_k"], D is None and n <= m)
    return {"task": task, "n": n, "d": d, "m": m, "growth": growth, "formula": formula,
            "ratio": growth / formula}  # fmt: skip


def measure_share(X: Any, options: Any) -> tuple[int, int]:
    """(peak RSS growth, formula) of a fit-share task given the whole step's fits, the larger
    of the seedings of every k ≤ 15 and the stability refits at k_max (any share's bound),
    its points arriving as Ray hands them over: unpickled from read-only buffers (the object
    store's pages, counted there, not here)."""
    import pickle
    from functools import partial

    from embgeom_ray.core.kmeans_selection import (
        K_DENSE,
        SquaredDistances,
        chain_trials,
        fit_many,
        plus_plus,
        scan_ks,
        serial_fits,
    )  # fmt: skip
    from embgeom_ray.core.lloyd import Points
    from embgeom_ray.sizing.sampled_tasks import seedings, share_step_bytes

    n, k_max = len(X), options.kmeans_k_max
    F, S = seedings(k_max, options.kmeans_n_init), options.kmeans_stability_seeds
    sqd, trials = SquaredDistances(X - X.mean(axis=0)), chain_trials(k_max)
    chains = [plus_plus(sqd, K_DENSE, (0, c), trials) for c in range(F)]
    dense = [k for k in scan_ks(min(k_max, n - 1)) if k <= K_DENSE]
    steps = [[ch[:k] for k in dense for ch in chains],
             [plus_plus(sqd, min(k_max, n - 1), (1, r), trials) for r in range(S)]]  # fmt: skip
    buffers: list[Any] = []
    data = pickle.dumps(Points(sqd.X), protocol=5, buffer_callback=buffers.append)
    store = [memoryview(bytes(b.raw())).toreadonly() for b in buffers]  # the store's pages
    fit = partial(fit_many, max_iter=300, tol=1e-4, dtype=np.float32)
    growth = max(peak_growth(partial(lambda g: serial_fits(fit, pickle.loads(data, buffers=store), g),
                                     inits))[0] for inits in steps)  # fmt: skip
    return growth, share_step_bytes(n, X.shape[1], k_max, options.kmeans_n_init, S)


def measure_apart(task: str, n: int, d: int, m: int) -> dict[str, Any]:
    """:func:`measure` in a fresh process of one thread."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.sampled_task_memory", "--one", task, str(n), str(d), str(m)],
        capture_output=True, text=True, env=os.environ | ONE_THREAD, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="512,1024,2048,4096", help="n: points a layer")
    p.add_argument("--dims", default="64,384", help="d")
    p.add_argument("--max-points", default="4096", help="m: --silhouette-max-points")
    p.add_argument("--one", nargs=4, metavar=("TASK", "N", "D", "M"), help="one point, here")
    p.add_argument("--tasks", default="kmeans,metrics,share", help="of kmeans, metrics, share")
    p.add_argument("--name", default="sampled_task_memory")
    args = p.parse_args(argv)
    if args.one:
        task, n, d, m = args.one
        print(json.dumps(measure(task, int(n), int(d), int(m))))
        return
    from bench.common import save

    results = []
    for m in map(int, args.max_points.split(",")):
        for d in map(int, args.dims.split(",")):
            for n in map(int, args.sizes.split(",")):
                for task in args.tasks.split(","):
                    r = measure_apart(task, n, d, m)
                    results.append(r)
                    mib = r["growth"] / 2**20, r["formula"] / 2**20
                    print(f"{task:7} n = {n:5,} d = {d:5,} m = {m:5,}: {mib[0]:7.1f} MiB "
                          f"of {mib[1]:7.1f} MiB ({r['ratio']:.2f})")  # fmt: skip
    save(args.name, {"command": "python -m bench.sampled_task_memory", "args": vars(args),
                     "results": results})  # fmt: skip


if __name__ == "__main__":
    main()
