"""What ``--plan`` prints: what runs where, every process's memory as number and formula, the
bytes that move and are stored, and what measuring fewer layers saves."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from .checkpoints import DRIVER, BudgetShape
from .checkpoints import describe_plan as checkpoint_lines
from .decisions import Sizing, driver_reserve, io_sizes, sample_task_memory, size_reducers
from .formulas import (
    DEFAULT_BATCH_TOKENS,
    DRIVER_ALLOWANCE_BYTES,
    DRIVER_SAMPLE_LAYERS,
    GPU_STATISTICS_SHARE,
    CorpusShape,
    Shape,
    batch_growth_bytes,
    gib,
    reducer_bytes,
    reducer_ranges,
    sample_layer_bytes,
    sample_on_workers,
    sample_task_bytes,
    shape_batch_bytes_per_token,
)  # fmt: skip
from .nodes import Cluster
from .nodes import extractors_per_node as nodes_hold
from .object_store import ObjectStorePeak, plan_object_store


def _shard_size(n: int) -> str:
    """A shard's bytes: MiB to three figures (the default's cap is rarely a round number)."""
    return f"{n / 2**20:.3g} MiB" if n >= 2**20 else gib(n)


def describe_plan(
    sizing: Sizing,
    corpus: CorpusShape,
    *,
    checkpoint_interval: float | None,
    total_layers: int,
    checkpoint_writers: str = DRIVER,
    checkpoint_check: bool = False,
) -> list[str]:
    """What ``--plan`` prints: what runs where, every process's memory as number and formula,
    the bytes that move and are stored, and what measuring fewer layers saves
    (``checkpoint_writers``: who writes the checkpoint groups,
    :func:`~embgeom_ray.sizing.checkpoints.writers_for`; ``checkpoint_check``: where the
    extractors' nodes are to see the run's local path for that,
    :func:`~embgeom_ray.sizing.checkpoints.needs_check`)."""
    shape, types, pool, red = sizing.shape, sizing.types, sizing.pool, sizing.reduce
    io = sizing.extras.get("io") or io_sizes(sizing)
    d, L, P = shape.dim, shape.layers, shape.positions
    gpus = f"{pool.num_gpus:g} GPU(s) + " if pool.num_gpus else ""
    batch = (
        f"{pool.batch_tokens:,} padded tokens a batch"
        + (f" ({pool.batch_reason})" if pool.batch_reason else "")
        if pool.batch_tokens
        else "batch tokens decided on each GPU once the model is loaded: min(8 GiB, half the "
        f"free memory) at {shape_batch_bytes_per_token(shape):,} B a token, 8,192 to 65,536"
    )
    stats = (
        "the whole S(V) + F (no bound needed)"
        if pool.statistics is None
        else f"σ = {gib(pool.statistics)} (spills past it; on a GPU no more than "
        f"{GPU_STATISTICS_SHARE:g} of what the model and a batch leave)"
    )
    lines = [
        f"model: {shape.name}: {shape.hidden_states - 1} blocks, d = {d:,}, d_ff = "
        f"{shape.intermediate:,}, {shape.heads} heads, V = {shape.vocab:,} tokenizer entries, "
        f"weights w = {gib(shape.weight_bytes)}",
        f"measured: L = {L} of {total_layers} layers, P = {P} positions, sample s = "
        f"{shape.sample_entries:,} entries" + (f", {shape.clip} clipped dims" if shape.clip else ""),
        f"corpus: {corpus.source}: {corpus.files:,} file(s), {gib(corpus.bytes)}, "
        f"{corpus.shards:,} shard{'' if corpus.shards == 1 else 's'}"
        + (f" of {_shard_size(corpus.shard_bytes)}" if corpus.shard_bytes else "")
        + (f" ({corpus.shard_rule})" if corpus.shard_rule else ""),
        f"cluster: {sizing.cluster.describe()}",
        f"types: {sizing.types_reason}",
        "",
        f"extractors: {pool.num_workers} actor(s){_pool_bound(sizing, corpus)}, each {gpus}"
        f"{pool.num_cpus} CPU(s), {batch}",
        f"  memory each: {gib(pool.memory)} asked of Ray ({pool.reason})",
        f"    = {pool.formula}{_terms(sizing)}",
        f"  statistics budget: {stats}",
        *(
            [f"  host tier: H = {gib(pool.host_statistics)}: each spill past σ merged into it, "
             "type by type, so a flush writes a type once per H, not once per spill "
             "(--host-statistics-memory; + H and a block of 64 MiB of the memory each: the "
             "tier is written a block at a time)"]
            if pool.host_statistics is not None and pool.statistics is not None
            else [f"  host tier: H = {gib(pool.host_statistics)} (--host-statistics-memory), "
                  "used only by an extractor whose GPU, once the model is loaded, holds less "
                  "than the whole statistics (+ H and a block of 64 MiB of the memory each)"]
            if pool.host_statistics is not None
            else []
        ),
    ]
    if red.partitioned:
        ranges = reducer_ranges(red.count, types)
        shown = ", ".join(f"[{lo:,}, {'∞' if hi is None else f'{hi:,}'})" for lo, hi in ranges[:4])
        more = f", … ({len(ranges)} ranges)" if len(ranges) > 4 else ""
        per = reducer_bytes(red.count, L, d, types, P, shape.clip)
        lines += [
            f"reducers: {red.count} actor(s) × {gib(red.memory)} asked of Ray ({red.reason})",
            f"    = {red.formula}: holds {gib(per)}"
            + (f", u {gib(shape.upload_bytes(per))}" if shape.upload_bytes(per) else ""),
            f"  token ranges: equal numbers of the ids seen, cut at the reduce; over [0, V): "
            f"{shown}{more}",
            f"  layers' state: reducer r holds layers r, r + R, … (⌈L/R⌉ = "
            f"{math.ceil(L / red.count)} at most)",
            f"  placed: {_placement(sizing.cluster, red.nodes)}; started with the extractors: "
            f"{red.early} (the rest at the reduce)",
            *(
                ["  on a local path: kept to the nodes that see it, checked on every node "
                 "when the reduce is decided (and pinned there)"]
                if checkpoint_check and len(sizing.cluster.nodes) > 1
                else []
            ),
        ]
    else:
        lines.append(f"reduce: in the job's own process ({red.reason})")
    lines += [
        f"driver (the job's own process): ≤ {gib(sizing.driver)} above its start = "
        f"{sizing.driver_formula}",
        *([f"  warning: {sizing.driver_warning()}"] if sizing.driver > DRIVER_ALLOWANCE_BYTES else []),
        *sample_task_lines(shape, sizing.cluster),
        *sampled_task_lines(shape),
        *object_store_lines(sizing, checkpoint_writers),
        "",
        f"per-type state S(V) = 8·L·V·(2d+2) + 8V = {gib(shape.type_bytes(types))}; per-layer "
        f"state F = 8·L·(d² + 3d + P·(d+1) + 2) = {gib(shape.layer_state_bytes())}; sample Q = "
        f"4·L·s·d + 48s = {gib(shape.sample_bytes)}",
        f"flush: pieces of ≤ {gib(io['flush_piece_bytes'])} ({io['flush_formula']}), one "
        "checkpoint group per flush (every checkpoint interval of an extractor's work, "
        "and when the queue drains)",
        *checkpoint_lines(
            io["flush_piece_bytes"] + shape.sample_bytes, pool.num_workers,
            extractors_per_node(sizing), checkpoint_interval, checkpoint_writers,
            checkpoint_check,
            None if pool.statistics is None else BudgetShape(
                pool.statistics if pool.host_statistics is None else pool.host_statistics,
                shape.row_bytes, shape.layer_state_bytes(), types,
                "the statistics budget σ" if pool.host_statistics is None else "the host tier H",
            ),
        ),
        "checkpoint groups on disk: one per extractor and --checkpoint-interval ("
        + (
            f"≤ {gib(io['checkpoint_bytes_per_interval'])} an interval for the "
            f"{pool.num_workers} extractor(s), each group the statistics of the types it saw + Q"
            if io["checkpoint_bytes_per_interval"] is not None
            else "each group a piece of ≤ σ + g a spill, and the sample Q"
            if pool.host_statistics is None
            else "each group a piece of ≤ H each time the host tier fills, and the sample Q"
        )
        + f"); they grow by ≤ {gib(io['checkpoint_bytes_per_round'])} a round of one-piece "
        "flushes (N · B) and are removed when the run completes",
        f"artefact: statistics S(V) + F + sample Q = {gib(io['artefact_bytes'])}",
        "tables (before compression): "
        + ", ".join(f"{k} {gib(v)}" for k, v in io["tables_bytes"].items()),
    ]
    lever = layers_lever(sizing, total_layers)
    if lever:
        lines.append(lever)
    return lines


def _terms(sizing: Sizing) -> str:
    """The formula's terms that have no number beside them: σ (the whole S(V) + F where the
    statistics are not bounded), g (0 then: nothing spills) and H."""
    shape, pool, types = sizing.shape, sizing.pool, sizing.types
    if pool.statistics is None:
        sigma, growth = f"S(V) + F = {gib(shape.statistics_bytes(types))}", "0"
    else:
        b = pool.batch_tokens or DEFAULT_BATCH_TOKENS  # the least a GPU batch is
        sigma, growth = gib(pool.statistics), gib(batch_growth_bytes(shape, types, b))
    host = "" if pool.host_statistics is None else f", H = {gib(pool.host_statistics)}"
    return f", with σ = {sigma}, g = {growth}{host}"


def _pool_bound(sizing: Sizing, corpus: CorpusShape) -> str:
    """Why the pool is smaller than the nodes hold by their CPUs and GPUs, where the corpus's
    shards bound it (an extractor folds a shard at a time, so more would wait): "" otherwise."""
    pool = sizing.pool
    held = sum(nodes_hold(sizing.cluster, pool.num_cpus, int(pool.num_gpus)))
    if corpus.shards and pool.num_workers >= corpus.shards and held > pool.num_workers:
        return (f" (one a shard: the corpus has {corpus.shards:,}; the nodes' CPUs and GPUs "
                f"hold {held:,}; --shard-bytes cuts more)")  # fmt: skip
    return ""


def sample_task_lines(shape: Shape, cluster: Cluster) -> list[str]:
    """The line on the sample's Ray tasks, where the sample is handled by them
    (:func:`~embgeom_ray.sizing.formulas.sample_on_workers`): what each holds and asks Ray
    for (nothing of a head that offers Ray no memory, where a local run's tasks run:
    :func:`~embgeom_ray.sizing.decisions.sample_task_memory`)."""
    if not sample_on_workers(shape.sample_entries, shape.dim):
        return []
    q = sample_layer_bytes(shape.sample_entries, shape.dim)
    local = shape.sample_local
    head = max((n.memory for n in cluster.nodes if n.head), default=0)
    if not sample_task_memory(sample_task_bytes(shape.sample_entries, shape.dim), local, head):
        asked = ("not asked of Ray: the job's own node, where they read the run's local files, "
                 "offers Ray no memory; --sample-size and --sample-type-size bound it")  # fmt: skip
    else:
        asked = ("asked of Ray: a node runs as many as its memory holds; --sample-size and "
                 "--sample-type-size bound it")  # fmt: skip
    return [
        f"sample tasks: one Ray task a layer merges that layer's sample, builds the sampled "
        f"metrics' inputs and its rows of samples.parquet (on the driver's node when read "
        f"from local files), each ≈ {DRIVER_SAMPLE_LAYERS} · Q_l = "
        f"{gib(sample_task_bytes(shape.sample_entries, shape.dim))} at its peak, Q_l = "
        f"4·s·d + 48s = {gib(q)} ({asked})"
    ]


def sampled_task_lines(shape: Shape) -> list[str]:
    """The line on the sampled stage's per-layer Ray tasks (:mod:`.sampled_tasks`): what a
    layer's K-means selection and its metrics each ask Ray for, and what bounds them."""
    tasks = shape.sampled_tasks()
    if tasks is None:
        return []
    n, m = tasks.n, tasks.m or tasks.n
    held = f"n × n distances, n = {n:,}" if n <= m else f"{m:,} × {m:,} distances of a subsample"
    return [
        f"sampled-stage tasks: a layer's K-means selection ≈ {gib(tasks.kmeans)} and its "
        f"metrics ≈ {gib(tasks.metrics)} at their peak ({held}, d = {tasks.d:,}; asked of Ray: "
        "a node runs as many as its memory holds; --silhouette-max-points and --sample-size "
        "bound them)"
    ]


def object_store_lines(sizing: Sizing, writers: str) -> list[str]:
    """The line on Ray's object store (:mod:`.object_store`): its peak, by phase, and a
    warning where it passes the cluster's stores (Ray spills the rest to disk)."""
    io = sizing.extras.get("io") or io_sizes(sizing)
    return store_lines(plan_object_store(sizing, io["flush_piece_bytes"], writers), sizing.cluster)


def store_lines(store: ObjectStorePeak, cluster: Cluster) -> list[str]:
    """:func:`object_store_lines` of a peak (an analysis's, or a merge's:
    :func:`~embgeom_ray.sizing.object_store.after_extraction`) on ``cluster``."""
    stage = store.stage
    parts = []
    if stage is not None:
        parts.append(
            f"the sampled stage {gib(stage.total)}: every layer's inputs L·(8·s·d + 16·n) = "
            f"{gib(stage.inputs)}"
            + (f", ≤ C + 1 distance matrices 8·n² = {gib(stage.distances)}" if stage.distances else "")
            + (f", the fits' points ≤ min(C_s, C − 1) · 12·n·d = {gib(stage.fit_points)} and what "
               f"their share tasks return {gib(stage.fit_results)}" if stage.fit_points else "")
            + (f", the partitioned fits' points L·16·n·d = {gib(stage.partitions)}"
               if stage.partitions else "")
            + (f", the sample Q = {gib(stage.sample)}" if stage.sample else "")
        )
    if store.extraction:
        parts.append(f"extraction N·(spills, flushes handed over) = {gib(store.extraction)}")
    if store.reduce:
        parts.append(f"reduce V·160 + 8·d² = {gib(store.reduce)}")
    if store.pieces:
        parts.append(f"samples.parquet's rows 2·s·(4·d + 96) + Q = {gib(store.pieces)}")
    lines = [f"object store: ≈ {gib(store.peak)} at its peak ({'; '.join(parts) or 'small objects only'})"]
    # with no live node with a CPU (an autoscaler's workers, not joined yet) the stores the
    # stage's tasks will use are not known: only the job's own node's is compared
    working = any(n.cpus >= 1 for n in cluster.nodes)
    stores = [n.object_store for n in cluster.nodes] if working else []
    head = max((n.object_store for n in cluster.nodes if n.head), default=0)
    warning = store.warning(stores, head)
    return lines + ([f"  warning: {warning}"] if warning else [])


def _placement(cluster: Cluster, nodes: Sequence[str]) -> str:
    """``"2 on node 1 (worker, 64 GiB), 1 on node 0 (head, 16 GiB)"``."""
    index = {n.node_id: i for i, n in enumerate(cluster.nodes)}
    parts = []
    for node_id in dict.fromkeys(nodes):
        i = index[node_id]
        n = cluster.nodes[i]
        kind = "head" if n.head else "worker"
        parts.append(f"{nodes.count(node_id)} on node {i} ({kind}, {gib(n.memory)})")
    return ", ".join(parts)


@dataclass(frozen=True)
class _NoOptions:
    """No explicit option: every decision self-sized."""

    reducers: int | None = None
    reducer_memory: int | None = None


def layers_lever(sizing: Sizing, total_layers: int) -> str | None:
    """What measuring every 4th layer would save (``--layers``, the cheapest lever)."""
    shape = sizing.shape
    fewer = len(range(0, total_layers, 4))
    if fewer >= shape.layers:
        return None
    small = shape.with_layers(fewer)
    state = small.statistics_bytes(sizing.types)
    try:
        red = size_reducers(
            small, sizing.types, sizing.cluster, _NoOptions(), driver_reserve(small, sizing.types)
        )
        where = (
            f"{red.count} reducer(s) × {gib(red.memory)}" if red.partitioned else "the job's process"
        )
    except ConfigError:
        where = "still too large for this cluster"
    return (
        f"--layers every 4th layer (L = {fewer}): S(V) + F = {gib(state)} instead of "
        f"{gib(shape.statistics_bytes(sizing.types))} (÷{shape.layers / fewer:.1f}), reduced "
        f"on {where}"
    )


def extractors_per_node(sizing: Sizing) -> int:
    """The most extractors of the pool one node holds (by its CPUs and GPUs): what one node's
    failure takes."""
    pool = sizing.pool
    held = [
        min(n.cpus // max(1, pool.num_cpus), int(n.gpus // pool.num_gpus) if pool.num_gpus else n.cpus)
        for n in sizing.cluster.nodes
    ]
    return max(1, min(pool.num_workers, max(held, default=1)))
