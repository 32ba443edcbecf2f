"""Who holds a store's ``reanalyze`` lock, and what a second invocation is told.

Shared by the lock on a local or NFS store (:mod:`.store_lock`, an ``flock``) and the one on
S3 (:mod:`.object_lock`, a conditional write): both keep ``STORE/reanalyze.lock.json`` saying
who holds the store (host, pid, start time, command line), and both end a second invocation
with :class:`StoreBusyError`, one line naming the holder and exit status :data:`BUSY_EXIT`
(75, ``EX_TEMPFAIL`` of ``sysexits.h``: try again later).
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

from ..errors import UserError
from ..run_dir import now

#: the file, in the store, that says who holds the lock (on S3: the lock itself)
HOLDER = "reanalyze.lock.json"
#: the exit status of an invocation that found the store locked (``EX_TEMPFAIL``)
BUSY_EXIT = 75


class StoreBusyError(UserError):
    """Another invocation holds the store: this one ran nothing and wrote nothing."""

    exit_code = BUSY_EXIT


def busy(store: str, holder: str) -> StoreBusyError:
    """The error of an invocation that found ``store`` held (``holder``: who, in words)."""
    return StoreBusyError(
        f"another reanalyze is running on the store {store}{holder}: this one ran nothing "
        f"(exit status {BUSY_EXIT}); the next one does what that one leaves"
    )


def this_holder() -> dict[str, Any]:
    """What the holder file says of this process: its host, pid, start time and command."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "started_at": now(),
            "argv": sys.argv}  # fmt: skip


def describe(holder: Any) -> str:
    """The holder file's contents in words, `` (pid P on HOST, since T)`` ("" if unknown)."""
    try:
        return f" (pid {holder['pid']} on {holder['host']}, since {holder['started_at']})"
    except (KeyError, TypeError):
        return ""
