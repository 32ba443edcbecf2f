"""Parts of one measurement's statistics: by layers, by a range of token ids, with or
without the per-layer state.

Per-type rows are independent of each other, so the statistics split exactly by token id:
:meth:`~embgeom_ray.core.statistics.EmbeddingStatistics.select` keeps some layers, the types
whose ids lie in [lo, hi) and, optionally, the per-layer moments; the header's ``partition``
record says which part of which measurement a file holds (:class:`StatisticsPart`). Parts of one
measurement merge with parts that hold the same :class:`StatisticsPart` (Chan, Golub & LeVeque's
update per row), and :meth:`~embgeom_ray.core.statistics.EmbeddingStatistics.combine` puts
parts of disjoint token ranges (and layers) back together, exactly: selecting and combining is
a copy. This module holds the record and the checks that a part asked for lies within what is
held (:func:`requested_part`) and that parts join into one (:func:`joint_part`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import StatisticsMismatchError


@dataclass(frozen=True)
class StatisticsPart:
    """Which part of a measurement a statistics object holds (the header's ``partition``).

    Attributes:
        of_layers: the whole measurement's layers, in order; the part holds its own
            ``layers``, a subset of these.
        token_range: (lo, hi): the part holds the per-type rows of the token ids t with
            lo ≤ t < hi; hi None: no upper bound, so (0, None) is every token id.
        layer_state: whether the part holds the per-layer fields (n, mean, co-moment, tails,
            positions, nonfinite) of its layers; a part without them reads as n = 0 there.

    A statistics object that holds everything has no partition (``None``); version-1 files
    are such wholes.
    """

    of_layers: tuple[int, ...]
    token_range: tuple[int, int | None] = (0, None)
    layer_state: bool = True

    def __post_init__(self) -> None:
        lo, hi = self.token_range
        if lo < 0 or (hi is not None and hi < lo):
            raise ValueError(f"token range [{lo}, {hi}) is not a range of token ids")

    def to_json(self) -> dict[str, Any]:
        return {
            "of_layers": list(self.of_layers),
            "token_range": list(self.token_range),
            "layer_state": self.layer_state,
        }

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> StatisticsPart:
        lo, hi = record["token_range"]
        return cls(
            tuple(int(x) for x in record["of_layers"]),
            (int(lo), None if hi is None else int(hi)),
            bool(record["layer_state"]),
        )


def range_key(token_range: tuple[int, int | None]) -> tuple[int, float]:
    """Sort key of token ranges: by lo, then hi (None: unbounded, last)."""
    lo, hi = token_range
    return lo, math.inf if hi is None else hi


def range_text(token_range: tuple[int, int | None]) -> str:
    lo, hi = token_range
    return f"[{lo}, {'∞' if hi is None else hi})"


def requested_part(
    held_layers: Sequence[int],
    held: StatisticsPart | None,
    layers: Sequence[int] | None,
    token_range: tuple[int, int | None],
    layer_state: bool,
) -> tuple[list[int], StatisticsPart | None]:
    """(the layers kept, in held order; the part's :class:`StatisticsPart`, None for a whole) of
    the part of statistics holding ``held_layers`` and the part ``held`` (None: a whole) that
    holds ``layers`` (None: all held), the types in ``token_range`` and, if ``layer_state``,
    the per-layer fields; after checking that the part lies within what is held (an empty
    token range lies anywhere: it holds no rows)."""
    held_layers = list(held_layers)
    of_layers = tuple(held_layers) if held is None else held.of_layers
    own = (0, None) if held is None else held.token_range
    want = set(held_layers if layers is None else (int(x) for x in layers))
    unknown = sorted(want - set(held_layers))
    if unknown:
        raise ValueError(f"layers {unknown} are not held; layers are {held_layers}")
    kept = [x for x in held_layers if x in want]
    (lo, hi), (own_lo, own_hi) = token_range, own
    outside = lo < own_lo or (own_hi is not None and (hi is None or hi > own_hi))
    if outside and lo != hi:
        raise ValueError(
            f"token range {range_text((lo, hi))} is not within the held {range_text(own)}"
        )
    if layer_state and not (held is None or held.layer_state):
        raise ValueError("these statistics hold no per-layer moments to select")
    whole = tuple(kept) == of_layers and (lo, hi) == (0, None) and layer_state
    return kept, None if whole else StatisticsPart(of_layers, (lo, hi), layer_state)


class HeldPart(Protocol):
    """What :func:`joint_part` reads of each part: its layers, its token range and whether it
    holds the per-layer state (:class:`~embgeom_ray.core.statistics.EmbeddingStatistics`)."""

    @property
    def layers(self) -> Sequence[int]: ...

    @property
    def token_range(self) -> tuple[int, int | None]: ...

    @property
    def holds_layer_state(self) -> bool: ...


def joint_part(
    parts: Sequence[HeldPart], layers: Sequence[int]
) -> tuple[tuple[int, int | None], bool]:
    """(token range, whether per-layer moments are held) of the union of ``parts``, after
    checking that for each of ``layers`` the parts holding it have disjoint token ranges that
    join into one range, the same for every layer, and that one of them (for every layer) or
    none (for every layer) holds its per-layer moments."""
    joint: tuple[int, int | None] | None = None
    states = []
    for layer in layers:
        holders = [p for p in parts if layer in p.layers]
        ranges = sorted((p.token_range for p in holders), key=range_key)
        for (_, hi_a), (lo_b, _) in itertools.pairwise(ranges):
            if hi_a is None or hi_a > lo_b:
                raise StatisticsMismatchError(
                    f"parts holding layer {layer} overlap in token ids "
                    f"({', '.join(range_text(s) for s in ranges)})"
                )
            if hi_a < lo_b:
                raise StatisticsMismatchError(
                    f"parts holding layer {layer} leave token ids [{hi_a}, {lo_b}) out"
                )
        span = (ranges[0][0], ranges[-1][1])
        if joint is not None and span != joint:
            raise StatisticsMismatchError(
                f"layer {layer}'s parts hold token ids {range_text(span)}, "
                f"layer {layers[0]}'s {range_text(joint)}"
            )
        joint = span
        states.append(sum(p.holds_layer_state for p in holders))
    if joint is None or max(states) > 1 or min(states) != max(states):
        raise StatisticsMismatchError(
            "each layer's per-layer moments must come from one part (or, for every "
            "layer, from none); parts holding them, by layer: "
            + ", ".join(f"{x}: {s}" for x, s in zip(layers, states, strict=True))
        )
    return joint, states[0] == 1
