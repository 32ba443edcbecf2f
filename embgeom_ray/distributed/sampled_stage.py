"""The sampled-metrics stage on Ray: one K-means model selection and one metrics task per layer.

Only where things run is decided here; what runs, and how its results become tables, is
engine-free in :mod:`embgeom_ray.core.tables` (:func:`~embgeom_ray.core.tables.plan_sampled_metrics`,
:func:`~embgeom_ray.core.tables.sampled_row`, :func:`~embgeom_ray.core.tables.finish_sampled_metrics`).
"""

from __future__ import annotations

import sys
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from ..core.options import SampledOptions
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
    from .cluster import connect  # only here: the driver imports ray when there is Ray work
    from .kmeans import call_on_ray, submit_layers_on_ray

    connect(address)
    km_refs = submit_layers_on_ray(
        {layer: inputs.vectors for layer, inputs in plan.layers.items()},
        groups={layer: inputs.content_keys for layer, inputs in plan.layers.items()},
        **plan.kmeans_options,
    )
    row_refs = {
        layer: call_on_ray(
            sampled_row,
            inputs.vectors,
            inputs.token_ids,
            inputs.type_vectors,
            km_refs[layer],
            inputs.clip_dims,
            groups=inputs.content_keys,
            **plan.row_options,
        )
        for layer, inputs in plan.layers.items()
    }
    rows, kmeans = _gather(row_refs, km_refs)
    return finish_sampled_metrics(tables, plan, rows, kmeans)


def _gather(row_refs: dict[int, Any], km_refs: dict[int, Any]) -> tuple[dict[int, Any], dict[int, Any]]:
    """(metric rows, K-means results) by layer, collected as the layers finish, with a progress
    bar on stderr: each finished layer's number of clusters and the k of its best silhouette."""
    import ray

    layer_of = {ref: layer for layer, ref in row_refs.items()}
    pending, rows, kmeans = list(row_refs.values()), {}, {}
    with tqdm(total=len(pending), desc="sampled metrics", unit="layer", file=sys.stderr,
              dynamic_ncols=True, mininterval=2.0) as bar:  # fmt: skip
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            layer = layer_of[done[0]]
            rows[layer] = ray.get(done[0])
            kmeans[layer] = km = ray.get(km_refs[layer])  # finished before its row started
            bar.set_postfix_str(f"layer {layer}: k = {km.k} (best silhouette at k = {km.best_k})", refresh=False)
            bar.update(1)
    return {layer: rows[layer] for layer in row_refs}, {layer: kmeans[layer] for layer in row_refs}
