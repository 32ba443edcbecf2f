"""A process's peak memory, as each process of the job (driver, extractors, reducers) reports it.

Two numbers, because Ray's object store is shared memory: pages a process writes into it
(``ray.put``, a large return value) or reads from it (``ray.get``) count in its resident set
(``ru_maxrss``) although they belong to the store, which is bounded by its own size and spills
to disk. The process's own heap is its anonymous resident memory (Linux ``RssAnon``), whose
peak :class:`PeakMemory` samples in a background thread; that is the number the job's memory
formulas predict.
"""

from __future__ import annotations

import resource
import sys
import threading

_STATUS = "/proc/self/status"


def peak_rss_bytes() -> int:
    """The calling process's peak resident set size in bytes (``getrusage``: KiB on Linux,
    bytes on macOS), shared pages of the object store included."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def anon_bytes() -> int | None:
    """The process's anonymous resident memory now (Linux ``RssAnon``); None elsewhere."""
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PeakMemory:
    """The peak of :func:`anon_bytes`, sampled every ``interval`` seconds by a daemon thread
    (one per process: :func:`sampler`)."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.peak = anon_bytes() or 0
        #: the anonymous resident memory when sampling started (the process's libraries)
        self.start = self.peak
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)
        if anon_bytes() is not None:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            now = anon_bytes()
            if now is not None and now > self.peak:
                self.peak = now

    def peak_bytes(self) -> int | None:
        """The largest anonymous resident memory seen so far (None where not measurable)."""
        now = anon_bytes()
        if now is None:
            return None
        self.peak = max(self.peak, now)
        return self.peak


_SAMPLER: PeakMemory | None = None


def sampler() -> PeakMemory:
    """This process's :class:`PeakMemory`, started on first use."""
    global _SAMPLER
    if _SAMPLER is None:
        _SAMPLER = PeakMemory()
    return _SAMPLER


def peak_memory() -> dict[str, int | None]:
    """``{"rss": peak resident bytes, "private": peak anonymous bytes, "start": anonymous bytes
    when sampling started}`` of this process."""
    own = sampler()
    return {"rss": peak_rss_bytes(), "private": own.peak_bytes(), "start": own.start or None}
