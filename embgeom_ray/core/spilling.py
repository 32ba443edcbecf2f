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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch


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


class SpillingStatistics:
    """Running statistics that spill to ``spill`` when they reach ``budget`` bytes.

    ``accumulator`` is empty statistics (cleared, never replaced); ``spill(data)`` keeps
    serialised statistics and returns a handle (an ObjectRef, or the bytes themselves);
    ``spilled_bytes`` sums what was spilled since the last :meth:`take`. ``spill_copies``:
    ``spill`` copies what it is given (``ray.put`` does), so one buffer serves every spill
    (kept between spills: no fresh pages to fault in each time).
    """

    def __init__(
        self,
        accumulator: Accumulator,
        budget: int | None,
        spill: Callable[[bytes | bytearray | np.ndarray], Any] = lambda data: data,
        *,
        spill_copies: bool = False,
    ) -> None:
        self.current, self.budget, self.spill = accumulator, budget, spill
        self.spill_copies = spill_copies
        self._buffer: np.ndarray | None = None  # reused by spills when spill copies
        if budget is not None:
            accumulator.fit_budget(budget)
        self.spilled: list[Any] = []
        self.spilled_bytes = 0
        self.spills = 0  # pieces spilled over the accumulator's life (for the manifest)

    def update(
        self,
        hidden: Sequence[torch.Tensor],
        token_ids: torch.Tensor,
        keep: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        finite: Sequence[bool] | None = None,
    ) -> None:
        """Fold one batch; spill the accumulator once it holds ``budget`` bytes or more."""
        self.current.update(hidden, token_ids, keep, positions, finite)
        if self.budget is not None and self.current.held_bytes() >= self.budget:
            data = self.current.to_bytes(self._buffer)
            self.current.clear()
            if self.spill_copies and not isinstance(data, np.ndarray):
                # the next spills' buffer, with room for larger pieces (pages beyond what a
                # spill writes are never touched)
                self._buffer = np.empty(len(data) + len(data) // 4, dtype=np.uint8)
            self.spilled_bytes += len(data)
            self.spilled.append(self.spill(data))
            self.spills += 1

    def nbytes(self) -> int:
        """The bytes the accumulator holds plus what it spilled since the last :meth:`take`."""
        return self.current.held_bytes() + self.spilled_bytes

    def take(self) -> list[Any]:
        """The spilled handles and the accumulator's own bytes (last), in fold order; the
        accumulator is cleared. The last bytes are built in the spills' buffer when there is
        one (the caller hands them on, as ``spill`` would, before the next spill reuses it):
        a flush then holds the accumulator and one serialised copy, as a spill does."""
        pieces = [*self.spilled, self.current.to_bytes(self._buffer)]
        self.current.clear()
        self.spilled, self.spilled_bytes = [], 0
        return pieces
