"""The CPU's float64 co-moment product (``core/gram.py``): ``dsyrk`` on one thread against the
block triangle and an exact reference."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from embgeom_ray.core import gram
from embgeom_ray.inputs.lanes import intra_op_threads


def exact_upper(x: np.ndarray) -> np.ndarray:
    """XᵀX's upper triangle, each entry the float64 rounding of the exact sum."""
    d = x.shape[1]
    out = np.zeros((d, d))
    for a in range(d):
        for b in range(a, d):
            pairs = zip(x[:, a], x[:, b], strict=True)
            out[a, b] = float(sum(Fraction(float(p)) * Fraction(float(q)) for p, q in pairs))
    return out


@pytest.mark.parametrize("offset", [0.0, 3e3])
@pytest.mark.parametrize("contiguous", [True, False])
def test_dsyrk_adds_the_upper_triangle_on_one_thread(monkeypatch, offset, contiguous):
    """On one intra-op thread a float64 product goes to dsyrk: the upper triangle (diagonal
    included) added within float64 rounding of the exact sums, the strict lower triangle
    untouched, into a C-order accumulator or any strided one (written back); the block
    triangle agrees to the same rounding. On two threads, and with ``CPU_SYRK`` off, the block
    triangle runs (dsyrk is never called)."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(37, 11)) + offset
    before = rng.normal(size=(11, 11))
    want = np.triu(before + exact_upper(x)) + np.tril(before, -1)
    scale = np.abs(x).max() ** 2 * len(x)
    calls = []
    real = gram._syrk_upper
    monkeypatch.setattr(gram, "_syrk_upper", lambda u, xs: (calls.append(1), real(u, xs)))

    def fold(threads: int) -> np.ndarray:
        # the same values, in C order or with column-major strides
        upper = torch.tensor(before) if contiguous else torch.tensor(before.T.copy()).T
        with intra_op_threads(threads):
            gram.add_gram(upper, torch.tensor(x))
        return upper.numpy()

    one = fold(1)
    assert calls == [1]
    np.testing.assert_allclose(np.triu(one), np.triu(want), rtol=0, atol=1e-15 * scale)
    np.testing.assert_array_equal(np.tril(one, -1), np.tril(before, -1))
    two = fold(2)
    assert calls == [1]  # torch's own product on two threads
    np.testing.assert_allclose(np.triu(two), np.triu(want), rtol=0, atol=1e-15 * scale)
    monkeypatch.setattr(gram, "CPU_SYRK", False)
    fold(1)
    assert calls == [1]
