"""The GPU's fold of several layers at once (``STACK_LAYERS``) against its fold of one layer at a
time, on the CPU with the GPU's path forced: the same statistics to float64 rounding, in every
precision that stacks, with clipped dimensions, positions and a layer that holds a NaN, and the
layers split into stacks as the byte bound and the non-finite layers require. The statistics'
values against the float64 two-pass reference are tests/core/test_statistics.py's (its "GPU's
way" folds stacked)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import embgeom_ray.core.statistics as statistics_module
from embgeom_ray.core import fold_kernels
from embgeom_ray.core import gram as gram_module
from embgeom_ray.core.statistics import EmbeddingStatistics

LAYERS, D = 5, 24


@pytest.fixture
def gpu_way(monkeypatch):
    """The GPU's fold on the CPU (one block, sparse sums, argmax tails, fused kernels traced),
    the co-moment product in float64 (not on int8 units); ``stacks`` records the stacks
    folded, as (first layer slot, layers)."""
    monkeypatch.setattr(statistics_module, "GPU_FOLD", True)
    monkeypatch.setattr(statistics_module, "INTEGER_PRODUCT", False)
    monkeypatch.setattr(gram_module, "CPU_SYRK", False)
    monkeypatch.setattr(fold_kernels, "FUSE", True)
    monkeypatch.setattr(fold_kernels, "BACKEND", "eager")
    stacks: list[tuple[int, int]] = []
    fold = EmbeddingStatistics._fold_stacked

    def recorded(self, lo, kept, g):
        stacks.append((lo, kept.shape[1]))
        return fold(self, lo, kept, g)

    monkeypatch.setattr(EmbeddingStatistics, "_fold_stacked", recorded)
    return stacks


def massive_batches(
    layers: int, d: int, count: int, nan_at: int | None = None
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``count`` batches (hidden states (layers, 3, 16, d), token ids of 30 types, kept
    tokens) of rows with massive offsets in about a tenth of the dimensions; ``nan_at``: the
    layer given a NaN in the third batch."""
    rng = np.random.default_rng(1)
    out = []
    for b in range(count):
        h = rng.normal(size=(layers, 3, 16, d)) * 3 + 1e3 * (rng.random(d) > 0.9)
        if nan_at is not None and b == 2:
            h[nan_at, 0, 3, 5] = np.nan
        out.append((h, rng.integers(0, 30, size=(3, 16)), rng.random((3, 16)) > 0.1))
    return out


def folded(precision: str, clip: bool, positions: bool, nan_at: int | None) -> EmbeddingStatistics:
    """Four :func:`massive_batches` (bf16 for the float32 product, else float64) folded."""
    stats = EmbeddingStatistics(
        list(range(LAYERS)), D, max_positions=16 if positions else 0,
        comoment_precision=precision, clip_dims=[1, 3] if clip else None,
    )  # fmt: skip
    dtype = torch.bfloat16 if precision == "float32" else torch.float64
    for h, ids, keep in massive_batches(LAYERS, D, 4, nan_at):
        stats.update(torch.as_tensor(h).to(dtype), torch.as_tensor(ids), torch.as_tensor(keep))
    return stats


def assert_same_statistics(a: EmbeddingStatistics, b: EmbeddingStatistics) -> None:
    """Every array equal to float64 rounding (relative to its largest value), counts exactly."""
    assert torch.equal(a.type_moments.slot_ids, b.type_moments.slot_ids)
    k = a.type_moments.num_types
    pairs = [(name, x, b.layer_state.arrays[name]) for name, x in a.layer_state.arrays.items()]
    pairs += [(name, x[:, :k], b.type_moments.arrays[name][:, :k]) for name, x in a.type_moments.arrays.items()]  # fmt: skip
    for name, x, y in pairs:
        if not x.dtype.is_floating_point:
            assert torch.equal(x, y), name
        elif x.numel():
            scale = float(y.abs().max()) or 1.0
            assert float((x - y).abs().max()) <= 1e-14 * scale, name


@pytest.mark.parametrize(
    "precision, clip, positions, nan_at",
    [
        (p, c, pos, nan)
        for p, c, pos, nan in itertools.product(
            ["float64", "float32", "bounded"], [False, True], [False, True], [None, 2]
        )
        if (c, pos) != (True, False)
    ],
)
def test_layers_folded_together_equal_one_at_a_time(gpu_way, monkeypatch, precision, clip, positions, nan_at):  # fmt: skip
    stacked = folded(precision, clip, positions, nan_at)
    assert gpu_way[0] == (0, LAYERS)  # the first batch: every layer in one stack
    if nan_at is not None:  # the third: the layer with a NaN alone, the others stacked around it
        assert (0, nan_at) in gpu_way and (nan_at + 1, LAYERS - nan_at - 1) in gpu_way
        assert int(stacked.layer_state.arrays["nonfinite"][nan_at]) == 1
    monkeypatch.setattr(statistics_module, "STACK_LAYERS", False)
    gpu_way.clear()
    one_at_a_time = folded(precision, clip, positions, nan_at)
    assert gpu_way == []
    assert_same_statistics(stacked, one_at_a_time)


def test_stacks_hold_at_most_their_bytes_and_never_the_int8_product(gpu_way, monkeypatch):
    """STACK_BYTES bounds a stack to about three float64 copies of its rows and its products;
    the bounded product on int8 units folds one layer at a time."""
    rows = 3 * 16  # every row kept: the mask below keeps all
    monkeypatch.setattr(statistics_module, "STACK_BYTES", 2 * 8 * (3 * rows * D + D * D))
    stats = EmbeddingStatistics(list(range(LAYERS)), D)
    h = torch.as_tensor(np.random.default_rng(0).normal(size=(LAYERS, 3, 16, D)))
    ids = torch.as_tensor(np.random.default_rng(1).integers(0, 9, size=(3, 16)))
    stats.update(h, ids)
    assert gpu_way == [(0, 2), (2, 2)]  # and layer 4 alone, one layer at a time
    monkeypatch.setattr(statistics_module, "STACK_BYTES", 256 << 20)
    monkeypatch.setattr(statistics_module, "INTEGER_PRODUCT", True)
    gpu_way.clear()
    EmbeddingStatistics(list(range(LAYERS)), D, comoment_precision="bounded").update(h, ids)
    assert gpu_way == []
