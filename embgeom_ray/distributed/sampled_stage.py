"""The sampled-metrics stage on Ray: one K-means model selection and one metrics task per layer."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ..config import JobConfig
from ..core.rogue import flagged_dims, sampled_clipped_cosines
from ..core.samples import ActivationSample

#: fewer sampled points than this and the sampled metrics are left empty (NaN)
MIN_SAMPLE_POINTS = 32


def _sampled_row(
    X: np.ndarray,
    token_ids: np.ndarray,
    type_vectors: np.ndarray | None,
    kmeans_result: Any,
    clip_dims: list[int],
    **options: Any,
) -> dict[str, Any]:
    """One layer's sampled ``layers.parquet`` columns (run as a Ray task by the stage below)."""
    from ..core.sampled_metrics import sampled_metrics_of_points

    return sampled_metrics_of_points(
        X, token_ids, type_vectors, kmeans_result, **options
    ) | sampled_clipped_cosines(X, token_ids, clip_dims)


def add_sampled_metrics(
    tables: dict[str, pd.DataFrame],
    sample: ActivationSample,
    tokenizer: Any,
    config: JobConfig,
) -> dict[str, Any]:
    """K-means, LID, silhouettes, cluster-adjusted and clipped cosines on the sample, on Ray.

    Every layer's K-means model selection is a Ray task (or, for samples too large for one
    worker, a distributed fit: :func:`~embgeom_ray.distributed.kmeans.submit_layers_on_ray`), and so
    are its other sampled metrics, which start as soon as the layer's clusters are ready; each
    task holds one CPU and runs one thread. Adds the sampled columns to ``tables["layers"]``
    and the ``samples`` table (with each uniform occurrence's K-means ``cluster``); returns
    what the manifest records.
    """
    import ray

    from ..core.sampled_metrics import isoscore_silhouette_correlation
    from .cluster import connect
    from .kmeans import call_on_ray, submit_layers_on_ray

    samples = sample.to_table(tokenizer.convert_ids_to_tokens)
    samples["cluster"] = pd.array([None] * len(samples), dtype="Int64")
    n_points = sample.num_uniform
    note: dict[str, Any] = {"uniform_points": n_points, "type_uniform_points": sample.num_types}
    if n_points < MIN_SAMPLE_POINTS:
        note["skipped"] = f"sample of {n_points} points < {MIN_SAMPLE_POINTS}: no sampled metrics"
        tables["samples"] = samples
        return note
    connect(config.address)
    points = {layer: sample.points(layer) for layer in sample.layers}
    km_refs = submit_layers_on_ray(
        {layer: pts.vectors for layer, pts in points.items()},
        ks=range(2, min(config.kmeans_k_max, n_points - 1) + 1),
        min_silhouette=config.kmeans_min_silhouette,
        n_init=config.kmeans_n_init,
        seed=config.sample_seed,
        silhouette_max_points=config.silhouette_max_points,
    )
    flagged = flagged_dims(tables["dims"])
    with_types = sample.type_uniform and sample.num_types >= 2
    row_refs = {
        layer: call_on_ray(
            _sampled_row,
            pts.vectors,
            pts.token_ids,
            sample.type_points(layer).vectors if with_types else None,
            km_refs[layer],
            flagged.get(layer, []),
            lid_k=min(config.lid_k, n_points - 1),
            silhouette_max_points=config.silhouette_max_points,
            seed=config.sample_seed,
        )
        for layer, pts in points.items()
    }
    row_values = ray.get(list(row_refs.values()))
    rows = [{"layer": layer} | row for layer, row in zip(row_refs, row_values, strict=True)]
    km = dict(zip(km_refs, ray.get(list(km_refs.values())), strict=True))
    for layer in sample.layers:
        uniform = (samples["layer"] == layer) & (samples["sample"] == "uniform")
        samples.loc[uniform, "cluster"] = np.asarray(km[layer].labels, dtype=np.int64)
    layers = tables["layers"].merge(pd.DataFrame(rows), on="layer", how="left")
    tables["layers"] = layers
    tables["samples"] = samples
    note["isoscore_silhouette_corr"] = isoscore_silhouette_correlation(layers)
    note["lid_convention"] = (
        "true (not squared) distances; cosine LID on chord distances sqrt(2 - 2 cos)"
    )
    return note
