"""The extractor pool on a cluster whose nodes come and go (an autoscaler's, spot instances):
how many extractors the nodes hold now, how large the pool is worth making, how many to start
now and what to ask an autoscaler for.

Pure functions of Ray's view of the cluster (:class:`~.nodes.Cluster`) and of what one
extractor asks for; the scheduler (:mod:`embgeom_ray.distributed.actor_pool`) reads the
cluster every few seconds, calls them and does what they say. docs/sizing.md states the rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from .nodes import Cluster


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


def pool_target(*, running: int, starting: int, queued: int, num_workers: int | None) -> int:
    """The pool worth having now: the extractors it has (``running``: ready or still
    ``starting``), and one more for each shard waiting in the queue that no extractor still
    starting will take; at most ``--num-workers`` (None: as many as the shards want)."""
    want = running + max(0, queued - starting)
    return want if num_workers is None else min(num_workers, want)


def extractors_to_add(
    held: int, *, running: int, starting: int, queued: int, num_workers: int | None
) -> int:
    """Extractors to start now: the pool's target (:func:`pool_target`) as far as the nodes
    hold it (``held``: the sum of :func:`extractors_held`), less those it has. And one when it
    has none and shards wait, even where no node holds it yet: it waits for a node (on an
    autoscaling cluster it is the demand that brings one), and the job never stalls with no
    extractor asked for."""
    target = pool_target(running=running, starting=starting, queued=queued, num_workers=num_workers)
    add = max(0, min(held, target) - running)
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
