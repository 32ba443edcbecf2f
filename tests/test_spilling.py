"""An extractor's statistics under a byte budget (core/spilling.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embgeom_ray.core.spilling import SpillingStatistics
from embgeom_ray.core.statistics import EmbeddingStatistics, state_bytes
from tests.test_statistics import assert_same_state

LAYERS, D = [0, 2], 8


def batches(n: int, vocab: int, offset: float = 0.0, seed: int = 5):
    rng = np.random.default_rng(seed)
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


def test_a_fresh_accumulator_has_room_for_the_types_of_the_last_one():
    """After a flush (or a spill) the next accumulator is allocated for as many types as the
    last held (no doublings from empty), within half the budget, and folds the same."""
    spilling = SpillingStatistics(lambda: EmbeddingStatistics(LAYERS, D, initial_types=1), None)
    for h, ids in batches(5, 300):
        spilling.update(h, ids)
    held = spilling.current.num_types
    pieces = spilling.take()
    assert spilling.current.num_types == 0 and spilling.current._capacity() >= held > 100
    one = EmbeddingStatistics(LAYERS, D, initial_types=1)
    for h, ids in batches(3, 300, seed=9):
        spilling.update(h, ids)
        one.update(h, ids)
    assert_same_state(EmbeddingStatistics.from_bytes(spilling.take()[-1]), one)
    assert len(pieces) == 1
    # under a budget: at most half of it reserved
    budget = state_bytes(len(LAYERS), D, 120, 0)
    spilling = SpillingStatistics(lambda: EmbeddingStatistics(LAYERS, D, initial_types=1), budget)
    for h, ids in batches(20, 2000):
        spilling.update(h, ids)
    assert spilling.spills >= 2
    spilling.take()
    assert 0 < spilling.current.nbytes() <= budget / 2 + EmbeddingStatistics(LAYERS, D, initial_types=1).nbytes()
