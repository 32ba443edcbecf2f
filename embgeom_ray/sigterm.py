"""SIGTERM in a command's process: ``SystemExit(15)``, as Ray's own handler raises it, and noted.

``ray.init`` installs a SIGTERM handler that raises ``SystemExit(15)`` (``sys.exit(signum)``),
which :func:`embgeom_ray.cli.exit_status` turns into one line and exit status 143. But a signal
that lands while the driver waits in ``ray.get`` or ``ray.wait`` (most of a job's time: the
extraction, the reduce, the sampled stage) runs the handler inside Ray's native wait, whose
signal check (``PyErr_CheckSignals``) takes the ``SystemExit`` and raises another in its place:
``SystemExit(1)``, its ``ray_terminate_msg`` ``"SystemExit is raised (sys.exit is called).
Exit code: 15."`` (Ray 2.60's ``_raylet.check_signals`` and ``check_status``). The exit code no
longer tells a SIGTERM from a bug, so :func:`on_sigterm` notes that the signal came
(:func:`received`) before raising; the commands install it (:func:`installed`), and
:func:`embgeom_ray.distributed.cluster.connect` puts it back over the one ``ray.init`` installs.

Put back by Python's ``signal.signal``, it also replaces the failure signal handler Ray's core
worker installs in the driver for SIGTERM, which printed a native stack (``*** SIGTERM
received at time=…``) before the command's line; Ray's handlers of crashes (SIGSEGV, SIGABRT,
…) are left as they are. This module imports nothing of the package: every layer may use it.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

_received = False


def on_sigterm(signum: int, frame: FrameType | None) -> None:
    """The handler: note the signal, then ``sys.exit(signum)`` as Ray's does (``atexit`` then
    shuts Ray down). Once only: a SIGTERM that comes again while the first unwinds the command
    (its checkpoints' cleanup, the one line) is ignored, so that it cannot end the process
    through Python's own exit halfway (SIGKILL still ends a process that does not go)."""
    global _received
    if _received:
        return
    _received = True
    sys.exit(signum)


def received() -> bool:
    """Whether SIGTERM came since :func:`installed` was entered (whatever exception it became)."""
    return _received


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Within: :func:`on_sigterm` handles SIGTERM (in the main thread; elsewhere nothing
    changes), :func:`received` starting False; on leaving, the handler that was there before
    is put back."""
    global _received
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received = False
    before: Any = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        # None: a handler not installed from Python, which cannot be put back from here
        signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)
