"""One ``reanalyze`` invocation at a time per store: ``STORE/reanalyze.lock``.

Two invocations on one store at once (cron starting tonight's while last night's still runs)
would analyse the same model into the same run directory at the same time, and each rewrites
``runs.parquet`` from its own view of it: one crashed on the other's checkpoint files, and the
index ended up saying ``failed`` for a run that was complete. So an invocation holds an
exclusive lock on the store while it runs, and a second one ends at once, runs nothing and
writes nothing, with one line naming the holder and exit status :data:`~.lock_holder.BUSY_EXIT` (75,
``EX_TEMPFAIL`` of ``sysexits.h``: try again later).

The lock is an advisory ``flock`` (:class:`filelock.FileLock`) on ``STORE/reanalyze.lock``,
held by the process itself: it goes away with the process however it ends (SIGKILL and a
crashed node included), so a killed invocation never leaves the store locked. Who holds it
(host, pid, start time, command line) is written beside it, in ``STORE/reanalyze.lock.json``,
for the second invocation's message, and removed before the lock is released (a killed
holder's stays until the next one writes its own). ``flock`` works on local disks and on NFS
(v4 and v3 with lockd). It needs no pid: containers of one host that see the store through
the host's mount are kept apart by its kernel. An NFSv4 server tells its clients apart by a
string made of their hostname, though: machines cloned with one hostname need each their own
identifier (``nfs.nfs4_unique_id``), or the server takes their locks for one client's.

On S3 (``s3://``) and GCS (``gs://``) the lock is ``reanalyze.lock.json`` itself, written only
where absent (a conditional write: S3's ``If-None-Match``, GCS's ``ifGenerationMatch=0``),
renewed while held and taken over once stale (:mod:`.object_lock`). Other object stores
(``abfs://``, …) get no lock, and the invocation says so in one line (:func:`unguarded`):
there the scheduler must run one invocation at a time (the KubeRay CronJob's
``concurrencyPolicy: Forbid``); with ``--submit``, the runs themselves are still never
submitted twice (stable submission ids).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from urllib.parse import urlsplit

from .. import progress
from ..io_utils import atomic_write_json, is_local, join, local_path
from .lock_holder import HOLDER, busy, describe, this_holder
from .object_lock import object_lock, supported

#: the lock file in the store (who holds it: :data:`~.lock_holder.HOLDER`)
LOCK = "reanalyze.lock"


def _holder(store: str) -> str:
    """Who holds the lock, in words, from ``STORE/reanalyze.lock.json`` ("" if unknown)."""
    try:
        with open(os.path.join(store, HOLDER), encoding="utf-8") as f:
            return describe(json.load(f))
    except (OSError, ValueError):
        return ""


def unguarded(store: str) -> str:
    """The warning of an invocation on an object store that gets no lock (neither S3 nor GCS):
    said, as two invocations on it at once would write one run directory and the index
    together."""
    return (f"warning: the store {store} gets no lock ({urlsplit(store).scheme}:// has none: "
            "only s3:// and gs:// do): another reanalyze on it at once is not kept off and "
            "would write the same runs; the scheduler must not overlap invocations")  # fmt: skip


@contextlib.contextmanager
def store_lock(store: str) -> Iterator[None]:
    """Hold ``STORE/reanalyze.lock`` while the block runs; :class:`~.lock_holder.StoreBusyError` at once if
    another process holds it. On S3 and GCS, :func:`~.object_lock.object_lock`; a store on
    another object store is not locked, and a warning says so (:func:`unguarded`)."""
    if not is_local(store):
        if not supported(store):
            progress.notice(unguarded(store))
        with object_lock(store) if supported(store) else contextlib.nullcontext():
            yield
        return
    from filelock import FileLock, Timeout

    path = local_path(store)
    os.makedirs(path, exist_ok=True)
    lock = FileLock(os.path.join(path, LOCK), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise busy(store, _holder(path)) from None
    try:
        atomic_write_json(join(path, HOLDER), this_holder())
        yield
    finally:
        # who held it goes first: left behind, it named a finished invocation as the holder
        with contextlib.suppress(OSError):
            os.remove(os.path.join(path, HOLDER))
        lock.release()
