"""The thin Ray layer of the sampled K-means: object-store partitions, a remote map, layers in parallel.

Geometry lives in :mod:`embgeom_ray.kmeans`; this module only decides where its map steps
run. Each layer's sample is centred, split into partitions and put in the object store once
(``ray.put``); every pass of the fit (k-means|| distance rounds, Lloyd partial sums, the final
assignment) is one :func:`_apply` task per partition, whose results the layer's driver reduces.
:func:`fit_layers_on_ray` starts one driver task per layer (each runs
:func:`~embgeom_ray.kmeans.select_k` with :func:`ray_map`), so layers run in parallel and
each layer's passes fan out over its partitions. A task blocked in ``ray.get`` lends its CPU
back to Ray, so the nested tasks cannot deadlock the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import ray

from .kmeans import KMeansResult, SelectKResult, fit, partition, select_k


@ray.remote
def _apply(fn: Callable[[Any], Any], part: Any) -> Any:
    """``fn(part)`` on a worker (``part`` arrives resolved from its object ref)."""
    return fn(part)


def ray_map(fn: Callable[[Any], Any], parts: Sequence[Any]) -> list[Any]:
    """``[fn(p) for p in parts]`` as one Ray task per partition (``parts``: object refs)."""
    return ray.get([_apply.remote(fn, p) for p in parts])


def put_partitions(X: np.ndarray, n_partitions: int) -> list[ray.ObjectRef]:
    """Object refs of :func:`~embgeom_ray.kmeans.partition` blocks of ``X`` (put once)."""
    return [ray.put(p) for p in partition(np.ascontiguousarray(X), n_partitions)]


def default_partitions(n: int, rows_per_partition: int = 2048, max_partitions: int = 16) -> int:
    """Partitions for n points: one per ``rows_per_partition`` rows, 1 ≤ P ≤ ``max_partitions``."""
    return int(min(max(1, -(-n // rows_per_partition)), max_partitions))


def fit_on_ray(
    X: np.ndarray,
    k: int,
    n_init: int = 3,
    max_iter: int = 300,
    tol: float = 1e-4,
    seed: int = 0,
    *,
    n_partitions: int | None = None,
) -> KMeansResult:
    """One distributed K-means fit (:func:`embgeom_ray.kmeans.fit`) from the driver."""
    X = np.asarray(X, dtype=np.float64)
    shift = X.mean(axis=0)
    Xc = X - shift
    parts = put_partitions(Xc, n_partitions or default_partitions(len(X)))
    res = fit(Xc, k, n_init, max_iter, tol, seed, ray_map, parts=parts)
    res.centers = res.centers + shift
    return res


@ray.remote(num_cpus=1)
def _select_k_task(Xc: np.ndarray, parts: list[ray.ObjectRef], options: dict[str, Any]):
    # ``parts`` arrive as refs (nested in a list), so each partition moves only to its tasks
    return select_k(Xc, map_fn=ray_map, parts=parts, **options)


def fit_layers_on_ray(
    samples_by_layer: Mapping[int, np.ndarray],
    *,
    ks: Iterable[int] = range(2, 16),
    min_silhouette: float = 0.1,
    n_init: int = 3,
    max_iter: int = 300,
    tol: float = 1e-4,
    seed: int = 0,
    silhouette_max_points: int | None = 4096,
    n_partitions: int | None = None,
) -> dict[int, SelectKResult]:
    """Cai et al.'s K-means model selection for every layer, layers in parallel on Ray.

    Args:
        samples_by_layer: layer -> (n, d) sample points (e.g.
            ``sample.points(layer).vectors``); labels in the result follow these rows.
        ks, min_silhouette, n_init, max_iter, tol, seed, silhouette_max_points: as
            :func:`embgeom_ray.kmeans.select_k` (the same seed for every layer).
        n_partitions: partitions per layer (default :func:`default_partitions`).

    Returns:
        layer -> :class:`~embgeom_ray.kmeans.SelectKResult` (centres in the input coordinates).
    """
    if not ray.is_initialized():
        raise RuntimeError("fit_layers_on_ray needs a running Ray (ray.init or connect first)")
    options = {
        "ks": list(ks),
        "min_silhouette": min_silhouette,
        "n_init": n_init,
        "max_iter": max_iter,
        "tol": tol,
        "seed": seed,
        "silhouette_max_points": silhouette_max_points,
    }
    futures, shifts = {}, {}
    for layer, X in samples_by_layer.items():
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2 or len(X) == 0:
            raise ValueError(f"layer {layer}: sample must be a non-empty (n, d) array")
        shifts[layer] = X.mean(axis=0)
        Xc = np.ascontiguousarray(X - shifts[layer])
        parts = put_partitions(Xc, n_partitions or default_partitions(len(Xc)))
        futures[layer] = _select_k_task.remote(ray.put(Xc), parts, options)
    results = dict(zip(futures, ray.get(list(futures.values())), strict=True))
    for layer, res in results.items():
        res.centers = res.centers + shifts[layer]
    return results
