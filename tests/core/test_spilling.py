"""An extractor's statistics under a byte budget (core/spilling.py) and the accumulator they
keep for an extractor's life (EmbeddingStatistics.clear / fit_budget)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embgeom_ray.core.spilling import SpillingStatistics
from embgeom_ray.core.split_statistics import SplitStatistics
from embgeom_ray.core.statistics import EmbeddingStatistics, state_bytes
from tests.core.test_statistics import assert_same_state

LAYERS, D = [0, 2], 8


def batches(n: int, vocab: int, offset: float = 0.0, seed: int = 5):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        h = torch.as_tensor(rng.normal(size=(len(LAYERS), 4, 16, D)) + offset)
        yield h, torch.as_tensor(rng.integers(0, vocab, size=(4, 16)))


def new(initial_types: int = 8) -> EmbeddingStatistics:
    return EmbeddingStatistics(LAYERS, D, max_positions=16, initial_types=initial_types)


@pytest.mark.parametrize("offset", [0.0, 1e4])
def test_spilled_pieces_merge_into_the_one_pass_statistics(offset):
    """Under a budget the accumulator holds at most the budget plus one batch's growth, and
    its arrays are never allocated past that; its pieces, merged in order, equal one pass to
    float64 rounding."""
    probe = new()
    probe.update(*next(batches(1, 2000)))  # the per-batch scratch buffers count too
    scratch = sum(b.numel() * b.element_size() for b in probe._buffers.values())
    budget = scratch + state_bytes(len(LAYERS), D, 120, 16)  # room for ~120 types
    one_batch = state_bytes(len(LAYERS), D, 64, 16) - state_bytes(len(LAYERS), D, 0, 16)
    spilling = SpillingStatistics(new(), budget)
    one = new()
    held, allocated = [], []
    for h, ids in batches(40, 2000, offset):
        spilling.update(h, ids)
        one.update(h, ids)
        held.append(spilling.current.held_bytes())
        allocated.append(spilling.current.nbytes())
    assert 3 <= spilling.spills < 40  # not every batch
    assert max(held) < budget + one_batch
    assert max(allocated) < budget + one_batch + scratch  # no doubling past the budget
    assert spilling.nbytes() == spilling.current.held_bytes() + spilling.spilled_bytes
    pieces = spilling.take()
    assert len(pieces) == spilling.spills + 1 and spilling.spilled == []
    merged = EmbeddingStatistics.from_bytes(pieces[0])
    for data in pieces[1:]:
        merged.merge(EmbeddingStatistics.from_bytes(data))
    assert merged.token_count() == one.token_count() == 40 * 64
    assert_same_state(merged, one, rtol=1e-11, comoment_rtol=1e-11)


def test_without_a_budget_nothing_spills():
    spilling = SpillingStatistics(EmbeddingStatistics(LAYERS, D), None)
    for h, ids in batches(5, 50):
        spilling.update(h, ids)
    assert spilling.spills == 0 and len(spilling.take()) == 1


@pytest.mark.parametrize("offset", [0.0, 1e6])
def test_a_cleared_accumulator_folds_as_new_statistics_in_the_same_memory(offset):
    """clear() forgets every type and the per-layer state but keeps the arrays: the next
    batches fold into the same memory (no growth, no new allocation) and give exactly what
    new statistics give, also with offsets where the first batch's shift matters."""
    stats = new(initial_types=1)
    for h, ids in batches(5, 300, offset):
        stats.update(h, ids)
    seen, capacity = stats.num_types, stats._capacity()
    pointers = {name: a.data_ptr() for name, a in stats._a.items()}
    stats.clear()
    assert stats.num_types == 0 and stats.token_count() == 0
    assert stats.held_bytes() == stats.nbytes() - capacity * stats._row_bytes()  # no type held
    assert_same_state(stats, new())  # empty: nothing held
    fresh = new(initial_types=1)
    for h, ids in batches(3, 300, offset, seed=9):
        stats.update(h, ids)
        fresh.update(h, ids)
    assert 100 < stats.num_types <= seen and stats._capacity() == capacity
    assert {name: a.data_ptr() for name, a in stats._a.items()} == pointers
    assert_same_state(stats, fresh)


def test_flushes_and_spills_clear_one_accumulator():
    """take() and a spill return the accumulator's bytes and clear it in place: the same
    object, its capacity kept, so the next interval does not grow it again."""
    stats = new(initial_types=1)
    spilling = SpillingStatistics(stats, None)
    for h, ids in batches(5, 300):
        spilling.update(h, ids)
    capacity = stats._capacity()
    (first,) = spilling.take()
    assert spilling.current is stats and stats.num_types == 0 and stats._capacity() == capacity
    one = new(initial_types=1)
    for h, ids in batches(3, 300, seed=9):
        spilling.update(h, ids)
        one.update(h, ids)
    assert stats._capacity() == capacity
    assert_same_state(EmbeddingStatistics.from_bytes(spilling.take()[-1]), one)
    assert EmbeddingStatistics.from_bytes(first).num_types > 100


def test_growth_stops_doubling_at_the_budget():
    """fit_budget: the per-type arrays get the slots that fit the budget at once (no
    doublings), then grow only by what a batch needs."""
    stats = new(initial_types=4)
    row = stats._row_bytes() + 8
    fixed = stats.held_bytes()
    stats.fit_budget(fixed + 50 * row)  # 50 slots
    assert stats._max_doubling == stats._capacity() == 50
    for h, ids in batches(1, 10_000):  # 64 new types in one batch: past the limit
        stats.update(h, ids)
    assert stats._capacity() == stats.num_types == 64  # what the batch needed, not 2 x 32
    held = stats.held_bytes()
    assert held == stats.nbytes()  # every allocated slot holds a type


@pytest.mark.parametrize("split", [False, True])
def test_no_more_slots_than_the_vocabulary_has_types(split):
    """max_types (an extractor's: its tokenizer's size) stops the doubling there, and a
    budget's slots too: 37 possible types take 37 slots, where doubling from the 20 of a
    first batch would take 40, and fold the same statistics."""
    rng = np.random.default_rng(3)
    folds = [
        (torch.as_tensor(rng.normal(size=(len(LAYERS), 4, 16, D))), ids)
        for ids in (torch.arange(64).reshape(4, 16) % v for v in (20, 37))
    ]
    cls = SplitStatistics if split else EmbeddingStatistics
    capped = cls(LAYERS, D, initial_types=4, max_types=37)
    plain = cls(LAYERS, D, initial_types=4)
    for stats in (capped, plain):
        for h, ids in folds:
            stats.update(h, ids)

    def capacities(stats):
        return [p._capacity() for _, p in stats.parts] if split else [stats._capacity()]

    assert capacities(capped) == [37] * len(capacities(capped))
    assert capacities(plain) == [40] * len(capacities(plain))
    assert_same_state(
        EmbeddingStatistics.from_bytes(capped.to_bytes()),
        EmbeddingStatistics.from_bytes(plain.to_bytes()),
    )
    budgeted = EmbeddingStatistics(LAYERS, D, initial_types=4, max_types=37)
    budgeted.fit_budget(1 << 30)
    assert budgeted._capacity() == budgeted._max_doubling == 37
    few = EmbeddingStatistics(LAYERS, D, initial_types=100, max_types=10)
    assert few._capacity() == 10
    few.update(*folds[1])  # more types than stated: grown by what the batch needs, no error
    assert few._capacity() == few.num_types == 37


def test_split_statistics_clear_and_share_the_budget_by_layers():
    """Per-device parts: each part's growth stops at its layers' share of the budget, and
    clear() empties every part, which then folds as new."""
    split = SplitStatistics([0, 1, 2], D, groups=[[0], [1, 2]], max_positions=16)
    split.fit_budget(3_000_000)
    rng = np.random.default_rng(1)
    h = [torch.as_tensor(rng.normal(size=(4, 16, D))) for _ in range(3)]
    ids = torch.as_tensor(rng.integers(0, 500, size=(4, 16)))
    split.update(h, ids)
    (_, one), (_, two) = split.parts
    assert one._max_doubling < two._max_doubling
    assert split.held_bytes() == one.held_bytes() + two.held_bytes()
    split.clear()
    assert one.num_types == two.num_types == 0 and split.held_bytes() < 3_000_000
    ref = SplitStatistics([0, 1, 2], D, groups=[[0], [1, 2]], max_positions=16)
    split.update(h, ids)
    ref.update(h, ids)
    assert_same_state(split.combined(), ref.combined())


def test_statistics_folded_under_inference_mode_clear_outside_it():
    """An extractor folds under torch.inference_mode (its arrays may be inference tensors)
    and flushes outside it: clear() must work there."""
    stats = new(initial_types=1)
    with torch.inference_mode():
        for h, ids in batches(2, 300):
            stats.update(h, ids)
    stats.clear()
    assert stats.num_types == 0
    with torch.inference_mode():
        for h, ids in batches(1, 300):
            stats.update(h, ids)
    assert stats.token_count() == 64


def test_spills_reuse_one_buffer_when_the_spill_copies():
    """With spill_copies (ray.put copies), the spills after the first are built in the first
    one's buffer (no new allocation), and the copies merge into the one-pass statistics."""
    probe = new()
    probe.update(*next(batches(1, 2000)))
    scratch = sum(b.numel() * b.element_size() for b in probe._buffers.values())
    budget = scratch + state_bytes(len(LAYERS), D, 120, 16)
    given: list = []

    def spill(data):
        given.append(data)
        return bytes(memoryview(data).cast("B"))  # a copy, as ray.put makes

    spilling = SpillingStatistics(new(), budget, spill, spill_copies=True)
    one = new()
    for h, ids in batches(40, 2000, seed=3):
        spilling.update(h, ids)
        one.update(h, ids)
    assert spilling.spills >= 3
    buffer = spilling.pieces.buffer
    assert buffer is not None
    reused = [np.shares_memory(np.asarray(d), buffer) for d in given[1:]]
    assert not isinstance(given[0], np.ndarray) and sum(reused) >= len(given) - 3  # all but
    # the first and a piece over 1.25 x the first
    pieces = spilling.take()
    # the flush's last piece is built in the same buffer (the caller hands it on first)
    assert np.shares_memory(np.asarray(pieces[-1]), buffer)
    merged = EmbeddingStatistics.from_bytes(pieces[0])
    for data in pieces[1:]:
        merged.merge(EmbeddingStatistics.from_bytes(data))
    assert_same_state(merged, one, rtol=1e-11, comoment_rtol=1e-11)


def zipf_batches(n: int, vocab: int, offset: float = 0.0, seed: int = 11):
    """Batches whose ids follow a Zipf law over ``vocab`` types: every batch repeats the
    frequent types, as text does."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, vocab + 1)
    weights /= weights.sum()
    for _ in range(n):
        h = torch.as_tensor(rng.normal(size=(len(LAYERS), 4, 16, D)) + offset)
        yield h, torch.as_tensor(rng.choice(vocab, size=(4, 16), p=weights))


@pytest.mark.parametrize("offset", [0.0, 1e5])
def test_a_host_tier_merges_the_spills_into_the_one_pass_statistics_in_fewer_bytes(offset):
    """With a host tier, every spill of the accumulator is merged on the host: the pieces
    (the tier's own spills when it fills, then what it holds) merge into the one-pass
    statistics to float64 rounding, massive offsets included; the tier never holds more than
    its budget; and, the frequent types being in every spill, its pieces take fewer bytes than
    the spills written one by one."""
    from embgeom_ray.core.spilling import HostTier

    probe = new()
    probe.update(*next(zipf_batches(1, 3000)))
    scratch = sum(b.numel() * b.element_size() for b in probe._buffers.values())
    budget = scratch + state_bytes(len(LAYERS), D, 60, 16)  # ~60 types: a spill every batch
    host_budget = state_bytes(len(LAYERS), D, 700, 16)
    plain = SpillingStatistics(new(), budget)
    host = HostTier(host_budget)
    tiered = SpillingStatistics(new(), budget, host=host)
    one = new()
    held = []
    for h, ids in zipf_batches(60, 3000, offset):
        plain.update(h, ids)
        tiered.update(h, ids)
        one.update(h, ids)
        # the statistics the tier holds (its merges' scratch, a few row blocks, apart)
        types = 0 if host.merged is None else host.merged.num_types
        held.append(state_bytes(len(LAYERS), D, types, 16))
    assert plain.spills >= 30 and tiered.merges == plain.spills  # each spill merged instead
    assert 1 <= tiered.spills < plain.spills / 4  # the tier spilled as it filled, seldom
    assert max(held) <= host_budget
    assert tiered.nbytes() == tiered.current.held_bytes() + host.nbytes()
    plain_pieces, pieces = plain.take(), tiered.take()
    assert len(pieces) == tiered.spills + 1 and host.spilled == []
    assert tiered.merges == plain.spills + 1  # the accumulator's last bytes merged too
    assert sum(len(p) for p in pieces) < 0.6 * sum(len(p) for p in plain_pieces)
    merged = EmbeddingStatistics.from_bytes(pieces[0])
    for data in pieces[1:]:
        merged.merge(EmbeddingStatistics.from_bytes(data))
    assert merged.token_count() == one.token_count() == 60 * 64
    assert_same_state(merged, one, rtol=1e-11, comoment_rtol=1e-11)
    # the tier goes on after a take, in the memory it had
    for h, ids in zipf_batches(3, 3000, offset, seed=12):
        tiered.update(h, ids)
    again = tiered.take()
    assert EmbeddingStatistics.from_bytes(again[-1]).token_count() == 3 * 64


def test_a_host_tier_takes_per_device_parts_as_their_combination():
    """Statistics folded in per-device parts (a model split across GPUs) are merged into the
    tier as the one-device statistics they combine into."""
    from embgeom_ray.core.spilling import HostTier

    split = SplitStatistics(LAYERS, D, groups=[[0], [2]], max_positions=16)
    budget = state_bytes(len(LAYERS), D, 40, 16)
    tiered = SpillingStatistics(split, budget, host=HostTier(state_bytes(len(LAYERS), D, 3000, 16)))
    one = new()
    for h, ids in zipf_batches(20, 3000):
        tiered.update(h, ids)
        one.update(h, ids)
    assert tiered.merges >= 5 and tiered.spills == 0
    (piece,) = tiered.take()
    assert_same_state(EmbeddingStatistics.from_bytes(piece), one, rtol=1e-11, comoment_rtol=1e-11)


@pytest.mark.parametrize("block_bytes", [1, 100, 2_000, 64 << 20])
def test_a_host_tiers_file_is_made_a_block_at_a_time_byte_for_byte(block_bytes):
    """The host tier is never serialised whole: its file is made a block at a time
    (StreamedStatistics), and the blocks are the bytes of one serialisation, whatever the
    block (rows of a layer's types in id order, whole layers, the per-layer state); its
    statistics are cleared only once the file is read (release), and fold on after."""
    from embgeom_ray.core.spilling import HostTier
    from embgeom_ray.core.statistics_io import StreamedStatistics

    tiered = SpillingStatistics(new(), state_bytes(len(LAYERS), D, 40, 16),
                                host=HostTier(state_bytes(len(LAYERS), D, 3000, 16)))  # fmt: skip
    for h, ids in zipf_batches(12, 3000, 1e5):
        tiered.update(h, ids)
    pieces = tiered.take_streamed()
    (last,) = pieces
    assert isinstance(last, StreamedStatistics)
    merged = tiered.host.merged
    whole = bytes(merged.to_bytes())
    last.block_bytes = block_bytes
    blocks = [bytes(b) for b in last]
    assert b"".join(blocks) == whole and last.size == len(whole)
    assert max(len(b) for b in blocks[1:]) <= max(block_bytes, D * 8)  # a row of d float64s
    assert merged.num_types > 0  # not cleared before it is read
    tiered.release()
    assert merged.num_types == 0
    for h, ids in zipf_batches(2, 3000, seed=9):
        tiered.update(h, ids)
    (again,) = tiered.take()
    assert EmbeddingStatistics.from_bytes(again).token_count() == 2 * 64


def test_writing_a_host_tier_holds_one_block_not_a_copy(tmp_path):
    """Writing the tier's statistics to a file a block at a time raises the process's peak
    memory by about one block; serialising them whole first, by their file's size and no
    more: each layer's rows are gathered into the file where they lie, with no copy of a
    field of every layer first (half the statistics more, before). In a fresh process each,
    its peak resident memory read from the kernel after resetting it."""
    import subprocess
    import sys

    script = """
import sys, torch
from embgeom_ray.core.statistics import EmbeddingStatistics
from embgeom_ray.core.statistics_io import StreamedStatistics
from embgeom_ray.io_utils import atomic_write_blocks, atomic_write_bytes
stats = EmbeddingStatistics([0, 1, 2, 3], 256, max_positions=4, initial_types=1)
g = torch.Generator().manual_seed(0)
for lo in range(0, 12000, 4000):
    ids = torch.arange(lo, lo + 4000).reshape(1000, 4)
    stats.update(torch.randn(4, 1000, 4, 256, generator=g), ids)
size = stats.held_bytes()
def status(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key))
    return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) reset to what is resident
before = status("VmRSS:")
if sys.argv[1] == "stream":
    piece = StreamedStatistics(stats, 4 << 20)
    atomic_write_blocks(sys.argv[2], piece, piece.size)
else:
    atomic_write_bytes(sys.argv[2], stats.to_bytes())
print(size, status("VmHWM:") - before)
"""
    grew = {}
    for mode in ("stream", "whole"):
        out = subprocess.run([sys.executable, "-c", script, mode, str(tmp_path / mode)],
                             capture_output=True, text=True, check=True)  # fmt: skip
        size, grew[mode] = (int(x) for x in out.stdout.split())
    assert (tmp_path / "stream").read_bytes() == (tmp_path / "whole").read_bytes()
    assert size > 150 << 20  # 12,000 types of 4 layers of d = 256
    file = (tmp_path / "whole").stat().st_size
    assert 0.9 * file < grew["whole"] < file + (16 << 20)  # 1.5 times the file before
    assert grew["stream"] < 16 << 20
