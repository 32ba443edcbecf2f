"""The sampled-metrics stage on Ray: one K-means model selection and one metrics task per layer.

Only where things run is decided here; what runs, and how its results become tables, is
engine-free in :mod:`embgeom_ray.core.tables` (:func:`~embgeom_ray.core.tables.plan_sampled_metrics`,
:func:`~embgeom_ray.core.tables.sampled_row`, :func:`~embgeom_ray.core.tables.finish_sampled_metrics`).
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from ..config import SampledOptions
from ..core.samples import ActivationSample
from ..core.tables import finish_sampled_metrics, plan_sampled_metrics, sampled_row


def add_sampled_metrics(
    tables: dict[str, pd.DataFrame],
    sample: ActivationSample,
    tokenizer: Any,
    options: SampledOptions,
    address: str | None = None,
) -> dict[str, Any]:
    """K-means, LID, silhouettes, cluster-adjusted and clipped cosines on the sample, on Ray.

    Every layer's K-means model selection is a Ray task (or, for samples too large for one
    worker, a distributed fit: :func:`~embgeom_ray.distributed.kmeans.submit_layers_on_ray`), and so
    is its :func:`~embgeom_ray.core.tables.sampled_row`, which starts as soon as the layer's
    clusters are ready; each task holds one CPU and runs one thread. Adds the sampled columns
    to ``tables["layers"]`` and the ``samples`` table (with each uniform occurrence's K-means
    ``cluster``); returns what the manifest records. A sample too small for the metrics
    (:data:`~embgeom_ray.core.tables.MIN_SAMPLE_POINTS`) needs no Ray.
    """
    plan = plan_sampled_metrics(sample, tables["dims"], tokenizer, options)
    if plan.skipped:
        return finish_sampled_metrics(tables, plan, {}, {})
    import ray  # only here: the driver imports ray when there is Ray work to do

    from .cluster import connect
    from .kmeans import call_on_ray, submit_layers_on_ray

    connect(address)
    km_refs = submit_layers_on_ray(
        {layer: inputs.vectors for layer, inputs in plan.layers.items()}, **plan.kmeans_options
    )
    row_refs = {
        layer: call_on_ray(
            sampled_row,
            inputs.vectors,
            inputs.token_ids,
            inputs.type_vectors,
            km_refs[layer],
            inputs.clip_dims,
            **plan.row_options,
        )
        for layer, inputs in plan.layers.items()
    }
    rows = dict(zip(row_refs, ray.get(list(row_refs.values())), strict=True))
    kmeans = dict(zip(km_refs, ray.get(list(km_refs.values())), strict=True))
    return finish_sampled_metrics(tables, plan, rows, kmeans)
