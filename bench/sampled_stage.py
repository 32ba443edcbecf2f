"""A layer's share of the sampled-metrics stage: this checkout's code against an earlier revision's.

The points are MiniLM's hidden states at ``--layers`` of a bottom-k sample of ``--size``
occurrences of the demo corpus (the extractor's own :class:`~embgeom_ray.core.samples.ActivationSample`,
with a type-uniform part), as the job's sampled stage gets them. For every layer, alternately
``--repeats`` times, single-threaded (one BLAS/OpenMP and one torch thread, as each Ray task
of the stage runs):

  (a) baseline: the K-means model selection and :func:`~embgeom_ray.core.tables.sampled_row`
      of the package as it was at git revision ``--baseline`` (extracted with ``git archive``
      and imported under another name), with its defaults;
  (b) current: :func:`~embgeom_ray.core.kmeans_selection.select_k` (with the sample's content
      keys) and ``sampled_row`` of this checkout, with its defaults, the way the stage's
      per-layer task runs them (:func:`~embgeom_ray.core.tables.sampled_layer_results`: the
      distance matrix of the distinct points computed once, in the selection's time, and
      given to both),

each also without the half-sample standard errors (``se_replicates=0``), to split the time into
the selection, the one-off metrics and the SEs. ``--synthetic-dim D`` replaces MiniLM's points
by ``--size`` synthetic ones of D dimensions per layer (:func:`synthetic_layer`: a mixture of
64 anisotropic Gaussian clusters around a common offset, token ids of a Zipf law over 5,000
types, every point distinct), to time the stage at a large model's shape (d = 4,096, s =
8,192: an 8B model's default sample) that MiniLM cannot give; its clusters are not a real
model's, so its Lloyd iterations are indicative only. Printed per layer: median seconds of each part
of (a) and (b), the ratio of the layer's totals, and each side's k; then the totals over the
layers (the stage's CPU time: the layers run as parallel tasks, so on C CPUs the stage takes
about that over C). ``--baseline none`` times the current code only. ``--clock cpu`` times
by the process's CPU time instead of the wall clock (one thread runs, so they agree on an idle
machine; on one shared with other work the CPU time does not count the waits for a core).

    python -m bench.sampled_stage [--size 4096] [--layers 0,...,6] [--repeats 3]
        [--baseline 5459444] [--clock wall|cpu] [--synthetic-dim D]
"""

from __future__ import annotations

import argparse
import inspect
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from bench.common import baseline_module, median, save, work_dir

#: the last revision before each k's partition was the lowest inertia of many seedings (one
#: k-means++ chain per k, scikit-learn's Lloyd; issue 50)
BASELINE = "5459444"


def baseline_modules(ref: str, work: Path) -> dict[str, ModuleType]:
    """``tables`` and the module holding ``select_k`` of git revision ``ref``."""
    tables = baseline_module(ref, work, "core.tables")
    package = tables.__name__.rsplit(".", 1)[0]
    import importlib

    for name in ("kmeans_selection", "kmeans"):
        try:
            module = importlib.import_module(f"{package}.{name}")
        except ImportError:
            continue
        if hasattr(module, "select_k"):
            return {"tables": tables, "selection": module}
    raise SystemExit(f"revision {ref} has no select_k")


def layer_parts(mods: dict[str, ModuleType], X, tok, tv, keys) -> dict[str, Any]:
    """The layer's three parts as callables of the given revision: selection, metrics (no SEs),
    metrics (with SEs); passing the content keys where that revision takes them."""
    select_k, sampled_row = mods["selection"].select_k, mods["tables"].sampled_row
    takes_groups = "groups" in inspect.signature(select_k).parameters
    extra = {"groups": keys} if takes_groups else {}
    shares = hasattr(mods["selection"], "distinct_distances")  # one matrix for both parts
    state: dict[str, Any] = {}

    def selection():
        if shares:
            sel = mods["selection"]
            shared = sel.distinct_distances(X, keys, sel.SILHOUETTE_MAX_POINTS)
            state["distances"] = {"distances": None if shared is None else shared[1]}
            state["km"] = select_k(X, shared=shared, **extra)
        else:
            state["distances"] = {}
            state["km"] = select_k(X, **extra)
        return state["km"]

    def metrics(se: bool):
        opts = {} if se else {"se_replicates": 0}
        return sampled_row(X, tok, tv, state["km"], [], **extra, **state["distances"], **opts)

    return {"select_k": selection, "no_se": lambda: metrics(False), "total": lambda: metrics(True)}


def synthetic_layer(size: int, dim: int, seed: int) -> tuple[np.ndarray, ...]:
    """(points, token ids, type vectors, content keys) of one synthetic layer: ``size`` float32
    points of ``dim`` dimensions, 64 clusters (centres N(0, 4² I) in a random subspace of
    min(64, dim) dimensions, points their centre plus N(0, I) noise scaled per dimension by a
    log-normal spectrum), all shifted by a common offset of norm 20 (the anisotropy of a
    transformer's states); token ids from a Zipf law (s = 1.1) over 5,000 types; one vector per type seen
    (its first occurrence); content keys 0..size − 1 (every point distinct)."""
    rng = np.random.default_rng(seed)
    sub = min(64, dim)
    basis = np.linalg.qr(rng.normal(size=(dim, sub)))[0]  # (dim, sub) orthonormal
    centres = rng.normal(scale=4.0, size=(64, sub)) @ basis.T
    scale = np.exp(rng.normal(scale=0.5, size=dim))
    offset = rng.normal(size=dim)
    offset *= 20.0 / np.linalg.norm(offset)
    which = rng.integers(0, 64, size=size)
    X = (centres[which] + rng.normal(size=(size, dim)) * scale + offset).astype(np.float32)
    ranks = np.arange(1, 5001)
    p = ranks**-1.1 / (ranks**-1.1).sum()
    tok = rng.choice(5000, size=size, p=p).astype(np.int64)
    _, first = np.unique(tok, return_index=True)
    return X, tok, X[np.sort(first)], np.arange(size, dtype=np.int64)


def bench_layer(layer: int, X, tok, tv, keys, revisions: dict[str, dict], args) -> dict:
    parts = {name: layer_parts(mods, X, tok, tv, keys) for name, mods in revisions.items()}
    times: dict[tuple[str, str], list[float]] = {
        (name, part): [] for name in parts for part in ("select_k", "no_se", "total")
    }
    results: dict[str, Any] = {}
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for _ in range(args.repeats):
        for name, fns in parts.items():
            for part in ("select_k", "no_se", "total"):
                t0 = clock()
                out = fns[part]()
                t = clock() - t0
                times[name, part].append(t)
                if part == "select_k":
                    results[name] = out
    secs = {
        name: {part: median(times[name, part]) for part in ("select_k", "no_se", "total")}
        for name in parts
    }
    for s in secs.values():  # "total" is the metrics with SEs; the layer is selection + that
        s["se"] = s["total"] - s["no_se"]
        s["layer"] = s["select_k"] + s["total"]
    result = {
        "layer": layer,
        "n": len(X),
        "seconds": secs,
        "k": {name: int(km.k) for name, km in results.items()},
        "best_k": {name: int(km.best_k) for name, km in results.items()},
    }
    line = f"layer {layer}: "
    for name, s in secs.items():
        line += (
            f"{name} select_k {s['select_k']:5.2f}s + metrics {s['no_se']:4.2f}s + SEs "
            f"{s['se']:4.2f}s = {s['layer']:5.2f}s (k {result['k'][name]}, best "
            f"{result['best_k'][name]}) | "
        )
    if "baseline" in secs:
        result["ratio"] = secs["baseline"]["layer"] / secs["current"]["layer"]
        line += f"baseline / current x{result['ratio']:.2f}"
    print(line, flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=4096, help="sampled occurrences per layer")
    p.add_argument("--layers", default="0,1,2,3,4,5,6", help="MiniLM hidden-state layers (0..6)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", default=BASELINE, help="git revision to compare with, or none")
    p.add_argument("--name", default="sampled_stage")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="what the times count")
    p.add_argument(
        "--synthetic-dim", type=int, default=0,
        help="time synthetic points of this dimension instead of MiniLM's (synthetic_layer)",
    )  # fmt: skip
    args = p.parse_args(argv)
    layers = [int(x) for x in args.layers.split(",")]

    import torch
    from threadpoolctl import threadpool_limits

    import embgeom_ray.core.kmeans_selection as selection
    import embgeom_ray.core.tables as tables
    from bench.kmeans import minilm_sample

    with work_dir("sampled-stage") as work:
        sample = None
        if not args.synthetic_dim:
            sample = minilm_sample(args.size, layers, work, args.seed, type_size=args.size)
        revisions = {"current": {"tables": tables, "selection": selection}}
        if args.baseline.lower() != "none":
            revisions = {"baseline": baseline_modules(args.baseline, work), **revisions}
        torch.set_num_threads(1)
        results = []
        with threadpool_limits(1):
            for layer in layers:
                if sample is None:
                    inputs = synthetic_layer(args.size, args.synthetic_dim, args.seed + layer)
                else:
                    pts = sample.points(layer)
                    tv = sample.type_points(layer).vectors if sample.num_types >= 2 else None
                    inputs = (pts.vectors, pts.token_ids, tv, pts.content_keys)
                results.append(bench_layer(layer, *inputs, revisions, args))
    totals = {name: sum(r["seconds"][name]["layer"] for r in results) for name in revisions}
    print(
        f"all {len(layers)} layers: "
        + " | ".join(f"{name} {t:.2f}s" for name, t in totals.items())
        + (f" | baseline / current x{totals['baseline'] / totals['current']:.2f}" if "baseline" in totals else "")
    )
    save(
        args.name,
        {
            "command": "python -m bench.sampled_stage",
            "args": vars(args),
            "points": {"model": "all-MiniLM-L6-v2", "dim": int(sample.dim)}
            if sample is not None
            else {"model": "synthetic", "dim": args.synthetic_dim},
            "results": results,
            "totals": totals,
        },
    )


if __name__ == "__main__":
    main()
