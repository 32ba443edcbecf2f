"""The job's K-means partitions against scikit-learn's ``KMeans(n_init=10)``, every layer and k.

The points are MiniLM's hidden states of a bottom-k sample of ``--size`` occurrences of the
demo corpus (the extractor's own sample, as the job's sampled stage gets them), each layer's
distinct points by content key, centred. For every layer, the job's model selection
(:func:`~embgeom_ray.core.kmeans_selection.select_k`, its defaults: the scan to ``--k-max``)
and, for every k of that scan, ``sklearn.cluster.KMeans(n_clusters=k, n_init=10,
random_state=0)`` on the same float32 points (Cai et al.'s protocol). Printed per layer: the
ratio of the job's inertia to scikit-learn's (from each partition's labels, in float64), its
largest value and median over k ≤ 15 and over k > 15; the decision (k = 1 or the best k) on the
job's partitions and on scikit-learn's, scored alike (``sklearn.metrics.silhouette_score``);
the job's support of its decision. One thread.

    python -m bench.kmeans_quality [--size 4096] [--layers 0,...,6] [--k-max 60] [--seed 0]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import save, work_dir


def inertia(X: np.ndarray, labels: np.ndarray) -> float:
    return float(
        sum(((X[labels == c] - X[labels == c].mean(0)) ** 2).sum() for c in np.unique(labels))
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=4096, help="sampled occurrences per layer")
    p.add_argument("--layers", default="0,1,2,3,4,5,6", help="MiniLM hidden-state layers (0..6)")
    p.add_argument("--k-max", type=int, default=60)
    p.add_argument("--seed", type=int, default=0, help="the sample's and the selection's seed")
    p.add_argument("--name", default="kmeans_quality")
    args = p.parse_args(argv)
    layers = [int(x) for x in args.layers.split(",")]

    import torch
    from sklearn.cluster import KMeans
    from sklearn.metrics import pairwise_distances, silhouette_score
    from threadpoolctl import threadpool_limits

    from bench.kmeans import minilm_sample
    from embgeom_ray.core.distinct import distinct_rows
    from embgeom_ray.core.kmeans_selection import MIN_SILHOUETTE, select_k

    with work_dir("kmeans-quality") as work:
        sample = minilm_sample(args.size, layers, work, args.seed)
    torch.set_num_threads(1)
    results = []
    with threadpool_limits(1):
        for layer in layers:
            pts = sample.points(layer)
            first, _ = distinct_rows(pts.vectors, pts.content_keys)
            Xc = pts.vectors[first] - pts.vectors[first].mean(0)
            t = time.perf_counter()
            ours = select_k(pts.vectors, k_max=args.k_max, groups=pts.content_keys, seed=args.seed)
            t_ours = time.perf_counter() - t
            D = pairwise_distances(Xc)
            t = time.perf_counter()
            theirs = {
                k: KMeans(k, n_init=10, random_state=0).fit(Xc.astype(np.float32)).labels_
                for k in ours.inertias
            }
            t_theirs = time.perf_counter() - t
            ratio = {k: ours.inertias[k] / inertia(Xc, theirs[k]) for k in theirs}
            sil = {k: silhouette_score(D, theirs[k], metric="precomputed") for k in theirs}
            best = max(sil, key=lambda k: (sil[k], -k))
            low = [r for k, r in ratio.items() if k <= 15]
            high = [r for k, r in ratio.items() if k > 15]
            row = {
                "layer": layer,
                "n_distinct": len(Xc),
                "ratio": {str(k): r for k, r in ratio.items()},
                "max_low": max(low), "median_low": float(np.median(low)),
                "max_high": max(high, default=float("nan")),
                "median_high": float(np.median(high)) if high else float("nan"),
                "ours": {"k": ours.k, "best_k": ours.best_k, "silhouette": ours.silhouette,
                         "k_support": ours.k_support, "structure_support": ours.structure_support},
                "sklearn": {"k": best if sil[best] >= MIN_SILHOUETTE else 1, "best_k": best,
                            "silhouette": sil[best]},
                "seconds": {"ours": t_ours, "sklearn": t_theirs},
            }  # fmt: skip
            results.append(row)
            print(
                f"layer {layer} (n {len(Xc)}): inertia / scikit-learn's, k <= 15: max "
                f"{row['max_low']:.4f} median {row['median_low']:.4f}; k > 15: max "
                f"{row['max_high']:.4f} median {row['median_high']:.4f} | decision: ours k "
                f"{ours.k} (best {ours.best_k}, silhouette {ours.silhouette:.3f}, support "
                f"{ours.k_support:.2f}/{ours.structure_support:.2f}), scikit-learn's k "
                f"{row['sklearn']['k']} (best {best}, {sil[best]:.3f}) | {t_ours:.1f}s / "
                f"{t_theirs:.1f}s",
                flush=True,
            )
    save(
        args.name,
        {"command": "python -m bench.kmeans_quality", "args": vars(args), "results": results},
    )


if __name__ == "__main__":
    main()
