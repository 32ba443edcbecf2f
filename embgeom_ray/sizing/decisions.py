"""The sizing's decisions: the extractor pool, where the statistics are reduced, the job's own
process; explicit options win, what cannot fit is refused here with the option that fixes it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..errors import ConfigError
from .checkpoints import writers_for
from .formulas import (
    CPU_BATCH_TOKENS_MAX,
    CPU_BATCH_TOKENS_MIN,
    DEFAULT_BATCH_TOKENS,
    DRIVER_ALLOWANCE_BYTES,
    DRIVER_BASE_BYTES,
    DRIVER_REDUCE_FACTOR,
    EXTRACTOR_BASE_BYTES,
    GPU_STATISTICS_SHARE,
    REDUCER_BASE_BYTES,
    REDUCER_MERGE_FACTOR,
    TYPE_ROW_BYTES,
    TYPE_ROW_DISK_BYTES,
    CorpusShape,
    MiB,
    Shape,
    batch_growth_bytes,
    cpu_batch_tokens,
    driver_bytes,
    driver_formula,
    extractor_bytes,
    extractor_upload_bytes,
    gib,
    layer_bytes_per_token,
    reducers_for,
    sample_entries_fitting,
    sample_on_workers,
    sample_task_bytes,
    shape_batch_bytes_per_token,
    shape_reducer_budget,
    statistics_for,
    tier_bytes,
    types_bound,
)  # fmt: skip
from .nodes import (
    Cluster,
    Node,
    NodeGroup,
    describe_offers,
    extractors_per_node,
    fits,
    place,
    placed_memory,
    slot_memory,
)
from .object_store import plan_object_store

#: a self-sized reducer asks for at most this share of the largest node's offer, so that a
#: node holds two and the reduce is spread over the cluster
REDUCER_NODE_SHARE = 0.5
#: reducers start while the extractors run (their processes and imports ready for the
#: reduce, ~5 s saved) only for corpora of at least this many bytes, whose extraction takes
#: minutes; for smaller ones the start would cost more than it saves
EARLY_REDUCERS_MIN_BYTES = 64 * MiB
#: self-sized ``--gpus-per-worker``: the fewest GPUs of one node whose memory holds the
#: weights in this share (the rest: the batch's activations and the statistics)
GPU_WEIGHT_SHARE = 0.5


def lanes_for(option: int | None, threads: int) -> int:
    """The lanes of a CPU extractor with ``threads`` CPUs: ``--cpu-lanes`` where given (at
    most ``threads``: a lane is one thread), else one lane a CPU."""
    return max(1, min(option or threads, threads))


@dataclass
class Pool:
    """The extractor actors: how many, what each asks Ray for, and what each may hold."""

    num_workers: int
    num_cpus: int
    num_gpus: float
    #: bytes of memory each asks Ray for and stays within (``--worker-memory``)
    memory: int
    #: bytes its running statistics may hold before they spill (None: no bound needed; on a
    #: GPU the actor lowers it to what its device holds)
    statistics: int | None
    #: padded tokens per batch (None: decided on each GPU once the model is loaded)
    batch_tokens: int | None
    formula: str
    reason: str
    #: why ``batch_tokens``: the option, or the CPU rule and its numbers ("": on each GPU)
    batch_reason: str = ""
    #: bytes of the head node's memory kept for the job's own process, which no extractor
    #: may take (:func:`driver_reserve`): what the pool's growth leaves of the head's offer
    head_reserve: int = 0
    #: bytes of host memory its spills are merged into before they go to the object store
    #: (``--host-statistics-memory``, or on GPUs whose statistics spill, what the memory it
    #: asks for leaves: :func:`host_tier_for`; None: no tier)
    host_statistics: int | None = None


@dataclass
class Reduce:
    """Where the statistics are reduced: in the job's process (``count`` 0) or on ``count``
    reducer actors of ``memory`` bytes each."""

    count: int
    memory: int | None
    types: int
    formula: str
    reason: str
    #: reducers started while the extractors run (their processes ready for the reduce)
    early: int = 0
    #: the node each reducer is placed on (:func:`place`), and each early one
    nodes: list[str] = field(default_factory=list)
    early_nodes: list[str] = field(default_factory=list)
    #: each reducer must run on its node of ``nodes`` (a local run directory that other nodes
    #: do not see: :func:`~embgeom_ray.runs.pipeline.reduce_decision`); else a preference
    pinned: bool = False
    #: bytes the job's own process may take above its start with this reduce, for the types
    #: it reduces (:func:`~embgeom_ray.sizing.formulas.driver_bytes`; 0: not sized here)
    driver: int = 0

    @property
    def partitioned(self) -> bool:
        return self.count > 0

    def describe(self) -> str:
        """One line: where the reduce runs, and why."""
        if not self.partitioned:
            return f"reduce in the job's own process: {self.reason}"
        early = f"; {self.early} started with the extractors" if self.early else ""
        return f"reducers: {self.count} × {gib(self.memory)}: {self.reason}{early}"


@dataclass
class Sizing:
    """Every decision of a run, made before any work (:func:`size_job`), with its reason."""

    shape: Shape
    cluster: Cluster
    types: int
    types_reason: str
    pool: Pool
    reduce: Reduce
    driver: int
    driver_formula: str
    extras: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The manifest's ``sizing`` (what ``--plan`` prints, as numbers)."""
        return {
            "types_bound": self.types,
            "types_reason": self.types_reason,
            "extractors": asdict(self.pool),
            "reducers": asdict(self.reduce),
            "driver_bytes": self.driver,
            "driver_formula": self.driver_formula,
            **self.extras,
        }

    def lines(self) -> list[str]:
        """The decisions, one line each, printed once when the job starts."""
        p = self.pool
        gpus = f", {p.num_gpus:g} GPU{'s' if p.num_gpus != 1 else ''}" if p.num_gpus else ""
        batch = "decided on its GPU" if p.batch_tokens is None else f"{p.batch_tokens:,}"
        stats = "the whole state" if p.statistics is None else gib(p.statistics)
        if p.host_statistics is not None and p.statistics is not None:
            stats += f", merged on the host up to {gib(p.host_statistics)}"
        elif p.host_statistics is not None:  # a GPU that holds less spills into the tier
            stats += f"; where a GPU holds less, merged on the host up to {gib(p.host_statistics)}"
        out = [
            f"sizing: {self.types_reason}",
            f"sizing: extractors: {p.num_workers} × ({p.num_cpus} CPU{gpus}) × {gib(p.memory)}"
            f" (statistics ≤ {stats}, batch {batch} tokens): {p.reason}",
        ]
        out.append(f"sizing: {self.reduce.describe()}")
        out.append(f"sizing: job's own process ≤ {gib(self.driver)} above its start: "
                   f"{self.driver_formula}")  # fmt: skip
        if self.driver > DRIVER_ALLOWANCE_BYTES:
            out.append(f"sizing: warning: {self.driver_warning()}")
        return out

    def driver_warning(self) -> str:
        """Why the job's own process needs more than :data:`DRIVER_ALLOWANCE_BYTES`."""
        shape = self.shape
        return (
            f"the job's own process needs {gib(self.driver)} above its start, more than "
            f"{gib(DRIVER_ALLOWANCE_BYTES)}: its share of the sample "
            f"({gib(shape.driver_sample_bytes)}) and a layer's type_stats rows "
            f"({gib(self.types * TYPE_ROW_BYTES)}) are held there; --sample-size and "
            "--sample-type-size lower the first"
        )


def sample_task_refusal(
    shape: Shape, cluster: Cluster, groups: Sequence[NodeGroup] | None = ()
) -> str | None:
    """Why no node can ever run one of the sample's per-layer Ray tasks
    (:mod:`~embgeom_ray.distributed.sample_tasks`, from a one-layer sample Q_l of
    :data:`~embgeom_ray.sizing.formulas.SAMPLE_ON_WORKERS_BYTES`), or None where one can (or
    the driver does that work): :func:`refuse_sample_task` on the live ``cluster`` and the
    node types its autoscaler may start (``groups``: () none can come, the private local Ray;
    None where the autoscaler does not say). A run on a local path has them read its files on
    the job's own node (the head); one in object storage, on any node."""
    if not sample_on_workers(shape.sample_entries, shape.dim):
        return None
    local = shape.sample_local
    # on a local path, the head (asked for no CPU where it offers none); else any node with a
    # CPU, as each asks for one: a head of ray start --num-cpus 0 runs none there
    offers = [n.memory for n in cluster.nodes if (n.head if local else n.cpus >= 1)]
    can_start = (None if groups is None
                 else [g.memory for g in groups if g.max_count != 0 and g.cpus >= 1])  # fmt: skip
    each = sample_task_bytes(shape.sample_entries, shape.dim)
    return refuse_sample_task(each, shape.dim, offers, local=local, can_start=can_start,
                              sized_by=sample_sized_by(shape.sample_entries, drawn=False))  # fmt: skip


def sample_sized_by(entries: int, drawn: bool) -> str:
    """What the sample tasks' s is: the sample drawn (the stage's, where its arrays say), or
    the options' sizes, the most it can hold (the plan's, before any is drawn)."""
    return (f"s = {entries:,} entries a layer: the sample drawn" if drawn
            else f"s = {entries:,} entries a layer: --sample-size + --sample-type-size, the most "
                 "the sample can hold")  # fmt: skip


def refuse_sample_task(
    each: int,
    dim: int,
    offers: Sequence[int],
    *,
    local: bool,
    can_start: Sequence[int] | None,
    sized_by: str = "",
) -> str | None:
    """The one line refusing the sample's per-layer tasks of ``each`` bytes (10 · Q_l, what
    each asks Ray for) that no node may ever run, else None: the plan's rule
    (:func:`sample_task_refusal`) and the stage's on the live cluster
    (:func:`~embgeom_ray.distributed.sample_tasks.check_fits`).

    ``local``: they read local files on the job's own node, whose Ray memory is ``offers``.
    A node that offers Ray no memory (``ray start --memory 0``: a head kept for the driver)
    is not refused: the tasks ask it for none (:func:`sample_task_memory`), as they ask no CPU
    of one that offers none, and run on what Ray was told to keep. Otherwise (object storage)
    any live node (``offers``) or a node type the autoscaler may start (``can_start``: each
    one's Ray memory; it starts one for a task waiting for memory) may run them; where the
    cluster may grow but does not say what (``can_start`` None: a joined cluster whose
    autoscaler reports no node types, as Ray 2.60's cluster launcher and KubeRay do not),
    nothing is refused: they wait for a node (as extractors do), and the stage says so.
    ``sized_by``: what s is (:func:`sample_sized_by`), said in the line."""
    if local:
        most = max(offers, default=0)
        if most == 0:  # no node here, or one that offers Ray no memory: asked for none
            return None
    elif can_start is None:
        return None
    else:
        most = max([*offers, *can_start], default=0)
    if each <= most:
        return None
    where = ("the job's own node (the sample is read from its local files)" if local
             else "the largest node with a CPU")  # fmt: skip
    return sample_task_refused(each, most, where, sample_entries_fitting(most, dim), sized_by)


def sample_task_memory(each: int, local: bool, offer: int) -> dict[str, int]:
    """The Ray ``memory`` a sample task of ``each`` bytes asks for: all of it, except on the
    job's own node (``local``) where that node offers Ray no memory (``offer`` 0: Ray would
    never place it; it runs there outside Ray's memory accounting, as before Ray was asked)."""
    return {} if local and offer <= 0 else {"memory": each}


def sampled_task_refusal(
    shape: Shape, cluster: Cluster, groups: Sequence[NodeGroup] | None = ()
) -> str | None:
    """Why no node can run one of the sampled stage's per-layer Ray tasks (a layer's K-means
    selection or its sampled metrics: :mod:`.sampled_tasks`), or None where one can (or the
    stage does not run). Each asks Ray for its peak and one CPU, so a task that no node with a
    CPU holds would wait for ever; they run on any such node, live or of a node type the
    autoscaler may start (``groups``; None: not said), for which it starts one, as the stage's
    own check on the live cluster counts them
    (:func:`~embgeom_ray.distributed.sampled_stage.task_memory_cap`). A head without CPUs
    (``--num-cpus 0``) runs none, whatever its memory; with no node with a CPU live or known
    (an autoscaler's workers, not joined yet) nothing is known, and nothing refused."""
    tasks = shape.sampled_tasks()
    memory = [n.memory for n in cluster.nodes if n.cpus >= 1]
    memory += [g.memory for g in groups or () if g.max_count != 0 and g.cpus >= 1]
    if tasks is None or not memory:
        return None
    return tasks.refusal(max(memory), "the largest node with a CPU")


def stage_task_refusal(
    shape: Shape, cluster: Cluster, groups: Sequence[NodeGroup] | None = ()
) -> str | None:
    """Why the sample's per-layer tasks (:func:`sample_task_refusal`) or the sampled stage's
    (:func:`sampled_task_refusal`) cannot run on ``cluster`` and the node types its autoscaler
    may start (``groups``), else None: what an analysis and a merge refuse before any work."""
    return sample_task_refusal(shape, cluster, groups) or sampled_task_refusal(shape, cluster, groups)


def sample_task_refused(each: int, most: int, where: str, entries: int, sized_by: str = "") -> str:
    """The one line refusing a sample whose per-layer task needs ``each`` bytes where the
    node it may run on offers Ray ``most`` (``entries``: the most that fit; ``sized_by``:
    what s is, :func:`sample_sized_by`)."""
    s = f"; {sized_by}" if sized_by else ""
    return (
        f"the sample's per-layer tasks need ≈ {gib(each)} each at their peak (10 · Q_l, "
        f"Q_l = 4·s·d + 48·s{s}), more than the {gib(most)} of Ray memory of {where}; lower "
        f"--sample-size and --sample-type-size (together at most {entries:,} entries fit)"
    )


def plan_pool(
    cluster: Cluster,
    shape: Shape,
    *,
    device: str,
    num_shards: int,
    num_workers: int | None = None,
    cpus_per_worker: int | None = None,
    gpus_per_worker: int | None = None,
) -> tuple[int, int, int]:
    """(actors, CPUs each, GPUs each): one actor per ``--gpus-per-worker`` GPUs of a node (self
    sized: the fewest GPUs of one node whose memory holds the weights in
    :data:`GPU_WEIGHT_SHARE`, 1 where Ray's accelerator type does not give the GPU's memory),
    else CPU actors of ``--cpus-per-worker`` CPUs (default min(4, the largest node's CPUs);
    with ``--num-workers N``, the cluster's CPUs // N, within 1 and the largest node's), as
    many as the nodes hold (``--num-workers``: that many).

    This is the pool the nodes hold when the job starts. With ``--device cuda`` GPU actors are
    asked for even if the cluster shows no GPU yet (one, until GPUs are visible); the pool then
    grows as nodes join (:mod:`.growth`, polled by the scheduler), up to ``--num-workers``.
    """
    alive = cluster.nodes
    cpus = max(cluster.cpus, 1)
    largest = max([n.cpus for n in alive if n.cpus > 0], default=cpus)
    if device == "cuda" or (cluster.gpus and device == "auto"):
        most = max((n.gpus for n in alive), default=0)
        per_gpu = gpus_per_worker or gpus_for_weights(cluster, shape)
        if cluster.gpus and per_gpu > most:
            raise ConfigError(
                f"--gpus-per-worker {per_gpu} exceeds the GPUs of the largest node ({most}); "
                "an extractor actor, and the model it loads, lives on one node"
            )
        fit = sum(n.gpus // per_gpu for n in alive)
        n = num_workers or max(fit, 1)
        return min(n, num_shards), per_gpu, cpus_per_worker or 1
    if (gpus_per_worker or 1) > 1:
        raise ConfigError(
            f"--gpus-per-worker {gpus_per_worker} needs GPUs, but the cluster has none and "
            f"--device is {device}"
        )
    if num_workers:
        per = cpus_per_worker or cpus_for_workers(num_workers, alive)
        n = num_workers
    else:
        per = cpus_per_worker or min(4, largest)
        n = max(1, sum(node.cpus // per for node in alive))  # an actor's CPUs: one node's
    if per > largest:
        raise ConfigError(
            f"--cpus-per-worker {per} exceeds the CPUs of the largest node ({largest}); "
            "an extractor actor runs on one node"
        )
    return max(1, min(n, num_shards)), 0, per


def cpus_for_workers(count: int, nodes: tuple[Node, ...]) -> int:
    """Each CPU extractor's CPUs with ``--num-workers`` ``count`` and no ``--cpus-per-worker``:
    the most, at most the cluster's CPUs / ``count`` and the largest node's, with which the
    nodes hold all ``count`` at once (Σ ⌊CPUs_n / c⌋ ≥ count); where none does (fewer CPUs
    than extractors: nodes yet to join), the cluster's CPUs / ``count``, at least 1.

    Why: the cluster's CPUs / N alone can leave an extractor no node holds: 24 CPUs on nodes
    of 8 and 16 gave 2 extractors 12 CPUs each, one of which waited for a node that never
    came; 8 each places both."""
    cpus = sum(n.cpus for n in nodes)
    largest = max([n.cpus for n in nodes if n.cpus > 0], default=max(cpus, 1))
    top = max(1, min(largest, cpus // count))
    return next((c for c in range(top, 0, -1) if sum(n.cpus // c for n in nodes) >= count), top)


def check_device(device: str, cluster: Cluster, *, private_local: bool) -> None:
    """Refuse ``--device cuda`` where no GPU can ever come: on the job's private local Ray of a
    machine without one. A cluster's GPU nodes may join later (an autoscaler's): there the pool
    asks for GPU extractors and waits for them (:func:`plan_pool`)."""
    if device == "cuda" and not cluster.gpus and private_local:
        raise ConfigError(
            f"--device cuda needs a GPU, and this machine has none that Ray sees (a private "
            f"local Ray of {cluster.cpus} CPUs and no GPU): give --device cpu or auto, or the "
            "--address of a cluster with GPUs"
        )


def gpus_for_weights(cluster: Cluster, shape: Shape) -> int:
    """The fewest GPUs of one node whose memory holds the weights in
    :data:`GPU_WEIGHT_SHARE`; all of the largest node's when none is enough (the device map
    then decides, and refuses weights beyond 90% of them); 1 when the GPUs' memory is unknown."""
    gpu_nodes = [n for n in cluster.nodes if n.gpus and n.gpu_memory]
    if not gpu_nodes or not shape.weight_bytes:
        return 1
    node = max(gpu_nodes, key=lambda n: n.gpus * (n.gpu_memory or 0))
    per = node.gpu_memory or 1
    need = math.ceil(shape.weight_bytes / (GPU_WEIGHT_SHARE * per))
    return max(1, min(need, node.gpus))


def device_statistics(cluster: Cluster, shape: Shape, gpus: int) -> int | None:
    """The most statistics an extractor's ``gpus`` GPUs hold beside the model and the least
    batch (:data:`GPU_STATISTICS_SHARE` of what they leave), where Ray's accelerator type
    gives every GPU node's memory; None otherwise (or on CPUs)."""
    memories = [n.gpu_memory for n in cluster.nodes if n.gpus]
    if not gpus or not memories or any(m is None for m in memories):
        return None
    left = gpus * min(m for m in memories if m is not None) - shape.weight_bytes
    left -= DEFAULT_BATCH_TOKENS * shape_batch_bytes_per_token(shape)
    return int(GPU_STATISTICS_SHARE * max(0, left))


def _cpu_batch(shape: Shape, options: Any, gpus: int) -> tuple[int | None, str]:
    """The batch tokens an extractor is given (None: a GPU sizes its own) and why."""
    if options.batch_tokens:
        return options.batch_tokens, "--batch-tokens"
    if gpus:
        return None, ""
    return cpu_batch_tokens(shape), (
        f"a CPU's: one layer's largest tensor, max(d_ff, d) · b = "
        f"{layer_bytes_per_token(shape):,} B a token, within glibc's 32 MiB mmap threshold, "
        f"{CPU_BATCH_TOKENS_MIN:,} to {CPU_BATCH_TOKENS_MAX:,}"
    )


def _extractor_formula(shape: Shape, b: int, gpus: int) -> str:
    """An extractor's memory as a formula (:func:`extractor_bytes`), for messages and plans."""
    return (
        f"{gib(EXTRACTOR_BASE_BYTES)} own + w {gib(shape.weight_bytes)}"
        + (f" / {gpus} GPUs" if gpus > 1 else "")
        + ("" if gpus else f" + batch {b:,} × {shape_batch_bytes_per_token(shape):,} B")
        + ("" if gpus or shape.lanes == 1 else f" ({shape.lanes} lanes)")
        + f" + 2 · sample {gib(shape.sample_bytes)} + "
        + (f"u {gib(extractor_upload_bytes(shape))} (a flush's upload to "
           f"{store_name(shape.store)}) + " if extractor_upload_bytes(shape) else "")
        + ("(σ + g) serialised from the GPUs" if gpus else "2 · (σ + g)")
    )  # fmt: skip


def store_name(url: str) -> str:
    """The object store of a run's URL, in words (``s3://b/run`` -> "S3")."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    return {"s3": "S3", "s3a": "S3", "gs": "GCS", "gcs": "GCS"}.get(protocol, protocol)


def host_tier_for(
    shape: Shape, types: int, b: int, memory: int, gpus: int, sigma: int
) -> int | None:
    """The host tier an extractor of ``memory`` bytes holds beside the rest it needs with the
    statistics budget ``sigma`` (:func:`extractor_bytes`): what is left less one block of its
    file (:func:`tier_bytes`: it is written a block at a time), no more than the whole
    statistics S(V) + F; None where that is not more than σ (a tier one spill fills would only
    copy every spill)."""
    left = memory - extractor_bytes(shape, types, b, sigma, gpus)
    tier = min(left - tier_bytes(0), shape.statistics_bytes(types))
    return tier if tier > sigma else None


def _extractor_range(
    shape: Shape,
    types: int,
    b: int,
    cluster: Cluster,
    gpus: int,
    explicit_s: int | None,
    explicit_h: int | None = None,
) -> tuple[int, int, int | None]:
    """(whole, least, on_device): an extractor's memory with its statistics unbounded (or
    bounded by the GPUs' share, ``on_device``, where they spill on the device, with a host
    tier holding the whole statistics beside them), and the least it can run with (the
    statistics at their fixed per-layer floor, or ``--statistics-memory``, no tier); with
    ``--host-statistics-memory`` (``explicit_h``), that tier in both."""
    floor = shape.layer_state_bytes()
    if explicit_s is not None and explicit_s <= floor:
        raise ConfigError(
            f"--statistics-memory {explicit_s:,} bytes is not more than the fixed per-layer "
            f"state of the statistics, {floor:,} bytes for {shape.layers} layers of d = "
            f"{shape.dim} and {shape.positions} positions (8·L·(d² + 3d + P·(d+1) + 2)); give "
            "more, or measure fewer --layers"
        )
    # on GPUs σ is decided on the device once the model is loaded, and may fall short of the
    # whole statistics the plan expects them to hold: a given tier is asked for there too
    whole = extractor_bytes(shape, types, b, None, gpus, explicit_h if gpus else None)
    on_device = device_statistics(cluster, shape, gpus)
    if on_device is not None and on_device >= shape.statistics_bytes(types):
        on_device = None  # the GPUs hold the whole statistics
    if on_device is not None:
        # the statistics live on the GPUs and spill past what those hold: the host needs the
        # copy of that, and at most a tier that merges the spills into the whole statistics
        on_device = max(on_device, floor + 1)
        tier = explicit_h if explicit_h is not None else shape.statistics_bytes(types)
        whole = extractor_bytes(shape, types, b, on_device, gpus, tier)
    # the statistics at their floor, with the growth a batch may add before it spills; no
    # more than the whole statistics (a small corpus: S(V) + F under that floor and growth)
    least = min(extractor_bytes(shape, types, b, floor + 1, gpus, explicit_h), whole)
    if explicit_s is not None:
        least = whole = extractor_bytes(shape, types, b, explicit_s, gpus, explicit_h)
    return whole, least, on_device


def _explicit_worker_memory(
    memory: int, least: int, offers: list[int], formula: str, explicit_s: int | None
) -> str:
    """``--worker-memory``, checked against the least an extractor needs and the largest
    node's offer; the reason recorded."""
    if memory < least:
        what = "the fixed per-layer state" if explicit_s is None else "--statistics-memory"
        raise ConfigError(
            f"--worker-memory {memory:,} bytes cannot hold an extractor: {least:,} bytes "
            f"({gib(least)}) at least, with {what} ({formula}); give more, or measure "
            "fewer --layers"
        )
    if max(offers, default=0) < memory:
        raise ConfigError(
            f"--worker-memory {memory:,} bytes is more than any node of the cluster offers "
            f"Ray's actors ({max(offers, default=0):,} bytes on the largest); give less, or "
            "add nodes with more memory"
        )
    return f"--worker-memory {gib(memory)}"


def _fitted_pool(
    shape: Shape, types: int, options: Any, count: int, hosts: list[int], offers: list[int],
    bounds: tuple[int, int, int | None], gpus: int, formula: str,
) -> tuple[int, int, str]:
    """(count, memory, reason) with no ``--worker-memory``: each extractor asks for what its
    statistics need unbounded (``whole``) or, where the nodes do not hold as many of those as
    their CPUs and GPUs hold of the ``count``, the most that lets those be placed at once
    (:func:`slot_memory`); a pool the nodes cannot hold at the ``least`` an extractor needs is
    made smaller, not below one, unless ``--num-workers`` names it (then refused). Extractors
    of ``--num-workers`` that no node's CPUs or GPUs hold yet are kept: they wait for nodes
    (an autoscaler's), asking for the same; where no node holds one, each asks for
    ``whole``."""
    whole, least, on_device = bounds
    explicit_s = options.statistics_memory
    placeable = min(count, sum(hosts))  # what the nodes' CPUs and GPUs hold now
    fitted = max(1, placeable)
    while fitted > 1 and slot_memory(fitted, hosts, offers) < least:
        fitted -= 1
    room = slot_memory(fitted, hosts, offers) if placeable else whole
    if room < least or (options.num_workers and fitted < placeable):
        raise ConfigError(
            f"an extractor needs at least {least:,} bytes ({gib(least)}: {formula} with σ "
            f"the {'--statistics-memory' if explicit_s else 'fixed per-layer state'}), "
            f"but the nodes (offering {describe_offers(offers)}) hold {placeable} such extractor(s) "
            f"at most {gib(slot_memory(placeable, hosts, offers))} each; "
            + ("lower --host-statistics-memory, " if options.host_statistics_memory else "")
            + "measure fewer --layers, lower --sample-size and --sample-type-size, give fewer "
            "--num-workers or more --cpus-per-worker, or add nodes with more memory"
        )
    memory = min(whole, room)
    fewer = (
        f"; {fitted} of the {placeable} extractors the CPUs/GPUs hold, so that each has that"
        if fitted < placeable
        else ""
    )
    if options.num_workers and placeable < count:
        fewer += (
            f"; the nodes hold {placeable} of the {count} extractors now, the rest wait for "
            "nodes to join"
            if placeable
            else f"; all {count} wait for nodes to join"
        )
        fitted = count
    state = gib(shape.statistics_bytes(types))
    if explicit_s is not None:
        reason = f"--statistics-memory {gib(explicit_s)}{fewer}"
    elif on_device is not None:
        reason = (
            f"S(V) + F = {state} do not fit the GPUs: they "
            f"spill past σ = {gib(on_device)} ({GPU_STATISTICS_SHARE:g} of what the model "
            f"and the least batch leave of {gpus} GPU(s)); the host holds their serialised "
            f"copy{fewer}"
        )
    elif memory >= whole and not placeable:
        reason = f"the whole statistics S(V) + F = {state}: no node holds an extractor yet{fewer}"
    elif memory >= whole:
        reason = (
            f"the whole statistics S(V) + F = {state} fit "
            f"(the nodes hold {min(fitted, placeable)} extractor(s) of {gib(room)}){fewer}"
        )
    else:
        reason = (
            f"S(V) + F = {state} do not fit the {gib(room)} "
            f"the nodes hold for each of {min(fitted, placeable)} extractor(s): they spill "
            f"past σ{fewer}"
        )
    return fitted, memory, reason


def size_extractors(
    shape: Shape,
    types: int,
    cluster: Cluster,
    options: Any,
    num_shards: int,
    driver: int,
) -> Pool:
    """The extractor pool and each actor's memory (``--worker-memory``) and statistics budget
    (``--statistics-memory``); explicit options win. Otherwise each actor asks for what its
    statistics need unbounded, or, where the nodes do not hold that many of those, the most
    that lets the whole pool be placed at once (:func:`slot_memory`), its statistics bounded
    by what is left of it; a pool the nodes' memory cannot hold at the least an extractor
    needs is made smaller (not below one) unless ``--num-workers`` names it."""
    count, gpus, cpus = plan_pool(
        cluster, shape, device=options.device, num_shards=num_shards,
        num_workers=options.num_workers, cpus_per_worker=options.cpus_per_worker,
        gpus_per_worker=options.gpus_per_worker,
    )  # fmt: skip
    if not gpus:  # a CPU extractor holds a batch in each of its lanes
        shape = replace(shape, lanes=lanes_for(options.cpu_lanes, cpus))
    batch, batch_reason = _cpu_batch(shape, options, gpus)
    b = batch or DEFAULT_BATCH_TOKENS  # the least a GPU batch is: for the growth bound
    formula = _extractor_formula(shape, b, gpus)
    tier = f" + H + {gib(tier_bytes(0))} (the host tier, written a block at a time)"
    explicit_s = options.statistics_memory
    explicit_h = options.host_statistics_memory
    explicit_h = None if explicit_h is None else int(explicit_h)
    # what the refusals name: with a given tier, H counted
    asked = formula if explicit_h is None else f"{formula} + H {gib(explicit_h)} + {gib(tier_bytes(0))}"
    bounds = _extractor_range(shape, types, b, cluster, gpus, explicit_s, explicit_h)
    whole, least, on_device = bounds
    offers = cluster.offers(driver)
    if options.worker_memory is not None:
        memory = int(options.worker_memory)
        reason = _explicit_worker_memory(memory, least, offers, asked, explicit_s)
    else:
        hosts = extractors_per_node(cluster, cpus, gpus)
        count, memory, reason = _fitted_pool(
            shape, types, options, count, hosts, offers, bounds, gpus, asked
        )
    host = explicit_h
    if host is None and explicit_s is None and on_device is not None:
        # statistics that spill on the GPUs: their spills merged on the host, in what the
        # memory asked for leaves beside the copy of σ
        host = host_tier_for(shape, types, b, memory, gpus, on_device)
        if host is None and options.worker_memory is None:  # no room for a tier: not asked
            memory = min(memory, extractor_bytes(shape, types, b, on_device, gpus))
    statistics = explicit_s or statistics_for(shape, types, b, memory - tier_bytes(host), gpus)
    unbounded = explicit_s is None and on_device is None and memory >= whole
    if unbounded or statistics >= shape.statistics_bytes(types):
        statistics = None  # the whole statistics fit: no bound needed
    # on GPUs, σ is at most what they hold (each extractor decides it on its device)
    spilled = None if statistics is None else min(statistics, on_device or statistics)
    if explicit_h is not None and spilled is not None and explicit_h <= spilled:
        raise ConfigError(
            f"--host-statistics-memory {explicit_h:,} bytes does not exceed the extractors' "
            f"statistics budget σ = {spilled:,} bytes: the host tier merges spills of σ "
            "bytes; give it more than σ, or leave it out"
        )
    if statistics is None and explicit_h is not None and not gpus:
        # a CPU's budget is the one decided here: nothing spills, so no tier is made
        host = None
        reason += (
            f"; --host-statistics-memory {gib(explicit_h)} not used: the whole statistics "
            "fit, nothing spills"
        )
    if statistics is None and explicit_h is None:
        host = None  # nothing spills: no tier
    if host is not None and explicit_h is None:
        reason += f"; the spills merged on the host into a tier of {gib(host)} (what is left)"
    if host is not None:
        formula += tier
    return Pool(
        count, cpus, float(gpus), memory, statistics, batch, formula, reason, batch_reason,
        head_reserve=driver, host_statistics=host,
    )  # fmt: skip


def _refuse_or_note(message: str, final: bool, least: tuple[int, int], offers: list[int]) -> str:
    """Refuse ``message`` when final, or when even the least the request needs whatever the
    types (``least``: that many reducers of that many bytes) does not fit; else the note that
    the reduce is sized again for the types seen."""
    if final or not fits(*least, offers):
        raise ConfigError(message)
    return (
        f"; at this bound on the types they do not all fit the nodes at once: the reduce "
        f"is sized again for the types seen ({message})"
    )


def reducer_counts_that_fit(
    shape: Shape, types: int, offers: list[int], start: int = 1
) -> tuple[int, int] | None:
    """(fewest, most): the reducer counts R from the fewest (at least ``start``) whose R
    budgets for ``types`` types (:func:`~embgeom_ray.sizing.formulas.reducer_budget`) the
    nodes' ``offers`` hold all at once, through every count after it that they hold too; None
    where no count fits. A reducer needs at least its own :data:`REDUCER_BASE_BYTES`, so no
    more than Σ offers / that are tried."""
    most = min(max(types, shape.layers, 1), sum(offers) // REDUCER_BASE_BYTES)
    span: list[int] = []
    for r in range(start, most + 1):
        if fits(r, shape_reducer_budget(shape, r, types), offers):
            span.append(r)
        elif span:
            break
    return (span[0], span[-1]) if span else None


def _reducers_advice(shape: Shape, types: int, offers: list[int], option: str, count: int) -> str:
    """What would fit where ``option`` (``--reducers`` or ``--reducer-memory``, asking for
    ``count`` reducers) does not: the counts the nodes hold for ``types`` types
    (:func:`reducer_counts_that_fit`), or, where none does, the most they hold of the least a
    reducer needs whatever the types; with the other levers."""
    # --reducers 1 is the reduce in the job's own process, not one reducer actor
    span = reducer_counts_that_fit(shape, types, offers, 2 if option == "--reducers" else 1)
    levers = "measure fewer --layers, or add nodes"
    if span is not None:
        lo, hi = span
        if option == "--reducer-memory":
            least = shape_reducer_budget(shape, hi, types)
            return (f"give --reducer-memory {least:,} ({gib(least)}: {hi} reducers of it fit "
                    f"the nodes), {levers}")  # fmt: skip
        fit = f"{lo}" if lo == hi else f"{lo} to {hi}"
        which = "fewer" if count > hi else "more"
        return f"give {which} --reducers ({fit} fit the nodes), {levers}"
    least = shape_reducer_budget(shape, max(shape.layers, 1), 0)
    held = sum(o // least for o in offers)
    if option == "--reducers" and count > held:
        return (f"give fewer --reducers (the nodes hold {held} even of the least a reducer "
                f"needs, {gib(least)}), {levers}")  # fmt: skip
    return f"no count of reducers fits these statistics on these nodes: {levers}"


def _by_reducer_memory(
    shape: Shape, types: int, options: Any, offers: list[int], rows: str, final: bool
) -> tuple[int, int, str, bool]:
    """``--reducer-memory B``: the fewest reducers of B each (at least ``--reducers``)."""
    memory, explicit_r = int(options.reducer_memory), options.reducers
    try:
        fewest = reducers_for(memory, shape.layers, shape.dim, types, shape.positions,
                              shape.clip, shape.store)  # fmt: skip
    except ConfigError:  # not even one layer's state: what the nodes would hold instead
        floor = shape_reducer_budget(shape, max(types, shape.layers, 1), types)
        advice = _reducers_advice(shape, types, offers, "--reducer-memory", 0)
        raise ConfigError(
            f"--reducer-memory {memory:,} bytes cannot hold a reducer's part: one layer's "
            f"state alone needs {floor:,} bytes ({gib(floor)}: the process's own "
            f"{gib(REDUCER_BASE_BYTES)} and {REDUCER_MERGE_FACTOR:g} · 8·(d² + 3d + P·(d+1) + 2) "
            f"for d = {shape.dim}, P = {shape.positions}, the merge's headroom); for {rows}, "
            f"{advice}"
        ) from None
    count = max(explicit_r or 1, fewest)
    largest = max(offers, default=0)
    if memory > largest:
        raise ConfigError(
            f"--reducer-memory {memory:,} bytes is more than any node of the cluster offers "
            f"Ray's actors ({largest:,} bytes on the largest); give less, or add nodes "
            "with more memory"
        )
    unsure = ""
    if not fits(count, memory, offers):
        unsure = _refuse_or_note(
            f"--reducer-memory {memory:,} bytes: {rows} need {count} reducers of that, "
            f"and the nodes, offering {describe_offers(offers)}, hold fewer; "
            + _reducers_advice(shape, types, offers, "--reducer-memory", count),
            final, (explicit_r or 1, memory), offers,
        )  # fmt: skip
    reason = f"--reducer-memory {gib(memory)}: {rows} over reducers of that{unsure}"
    return count, memory, reason, bool(unsure)


def _by_reducer_count(
    shape: Shape, types: int, count: int, offers: list[int], rows: str, formula: str,
    final: bool,
) -> tuple[int, int, str, bool]:
    """``--reducers R > 1``: R reducers, each asking for what its share needs."""
    memory = shape_reducer_budget(shape, count, types)
    unsure = ""
    if not fits(count, memory, offers):
        unsure = _refuse_or_note(
            f"--reducers {count}: each needs {memory:,} bytes ({gib(memory)}: {formula} "
            f"for {rows}), and the nodes, offering {describe_offers(offers)}, do not hold "
            f"{count} of them; " + _reducers_advice(shape, types, offers, "--reducers", count),
            final, (count, shape_reducer_budget(shape, count, 0)), offers,
        )  # fmt: skip
    return count, memory, f"--reducers {count}: {rows} over {count}{unsure}", bool(unsure)


def _by_node_share(
    shape: Shape, types: int, offers: list[int], rows: str, final: bool
) -> tuple[int, int, str, bool]:
    """No reducer option: the fewest reducers, each needing at most
    :data:`REDUCER_NODE_SHARE` of the largest node's offer, that the nodes hold together, at
    least one on each node that can hold one."""
    largest = max(offers, default=0)
    cap = int(REDUCER_NODE_SHARE * largest)
    most = max(types, shape.layers, 1)
    first = reducers_for_cap(shape, types, cap)

    def budget(r: int) -> int:
        return shape_reducer_budget(shape, r, types)

    def spread(r: int) -> bool:  # at least one reducer on each node that can hold one
        return r >= sum(o >= budget(r) for o in offers)

    count = next(
        (r for r in range(max(first, 1), most + 1)
         if first and fits(r, budget(r), offers) and spread(r)),
        0,
    )  # fmt: skip
    if not count and (final or not first):
        raise ConfigError(
            f"the statistics, {rows}, do not fit the cluster: reducers of at most "
            f"{gib(cap)} (half the largest node's offer; nodes offer {describe_offers(offers)}) "
            "cannot hold them; measure fewer --layers, or add nodes with more memory "
            "(or give --reducer-memory)"
        )
    unsure = ""
    if not count:  # at the bound: the fewest within the cap, which the types seen may fit
        count = first
        unsure = (
            "; at this bound on the types they do not all fit the nodes at once: the "
            "reduce is sized again for the types seen, and refused then if they still "
            "do not"
        )
    reason = (
        f"{rows} over reducers of ≤ {gib(cap)} ({REDUCER_NODE_SHARE:g} of the largest "
        f"node's {gib(largest)}), at least one on each node that holds one (nodes offer "
        f"{describe_offers(offers)}){unsure}"
    )
    return count, budget(count), reason, bool(unsure)


def size_reducers(
    shape: Shape,
    types: int,
    cluster: Cluster,
    options: Any,
    driver: int,
    *,
    beside: tuple[int, int, int, int] | None = None,
    final: bool = True,
) -> Reduce:
    """Where the statistics of ``types`` types are reduced (explicit options win):

    - ``--reducers 1``: in the job's own process; ``--reducers R > 1``: R reducers, each
      asking for what its share needs; ``--reducer-memory B``: the fewest reducers of B each
      (at least ``--reducers``);
    - otherwise in the job's process while its whole memory with the in-process reduce
      (:func:`driver_bytes`, ``in_process=True``: :data:`DRIVER_REDUCE_FACTOR` · (S(V) + F)
      beside its base, the type rows, the sample and any upload) stays within
      :data:`DRIVER_ALLOWANCE_BYTES`, else on the fewest reducers each needing at most
      :data:`REDUCER_NODE_SHARE` of the largest node's offer that the nodes hold together.

    ``beside`` (extractors, CPUs, GPUs, memory each): the extractor pool, to start as many
    reducers as fit beside it while it runs (``early``). ``final``: ``types`` are the types
    seen, and reducers the nodes cannot hold are refused; before the corpus is read (a bound
    on the types) only what cannot fit whatever the types is refused (reducers of more than
    any node offers, more reducers than the nodes hold at their least), and a decision the
    bound does not fit says so: the reduce is sized again for the types seen.
    """
    rows = f"8·L·V·(2d+2) + F = {gib(shape.statistics_bytes(types))}"
    offers = cluster.offers(driver)
    explicit_r, explicit_b = options.reducers, options.reducer_memory
    formula = f"{gib(REDUCER_BASE_BYTES)} + {REDUCER_MERGE_FACTOR:g} · (⌈V/R⌉ types' rows + ⌈L/R⌉ layers' state)"
    if shape.upload_bytes(1):  # the run is in object storage
        formula += " + u (writing that part to the store: its upload's buffers)"
    if explicit_b is None and explicit_r == 1:
        return Reduce(0, None, types, f"{DRIVER_REDUCE_FACTOR} · (S(V) + F)", "--reducers 1", 0)
    if explicit_b is None and explicit_r is None:
        in_driver = driver_bytes(shape, types, in_process=True)
        if in_driver <= DRIVER_ALLOWANCE_BYTES:
            return Reduce(
                0, None, types, f"{DRIVER_REDUCE_FACTOR} · (S(V) + F)",
                f"the job's process would take {gib(in_driver)} above its start with "
                f"{rows} ({driver_formula(True, shape)}), within its "
                f"{gib(DRIVER_ALLOWANCE_BYTES)}",
            )  # fmt: skip
    if explicit_b is not None:
        count, memory, reason, unsure = _by_reducer_memory(
            shape, types, options, offers, rows, final
        )
    elif explicit_r is not None:
        count, memory, reason, unsure = _by_reducer_count(
            shape, types, explicit_r, offers, rows, formula, final
        )
    else:
        count, memory, reason, unsure = _by_node_share(shape, types, offers, rows, final)
    early: list[str] = []
    if beside is not None:
        n_ext, cpus, gpus, each = beside
        taken = placed_memory(cluster, offers, n_ext, cpus, gpus, each)
        early = place(cluster, offers, count, memory, taken, partial=True)
    nodes = place(cluster, offers, count, memory, partial=unsure)
    return Reduce(count, memory, types, formula, reason, len(early), nodes, early)


def reducers_for_cap(shape: Shape, types: int, cap: int) -> int:
    """The fewest reducers within ``cap`` bytes each (0 when none is)."""
    try:
        return reducers_for(
            cap, shape.layers, shape.dim, types, shape.positions, shape.clip, shape.store
        )
    except ConfigError:
        return 0


def driver_reserve(shape: Shape, types: int = 0) -> int:
    """What the head node keeps for the job's own process: its start
    (:data:`DRIVER_BASE_BYTES`) and its allowance (:data:`DRIVER_ALLOWANCE_BYTES`), or what it
    needs with the statistics on reducers where that is more (:func:`driver_bytes`)."""
    need = driver_bytes(shape, types, in_process=False)
    return DRIVER_BASE_BYTES + max(DRIVER_ALLOWANCE_BYTES, need)


def size_job(
    shape: Shape, corpus: CorpusShape, cluster: Cluster, options: Any, *, special: int = 0,
    groups: Sequence[NodeGroup] | None = (),
) -> Sizing:
    """Every decision of a run before any work (module docstring; explicit options win), at the
    most types the corpus can hold (:func:`types_bound`; ``special``: the special ids counted
    with ``--keep-special``). Raises :class:`ConfigError` for what cannot fit, naming the
    option that fixes it. ``groups``: the node types the cluster's autoscaler may start
    (() none: the private local Ray; None: not said, :func:`sample_task_refusal`)."""
    types, types_reason = types_bound(shape.vocab, corpus.text_bytes, special)
    reserve = driver_reserve(shape, types)
    pool = size_extractors(shape, types, cluster, options, corpus.shards, reserve)
    beside = (pool.num_workers, pool.num_cpus, int(pool.num_gpus), pool.memory)
    if options.reducers is None and corpus.bytes < EARLY_REDUCERS_MIN_BYTES:
        beside = None  # self-sized reducers start early only for a long extraction
    reduce = size_reducers(shape, types, cluster, options, reserve, beside=beside, final=False)
    driver = driver_bytes(shape, types, not reduce.partitioned)
    reduce.driver = driver
    head = max((n.memory for n in cluster.nodes if n.head), default=0)
    if head and DRIVER_BASE_BYTES + driver > head:
        raise ConfigError(
            f"the job's own process would need {gib(DRIVER_BASE_BYTES + driver)} "
            f"({gib(DRIVER_BASE_BYTES)} at its start + {driver_formula(not reduce.partitioned, shape)}"
            f": its share of the sample {gib(shape.driver_sample_bytes)}, the type_stats rows "
            f"{gib(types * TYPE_ROW_BYTES)} a layer), more than the head node's "
            f"{gib(head)}; lower --sample-size and --sample-type-size, or measure fewer --layers"
        )
    refused = stage_task_refusal(shape, cluster, groups)
    if refused:
        raise ConfigError(refused)
    sizing = Sizing(
        shape, cluster, types, types_reason, pool, reduce, driver,
        driver_formula(not reduce.partitioned, shape),
    )  # fmt: skip
    sizing.extras["io"] = io_sizes(sizing)
    tasks = shape.sampled_tasks()
    if tasks is not None:  # what each of the sampled stage's per-layer tasks asks Ray for
        sizing.extras["sampled_tasks"] = {
            "kmeans_memory": tasks.kmeans, "metrics_memory": tasks.metrics
        }  # fmt: skip
    # what its processes hand each other through Ray's object store, at its peak
    sizing.extras["object_store"] = plan_object_store(
        sizing, sizing.extras["io"]["flush_piece_bytes"], writers_for(shape.store or "")
    ).to_json()
    return sizing


def size_reduce(shape: Shape, types: int, cluster: Cluster, options: Any) -> Reduce:
    """Where ``types`` token types (known now: V_seen, at most the bound the run was sized
    for) are reduced, by the rule of :func:`size_reducers`: self-sized, the same or fewer
    reducers, each asking for what its share of V_seen needs, or the job's own process."""
    reduce = size_reducers(shape, types, cluster, options, driver_reserve(shape, types))
    return replace(reduce, driver=driver_bytes(shape, types, not reduce.partitioned))


def io_sizes(sizing: Sizing) -> dict[str, Any]:
    """Bytes that move and are stored: a flush's pieces, what the checkpoint groups on disk
    grow by each round of flushes (every extractor's, a piece and the sample each; the groups
    are kept until the run completes, so their total grows with the run's length), the
    artefact and the tables."""
    shape, types, pool = sizing.shape, sizing.types, sizing.pool
    whole = shape.statistics_bytes(types)
    tier = pool.host_statistics if pool.statistics is not None else None
    piece = whole if pool.statistics is None else min(
        whole,
        pool.statistics + batch_growth_bytes(shape, types, pool.batch_tokens or DEFAULT_BATCH_TOKENS)
        if tier is None
        else tier,
    )
    tables = {
        "type_stats": shape.layers * types * TYPE_ROW_DISK_BYTES,
        "dims": shape.layers * shape.dim * TYPE_ROW_DISK_BYTES,
        "positions": shape.layers * shape.positions * TYPE_ROW_DISK_BYTES,
        "samples": shape.layers * shape.sample_entries * (4 * shape.dim + 64),
    }
    return {
        "flush_piece_bytes": piece,
        "flush_formula": "≤ S(V) + F, one piece"
        if pool.statistics is None
        else "a piece ≤ σ + g (spilled or last); a flush: the pieces of one interval"
        if tier is None
        else "a piece ≤ H, the host tier's (spilled when full, or last); a flush: its pieces of "
        "one interval",
        # a round of full flushes, one a piece: what the groups on disk grow by each interval
        "checkpoint_bytes_per_round": pool.num_workers * (piece + shape.sample_bytes),
        # unbounded, a flush is one piece; under σ, as many pieces as the interval spilled
        "checkpoint_bytes_per_interval": None
        if pool.statistics is not None
        else pool.num_workers * (piece + shape.sample_bytes),
        "artefact_bytes": whole + shape.sample_bytes,
        "tables_bytes": tables,
    }

