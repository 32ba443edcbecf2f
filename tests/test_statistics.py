"""The statistics core against independent float64 two-pass computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import embgeom_ray.core.statistics as statistics_module
from embgeom_ray.core.metrics import (
    cosine_metrics,
    dims_table,
    isoscore_from_covariance,
    layers_table,
    self_similarity,
    type_stats_table,
    type_variances,
    variance_decomposition,
)
from embgeom_ray.core.statistics import EmbeddingStatistics
from embgeom_ray.errors import StatisticsMismatchError


@pytest.fixture(autouse=True, scope="module", params=["one block", "blocks of 5 rows"])
def row_block(request):
    """Every test twice: batches folded in one block of rows, and in many blocks of 5 rows
    (the CPU fold walks blocks of ``CPU_ROW_BLOCK`` rows; its tests' batches are smaller)."""
    saved = statistics_module.CPU_ROW_BLOCK
    statistics_module.CPU_ROW_BLOCK = 5 if request.param == "blocks of 5 rows" else 1 << 30
    yield request.param
    statistics_module.CPU_ROW_BLOCK = saved


def make_batch(rng: np.random.Generator, n_layers=2, b=3, t=7, d=5, vocab=6, offset=0.0):
    """Random hidden states (L,B,T,d) float64, ids (B,T), keep mask (B,T)."""
    h = rng.normal(size=(n_layers, b, t, d))
    h += offset
    ids = rng.integers(0, vocab, size=(b, t))
    keep = rng.random((b, t)) > 0.2
    return h, ids, keep


def fold(stats: EmbeddingStatistics, h, ids, keep, positions=None) -> EmbeddingStatistics:
    stats.update(
        torch.as_tensor(h),
        torch.as_tensor(ids),
        torch.as_tensor(keep),
        None if positions is None else torch.as_tensor(np.array(positions)),
    )
    return stats


def two_pass(points: np.ndarray, ids: np.ndarray) -> dict:
    """Independent float64 two-pass reference for one layer: per-type count/mean/variance."""
    out = {}
    for t in np.unique(ids):
        x = points[ids == t]
        mu = x.mean(0)
        out[int(t)] = (len(x), mu, ((x - mu) ** 2).sum(1).mean())
    return out


def flat(h, ids, keep, layer_index):
    return h[layer_index][keep].astype(np.float64), ids[keep]


def assert_matches_two_pass(stats, h, ids, keep, rtol):
    for li, layer in enumerate(stats.layers):
        x, tid = flat(h, ids, keep, li)
        m = stats.layer(layer)
        ref = two_pass(x, tid)
        assert m.type_ids.tolist() == sorted(ref)
        var = type_variances(m)
        for k, t in enumerate(m.type_ids):
            n, mu, v = ref[int(t)]
            assert m.counts[k] == n
            np.testing.assert_allclose(m.means[k], mu, rtol=1e-12, atol=1e-12 * np.abs(mu).max())
            if n == 1:
                assert var[k] == 0.0
            else:
                np.testing.assert_allclose(var[k], v, rtol=rtol)
        mu = x.mean(0)
        cov = (x - mu).T @ (x - mu)
        np.testing.assert_allclose(m.mean, mu, rtol=1e-12, atol=1e-12 * np.abs(mu).max())
        np.testing.assert_allclose(m.comoment, cov, rtol=rtol, atol=rtol * np.abs(cov).max())


def test_single_batch_equals_two_pass():
    rng = np.random.default_rng(0)
    h, ids, keep = make_batch(rng, d=8, vocab=5, t=20)
    stats = fold(EmbeddingStatistics([0, 3], 8), h, ids, keep)
    assert_matches_two_pass(stats, h, ids, keep, rtol=1e-12)


@pytest.mark.parametrize("scale", [1e3, 3e3, 4e4])
def test_massive_offsets_in_few_dims(scale):
    """||μ||²/V ~ 1e8 in a few dimensions (GPT-2's massive activations): still 1e-6 relative."""
    rng = np.random.default_rng(1)
    stats = EmbeddingStatistics([0], 16)
    hs = []
    for _ in range(5):
        h, ids, keep = make_batch(rng, n_layers=1, b=4, t=30, d=16, vocab=7)
        h[..., :2] += scale  # the massive dims
        h *= 1.0  # keep float64
        fold(stats, h, ids, keep)
        hs.append((h, ids, keep))
    h = np.concatenate([a for a, _, _ in hs], axis=1)
    ids = np.concatenate([b for _, b, _ in hs], axis=0)
    keep = np.concatenate([c for _, _, c in hs], axis=0)
    m = stats.layer(0)
    x, _ = flat(h, ids, keep, 0)
    ratio = (np.linalg.norm(m.mean) ** 2) / (np.trace(m.comoment) / m.n)
    assert ratio > 0.5 * scale**2 / 16  # 4e4 gives ||mu||^2/V ~ 2e8
    assert_matches_two_pass(stats, h, ids, keep, rtol=1e-6)
    # IsoScore must not drift with the shared offset
    iso_shifted = isoscore_from_covariance(m.covariance)
    xc = x - x.mean(0)
    np.testing.assert_allclose(
        iso_shifted, isoscore_from_covariance(xc.T @ xc / len(xc)), rtol=1e-9
    )


def test_float32_naive_formula_would_fail_but_we_do_not():
    """The motivating failure: E||x||² − ||μ||² in float32 is badly wrong at ||μ|| = 3000."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(4000, 32)).astype(np.float32)
    x[:, 0] += 3000.0
    naive = np.mean((x**2).sum(1)) - np.sum(x.mean(0) ** 2)
    true = ((x.astype(np.float64) - x.astype(np.float64).mean(0)) ** 2).sum(1).mean()
    assert abs(naive - true) / true > 1e-3  # the textbook formula is broken here
    stats = EmbeddingStatistics([0], 32)
    for chunk in np.array_split(np.arange(4000), 8):
        xb = torch.from_numpy(x[chunk])[None, None]  # (L=1, B=1, T, d) float32
        stats.update(xb, torch.zeros(1, len(chunk), dtype=torch.long))
    m = stats.layer(0)
    np.testing.assert_allclose(type_variances(m)[0], true, rtol=1e-9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_are_cast_before_squaring(dtype):
    """Statistics of bf16/fp16 activations equal float64 two-pass on the same (rounded) values."""
    rng = np.random.default_rng(3)
    h, ids, keep = make_batch(rng, d=12, t=40, vocab=4)
    h[..., 0] += 200.0  # squares overflow fp16 (65504) if not cast first
    ht = torch.as_tensor(h).to(dtype)
    stats = EmbeddingStatistics([0, 1], 12)
    stats.update(ht, torch.as_tensor(ids), torch.as_tensor(keep))
    assert_matches_two_pass(stats, ht.double().numpy(), ids, keep, rtol=1e-9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_float32_comoment_of_any_input_dtype(dtype):
    """The float32 co-moment path subtracts the float32 shift from the model's own values
    (bf16/fp16 promote to float32, float64 rounds once): the covariance keeps ~1e-6 relative
    accuracy and every per-type statistic stays exact."""
    rng = np.random.default_rng(31)
    h, ids, keep = make_batch(rng, n_layers=1, b=6, t=40, d=16, vocab=5)
    h[..., :2] += 200.0
    ht = torch.as_tensor(h).to(dtype)
    exact = EmbeddingStatistics([0], 16)
    fast = EmbeddingStatistics([0], 16, comoment_precision="float32")
    for stats in (exact, fast):
        stats.update(ht, torch.as_tensor(ids), torch.as_tensor(keep))
    x = ht.double().numpy()[0][keep]
    ref = (x - x.mean(0)).T @ (x - x.mean(0))
    np.testing.assert_allclose(fast.layer(0).comoment, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    np.testing.assert_allclose(fast.layer(0).mean, x.mean(0), rtol=1e-12)
    np.testing.assert_array_equal(type_variances(exact.layer(0)), type_variances(fast.layer(0)))


def test_finite_values_beyond_float32_are_not_taken_for_nonfinite():
    """The fold's NaN/inf check is one float32 sum; finite float64 values whose sum overflows
    float32 take the exact row-by-row route and are all kept."""
    rng = np.random.default_rng(32)
    h, ids, keep = make_batch(rng, n_layers=1, b=2, t=8, d=4, vocab=3)
    h = (np.abs(h) + 1.0) * 1e38
    with np.errstate(over="ignore"):
        assert not np.isfinite(h[0][keep].astype(np.float32).sum())  # the exact route is taken
    stats = fold(EmbeddingStatistics([0], 4), h, ids, keep)
    m = stats.layer(0)
    assert m.nonfinite == 0 and m.n == int(keep.sum())
    np.testing.assert_allclose(m.mean, h[0][keep].mean(0), rtol=1e-12)


def test_single_occurrence_variance_is_exactly_zero():
    rng = np.random.default_rng(4)
    h = rng.normal(size=(1, 1, 4, 3)) * 1e3 + 1e4
    stats = fold(EmbeddingStatistics([0], 3), h, np.array([[5, 6, 7, 7]]), np.ones((1, 4), bool))
    m = stats.layer(0)
    v = type_variances(m)
    assert v[0] == 0.0 and v[1] == 0.0 and v[2] > 0.0


def test_total_variance_equals_within_plus_between():
    rng = np.random.default_rng(5)
    h, ids, keep = make_batch(rng, d=10, t=50, vocab=9, offset=50.0)
    stats = fold(EmbeddingStatistics([0, 1], 10), h, ids, keep)
    for layer in stats.layers:
        total, within, between = variance_decomposition(stats.layer(layer))
        assert abs(total - (within + between)) <= 1e-12 * total


def shards_strategy():
    return st.tuples(
        st.integers(1, 5),  # number of shards
        st.integers(0, 2**31 - 1),  # seed
        st.booleans(),  # massive offset
    )


@settings(max_examples=25, deadline=None)
@given(shards_strategy(), st.sampled_from(["float64", "float32"]))
def test_merge_of_random_shards_equals_one_pass(params, precision):
    """Any split into shards and sub-batches, merged in any order or as a tree, equals one
    pass: to 1e-10 with the exact product; with the float32 product (whose rounding depends
    on the batch order through its shift) the co-moment to 1e-6, everything else to 1e-10."""
    k, seed, massive = params
    rng = np.random.default_rng(seed)
    h, ids, keep = make_batch(rng, n_layers=2, b=12, t=9, d=6, vocab=8)
    if massive:
        h[..., 0] += 1e4
    pos = np.broadcast_to(np.arange(9), ids.shape)
    whole = fold(
        EmbeddingStatistics([1, 4], 6, max_positions=9, comoment_precision=precision),
        h,
        ids,
        keep,
        pos,
    )
    # random split of the batch rows into k shards, each folded in random sub-batches
    assignment = rng.integers(0, k, size=12)
    parts = []
    for s in range(k):
        rows = np.flatnonzero(assignment == s)
        part = EmbeddingStatistics([1, 4], 6, max_positions=9, comoment_precision=precision)
        for sub in np.array_split(rows, max(1, len(rows) // 3)):
            if len(sub):
                fold(part, h[:, sub], ids[sub], keep[sub], pos[sub])
        parts.append(part)
    order = rng.permutation(k)
    merged = EmbeddingStatistics([1, 4], 6, max_positions=9, comoment_precision=precision)
    for i in order:
        merged.merge(parts[i])
    # also a tree-shaped merge
    tree = parts[:]
    while len(tree) > 1:
        tree = [
            tree[i].merge(tree[i + 1]) if i + 1 < len(tree) else tree[i]
            for i in range(0, len(tree), 2)
        ]
    for candidate in (merged, tree[0]):
        a, b = whole.state_dict(), candidate.state_dict()
        assert a.keys() == b.keys()
        for key in a:
            if a[key].dtype.kind in "iu":
                np.testing.assert_array_equal(a[key], b[key], err_msg=key)
            else:
                scale = max(np.abs(a[key]).max(), 1.0) if a[key].size else 1.0
                tol = 1e-6 if precision == "float32" and "comoment" in key else 1e-10
                np.testing.assert_allclose(a[key], b[key], rtol=tol, atol=tol * scale, err_msg=key)


def test_merge_is_commutative_in_the_compact_form():
    rng = np.random.default_rng(6)
    a = fold(EmbeddingStatistics([0], 4), *make_batch(rng, n_layers=1, d=4, vocab=10))
    b = fold(EmbeddingStatistics([0], 4), *make_batch(rng, n_layers=1, d=4, vocab=10))
    ab = EmbeddingStatistics.from_bytes(a.to_bytes()).merge(b)
    ba = EmbeddingStatistics.from_bytes(b.to_bytes()).merge(a)
    for key, val in ab.state_dict().items():
        np.testing.assert_allclose(val, ba.state_dict()[key], rtol=1e-13, atol=1e-13, err_msg=key)


def test_round_trip_is_exact(tmp_path):
    rng = np.random.default_rng(7)
    h, ids, keep = make_batch(rng, d=5, vocab=20, t=15)
    s = fold(
        EmbeddingStatistics([0, 2], 5, max_positions=15, metadata={"model_fingerprint": "m1"}),
        h,
        ids,
        keep,
    )
    path = tmp_path / "stats.safetensors"
    s.save(path)
    r = EmbeddingStatistics.load(path)
    assert r.layers == s.layers and r.dim == 5 and r.max_positions == 15
    assert r.metadata == {"model_fingerprint": "m1"}
    for key, val in s.state_dict().items():
        np.testing.assert_array_equal(val, r.state_dict()[key], err_msg=key)
    assert not list(tmp_path.glob(".tmp-*"))


def test_load_rejects_foreign_and_mismatched_artefacts(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{}abc")
    with pytest.raises(StatisticsMismatchError, match="not an embgeom_ray statistics artefact"):
        EmbeddingStatistics.load(bad)
    a = EmbeddingStatistics([0], 4, metadata={"model_fingerprint": "A"})
    b = EmbeddingStatistics([0], 4, metadata={"model_fingerprint": "B"})
    with pytest.raises(StatisticsMismatchError, match="model_fingerprint"):
        a.merge(b)
    with pytest.raises(StatisticsMismatchError, match="layers"):
        a.merge(EmbeddingStatistics([1], 4))


def test_nonfinite_tokens_are_counted_and_excluded():
    rng = np.random.default_rng(8)
    h, ids, keep = make_batch(rng, n_layers=2, d=4, t=10, vocab=3)
    keep[:] = True
    h[1, 0, 0, 2] = np.inf
    h[1, 1, 3, 0] = np.nan
    stats = fold(EmbeddingStatistics([0, 1], 4), h, ids, keep)
    assert stats.layer(0).nonfinite == 0 and stats.layer(1).nonfinite == 2
    assert stats.layer(1).n == stats.layer(0).n - 2
    good = np.ones(ids.shape, bool)
    good[0, 0] = good[1, 3] = False
    x = h[1][good]
    np.testing.assert_allclose(stats.layer(1).mean, x.mean(0), rtol=1e-12)


def test_nonfinite_rows_leave_every_other_statistic_exact():
    """A NaN/inf token in one layer drops out of that layer only; the rest of the batch keeps
    per-type moments, positions and tails equal to a two-pass computation on its finite rows."""
    rng = np.random.default_rng(18)
    h, ids, keep = make_batch(rng, n_layers=2, b=4, t=9, d=6, vocab=4)
    h[1, 0, 2, 1] = np.nan
    h[1, 3, 5, 4] = -np.inf
    keep[0, 2] = keep[3, 5] = True
    stats = fold(EmbeddingStatistics([0, 1], 6, max_positions=9), h, ids, keep)
    good = keep.copy()
    good[0, 2] = good[3, 5] = False
    m = stats.layer(1)
    assert m.nonfinite == 2 and m.n == int(good.sum())
    x, tid = h[1][good], ids[good]
    ref = two_pass(x, tid)
    assert m.type_ids.tolist() == sorted(ref)
    for k, t in enumerate(m.type_ids):
        n, mu, v = ref[int(t)]
        assert m.counts[k] == n
        np.testing.assert_allclose(m.means[k], mu, rtol=1e-12)
        np.testing.assert_allclose(type_variances(m)[k], v, rtol=1e-10, atol=1e-14)
    pos = np.broadcast_to(np.arange(9), ids.shape)[good]
    for q in np.unique(pos):
        np.testing.assert_allclose(m.position_means[q], x[pos == q].mean(0), rtol=1e-12)
    np.testing.assert_array_equal(m.argmax_counts, np.bincount(x.argmax(1), minlength=6))
    assert stats.layer(0).n == int(keep.sum())


def test_tails_count_the_first_extreme_dimension_on_ties():
    """argmax/argmin counts follow numpy's convention: a tie goes to the first dimension."""
    h = np.array([[[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [-1.0, 0.0, -1.0, 5.0]]])
    stats = fold(EmbeddingStatistics([0], 4), h[None], np.array([[1, 2, 3]]), np.ones((1, 3), bool))
    m = stats.layer(0)
    np.testing.assert_array_equal(m.argmax_counts, np.bincount(h[0].argmax(1), minlength=4))
    np.testing.assert_array_equal(m.argmin_counts, np.bincount(h[0].argmin(1), minlength=4))
    assert m.argmax_counts.tolist() == [1, 1, 0, 1] and m.argmin_counts.tolist() == [2, 0, 0, 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_extreme_counts_equal_argmax_counts(dtype):
    """Tails from the column sums of x == rowmax(x) equal bincount(argmax) in every dtype, also
    beyond 256 rows (where a bf16 sum would round) and with ties (first dimension wins)."""
    from embgeom_ray.core.statistics import extreme_counts

    rng = np.random.default_rng(41)
    x = torch.as_tensor(rng.normal(size=(3000, 7)) * [1, 1, 1.5, 1, 1, 1, 0.5]).to(dtype)
    scratch = torch.empty(x.shape, dtype=torch.float32)
    for which, ref in (("max", x.argmax(dim=1)), ("min", x.argmin(dim=1))):
        want = torch.bincount(ref, minlength=7)
        assert torch.equal(extreme_counts(x, which, scratch), want)
    x[:5] = 0.0  # ties: argmax takes the first dimension
    want = torch.bincount(torch.as_tensor(x.double().numpy().argmax(1)), minlength=7)
    assert torch.equal(extreme_counts(x, "max", scratch), want)


@pytest.mark.parametrize("d", [1, 5, 96, 100, 385])
@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_gram_block_triangle_equals_the_full_product(d, precision):
    """The co-moment product multiplies only the upper block triangle and mirrors it."""
    from embgeom_ray.core.statistics import gram

    rng = np.random.default_rng(d)
    x = rng.normal(size=(257, d)) * rng.uniform(0.1, 10.0, size=d)
    g = gram(torch.as_tensor(x).to(getattr(torch, precision)), block=32).numpy()
    ref = x.T @ x
    assert g.dtype == np.float64
    np.testing.assert_array_equal(g, g.T)
    tol = 1e-13 if precision == "float64" else 1e-6
    np.testing.assert_allclose(g, ref, rtol=0, atol=tol * np.abs(ref).max())


def brute_cosines(x: np.ndarray, ids: np.ndarray):
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    c = u @ u.T
    n = len(x)
    off = ~np.eye(n, dtype=bool)
    same = ids[:, None] == ids[None, :]
    self_sim = {}
    for t in np.unique(ids):
        sel = ids == t
        k = int(sel.sum())
        if k >= 2:
            block = c[np.ix_(sel, sel)]
            self_sim[int(t)] = (block.sum() - np.trace(block)) / (k * (k - 1))
    return c[off].mean(), c[~same].mean(), self_sim


def test_cosine_metrics_equal_brute_force():
    rng = np.random.default_rng(9)
    h, ids, keep = make_batch(rng, n_layers=1, b=6, t=25, d=7, vocab=6, offset=0.7)
    stats = fold(EmbeddingStatistics([0], 7), h, ids, keep)
    m = stats.layer(0)
    x, tid = flat(h, ids, keep, 0)
    aniso, s_inter, self_sim = brute_cosines(x, tid)
    a, si, s_intra = cosine_metrics(m)
    np.testing.assert_allclose(a, aniso, rtol=1e-10)
    np.testing.assert_allclose(si, s_inter, rtol=1e-10)
    ss = self_similarity(m)
    for k, t in enumerate(m.type_ids):
        if int(t) in self_sim:
            np.testing.assert_allclose(ss[k], self_sim[int(t)], rtol=1e-10, atol=1e-13)
        else:
            assert np.isnan(ss[k])
    np.testing.assert_allclose(s_intra, np.mean(list(self_sim.values())), rtol=1e-10)


def test_isoscore_equals_the_isoscore_package():
    from IsoScore import IsoScore

    rng = np.random.default_rng(10)
    for scales in ([1.0] * 6, [5.0, 1.0, 1.0, 0.2, 0.1, 0.01], [1.0, 0, 0, 0, 0, 0]):
        x = rng.normal(size=(300, 6)) * np.array(scales) + 40.0
        stats = EmbeddingStatistics([0], 6)
        stats.update(torch.from_numpy(x)[None, None], torch.zeros(1, 300, dtype=torch.long))
        ours = isoscore_from_covariance(stats.layer(0).covariance)
        theirs = float(IsoScore.IsoScore(x))
        # the package takes sqrt(n) of an int64 tensor, which torch computes in float32
        # (2.4494898 vs 2.4494897428 for n = 6): agreement is to ~1e-6, not to float64.
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7)


def test_tables_have_contract_columns_and_values():
    rng = np.random.default_rng(11)
    h, ids, keep = make_batch(rng, n_layers=2, b=5, t=30, d=6, vocab=7, offset=3.0)
    stats = fold(EmbeddingStatistics([0, 5], 6), h, ids, keep)
    ts = type_stats_table(stats, lambda xs: [f"tok{i}" for i in xs])
    assert list(ts.columns)[:3] == ["layer", "token_id", "token"]
    x, tid = flat(h, ids, keep, 1)
    row = ts[(ts.layer == 5) & (ts.token_id == tid[0])].iloc[0]
    sel = x[tid == tid[0]]
    np.testing.assert_allclose(row.sq_norm_mean, (sel**2).sum(1).mean(), rtol=1e-12)
    np.testing.assert_allclose(row.mean_norm, np.linalg.norm(sel.mean(0)), rtol=1e-12)
    assert row.token == f"tok{tid[0]}"
    lt = layers_table(stats)
    assert lt.n_tokens.tolist() == [int(keep.sum())] * 2
    np.testing.assert_allclose(
        lt.total_variance, lt.within_variance + lt.between_variance, rtol=1e-12
    )
    dt = dims_table(stats)
    np.testing.assert_allclose(dt[dt.layer == 5]["std"], x.std(0), rtol=1e-12)
    np.testing.assert_allclose(dt[dt.layer == 5]["mean"], x.mean(0), rtol=1e-12)


def test_positions_and_tails_statistics():
    rng = np.random.default_rng(12)
    h, ids, keep = make_batch(rng, n_layers=1, b=8, t=6, d=5, vocab=4)
    h[0, ..., 3] += 10.0  # dim 3 is the argmax of nearly every vector
    pos = np.broadcast_to(np.arange(6), ids.shape)
    stats = fold(EmbeddingStatistics([0], 5, max_positions=6), h, ids, keep, pos)
    m = stats.layer(0)
    x = h[0][keep]
    p = pos[keep]
    np.testing.assert_array_equal(m.argmax_counts, np.bincount(x.argmax(1), minlength=5))
    np.testing.assert_array_equal(m.argmin_counts, np.bincount(x.argmin(1), minlength=5))
    for q in range(6):
        assert m.position_counts[q] == (p == q).sum()
        if (p == q).any():
            np.testing.assert_allclose(m.position_means[q], x[p == q].mean(0), rtol=1e-12)
    with pytest.raises(ValueError, match="max_positions"):
        fold(EmbeddingStatistics([0], 5, max_positions=3), h, ids, keep, pos)


def test_float32_comoment_is_centred_and_accurate_to_1e6():
    """--comoment-precision float32: the product runs on centred rows, so even with a shared
    offset of 3000 the covariance keeps ~1e-6 relative accuracy; other statistics are exact."""
    rng = np.random.default_rng(13)
    exact = EmbeddingStatistics([0], 24)
    fast = EmbeddingStatistics([0], 24, comoment_precision="float32")
    chunks = []
    for _ in range(6):
        h, ids, keep = make_batch(rng, n_layers=1, b=8, t=64, d=24, vocab=30)
        h[..., :3] += 3000.0
        fold(exact, h, ids, keep)
        fold(fast, h, ids, keep)
        chunks.append(h[0][keep])
    x = np.concatenate(chunks)
    ref = (x - x.mean(0)).T @ (x - x.mean(0))
    a, b = exact.layer(0), fast.layer(0)
    np.testing.assert_allclose(a.comoment, ref, rtol=1e-10, atol=1e-10 * np.abs(ref).max())
    np.testing.assert_allclose(b.comoment, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    np.testing.assert_allclose(
        isoscore_from_covariance(b.covariance), isoscore_from_covariance(ref), rtol=1e-5
    )
    np.testing.assert_array_equal(type_variances(a), type_variances(b))
    assert EmbeddingStatistics.from_bytes(fast.to_bytes()).comoment_precision == "float32"


def test_one_type_far_from_the_layer_mean_keeps_its_variance():
    """GPT-2's massive activations sit on one position/type: that type's mean is ~3000 from
    the layer mean while its spread is ~1e-2 (ratio ~1e11); identical vectors give exactly 0."""
    rng = np.random.default_rng(14)
    stats = EmbeddingStatistics([0], 16)
    chunks, id_chunks = [], []
    for _ in range(4):
        h, ids, keep = make_batch(rng, n_layers=1, b=4, t=40, d=16, vocab=6)
        keep[:] = True
        ids[:, 0] = 99  # the "first position" type
        h[0, :, 0, :] = 3000.0 + 1e-2 * rng.normal(size=(4, 16))
        ids[:, 1] = 77  # a type whose occurrences are identical
        h[0, :, 1, :] = 5.0
        fold(stats, h, ids, keep)
        chunks.append(h[0].reshape(-1, 16))
        id_chunks.append(ids.reshape(-1))
    x, tid = np.concatenate(chunks), np.concatenate(id_chunks)
    m = stats.layer(0)
    var = dict(zip(m.type_ids.tolist(), type_variances(m), strict=True))
    ref = x[tid == 99]
    np.testing.assert_allclose(var[99], ((ref - ref.mean(0)) ** 2).sum(1).mean(), rtol=1e-6)
    assert var[77] == 0.0
