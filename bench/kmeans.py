"""Distributed K-means against scikit-learn's KMeans on the same real activations.

The points are MiniLM's hidden states at one middle layer (``--layer``, default 3 of 0..6) of
occurrences drawn uniformly from the demo corpus (the Python Language Reference prose): the
extractor's own bottom-k sample (:class:`~embgeom_ray.core.samples.ActivationSample`) of
``max(--sizes)`` occurrences; a size n uses the n occurrences with the smallest keys, itself a
uniform sample. For every size n and every k in ``--ks``, the same float64 points are fitted by
  (a) ours: :func:`embgeom_ray.distributed.kmeans.fit_on_ray` on a local Ray of ``--cpus`` CPUs
      (k-means|| initialisation, Lloyd with one Ray task per partition per pass);
  (b) ours, serial: :func:`embgeom_ray.core.kmeans.fit` with its in-process map (the same
      algorithm without Ray: separates the algorithm's cost from Ray's overhead);
  (c) ``sklearn.cluster.KMeans(n_clusters=k, n_init=..., random_state=seed)`` (k-means++,
      Lloyd, its OpenMP threads),
with the same ``n_init``, ``max_iter`` and ``tol``, ``--repeats`` times alternately in one
process. The printed ratios are ours/sklearn: inertia (≤ 1 is as good or better; same seed
every repeat, so the inertias are those of one fit) and median wall time (< 1 is faster).

``--selection N`` adds the job's whole model selection (k = 2..``--selection-k-max``,
``--n-init`` initialisations, silhouettes on the shared distance matrix) for every MiniLM
layer (0..6) on the same bottom-k sample of N occurrences, on the same local Ray, alternately
``--selection-repeats`` times:
  (d) distributed: :func:`embgeom_ray.distributed.kmeans.fit_layers_on_ray` with
      ``local_max_elements=None``, the k-means|| map with one Ray task per partition per pass
      (the job's only route before samples this small were fitted in one task);
  (e) one task per layer: the same call with its default threshold, scikit-learn's KMeans in
      one single-threaded Ray task per layer (the job's route for such samples);
  (f) the stage: :func:`embgeom_ray.distributed.sampled_stage.add_sampled_metrics` as the job runs it — (e)
      plus every layer's other sampled metrics (LID, silhouette by type, cluster-adjusted
      metrics, partition isotropy, clipped cosines) in Ray tasks that start as each layer's
      clusters are ready.
Printed: wall time of each and, per layer, the chosen k and best silhouette of (d) and (e),
which differ only as K-means runs from different random initialisations do.

    python -m bench.kmeans [--sizes 1024,4096,16384] [--ks 2,8,15] [--n-init 3] [--repeats 3]
        [--no-serial] [--selection 4096] [--selection-k-max 15] [--selection-repeats 1]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from bench.common import alternate, english_jsonl, median, minilm_dir, save, timed, work_dir


def minilm_points(n: int, layer: int, work: Path, seed: int = 0) -> np.ndarray:
    """(n, 384) float64 MiniLM hidden states at ``layer`` of n uniformly sampled occurrences."""
    sample = minilm_sample(n, [layer], work, seed)
    X = sample.points(layer).vectors
    print(f"points: {n:,} MiniLM occurrences, layer {layer}, d = {X.shape[1]}")
    return np.ascontiguousarray(X[:n], dtype=np.float64)


def minilm_sample(n: int, layers: list[int], work: Path, seed: int = 0, type_size: int = 1):
    """The extractor's bottom-k :class:`ActivationSample` of n MiniLM occurrences at ``layers``.

    ``type_size``: token types in its type-uniform part (1: none to speak of).
    """
    from embgeom_ray.config import build_config
    from embgeom_ray.inputs.corpus import CorpusSpec, plan_shards
    from embgeom_ray.inputs.extractor import ShardProcessor

    full = Path(english_jsonl(work / "full.jsonl"))
    # a prefix of about 2n tokens (~5 characters per token in this prose), so that the
    # bottom-k sample of n occurrences is drawn from twice as many
    corpus = work / "prefix.jsonl"
    chars = 0
    with corpus.open("w") as f:
        for line in full.read_text().splitlines(keepends=True):
            f.write(line)
            chars += len(line)
            if chars > 10 * n:
                break
    cfg = build_config(
        None,
        {
            "model": minilm_dir(),
            "corpus": str(corpus),
            "out": str(work / "unused"),
            "sample_size": n,
            "sample_type_size": type_size,
            "sample_seed": seed,
        },
    )
    proc = ShardProcessor(cfg.extraction, layers, {"model_fingerprint": "bench"})
    _, sample, counts = proc.process(plan_shards(CorpusSpec(str(corpus)), 1 << 40).shards[0])
    if sample.num_uniform < n:
        raise SystemExit(
            f"the corpus gave {sample.num_uniform} occurrences, fewer than the {n} asked for"
        )
    print(f"sample: {n:,} of {counts.tokens:,} MiniLM tokens, layers {layers}")
    return sample


def bench_case(X: np.ndarray, k: int, args) -> dict:
    from sklearn.cluster import KMeans

    from embgeom_ray.core.kmeans import fit
    from embgeom_ray.distributed.kmeans import fit_on_ray

    opts = {"n_init": args.n_init, "max_iter": args.max_iter, "tol": args.tol}
    runs = {
        "ours_ray": lambda: fit_on_ray(X, k, seed=args.seed, **opts),
        "ours_serial": lambda: fit(X, k, seed=args.seed, **opts),
        "sklearn": lambda: KMeans(n_clusters=k, random_state=args.seed, **opts).fit(X),
    }
    if args.no_serial:
        del runs["ours_serial"]
    times: dict[str, list[float]] = {name: [] for name in runs}
    inertia: dict[str, float] = {}
    n_iter: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, run in runs.items():
            t, res = timed(run)
            times[name].append(t)
            inertia[name] = float(res.inertia if name != "sklearn" else res.inertia_)
            n_iter[name] = int(res.n_iter if name != "sklearn" else res.n_iter_)
    secs = {name: median(ts) for name, ts in times.items()}
    result = {
        "n": len(X),
        "k": k,
        "seconds": secs,
        "inertia": inertia,
        "n_iter": n_iter,
        "inertia_ratio": inertia["ours_ray"] / inertia["sklearn"],
        "time_ratio": secs["ours_ray"] / secs["sklearn"],
    }
    line = (
        f"n={len(X):6,d} k={k:2d} | inertia ours/sklearn {result['inertia_ratio']:.4f} | "
        f"time ours {secs['ours_ray']:7.3f}s sklearn {secs['sklearn']:7.3f}s "
        f"ratio {result['time_ratio']:6.2f}"
    )
    if "ours_serial" in runs:
        result["serial_inertia_ratio"] = inertia["ours_serial"] / inertia["sklearn"]
        result["serial_time_ratio"] = secs["ours_serial"] / secs["sklearn"]
        line += (
            f" | serial (no Ray) ratio {result['serial_time_ratio']:6.2f} "
            f"inertia {result['serial_inertia_ratio']:.4f}"
        )
    print(line)
    return result


def bench_selection(sample, args) -> dict:
    """(d), (e), (f) of the module docstring on every layer of ``sample``."""
    import pandas as pd

    from embgeom_ray.config import build_config
    from embgeom_ray.core.sample_layers import InMemorySample
    from embgeom_ray.distributed.kmeans import fit_layers_on_ray
    from embgeom_ray.distributed.sampled_stage import add_sampled_metrics

    layers = list(sample.layers)
    by_layer = {layer: sample.points(layer).vectors for layer in layers}
    n, d = by_layer[layers[0]].shape
    opts = {"k_max": args.selection_k_max, "n_init": args.n_init, "seed": args.seed}
    cfg = build_config(
        None,
        {
            "model": "bench",
            "corpus": "bench",
            "out": "unused",
            "kmeans_k_max": args.selection_k_max,
            "kmeans_n_init": args.n_init,
            "sample_seed": args.seed,
        },
    )

    def stage():
        tables = {
            "layers": pd.DataFrame({"layer": layers, "isoscore": np.nan}),
            "dims": pd.DataFrame({"layer": [], "dim": [], "outlier": []}),
        }
        add_sampled_metrics(tables, InMemorySample(sample), cfg.sampled)
        return tables["layers"]

    runs = {
        "distributed": lambda: fit_layers_on_ray(by_layer, local_max_elements=None, **opts),
        "one_task_per_layer": lambda: fit_layers_on_ray(by_layer, **opts),
        "stage": stage,
    }
    times, out = alternate(runs, args.selection_repeats)
    secs = {name: median(ts) for name, ts in times.items()}
    per_layer = {
        name: {
            str(layer): {"k": out[name][layer].k, "silhouette": out[name][layer].silhouette}
            for layer in layers
        }
        for name in ("distributed", "one_task_per_layer")
    }
    print(
        f"selection, {len(layers)} layers x n={n:,} d={d}, k=2..{opts['k_max']}: "
        f"distributed {secs['distributed']:.2f}s | one task per layer "
        f"{secs['one_task_per_layer']:.2f}s (x{secs['distributed'] / secs['one_task_per_layer']:.1f}"
        f" faster) | whole sampled-metrics stage {secs['stage']:.2f}s"
    )
    for layer in layers:
        a, b = per_layer["distributed"][str(layer)], per_layer["one_task_per_layer"][str(layer)]
        print(
            f"  layer {layer}: k {a['k']:2d} vs {b['k']:2d}, "
            f"silhouette {a['silhouette']:.4f} vs {b['silhouette']:.4f}"
        )
    return {"n": n, "dim": d, "layers": layers, "seconds": secs, "per_layer": per_layer}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1024,4096,16384", help="sample sizes n")
    p.add_argument("--ks", default="2,8,15", help="numbers of clusters k")
    p.add_argument("--n-init", type=int, default=3)
    p.add_argument("--max-iter", type=int, default=300)
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layer", type=int, default=3, help="MiniLM hidden-state layer (0..6)")
    p.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-serial", action="store_true", help="skip (b), ours without Ray")
    p.add_argument(
        "--selection", type=int, default=0, help="also (d)-(f) on a sample of this many points"
    )
    p.add_argument("--selection-k-max", type=int, default=15)
    p.add_argument("--selection-repeats", type=int, default=1)
    p.add_argument("--name", default="kmeans")
    args = p.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    ks = [int(k) for k in args.ks.split(",")]
    if min(sizes) < max(ks):
        raise SystemExit(f"every size must be >= the largest k ({max(ks)})")

    import ray

    with work_dir("kmeans") as work:
        X_all = minilm_points(max(sizes), args.layer, work, args.seed)
        sample = None
        if args.selection:
            sample = minilm_sample(args.selection, list(range(7)), work, args.seed)
    started = not ray.is_initialized()
    if started:
        ray.init(  # a new local Ray of --cpus CPUs, never a cluster already running here
            address="local",
            num_cpus=args.cpus,
            include_dashboard=False,
            log_to_driver=False,
            logging_level="ERROR",
        )
    try:
        from sklearn.cluster import KMeans

        from embgeom_ray.core.kmeans import fit
        from embgeom_ray.distributed.kmeans import fit_on_ray

        t0 = time.perf_counter()  # warm-up of each contender (Ray workers, thread pools)
        X_warm = X_all[: max(64, max(ks))]
        fit_on_ray(X_warm, 2, n_init=1, seed=args.seed)
        fit(X_warm, 2, n_init=1, seed=args.seed)
        KMeans(n_clusters=2, n_init=1, random_state=args.seed).fit(X_warm)
        print(f"warm-up {time.perf_counter() - t0:.2f}s (not counted)")
        results = [bench_case(X_all[:n], k, args) for n in sizes for k in ks]
        selection = bench_selection(sample, args) if sample is not None else None
    finally:
        if started:
            ray.shutdown()
    save(
        args.name,
        {
            "command": "python -m bench.kmeans",
            "args": vars(args),
            "points": {"model": "all-MiniLM-L6-v2", "layer": args.layer, "dim": X_all.shape[1]},
            "results": results,
        }
        | ({"selection": selection} if selection is not None else {}),
    )


if __name__ == "__main__":
    main()
