"""Helpers of the tests that start their own Ray heads: free ports, finding and stopping only
the processes a test started (other agents' and CI's Ray processes may share the machine)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Sequence


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 right now (held open together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def marked_pids(markers: Sequence[str], pgid: int | None = None) -> list[int]:
    """Live processes in process group ``pgid`` or whose command line names a marker."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            in_group = pgid is not None and os.getpgid(pid) == pgid
        except (OSError, IndexError):
            continue
        if state != "Z" and (in_group or any(m in cmdline for m in markers)):
            pids.append(pid)
    return pids


def kill_marked(markers: Sequence[str], pgid: int | None = None) -> None:
    """SIGTERM, then SIGKILL, the processes :func:`marked_pids` finds, waiting for each."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        for pid in marked_pids(markers, pgid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while marked_pids(markers, pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
