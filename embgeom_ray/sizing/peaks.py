"""What a run's processes peaked at against what they were sized for: the manifest's
``memory`` (peak private bytes, :func:`~embgeom_ray.runs.finish.memory_of`) beside its
``sizing`` and ``workers``, printed when the run ends and shown in its report.

The budgets compared are those the run used: each extractor's memory asked of Ray
(``workers.memory_bytes``), each reducer's for the types seen (``sizing.reduce.memory``), and
the job's own process's figure above its start for the reduce it did (``sizing.reduce.driver``,
else the plan's ``sizing.driver_bytes``). Private memory is what the formulas predict
(docs/sizing.md, Measured); a peak under its budget is the bound on the types at work (the
extractors are sized for every type of the vocabulary) or the formulas' headroom.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .units import gib


@dataclass(frozen=True)
class Peak:
    """One kind of process: its peak private bytes against its budget."""

    process: str
    peak: int
    #: bytes it was sized for (None: not recorded)
    budget: int | None
    #: what the budget is: asked of Ray, or the job's own process's figure above its start
    what: str
    #: what to turn where it peaked over its budget
    lever: str

    @property
    def share(self) -> float | None:
        """peak / budget (None where no budget is recorded)."""
        return None if not self.budget else self.peak / self.budget

    def describe(self) -> str:
        """``extractor 2.3 GiB of 6.0 GiB asked of Ray (38%)``, and over its budget, the option
        that bounds it."""
        if self.share is None:
            return f"{self.process} {gib(self.peak)}"
        over = f"; over its budget: {self.lever}" if self.share > 1 else ""
        return (f"{self.process} {gib(self.peak)} of {gib(self.budget)} {self.what} "
                f"({self.share:.0%}{over})")  # fmt: skip


def peaks(manifest: Mapping[str, Any]) -> list[Peak]:
    """The job's own process, the largest extractor and the largest reducer of a manifest
    (as JSON), each where its peak is recorded."""
    memory = manifest.get("memory") or {}
    sizing = manifest.get("sizing") or {}
    workers = manifest.get("workers") or {}
    reduce = sizing.get("reduce") or {}
    out = []
    start, peak = memory.get("driver_start_private_bytes"), memory.get("driver_peak_private_bytes")
    if start is not None and peak is not None:
        budget = reduce.get("driver") or sizing.get("driver_bytes")
        out.append(Peak("job's own process", max(0, peak - start), budget, "above its start",
                        "lower --sample-size, or give the head node more memory"))  # fmt: skip
    extractor = memory.get("extractor_peak_private_bytes")
    if extractor:
        out.append(Peak("extractor", extractor, workers.get("memory_bytes"), "asked of Ray",
                        "give more --worker-memory"))  # fmt: skip
    reducers = [b for b in memory.get("reducer_peak_private_bytes") or [] if b]
    if reducers:
        out.append(Peak("reducer (largest)", max(reducers), reduce.get("memory"),
                        "asked of Ray", "give more --reducer-memory"))  # fmt: skip
    return out


def describe_peaks(manifest: Mapping[str, Any]) -> str | None:
    """One line: every recorded peak against its budget (None where none is recorded)."""
    found = peaks(manifest)
    if not found:
        return None
    return "memory, peak private: " + "; ".join(p.describe() for p in found)
