"""The sample's per-layer work as Ray tasks, so that the job's own process holds none of its vectors.

A one-layer sample is Q_l = 4·s·d + 48·s bytes (s entries of d float32 and six int64): 128 MiB
for an 8B model at the default s = 8,192, 256 MiB for a 70B one. Merging it from its parts,
widening its points for the sampled stage and encoding its rows of ``samples.parquet`` take
about ten times that (:data:`~embgeom_ray.sizing.formulas.DRIVER_SAMPLE_LAYERS`), more than the
driver's allowance. From :data:`~embgeom_ray.sizing.formulas.SAMPLE_ON_WORKERS_BYTES` on
(:func:`~embgeom_ray.sizing.formulas.on_workers`) this work runs in Ray tasks, one per layer, each reading its layer itself
(the :class:`~embgeom_ray.core.sample_layers.SampleLayers` is put in the object store once:
file URLs, a run directory, or the sample itself when it is in memory):

- :func:`submit_inputs`: the layer's :func:`~embgeom_ray.core.tables.sampled_layer` inputs,
  returned as separate objects that the K-means and metrics tasks take as arguments
  (:func:`embgeom_ray.distributed.sampled_stage.add_sampled_metrics`);
- :func:`table_pieces_on_ray`: the layer's rows of ``samples.parquet``
  (:func:`~embgeom_ray.run_dir.sample_layer_table`, the same code as in the driver), cut into
  pieces of at most :data:`~embgeom_ray.sizing.formulas.SAMPLE_PIECE_BYTES` within each run of
  (layer, sample), which the driver fetches and writes one at a time
  (:meth:`~embgeom_ray.run_dir.RunDir.write_samples`).

A sample read from local files (checkpoint groups or a run on this machine's disk) is read
by tasks on the driver's node (:func:`placement`), which other nodes' tasks could not read;
from object storage, anywhere. The tasks run the driver's own functions on the same inputs, so every array and row is the
same bit for bit; only ``samples.parquet``'s row groups are cut finer (readers do not depend
on them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from ..core.options import header_entries
from ..sizing.formulas import SAMPLE_PIECE_BYTES

if TYPE_CHECKING:
    import pyarrow as pa

    from ..core.sample_layers import SampleLayers


@ray.remote(num_returns=5)
def _layer_inputs(sample: SampleLayers, layer: int, clip_dims: list[int]) -> tuple[Any, ...]:
    """(the stage's note, then the uniform vectors, token ids, type-uniform vectors and
    content keys) of ``layer``: :func:`~embgeom_ray.core.tables.sampled_layer` of its
    one-layer sample."""
    from ..core.tables import sampled_layer, sampled_note

    one = sample.layer(layer)
    note = sampled_note(one)
    inputs = sampled_layer(one, layer, clip_dims)
    del one
    return note, inputs.vectors, inputs.token_ids, inputs.type_vectors, inputs.content_keys


def _reads_local_files(sample: Any) -> bool:
    """Whether ``sample`` (or one of its merged parts) is read from this machine's files
    (a group's sample file, a run's ``samples.parquet``), which other nodes may not see."""
    from ..io_utils import is_local

    for part in getattr(sample, "parts", [sample]):
        url = getattr(part, "url", None) or getattr(getattr(part, "run", None), "url", None)
        if url is not None and is_local(url):
            return True
    return False


def sample_size(sample: Any) -> tuple[int, bool]:
    """(s, whether it is the sample drawn): the entries each layer of ``sample`` holds as
    drawn (:func:`~embgeom_ray.core.sample_layers.drawn_entries`), fewer than its sizes
    where the corpus had fewer occurrences or types; else its sizes (``--sample-size`` +
    ``--sample-type-size``), the most it can hold, as the plan sized it."""
    from ..core.sample_layers import drawn_entries

    drawn = drawn_entries(sample)
    return (drawn, True) if drawn is not None else (sum(header_entries(sample.header)), False)


def task_bytes(sample: Any) -> int:
    """What each task that reads ``sample`` holds at its peak and asks Ray for:
    :func:`~embgeom_ray.sizing.formulas.sample_task_bytes` = 10 · Q_l of its one-layer
    sample, as drawn where it says (:func:`sample_size`; the plan's formula, by the options'
    sizes, is the most it can be)."""
    from ..sizing.formulas import sample_task_bytes

    return sample_task_bytes(sample_size(sample)[0], int(sample.header["dim"]))


def memory_with_cpu(nodes: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Each live node with a CPU (``nodes``: ``ray.nodes()``) -> its Ray memory: the nodes a
    task asking Ray for a CPU may run on (a head of ``ray start --num-cpus 0`` runs none,
    whatever its memory), for the sample's tasks in object storage and the sampled stage's."""
    return {str(n.get("NodeID", "")): int(n.get("Resources", {}).get("memory", 0)) for n in nodes
            if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) >= 1}  # fmt: skip


def _memory_of(nodes: Sequence[Mapping[str, Any]], here: str | None) -> list[int]:
    """The Ray memory of each live node a task may run on: ``here`` only, where given (asked
    for no CPU where it offers none); else each node with a CPU (:func:`memory_with_cpu`)."""
    if here is None:
        return list(memory_with_cpu(nodes).values())
    return [int(n.get("Resources", {}).get("memory", 0)) for n in nodes
            if n.get("Alive") and n.get("NodeID") == here]  # fmt: skip


def check_fits(
    sample: Any,
    nodes: Sequence[Mapping[str, Any]],
    here: str | None,
    can_start: Sequence[int] | None = (),
) -> None:
    """:class:`~embgeom_ray.errors.ConfigError` (one line, exit status 2) where no node may
    ever run a task reading ``sample``: :func:`~embgeom_ray.sizing.decisions.refuse_sample_task`
    on the cluster as it is when the stage starts (hours after the plan's same check, the
    extractors' nodes perhaps gone), of the sample as drawn where it says (:func:`sample_size`;
    the plan's is by the options' sizes, the most it can be; the line says which):
    ``nodes`` (``ray.nodes()``), ``here`` (this node's id,
    when it reads local files), ``can_start`` (the Ray memory of each node type the autoscaler
    may start; () none, None: it does not say)."""
    from ..errors import ConfigError
    from ..sizing.decisions import refuse_sample_task, sample_sized_by

    refused = refuse_sample_task(task_bytes(sample), int(sample.header["dim"]),
                                 _memory_of(nodes, here), local=here is not None,
                                 can_start=can_start,
                                 sized_by=sample_sized_by(*sample_size(sample)))  # fmt: skip
    if refused:
        raise ConfigError(refused)


def free_memory() -> dict[str, float]:
    """Each node's Ray memory not held now (node id -> bytes; {} where Ray does not say: its
    per-node figures are not a public API)."""
    try:
        from ray._private.state import state

        return {node: res.get("memory", 0.0) for node, res in state.available_resources_per_node().items()}
    except Exception:  # not this Ray's API: nothing to say
        return {}


def held_memory(
    each: int,
    free: Mapping[str, float],
    here: str | None,
    tasks: str = "the sample's per-layer tasks",
) -> tuple[int, str] | None:
    """(the Ray memory each task asks for, the line saying so) where no node the ``tasks`` of
    ``each`` bytes at their peak may run on (``here``, or any node in ``free``: those with a
    CPU) has ``each`` free now (``free``: node id -> bytes); None where one has, or where Ray
    does not say. What holds it is other actors: another job's, which may live for ever
    (the job's own reducers are stopped, and Ray has their memory back, before the stage
    starts: :meth:`~embgeom_ray.distributed.reducers.PartitionedStatistics.close` in
    :func:`~embgeom_ray.runs.finish.finish_run`): tasks asking for it could wait for ever,
    the job hung. They ask instead for the most one such node has free (0: none, a CPU
    each) and run fewer at once. The one rule of the
    sample's tasks (:func:`placement`) and of the sampled stage's
    (:func:`~embgeom_ray.distributed.sampled_stage.task_memory_cap`)."""
    from ..sizing.units import gib

    room = [b for node, b in free.items() if here is None or node == here]
    if not room or max(room) >= each:
        return None
    most = int(max(room))
    where = "the job's own node" if here else "a node with a CPU"
    return most, (f"{tasks} need ≈ {gib(each)} each at their peak; {where} has at most "
                  f"{gib(most)} of its Ray memory free now (other actors, such as another "
                  "job's, hold the rest): they ask Ray for that much, and run fewer at once "
                  "rather than wait for it")  # fmt: skip


def note_no_node(each: int, offers: Sequence[int], said: bool) -> str | None:
    """The line saying that the tasks (``each`` bytes, in object storage) wait for a node the
    autoscaler starts, where no live node has that much Ray memory (``offers``); None where
    one has. ``said``: the autoscaler said it may start one (else, on a cluster without one,
    they would wait for ever, which nothing here can tell)."""
    from ..sizing.units import gib

    if each <= max(offers, default=0):
        return None
    unsure = "" if said else (" (on a cluster without one, for ever: stop the job and lower "
                              "--sample-size and --sample-type-size)")  # fmt: skip
    return (f"the sample's per-layer tasks ask Ray for {gib(each)} each and no node now has "
            f"that much Ray memory (the largest {gib(max(offers, default=0))}): they wait for "
            f"a node the autoscaler starts{unsure}")  # fmt: skip


def placement(sample: Any) -> dict[str, Any]:
    """Ray options of the tasks that read ``sample``: their memory (:func:`task_bytes`, so that
    Ray runs no more of them at once on a node than its memory holds; :func:`check_fits`
    first; none on this node where it offers Ray none,
    :func:`~embgeom_ray.sizing.decisions.sample_task_memory`, and less where no node they
    may run on has it free now, :func:`held_memory`); anywhere when it is not read
    from local files (object storage); else on this node, which sees them (other nodes may
    not: the driver's own disk), asking for no CPU where this node offers Ray none (a head
    started with ``--num-cpus 0``: the task still runs there, on the CPUs Ray was told to
    keep)."""
    from .. import progress
    from ..sizing.decisions import sample_task_memory
    from .cluster import read_autoscaler_groups, started_private_local

    nodes, each = ray.nodes(), task_bytes(sample)
    local = _reads_local_files(sample)
    node = ray.get_runtime_context().get_node_id() if local else None
    # the node types the autoscaler may start, where any node may run them (none can come to
    # the private local Ray; None: the autoscaler, if any, does not say)
    groups = () if local or started_private_local() else read_autoscaler_groups()
    can_start = (None if groups is None
                 else [g.memory for g in groups if g.max_count != 0 and g.cpus >= 1])  # fmt: skip
    check_fits(sample, nodes, node, can_start)
    offers = _memory_of(nodes, node)
    memory = sample_task_memory(each, local, max(offers, default=0))
    said = note_no_node(each, offers, can_start is not None) if memory and not local else None
    if memory and said is None:
        free = free_memory()
        if node is None:  # any node with a CPU may run them
            cpus = memory_with_cpu(nodes)
            free = {k: v for k, v in free.items() if k in cpus}
        held = held_memory(each, free, node)
        if held:  # asked in full, they could wait for ever for other jobs' actors
            memory = {"memory": held[0]} if held[0] > 0 else {}
            said = held[1]
    if said:
        progress.notice(f"warning: {said}")
    if not local:
        return memory
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = [n for n in nodes if n.get("NodeID") == node and n.get("Alive")]
    cpus = {} if here and here[0]["Resources"].get("CPU", 0) >= 1 else {"num_cpus": 0}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False), **cpus, **memory}


def submit_inputs(
    source: Any, layer: int, clip_dims: list[int], where: dict[str, Any] | None = None
) -> list[ray.ObjectRef]:
    """Object refs of ``layer``'s (note, vectors, token ids, type vectors, content keys),
    computed by a task from ``source`` (the sample's object ref), placed by ``where``
    (:func:`placement`)."""
    return list(_layer_inputs.options(**(where or {})).remote(source, layer, clip_dims))


@ray.remote
def select_k_of(
    vectors: np.ndarray,
    groups: np.ndarray | None,
    shares: tuple[int, int],
    options: dict[str, Any],
    memory_cap: int | None = None,
) -> Any:
    """One layer's :func:`~embgeom_ray.distributed.kmeans.submit_layers_on_ray` (its
    one-task fit or its distributed one, as the driver would start it), from a task: the
    layer's points need not pass through the driver (``memory_cap``: the most Ray memory its
    task asks for, :func:`~embgeom_ray.distributed.sampled_stage.task_memory_cap`)."""
    from .kmeans import submit_layers_on_ray

    ref = submit_layers_on_ray(
        {0: vectors}, groups={0: groups}, shares=shares, memory_cap=memory_cap, **options
    )[0]
    return ray.get(ref)


def _piece_rows(dim: int) -> int:
    """Rows of one piece: :data:`~embgeom_ray.sizing.formulas.SAMPLE_PIECE_BYTES` of rows of a
    float32 vector of ``dim`` and six int64, a token and a sample name."""
    return max(1, SAMPLE_PIECE_BYTES // (4 * dim + 96))


def _pieces_at_most(header: Mapping[str, Any], rows: int) -> int:
    """How many pieces of ``rows`` rows one layer's rows make at most (within each sample)."""
    return max(1, sum(math.ceil(n / rows) for n in header_entries(header)))


def _layer_pieces(
    sample: SampleLayers,
    layer: int,
    id_to_token: Callable[[Sequence[int]], Sequence[str]] | None,
    labels: np.ndarray | None,
    rows: int,
    pieces: int,
) -> list[Any]:
    """[``layer``'s one-layer header, then its rows of ``samples.parquet`` in ``pieces``
    tables of at most ``rows`` rows within each run of (layer, sample) (copies, so that each
    travels alone; None past the last)]."""
    from ..run_dir import ROW_GROUP_KEYS, row_runs, sample_layer_table

    one = sample.layer(layer)
    header = one.header()
    table = sample_layer_table(one, id_to_token, labels)
    del one
    cut = [
        (start + i, min(rows, length - i))
        for start, length in row_runs(table, ROW_GROUP_KEYS["samples"])
        for i in range(0, max(length, 1), rows)
    ]
    if len(cut) > pieces:
        raise ValueError(f"layer {layer}: {len(cut)} pieces of rows, more than the {pieces} planned")
    out = [table.slice(a, n).take(np.arange(n)) for a, n in cut]
    return [header, *out, *([None] * (pieces - len(out)))]


def table_pieces_on_ray(
    sample: SampleLayers,
    id_to_token: Callable[[Sequence[int]], Sequence[str]] | None,
    clusters: Mapping[int, np.ndarray],
    address: str | None = None,
    ahead: int = 2,
    where: dict[str, Any] | None = None,
) -> Iterator[tuple[dict[str, Any], pa.Table]]:
    """The rows of ``samples.parquet`` as :meth:`~embgeom_ray.run_dir.RunDir.write_samples`
    takes them (each with its layer's header), built by one task per layer from the sample
    (``clusters``: layer -> the uniform rows' K-means labels) and fetched one piece at a time;
    at most ``ahead`` layers' tasks are running or waiting to be fetched. Joins the cluster
    of ``address`` (:func:`~embgeom_ray.distributed.cluster.connect`) when first iterated.
    ``where``: the tasks' Ray options, :func:`placement`'s as the sampled stage's tasks
    that read the sample had them (decided, and any warning said, once); None: decided
    here."""
    from .cluster import connect

    connect(address)
    source, names = ray.put(sample), ray.put(id_to_token)
    rows = _piece_rows(int(sample.header["dim"]))
    pieces = _pieces_at_most(sample.header, rows)
    where = placement(sample) if where is None else where
    task = ray.remote(_layer_pieces).options(num_returns=1 + pieces, **where)
    layers = list(sample.layers)
    submitted: list[list[ray.ObjectRef]] = []
    for i in range(len(layers)):
        while len(submitted) < min(len(layers) - i, ahead):
            nxt = layers[i + len(submitted)]
            submitted.append(task.remote(source, nxt, names, clusters.get(nxt), rows, pieces))
        refs = submitted.pop(0)
        header = ray.get(refs[0])
        for j in range(1, len(refs)):
            piece = ray.get(refs[j])
            refs[j] = None  # the piece leaves the object store once written
            if piece is not None:
                yield header, piece
            del piece
