"""Work of the driver handed to Ray tasks on chosen nodes: on the driver's own node (e.g. the
report's figures, :func:`on_this_node`), and a check run on every other node
(:func:`nodes_not_seeing`: which nodes do not see a local run directory).

The driver's tasks hold one CPU each and are pinned to the node the driver runs on
(``NodeAffinitySchedulingStrategy``, not soft): what they read and write is where the driver
reads and writes (a local output directory is on that node's disk). A node that offers Ray no
CPU (a head started with ``--num-cpus 0``) gets no such task: the driver does the work itself,
as it does without Ray. A task that fails there (its worker lost, or an error) is run again
here, in the driver, so nothing depends on it. The checks hold no CPU, one pinned to each
node: they read one small file.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

#: how long a node's check of a local directory may take before the node counts as not
#: seeing it (a worker process to start there, and one small file to read)
PROBE_TIMEOUT_S = 60.0


def on_this_node(fn: Callable[..., T]) -> Callable[..., Callable[[], T]] | None:
    """``fn`` as Ray tasks on this driver's node: call the result with ``fn``'s arguments to
    start one, and call what it returns to wait for ``fn``'s value (computed here instead if
    the task fails: its worker lost, or an error in ``fn``). None when Ray is not initialised (not even imported: this
    does not import it) or this node has no CPU for tasks."""
    if "ray" not in sys.modules or not sys.modules["ray"].is_initialized():
        return None
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    here = [n for n in ray.nodes() if n.get("NodeID") == node and n.get("Alive")]
    cpus = here[0]["Resources"].get("CPU", 0) if here else 0
    if cpus < 1:
        return None
    task = ray.remote(fn).options(
        num_cpus=1, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
    )

    def start(*args: Any, **kwargs: Any) -> Callable[[], T]:
        ref = task.remote(*args, **kwargs)

        def wait() -> T:
            try:
                return ray.get(ref)
            except ray.exceptions.RayError:
                # the worker was lost, or fn failed there: do it here (a real error of fn's
                # then reaches the caller as itself, not wrapped in Ray's RayTaskError)
                return fn(*args, **kwargs)

        return wait

    return start


def nodes_not_seeing(
    markers: Sequence[dict[str, str]], nodes: Sequence[str], timeout_s: float = PROBE_TIMEOUT_S
) -> dict[str, str]:
    """Per node of ``nodes`` that does not see one of the local files of ``markers`` as this
    driver does, why, in a few words (:func:`~embgeom_ray.shared_out.unseen`, of the first
    marker it does not see); the nodes that see them all are left out, and so is the
    driver's own node. One task of no CPU pinned to each node (``NodeAffinitySchedulingStrategy``,
    not soft), all at once: a node whose task fails, or does not answer within ``timeout_s``
    seconds, counts as not seeing them."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ..shared_out import unseen_any

    here = ray.get_runtime_context().get_node_id()
    probe = ray.remote(unseen_any)
    refs = {
        node: probe.options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
        ).remote(list(markers))
        for node in dict.fromkeys(nodes)
        if node != here
    }
    if not refs:
        return {}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    answered = set(ready)
    out: dict[str, str] = {}
    for node, ref in refs.items():
        if ref not in answered:
            ray.cancel(ref, force=True)
            out[node] = f"its check did not answer within {timeout_s:g} s"
            continue
        try:
            why = ray.get(ref)
        except ray.exceptions.RayError as exc:
            why = f"its check failed: {type(exc).__name__}"
        if why is not None:
            out[node] = why
    return out
