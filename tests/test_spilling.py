"""An extractor's statistics under a byte budget (core/spilling.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embgeom_ray.core.spilling import SpillingStatistics
from embgeom_ray.core.statistics import EmbeddingStatistics, state_bytes
from tests.test_statistics import assert_same_state

LAYERS, D = [0, 2], 8


def batches(n: int, vocab: int, offset: float = 0.0):
    rng = np.random.default_rng(5)
    for _ in range(n):
        h = torch.as_tensor(rng.normal(size=(len(LAYERS), 4, 16, D)) + offset)
        yield h, torch.as_tensor(rng.integers(0, vocab, size=(4, 16)))


@pytest.mark.parametrize("offset", [0.0, 1e4])
def test_spilled_pieces_merge_into_the_one_pass_statistics(offset):
    """Under a budget the accumulator never holds more than the budget plus one batch's
    growth; its pieces, merged in order, equal one pass to float64 rounding."""

    def new() -> EmbeddingStatistics:
        return EmbeddingStatistics(LAYERS, D, max_positions=16, initial_types=8)

    budget = state_bytes(len(LAYERS), D, 120, 16)  # room for ~120 types
    one_batch = state_bytes(len(LAYERS), D, 64, 16) - state_bytes(len(LAYERS), D, 0, 16)
    spilling = SpillingStatistics(new, budget)
    one = new()
    held = []
    for h, ids in batches(40, 2000, offset):
        spilling.update(h, ids)
        one.update(h, ids)
        held.append(spilling.current.nbytes())
    assert spilling.spills >= 3
    assert max(held) < budget + 2 * one_batch + new().nbytes()  # doubling: at most 2x a batch
    assert spilling.nbytes() == spilling.current.nbytes() + spilling.spilled_bytes
    pieces = spilling.take()
    assert len(pieces) == spilling.spills + 1 and spilling.spilled == []
    merged = EmbeddingStatistics.from_bytes(pieces[0])
    for data in pieces[1:]:
        merged.merge(EmbeddingStatistics.from_bytes(data))
    assert merged.token_count() == one.token_count() == 40 * 64
    assert_same_state(merged, one, rtol=1e-11, comoment_rtol=1e-11)


def test_without_a_budget_nothing_spills():
    spilling = SpillingStatistics(lambda: EmbeddingStatistics(LAYERS, D), None)
    for h, ids in batches(5, 50):
        spilling.update(h, ids)
    assert spilling.spills == 0 and len(spilling.take()) == 1
