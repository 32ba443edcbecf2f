"""Which sampled occurrences are the same point: by what the model saw, then by bits.

The sample stores, with each occurrence, a content key
(:func:`embgeom_ray.core.samples.content_keys`): equal keys mean the model saw the same input
for both occurrences (the same window, or the same prefix for a causal model, and the same
position), so their vectors are one point up to the forward's rounding, whose last bits depend
on how the windows were batched. :func:`distinct_rows` keeps one occurrence per key, and then
one per bit pattern (points with different inputs but bit-identical vectors, such as the
embedding layer's, which depends on the token and position only).
"""

from __future__ import annotations

import numpy as np


def _first_of_each(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first, inverse) of the equal entries (rows) of ``keys``: ``first`` ascending indices of
    each value's first occurrence, ``inverse[i]`` the position in ``first`` of row i's value."""
    axis = 0 if keys.ndim > 1 else None
    _, first, inverse = np.unique(keys, axis=axis, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    return first[order].astype(np.int64), rank[np.asarray(inverse).reshape(-1)]


#: odd 64-bit multipliers of the row hash (:func:`_first_of_each_row`), fixed once
_ROW_HASH = np.random.default_rng(0x5EED).integers(0, 2**63, 4096, dtype=np.uint64) * 2 + 1


def _first_of_each_row(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_first_of_each` of the rows of a 2-D float array (the equal rows as
    ``np.unique(X, axis=0)`` finds them: every coordinate equal in value), from one 64-bit
    hash per row: Σ_i w_i · m_i mod 2⁶⁴ over the row's 64-bit words w_i (−0.0 made +0.0
    first: equal values, equal bits) with fixed odd multipliers m_i. Rows of one hash are
    then checked equal to the first of them; a collision or a NaN (unequal to itself) fails
    the check, and ``np.unique(X, axis=0)`` decides. The classes are the same either way, and
    so is (first, inverse), which depends on the classes alone."""
    norm = np.ascontiguousarray(X) + X.dtype.type(0)
    raw = norm.view(np.uint8).reshape(len(norm), -1)
    pad = -raw.shape[1] % 8
    if pad:
        raw = np.hstack([raw, np.zeros((len(raw), pad), np.uint8)])
    words = np.ascontiguousarray(raw).view(np.uint64)
    mult = np.resize(_ROW_HASH, words.shape[1])
    with np.errstate(over="ignore"):
        h = (words * mult[None, :]).sum(axis=1, dtype=np.uint64)
    first, inverse = _first_of_each(h)
    if (norm == norm[first][inverse]).all():
        return first, inverse
    return _first_of_each(X)


def distinct_rows(
    X: np.ndarray, groups: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(first, inverse): the rows of X that are distinct points, and each row's point.

    Rows are the same point when their ``groups`` (content keys) are equal, or when they are
    bit-identical (every coordinate equal, as ``np.unique(X, axis=0)`` compares them); with
    ``groups`` None only the latter. ``first`` (ascending) indexes the first row of each
    point, so ``X[first]`` keeps the input order (and is X itself when no row repeats);
    ``inverse[i]`` is the position in ``X[first]`` of row i's point, so ``X[first][inverse]``
    equals X up to the rounding between rows of one content key.
    """
    X = np.asarray(X)
    if X.ndim != 2:
        raise ValueError(f"X must be an (n, d) array, got shape {X.shape}")
    if len(X) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    rows = _first_of_each_row if X.dtype.kind == "f" and X.shape[1] else _first_of_each
    if groups is None:
        return rows(X)
    groups = np.asarray(groups)
    if groups.shape != (len(X),):
        raise ValueError(f"groups must be ({len(X)},), got {groups.shape}")
    first, inverse = _first_of_each(groups)
    bits_first, bits_inverse = rows(X[first])
    return first[bits_first], bits_inverse[inverse]
