"""Work of the driver handed to Ray tasks on the driver's own node (e.g. the report's figures).

The tasks hold one CPU each and are pinned to the node the driver runs on
(``NodeAffinitySchedulingStrategy``, not soft): what they read and write is where the driver
reads and writes (a local output directory is on that node's disk). A node that offers Ray no
CPU (a head started with ``--num-cpus 0``) gets no such task: the driver does the work itself,
as it does without Ray. A task that fails there (its worker lost, or an error) is run again
here, in the driver, so nothing depends on it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


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
