"""The cluster as the sizing sees it (Ray's resources, read by
:func:`embgeom_ray.distributed.cluster.read_cluster`), and placing actors of a size on it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .units import gib

#: the memory of one GPU by Ray's accelerator type (the node's ``accelerator_type:…``
#: resource), the smallest model sold under the name (bytes)
GPU_MEMORY_BY_TYPE: dict[str, int] = {
    "V100": 16 * 10**9, "P100": 16 * 10**9, "T4": 16 * 10**9, "P4": 8 * 10**9,
    "K80": 12 * 10**9, "A10G": 24 * 10**9, "L4": 24 * 10**9, "L40S": 48 * 10**9,
    "A100": 40 * 10**9, "A100-40G": 40 * 10**9, "A100-80G": 80 * 10**9,
    "H100": 80 * 10**9, "H200": 141 * 10**9, "H20": 96 * 10**9, "B200": 180 * 10**9,
}  # fmt: skip

@dataclass(frozen=True)
class Node:
    """One live node as Ray reports it."""

    node_id: str
    #: Ray's ``memory`` resource: what actors and tasks may reserve
    memory: int
    cpus: int = 0
    gpus: int = 0
    head: bool = False
    #: Ray's accelerator type of its GPUs (``accelerator_type:H100`` → ``H100``)
    gpu_type: str | None = None
    #: Ray's ``object_store_memory``: its shared-memory object store (0: not known)
    object_store: int = 0

    @property
    def gpu_memory(self) -> int | None:
        """One GPU's memory, from :data:`GPU_MEMORY_BY_TYPE` (None: unknown)."""
        return GPU_MEMORY_BY_TYPE.get(self.gpu_type or "")


@dataclass(frozen=True)
class NodeGroup:
    """A node type the cluster's autoscaler may start, as Ray shows it (the cluster config an
    autoscaler reports to Ray's GCS): one node's resources and the most nodes of the type."""

    name: str
    cpus: int = 0
    gpus: int = 0
    #: bytes of Ray's ``memory`` resource a node has (0: not stated)
    memory: int = 0
    #: the most nodes of the type (None: no limit)
    max_count: int | None = 0


@dataclass(frozen=True)
class Cluster:
    """The live nodes of the cluster (:func:`~embgeom_ray.distributed.cluster.read_cluster`)."""

    nodes: tuple[Node, ...]

    @property
    def cpus(self) -> int:
        return sum(n.cpus for n in self.nodes)

    @property
    def gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    def offers(self, driver: int) -> list[int]:
        """The memory each node offers the job's actors: Ray's ``memory`` resource, on the head
        node less ``driver`` (the job's own process lives there, outside Ray's accounting)."""
        return [max(0, n.memory - (driver if n.head else 0)) for n in self.nodes]

    def describe(self) -> str:
        heads = sum(n.head for n in self.nodes)
        gpu_types = sorted({n.gpu_type for n in self.nodes if n.gpus and n.gpu_type})
        gpus = f", {self.gpus} GPUs" + (f" ({', '.join(gpu_types)})" if gpu_types else "")
        memory = sorted({n.memory for n in self.nodes})
        each = gib(memory[0]) if len(memory) == 1 else f"{gib(memory[0])}–{gib(memory[-1])}"
        return (
            f"{len(self.nodes)} node{'s' if len(self.nodes) != 1 else ''} "
            f"({heads} head), {self.cpus} CPUs{gpus if self.gpus else ''}, Ray memory {each} "
            f"a node"
        )


def fits(count: int, each: int, offers: Sequence[int], taken: Sequence[int] = ()) -> bool:
    """Whether ``count`` actors of ``each`` bytes fit the nodes' ``offers`` (less ``taken``
    there already), each actor on one node."""
    room = [o - (taken[i] if i < len(taken) else 0) for i, o in enumerate(offers)]
    return (each > 0 and sum(max(0, r) // each for r in room) >= count) or count == 0


def place(
    cluster: Cluster,
    offers: Sequence[int],
    count: int,
    each: int,
    taken: Sequence[int] = (),
    *,
    partial: bool = False,
) -> list[str]:
    """The node of each of ``count`` actors of ``each`` bytes: one at a time on the node with
    the most memory left of its offer (less ``taken`` there already; a worker node before the
    head at equal room), so the reduce spreads over the cluster and the head keeps its room
    for the job's own process. ``partial``: as many as fit (else all, or a :class:`ValueError`)."""
    room = [o - (taken[i] if i < len(taken) else 0) for i, o in enumerate(offers)]
    nodes: list[str] = []
    for _ in range(count):
        best = max(range(len(room)), key=lambda i: (room[i], not cluster.nodes[i].head), default=None)
        if best is None or room[best] < each:
            if partial:
                break
            raise ValueError(f"{count} actors of {each:,} bytes do not fit offers {list(offers)}")
        nodes.append(cluster.nodes[best].node_id)
        room[best] -= each
    return nodes


def slot_memory(count: int, hosts: Sequence[int], offers: Sequence[int]) -> int:
    """The most memory each of ``count`` actors may ask for with all of them placed at once,
    node n holding at most ``hosts[n]`` (by its CPUs and GPUs) and ``offers[n]`` bytes: the
    ``count``-th largest of the shares offer_n / j, j = 1..hosts[n] (0 when they do not fit)."""
    shares = sorted(
        (o // j for o, h in zip(offers, hosts, strict=True) for j in range(1, min(h, count) + 1)),
        reverse=True,
    )
    return shares[count - 1] if 0 < count <= len(shares) else 0


def extractors_per_node(cluster: Cluster, cpus: int, gpus: int) -> list[int]:
    """How many extractors of ``cpus`` CPUs and ``gpus`` GPUs each node holds."""
    out = []
    for n in cluster.nodes:
        by_cpu = n.cpus // cpus if cpus else 10**9
        by_gpu = n.gpus // gpus if gpus else 10**9
        out.append(min(by_cpu, by_gpu))
    return out


def placed_memory(
    cluster: Cluster, offers: Sequence[int], count: int, cpus: int, gpus: int, each: int
) -> list[int]:
    """Memory the extractor pool takes on each node, placed greedily in node order (at most
    what each node's CPUs, GPUs and memory hold)."""
    taken = [0] * len(offers)
    left = count
    for i, hold in enumerate(extractors_per_node(cluster, cpus, gpus)):
        k = min(left, hold, offers[i] // each if each else hold)
        taken[i] = k * each
        left -= k
    return taken


def describe_offers(offers: Sequence[int]) -> str:
    """The nodes' memory ``offers`` in words: each distinct offer with how many nodes make it
    (``"2 × 7.5 GiB, 1 × 3.0 GiB"``), largest first."""
    distinct = sorted(set(offers), reverse=True)
    return ", ".join(f"{offers.count(o)} × {gib(o)}" for o in distinct)
