"""How often the extractors checkpoint when ``--checkpoint-interval`` is not given.

Each extractor flushes its running statistics once its oldest unflushed shard is T seconds
old (and when the queue drains, or its statistics budget is full); the job's own process
writes each flush as one checkpoint group, one after the other. With N extractors flushing B
bytes each every T seconds to storage that takes W bytes a second, writing takes
N · B / (W · T) of the extraction's time. The interval is chosen so that this is at most
:data:`IO_SHARE`:

    T = N · B / (IO_SHARE · W), within [FLOOR_S, CEILING_S]

B and W are measured, not assumed (:class:`Pacer`): the mean bytes of the flushes written so
far, and those bytes over the seconds their writes took. Until the first flush is written
there is no measurement, so the first flushes come at the floor. The ceiling bounds the work
a failure loses: an extractor lost (or a node, with its extractors) redoes at most T seconds
of its shards. Pure functions and a little state, no Ray: the scheduler asks
:meth:`Pacer.interval` at every shard, the pipeline tells :meth:`Pacer.wrote` after every
group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .formulas import gib

#: the share of the extraction's time that writing checkpoints may take
IO_SHARE = 0.05
#: the interval's floor: the first flushes come then (they measure the storage), and no
#: extractor flushes more often on its own account
FLOOR_S = 60.0
#: the interval's ceiling: the most work (seconds of an extractor's shards) a failure loses
CEILING_S = 3600.0


def interval_for(
    flush_bytes: float,
    extractors: int,
    bandwidth: float,
    *,
    share: float = IO_SHARE,
    floor: float = FLOOR_S,
    ceiling: float = CEILING_S,
) -> float:
    """T = N · B / (share · W) within [floor, ceiling] (the module docstring)."""
    if bandwidth <= 0:
        return ceiling
    need = max(1, extractors) * flush_bytes / (share * bandwidth)
    return min(max(need, floor), ceiling)


def write_share(flush_bytes: float, extractors: int, bandwidth: float, interval: float) -> float:
    """The share of the extraction's time writing checkpoints takes at ``interval``."""
    return max(1, extractors) * flush_bytes / (bandwidth * interval) if bandwidth > 0 else float("inf")


@dataclass
class Pacer:
    """The checkpoint interval, from the flushes written so far (the module docstring), or
    ``given`` (``--checkpoint-interval``) as it is."""

    given: float | None = None
    share: float = IO_SHARE
    floor: float = FLOOR_S
    ceiling: float = CEILING_S
    flushes: int = 0
    bytes_written: int = 0
    write_s: float = 0.0
    #: the interval last chosen, and for how many extractors
    last: float | None = None
    extractors: int = 0

    def wrote(self, nbytes: int, seconds: float) -> None:
        """One checkpoint group of ``nbytes`` was written in ``seconds``."""
        self.flushes += 1
        self.bytes_written += int(nbytes)
        self.write_s += max(float(seconds), 1e-6)

    @property
    def bandwidth(self) -> float | None:
        """Bytes a second the storage took, over every write so far (None before one)."""
        return self.bytes_written / self.write_s if self.flushes else None

    @property
    def flush_bytes(self) -> float | None:
        return self.bytes_written / self.flushes if self.flushes else None

    def interval(self, extractors: int) -> float:
        """Seconds between an extractor's flushes, for ``extractors`` extractors now."""
        if self.given is not None:
            value = self.given
        elif self.bandwidth is None or self.flush_bytes is None:
            value = self.floor
        else:
            value = interval_for(
                self.flush_bytes, extractors, self.bandwidth,
                share=self.share, floor=self.floor, ceiling=self.ceiling,
            )  # fmt: skip
        self.last, self.extractors = value, extractors
        return value

    def reason(self) -> str:
        """Why the interval is what it last was, in one line."""
        if self.given is not None:
            return f"{self.given:g} s (--checkpoint-interval)"
        if self.bandwidth is None or self.flush_bytes is None:
            return (
                f"{self.floor:g} s (the floor) until a flush has measured the storage; then "
                f"N · B / ({self.share:.0%} · W) within [{self.floor:g} s, {self.ceiling:g} s]"
            )
        n = max(1, self.extractors)
        need = n * self.flush_bytes / (self.share * self.bandwidth)
        bound = " (the floor)" if need < self.floor else " (the ceiling)" if need > self.ceiling else ""
        return (
            f"{self.last or need:,.0f} s{bound}: {n} extractor(s) × {gib(int(self.flush_bytes))} a "
            f"flush at {gib(int(self.bandwidth))}/s measured on {self.flushes} flush(es) = "
            f"{need:,.0f} s for writing to take {self.share:.0%} of the extraction, within "
            f"[{self.floor:g} s, {self.ceiling:g} s]"
        )

    def to_json(self, extract_s: float | None = None) -> dict[str, Any]:
        """The manifest's ``sizing.checkpoints``: the rule, the measurements, the interval
        last chosen and the share of the extraction the writes took."""
        return {
            "given_s": self.given,
            "share": self.share,
            "floor_s": self.floor,
            "ceiling_s": self.ceiling,
            "interval_s": self.last,
            "reason": self.reason(),
            "flushes": self.flushes,
            "bytes_written": self.bytes_written,
            "write_s": round(self.write_s, 3),
            "bandwidth_bytes_per_s": None if self.bandwidth is None else round(self.bandwidth),
            "write_share": None
            if not extract_s or not self.flushes
            else round(self.write_s / extract_s, 4),
        }


def describe_plan(flush_bytes: int, extractors: int, per_node: int, given: float | None) -> list[str]:
    """``--plan``'s lines on checkpoints: the interval (given, or the rule with what it
    gives at a few bandwidths, since the run measures its own) and the work one node's
    failure loses at most."""
    n = max(1, extractors)
    round_bytes = n * flush_bytes
    if given is not None:
        share = {w: write_share(flush_bytes, n, w * 2**30, given) for w in (1, 10)} if given else {}
        at = ", ".join(f"{s:.0%} at {w} GiB/s" for w, s in share.items()) if share else "every shard"
        lines = [f"checkpoints: every {given:g} s (--checkpoint-interval): writing them takes {at}"]
        worst = given
    else:
        at = [(w, interval_for(flush_bytes, n, w * 2**30)) for w in (1, 10, 100)]
        lines = [
            f"checkpoints: every T = N · B / ({IO_SHARE:.0%} · W) s within [{FLOOR_S:g} s, "
            f"{CEILING_S:g} s], B and W measured on the run's own flushes (the first at "
            f"{FLOOR_S:g} s); N · B = {n} × {gib(flush_bytes)} = {gib(round_bytes)} a round: "
            + ", ".join(
                f"T = {t:,.0f} s at {w} GiB/s ({write_share(flush_bytes, n, w * 2**30, t):.0%})"
                for w, t in at
            )
        ]
        worst = CEILING_S
    lines.append(
        f"  a node lost loses at most its {per_node} extractor(s)' last {worst:,.0f} s of "
        f"shards: {per_node * worst / 3600:,.2f} extractor-hours redone"
    )
    return lines
