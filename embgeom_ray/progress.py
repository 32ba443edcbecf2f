"""Where a job's progress goes: bars and notices on stderr, or a caller's own sink.

The commands print what they were asked for on stdout (their ``echo``) and their progress on
stderr: tqdm bars of the shards and of the sampled stage, and *notices* between them (which
Ray the job runs on, a change of the checkpoint interval, the pool growing or shrinking, a
reducer's checkpoint not used). The Python API (:mod:`embgeom_ray.api`) routes the notices to
its ``echo`` instead, and draws no bars, when ``echo`` is not ``print`` (:func:`routed`):
``echo=None`` keeps a job silent, Ray's own lines and its workers' output included; a logger's
method gets every line.

The route is the process's (a module global, not a context variable): the job's threads (its
reducers' and the sampled stage's) notice through it too.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tqdm.auto import tqdm
from tqdm.autonotebook import tqdm as _chosen  # loaded by tqdm.auto: its console or widget bar
from tqdm.std import tqdm as _console

#: the sinks :func:`routed` installed, innermost last (empty: stderr and bars)
_routes: list[Callable[[str], None] | None] = []


@contextmanager
def routed(sink: Callable[[str], None] | None) -> Iterator[None]:
    """Within: notices go to ``sink`` (None: nowhere), no bar is drawn, and a Ray this
    process starts or joins logs nothing here."""
    _routes.append(sink)
    try:
        yield
    finally:
        _routes.pop()


def is_routed() -> bool:
    """Whether a caller took the progress (:func:`routed`): no bars, no lines on stderr."""
    return bool(_routes)


def notice(line: str) -> None:
    """One line of progress between the bars: to stderr above any bar, or to the route."""
    if _routes:
        sink = _routes[-1]
        if sink is not None:
            sink(line)
        return
    with tqdm.external_write_mode(file=sys.stderr):
        print(line, file=sys.stderr, flush=True)


#: seconds between two of a bar's lines where stderr is not a terminal (a log file)
LOG_INTERVAL_S = 30.0
#: whether the bars are a notebook's widgets (tqdm.auto's choice in a Jupyter kernel): drawn
#: in place, though the kernel's stderr is no terminal
WIDGETS = _chosen is not _console


class _Lines:
    """A bar's stream where stderr is not a terminal: each redraw of the bar becomes a line of
    its own (tqdm redraws in place with ``\r``, which a log file or a log viewer keeps as one
    ever longer line, with the notices between bars glued to it); the clearing writes, blank
    once the ``\r`` are gone, are dropped."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


def bar(**options: Any) -> tqdm:
    """A progress bar on stderr (``tqdm(**options)``), disabled where the progress is routed:
    on a terminal, redrawn in place at most every 2 s; elsewhere (a log: ``ray job submit``, a
    scheduler's job, a redirect), a line at most every :data:`LOG_INTERVAL_S` and at the end.
    A notebook's widget (:data:`WIDGETS`) is drawn in place, as on a terminal."""
    if WIDGETS or sys.stderr.isatty():
        return tqdm(file=sys.stderr, dynamic_ncols=True, mininterval=2.0, disable=is_routed(), **options)
    # miniters=1: a line at an update at least LOG_INTERVAL_S after the last (mininterval).
    # Left to itself tqdm adapts miniters, and its monitor thread then redraws a bar not drawn
    # for maxinterval (10 s by default) outside that rule, without recording when: lines
    # came 10 and 20 s apart
    return tqdm(file=_Lines(sys.stderr), mininterval=LOG_INTERVAL_S, miniters=1,
                disable=is_routed(), **options)  # fmt: skip
