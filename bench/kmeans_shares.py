"""A layer's K-means fits spread over Ray tasks against one task per layer, the job's defaults.

The points are MiniLM's hidden states at ``--layers`` (default all, 0..6) of a bottom-k sample
of ``--size`` occurrences of the demo corpus (the extractor's own :class:`~embgeom_ray.core.samples.ActivationSample`, as in
``bench.kmeans``), for each seed of ``--seeds`` (another seed: another sample). On a local Ray
of ``--cpus`` CPUs, every layer's model selection runs as the job runs it
(:func:`embgeom_ray.distributed.kmeans.fit_layers_on_ray`: the scan of
:func:`~embgeom_ray.core.kmeans_selection.scan_ks` up to 60, one initialisation, 2 stability
refits), alternately ``--repeats`` times:

  (a) one share: each layer's fits all in its own task (the job before the fits were spread);
  (b) shares: the job's default (:func:`~embgeom_ray.distributed.kmeans.fit_shares`: the
      refits split over up to C tasks, the scan only where C exceeds the layers).

Printed per seed: the median wall time of each, their ratio, whether every layer's result is
the same (k, silhouettes, inertias, labels, stability), and each layer's largest k searched and
the time of its selection alone in one process (one thread): the stage cannot end before its
slowest layer in (a), nor before the layers' total over C in either.

    python -m bench.kmeans_shares [--size 4096] [--layers 0,...,6] [--seeds 0,1,2]
        [--repeats 3] [--cpus 2]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bench.common import alternate, median, save, timed, work_dir
from bench.kmeans import minilm_sample


def same_results(a, b) -> bool:
    """Whether two layer -> SelectKResult maps hold the same selections, value for value."""
    for layer in a:
        x, y = a[layer], b[layer]
        if (x.k, x.best_k, x.k_searched, x.silhouettes, x.inertias) != (
            y.k, y.best_k, y.k_searched, y.silhouettes, y.inertias
        ):  # fmt: skip
            return False
        if not (np.array_equal(x.labels, y.labels) and np.array_equal(x.centers, y.centers)):
            return False
        if not (x.stability == y.stability or (np.isnan(x.stability) and np.isnan(y.stability))):
            return False
    return True


def bench_seed(seed: int, args, work: Path) -> dict:
    from threadpoolctl import threadpool_limits

    from embgeom_ray.core.kmeans_selection import select_k
    from embgeom_ray.distributed.kmeans import fit_layers_on_ray, fit_shares

    layers = [int(x) for x in args.layers.split(",")]
    sample = minilm_sample(args.size, layers, work / f"seed{seed}", seed)
    by_layer = {layer: sample.points(layer).vectors for layer in layers}
    alone: dict[int, float] = {}
    searched: dict[int, int] = {}
    with threadpool_limits(1):
        for layer, X in by_layer.items():
            alone[layer], res = timed(lambda X=X: select_k(X, seed=seed))
            searched[layer] = int(res.k_searched)
    shares = fit_shares(len(layers), 1)
    runs = {
        "one_share": lambda: fit_layers_on_ray(by_layer, seed=seed, shares=(1, 1)),
        "shares": lambda: fit_layers_on_ray(by_layer, seed=seed),
    }
    times, out = alternate(runs, args.repeats)
    secs = {name: median(ts) for name, ts in times.items()}
    same = same_results(out["one_share"], out["shares"])
    bound = max(max(alone.values()), sum(alone.values()) / args.cpus)
    print(
        f"seed {seed}: one share {secs['one_share']:6.2f}s | shares {shares} "
        f"{secs['shares']:6.2f}s (x{secs['one_share'] / secs['shares']:.2f}) | same results: "
        f"{same} | lower bound of (a) {bound:5.2f}s, of (b) {sum(alone.values()) / args.cpus:5.2f}s"
    )
    for layer in layers:
        print(
            f"  layer {layer}: k {out['shares'][layer].k:2d}, searched up to "
            f"{searched[layer]:2d}, alone {alone[layer]:5.2f}s"
        )
    return {
        "seed": seed,
        "seconds": secs,
        "times": times,
        "shares": list(shares),
        "same_results": same,
        "alone_seconds": {str(k): v for k, v in alone.items()},
        "k_searched": {str(k): v for k, v in searched.items()},
        "k": {str(layer): int(out["shares"][layer].k) for layer in layers},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=4096, help="sampled occurrences per layer")
    p.add_argument("--layers", default="0,1,2,3,4,5,6", help="MiniLM hidden-state layers (0..6)")
    p.add_argument("--seeds", default="0,1,2", help="sample seeds (one sample each)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray")
    p.add_argument("--name", default="kmeans_shares")
    args = p.parse_args(argv)

    import ray

    started = not ray.is_initialized()  # a Ray already up (the smoke test's) is used as is
    if started:
        ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    try:
        with work_dir("kmeans-shares") as work:
            results = [bench_seed(int(s), args, work) for s in args.seeds.split(",")]
    finally:
        if started:
            ray.shutdown()
    a = sum(r["seconds"]["one_share"] for r in results)
    b = sum(r["seconds"]["shares"] for r in results)
    print(f"all seeds: one share {a:.2f}s, shares {b:.2f}s (x{a / b:.2f})")
    save(
        args.name,
        {
            "command": "python -m bench.kmeans_shares",
            "args": vars(args),
            "points": {"model": "all-MiniLM-L6-v2"},
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
