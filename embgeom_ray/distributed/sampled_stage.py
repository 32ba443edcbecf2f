"""The sampled-metrics stage on Ray: one K-means model selection and one metrics task per layer.

Only where things run is decided here; what runs, and how its results become tables, is
engine-free in :mod:`embgeom_ray.core.tables` (:func:`~embgeom_ray.core.tables.sampled_layer`,
:func:`~embgeom_ray.core.tables.sampled_row`, :func:`~embgeom_ray.core.tables.finish_sampled_columns`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from .. import progress
from ..core.options import SampledOptions
from ..core.rogue import flagged_dims
from ..core.tables import (
    finish_sampled_columns,
    sampled_layer,
    sampled_note,
    sampled_options,
    sampled_row,
    sampled_selection,
)
from ..sizing.formulas import on_workers
from ..sizing.sampled_tasks import SampledTasks

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ..core.sample_layers import SampleLayers


def add_sampled_metrics(
    tables: dict[str, pd.DataFrame],
    sample: SampleLayers,
    options: SampledOptions,
    address: str | None = None,
    where: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[int, np.ndarray]]:
    """K-means, LID, silhouettes, cluster-adjusted and clipped cosines on the sample, on Ray.

    Every layer's K-means model selection is one Ray task
    (:func:`~embgeom_ray.core.tables.sampled_selection`), which also returns the distance
    matrix of the layer's distinct points, and its :func:`~embgeom_ray.core.tables.sampled_row`
    a second task that reads that matrix from the object store (one matrix serves both, the
    numbers of :func:`~embgeom_ray.core.tables.sampled_layer_results`). A layer's metrics task
    is submitted after the selections of the next C layers (C: the CPUs free when the stage
    starts; :func:`~embgeom_ray.distributed.kmeans.fit_shares`): Ray starts ready tasks in
    the order submitted, so the selections keep every CPU busy and the shorter metrics tasks
    fill them at the end, instead of a last layer's whole work running alone on one CPU while
    the others idle; at most about C + 1 distance matrices wait in the object store. Samples
    too large for one worker have a
    distributed fit (:func:`~embgeom_ray.distributed.kmeans.submit_layers_on_ray`) followed by
    the row's task, which starts as soon as the layer's clusters are ready; each task holds one
    CPU and runs one thread, and asks Ray for its peak memory
    (:mod:`~embgeom_ray.sizing.sampled_tasks`, for the layer's points as drawn;
    :func:`task_memory_cap` first refuses a task that no node holds, and asks for less where
    other jobs' actors hold it). The layers are planned
    and submitted one at a time (``sample`` gives one layer's sample at a time: its points go
    to the object store with the layer's tasks, and this process drops them before the next
    layer's), so this process never holds more than one layer of the sample; a sample whose
    one layer reaches :data:`~embgeom_ray.sizing.formulas.SAMPLE_ON_WORKERS_BYTES`
    (:func:`~embgeom_ray.sizing.formulas.on_workers`) has each layer's inputs made by a
    Ray task instead, and this process holds none of it (``where``: those tasks' Ray options,
    :func:`~embgeom_ray.distributed.sample_tasks.placement`, decided once by the caller for
    them and the rows' tasks after; None: decided here). Adds the
    sampled columns to ``tables["layers"]`` and ``tables["kmeans"]``; returns what the
    manifest records and each layer's K-means ``cluster`` of the uniform occurrences, in
    canonical order (for ``samples.parquet``, written a layer at a time by
    :meth:`~embgeom_ray.run_dir.RunDir.finalise`). A sample too small for the metrics
    (:data:`~embgeom_ray.core.tables.MIN_SAMPLE_POINTS`) needs no Ray (unless it is that large).
    """
    layers = list(sample.layers)
    if on_workers(sample):
        return _on_workers(tables, sample, options, address, where)
    first = sample.layer(layers[0])
    note = sampled_note(first)
    if "skipped" in note:
        return note, {}
    import ray

    from ..core.kmeans_selection import LOCAL_FIT_MAX_ELEMENTS
    from .cluster import connect  # only here: the driver imports ray when there is Ray work
    from .kmeans import RayFits, call_on_ray, fit_shares, submit_layers_on_ray
    from .warm_workers import await_warm_workers

    connect(address)
    await_warm_workers()
    kmeans_options, row_options = sampled_options(options, first.num_uniform)
    tasks = stage_tasks(first.num_uniform, first.dim, options)
    cap = task_memory_cap(tasks)
    flagged = flagged_dims(tables["dims"])
    shares = fit_shares(len(layers), 1)
    km_refs, row_refs, rows_after = {}, {}, []

    def submit_row(
        layer: int, args: list[Any], clip_dims: list[int], keys: Any, distances: Any
    ) -> None:  # the layer's metrics, once its selection (km_refs) and distances are ready
        row_refs[layer] = call_on_ray(
            sampled_row, *args, km_refs[layer], clip_dims, groups=keys, distances=distances,
            memory=capped(tasks.metrics, cap), **row_options,
        )  # fmt: skip

    for layer in layers:
        one = first if layer == layers[0] else sample.layer(layer)
        first = None
        inputs = sampled_layer(one, layer, flagged.get(layer, []))
        del one
        if inputs.vectors.size <= LOCAL_FIT_MAX_ELEMENTS:  # one distance matrix, two tasks
            args = [ray.put(a) for a in (inputs.vectors, inputs.token_ids, inputs.type_vectors)]
            keys = ray.put(inputs.content_keys)
            km_refs[layer], distances = call_on_ray(
                sampled_selection, args[0], keys, kmeans_options, RayFits(*shares), returns=2,
                memory=capped(tasks.kmeans, cap),
            )  # fmt: skip
            rows_after.append((layer, args, inputs.clip_dims, keys, distances))
            del inputs
            if len(rows_after) > shares[1]:  # the metrics of a layer CPUs-many selections ago
                submit_row(*rows_after.pop(0))
            continue
        km_refs[layer] = submit_layers_on_ray(
            {layer: inputs.vectors}, groups={layer: inputs.content_keys}, shares=shares,
            memory_cap=cap, **kmeans_options,
        )[layer]  # fmt: skip
        row_refs[layer] = call_on_ray(
            sampled_row,
            inputs.vectors,
            inputs.token_ids,
            inputs.type_vectors,
            km_refs[layer],
            inputs.clip_dims,
            groups=inputs.content_keys,
            memory=capped(replace(tasks, own_distances=True).metrics, cap),
            **row_options,
        )
        del inputs
    for pending in rows_after:
        submit_row(*pending)
    row_refs = {layer: row_refs[layer] for layer in layers}
    return _finish(tables, note, layers, row_refs, km_refs)


def _on_workers(
    tables: dict[str, pd.DataFrame],
    sample: SampleLayers,
    options: SampledOptions,
    address: str | None,
    where: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[int, np.ndarray]]:
    """:func:`add_sampled_metrics` with each layer's inputs made by a Ray task from the
    sample (:mod:`~embgeom_ray.distributed.sample_tasks`), placed by ``where`` (else
    :func:`~embgeom_ray.distributed.sample_tasks.placement` here): the same tasks on the same
    arrays, none of which passes through this process."""
    import ray

    from .cluster import connect
    from .kmeans import call_on_ray, fit_shares
    from .sample_tasks import placement, select_k_of, submit_inputs

    connect(address)
    layers = list(sample.layers)
    flagged = flagged_dims(tables["dims"])
    source, where = ray.put(sample), placement(sample) if where is None else where
    inputs = {layer: submit_inputs(source, layer, flagged.get(layer, []), where) for layer in layers}
    note = ray.get(inputs[layers[0]][0])
    if "skipped" in note:
        return note, {}
    kmeans_options, row_options = sampled_options(options, note["uniform_points"])
    dim = int(sample.header["dim"])
    tasks = stage_tasks(note["uniform_points"], dim, options, own_distances=True)
    cap = task_memory_cap(tasks)
    shares = fit_shares(len(layers), 1)
    km_refs, row_refs = {}, {}
    for layer in layers:
        _, vectors, token_ids, type_vectors, content_keys = inputs.pop(layer)
        km_refs[layer] = select_k_of.remote(vectors, content_keys, shares, kmeans_options, cap)
        row_refs[layer] = call_on_ray(
            sampled_row,
            vectors,
            token_ids,
            type_vectors,
            km_refs[layer],
            flagged.get(layer, []),
            groups=content_keys,
            memory=capped(tasks.metrics, cap),
            **row_options,
        )
    return _finish(tables, note, layers, row_refs, km_refs)


def stage_tasks(
    n: int, d: int, options: SampledOptions, own_distances: bool = False
) -> SampledTasks:
    """The per-layer tasks' memory (:mod:`~embgeom_ray.sizing.sampled_tasks`) for layers of
    ``n`` uniform points of dimension ``d`` (``own_distances``: the metrics task computes the
    distances itself, the selection handing none over)."""
    return SampledTasks(
        n, d, options.silhouette_max_points, options.kmeans_k_max, options.kmeans_n_init,
        min(options.lid_k, n - 1), own_distances,
    )  # fmt: skip


def task_memory_cap(
    tasks: SampledTasks,
    nodes: Any = None,
    can_start: int | None = None,
    free: Mapping[str, float] | None = None,
) -> int | None:
    """The most Ray memory one of the stage's tasks asks for: None, what each holds at its
    peak (:mod:`~embgeom_ray.sizing.sampled_tasks`), unless actors hold it (below).

    Only nodes with a CPU count: each task asks Ray for one, so a head started with
    ``--num-cpus 0`` (``cluster.yaml``'s) runs none, whatever its memory. Where such nodes are
    known, live ones (``nodes``: ``ray.nodes()``) or a node type the autoscaler may start
    (``can_start``: the most Ray memory of one with a CPU), and none has the Ray memory a task
    asks for, a :class:`~embgeom_ray.errors.ConfigError` (one line, exit status 2): the task
    would wait for ever. Where none is known (an autoscaler's workers gone or not joined yet,
    its node types not reported), the autoscaler starts one for the tasks: nothing refused.
    The plan refuses the same before any work
    (:func:`~embgeom_ray.sizing.decisions.sampled_task_refusal`); this checks the cluster as
    it is when the stage starts.

    Where no such node has a task's memory free now (``free``: node id -> Ray memory not
    held; :func:`~embgeom_ray.distributed.sample_tasks.free_memory`) and no node type the
    autoscaler may start holds one, other actors hold the rest (another job's: the job's own
    reducers are stopped before the stage, their memory back): the tasks could wait for
    them for ever. They then ask for the most one such node has free (0: none, one task a
    CPU), and a warning line says so: they run, fewer at once."""
    import ray

    from ..errors import ConfigError
    from .sample_tasks import free_memory, held_memory, memory_with_cpu

    if nodes is None:
        nodes = ray.nodes()
    if can_start is None:
        from .cluster import read_autoscaler_groups

        groups = read_autoscaler_groups() or ()
        can_start = max((g.memory for g in groups if g.max_count != 0 and g.cpus >= 1), default=0)
    with_cpu = memory_with_cpu(nodes)
    if not with_cpu and not can_start:
        return None
    refused = tasks.refusal(max([*with_cpu.values(), can_start]), "the largest node with a CPU",
                            drawn=True)  # fmt: skip
    if refused:
        raise ConfigError(refused)
    if can_start >= tasks.largest:
        return None
    free = free_memory() if free is None else free
    held = held_memory(tasks.largest, {k: v for k, v in free.items() if k in with_cpu}, None,
                       "the sampled stage's per-layer tasks")  # fmt: skip
    if held is None:
        return None  # one has it free now, or Ray does not say
    progress.notice(f"warning: {held[1]}")
    return held[0]


def capped(memory: int, cap: int | None) -> int:
    """``memory``, at most ``cap`` (:func:`task_memory_cap`; None: no cap)."""
    return memory if cap is None else min(memory, cap)


def _finish(
    tables: dict[str, pd.DataFrame],
    note: dict[str, Any],
    layers: list[int],
    row_refs: dict[int, Any],
    km_refs: dict[int, Any],
) -> tuple[dict[str, Any], dict[int, np.ndarray]]:
    """The sampled columns into ``tables`` once every layer's tasks are done; (the note,
    each layer's K-means labels)."""
    rows, kmeans = _gather(row_refs, km_refs)
    clusters = {layer: np.asarray(kmeans[layer].labels, dtype=np.int64) for layer in layers}
    return finish_sampled_columns(tables, note, layers, rows, kmeans), clusters


def _gather(row_refs: dict[int, Any], km_refs: dict[int, Any]) -> tuple[dict[int, Any], dict[int, Any]]:
    """(metric rows, K-means results) by layer, collected as the layers finish, with a progress
    bar on stderr: each finished layer's number of clusters and the k of its best silhouette."""
    import ray

    layer_of = {ref: layer for layer, ref in row_refs.items()}
    pending, rows, kmeans = list(row_refs.values()), {}, {}
    with progress.bar(total=len(pending), desc="sampled metrics", unit="layer") as bar:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            layer = layer_of[done[0]]
            if km_refs[layer] is None:  # one task gave both
                rows[layer], kmeans[layer] = ray.get(done[0])
            else:
                rows[layer] = ray.get(done[0])
                kmeans[layer] = ray.get(km_refs[layer])  # finished before its row started
            km = kmeans[layer]
            bar.set_postfix_str(f"layer {layer}: k = {km.k} (best silhouette at k = {km.best_k})", refresh=False)
            bar.update(1)
    return {layer: rows[layer] for layer in row_refs}, {layer: kmeans[layer] for layer in row_refs}
