"""How often the extractors checkpoint when ``--checkpoint-interval`` is not given, and who
writes the checkpoints.

Each extractor flushes its running statistics once its oldest unflushed shard is T seconds
old, when its statistics budget is full, and once more when the queue drains (its *last*
flush: the extractor's state since its previous flush, which the reduce reads from the
checkpoint groups, as it reads every other: below). Who writes a flush
(:func:`decide_writers`):

- **each extractor**, where every extractor's node reaches the run: object storage
  (``s3://``, ``gs://``, …), or a local path that every extractor's node sees as the job's
  own process does (a shared filesystem such as NFS or Lustre, or a run on one node), which
  each extractor checks when it starts (:mod:`embgeom_ray.shared_out`). It writes its own
  flush's files and hands the driver their digests, the driver writes the group's JSON (what
  marks its shards done). The N writers write at once, each at its own W, so an extractor
  spends B / (W · T) of its time writing;
- the **driver** (the job's own process), for a run on a local path that an extractor's node
  does not see (the driver's own disk): each flush travels to the driver, which writes the
  groups one after the other. N extractors flushing B bytes each every T seconds to storage
  that takes W bytes a second from that one writer spend N · B / (W · T) of the extraction's
  time writing. The first extractor that does not see the run turns the run to this for every
  flush after (one line says which node and why).

The interval is chosen so that this share is at most :data:`IO_SHARE`:

    T = N · B / (IO_SHARE · W)   (the driver writes)
    T = B / (IO_SHARE · W)       (each extractor writes; W: one writer's bandwidth)

within [FLOOR_S, CEILING_S]. B and W are measured, not assumed (:class:`Pacer`): the mean
bytes of the flushes written so far, and those bytes over the seconds their writes took (each
writer's own seconds). Until the first flush is written there is no measurement, so the first
flushes come at the floor. The ceiling bounds the work a failure loses: an extractor lost (or a
node, with its extractors) redoes its shards since its last flush.

Flushes are decided between shards (the Ray layer's scheduler, when a shard ends), so the oldest
unflushed shard can age to T plus a shard. Under the sized interval the scheduler also flushes
where one more shard of the mean length would age it past the ceiling; a given interval is used
as it is. Where a shard takes at least the interval, every shard ends in a flush and a failure
loses up to a shard whatever T says: :meth:`Pacer.folded` measures the shards and
:meth:`Pacer.shard_news` says so, with the ``--shard-bytes`` that would fit.

The last flush is not a checkpoint the interval could leave out: when the queue drains the
extractors are ended, and the reduce (in the job's own process, or on reducer actors on other
nodes, each reading the groups of its token range) reads every extractor's state from the
groups; a flush written there also keeps that state through the reduce (a reduce that fails,
a job killed during it: the rerun reduces again, extracting nothing). It adds one flush per
extractor to the run whatever T is, B / W seconds of each writer's time, which the share
states apart: over an extraction of E seconds writing takes IO_SHARE + B / (W · E) of it
(:attr:`Pacer.to_json`'s ``write_share`` and ``write_share_before_drain``). Pure functions and
a little state, no Ray: the scheduler asks :meth:`Pacer.interval` at every shard, the pipeline
tells :meth:`Pacer.wrote` after every group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .units import gib

#: who writes the checkpoint groups (:func:`writers_for`)
DRIVER, EXTRACTORS = "driver", "extractors"

#: the share of the extraction's time that writing checkpoints may take
IO_SHARE = 0.05
#: the interval's floor: the first flushes come then (they measure the storage), and no
#: extractor flushes more often on its own account
FLOOR_S = 60.0
#: the interval's ceiling: the most work (seconds of an extractor's shards) a failure loses
CEILING_S = 3600.0


def needs_check(out: str) -> bool:
    """Whether who writes the checkpoint groups of a run at ``out`` depends on what the
    extractors' nodes see (a local path: :mod:`embgeom_ray.shared_out`); object storage is
    reached from every node."""
    from ..storage import is_remote

    return not is_remote(out)


def decide_writers(out: str, unseen: Sequence[tuple[str, str]] = ()) -> tuple[str, str]:
    """Who writes the checkpoint groups of a run at ``out``, and why in a few words:
    :data:`EXTRACTORS` in object storage, and on a local path while no extractor's node is
    ``unseen`` (node id, why it does not see the run: :func:`~embgeom_ray.shared_out.unseen`);
    else :data:`DRIVER`."""
    if not needs_check(out):
        return EXTRACTORS, "object storage"
    if not unseen:
        return EXTRACTORS, f"every extractor's node sees {out} (a shared filesystem, or one node)"
    node, why = unseen[0]
    return DRIVER, (
        f"the extractor on node {node[:8] or '?'} does not see {out} ({why}): not a filesystem "
        "its nodes share"
    )


def writers_for(out: str) -> str:
    """Who writes the checkpoint groups of a run at ``out`` before any extractor has said
    what it sees (:func:`decide_writers`): each extractor."""
    return decide_writers(out)[0]


def _queued(extractors: int, writers: str) -> int:
    """How many flushes one writer writes a round: all N when the driver writes them, its own
    when each extractor writes."""
    return 1 if writers == EXTRACTORS else max(1, extractors)


def interval_for(
    flush_bytes: float,
    extractors: int,
    bandwidth: float,
    *,
    share: float = IO_SHARE,
    floor: float = FLOOR_S,
    ceiling: float = CEILING_S,
    writers: str = DRIVER,
) -> float:
    """T = N · B / (share · W), or B / (share · W) where each extractor writes, within
    [floor, ceiling] (the module docstring)."""
    if bandwidth <= 0:
        return ceiling
    need = _queued(extractors, writers) * flush_bytes / (share * bandwidth)
    return min(max(need, floor), ceiling)


def flush_due(
    age: float,
    interval: float,
    *,
    drained: bool = False,
    over_budget: bool = False,
    ceiling: float | None = None,
    shard_mean: float | None = None,
) -> bool:
    """Whether an extractor flushes now, at the end of a shard (flushes come only there):
    the queue is drained, its statistics hold their budget, or its oldest unflushed shard,
    dispatched ``age`` seconds ago, is at least ``interval`` old; and, under a ``ceiling``
    (the sized interval's), where one more shard of the mean length ``shard_mean`` would age
    it past the ceiling. Without that last rule the oldest could age to the interval plus a
    shard; with it, a shard of at least half the ceiling ends in a flush every time."""
    if drained or over_budget or age >= interval:
        return True
    return ceiling is not None and shard_mean is not None and age + shard_mean > ceiling


def write_share(
    flush_bytes: float, extractors: int, bandwidth: float, interval: float, writers: str = DRIVER
) -> float:
    """The share of the extraction's time (of each extractor's, where each writes its own)
    writing checkpoints takes at ``interval``."""
    if bandwidth <= 0:
        return float("inf")
    return _queued(extractors, writers) * flush_bytes / (bandwidth * interval)


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
    #: who writes the groups (:func:`writers_for`)
    writers: str = DRIVER
    #: the most extractors at once (the writers' count, where each writes its own)
    most_extractors: int = 0
    #: why they write them (:func:`decide_writers`)
    writers_why: str = ""
    #: of the flushes, the extractors' last ones (when the queue drained: the module
    #: docstring), and the seconds their writes took
    last_flushes: int = 0
    last_write_s: float = 0.0
    #: of the others, those the statistics budget forced (:meth:`wrote`'s ``budget_fill_s``):
    #: how many, their bytes, and the seconds the extractors took to fill the budget, summed
    budget_flushes: int = 0
    budget_bytes: int = 0
    budget_fill_s: float = 0.0
    #: the write share :meth:`budget_news` last said (None: not said)
    budget_said: float | None = None
    #: what fills and forces those flushes, as :meth:`budget_news` names it
    budget_name: str = "statistics budget (--statistics-memory)"
    #: the shards folded (:meth:`folded`): how many, their seconds summed and the longest
    shards: int = 0
    shard_s: float = 0.0
    shard_s_max: float = 0.0
    #: the bytes of text a shard was cut to (the plan's ``shard_bytes``; 0: unknown)
    shard_bytes: int = 0
    #: the mean shard seconds :meth:`shard_news` last said (None: not said)
    shard_said: float | None = None
    #: the most seconds a flush's oldest shard had waited, from its dispatch to the flush:
    #: the work an extractor held that no checkpoint had, just before that flush
    oldest_s_max: float = 0.0

    def wrote(
        self,
        nbytes: int,
        seconds: float,
        last: bool = False,
        budget_fill_s: float | None = None,
        age_s: float | None = None,
    ) -> None:
        """One checkpoint group of ``nbytes`` was written in ``seconds`` (``last``: an
        extractor's last flush, when the queue drained; ``budget_fill_s``: the flush was forced
        by the extractor's statistics budget, which its shards filled in that many seconds;
        ``age_s``: the seconds from its oldest shard's dispatch to the flush)."""
        self.flushes += 1
        self.oldest_s_max = max(self.oldest_s_max, float(age_s or 0.0))
        self.bytes_written += int(nbytes)
        self.write_s += max(float(seconds), 1e-6)
        if last:
            self.last_flushes += 1
            self.last_write_s += max(float(seconds), 1e-6)
        elif budget_fill_s is not None:
            self.budget_flushes += 1
            self.budget_bytes += int(nbytes)
            self.budget_fill_s += max(float(budget_fill_s), 1e-6)

    @property
    def budget_fill(self) -> float | None:
        """t_σ: the mean seconds an extractor took to fill its statistics budget, over the
        flushes the budget forced (None before one)."""
        return self.budget_fill_s / self.budget_flushes if self.budget_flushes else None

    def budget_share(self) -> float | None:
        """The share of the extraction writing takes where the statistics budget sets the
        flushes: B_σ / (W · t_σ), or N · B_σ / (W · t_σ) where the driver writes them all, B_σ
        the mean bytes of those flushes (None before one)."""
        fill, bandwidth = self.budget_fill, self.bandwidth
        if fill is None or bandwidth is None:
            return None
        flush = self.budget_bytes / self.budget_flushes
        return write_share(flush, max(1, self.extractors), bandwidth, fill, self.writers)

    def budget_news(self) -> str | None:
        """A line to print when the statistics budget, not the interval, sets the flushes: the
        first time a flush it forced came before the interval, and again when the share of the
        extraction the writes take has doubled or halved since; None otherwise."""
        fill, share = self.budget_fill, self.budget_share()
        interval = self.given if self.given is not None else self.last
        if fill is None or share is None or interval is None or fill >= interval:
            return None
        said = self.budget_said
        if said is not None and said / 2 < share < 2 * said:
            return None
        self.budget_said = share
        whose = "each extractor's" if self.writers == EXTRACTORS else "the extraction's"
        flush = self.budget_bytes / self.budget_flushes
        aim = "above" if share > self.share else "within"
        return (
            f"checkpoints: the extractors' {self.budget_name} filled in "
            f"{fill:,.0f} s on average over {self.budget_flushes} flush(es), before the "
            f"{interval:,.0f} s interval: each extractor flushes whenever it fills, "
            f"{gib(int(flush))} a flush, so writing takes ~{share:.0%} of {whose} time at the "
            f"{gib(int(self.bandwidth or 0))}/s measured, {aim} the "
            f"{self.share:.0%} the interval aims at (a larger budget spaces these flushes; "
            "nothing is lost or counted twice)"
        )

    def folded(self, seconds: float) -> None:
        """An extractor folded a shard in ``seconds`` (from its dispatch to its result)."""
        self.shards += 1
        self.shard_s += max(float(seconds), 0.0)
        self.shard_s_max = max(self.shard_s_max, float(seconds))

    @property
    def shard_mean(self) -> float | None:
        """The mean seconds a shard took an extractor (None before one)."""
        return self.shard_s / self.shards if self.shards else None

    def shard_news(self) -> str | None:
        """A line to print when the shards, not the interval, set the flushes: an extractor
        decides to flush only between shards, so where a shard takes at least the interval
        it flushes after every shard, and a failure loses up to a shard of its work, however
        short the interval. Said the first time the mean shard reaches the interval (once the
        interval is measured or given), and again when that mean has doubled or halved. Never
        with ``--checkpoint-interval 0``: a flush after every shard is what it asks for."""
        mean = self.shard_mean
        measured = self.last if self.bandwidth is not None else None
        interval = self.given if self.given is not None else measured
        if mean is None or interval is None or interval <= 0 or mean < interval:
            return None
        said = self.shard_said
        if said is not None and said / 2 < mean < 2 * said:
            return None
        self.shard_said = mean
        hint = ""
        if self.shard_bytes:
            fits = max(2**20, int(self.shard_bytes * interval / (2 * mean)))
            hint = (
                f"; --shard-bytes {fits} ({gib(fits)}, shards of ~half the interval) would let "
                "the interval set them"
            )
        return (
            f"checkpoints: a shard takes {mean:,.0f} s on average (the longest "
            f"{self.shard_s_max:,.0f} s), at least the {interval:,.0f} s interval: an extractor "
            "flushes only between shards, so each flushes after every shard and a failure "
            f"loses up to a shard of each of its extractors' work{hint}"
        )

    def fall_back(self, why: str) -> None:
        """An extractor does not see the run (``why``, :func:`decide_writers`): the job's own
        process writes every flush from now on."""
        self.writers, self.writers_why = DRIVER, why

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
                share=self.share, floor=self.floor, ceiling=self.ceiling, writers=self.writers,
            )  # fmt: skip
        self.last, self.extractors = value, extractors
        self.most_extractors = max(self.most_extractors, extractors)
        return value

    def reason(self) -> str:
        """Why the interval is what it last was, in one line."""
        each = self.writers == EXTRACTORS
        if self.given is not None:
            return f"{self.given:g} s (--checkpoint-interval)"
        rule = "B / ({share} · W), each extractor writing its own" if each else "N · B / ({share} · W)"
        rule = rule.format(share=f"{self.share:.0%}")
        if self.bandwidth is None or self.flush_bytes is None:
            return (
                f"{self.floor:g} s (the floor) until a flush has measured the storage; then "
                f"{rule} within [{self.floor:g} s, {self.ceiling:g} s]"
            )
        n = max(1, self.extractors)
        need = _queued(n, self.writers) * self.flush_bytes / (self.share * self.bandwidth)
        bound = " (the floor)" if need < self.floor else " (the ceiling)" if need > self.ceiling else ""
        who = (
            f"{gib(int(self.flush_bytes))} a flush at {gib(int(self.bandwidth))}/s a writer "
            f"({n} extractor(s) writing their own)"
            if each
            else f"{n} extractor(s) × {gib(int(self.flush_bytes))} a flush at "
            f"{gib(int(self.bandwidth))}/s"
        )
        return (
            f"{self.last or need:,.0f} s{bound}: {who} measured on {self.flushes} flush(es) = "
            f"{need:,.0f} s for writing to take {self.share:.0%} of the extraction, within "
            f"[{self.floor:g} s, {self.ceiling:g} s]"
        )

    def writers_line(self) -> str:
        """Who writes the groups, in a few words."""
        if self.writers == EXTRACTORS:
            return (
                f"written by each extractor ({self.writers_why}), committed by this process"
                if self.writers_why
                else "written by each extractor, committed by this process"
            )
        return f"written by this process ({self.writers_why})" if self.writers_why else (
            "written by this process"
        )

    def share_of(self, write_s: float, extract_s: float | None) -> float | None:
        """``write_s`` seconds of writes as a share of an extraction of ``extract_s`` (of each
        extractor's time, where each writes its own)."""
        if not extract_s or not self.flushes:
            return None
        each = max(1, self.most_extractors) if self.writers == EXTRACTORS else 1
        return round(write_s / extract_s / each, 4)

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
            "writers": self.writers,
            "writers_reason": self.writers_why,
            # where each extractor writes its own, the writes' seconds are spread over them
            "write_share": self.share_of(self.write_s, extract_s),
            # the extractors' last flushes (when the queue drained: the reduce's input), and
            # the share of the others, the one the interval holds to ``share``
            "last_flushes": self.last_flushes,
            "last_write_s": round(self.last_write_s, 3),
            "write_share_before_drain": self.share_of(self.write_s - self.last_write_s, extract_s),
            # of the flushes before the last ones, those the statistics budget forced, the mean
            # seconds an extractor took to fill it (t_σ), and the share writing takes at that
            # pace: B_σ / (W · t_σ)
            "budget_flushes": self.budget_flushes,
            "budget_fill_s": None if self.budget_fill is None else round(self.budget_fill, 3),
            "budget_write_share": None
            if (share := self.budget_share()) is None
            else round(share, 4),
            # the shards' seconds (an extractor decides to flush only between shards), and the
            # most seconds of work an extractor held unflushed: what a failure just before
            # that flush would have cost it
            "shards_timed": self.shards,
            "shard_s_mean": None if self.shard_mean is None else round(self.shard_mean, 3),
            "shard_s_max": round(self.shard_s_max, 3),
            "unflushed_s_max": round(self.oldest_s_max, 3),
        }


def describe_plan(
    flush_bytes: int,
    extractors: int,
    per_node: int,
    given: float | None,
    writers: str = DRIVER,
    checked: bool = False,
    budget: BudgetShape | None = None,
) -> list[str]:
    """``--plan``'s lines on checkpoints: who writes them (``checked``: each extractor where
    its node sees the run's local path, :func:`decide_writers`), the interval (given, or the
    rule with what it gives at a few bandwidths, since the run measures its own), the
    extractors' last flushes, the work one node's failure loses at most, and where the
    statistics ``budget`` cannot hold every type, that it may set the flushes instead."""
    n = max(1, extractors)
    round_bytes = n * flush_bytes
    each = writers == EXTRACTORS
    per = "a writer" if each else ""
    if given is not None:
        share = (
            {w: write_share(flush_bytes, n, w * 2**30, given, writers) for w in (1, 10)}
            if given
            else {}
        )
        at = (
            ", ".join(f"{s:.0%} at {w} GiB/s{' ' + per if per else ''}" for w, s in share.items())
            if share
            else "every shard"
        )
        lines = [f"checkpoints: every {given:g} s (--checkpoint-interval): writing them takes {at}"]
        worst = given
    else:
        at = [(w, interval_for(flush_bytes, n, w * 2**30, writers=writers)) for w in (1, 10, 100)]
        rule = "B / ({s} · W) s (W: one writer's)" if each else "N · B / ({s} · W) s"
        lines = [
            f"checkpoints: every T = {rule.format(s=f'{IO_SHARE:.0%}')} within [{FLOOR_S:g} s, "
            f"{CEILING_S:g} s], B and W measured on the run's own flushes (the first at "
            f"{FLOOR_S:g} s); N · B = {n} × {gib(flush_bytes)} = {gib(round_bytes)} a round: "
            + ", ".join(
                f"T = {t:,.0f} s at {w} GiB/s{' ' + per if per else ''} "
                f"({write_share(flush_bytes, n, w * 2**30, t, writers):.0%})"
                for w, t in at
            ),
        ]
        worst = CEILING_S
    lines.append(
        f"  and each extractor's last flush, when the queue drains (its state since the one "
        f"before, which the reduce reads from the groups): B / W = "
        f"{flush_bytes / 2**30:,.0f} s at 1 GiB/s{' ' + per if per else ''}, once a run"
    )
    # an extractor decides to flush only between shards: under a given interval the oldest
    # unflushed shard may age to T plus a shard; the sized one also flushes where one more
    # shard would pass the ceiling (the Ray layer's scheduler), so only a shard longer than
    # the ceiling passes it
    beyond = (
        "and the shard each was folding past it (an extractor flushes only between shards)"
        if given is not None
        else "or one shard each, where a shard takes longer (an extractor flushes only "
        "between shards)"
    )
    lines.append(
        f"  a node lost loses at most its {per_node} extractor(s)' last {worst:,.0f} s of "
        f"shards, {beyond}: {per_node * worst / 3600:,.2f} extractor-hours redone"
    )
    if each and checked:
        alone = interval_for(flush_bytes, n, 2**30)
        lines.append(
            f"  written by each extractor ({n} writers at once) where every extractor's node "
            "sees the run's directory (checked as each starts: a shared filesystem, or one "
            "node), committed by the job's own process; else by the job's own process alone: "
            f"T = N · B / ({IO_SHARE:.0%} · W) = {alone:,.0f} s at 1 GiB/s "
            f"({write_share(flush_bytes, n, 2**30, alone):.0%})"
        )
    elif each:
        lines.append(
            f"  written by each extractor ({n} writers at once: object storage), committed by "
            "the job's own process"
        )
    else:
        lines.append("  written by the job's own process (one writer)")
    if budget is not None and budget.types_held < budget.types:
        at = given or interval_for(flush_bytes, n, 2**30, writers=writers)
        lines.append(
            f"  {budget.name} = {gib(budget.held_bytes)} holds the rows of "
            f"~{budget.types_held:,} types ({gib(budget.row_bytes)} a type, beside F) of the ≤ "
            f"{budget.types:,} the run may see: an extractor that meets more types between two "
            "checkpoints flushes whenever it fills, every t_σ seconds, and writing then takes "
            f"{'' if each else 'N · '}B / (W · t_σ) of {'its' if each else 'the'} time, over "
            f"{IO_SHARE:.0%} wherever it fills in less than T ({at:,.0f} s at 1 GiB/s"
            f"{' ' + per if per else ''}); the run measures t_σ and says so "
            "(sizing.checkpoints.budget_fill_s)"
        )
    return lines


@dataclass(frozen=True)
class BudgetShape:
    """What an extractor's statistics may hold before it flushes, against the types a run may
    see, for :func:`describe_plan`: its budget σ (or its host tier H, where it has one), one
    type's rows in every measured layer, the per-layer state F that the budget also holds, and
    the bound on the types seen."""

    #: σ, or H where there is a host tier
    held_bytes: int
    row_bytes: int
    fixed_bytes: int
    types: int
    #: what the budget is, as the plan names it
    name: str = "the statistics budget σ"

    @property
    def types_held(self) -> int:
        """The types whose rows fit the budget beside F: ⌊(budget − F) / row⌋."""
        return max(0, (self.held_bytes - self.fixed_bytes) // max(1, self.row_bytes))
