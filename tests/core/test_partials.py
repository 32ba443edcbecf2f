"""Partial sums over token partitions (core/partials.py) and tables built from parts.

A vocabulary too large for one process is cut by token id; each part's sums merge into the
layer's metrics. These tests check the sums against float64 two-pass computations on the raw
values (with large common offsets), and that the exact tables built from any cut of the
statistics equal the tables of the whole to float64 rounding.
"""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embgeom_ray.config import JobConfig
from embgeom_ray.core.partials import (
    CosineSums,
    PairMoments,
    merge_partials,
    self_similarities,
    type_partials,
)
from embgeom_ray.core.statistics import EmbeddingStatistics
from embgeom_ray.core.tables import build_tables

LAYERS = (1, 4, 7)
D = 6
VOCAB = 30


class Tokenizer:
    @staticmethod
    def convert_ids_to_tokens(ids: list[int]) -> list[str]:
        return [f"tok{i}" for i in ids]


def statistics(seed: int, clip: bool, offset: float) -> EmbeddingStatistics:
    """Statistics of random batches over token ids 0..29 (a few frequent, many rare), with a
    common offset in every dimension and a rogue dimension 2 in the middle layer."""
    rng = np.random.default_rng(seed)
    stats = EmbeddingStatistics(
        list(LAYERS), D, max_positions=9, clip_dims=[2] if clip else None,
        metadata={"model_fingerprint": "m"},
    )  # fmt: skip
    for _ in range(3):
        h = rng.normal(size=(len(LAYERS), 5, 9, D)) + offset
        h[1, ..., 2] += 30.0
        ids = np.minimum(rng.geometric(0.15, size=(5, 9)) - 1, VOCAB - 1)
        keep = rng.random((5, 9)) > 0.15
        stats.update(torch.as_tensor(h), torch.as_tensor(ids), torch.as_tensor(keep))
    return stats


def cut(
    whole: EmbeddingStatistics, edges: list[int], groups: list[int], separate_state: bool
) -> list[EmbeddingStatistics]:
    """The statistics cut into token ranges [e_i, e_{i+1}) (last one open) per layer group;
    each group's per-layer state with its first range, or in a part of its own."""
    bounds = sorted({0, *edges})
    ranges = [(a, b) for a, b in itertools.pairwise(bounds)] + [(bounds[-1], None)]
    layer_groups = [[x for x, g in zip(LAYERS, groups, strict=True) if g == k] for k in set(groups)]
    parts = []
    for layers in layer_groups:
        for i, span in enumerate(ranges):
            parts.append(whole.select(layers, span, layer_state=i == 0 and not separate_state))
        if separate_state:
            parts.append(whole.select(layers, (0, 0), layer_state=True))
    return parts


def assert_tables_close(got: dict[str, pd.DataFrame], want: dict[str, pd.DataFrame]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        a, b = got[name], want[name]
        assert list(a.columns) == list(b.columns), name
        assert len(a) == len(b), name
        for col in b.columns:
            if pd.api.types.is_numeric_dtype(b[col]):
                # a correlation (in [-1, 1]) near 0 comes of cancelling sums, merged in another
                # order: absolute error is its measure (seed 12797, offset 1e4: 2e-12 at -4e-4)
                atol = 1e-10 if col.endswith("_corr") else 1e-12
                np.testing.assert_allclose(
                    a[col].to_numpy(float), b[col].to_numpy(float), rtol=1e-9, atol=atol,
                    equal_nan=True, err_msg=f"{name}.{col}",
                )  # fmt: skip
            else:
                assert a[col].tolist() == b[col].tolist(), f"{name}.{col}"


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    clip=st.booleans(),
    offset=st.sampled_from([0.0, 1e4]),
    edges=st.lists(st.integers(1, VOCAB + 5), max_size=3),
    groups=st.lists(st.integers(0, 2), min_size=3, max_size=3),
    separate_state=st.booleans(),
    shuffle=st.booleans(),
)
def test_tables_from_any_cut_equal_the_whole(
    seed, clip, offset, edges, groups, separate_state, shuffle
):
    """R ∈ {1..4} token ranges x any layer grouping (state with a range or alone), in any
    order: every exact table (type_stats, layers incl. exact clipped cosines, dims, positions)
    equals the whole's to float64 rounding, also under a 1e4 offset."""
    whole = statistics(seed, clip, offset)
    options = JobConfig(model="m", corpus="c", out="o", min_count=2).tables
    want = build_tables(whole, Tokenizer, options)
    parts = cut(whole, edges, groups, separate_state)
    if shuffle:
        parts = [parts[i] for i in np.random.default_rng(seed).permutation(len(parts))]
    assert_tables_close(build_tables(parts, Tokenizer, options), want)
    if clip:
        assert want["layers"]["anisotropy_clipped_exact"].notna().all()


def test_a_part_without_the_layer_state_is_refused():
    whole = statistics(3, False, 0.0)
    options = JobConfig(model="m", corpus="c", out="o").tables
    parts = [whole.select(token_range=(0, 10), layer_state=False),
             whole.select(token_range=(10, None), layer_state=False)]  # fmt: skip
    with pytest.raises(ValueError, match="per-layer state"):
        build_tables(parts, Tokenizer, options)


# ------------------------------------------------------------------ the sums themselves
def two_pass_correlation(x: np.ndarray, y: np.ndarray) -> float:
    dx, dy = x - x.mean(), y - y.mean()
    return float(dx @ dy / np.sqrt((dx @ dx) * (dy @ dy)))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    sizes=st.lists(st.integers(0, 12), min_size=1, max_size=6),
    offset=st.sampled_from([0.0, 1e6, -1e8]),
)
def test_pair_moments_merged_equal_two_pass(seed, sizes, offset):
    """Chan's merge of any split of the pairs equals the two-pass moments of all of them,
    also with the pairs 1e6..1e8 away from the origin: no cancellation, only the rounding of
    the parts' means (relative error ~ ε |offset| / σ, here σ ≈ 1), which the tolerance states."""
    rng = np.random.default_rng(seed)
    n = sum(sizes)
    x = rng.normal(size=n) + offset
    y = 0.5 * (x - offset) + rng.normal(size=n) + 3 * offset
    edges = np.cumsum([0, *sizes])
    merged = PairMoments()
    for a, b in itertools.pairwise(edges):
        merged = merged + PairMoments.of(x[a:b], y[a:b])
    assert merged.count == n
    if n == 0:
        return
    dx, dy = x - x.mean(), y - y.mean()
    scale = max(1.0, 3 * abs(offset))
    tol = 1e-11 + 64 * np.finfo(float).eps * scale  # ~ ε |offset| / σ: the means' rounding
    assert merged.mean_x == pytest.approx(x.mean(), rel=1e-15, abs=tol)
    assert merged.mean_y == pytest.approx(y.mean(), rel=1e-15, abs=tol)
    assert merged.m2_x == pytest.approx(dx @ dx, rel=tol, abs=tol)
    assert merged.m2_y == pytest.approx(dy @ dy, rel=tol, abs=tol)
    assert merged.c_xy == pytest.approx(dx @ dy, rel=tol, abs=tol * n)
    if n >= 3:
        assert merged.correlation() == pytest.approx(two_pass_correlation(x, y), abs=tol)
    else:
        assert np.isnan(merged.correlation())


def brute_cosines(x: np.ndarray, ids: np.ndarray) -> tuple[float, float, float]:
    """Anisotropy, S_inter, S_intra by enumerating every pair of points."""
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    cos = u @ u.T
    off = ~np.eye(len(x), dtype=bool)
    diff = ids[:, None] != ids[None, :]
    intra = [
        cos[np.ix_(ids == t, ids == t)][~np.eye((ids == t).sum(), dtype=bool)].mean()
        for t in np.unique(ids)
        if (ids == t).sum() >= 2
    ]
    return float(cos[off].mean()), float(cos[diff].mean()), float(np.mean(intra))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n_parts=st.integers(1, 4))
def test_cosine_sums_of_type_partitions_equal_brute_force(seed, n_parts):
    """Σ of CosineSums over a partition of the types gives the all-pairs cosine metrics."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 8, size=40)
    x = rng.normal(size=(40, 5)) + 2.0
    types = np.unique(ids)
    counts = np.array([(ids == t).sum() for t in types])
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    unit_sums = np.stack([u[ids == t].sum(axis=0) for t in types])
    owner = rng.integers(0, n_parts, size=len(types))
    sums = [CosineSums.of(counts[owner == k], unit_sums[owner == k]) for k in range(n_parts)]
    total = sums[0]
    for s in sums[1:]:
        total = total + s
    np.testing.assert_allclose(total.metrics(), brute_cosines(x, ids), rtol=1e-10, atol=1e-12)
    ss = self_similarities(counts, unit_sums)
    assert np.isnan(ss[counts < 2]).all()


def test_partials_of_different_layers_do_not_merge():
    whole = statistics(5, True, 0.0)
    a, b = whole.layer(1), whole.layer(4)
    with pytest.raises(ValueError, match="do not merge"):
        merge_partials([type_partials(a, a.mean, 2), type_partials(b, b.mean, 2)])
    with pytest.raises(ValueError, match="at least one"):
        merge_partials([])


def test_parts_given_as_any_iterable_build_the_same_tables():
    """``build_tables`` takes the parts as a list, a tuple or any iterable of them (a
    generator, a dict's values), as before its test became ``isinstance(merged, Sequence)``,
    which wrapped a generator as one part ('generator' object has no attribute
    'token_range'); one statistics object is one part."""
    whole = statistics(5, False, 0.0)
    options = JobConfig(model="m", corpus="c", out="o", min_count=2).tables
    want = build_tables(whole, Tokenizer, options)
    parts = cut(whole, [7, 15], [0, 0, 1], False)
    for held in (tuple(parts), (p for p in parts), dict(enumerate(parts)).values()):
        assert_tables_close(build_tables(held, Tokenizer, options), want)
