"""Sums of rows by group as sparse products (the GPU fold's) against a float64 loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embgeom_ray.core.group_sums import SPLIT_BITS, GroupMatrix, split_levels, split_sums


def loop_sums(x: np.ndarray, labels: np.ndarray, groups: int, w: np.ndarray | None) -> np.ndarray:
    """Σ_{i: labels[i] = g} w_i x_i, one row at a time (math.fsum per entry: exact rounding)."""
    import math

    w = np.ones(len(x)) if w is None else w
    out = np.zeros((groups, x.shape[1]))
    for g in range(groups):
        rows = np.flatnonzero(labels == g)
        for j in range(x.shape[1]):
            out[g, j] = math.fsum(w[i] * x[i, j] for i in rows)
    return out


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 60),
    d=st.integers(1, 9),
    groups=st.integers(1, 12),
    offset=st.sampled_from([0.0, 1e6]),
    weighted=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_group_sums_equal_a_float64_loop(n, d, groups, offset, weighted, seed):
    """Both constructions (rows in group order; rows labelled in any order, groups possibly
    empty) give the per-group (weighted) sums, to float64 rounding, also with a large offset."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)) + offset
    labels = rng.integers(0, groups, size=n)
    w = rng.uniform(0.1, 2.0, size=n) if weighted else None
    want = loop_sums(x, labels, groups, w)
    tol = dict(rtol=1e-12, atol=1e-12 * (1 + offset) * n)

    counts = torch.bincount(torch.as_tensor(labels), minlength=groups)
    by_label = GroupMatrix.of_labels(torch.as_tensor(labels), counts)
    got = by_label.sums(torch.as_tensor(x), None if w is None else torch.as_tensor(w))
    np.testing.assert_allclose(got.numpy(), want, **tol)

    order = np.argsort(labels, kind="stable")  # the fold's rows: sorted by type
    sorted_counts = counts[counts > 0]
    present = np.unique(labels)
    by_type = GroupMatrix.of_sorted(sorted_counts, n)
    xs = torch.as_tensor(x[order])
    ws = None if w is None else torch.as_tensor(w[order])
    np.testing.assert_allclose(by_type.sums(xs, ws).numpy(), want[present], **tol)


def test_group_sums_under_inference_mode_and_float32_rows():
    """As the extractor calls it (inference mode); the result keeps the rows' dtype."""
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    gm = GroupMatrix.of_labels(torch.tensor([1, 0, 1, 2]), torch.tensor([1, 2, 1]))
    with torch.inference_mode():
        got = gm.sums(x, torch.tensor([1.0, 2.0, 0.5, 1.0]))
    assert got.dtype == torch.float32
    want = torch.tensor([[6.0, 8.0, 10.0], [0.0 + 3.0, 1.0 + 3.5, 2.0 + 4.0], [9.0, 10.0, 11.0]])
    assert torch.equal(got, want)


def test_split_levels():
    """L is the smallest count of levels with n_max 2^-24 ρ^L ≤ 2^-36, ρ = 2^(⌈log2 n_max⌉ − 22);
    groups over 2^20 rows are refused."""
    for n_max, levels in [(1, 1), (1024, 2), (1025, 3), (8192, 3), (65536, 5), (2**20, 16)]:
        assert split_levels(n_max) == levels
        c = (n_max - 1).bit_length()
        assert -24 + c + levels * (c - 22) <= -SPLIT_BITS < -24 + c + (levels - 1) * (c - 22)
    with pytest.raises(ValueError, match="2\\^20"):
        split_levels(2**20 + 1)
    with pytest.raises(ValueError, match="float32"):
        split_sums(torch.zeros(2, 2, dtype=torch.float64), torch.zeros(2, dtype=torch.long), 1)


def exact_group_sums(x: np.ndarray, labels: np.ndarray, groups: int) -> np.ndarray:
    """Σ per group and column, correctly rounded to float64 (math.fsum of the exact values)."""
    import math

    out = np.zeros((groups, x.shape[1]))
    for g in range(groups):
        rows = x[labels == g]
        for j in range(x.shape[1]):
            out[g, j] = math.fsum(rows[:, j].tolist())
    return out


def split_bound(x: np.ndarray, labels: np.ndarray, groups: int, n_max: int) -> np.ndarray:
    """The bound of :func:`split_sums` on each group's sum: (n_g 2^-24 ρ^L n_g + (L + 1) 2^-53
    n_g) M_a, with M_a the column's largest |x| and n_g the group's rows."""
    levels = split_levels(n_max)
    c = (n_max - 1).bit_length()
    n_g = np.bincount(labels, minlength=groups)[:, None].astype(float)
    m = np.abs(x).max(axis=0)[None, :]
    rho = 2.0 ** (c - 22)
    return (n_g**2 * 2.0**-24 * rho**levels + (levels + 1) * 2.0**-53 * n_g) * m


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 1500),
    d=st.integers(1, 5),
    groups=st.integers(1, 6),
    heavy=st.floats(0.0, 0.99),
    offset=st.sampled_from([0.0, 1e4, -3e6]),
    tail=st.sampled_from([None, 1.0, 2.0]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**32 - 1),
)
def test_split_sums_within_the_bound_in_any_order(n, d, groups, heavy, offset, tail, dtype, seed):
    """The split's per-group sums, over rows in random orders (how a GPU's atomics may add them),
    are within its bound of the exact sums: massive offsets in one column, Student-t columns,
    one group holding most rows, groups seen once; bf16 and float32 rows."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)) if tail is None else rng.standard_t(tail, size=(n, d))
    x[:, 0] += offset
    x = torch.as_tensor(x).to(dtype).to(torch.float32).numpy()  # the model's own values
    labels = np.where(rng.uniform(size=n) < heavy, 0, rng.integers(0, groups, size=n))
    want = exact_group_sums(x.astype(np.float64), labels, groups)
    bound = split_bound(x, labels, groups, n)
    for _ in range(3):
        order = rng.permutation(n)
        got = split_sums(
            torch.as_tensor(x[order]).to(dtype), torch.as_tensor(labels[order]), groups
        ).numpy()
        assert np.all(np.abs(got - want) <= bound)


def type_moments_of(sums: np.ndarray, x: np.ndarray, labels: np.ndarray, groups: int):
    """(‖μ_t‖, V_t, Q_t) per group from its sums: V_t = Σ ‖x − μ_t‖² / n_t about those means
    (the fold's pass 2), Q_t = ‖μ_t‖² + V_t."""
    counts = np.bincount(labels, minlength=groups).astype(float)
    mu = sums / counts[:, None]
    v = np.bincount(labels, ((x - mu[labels]) ** 2).sum(axis=1), minlength=groups) / counts
    norm = np.linalg.norm(mu, axis=1)
    return norm, v, norm**2 + v


@settings(max_examples=6, deadline=None)
@given(
    offset=st.sampled_from([1e4, 3e3]),
    n=st.sampled_from([8192, 12000]),
    d=st.sampled_from([16, 48]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**32 - 1),
)
def test_split_sums_give_the_type_moments_within_1e6(offset, n, d, dtype, seed):
    """A batch of 8,192+ bf16 or float32 rows, ‖μ‖²/V ≈ 1e8 in three dimensions, one type holding most
    rows, types seen once, rows in random order (GPU atomics): every type's ‖μ_t‖, V_t and Q_t
    from the split's float32 sums are within 1e-6 of the float64 two-pass values (a plain
    float32 ``index_add_`` of float32 rows misses it: its heavy type's sums of ~1e8 err by
    ~2^-24 √n of them)."""
    rng = np.random.default_rng(seed)
    groups = 200
    labels = np.where(rng.uniform(size=n) < 0.8, 0, rng.integers(1, groups, size=n))
    labels[:groups] = np.arange(groups)  # every type present, some only once
    centres = rng.normal(size=(groups, d)) * 2
    x = centres[labels] + rng.normal(size=(n, d))
    x[:, :3] += offset  # massive dimensions: μ²/V ≈ offset² ≈ 1e7-1e8
    x = torch.as_tensor(x).to(dtype).double().numpy()  # the model's own values
    order = rng.permutation(n)
    x, labels = x[order], labels[order]
    sums = split_sums(torch.as_tensor(x).to(dtype), torch.as_tensor(labels), groups)
    got = type_moments_of(sums.numpy(), x, labels, groups)
    counts = np.bincount(labels, minlength=groups)
    mu = np.stack([x[labels == g].mean(axis=0) for g in range(groups)])  # float64 two-pass
    ref_v = np.array([((x[labels == g] - mu[g]) ** 2).sum() / counts[g] for g in range(groups)])
    ref_norm = np.linalg.norm(mu, axis=1)
    want = (ref_norm, ref_v, ref_norm**2 + ref_v)
    many = counts > 1  # V_t of a type seen once is 0 on both sides
    for g_val, w_val in zip(got, want, strict=True):
        np.testing.assert_allclose(g_val[many], w_val[many], rtol=1e-6)
    np.testing.assert_array_equal(got[1][~many], 0.0)
