"""Content keys: equal model inputs give equal keys, whatever the batch; any change of input changes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embgeom_ray.core.distinct import distinct_rows
from embgeom_ray.core.samples import content_keys
from embgeom_ray.inputs.model_loading import content_rule

windows = st.lists(st.integers(0, 50_000), min_size=1, max_size=24)


def batch(rows: list[list[int]], pad_to: int = 0, pad_id: int = 0):
    """Right-padded ids and attention mask of ``rows`` (padding ``pad_id``, mask 0)."""
    width = max(max(map(len, rows)), pad_to)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
        mask[r, : len(row)] = 1
    return ids, mask


def keys_of(rows: list[list[int]], rule: str, **kw) -> list[list[int]]:
    ids, mask = batch(rows, **kw)
    k = content_keys(ids, mask, rule)
    return [k[r, : len(row)].tolist() for r, row in enumerate(rows)]


@settings(max_examples=60, deadline=None)
@given(
    window=windows,
    others=st.lists(windows, max_size=4),
    pad=st.integers(0, 9),
    pad_id=st.integers(0, 9),
    rule=st.sampled_from(["window", "prefix"]),
)
def test_equal_inputs_give_equal_keys_whatever_the_batch(window, others, pad, pad_id, rule):
    """The same window alone, among other rows, with more padding or another pad id: the same
    keys; and every key is a 63-bit non-negative integer."""
    alone = keys_of([window], rule)[0]
    among = keys_of([*others, window], rule, pad_to=len(window) + pad, pad_id=pad_id)[-1]
    assert alone == among
    assert all(0 <= k < 2**63 for k in alone)


@settings(max_examples=60, deadline=None)
@given(window=windows, data=st.data())
def test_any_change_of_input_changes_the_key(window, data):
    """Another token id anywhere in the window, another window length, or another position
    changes every window key; for a prefix key, exactly the positions at or after the change."""
    n = len(window)
    at = data.draw(st.integers(0, n - 1))
    other = list(window)
    other[at] = data.draw(st.integers(0, 50_000).filter(lambda t: t != window[at]))
    for rule in ("window", "prefix"):
        a, b = keys_of([window, other], rule)
        for p in range(n):
            changed = rule == "window" or p >= at
            assert (a[p] != b[p]) == changed, (rule, p, at)
        assert len(set(a)) == n  # positions of one window never share a key
    longer = [*window, data.draw(st.integers(0, 50_000))]
    assert keys_of([longer], "window")[0][:n] != keys_of([window], "window")[0][:n]
    assert keys_of([longer], "prefix")[0][:n] == keys_of([window], "prefix")[0]


def test_prefix_keys_see_no_later_token_and_window_keys_see_all():
    """Two windows sharing their first three tokens: a causal model's positions 0..2 saw the
    same input in both (equal prefix keys), a bidirectional model's did not."""
    a, b = [101, 7, 8, 9, 102], [101, 7, 8, 4, 5, 102]
    pa, pb = keys_of([a, b], "prefix")
    assert pa[:3] == pb[:3] and pa[3] != pb[3]
    wa, wb = keys_of([a, b], "window")
    assert all(x != y for x, y in zip(wa, wb, strict=False))


def test_distinct_rows_by_content_then_by_bits():
    """Rows of one content key are one point even when their vectors differ in the last bits;
    rows of different keys are one point only when bit-identical."""
    rng = np.random.default_rng(0)
    base = rng.normal(size=(4, 3))
    X = np.vstack([base, base[[0, 1]] * (1 + 1e-7), base[[2]]])  # rows 4, 5 ≈ 0, 1; 6 == 2
    groups = np.array([10, 11, 12, 13, 10, 11, 99])
    first, inverse = distinct_rows(X, groups)
    np.testing.assert_array_equal(first, [0, 1, 2, 3])
    np.testing.assert_array_equal(inverse, [0, 1, 2, 3, 0, 1, 2])
    by_bits, _ = distinct_rows(X)
    np.testing.assert_array_equal(by_bits, [0, 1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="groups"):
        distinct_rows(X, groups[:3])


@pytest.mark.parametrize(
    ("model_type", "extra", "rule"),
    [
        ("bert", {}, "window"),
        ("roberta", {}, "window"),
        ("bert", {"is_decoder": True}, "prefix"),
        ("gpt2", {}, "prefix"),
        ("llama", {}, "prefix"),
    ],
)
def test_content_rule_follows_the_attention(model_type, extra, rule):
    from transformers import AutoConfig

    assert content_rule(AutoConfig.for_model(model_type, **extra)) == rule


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([np.float16, np.float32, np.float64]),
    st.integers(1, 7),
    st.integers(0, 2**32 - 1),
)
def test_distinct_rows_by_hash_equal_numpys_unique_rows(dtype, d, seed):
    """The rows' hash finds the classes np.unique(X, axis=0) finds (equal values: −0.0 and
    +0.0 one row, a NaN row its own), so (first, inverse) are the same."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((12, d)).astype(dtype)[rng.integers(0, 12, 60)]
    X[rng.integers(0, 60, 6), 0] = -0.0
    X[rng.integers(0, 60, 6), 0] = 0.0
    if seed % 3 == 0:
        X[rng.integers(0, 60, 2), -1] = np.nan
    _, first_np, inverse_np = np.unique(X, axis=0, return_index=True, return_inverse=True)
    first, inverse = distinct_rows(X)
    # the classes: rows i, j are one point exactly when numpy's unique rows say so
    assert np.array_equal(
        inverse[:, None] == inverse[None, :],
        inverse_np.reshape(-1)[:, None] == inverse_np.reshape(-1)[None, :],
    )
    assert np.array_equal(first, np.sort(first_np))
    assert np.array_equal(X[first][inverse], X, equal_nan=True)
