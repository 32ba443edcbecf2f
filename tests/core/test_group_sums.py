"""Sums of rows by group as sparse products (the GPU fold's) against a float64 loop."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embgeom_ray.core.group_sums import GroupMatrix


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
