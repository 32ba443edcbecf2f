"""The per-layer sampled metrics: this checkout's code against an earlier revision's, same process.

The points are MiniLM's hidden states at ``--layers`` of a bottom-k sample of ``--size``
occurrences of the demo corpus (the extractor's own :class:`~embgeom_ray.core.samples.ActivationSample`,
with a type-uniform part), as the job's sampled stage gets them. For every layer K-means
model selection (:func:`embgeom_ray.core.kmeans.select_k`, the job's defaults) is run
alternately ``--repeats`` times with scikit-learn's own k-means++ seeding and with the job's
(:class:`~embgeom_ray.core.kmeanspp.PlusPlus`, the float64 copy made once a fit), checked to
give the same result, and timed; then, alternately ``--repeats`` times, single-threaded (one
BLAS/OpenMP and one torch thread, as each Ray task of the stage runs, and as ``select_k`` ran):

  (a) baseline: :func:`~embgeom_ray.core.tables.sampled_row` of the package as it was at git
      revision ``--baseline`` (extracted with ``git archive`` and imported under another name);
  (b) current: the same function of this checkout,

on the same points and K-means result, each also without the half-sample standard errors
(``se_replicates=0``) to split the time into the one-off metrics and the SEs. Printed per
layer: median seconds of (a) and (b), their ratio, and the largest relative difference
between any two output values (the optimisations must not change what is computed).
``--clusters best`` uses the best-silhouette K-means labels even where k = 1 is chosen (more
clusters: more cluster-adjusted IsoScores). ``--baseline none`` times the current code only.

    python -m bench.sampled_stage [--size 4096] [--layers 0,3,6] [--repeats 3]
        [--baseline 573a6e4] [--clusters chosen|best]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from bench.common import baseline_module, median, save, timed

#: the last revision before the sampled stage shared its kNN searches across half-samples
BASELINE = "573a6e4"


def baseline_tables(ref: str, work: Path) -> ModuleType:
    """``embgeom_ray.core.tables`` of git revision ``ref``, imported as a separate package."""
    return baseline_module(ref, work, "core.tables")


def max_rel_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest |a − b| / |b| over the common keys (NaN = NaN; inf where only one is NaN)."""
    worst = 0.0
    for key in a.keys() & b.keys():
        x, y = float(a[key]), float(b[key])
        if (np.isnan(x) and np.isnan(y)) or x == y:
            continue
        worst = max(worst, abs(x - y) / abs(y) if np.isfinite(x - y) and y else np.inf)
    return worst


def bench_select_k(X, args) -> tuple[dict[str, float], Any]:
    """``select_k`` alternately with scikit-learn's own k-means++ seeding and with
    :class:`~embgeom_ray.core.kmeanspp.PlusPlus` (the job's), ``--repeats`` times; median
    seconds of each, and the job's result after checking that both are the same."""
    import embgeom_ray.core.kmeans as km_module

    ours = km_module.PlusPlus
    times: dict[str, list[float]] = {"sklearn_seeding": [], "current": []}
    results = {}
    try:
        for _ in range(args.repeats):
            for name, init in (("sklearn_seeding", lambda: "k-means++"), ("current", ours)):
                km_module.PlusPlus = init
                t, results[name] = timed(lambda: km_module.select_k(X, seed=args.seed))
                times[name].append(t)
    finally:
        km_module.PlusPlus = ours
    a, b = results["sklearn_seeding"], results["current"]
    same = repr((a.k, a.silhouettes, a.inertias, a.stability)) == repr(
        (b.k, b.silhouettes, b.inertias, b.stability)
    ) and np.array_equal(a.labels, b.labels)  # repr: NaN equals NaN
    if not same:
        raise AssertionError("select_k's result changed with the seeding")
    return {name: median(ts) for name, ts in times.items()}, b


def bench_layer(layer: int, X, tok, tv, tables: dict[str, ModuleType], args) -> dict:
    km_secs, km = bench_select_k(X, args)
    t_km = km_secs["current"]
    if args.clusters == "best" and km.best_labels is not None:
        km = replace(km, k=km.best_k, labels=km.best_labels)
    runs = {
        (name, part): (lambda mod=mod, opts=opts: mod.sampled_row(X, tok, tv, km, [], **opts))
        for name, mod in tables.items()
        for part, opts in (("total", {}), ("no_se", {"se_replicates": 0}))
    }
    times: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
    rows: dict[tuple[str, str], dict] = {}
    for _ in range(args.repeats):
        for key, run in runs.items():
            t, rows[key] = timed(run)
            times[key].append(t)
    secs = {
        name: {part: median(times[name, part]) for part in ("total", "no_se")} for name in tables
    }
    for s in secs.values():
        s["se"] = s["total"] - s["no_se"]
    result = {
        "layer": layer,
        "n": len(X),
        "kmeans_k": int(km.k),
        "select_k_seconds": t_km,
        "select_k_seconds_sklearn_seeding": km_secs["sklearn_seeding"],
        "seconds": secs,
    }
    line = (
        f"layer {layer}: select_k {km_secs['sklearn_seeding']:5.2f}s -> {t_km:5.2f}s with "
        f"PlusPlus (same result) | k={km.k:2d} | "
    )
    if "baseline" in tables:
        b, c = secs["baseline"], secs["current"]
        result["ratio"] = {part: b[part] / c[part] for part in b}
        result["max_rel_diff"] = max_rel_diff(rows["current", "total"], rows["baseline", "total"])
        line += (
            f"sampled_row {b['total']:5.2f}s -> {c['total']:5.2f}s (x{result['ratio']['total']:.2f};"
            f" without SEs {b['no_se']:4.2f} -> {c['no_se']:4.2f}, SEs {b['se']:4.2f} -> "
            f"{c['se']:4.2f}) | max rel diff {result['max_rel_diff']:.1e}"
        )
    else:
        c = secs["current"]
        line += (
            f"sampled_row {c['total']:5.2f}s (without SEs {c['no_se']:4.2f}, SEs {c['se']:4.2f})"
        )
    print(line)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=4096, help="sampled occurrences per layer")
    p.add_argument("--layers", default="0,3,6", help="MiniLM hidden-state layers (0..6)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", default=BASELINE, help="git revision to compare with, or none")
    p.add_argument("--clusters", choices=("chosen", "best"), default="chosen")
    p.add_argument("--name", default="sampled_stage")
    args = p.parse_args(argv)
    layers = [int(x) for x in args.layers.split(",")]

    import torch
    from threadpoolctl import threadpool_limits

    import embgeom_ray.core.tables as current
    from bench.kmeans import minilm_sample

    work = Path(tempfile.mkdtemp(prefix="embgeom-bench-sampled-"))
    try:
        sample = minilm_sample(args.size, layers, work, args.seed, type_size=args.size)
        tables = {"current": current}
        if args.baseline.lower() != "none":
            tables = {"baseline": baseline_tables(args.baseline, work), **tables}
        torch.set_num_threads(1)
        results = []
        with threadpool_limits(1):
            for layer in layers:
                pts = sample.points(layer)
                tv = sample.type_points(layer).vectors if sample.num_types >= 2 else None
                results.append(bench_layer(layer, pts.vectors, pts.token_ids, tv, tables, args))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if "baseline" in tables:
        per_layer = [r["seconds"] for r in results]
        b = sum(s["baseline"]["total"] for s in per_layer)
        c = sum(s["current"]["total"] for s in per_layer)
        print(f"all {len(layers)} layers: sampled_row {b:.2f}s -> {c:.2f}s (x{b / c:.2f})")
    save(
        args.name,
        {
            "command": "python -m bench.sampled_stage",
            "args": vars(args),
            "points": {"model": "all-MiniLM-L6-v2", "dim": int(sample.dim)},
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
