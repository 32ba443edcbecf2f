"""Statistics folded where the hidden states are: one part per device, for models split
across GPUs (``--gpus-per-worker N``).

A model loaded across N GPUs (a device map) produces each layer's hidden states on the GPU
that holds the block that computed them. Copying every layer to one GPU would cost
B · T · L · d numbers of inter-GPU traffic per batch and put every layer's fold on one device;
instead :class:`SplitStatistics` keeps one :class:`~embgeom_ray.core.statistics.EmbeddingStatistics`
part per device, holding the layers whose hidden states live there (a part by layers, with
their per-layer state and every token id: :class:`~embgeom_ray.core.statistics.StatisticsPart`),
made at the first batch from the hidden states' devices. A flush combines the parts on the CPU
(:meth:`~embgeom_ray.core.statistics.EmbeddingStatistics.combine`) into exactly the statistics
one device would have folded (each layer's fold is independent of the others').

Memory: each device holds the per-type state of its own layers only,
8 · L_k · (V_seen · (2d + 2) + d² + …) bytes for its L_k layers; a flush briefly holds the
combined statistics on the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .statistics import EmbeddingStatistics, StatisticsPart


class SplitStatistics:
    """Per-device parts of one measurement's statistics (module docstring).

    ``groups``: the layer groups to fold apart, as lists of layers (for tests and for a
    caller that knows the map); by default the groups are the devices of the first batch's
    hidden states. ``options``: the keywords of every part's
    :class:`~embgeom_ray.core.statistics.EmbeddingStatistics` (max_positions, metadata,
    clip_dims, comoment_precision).
    """

    def __init__(
        self,
        layers: Sequence[int],
        dim: int,
        *,
        groups: Sequence[Sequence[int]] | None = None,
        **options: Any,
    ) -> None:
        self.layers = [int(x) for x in layers]
        self.dim = int(dim)
        self.options = options
        self.groups = None if groups is None else [[int(x) for x in g] for g in groups]
        if self.groups is not None and sorted(x for g in self.groups for x in g) != sorted(
            self.layers
        ):
            raise ValueError(f"layer groups {self.groups} do not cover the layers {self.layers}")
        self.parts: list[tuple[list[int], EmbeddingStatistics]] = []
        self.budget: int | None = None

    def fit_budget(self, budget: int) -> None:
        """Each part's arrays get the slots that fit its share of ``budget`` (its layers'
        share: every part holds every type seen; :meth:`EmbeddingStatistics.fit_budget`)."""
        self.budget = int(budget)
        for _, part in self.parts:
            part.fit_budget(self.budget * len(part.layers) // len(self.layers))

    def held_bytes(self) -> int:
        return sum(part.held_bytes() for _, part in self.parts)

    def clear(self) -> None:
        """Every part forgets what it has seen, keeping its memory
        (:meth:`EmbeddingStatistics.clear`)."""
        for _, part in self.parts:
            part.clear()

    @property
    def num_types(self) -> int:
        return max((part.num_types for _, part in self.parts), default=0)

    def _make_parts(self, hidden: Sequence[torch.Tensor]) -> None:
        if self.groups is not None:
            by_group = self.groups
            devices = [hidden[self.layers.index(g[0])].device for g in by_group]
        else:
            found: dict[torch.device, list[int]] = {}
            for layer, h in zip(self.layers, hidden, strict=True):
                found.setdefault(h.device, []).append(layer)
            by_group, devices = list(found.values()), list(found)
        whole = len(by_group) == 1
        for group, device in zip(by_group, devices, strict=True):
            ordered = [x for x in self.layers if x in group]
            partition = None if whole else StatisticsPart(tuple(self.layers), (0, None), True)
            part = EmbeddingStatistics(
                ordered, self.dim, device=device, partition=partition, **self.options
            )
            if self.budget is not None:
                part.fit_budget(self.budget * len(ordered) // len(self.layers))
            self.parts.append(([self.layers.index(x) for x in ordered], part))

    def update(
        self,
        hidden: Sequence[torch.Tensor],
        token_ids: torch.Tensor,
        keep: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        finite: Sequence[bool] | None = None,
    ) -> None:
        """Fold one batch: each part folds its layers' hidden states on their device (with
        their layers' ``finite`` flags, when given)."""
        if len(hidden) != len(self.layers):
            raise ValueError(
                f"expected {len(self.layers)} layers' hidden states, got {len(hidden)}"
            )
        if not self.parts:
            self._make_parts(hidden)
        for index, part in self.parts:
            flags = None if finite is None else [finite[i] for i in index]
            part.update([hidden[i] for i in index], token_ids, keep, positions, flags)

    def nbytes(self) -> int:
        return sum(part.nbytes() for _, part in self.parts)

    def combined(self) -> EmbeddingStatistics:
        """The parts as one statistics object on the CPU (exactly a one-device fold)."""
        if not self.parts:
            return EmbeddingStatistics(self.layers, self.dim, initial_types=1, **self.options)
        if len(self.parts) == 1:
            return EmbeddingStatistics.from_bytes(self.parts[0][1].to_bytes())
        return EmbeddingStatistics.combine(
            [EmbeddingStatistics.from_bytes(part.to_bytes()) for _, part in self.parts]
        )

    def to_bytes(self, into: np.ndarray | None = None) -> bytearray | np.ndarray:
        return self.combined().to_bytes(into)

    @property
    def devices(self) -> Mapping[int, str]:
        """Layer → the device its part folds on (empty before the first batch)."""
        return {x: str(part.device) for _, part in self.parts for x in part.layers}
