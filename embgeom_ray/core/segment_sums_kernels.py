"""The Triton kernels of :mod:`~embgeom_ray.core.segment_sums` (imported there on first use:
this module imports Triton, which the CPU build of torch does not bring).

``triton.jit`` reads ``TRITON_INTERPRET`` as it wraps, when this module is first imported:
the tests set it before (``tests/conftest.py``), a GPU run never does.
"""

import triton
import triton.language as tl


@triton.jit
def row_stats(
    rows_ptr,  # (n, d) rows, any float dtype, row stride stride_row, unit column stride
    order_ptr,  # (n,) int64: the row at each position of group order (unless IN_ORDER)
    inv_norms_ptr,  # (n,) float64, out: 1/max(‖x‖, tiny) of the row at each position
    amax_ptr,  # (n,) int64, out (TAILS): each row's first argmax dimension, by position
    amin_ptr,  # (n,) int64, out (TAILS): ... and argmin
    n,
    d,
    stride_row,
    RB: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IN_ORDER: tl.constexpr,
    TAILS: tl.constexpr,
):
    p = tl.program_id(0) * RB + tl.arange(0, RB)
    valid = p < n
    if IN_ORDER:
        row = p.to(tl.int64)
    else:
        row = tl.load(order_ptr + p, mask=valid, other=0)
    base = rows_ptr + row * stride_row
    ssq = tl.zeros((RB,), dtype=tl.float64)
    top = tl.full((RB,), float("-inf"), dtype=tl.float64)
    low = tl.full((RB,), float("inf"), dtype=tl.float64)
    top_at = tl.zeros((RB,), dtype=tl.int64)
    low_at = tl.zeros((RB,), dtype=tl.int64)
    for c0 in range(0, d, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)
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
            top_at = tl.where(b_top > top, b_top_at, top_at)  # strict: the first on ties
            low_at = tl.where(b_low < low, b_low_at, low_at)
            top = tl.maximum(top, b_top)
            low = tl.minimum(low, b_low)
    tl.store(inv_norms_ptr + p, 1.0 / tl.maximum(tl.sqrt(ssq), 2.2250738585072014e-308), mask=valid)
    if TAILS:
        tl.store(amax_ptr + p, top_at, mask=valid)
        tl.store(amin_ptr + p, low_at, mask=valid)


@triton.jit
def group_pass(
    rows_ptr,  # as row_stats'
    order_ptr,  # as row_stats'
    keys_ptr,  # (n,) int64: the group at each position of group order (non-decreasing)
    sums_ptr,  # (groups, d) float64, out
    units_ptr,  # float64, row stride stride_units: the unit-vector sums are added (WEIGHTED)
    unit_rows_ptr,  # (groups,) int64: the row of units_ptr each group's sum is added to
    inv_norms_ptr,  # (n,) float64: row_stats' (WEIGHTED)
    carry_ptr,  # (chunks, 2, 2, d) float64, out: pieces of groups across chunks (sums, units)
    n,
    d,
    stride_row,
    stride_units,
    R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IN_ORDER: tl.constexpr,
    WEIGHTED: tl.constexpr,
):
    c = tl.program_id(0).to(tl.int64)  # (first, end and the rows' positions in int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    inside = cols < d
    first = c * R
    end = tl.minimum(first + R, n)
    first_key = tl.load(keys_ptr + first)
    prev_key = tl.load(keys_ptr + tl.maximum(first - 1, 0))
    prev_key = tl.where(c > 0, prev_key, -3)
    key = first_key
    acc = tl.zeros((BLOCK_D,), dtype=tl.float64)
    acc_w = tl.zeros((BLOCK_D,), dtype=tl.float64)
    # each step reads the next row (and its key and weight) before it adds the current one:
    # two reads in flight, where a loop that adds what it just read waits for every read
    if IN_ORDER:
        row = first
    else:
        row = tl.load(order_ptr + first)
    x = tl.load(rows_ptr + row * stride_row + cols, mask=inside, other=0.0)
    nxt = tl.load(keys_ptr + tl.minimum(first + 1, n - 1))
    w = 0.0
    if WEIGHTED:
        w = tl.load(inv_norms_ptr + first)
    for p in range(first, end):  # the chunk's rows in order, one group's piece at a time
        q = p + 1  # the next row's position (its read masked off past the chunk)
        if IN_ORDER:
            row = q
        else:
            row = tl.load(order_ptr + tl.minimum(q, n - 1))
        more = inside & (q + tl.zeros_like(cols) < end)  # (q as a vector: the interpreter's masks)
        x_q = tl.load(rows_ptr + row * stride_row + cols, mask=more, other=0.0)
        nxt_q = tl.load(keys_ptr + tl.minimum(q + 1, n - 1))
        xf = x.to(tl.float64)
        acc += xf
        if WEIGHTED:
            acc_w += xf * w
            w = tl.load(inv_norms_ptr + tl.minimum(q, n - 1))
        nxt = tl.where(q < n, nxt, -2)
        if (nxt != key) | (p == end - 1):  # the piece of group `key` ends here
            if (key == prev_key) | ((p == end - 1) & (nxt == key)):  # it crosses a chunk edge
                slot = tl.where(key == first_key, 0, 1)
                at = carry_ptr + ((c * 2 + slot) * 2) * d + cols
                tl.store(at, acc, mask=inside)
                if WEIGHTED:
                    tl.store(at + d, acc_w, mask=inside)
            else:
                tl.store(sums_ptr + key * d + cols, acc, mask=inside)
                if WEIGHTED:
                    target = units_ptr + tl.load(unit_rows_ptr + key) * stride_units + cols
                    tl.store(target, tl.load(target, mask=inside, other=0.0) + acc_w, mask=inside)
            acc = tl.zeros((BLOCK_D,), dtype=tl.float64)
            acc_w = tl.zeros((BLOCK_D,), dtype=tl.float64)
            key = nxt
        x = x_q
        nxt = nxt_q


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


@triton.jit
def merge_types(
    means_ptr,  # (capacity, d) float64, row stride stride_means: the running means, in place
    counts_ptr,  # (capacity,) int64: the running counts, in place
    m2_ptr,  # (capacity,) float64: the running M2, in place
    slots_ptr,  # (u,) int64: the slot of each of the batch's types (no slot twice)
    n_b_ptr,  # (u,) int64: the batch's rows of each type
    mean_b_ptr,  # (u, d) float64, row stride stride_b: the batch's means
    m2_b_ptr,  # (u,) float64: the batch's M2
    u,
    d,
    stride_means,
    stride_b,
    TB: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0) * TB + tl.arange(0, TB)
    valid = t < u
    slot = tl.load(slots_ptr + t, mask=valid, other=0)
    n_a = tl.load(counts_ptr + slot, mask=valid, other=0)
    n_b = tl.load(n_b_ptr + t, mask=valid, other=0)
    n = n_a + n_b
    n_f = tl.maximum(n.to(tl.float64), 1.0)
    w_b = n_b.to(tl.float64) / n_f
    w_ab = n_a.to(tl.float64) * n_b.to(tl.float64) / n_f
    row_a = means_ptr + slot * stride_means
    row_b = mean_b_ptr + t.to(tl.int64) * stride_b
    ssq = tl.zeros((TB,), dtype=tl.float64)
    for c0 in range(0, d, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)
        m = valid[:, None] & (cols < d)[None, :]
        mean_a = tl.load(row_a[:, None] + cols[None, :], mask=m, other=0.0)
        delta = tl.load(row_b[:, None] + cols[None, :], mask=m, other=0.0) - mean_a
        tl.store(row_a[:, None] + cols[None, :], mean_a + delta * w_b[:, None], mask=m)
        ssq += tl.sum(delta * delta, axis=1)
    m2_b = tl.load(m2_b_ptr + t, mask=valid, other=0.0)
    m2 = tl.load(m2_ptr + slot, mask=valid, other=0.0)
    tl.store(m2_ptr + slot, m2 + (m2_b + ssq * w_ab), mask=valid)
    tl.store(counts_ptr + slot, n, mask=valid)
