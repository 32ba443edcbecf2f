"""Forward lanes: a CPU extractor runs several batches through the model at once, one thread
each, and folds them one at a time in batch order.

On a CPU the fold and the forward share the same cores, so what a batch costs is the CPU time
of both. Neither uses two cores well from one call: MiniLM's forward on two intra-op threads
ran at ×1.60 of one thread, and its fold (many short passes over a batch's rows) at
×1.03–1.06. With k lanes of one intra-op thread each, every core runs a whole forward or a whole
fold at one thread's efficiency, and while one lane folds the others run the model.
Measured on a 2-core VM (MiniLM over 100k tokens of English prose, ``python -m
bench.extraction``; docs/benchmarks.md): the extractor in two lanes ran at 0.84 of the fastest
bare forward, in one lane of two threads at 0.76.

Nothing computed depends on the lanes: batches are cut as in one lane, and the fold takes
them strictly in their order (:func:`in_lanes`), so the statistics, the sample and the counts
are those of one single-threaded lane to the bit. Against one lane on several threads they
differ only where the model's float32 forward rounds differently with the thread count, as
it does between extractors of different CPU counts (on an AVX-512 CPU, MiniLM's statistics
over the demo prose in windows of 128 tokens were equal either way, while in windows of 48
its layer 6 moved by up to 1.2e-6 relative, 1 thread against 2).

The lanes of an extractor: :func:`~embgeom_ray.sizing.lanes_for`.

Memory: each lane holds one batch's hidden states and activations while it waits for its turn
to fold, so a CPU extractor holds k batches of them (the fold's scratch once):
:func:`~embgeom_ray.sizing.formulas.batch_bytes_per_token`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch

Item = TypeVar("Item")
Result = TypeVar("Result")


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` within the block (every thread of the process:
    lanes started inside take it), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def in_lanes(
    items: Iterable[Item],
    work: Callable[[Item], Result],
    finish: Callable[[Item, Result], None],
    lanes: int,
) -> None:
    """``finish(item, work(item))`` for every item, ``work`` in ``lanes`` threads at once and
    ``finish`` one at a time in the items' order.

    Each lane takes the next item (the iterator is read under a lock, so it is read in order
    by one thread at a time), runs ``work`` on it, waits until every earlier item is finished,
    then finishes its own. At most ``lanes`` items are taken and not yet finished. While the
    lanes run, the process's torch intra-op threads are shared out among them (one each on
    as many CPUs as lanes: :func:`intra_op_threads`), and restored after. The first
    exception raised in a lane (by the iterator, ``work`` or ``finish``) stops every lane
    once its current step ends and is raised here, after all have stopped: what was
    finished is a prefix of the items, without the failed one (earlier items still in
    ``work`` are not finished either; a caller discards what ``finish`` built). Every lane
    runs in ``torch.inference_mode``. ``lanes`` 1 runs in the calling thread.
    """
    if lanes <= 1:
        for item in items:
            finish(item, work(item))
        return
    source = iter(items)
    take = threading.Lock()
    turn = threading.Condition()
    state = {"taken": 0, "finished": 0}
    errors: list[BaseException] = []

    def lane() -> None:
        with torch.inference_mode():
            try:
                while not errors:
                    with take:
                        item = next(source, _END)
                        index = state["taken"]
                        state["taken"] += 1
                    if item is _END:
                        return
                    result = work(item)  # type: ignore[arg-type]
                    with turn:
                        turn.wait_for(lambda i=index: state["finished"] == i or bool(errors))
                    if errors:
                        return
                    finish(item, result)  # type: ignore[arg-type]
                    del result
                    with turn:
                        state["finished"] += 1
                        turn.notify_all()
            except BaseException as exc:  # raised again in the caller's thread
                with turn:
                    errors.append(exc)
                    turn.notify_all()

    threads = [threading.Thread(target=lane, name=f"lane-{i}") for i in range(lanes)]
    with intra_op_threads(max(1, torch.get_num_threads() // lanes)):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]


_END = object()
