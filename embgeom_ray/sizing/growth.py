"""The extractor pool on a cluster whose nodes come and go (an autoscaler's, spot instances):
how many extractors the nodes hold now, how large the pool is worth making, how many to start
now and what to ask an autoscaler for.

Pure functions of Ray's view of the cluster (:class:`~.nodes.Cluster`) and of what one
extractor asks for; the scheduler (:mod:`embgeom_ray.distributed.actor_pool`) reads the
cluster every few seconds, calls them and does what they say. docs/sizing.md states the rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .nodes import Cluster, NodeGroup


@dataclass(frozen=True)
class Extractor:
    """What one extractor actor asks Ray for: CPUs, GPUs and bytes of memory (0: none)."""

    cpus: int
    gpus: float = 0.0
    memory: int = 0

    def bundle(self) -> dict[str, float]:
        """These resources as one bundle of an autoscaler's request (Ray's
        ``request_resources``), named as Ray names them."""
        out = {"CPU": float(self.cpus)}
        if self.gpus:
            out["GPU"] = float(self.gpus)
        if self.memory:
            out["memory"] = float(self.memory)
        return out

    def describe(self) -> str:
        """What it asks for, in words: ``1 GPU, 1 CPU and 2.1 GiB``."""
        from .units import gib

        parts = [f"{self.gpus:g} GPU{'s' if self.gpus != 1 else ''}"] if self.gpus else []
        parts.append(f"{self.cpus} CPU{'s' if self.cpus != 1 else ''}")
        if self.memory:
            parts.append(gib(self.memory))
        return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]


def extractors_held(cluster: Cluster, each: Extractor, head_reserve: int = 0) -> dict[str, int]:
    """How many extractors of ``each`` every live node holds, by node id: the least of its
    CPUs, its GPUs and its memory (Ray's ``memory`` resource; on the head less
    ``head_reserve``, the job's own process) divided by what one asks for of each. A resource
    the extractor does not ask for limits nothing."""
    held = {}
    for node in cluster.nodes:
        room = [node.cpus // each.cpus if each.cpus else None]
        room.append(int(node.gpus // each.gpus) if each.gpus else None)
        offer = max(0, node.memory - (head_reserve if node.head else 0))
        room.append(offer // each.memory if each.memory else None)
        limits = [r for r in room if r is not None]
        held[node.node_id] = max(0, min(limits)) if limits else 0
    return held


def extractors_possible(groups: Sequence[NodeGroup], each: Extractor) -> int | None:
    """The most extractors of ``each`` the autoscaler's node groups hold with every group at
    its most nodes: the sum over groups of max_count × what one of its nodes holds (a resource
    a group does not state limits nothing). None where nothing tells: no group shown, a group
    that holds one without a limit on its nodes, or no group that holds one (its resources
    not stated as the extractor asks for them)."""
    total = 0
    for group in groups:
        room = [group.cpus // each.cpus if each.cpus else None]
        room.append(int(group.gpus // each.gpus) if each.gpus else None)
        room.append(group.memory // each.memory if each.memory and group.memory else None)
        limits = [r for r in room if r is not None]
        per_node = min(limits) if limits else 0
        if per_node <= 0 or group.max_count == 0:
            continue
        if group.max_count is None:
            return None
        total += per_node * group.max_count
    return total or None


def pool_ceiling(num_workers: int | None, possible: int | None) -> int | None:
    """The most extractors the pool grows to: ``--num-workers``, and no more than the
    autoscaler's node groups hold (``possible``: :func:`extractors_possible`); None: as many
    as the shards want."""
    bounds = [n for n in (num_workers, possible) if n is not None]
    return min(bounds) if bounds else None


def pool_target(*, running: int, starting: int, queued: int, num_workers: int | None) -> int:
    """The pool worth having now: the extractors it has (``running``: ready or still
    ``starting``), and one more for each shard waiting in the queue that no extractor still
    starting will take; at most ``num_workers``, the pool's ceiling (:func:`pool_ceiling`;
    None: as many as the shards want)."""
    want = running + max(0, queued - starting)
    return want if num_workers is None else min(num_workers, want)


def extractors_to_add(
    held: int,
    *,
    running: int,
    starting: int,
    queued: int,
    num_workers: int | None,
    demand: bool = False,
) -> int:
    """Extractors to start now: the pool's target (:func:`pool_target`) as far as the nodes
    hold it (``held``: the sum of :func:`extractors_held`), less those it has. And one when it
    has none and shards wait, even where no node holds it yet: it waits for a node (on an
    autoscaling cluster it is the demand that brings one), and the job never stalls with no
    extractor asked for.

    ``demand``: the autoscaler cannot be asked for room (its request failed), so a pool of a
    known ceiling (``num_workers``) starts its whole target at once, the extractors no node
    holds waiting for nodes: their pending resources are the autoscaler's demand."""
    target = pool_target(running=running, starting=starting, queued=queued, num_workers=num_workers)
    add = max(0, min(held, target) - running)
    if demand and num_workers is not None:
        add = max(0, target - running)
    if running == 0 and queued > 0:
        add = max(add, 1)
    return add


def autoscaler_request(
    each: Extractor, target: int, held: int, asked: int | None
) -> list[dict[str, float]] | None:
    """What to ask an autoscaler for now (None: nothing new to ask): one bundle of ``each``'s
    resources for every extractor of the pool's ``target``, once the nodes do not hold it
    (``held`` < ``target``); after that every change of the target (``asked``: the bundles
    asked for last, None: never), so that the request shrinks as the shards run out. A
    request is the size the cluster should have room for, not an addition to it; the
    scheduler clears it (``[]``) when the extraction ends."""
    if asked is None and target <= held:
        return None  # the nodes hold the pool: nothing to ask of anyone
    if target == asked:
        return None
    return [each.bundle()] * target
