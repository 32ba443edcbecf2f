"""The co-moment product on int8 matrix units (core/integer_gram.py): exact integer arithmetic
against Python's integers, and the stated bound against float64 products, on the inputs that
make fixed point hard (massive offsets, heavy tails, one huge row, constant columns)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embgeom_ray.core import fold_kernels, integer_gram
from embgeom_ray.core.gram import integer_blocks
from embgeom_ray.core.integer_gram import (
    BITS,
    MAX_ROWS,
    MODULI,
    IntegerGram,
    bound,
    column_scales,
    emulated_int8_matmul,
    garner_eager,
    moduli_for,
    residues_eager,
    upper_blocks,
)


def shifted_gram(x: torch.Tensor, shift: torch.Tensor, block: int = 96, align: int = 8):
    """The symmetric Gram of x − shift by :class:`IntegerGram` (every row's residues put at
    once, as a GPU's fold does), and the gram object."""
    gram = IntegerGram(x, shift, block=block, align=align)
    for g, s, e in gram.pieces(0, x.shape[0]):
        rows = x[s:e].to(torch.float64)
        res = residues_eager(rows, gram.shift, g.scale, g.moduli, *gram.padding(g, s, e))
        gram.put(g, s, e, res)
    upper = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64)
    gram.add_upper(upper)
    upper = torch.triu(upper)
    return (upper + torch.triu(upper, 1).T).numpy(), gram


def posterior_bound(xs: np.ndarray) -> np.ndarray:
    """The data's own bound (module docstring): 2^(1−B) (M_a Σ|x'_b| + M_b Σ|x'_a|)
    + n 2^(2−2B) M_a M_b, with M the columns' largest |x'| and n the rows."""
    m = np.abs(xs).max(axis=0)
    s = np.abs(xs).sum(axis=0)
    n = xs.shape[0]
    return 2.0 ** (1 - BITS) * (np.outer(m, s) + np.outer(s, m)) + n * 2.0 ** (
        2 - 2 * BITS
    ) * np.outer(m, m)


def assert_within_bound(x: torch.Tensor, shift: torch.Tensor, gram_np: np.ndarray) -> float:
    """|G − G₆₄| within the a-posteriori bound and ε_n √(G_aa G_bb) (plus float64's own
    rounding, ≤ 1e-13 of the scale); returns the largest error in units of √(G_aa G_bb)."""
    xs = x.to(torch.float64).numpy() - shift.numpy()
    ref = xs.T @ xs
    scale = np.sqrt(np.outer(np.diag(ref), np.diag(ref)))
    err = np.abs(gram_np - ref)
    slack = 1e-13 * scale + 1e-300
    assert (err <= posterior_bound(xs) + slack).all()
    assert (err <= bound(x.shape[0]) * scale + slack).all()
    return float((err / np.where(scale > 0, scale, 1.0)).max())


def test_moduli_hold_twice_the_integer_grams_range():
    for rows in (1, 8, 1000, 8192, MAX_ROWS):
        moduli = moduli_for(rows)
        assert math.prod(moduli) > 4 * rows * 2 ** (2 * BITS - 2)
        assert math.prod(moduli[:-1]) <= 4 * rows * 2 ** (2 * BITS - 2)
        # int32 sums of the residues' products cannot overflow
        assert rows * 128**2 < 2**31
    assert all(math.gcd(a, b) == 1 for a, b in itertools.combinations(MODULI, 2))
    assert max(MODULI) <= 256
    assert bound(MAX_ROWS) < 2.0**-28  # ε ≈ 1.9e-9 for a group of 65,536 rows


def test_garner_reconstructs_any_integer_in_range_exactly():
    """Random integers of up to ±M/2 (M = Π m_k ~ 2^95) from their residues, in float64: the
    value rounded once (within 12 · 2^-53 of float(G)), small values exactly."""
    rng = np.random.default_rng(1)
    moduli = moduli_for(MAX_ROWS)
    big = math.prod(moduli)
    values = [int(v) for v in rng.integers(-(2**62), 2**62, size=200)]
    values += [int(rng.integers(0, 2**62)) * 2**31 - big // 3 for _ in range(200)]
    values += [0, 1, -1, 255, -256, big // 2 - 1, -(big // 2) + 1, 2**53 + 1, -(2**53) - 1]
    remainders = torch.tensor([[v % m for v in values] for m in moduli], dtype=torch.int64)
    got = garner_eager(remainders, moduli).numpy()
    want = np.array([float(v) for v in values])
    np.testing.assert_allclose(got, want, rtol=12 * 2.0**-53, atol=0)
    small = np.abs(want) < 2**53
    assert np.array_equal(got[small], want[small])


def test_residues_are_balanced_int8_and_exact():
    """x̃ mod m in [−m/2, m/2) for every modulus, equal to Python's arithmetic, at the extremes
    of the fixed point (|x̃| = 2^38)."""
    rng = np.random.default_rng(2)
    x = torch.as_tensor(rng.normal(size=(50, 9)) * 10.0 ** rng.integers(-8, 8, size=9))
    x[0, 0], x[1, 0] = 1e30, -1e30  # the column's extremes
    shift = x.mean(0)
    absmax = (x - shift).abs().amax(0)
    scale = column_scales(absmax)
    res = residues_eager(x, shift, scale, MODULI)
    assert res.dtype == torch.int8 and res.shape == (len(MODULI), 9, 50)
    z = torch.round((x - shift) * scale)
    assert z.abs().max() <= 2 ** (BITS - 1) and z.abs().max() >= 2 ** (BITS - 2)
    for k, m in enumerate(MODULI):
        want = [((int(v) + m // 2) % m) - m // 2 for v in z.t().flatten().tolist()]
        assert res[k].flatten().tolist() == want
        assert res[k].min() >= -(m // 2) and res[k].max() <= (m + 1) // 2 - 1


def test_emulated_int8_product_is_the_cpus_int8_product_bit_for_bit():
    rng = np.random.default_rng(3)
    a = torch.as_tensor(rng.integers(-128, 128, size=(40, 4000)), dtype=torch.int8)
    b = torch.as_tensor(rng.integers(-128, 128, size=(4000, 24)), dtype=torch.int8)
    a[0], b[:, 0] = -128, -128  # the largest products, every one
    assert torch.equal(emulated_int8_matmul(a, b), torch._int_mm(a, b))
    assert int(torch._int_mm(a, b)[0, 0]) == 4000 * 128**2


@pytest.mark.parametrize("d", [17, 24, 100, 385, 2048, 4096])
@pytest.mark.parametrize(("block", "align"), [(96, 8), (None, 64)])
def test_blocks_are_aligned_wide_enough_and_cover_the_columns(d, block, align):
    """The CPU's blocks, and the GPU's (``gram.integer_blocks(d, gpu=True)``)."""
    d_pad = max(24, -(-d // 8) * 8)
    edges = upper_blocks(d_pad, block or integer_blocks(d_pad, gpu=True)["block"], align)
    assert edges[0] == 0 and edges[-1] == d_pad
    widths = [b - a for a, b in itertools.pairwise(edges)]
    assert all(w >= integer_gram.MIN_BLOCK and w % 8 == 0 for w in widths)
    assert all(e % align == 0 for e in edges[1:-1])


def test_the_product_is_the_exact_integer_gram_of_the_fixed_point_rows():
    """Every entry G̃_ab equals Σ_i x̃_ia x̃_ib computed with Python's integers (before the
    scales are taken off), whatever the column blocks, also with rows not a multiple of 8."""
    rng = np.random.default_rng(4)
    x = torch.as_tensor(rng.normal(size=(203, 30)) * rng.uniform(0.01, 100, size=30))
    x[:, 3] += 5e4
    shift = x.mean(0)
    for block, align in ((8, 8), (96, 8), (16, 64), (256, 64)):  # the last: a GPU's, one block
        g_np, gram = shifted_gram(x, shift, block, align)
        scale = gram.groups[0].scale.numpy()
        z = torch.round((x - shift) * gram.groups[0].scale).to(torch.int64).numpy().astype(object)
        exact = z.T.dot(z)
        got = g_np * np.outer(scale, scale)
        want = exact.astype(float)
        np.testing.assert_allclose(got, want, rtol=16 * 2.0**-53, atol=0)


def test_rows_beyond_one_group_get_their_own_scales(monkeypatch):
    """Batches longer than MAX_ROWS are cut into groups, each with its own column scales
    (here 100 rows, groups of 32)."""
    monkeypatch.setattr(integer_gram, "MAX_ROWS", 32)
    rng = np.random.default_rng(5)
    x = torch.as_tensor(rng.normal(size=(100, 20)))
    x[70:] *= 1e3  # the last groups' rows are far larger
    shift = x[:70].mean(0)
    g_np, gram = shifted_gram(x, shift)
    assert [(g.start, g.stop) for g in gram.groups] == [(0, 32), (32, 64), (64, 96), (96, 100)]
    for g in gram.groups:  # each from its own rows' largest |x − c|
        absmax = (x[g.start : g.stop] - shift).abs().amax(0)
        assert torch.equal(g.scale, column_scales(absmax))
    assert (gram.groups[0].scale > 10 * gram.groups[3].scale).all()
    # the bound of each group adds up to that of 32 rows (Cauchy–Schwarz across the groups)
    xs = x.numpy() - shift.numpy()
    ref = xs.T @ xs
    scale = np.sqrt(np.outer(np.diag(ref), np.diag(ref)))
    assert (np.abs(g_np - ref) <= bound(32) * scale + 1e-13 * scale).all()


@st.composite
def hard_rows(draw):
    """Rows that make fixed point hard: massive offsets in a few dimensions (‖μ‖²/V up to
    1e10), heavy-tailed columns (Student t with 1–3 degrees of freedom), one row far out in
    some column (its largest value √n times the column's RMS: the worst case of the bound),
    constant columns, and bf16 values (a bf16 model's hidden states)."""
    seed = draw(st.integers(0, 2**32 - 1))
    n = draw(st.integers(1, 300))
    d = draw(st.integers(17, 41))
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)) * 10.0 ** rng.uniform(-3, 2, size=d)
    massive = rng.choice(d, size=draw(st.integers(0, 3)), replace=False)
    x[:, massive] += rng.choice([-1, 1], size=len(massive)) * 10.0 ** rng.uniform(
        3, 5, size=len(massive)
    )
    heavy = rng.choice(d, size=draw(st.integers(0, 4)), replace=False)
    x[:, heavy] = rng.standard_t(draw(st.integers(1, 3)), size=(n, len(heavy)))
    if draw(st.booleans()):
        x[rng.integers(n), rng.integers(d)] += 1e6  # one row far out
    if draw(st.booleans()):
        x[:, rng.integers(d)] = 3.0  # a constant column
    dtype = draw(st.sampled_from([torch.float64, torch.bfloat16, torch.float32]))
    return torch.as_tensor(x).to(dtype)


@settings(max_examples=60, deadline=None)
@given(hard_rows())
def test_the_product_is_within_the_stated_bound(x):
    """|G_ab − G₆₄_ab| ≤ ε_n √(G_aa G_bb) (ε_n = 2^(2−B) √n (1 + 2^−B √n)), and within the
    data's own (a-posteriori) bound, for rows shifted by their mean as the fold shifts them."""
    shift = x.to(torch.float64).mean(0)
    g_np, _ = shifted_gram(x, shift)
    assert_within_bound(x, shift, g_np)


def test_the_worst_case_row_is_within_the_bound():
    """One row holding a column's whole mass (|x'| = √n × the column's RMS): the case the
    bound is made for; the error stays within ε_n √(G_aa G_bb)."""
    n = 4096
    x = torch.full((n, 24), 1.0, dtype=torch.float64)
    x[:, 1:] = torch.as_tensor(np.random.default_rng(6).normal(size=(n, 23)))
    x[0, 0] = 1e6  # the mean is ~244; every other row is 244 below it, one 1e6 above
    shift = x.mean(0)
    g_np, _ = shifted_gram(x, shift)
    worst = assert_within_bound(x, shift, g_np)
    assert worst < bound(n)


def test_the_compiled_kernels_trace_whole(monkeypatch):
    """The residues and the reconstruction as compiled kernels (traced, run eagerly here, as
    the tests of the GPU's fold do) give the eager values."""
    monkeypatch.setattr(fold_kernels, "FUSE", True)
    monkeypatch.setattr(fold_kernels, "BACKEND", "eager")
    monkeypatch.setattr(fold_kernels, "_compiled", {})
    monkeypatch.setattr(fold_kernels, "_unavailable", False)
    rng = np.random.default_rng(7)
    x = torch.as_tensor(rng.normal(size=(77, 33)) + 100.0)
    shift = x.mean(0)
    eager, _ = shifted_gram(x, shift)
    gram = IntegerGram(x, shift)
    ((g, s, e),) = gram.pieces(0, 77)
    means = torch.zeros(1, 33, dtype=torch.float64)
    inv = torch.zeros(77, dtype=torch.int64)
    sq, res = integer_gram.deviations_and_residues(
        means, inv, x, shift, g.scale, g.moduli, *gram.padding(g, s, e)
    )
    assert res.shape == (len(g.moduli), 40, 80)  # padded: 33 → 40 columns, 77 → 80 rows
    np.testing.assert_allclose(sq.numpy(), (x.numpy() ** 2).sum(1), rtol=1e-13)
    gram.put(g, s, e, res)
    upper = torch.zeros(33, 33, dtype=torch.float64)
    gram.add_upper(upper)
    np.testing.assert_array_equal(np.triu(upper.numpy()), np.triu(eager))
    assert {name for name, _ in fold_kernels._compiled} == {
        "deviations_and_residues_eager",
        "garner_eager",
    }
    assert not fold_kernels._unavailable
