"""Who holds a store's ``reanalyze`` lock, and what a second invocation is told.

Shared by the lock on a local or NFS store (:mod:`.store_lock`, an ``flock``) and the one on
S3 (:mod:`.object_lock`, a conditional write): both keep ``STORE/reanalyze.lock.json`` saying
who holds the store (host, pid, start time, command line), and both end a second invocation
with :class:`StoreBusyError`, one line naming the holder and exit status :data:`BUSY_EXIT`
(75, ``EX_TEMPFAIL`` of ``sysexits.h``: try again later).

A hostname does not say whose pids a holder's pid is among: two containers of one host
started with ``--network host``, pods or containers given one ``--hostname``, or machines
cloned from one image all report the same hostname, and each has its own pids (a PID
namespace, or a kernel). So the holder file also records the PID namespace its pid belongs to
(:func:`pid_space`: on Linux, this boot's ``/proc/sys/kernel/random/boot_id`` and the device
and inode of ``/proc/self/ns/pid``, which namespaces(7) says name a namespace among those
alive), and a holder's pid is taken as one of this process's (:func:`same_pids`) only where
hostname, boot id and namespace all match. Where they cannot be read (macOS, a restricted
``/proc``) or were not recorded (a holder file of a version before them), it is not: a
hostname alone cannot tell two machines of one name apart, so such a holder is never taken
for gone from its pid.
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


#: which boot of which kernel this is (random at each boot; the host's, in a container)
BOOT_ID = "/proc/sys/kernel/random/boot_id"
#: the PID namespace of this process (its device and inode name it: namespaces(7))
PID_NS = "/proc/self/ns/pid"


def pid_space() -> dict[str, str] | None:
    """What names the pids of this process: ``{"boot_id": …, "pid_ns": "DEV:INODE"}``, or
    None where either cannot be read (not Linux, ``/proc`` not mounted or restricted).

    A namespace's inode is unique only among the namespaces alive on one kernel (the init
    namespace's is the same on every Linux host), hence the boot id beside it."""
    try:
        ns = os.stat(PID_NS)
        with open(BOOT_ID, encoding="ascii") as f:
            boot_id = f.read().strip()
    except (OSError, ValueError):
        return None
    if not boot_id:
        return None
    return {"boot_id": boot_id, "pid_ns": f"{ns.st_dev}:{ns.st_ino}"}


def this_holder() -> dict[str, Any]:
    """What the holder file says of this process: its host, pid, start time, command, and
    the PID namespace of its pid (:func:`pid_space`: None where it cannot be read)."""
    space = pid_space() or {}
    return {"host": socket.gethostname(), "pid": os.getpid(), "started_at": now(),
            "argv": sys.argv, "boot_id": space.get("boot_id"),
            "pid_ns": space.get("pid_ns")}  # fmt: skip


def same_pids(holder: Any) -> bool:
    """Whether ``holder``'s pid is among this process's pids (so ``os.kill(pid, 0)`` here
    tells whether it runs): the same hostname, boot id and PID namespace. False where the
    holder recorded no namespace (an older version's file) or this process cannot read its
    own (:func:`pid_space`): the same hostname alone may be another container or machine."""
    if not isinstance(holder, dict) or holder.get("host") != socket.gethostname():
        return False
    space = pid_space()
    return space is not None and all(holder.get(k) == v for k, v in space.items())


def describe(holder: Any) -> str:
    """The holder file's contents in words, `` (pid P on HOST, since T)`` ("" if unknown).

    A holder on this hostname whose pid is not among this process's (:func:`same_pids`) is
    said to be so, lest its pid, not found here by ``ps``, be taken for a process gone."""
    try:
        said = f" (pid {holder['pid']} on {holder['host']}, since {holder['started_at']}"
    except (KeyError, TypeError):
        return ""
    if holder["host"] == socket.gethostname() and not same_pids(holder):
        known = holder.get("pid_ns") and pid_space() is not None  # both sides read
        said += ("; not a pid of this container or machine, whose hostname is the same"
                 if known else
                 "; its PID namespace not known, so perhaps not a pid of this container or "
                 "machine")  # fmt: skip
    return said + ")"
