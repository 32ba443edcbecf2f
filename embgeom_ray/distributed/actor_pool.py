"""The thin Ray layer: size the actor pool, run shards on extractor actors (joining a cluster:
:mod:`~embgeom_ray.distributed.cluster`).

The driver only plans and gathers. Each :class:`ShardExtractActor` loads the model once and
folds whole shards (:class:`~embgeom_ray.inputs.extractor.ShardProcessor`) into *one* running
statistics object, sample and counts kept across the shards it processes; ``process``
returns only the shard's small counts. The driver asks an actor to ``flush`` (hand over the
accumulated statistics as safetensors bytes with the ids of the shards they cover, and start
afresh) once its unflushed work is older than ``--checkpoint-interval`` seconds (0: after
every shard), and always when the queue is drained. ``on_group`` checkpoints each flush in
the driver (where the extractors reach the run, in object storage or on a local path their
nodes see, it commits the files the extractor wrote itself: ``flush``'s ``writer``): a shard
counts as done only there, so a shard's result is merged exactly once. A shard an actor read
from another node's copy of a local corpus file, whose modification time is not the planned
one, comes with the digest of its bytes (:class:`~embgeom_ray.inputs.copies.CopyReading`); the
driver compares it with its own copy's in a thread (:func:`~embgeom_ray.inputs.copies.check_copy`),
and commits the group holding that shard only once it matched.

The scheduler keeps one shard in flight per actor (shards take seconds or more; the dispatch
round trip is milliseconds). An actor that dies (process killed, node lost, spot
preemption) loses every shard it folded since its last flush: they all go back to the queue,
each counting one loss toward ``--max-shard-retries``, and a replacement starts where the
cluster has room for it.

The pool follows the cluster. It starts with the extractors the nodes hold (at least one,
which waits for a node where none holds it), and every :data:`POOL_POLL_S` seconds while
shards wait it reads Ray's view of the nodes again and starts more where room appeared, up to
``--num-workers``, and no more than the autoscaler's node groups hold where Ray shows them
(else as many as the shards want): :mod:`embgeom_ray.sizing.growth` decides, the scheduler only
asks and starts. Where the nodes do not hold the pool it wants, it asks the autoscaler for
room (Ray's ``request_resources``, cleared when the extraction ends). An extractor still
waiting for a node never holds the job up: the others run the shards, and it is ended with
the pool.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from threading import Event
from typing import Any

import numpy as np
import ray

from ..core.spilling import HostTier, SpillingStatistics
from ..core.statistics_io import BYTES_LIKE
from ..counts import Counts
from ..errors import UserError
from ..inputs.copies import CopyReading, check_copy
from ..inputs.corpus import Shard
from ..inputs.extractor import ShardProcessor
from ..inputs.hub_credentials import hub_credentials, use_hub_credentials
from ..inputs.malloc_tuning import release_freed_memory, reuse_freed_memory
from ..inputs.options import ExtractionOptions
from ..shared_out import unseen
from ..sizing import Cluster, Extractor, Pool
from ..sizing.checkpoints import Pacer
from ..sizing.checkpoints import flush_due as checkpoint_flush_due
from ..sizing.growth import (
    autoscaler_request,
    extractors_held,
    extractors_possible,
    extractors_to_add,
    pool_ceiling,
    pool_target,
)
from ..storage import storage_access, use_storage_access
from .cluster import read_autoscaler_groups, read_cluster, started_private_local
from .options import SchedulingOptions
from .process_memory import peak_rss_bytes, sampler

log = logging.getLogger(__name__)

#: seconds between two looks at the cluster for room for more extractors, while shards wait
#: (one request to Ray's GCS: milliseconds)
POOL_POLL_S = 5.0
#: seconds without an extractor before the job says, once, that no node holds one (it waits
#: for one to join: an autoscaler's node, or none will, and the user should know)
WAIT_NOTICE_S = 60.0


@dataclass
class PoolPlan:
    """The extractor pool, and what happened to it (recorded in the manifest)."""

    #: extractors started at first (the pool the nodes held when the extraction began)
    num_workers: int
    num_gpus: float
    num_cpus: int
    #: the most the pool may grow to: ``--num-workers``, and no more than the autoscaler's
    #: node groups hold where Ray shows them (None: as many as the shards want)
    max_workers: int | None = None
    #: the most extractors ready at once
    largest_workers: int = 0
    #: extractors started after the first ones: as nodes joined, or in place of one lost
    workers_added: int = 0
    #: extractors lost (their process or node died); their unflushed shards were queued again
    workers_lost: int = 0
    #: extractors asked for that had not started when the extraction ended (still waiting for
    #: a node, or loading their model); ended with the pool
    workers_waiting: int = 0
    #: shards put back on the queue because their actor was lost before flushing them
    shards_requeued: int = 0
    #: flushes received, i.e. checkpoint groups written
    checkpoints: int = 0
    #: of those, flushes asked because an actor's statistics reached --worker-memory
    budget_flushes: int = 0
    #: statistics pieces extractors spilled to the object store at --worker-memory
    spills: int = 0
    #: spills of the running statistics merged into a host tier instead
    #: (``--host-statistics-memory``)
    host_merges: int = 0
    #: the largest peak resident memory any extractor actor reported (bytes; includes the
    #: object store's shared pages it touched)
    extractor_peak_rss_bytes: int = 0
    #: the largest peak private (anonymous) memory any extractor reported (bytes; Linux)
    extractor_peak_private_bytes: int = 0
    #: padded tokens per forward batch (``--batch-tokens``, or the largest an extractor chose
    #: for its device where it was not given)
    batch_tokens: int = 0
    #: bytes of memory each extractor asked Ray for (``--worker-memory``; 0: none asked)
    memory_bytes: int = 0
    #: the largest statistics budget an extractor used (``--statistics-memory``, or what its
    #: device holds; None: unbounded)
    statistics_bytes: int | None = None
    #: every extractor that started, in the order they did: ``node_id`` (Ray's), ``pid``,
    #: ``requested_s`` and ``ready_s`` (seconds from the extraction's start to when it was
    #: asked for and when it had loaded its model), ``lost_s`` (when it was lost; None: it ran
    #: to the end), ``shards`` (shards it folded that were checkpointed)
    extractors: list[dict[str, Any]] = field(default_factory=list)


def plan_pool(config: SchedulingOptions, num_shards: int) -> PoolPlan:
    """The extractor pool on the cluster Ray is joined to (:func:`embgeom_ray.sizing.plan_pool`:
    actors, CPUs and GPUs each), for a model whose weights' size is not known."""
    from ..sizing import Shape
    from ..sizing import plan_pool as decide

    count, gpus, cpus = decide(
        read_cluster(), Shape(layers=1, dim=1, positions=0, vocab=1), device=config.device,
        num_shards=num_shards, num_workers=config.num_workers,
        cpus_per_worker=config.cpus_per_worker, gpus_per_worker=config.gpus_per_worker,
    )  # fmt: skip
    return PoolPlan(count, float(gpus), cpus)


def pool_plan(pool: Pool) -> PoolPlan:
    """The :class:`PoolPlan` of the pool the job's sizing decided (:class:`~embgeom_ray.sizing.Pool`)."""
    return PoolPlan(
        pool.num_workers,
        pool.num_gpus,
        pool.num_cpus,
        memory_bytes=pool.memory,
        statistics_bytes=pool.statistics,
        batch_tokens=pool.batch_tokens or 0,
    )


@dataclass
class FoldReport:
    """A shard an actor has folded into its running statistics (not yet checkpointed)."""

    shard: Shard
    counts: Counts
    #: the actor's process id and Ray node id (diagnostics; the fault tests kill them)
    pid: int
    node_id: str
    #: shards the actor has folded since its last flush, this one included
    unflushed: int
    #: seconds from the shard's dispatch to its result
    seconds: float = 0.0


@dataclass
class GroupResult:
    """One flush of an actor: the statistics of ``shard_ids`` folded together, as pieces in
    fold order (uint8 arrays of safetensors files, or ObjectRefs of the pieces it spilled
    under ``--worker-memory``)."""

    shard_ids: list[str]
    stats: list[Any]
    #: the sample's file as a uint8 array: the driver reads it from the object store without a
    #: private copy (zero-copy numpy), and writes it to the checkpoint group
    sample: np.ndarray | None
    counts: Counts
    #: where the extractor wrote the group's files itself (object storage): what its
    #: ``writer`` returned (the files' names and digests, for the driver to commit; ``stats``
    #: and ``sample`` are then empty), and the seconds the extractor's writes took
    written: dict[str, Any] | None = None
    write_s: float = 0.0
    #: the extractor's last flush: asked when the queue had drained
    last: bool = False
    #: asked because the extractor's running statistics reached their budget
    #: (``--statistics-memory``), whatever the checkpoint interval said
    budget: bool = False
    #: seconds from the dispatch of the flush's oldest shard to the flush being asked: under
    #: ``budget``, how long the extractor took to fill its statistics budget
    age_s: float = 0.0

    def pieces(self) -> Iterator[Any]:
        """The statistics pieces (bytes-like, or :class:`BlockRefs` whose blocks are fetched
        as they are written), fetched one at a time and let go of as they are taken (consumes
        ``stats``: one piece in memory)."""
        while self.stats:
            piece = self.stats.pop(0)
            yield ray.get(piece) if isinstance(piece, ray.ObjectRef) else piece
            del piece


@dataclass
class BlockRefs:
    """A statistics file in Ray's object store a block at a time: its ``size`` in bytes and
    the ObjectRefs of its consecutive blocks (a host tier's piece, put there as it was made:
    :class:`~embgeom_ray.core.statistics_io.StreamedStatistics`). Iterating fetches the blocks
    one at a time, as the checkpoint's write takes them."""

    size: int
    refs: list[Any]

    @classmethod
    def put(cls, piece: Any) -> BlockRefs:
        """Each block of ``piece`` (a file made a block at a time) put in the object store."""
        return cls(int(piece.size), [ray.put(block) for block in piece])  # each copied in

    def __iter__(self) -> Iterator[np.ndarray]:
        for ref in self.refs:
            yield ray.get(ref)


def as_array(data: bytes | bytearray) -> np.ndarray:
    """Serialised statistics as a uint8 array on the same memory: Ray puts numpy arrays into
    its object store with one copy (pickle protocol 5, out of band), where bytes and
    bytearrays are first copied into the pickle stream."""
    return np.frombuffer(data, dtype=np.uint8)


class ShardExtract:
    """Actor body: a :class:`ShardProcessor` with torch limited to the actor's CPUs, and the
    running statistics, sample and counts of the shards folded since the last flush. On a
    CPU the process's allocator keeps the forward's freed tensors for the next batch
    (:func:`~embgeom_ray.inputs.malloc_tuning.reuse_freed_memory`): the actor owns its process.

    ``credentials``: the driver's hub token (:mod:`embgeom_ray.inputs.hub_credentials`), set in
    the actor's process where its node has none. An error while loading (bad weights, missing
    files, …) is kept and raised again by :meth:`ready`, so the driver sees the original
    exception instead of a dead actor, and does not retry what cannot succeed. An error while folding leaves part of a shard in the
    running statistics: the actor then refuses to flush or fold anything more.
    """

    def __init__(
        self,
        options_json: dict[str, Any],
        layers: list[int],
        metadata: dict[str, str],
        threads: int,
        clip_dims: list[int] | None = None,
        credentials: dict[str, str] | None = None,
        storage: dict[str, Any] | None = None,
        out_marker: dict[str, str] | None = None,
    ) -> None:
        import torch

        torch.set_num_threads(max(1, threads))
        use_hub_credentials(credentials or {})  # the driver's hub token, before any loading
        # the driver's access to object storage, for the groups this actor writes itself
        use_storage_access(storage or {})
        #: why this node does not see the run's local directory (None: it does, or the run
        #: is in object storage): checked before anything else (embgeom_ray/shared_out.py)
        self.out_unseen = None if out_marker is None else unseen(out_marker)
        sampler()  # this process's peak private memory, sampled from now on
        self.error: Exception | None = None
        self.broken_on: str | None = None
        #: the running statistics, one accumulator for the actor's life (cleared in place by
        #: a spill or a flush: the next shards fold into memory already written)
        self.stats: SpillingStatistics | None = None
        #: a flush since the last shard folded (the next one releases the freed heap first)
        self.flushed = False
        self._reset()
        try:
            options = ExtractionOptions(**options_json)
            self.processor = ShardProcessor(options, layers, metadata, clip_dims)
            if self.processor.device == "cpu":
                reuse_freed_memory()
        except Exception as exc:
            self.error = exc

    def _reset(self) -> None:
        """Start the next flush's shards (the statistics are cleared by their ``take``)."""
        self.sample: Any = None
        self.counts = Counts()
        self.shard_ids: list[str] = []

    def _check_whole(self) -> None:
        if self.broken_on is not None:
            raise RuntimeError(
                f"this extractor failed inside shard {self.broken_on}; its statistics hold "
                "part of that shard and cannot be used"
            )

    def ready(self) -> dict[str, Any]:
        """The loaded extractor's device, padded tokens per batch and statistics budget, its
        process and node, and why its node does not see the run's local directory, where it
        was asked to check (or its loading error)."""
        if self.error is not None:
            raise self.error
        return {
            "device": self.processor.device,
            "batch_tokens": self.processor.batch_tokens,
            "statistics_budget": self.processor.statistics_budget,
            "flush_budget": self.processor.flush_budget,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "out_unseen": self.out_unseen,
        }

    def process(self, shard_json: dict[str, Any]) -> dict[str, Any]:
        """Fold one shard into the running statistics; returns its counts (small). The first
        shard after a flush first hands the heap's free memory back to the system
        (:func:`~embgeom_ray.inputs.malloc_tuning.release_freed_memory`): what the flush's and
        the spills' serialisations freed, which the allocator would otherwise keep."""
        self._check_whole()
        if self.flushed:
            self.flushed = False
            release_freed_memory()
        shard = Shard(**shard_json)
        if self.stats is None:
            # past the statistics budget, pieces go to the object store (ray.put), or are
            # merged into the host tier first, which spills its own pieces there as it fills,
            # a block at a time
            host = self.processor.host_budget

            def put(data: Any) -> Any:
                """A spill in the object store, then what the heap keeps of it handed back."""
                ref = ray.put(as_array(data))
                release_freed_memory()
                return ref

            self.stats = SpillingStatistics(
                self.processor.new_statistics(),
                self.processor.statistics_budget,
                put,
                spill_copies=True,  # ray.put copies into the object store
                host=None if host is None else HostTier(host, BlockRefs.put),
            )
        if not self.shard_ids:  # the first shard since the last flush
            self.sample = self.processor.new_sample()
        try:
            # another node's copy of a local file: not written from here to the end of its
            # digest, which is taken where its modification time is not the planned one, for
            # the driver to compare with its own copy's (inputs/copies.py)
            reading = CopyReading(shard)
            counts = self.processor.fold_shard(shard, self.stats, self.sample)
            copy = reading.result()
        except BaseException:
            self.broken_on = shard.shard_id
            raise
        self.counts.add(counts)
        self.shard_ids.append(shard.shard_id)
        return {
            **({COPY: copy} if copy is not None else {}),
            "counts": counts.to_json(),
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "unflushed": len(self.shard_ids),
            "state_bytes": self.stats.nbytes(),
            "spills": self.stats.spills,
            "merges": self.stats.merges,
            **_peaks(),
        }

    def flush(
        self, writer: Callable[..., dict[str, Any]] | None = None
    ) -> tuple[list[str], list[Any], np.ndarray | None, dict[str, Any]]:
        """(shard ids, statistics pieces, sample bytes, summed counts) since the last flush;
        the pieces are ObjectRefs of what was spilled, then the running statistics' bytes.
        With a host tier, its pieces are :class:`BlockRefs`, and its statistics are never
        serialised whole: they are written (or put in the object store) a block at a time,
        and cleared after.

        With ``writer`` (a run this actor's node reaches: the driver's
        :func:`~embgeom_ray.runs.checkpoints.write_group` bound to the run), the actor writes
        the group's files itself, ``writer(shard ids, pieces, sample)``, each spilled piece
        fetched, written and let go of in turn, and returns, in place of the pieces, the
        counts with what ``writer`` returned (the files' names and digests) and the seconds
        it took, for the driver to commit. A store that fails raises here: the job stops
        resumably, the group is not committed and its shards are redone.

        The heap's free memory goes back to the system first
        (:func:`~embgeom_ray.inputs.malloc_tuning.release_freed_memory`), so that the
        statistics' serialised copy is not made beside what the fold's freed batches left
        kept (docs/sizing.md: measured, the extractor's peak fell below what it asks). The
        accumulators start afresh afterwards.
        """
        self._check_whole()
        if not self.shard_ids:
            raise RuntimeError("flush asked of an extractor that holds no shard")
        release_freed_memory()
        pieces = self.stats.take_streamed()
        self.flushed = True
        sample = None if self.sample is None else as_array(self.sample.to_bytes())
        shard_ids, counts = list(self.shard_ids), self.counts.to_json()
        self._reset()
        try:
            if writer is None:
                last = pieces[-1]
                last = as_array(last) if isinstance(last, BYTES_LIKE) else BlockRefs.put(last)
                return shard_ids, [*pieces[:-1], last], sample, {**counts, **_peaks()}
            t0 = time.perf_counter()
            files = writer(shard_ids, _fetched(pieces), sample)
            write_s = time.perf_counter() - t0
        finally:
            self.stats.release()  # the host tier's statistics, once read
        return shard_ids, [], None, {**counts, WRITTEN: files, "write_s": write_s, **_peaks()}


#: the keys of an extractor's peak memory in its reports (:func:`_peaks`)
PEAK_KEYS = ("peak_rss_bytes", "peak_private_bytes")


def _peaks() -> dict[str, int]:
    """This process's peak memory so far, resident and private, as its reports carry it: a
    flush's too, since no shard follows the last one to report it."""
    return dict(zip(PEAK_KEYS, (peak_rss_bytes(), sampler().peak_bytes()), strict=True))


ShardExtractActor = ray.remote(ShardExtract)

#: the key of a flush's counts that carries the files an extractor wrote itself
WRITTEN = "written_group"
#: the key of a shard's result that carries its copy's digest and host
#: (:class:`~embgeom_ray.inputs.copies.CopyReading`)
COPY = "copy"


def _fetched(pieces: list[Any]) -> Iterator[Any]:
    """The statistics pieces as bytes, each spilled one fetched from the object store when it
    is written and let go of after (consumes ``pieces``); a file made a block at a time
    (:class:`BlockRefs`, the host tier's) passed as it is, its blocks read as it is written."""
    while pieces:
        piece = pieces.pop(0)
        yield ray.get(piece) if isinstance(piece, ray.ObjectRef) else piece
        del piece


def _unwrap_user_error(exc: BaseException) -> UserError | None:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, UserError):
        return cause
    return exc if isinstance(exc, UserError) else None


@dataclass
class _Worker:
    """The driver's view of one actor, from when it is asked for."""

    actor: Any
    #: what the manifest records of it (:attr:`PoolPlan.extractors`)
    record: dict[str, Any]
    #: started after the first pool: as a node joined, or in place of one lost
    added: bool = False
    #: the bytes its running statistics may hold (None: no bound)
    budget: int | None = None
    #: the shard its ``process`` call is folding; None while idle or flushing
    current: Shard | None = None
    #: shards folded since its last flush, oldest first
    unflushed: list[FoldReport] = field(default_factory=list)
    #: when the oldest unflushed shard was dispatched, and the current one (time.monotonic)
    since: float | None = None
    sent: float = 0.0
    flushing: bool = False
    #: the flush asked is its last (the queue had drained)
    last: bool = False
    #: the flush asked was forced by the statistics budget, and the age of its oldest shard
    budget_flush: bool = False
    flush_age_s: float = 0.0
    #: the host tier's merges it last reported (a count over its life)
    merges: int = 0


@dataclass
class Growth:
    """How the scheduler follows the cluster (:mod:`embgeom_ray.sizing.growth` decides): what
    one extractor asks for, the pool's ceiling, where the cluster is read and an autoscaler
    asked, and where a change of the pool is said."""

    each: Extractor
    #: the most extractors (:func:`~embgeom_ray.sizing.growth.pool_ceiling`: ``--num-workers``
    #: and the autoscaler's node groups; None: as many as the shards want)
    num_workers: int | None
    #: bytes of the head's memory kept for the job's own process
    head_reserve: int = 0
    read: Callable[[], Cluster] = read_cluster
    #: asks an autoscaler for room for these bundles; False: it could not (None: nobody to
    #: ask)
    ask: Callable[[list[dict[str, float]]], bool] | None = None
    #: one line each time the pool grows or shrinks
    say: Callable[[str], None] = log.info
    poll_s: float = POOL_POLL_S
    #: seconds with no extractor started before ``say`` tells that no node holds one
    wait_notice_s: float = WAIT_NOTICE_S


def ask_autoscaler(bundles: list[dict[str, float]]) -> bool:
    """Ray's ``request_resources``: the cluster is to have room for ``bundles`` (replacing the
    last request; ``[]`` clears it). A hint: where it fails the pool grows as nodes join
    anyway, so the failure is logged and False returned (the scheduler asks no more), not
    raised."""
    from ray.autoscaler.sdk import request_resources

    try:
        request_resources(bundles=bundles)
    except Exception as exc:  # a client without the autoscaler's API, an old GCS …
        log.warning("could not ask the autoscaler for room (%s: %s)", type(exc).__name__, exc)
        return False
    return True


def _node(node_id: str) -> str:
    """A node id as the progress lines show it (Ray's hex id, first 8 characters)."""
    return node_id[:8] or "?"


class _Scheduler:
    """The driver loop of :func:`run_shards`: start extractors where the cluster has room,
    dispatch, flush, and follow the cluster as nodes join and leave."""

    def __init__(
        self,
        config: SchedulingOptions,
        pool: PoolPlan,
        start: Callable[[], Any],
        shards: list[Shard],
        on_group: Callable[[GroupResult], None],
        on_folded: Callable[[FoldReport], None],
        on_requeued: Callable[[list[FoldReport]], None],
        on_ready: Callable[[PoolPlan], None] | None = None,
        growth: Growth | None = None,
        interval: Callable[[int], float] | None = None,
        checkpoint_writer: Callable[..., dict[str, Any]] | None = None,
        on_unseen: Callable[[str, str], None] | None = None,
        ceiling: float | None = None,
        on_requested: Callable[[PoolPlan], None] | None = None,
    ) -> None:
        self.config, self.pool, self._start = config, pool, start
        #: the age no unflushed shard is to pass where one more shard of the mean length
        #: would take it past (the sized interval's ceiling: the work a failure may cost an
        #: extractor), else None
        self.ceiling = ceiling
        #: the shards folded, and their seconds summed (from dispatch to result)
        self.folded, self.folded_s = 0, 0.0
        #: what each extractor writes its own flushes with (the driver's ``write_group``
        #: bound to the run), else None: the flushes come to the driver (``on_group`` writes
        #: them); None from the first extractor whose node does not see the run's local
        #: directory on, ``on_unseen(node id, why)`` told once
        self.checkpoint_writer = checkpoint_writer
        self.on_unseen = on_unseen
        #: seconds an extractor's oldest unflushed shard may age, for so many extractors
        #: ready (:class:`~embgeom_ray.sizing.checkpoints.Pacer`: the option's, or its floor)
        self.interval = interval or Pacer(config.checkpoint_interval).interval
        self.on_group, self.on_folded, self.on_requeued = on_group, on_folded, on_requeued
        #: called once, when the first actor has loaded its model
        self.on_ready = on_ready
        #: called once, when the first pool's actors have been asked for
        self.on_requested = on_requested
        each = Extractor(pool.num_cpus, pool.num_gpus, pool.memory_bytes)
        self.growth = growth or Growth(each, config.num_workers)
        self.pool.max_workers = self.growth.num_workers
        self.queue: deque[Shard] = deque(shards)
        self.losses: dict[str, int] = {}
        self.in_flight: dict[Any, _Worker] = {}  # process() or flush() ref -> its worker
        self.starting: dict[Any, _Worker] = {}  # ready() ref -> actor not yet ready
        self.idle: list[_Worker] = []
        self.ready = 0  # extractors ready and not lost
        self.first_started = False  # the first pool asked for: those after it are added
        self.start_failures = 0
        self.t0 = time.monotonic()
        self.last_poll = self.t0
        #: bundles last asked of the autoscaler (None: never asked), and whether asking failed
        self.asked: int | None = None
        self.ask_failed = False
        #: whether the job said that no node holds an extractor (:meth:`say_waiting`)
        self.said_waiting = False
        #: the driver's checks of other nodes' copies of the corpus, by shard id
        #: (:func:`~embgeom_ray.inputs.copies.check_copy`: a read of the shard's bytes of its
        #: own copy), in a thread off this loop; awaited before the shard's group is committed.
        #: A list: a shard requeued by a lost extractor keeps its first reading's check beside
        #: the next's (each ends the run if it fails, whichever finishes first)
        self.copy_checks: dict[str, list[Future[None]]] = {}
        self.checker: ThreadPoolExecutor | None = None
        #: set as the loop ends: a check still reading stops at its next MiB (a prompt exit)
        self.checks_cancelled = Event()

    def run(self) -> None:
        self.t0 = time.monotonic()
        try:
            self.poll(force=True)  # the first pool: what the nodes hold now
            self.pool.num_workers = len(self.starting)
            self.first_started = True
            if self.on_requested is not None:
                self.on_requested(self.pool)
            while self.queue or self.in_flight:
                if not self.in_flight and not self.starting:
                    self.start_actor()  # every actor was lost: start again rather than stall
                waiting = [*self.in_flight, *self.starting]
                ready, _ = ray.wait(waiting, num_returns=1, timeout=self.until_poll())
                if ready and ready[0] in self.starting:
                    self.on_started(ready[0])
                elif ready:
                    self.on_returned(ready[0])
                self.copies_checked()  # a copy found other ends the run now, not at its flush
                self.poll()
        finally:
            self.shutdown()

    def until_poll(self) -> float | None:
        """Seconds ``ray.wait`` may block: until the next look at the cluster while shards
        wait, else until something returns."""
        if not self.queue:
            return None
        return max(0.0, self.last_poll + self.growth.poll_s - time.monotonic())

    def poll(self, force: bool = False) -> None:
        """Every :attr:`Growth.poll_s` seconds (or now, ``force``): start the extractors the
        cluster has room for now (:func:`~embgeom_ray.sizing.growth.extractors_to_add`) and
        keep the autoscaler's request at the pool's target (where it cannot be asked, a pool
        of a known ceiling starts its whole target: those no node holds wait, as the
        autoscaler's demand). The cluster is read only when the pool wants more than it has,
        or an autoscaler's request is to be kept current."""
        now = time.monotonic()
        if not force and now - self.last_poll < self.growth.poll_s:
            return
        self.last_poll = now
        g = self.growth
        self.say_waiting(now)
        starting, queued = len(self.starting), len(self.queue)
        counts = {"running": self.ready + starting, "starting": starting, "queued": queued}
        target = pool_target(**counts, num_workers=g.num_workers)
        if target <= counts["running"] and counts["running"] and self.asked is None:
            return  # the pool has what it wants: nothing to read, nothing to ask
        held = sum(extractors_held(g.read(), g.each, g.head_reserve).values())
        if g.ask is not None and not self.ask_failed:
            bundles = autoscaler_request(g.each, target, held, self.asked)
            if bundles is not None and g.ask(bundles) is False:
                self.ask_failed = True  # asked no more: extractors waiting are the demand
            elif bundles is not None:
                self.asked = len(bundles)
        add = extractors_to_add(held, **counts, num_workers=g.num_workers, demand=self.ask_failed)
        for _ in range(add):
            self.start_actor()

    def say_waiting(self, now: float) -> None:
        """Once, :attr:`Growth.wait_notice_s` into the extraction with no extractor ready:
        where no node holds one (a GPU extractor on a cluster of CPU nodes, one asking for
        more memory than a node offers), say what one asks for and that it waits for a node
        to join; otherwise it is loading its model, and nothing is said."""
        if self.said_waiting or self.ready or now - self.t0 < self.growth.wait_notice_s:
            return
        g = self.growth
        cluster = g.read()
        if sum(extractors_held(cluster, g.each, g.head_reserve).values()):
            return
        self.said_waiting = True
        g.say(
            f"extractors: none running {now - self.t0:.0f} s into the extraction: each asks for "
            f"{g.each.describe()}, and no node of the cluster ({cluster.describe()}) holds "
            "one; the job waits for a node that does to join (an autoscaler's, or `ray start "
            "--address`); Ctrl-C or `ray job stop` ends it, and the same command resumes"
        )

    def start_actor(self) -> None:
        actor = self._start()
        requested = round(time.monotonic() - self.t0, 3)
        record = {"node_id": None, "pid": None, "requested_s": requested, "ready_s": None,
                  "lost_s": None, "shards": 0}  # fmt: skip
        self.starting[actor.ready.remote()] = _Worker(actor, record, added=self.first_started)

    def send(self, worker: _Worker, shard: Shard) -> None:
        worker.current = shard
        worker.sent = time.monotonic()
        if worker.since is None:
            worker.since = worker.sent
        self.in_flight[worker.actor.process.remote(dataclasses.asdict(shard))] = worker

    def dispatch(self) -> None:
        while self.idle and self.queue:
            self.send(self.idle.pop(), self.queue.popleft())

    def on_started(self, ref: Any) -> None:
        worker = self.starting.pop(ref)
        try:
            started = ray.get(ref)
        except ray.exceptions.RayTaskError as exc:  # loading failed: no retry helps
            user = _unwrap_user_error(exc)
            if user is not None:
                raise user from None
            raise RuntimeError(f"an extractor could not start: {exc}") from exc
        except ray.exceptions.RayActorError as exc:  # its process or node died
            self.start_failures += 1
            most = max(self.pool.num_workers, self.pool.largest_workers)
            if self.start_failures > 2 * most + 1:
                raise RuntimeError(
                    f"extractor actors keep dying while starting ({self.start_failures} "
                    f"times); last error: {exc}"
                ) from exc
            log.warning("an extractor died while starting (%s); starting another", exc)
            self.poll(force=True)  # another where the cluster has room for it
            return
        self.pool.batch_tokens = max(self.pool.batch_tokens, started["batch_tokens"])
        budget = started.get("statistics_budget")
        if budget is not None:
            self.pool.statistics_bytes = max(self.pool.statistics_bytes or 0, budget)
        # what its statistics may hold before a flush: the statistics budget, or with a host
        # tier, the tier's
        worker.budget = started.get("flush_budget", budget)
        if started.get("out_unseen") and self.checkpoint_writer is not None:
            self.checkpoint_writer = None  # its flushes, and every one after, come here
            if self.on_unseen is not None:
                self.on_unseen(started.get("node_id") or "", started["out_unseen"])
        worker.record.update(
            node_id=started.get("node_id"),
            pid=started.get("pid"),
            ready_s=round(time.monotonic() - self.t0, 3),
        )
        self.pool.extractors.append(worker.record)
        self.ready += 1
        self.pool.largest_workers = max(self.pool.largest_workers, self.ready)
        if worker.added:
            self.pool.workers_added += 1
            self.growth.say(
                f"extractors: {self.ready} (+1 on node {_node(worker.record['node_id'] or '')}; "
                f"{len(self.queue)} shards queued)"
            )
        self.idle.append(worker)
        self.dispatch()
        if self.on_ready is not None:
            on_ready, self.on_ready = self.on_ready, None
            on_ready(self.pool)

    def on_returned(self, ref: Any) -> None:
        worker = self.in_flight.pop(ref)
        try:
            result = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as exc:
            self.on_lost(worker, exc)
            return
        except ray.exceptions.RayTaskError as exc:
            user = _unwrap_user_error(exc)
            if user is not None:
                raise user from None
            raise
        if worker.flushing:
            self.on_flushed(worker, result)
        else:
            self.on_processed(worker, result)

    def flush_due(self, worker: _Worker, state_bytes: int) -> bool:
        """Flush when the queue is drained, the oldest unflushed shard is old enough, or the
        actor's running statistics hold its statistics budget or more; and, under a
        ``ceiling``, when one more shard of the mean length would age it past the ceiling
        (flushes are decided only between shards: without this, the oldest could age to the
        interval plus a shard)."""
        assert worker.since is not None
        age = time.monotonic() - worker.since
        over = worker.budget is not None and state_bytes >= worker.budget
        if over:
            self.pool.budget_flushes += 1
        worker.budget_flush, worker.flush_age_s = over, age
        return checkpoint_flush_due(
            age, self.interval(max(1, self.ready)), drained=not self.queue, over_budget=over,
            ceiling=self.ceiling, shard_mean=self.folded_s / self.folded,
        )  # fmt: skip

    def on_processed(self, worker: _Worker, result: dict[str, Any]) -> None:
        assert worker.current is not None
        report = FoldReport(
            worker.current,
            Counts.from_json(result["counts"]),
            result["pid"],
            result["node_id"],
            result["unflushed"],
            time.monotonic() - worker.sent,
        )
        worker.current = None
        if result.get(COPY) is not None:
            if self.checker is None:
                self.checker = ThreadPoolExecutor(1, thread_name_prefix="copy-check")
            check = self.checker.submit(
                check_copy, report.shard, result[COPY], self.checks_cancelled
            )
            self.copy_checks.setdefault(report.shard.shard_id, []).append(check)
        self.folded += 1
        self.folded_s += report.seconds
        merges = int(result.get("merges", 0))
        self.pool.host_merges += merges - worker.merges
        worker.merges = merges
        self.note_peaks(result)
        worker.unflushed.append(report)
        if report.unflushed != len(worker.unflushed):
            raise RuntimeError(
                f"an extractor holds {report.unflushed} unflushed shards, the driver "
                f"expected {len(worker.unflushed)}"
            )
        self.on_folded(report)
        if self.flush_due(worker, int(result.get("state_bytes", 0))):
            worker.flushing, worker.last = True, not self.queue
            writer = self.checkpoint_writer  # None: the flush comes here (no argument)
            ref = worker.actor.flush.remote() if writer is None else worker.actor.flush.remote(writer)
            self.in_flight[ref] = worker
        else:
            self.send(worker, self.queue.popleft())

    def copies_checked(self, shard_ids: Iterable[str] | None = None) -> None:
        """Raise the error of a copy check that failed (:class:`CorpusError`): of those done,
        or of ``shard_ids``'s, waited for (a group is committed only once they passed)."""
        for shard_id in list(self.copy_checks) if shard_ids is None else shard_ids:
            checks = self.copy_checks.pop(shard_id, [])
            if shard_ids is None:  # those not done yet wait for their group, or the next look
                if waiting := [check for check in checks if not check.done()]:
                    self.copy_checks[shard_id] = waiting
                checks = [check for check in checks if check.done()]
            for check in checks:
                check.result()

    def note_peaks(self, result: dict[str, Any]) -> None:
        """An extractor's peak memory, as a shard's or a flush's result reports it."""
        self.pool.extractor_peak_rss_bytes = max(
            self.pool.extractor_peak_rss_bytes, int(result.get("peak_rss_bytes") or 0)
        )
        self.pool.extractor_peak_private_bytes = max(
            self.pool.extractor_peak_private_bytes, int(result.get("peak_private_bytes") or 0)
        )

    def on_flushed(self, worker: _Worker, result: tuple[Any, ...]) -> None:
        shard_ids, stats, sample, counts = result
        expected = sorted(r.shard.shard_id for r in worker.unflushed)
        if sorted(shard_ids) != expected:
            raise RuntimeError(f"an extractor flushed shards {shard_ids}, expected {expected}")
        counts = dict(counts)
        written, write_s = counts.pop(WRITTEN, None), float(counts.pop("write_s", 0.0))
        self.note_peaks({key: counts.pop(key, 0) for key in PEAK_KEYS})
        why = {"last": worker.last, "budget": worker.budget_flush, "age_s": worker.flush_age_s}
        if written is not None:  # the extractor wrote its files: the driver commits them
            self.pool.spills += int(written["parts"]) - 1
            group = GroupResult(
                list(shard_ids), [], None, Counts.from_json(counts), written, write_s, **why
            )
        else:
            self.pool.spills += len(stats) - 1
            group = GroupResult(list(shard_ids), stats, sample, Counts.from_json(counts), **why)
        self.copies_checked(shard_ids)  # no group of a shard read from another copy's bytes
        self.on_group(group)
        self.pool.checkpoints += 1
        worker.record["shards"] += len(shard_ids)
        worker.unflushed, worker.since, worker.flushing = [], None, False
        self.idle.append(worker)
        self.dispatch()

    def on_lost(self, worker: _Worker, exc: BaseException) -> None:
        """Its unflushed shards and the one in flight go back to the queue; another extractor
        starts where the cluster has room for one (the pool shrinks where it has none: a
        node that left)."""
        lost = [r.shard for r in worker.unflushed]
        if worker.current is not None:
            lost.append(worker.current)
        self.pool.workers_lost += 1
        self.pool.shards_requeued += len(lost)
        for shard in lost:
            self.losses[shard.shard_id] = self.losses.get(shard.shard_id, 0) + 1
        worst = max(lost, key=lambda s: self.losses[s.shard_id])
        if self.losses[worst.shard_id] > self.config.max_shard_retries:
            raise RuntimeError(
                f"shard {worst.shard_id} lost its worker {self.losses[worst.shard_id]} times "
                f"(last: {type(exc).__name__}); giving up"
            ) from exc
        log.warning(
            "worker lost (%s) holding %d shard(s) not yet checkpointed (%s); queued again",
            type(exc).__name__,
            len(lost),
            ", ".join(s.shard_id for s in lost),
        )
        ray.kill(worker.actor, no_restart=True)
        self.ready -= 1
        worker.record["lost_s"] = round(time.monotonic() - self.t0, 3)
        self.growth.say(
            f"extractors: {self.ready} (-1: lost on node {_node(worker.record['node_id'] or '')}, "
            f"{len(lost)} shards queued again)"
        )
        if worker.unflushed:
            self.on_requeued(list(worker.unflushed))
        self.queue.extendleft(reversed(lost))
        self.poll(force=True)  # another where the cluster has room for one
        self.dispatch()

    def shutdown(self) -> None:
        """Kill every actor (their running tasks die with them), those still waiting for a
        node too, and clear the autoscaler's request."""
        self.pool.workers_waiting = len(self.starting)
        workers = [*self.starting.values(), *self.idle, *self.in_flight.values()]
        for worker in workers:
            ray.kill(worker.actor, no_restart=True)
        self.checks_cancelled.set()
        if self.checker is not None:
            self.checker.shutdown(wait=False, cancel_futures=True)
        if self.asked is not None and self.growth.ask is not None:
            self.growth.ask([])
            self.asked = None


def run_shards(
    extraction: ExtractionOptions,
    scheduling: SchedulingOptions,
    layers: list[int],
    metadata: dict[str, str],
    shards: list[Shard],
    on_group: Callable[[GroupResult], None],
    clip_dims: list[int] | None = None,
    on_folded: Callable[[FoldReport], None] | None = None,
    on_requeued: Callable[[list[FoldReport]], None] | None = None,
    on_ready: Callable[[PoolPlan], None] | None = None,
    pool: Pool | None = None,
    on_resized: Callable[[str], None] | None = None,
    interval: Callable[[int], float] | None = None,
    checkpoint_writer: Callable[..., dict[str, Any]] | None = None,
    out_marker: dict[str, str] | None = None,
    on_unseen: Callable[[str, str], None] | None = None,
    ceiling: float | None = None,
    on_requested: Callable[[PoolPlan], None] | None = None,
) -> PoolPlan:
    """Process ``shards`` on a pool of extractor actors: ``pool``, as the job's sizing decided
    it (:func:`~embgeom_ray.sizing.size_extractors`: actors, CPUs, GPUs, the memory each asks
    Ray for, its statistics budget, its batch tokens), else :func:`plan_pool`'s with the
    options' budgets.

    ``on_group`` receives every flush (each shard in exactly one of them, once all is done);
    ``on_folded`` each shard as an actor folds it (progress), ``on_requeued`` the folded
    shards an actor lost before flushing them (they are folded again later); ``on_ready`` is
    called once with the pool's plan, when the first actor has loaded its model and been
    given its first shard; ``on_requested`` once with it, when the first pool's actors have
    been asked for (before any has loaded its model); ``on_resized`` gets one line each time the pool grows or shrinks
    (module docstring: the pool follows the cluster); ``interval(n)`` the seconds between an
    extractor's flushes while ``n`` extractors are ready (default: ``--checkpoint-interval``);
    ``checkpoint_writer``: where each extractor writes its own flushes' files
    (:func:`~embgeom_ray.runs.checkpoints.write_group` bound to the run; ``on_group`` then
    commits them), else None; ``out_marker``: on a local path, the marker each extractor
    checks when it starts (:mod:`embgeom_ray.shared_out`): from the first whose node does not
    see it, ``on_unseen(node id, why)`` is told and the flushes come to ``on_group``;
    ``ceiling``: an extractor also flushes where one more shard of the mean length would age
    its oldest unflushed shard past this many seconds (the sized interval's ceiling), so that
    the work a failure costs it stays within it wherever a shard does.
    """
    plan = plan_pool(scheduling, len(shards)) if pool is None else pool_plan(pool)
    if not shards:
        return plan
    options: dict[str, Any] = {"num_cpus": plan.num_cpus, "max_restarts": 0}
    if plan.num_gpus:
        options["num_gpus"] = plan.num_gpus
    if plan.memory_bytes:
        options["memory"] = plan.memory_bytes
    extraction = extraction.model_copy(update={"gpus_per_worker": int(plan.num_gpus) or 1})
    if pool is not None:  # the actors get the decided budgets
        extraction = extraction.model_copy(
            update={
                "worker_memory": pool.memory,
                "statistics_memory": pool.statistics,
                "host_statistics_memory": pool.host_statistics,
                "batch_tokens": pool.batch_tokens,
            }
        )
    actor_cls = ShardExtractActor.options(**options)
    storage = storage_access() if checkpoint_writer is not None else None
    args = (
        extraction.model_dump(), layers, metadata, plan.num_cpus, clip_dims, hub_credentials(),
        storage, out_marker if checkpoint_writer is not None else None,
    )  # fmt: skip
    each = Extractor(plan.num_cpus, plan.num_gpus, plan.memory_bytes)
    possible = extractors_possible(read_autoscaler_groups() or (), each)
    growth = Growth(
        each,
        pool_ceiling(scheduling.num_workers, possible),
        head_reserve=0 if pool is None else pool.head_reserve,
        # a private local Ray has no autoscaler to ask
        ask=None if started_private_local() else ask_autoscaler,
        say=on_resized or log.info,
        poll_s=POOL_POLL_S,
    )
    _Scheduler(
        scheduling,
        plan,
        lambda: actor_cls.remote(*args),
        shards,
        on_group,
        on_folded or (lambda _report: None),
        on_requeued or (lambda _reports: None),
        on_ready,
        growth,
        interval,
        checkpoint_writer,
        on_unseen,
        ceiling,
        on_requested,
    ).run()
    return plan
