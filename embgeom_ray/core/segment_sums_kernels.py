"""The Triton kernels of :mod:`~embgeom_ray.core.segment_sums` (imported there on first use:
this module imports Triton, which the CPU build of torch does not bring).

``triton.jit`` reads ``TRITON_INTERPRET`` as it wraps, when this module is first imported:
the tests set it before (``tests/conftest.py``), a GPU run never does.
"""

import triton
import triton.language as tl


@triton.jit
def seg_add(k1, v1, k2, v2):
    """The segmented sum's operator: (k₁, v₁) ∘ (k₂, v₂) = (k₂, v₂ + [k₁ = k₂] v₁)."""
    return k2, tl.where(k1 == k2, v1 + v2, v2)


@triton.jit
def group_pass(
    rows_ptr,  # (n, d) rows, any float dtype, row stride stride_row, unit column stride
    order_ptr,  # (n,) int64: the row at each position of group order (unless IN_ORDER)
    keys_ptr,  # (n,) int64: the group at each position of group order (non-decreasing)
    sums_ptr,  # (groups, d) float64, out
    units_ptr,  # float64, row stride stride_units: the unit-vector sums are added (WEIGHTED)
    unit_rows_ptr,  # (groups,) int64: the row of units_ptr each group's sum is added to
    carry_ptr,  # (chunks, 2, 2, d) float64, out: pieces of groups across chunks (sums, units)
    amax_ptr,  # (n,) int64, out (TAILS): each row's first argmax dimension, in group order
    amin_ptr,  # (n,) int64, out (TAILS): ... and argmin
    n,
    d,
    stride_row,
    stride_units,
    R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IN_ORDER: tl.constexpr,
    WEIGHTED: tl.constexpr,
    TAILS: tl.constexpr,
):
    c = tl.program_id(0)
    first = c * R
    p = first + tl.arange(0, R)
    valid = p < n
    keys = tl.load(keys_ptr + p, mask=valid, other=-1)
    nxt = tl.load(keys_ptr + p + 1, mask=p + 1 < n, other=-2)
    first_key = tl.load(keys_ptr + first)
    prev_key = tl.load(keys_ptr + tl.maximum(first - 1, 0))
    prev_key = tl.where(c > 0, prev_key, -3)
    if IN_ORDER:
        row = p.to(tl.int64)
    else:
        row = tl.load(order_ptr + p, mask=valid, other=0)
    base = rows_ptr + row * stride_row
    cols0 = tl.arange(0, BLOCK_D)
    if WEIGHTED or TAILS:  # walk 1: Σ x² and the tails of each row
        ssq = tl.zeros((R,), dtype=tl.float64)
        top = tl.full((R,), float("-inf"), dtype=tl.float64)
        low = tl.full((R,), float("inf"), dtype=tl.float64)
        top_at = tl.zeros((R,), dtype=tl.int64)
        low_at = tl.zeros((R,), dtype=tl.int64)
        for c0 in range(0, d, BLOCK_D):
            cols = c0 + cols0
            inside = cols < d
            m = valid[:, None] & inside[None, :]
            x = tl.load(base[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float64)
            ssq += tl.sum(x * x, axis=1)
            if TAILS:
                hi = tl.where(inside[None, :], x, float("-inf"))
                lo = tl.where(inside[None, :], x, float("inf"))
                b_top = tl.max(hi, axis=1)
                b_low = tl.min(lo, axis=1)
                b_top_at = tl.argmax(hi, axis=1, tie_break_left=True).to(tl.int64) + c0
                b_low_at = tl.argmin(lo, axis=1, tie_break_left=True).to(tl.int64) + c0
                top_at = tl.where(b_top > top, b_top_at, top_at)  # strict: first on ties
                low_at = tl.where(b_low < low, b_low_at, low_at)
                top = tl.maximum(top, b_top)
                low = tl.minimum(low, b_low)
        if TAILS:
            tl.store(amax_ptr + p, top_at, mask=valid)
            tl.store(amin_ptr + p, low_at, mask=valid)
        w = 1.0 / tl.maximum(tl.sqrt(ssq), 2.2250738585072014e-308)  # 1/max(‖x‖, tiny)
    last = p == first + R - 1
    is_end = valid & ((nxt != keys) | last)  # the last row of its group in the chunk
    partial = (keys == prev_key) | (last & (nxt == keys))  # the group crosses a chunk edge
    slot = tl.where(keys == first_key, 0, 1)
    whole = is_end & ~partial
    piece = is_end & partial
    out_row = keys.to(tl.int64) * d
    carry_row = ((c.to(tl.int64) * 2 + slot) * 2) * d
    if WEIGHTED:
        unit_row = tl.load(unit_rows_ptr + keys, mask=whole, other=0) * stride_units
    k2 = keys.to(tl.int32)
    for c0 in range(0, d, BLOCK_D):  # walk 2: the segmented sums
        cols = c0 + cols0
        inside = cols < d
        m = valid[:, None] & inside[None, :]
        x = tl.load(base[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float64)
        kk = tl.broadcast_to(k2[:, None], (R, BLOCK_D))
        _, s = tl.associative_scan((kk, x), 0, seg_add)
        tl.store(sums_ptr + out_row[:, None] + cols[None, :], s, mask=whole[:, None] & m)
        tl.store(carry_ptr + carry_row[:, None] + cols[None, :], s, mask=piece[:, None] & m)
        if WEIGHTED:
            _, s = tl.associative_scan((kk, x * w[:, None]), 0, seg_add)
            at = units_ptr + unit_row[:, None] + cols[None, :]
            into = whole[:, None] & m
            tl.store(at, tl.load(at, mask=into, other=0.0) + s, mask=into)
            tl.store(carry_ptr + carry_row[:, None] + d + cols[None, :], s, mask=piece[:, None] & m)


@triton.jit
def join(
    keys_ptr,  # as group_pass's
    starts_ptr,  # (groups + 1,) int64: each group's first position in group order
    sums_ptr,  # as group_pass's
    units_ptr,
    unit_rows_ptr,
    carry_ptr,
    n,
    d,
    stride_units,
    R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WEIGHTED: tl.constexpr,
):
    c = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    inside = cols < d
    first = c * R
    key = tl.load(keys_ptr + first)
    prev_key = tl.load(keys_ptr + tl.maximum(first - 1, 0))
    next_key = tl.load(keys_ptr + tl.minimum(first + R, n - 1))
    began_before = (c > 0) & (prev_key == key)
    ends_here = (first + R >= n) | (next_key != key)
    if began_before & ends_here:  # the group of the chunk's first row: its pieces, in order
        start = tl.load(starts_ptr + key)
        c_start = start // R
        slot = tl.where(start % R == 0, 0, 1)
        at = ((c_start * 2 + slot) * 2) * d + cols
        acc = tl.load(carry_ptr + at, mask=inside, other=0.0)
        if WEIGHTED:
            acc_w = tl.load(carry_ptr + at + d, mask=inside, other=0.0)
        for cc in range(c_start + 1, c + 1):
            at = (cc * 4) * d + cols
            acc += tl.load(carry_ptr + at, mask=inside, other=0.0)
            if WEIGHTED:
                acc_w += tl.load(carry_ptr + at + d, mask=inside, other=0.0)
        tl.store(sums_ptr + key.to(tl.int64) * d + cols, acc, mask=inside)
        if WEIGHTED:
            target = units_ptr + tl.load(unit_rows_ptr + key) * stride_units + cols
            tl.store(target, tl.load(target, mask=inside, other=0.0) + acc_w, mask=inside)
