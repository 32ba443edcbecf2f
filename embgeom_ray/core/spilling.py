"""An extractor's running statistics under a byte budget (``--worker-memory``).

The per-type state grows with the token types seen: a shard of a 128k-vocabulary corpus can
alone take an accumulator far past any budget. :class:`SpillingStatistics` checks the bytes
the accumulator holds (:meth:`~embgeom_ray.core.statistics.EmbeddingStatistics.held_bytes`)
after every batch; at the budget it serialises the accumulator, hands the bytes to ``spill``
(the actor puts them in Ray's object store, which can spill to disk) and clears it. A flush
returns the spilled pieces and the last accumulator, all of the same shards, which the
checkpoint group keeps as parts and the reduce merges in order, so nothing is lost and every
statistic is the same to rounding (Chan's merge of consecutive parts).

One accumulator serves the extractor's whole life: a spill or a flush clears it in place
(:meth:`~embgeom_ray.core.statistics.EmbeddingStatistics.clear`), so the next interval folds
into memory already written, with no doublings and no fresh pages. Folding into fresh
statistics cost 1.2-1.9x folding into statistics that had seen the batch's types
(``bench.vocabulary``, docs/benchmarks.md); a new accumulator per interval made every interval
under a budget a first one.

Memory of the extractor: the budget plus one batch's growth (at most B · T new types: under a
budget the per-type arrays are allocated once for the budget's slots and grow past them
only by a batch's need, ``fit_budget``) and one
serialised copy (the spills' buffer, kept for the next spill when ``spill`` copies, as
``ray.put`` does); the object store holds the spilled pieces until the flush.
Without a budget: the largest state an interval between flushes reached.

**A host tier** (:class:`HostTier`, ``--host-statistics-memory``): where the budget σ is small
beside the types the text meets (a GPU's memory against a 128k vocabulary), each spill holds
mostly the same frequent types again, and a flush of its pieces writes those types once per
spill. With a tier, each spill is merged on the host, type by type, into statistics of at most
H bytes, and a flush writes each type once per H bytes instead: the pieces spilled to the
object store are the tier's own, when it fills. The tier's pieces are never serialised whole:
each is made a block at a time as it is spilled or written
(:class:`~embgeom_ray.core.statistics_io.StreamedStatistics`, the same bytes as one
serialisation). Memory: the tier's H more, and one block of
:data:`~embgeom_ray.core.statistics_fields.STREAM_BLOCK_BYTES` while it spills or is written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from .statistics import EmbeddingStatistics
from .statistics_io import StreamedStatistics


class Accumulator(Protocol):
    """What the extractor folds into (an EmbeddingStatistics or its per-device split)."""

    def update(
        self,
        hidden: Sequence[torch.Tensor],
        token_ids: torch.Tensor,
        keep: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        finite: Sequence[bool] | None = None,
    ) -> None: ...

    def held_bytes(self) -> int: ...

    def to_bytes(self, into: np.ndarray | None = None) -> bytearray | np.ndarray: ...

    def clear(self) -> None: ...

    def fit_budget(self, budget: int) -> None: ...


class SpilledPieces:
    """Serialised statistics handed to ``spill`` in order, and the buffer they are built in.

    ``spill(data)`` keeps serialised statistics and returns a handle (an ObjectRef, or the
    bytes themselves). ``spill_copies``: ``spill`` copies what it is given (``ray.put`` does),
    so one buffer serves every spill, kept between them (no fresh pages to fault in each
    time), with room for pieces a quarter larger than the first.
    """

    def __init__(
        self,
        spill: Callable[[Any], Any] = lambda data: data,
        spill_copies: bool = False,
        stream: bool = False,
    ) -> None:
        #: ``stream``: ``spill`` is given the statistics as :class:`StreamedStatistics` (their
        #: file a block at a time), which it must have read when it returns; else their bytes
        self.spill, self.spill_copies, self.stream = spill, spill_copies, stream
        self.buffer: np.ndarray | None = None
        self.handles: list[Any] = []  # since the last take
        self.nbytes = 0  # their bytes
        self.count = 0  # pieces spilled over the life

    def put(self, stats: Accumulator) -> None:
        """Serialise ``stats``, clear them (their memory kept), and spill the bytes (or, with
        ``stream``, spill them as their file's blocks, then clear them)."""
        if self.stream:
            piece = StreamedStatistics(stats)  # type: ignore[arg-type]
            self.handles.append(self.spill(piece))
            stats.clear()
            self.nbytes += piece.size
            self.count += 1
            return
        data = stats.to_bytes(self.buffer)
        stats.clear()
        if self.spill_copies and not isinstance(data, np.ndarray):
            # the next spills' buffer, with room for larger pieces (pages beyond what a
            # spill writes are never touched)
            self.buffer = np.empty(len(data) + len(data) // 4, dtype=np.uint8)
        self.nbytes += len(data)
        self.handles.append(self.spill(data))
        self.count += 1

    def take(self, last: Accumulator) -> list[Any]:
        """The handles spilled since the last take and ``last``'s own bytes, in that order;
        ``last`` is cleared. The last bytes are built in the buffer when there is one (the
        caller hands them on, as ``spill`` would, before the next spill reuses it)."""
        pieces = [*self.handles, last.to_bytes(self.buffer)]
        last.clear()
        self.handles, self.nbytes = [], 0
        return pieces


class SpillingStatistics:
    """Running statistics that spill to ``spill`` when they reach ``budget`` bytes.

    ``accumulator`` is empty statistics (cleared, never replaced); ``spill`` and
    ``spill_copies`` as :class:`SpilledPieces` takes them; ``host``: a :class:`HostTier` the
    spills are merged into instead.
    """

    def __init__(
        self,
        accumulator: Accumulator,
        budget: int | None,
        spill: Callable[[bytes | bytearray | np.ndarray], Any] = lambda data: data,
        *,
        spill_copies: bool = False,
        host: HostTier | None = None,
    ) -> None:
        self.current, self.budget = accumulator, budget
        if budget is not None:
            accumulator.fit_budget(budget)
        #: the accumulator's own spills (none where a host tier takes them)
        self.pieces = SpilledPieces(spill, spill_copies)
        #: where spills are merged before any piece goes to ``spill`` (None: no tier)
        self.host = host

    @property
    def spilled(self) -> list[Any]:
        """The handles of the accumulator's own spills since the last :meth:`take`."""
        return self.pieces.handles

    @property
    def spilled_bytes(self) -> int:
        """Their bytes."""
        return self.pieces.nbytes

    @property
    def spills(self) -> int:
        """Pieces handed to ``spill`` over the accumulator's life (for the manifest): the
        accumulator's own, or the host tier's."""
        return self.pieces.count + (0 if self.host is None else self.host.pieces.count)

    @property
    def merges(self) -> int:
        """Spills of the accumulator merged into the host tier (0 without one)."""
        return 0 if self.host is None else self.host.merges

    def update(
        self,
        hidden: Sequence[torch.Tensor],
        token_ids: torch.Tensor,
        keep: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        finite: Sequence[bool] | None = None,
    ) -> None:
        """Fold one batch; spill the accumulator (or merge it into the host tier) once it
        holds ``budget`` bytes or more."""
        self.current.update(hidden, token_ids, keep, positions, finite)
        if self.budget is not None and self.current.held_bytes() >= self.budget:
            if self.host is not None:
                self.host.absorb(self.current)
                self.current.clear()
            else:
                self.pieces.put(self.current)

    def nbytes(self) -> int:
        """The bytes the accumulator holds plus what it spilled since the last :meth:`take`
        (with a host tier: plus what the tier holds and spilled)."""
        if self.host is not None:
            return self.current.held_bytes() + self.host.nbytes()
        return self.current.held_bytes() + self.pieces.nbytes

    def take(self) -> list[Any]:
        """The spilled handles and the accumulator's own bytes (last), in fold order; the
        accumulator is cleared. A flush then holds the accumulator and one serialised copy, as
        a spill does (:meth:`SpilledPieces.take`). With a host tier, the accumulator is merged
        into it first, and the pieces are the tier's (:meth:`HostTier.take`)."""
        if self.host is not None:
            return self._merged_into_host().take()
        return self.pieces.take(self.current)

    def take_streamed(self) -> list[Any]:
        """:meth:`take`, but with a host tier the last piece is the tier's statistics as
        :class:`StreamedStatistics` (their file a block at a time: no serialised copy of H),
        which the caller reads and then :meth:`release`s. Without a tier, :meth:`take`."""
        if self.host is None:
            return self.take()
        return self._merged_into_host().take_streamed()

    def _merged_into_host(self) -> HostTier:
        """The host tier, the accumulator merged into it and cleared."""
        assert self.host is not None
        self.host.absorb(self.current)
        self.current.clear()
        return self.host

    def release(self) -> None:
        """After :meth:`take_streamed`'s pieces are read: clear the host tier (no-op without)."""
        if self.host is not None:
            self.host.release()


class HostTier:
    """Spilled statistics merged on the host, type by type, up to ``budget`` bytes
    (``--host-statistics-memory``; the module docstring).

    :meth:`absorb` merges an accumulator (an :class:`EmbeddingStatistics` on any device, or
    the CPU combination of a :class:`~embgeom_ray.core.split_statistics.SplitStatistics`'s
    parts) into ``merged``, on the CPU, by :meth:`EmbeddingStatistics.merge` (Chan's update for
    the moments, sums for the rest: the same merge the reduce makes of pieces, so the
    statistics are those of one pass to float64 rounding). Where the merge would take
    ``merged`` past ``budget`` (:meth:`EmbeddingStatistics.held_bytes_after_merge`: one slot
    for each type it does not hold yet), ``merged`` is spilled first
    (:meth:`SpilledPieces.put`: serialised, handed to ``spill``, the object store, and cleared
    in place). :meth:`take` returns the pieces spilled since the last one and ``merged``'s own
    bytes, in merge order; :meth:`take_streamed` the same with ``merged`` as
    :class:`StreamedStatistics`, cleared by :meth:`release` once read.

    ``spill(piece)`` is given each spill as :class:`StreamedStatistics` (the file of ``merged``
    a block at a time) and must have read it when it returns (the Ray layer puts each block in
    the object store); it returns the piece's handle. The default keeps the file's bytes.

    Memory: ``merged``, allocated once for ``budget`` (:meth:`EmbeddingStatistics.fit_budget`;
    the budget bounds what it holds, its merges' scratch included, which is a few blocks of
    :data:`~embgeom_ray.core.statistics.CPU_ROW_BLOCK` rows of d float64s at most), one block
    of its file while it spills or is written
    (:data:`~embgeom_ray.core.statistics_fields.STREAM_BLOCK_BYTES`), and, where the accumulator
    is on a GPU, its rows' copy on the host during a merge.
    """

    def __init__(self, budget: int, spill: Callable[[StreamedStatistics], Any] | None = None) -> None:
        self.budget = int(budget)
        self.merged: EmbeddingStatistics | None = None
        #: the tier's own spills, when it fills
        self.pieces = SpilledPieces(spill or file_bytes, stream=True)
        self.merges = 0  # accumulators merged in over its life

    @property
    def spilled(self) -> list[Any]:
        """The handles of the tier's spills since the last :meth:`take`."""
        return self.pieces.handles

    @torch.inference_mode()  # the fold's arrays may be inference tensors, and so the tier's
    def absorb(self, accumulator: Accumulator) -> None:
        """Merge ``accumulator``'s statistics in (it is left as it was: the caller clears it)."""
        piece = accumulator if isinstance(accumulator, EmbeddingStatistics) else None
        if piece is None:  # per-device parts: their CPU combination
            piece = accumulator.combined()  # type: ignore[attr-defined]
        if self.merged is None:
            # the tier's statistics, of the accumulator's layers and options, on the CPU,
            # with the slots of its budget allocated once
            self.merged = EmbeddingStatistics.empty(piece.header())
            self.merged.fit_budget(self.budget)
        elif self.merged.num_types and self.merged.held_bytes_after_merge(piece) > self.budget:
            self.pieces.put(self.merged)
        self.merged.merge(piece)
        self.merges += 1

    def nbytes(self) -> int:
        """What the tier holds plus what it spilled since the last :meth:`take`."""
        held = 0 if self.merged is None else self.merged.held_bytes()
        return held + self.pieces.nbytes

    def take(self) -> list[Any]:
        """The spilled handles and ``merged``'s own bytes (last), in merge order; the tier is
        cleared (its memory kept)."""
        pieces = self.take_streamed()
        pieces[-1] = file_bytes(pieces[-1])
        self.release()
        return pieces

    def take_streamed(self) -> list[Any]:
        """The spilled handles and ``merged`` as :class:`StreamedStatistics` (last), in merge
        order; the tier is cleared by :meth:`release`, once that is read."""
        if self.merged is None:
            raise RuntimeError("take() of a host tier that has absorbed nothing")
        pieces = [*self.pieces.handles, StreamedStatistics(self.merged)]
        self.pieces.handles, self.pieces.nbytes = [], 0
        return pieces

    def release(self) -> None:
        """Clear ``merged`` (its memory kept), after :meth:`take_streamed`'s last piece is read."""
        if self.merged is not None:
            self.merged.clear()


def file_bytes(piece: StreamedStatistics) -> bytearray:
    """The file of streamed statistics as bytes (one copy of it)."""
    out = bytearray(piece.size)
    at = 0
    for block in piece:
        out[at : at + block.nbytes] = memoryview(block).cast("B")
        at += block.nbytes
    return out
