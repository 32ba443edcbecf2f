"""A process's peak resident memory, as each Ray process of the job reports it."""

from __future__ import annotations

import resource
import sys


def peak_rss_bytes() -> int:
    """The calling process's peak resident set size in bytes (``getrusage``: KiB on Linux,
    bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
