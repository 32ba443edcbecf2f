"""The statistics core against independent float64 two-pass computations."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import embgeom_ray.core.statistics as statistics_module
from embgeom_ray.core import fold_kernels
from embgeom_ray.core import gram as gram_module
from embgeom_ray.core.metrics import (
    cosine_metrics,
    dims_table,
    isoscore_from_covariance,
    layers_table,
    participation_ratio,
    self_similarity,
    type_stats_table,
    type_variances,
    variance_decomposition,
)
from embgeom_ray.core.samples import ActivationSample
from embgeom_ray.core.statistics import EmbeddingStatistics
from embgeom_ray.errors import StatisticsMismatchError
from tests import sketch_fixtures
from tests.reference import participation_ratio as two_pass_participation_ratio

#: the job's rows per block of the CPU's fold (the ``row_block`` fixture sets others)
JOB_ROW_BLOCK = statistics_module.CPU_ROW_BLOCK


@pytest.fixture(
    autouse=True, scope="module", params=["one block", "blocks of 5 rows", "the GPU's way"]
)
def row_block(request):
    """Every test three times: batches folded in one block of rows, in many blocks of 5 rows
    (the CPU fold walks blocks of ``CPU_ROW_BLOCK`` rows; its tests' batches are smaller), and
    the GPU's way (``GPU_FOLD``: one block, tails by argmax, the sums by type and position as
    sparse products, the squared deviations by the fused kernel's traced graph). The bounded
    co-moment product runs on int8 units in all three (``INTEGER_PRODUCT``), as on CUDA."""
    saved = (
        statistics_module.CPU_ROW_BLOCK,
        statistics_module.GPU_FOLD,
        statistics_module.INTEGER_PRODUCT,
        fold_kernels.FUSE,
        fold_kernels.BACKEND,
        gram_module.CPU_SYRK,
    )
    gpu = request.param == "the GPU's way"
    # the GPU's product, column blocks (dsyrk reads its operands into numpy: host reads)
    gram_module.CPU_SYRK = not gpu
    statistics_module.CPU_ROW_BLOCK = 5 if request.param == "blocks of 5 rows" else 1 << 30
    statistics_module.GPU_FOLD = gpu
    # the bounded product on int8 units, as on CUDA (here on the CPU's own int8 units)
    statistics_module.INTEGER_PRODUCT = True
    # the GPU's fused kernel too, traced (fullgraph) but run eagerly: building it is for GPUs
    fold_kernels.FUSE, fold_kernels.BACKEND = gpu, "eager"
    yield request.param
    (
        statistics_module.CPU_ROW_BLOCK,
        statistics_module.GPU_FOLD,
        statistics_module.INTEGER_PRODUCT,
        fold_kernels.FUSE,
        fold_kernels.BACKEND,
        gram_module.CPU_SYRK,
    ) = saved


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
    # nor the participation ratio, against the eigenvalues of the two-pass covariance
    pr = layers_table(stats)["participation_ratio"].item()
    np.testing.assert_allclose(pr, two_pass_participation_ratio(x), rtol=1e-6)


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


def test_finite_flags_from_the_caller_are_used_and_checked():
    """The extractor computes each layer's finite flag once for the statistics and the sample:
    given, they equal the fold's own check; a flag list of the wrong length is refused."""
    from embgeom_ray.core.sketch import finite_layers

    rng = np.random.default_rng(33)
    h, ids, keep = make_batch(rng, n_layers=3, b=3, t=6, d=4, vocab=5)
    keep[0, 1] = True
    h[1, 0, 1, 2] = np.inf
    hidden = list(torch.as_tensor(h))
    assert finite_layers(hidden) == [True, False, True]
    given = EmbeddingStatistics([0, 1, 2], 4)
    given.update(hidden, torch.as_tensor(ids), torch.as_tensor(keep), finite=finite_layers(hidden))
    own = fold(EmbeddingStatistics([0, 1, 2], 4), h, ids, keep)
    assert_same_state(given, own)
    assert given.layer(1).nonfinite == 1
    with pytest.raises(ValueError, match="2 finite flags for 3 hidden states"):
        given.update(hidden, torch.as_tensor(ids), torch.as_tensor(keep), finite=[True, True])


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
    from embgeom_ray.core.layer_state import extreme_counts

    rng = np.random.default_rng(41)
    x = torch.as_tensor(rng.normal(size=(3000, 7)) * [1, 1, 1.5, 1, 1, 1, 0.5]).to(dtype)
    scratch = torch.empty(x.shape, dtype=torch.float32)
    for which, ref in (("max", x.argmax(dim=1)), ("min", x.argmin(dim=1))):
        want = torch.bincount(ref, minlength=7)
        assert torch.equal(extreme_counts(x, which, scratch), want)
        assert torch.equal(extreme_counts(x, which), want)  # the GPU's way: argmax itself
    x[:5] = 0.0  # ties: argmax takes the first dimension
    x[5:9, 2:5] = 9.0  # a tie for the maximum that is not in the first dimension
    x[9:12, 4:] = -9.0
    for which in ("max", "min"):
        ref = getattr(x.double().numpy(), f"arg{which}")(1)
        want = torch.bincount(torch.as_tensor(ref), minlength=7)
        assert torch.equal(extreme_counts(x, which, scratch), want)
        assert torch.equal(extreme_counts(x, which), want)
        for sc in (scratch, None):  # counts added into a vector the caller holds
            into = torch.full((7,), 5, dtype=torch.int64)
            assert extreme_counts(x, which, sc, into=into) is into
            assert torch.equal(into, want + 5)


#: torch calls that make the host wait for a GPU (a value read back, an output whose size
#: depends on the data, a copy from host memory)
_HOST_SYNCS = frozenset(
    {"__bool__", "__int__", "__float__", "item", "tolist", "cpu", "numpy", "nonzero",
     "unique", "unique_consecutive", "bincount", "tensor", "masked_select", "repeat_interleave"}
)


class _SyncCounter(torch.overrides.TorchFunctionMode):
    """Counts the host-synchronising calls (:data:`_HOST_SYNCS`, and indexing by a bool mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        masked = name in ("__getitem__", "__setitem__") and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool
            for a in (args[1] if isinstance(args[1], tuple) else (args[1],))
        )
        if name in _HOST_SYNCS or masked:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def test_the_gpu_fold_waits_for_the_device_once_per_batch_not_per_layer(row_block):
    """Folding the GPU's way, the host synchronisations of a batch (grouping the token ids,
    checking every layer for NaN/inf at once) do not grow with the number of layers: a GPU's
    host queues every layer's kernels without waiting. The sample's update too."""
    if row_block != "the GPU's way":
        pytest.skip("the CPU's fold reads values back freely (its tie check, per layer)")
    rng = np.random.default_rng(43)
    counts = {}
    for n_layers in (2, 6):
        h, ids, keep = make_batch(rng, n_layers=n_layers, b=4, t=9, d=6, vocab=12)
        h[-1, 0, 0, 0] = 1e39  # finite, but its float32 sum is not: that layer's exact route
        layers = list(range(n_layers))
        stats = EmbeddingStatistics(layers, 6, max_positions=9)
        sample = ActivationSample(layers, 6, size=8)
        for _ in range(2):  # the second batch: every type already has a slot
            with _SyncCounter() as fold_calls:
                fold(stats, h, ids, keep)
            with _SyncCounter() as sample_calls:
                sample.update(
                    torch.as_tensor(h), torch.as_tensor(ids), torch.as_tensor(keep),
                    torch.arange(4), torch.zeros(4, dtype=torch.int64),
                )
        counts[n_layers] = (len(fold_calls.calls), len(sample_calls.calls))
        m = stats.layer(n_layers - 1)
        assert m.nonfinite == 0 and m.n == 2 * int(keep.sum())
    # the layer with the overflowing sum adds its exact route's reads once, in either run
    assert counts[2] == counts[6], counts
    assert counts[2][0] <= 12, counts


def test_the_integer_product_adds_no_host_synchronisation(row_block):
    """The bounded product on int8 units, folded the GPU's way: its scales, residues, products
    and reconstruction read nothing back, so the synchronisations of a batch do not grow with
    the layers and equal the float64 product's."""
    if row_block != "the GPU's way":
        pytest.skip("the CPU's fold reads values back freely")
    rng = np.random.default_rng(44)
    counts = {}
    for n_layers, precision in ((2, "bounded"), (6, "bounded"), (2, "float64")):
        h, ids, keep = make_batch(rng, n_layers=n_layers, b=4, t=9, d=24, vocab=12)
        stats = EmbeddingStatistics(list(range(n_layers)), 24, comoment_precision=precision)
        for _ in range(2):  # the second batch: every type already has a slot
            with _SyncCounter() as calls:
                fold(stats, h, ids, keep)
        counts[n_layers, precision] = len(calls.calls)
    assert counts[2, "bounded"] == counts[6, "bounded"] == counts[2, "float64"], counts


@pytest.mark.parametrize("d", [1, 5, 96, 100, 385])
@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_gram_block_triangle_equals_the_full_product(d, precision):
    """The co-moment product multiplies only the upper block triangle and mirrors it."""
    from embgeom_ray.core.gram import gram

    rng = np.random.default_rng(d)
    x = rng.normal(size=(257, d)) * rng.uniform(0.1, 10.0, size=d)
    g = gram(torch.as_tensor(x).to(getattr(torch, precision)), block=32).numpy()
    ref = x.T @ x
    assert g.dtype == np.float64
    np.testing.assert_array_equal(g, g.T)
    tol = 1e-13 if precision == "float64" else 1e-6
    np.testing.assert_allclose(g, ref, rtol=0, atol=tol * np.abs(ref).max())


@pytest.mark.parametrize("d", [1, 5, 100, 385, 2048])
@pytest.mark.parametrize("blocks", [4, 6, 8])
def test_gpu_gram_blocks_are_aligned_and_cover_the_columns(d, blocks):
    """The GPU's k column blocks (``add_gram``): edges at multiples of 64 columns (never
    empty blocks), the product still the full one."""
    from embgeom_ray.core.gram import _column_blocks, add_gram_upper, symmetric_from_upper

    edges = _column_blocks(d, -(-d // blocks), 64)
    assert edges[0] == 0 and edges[-1] == d and all(b > a for a, b in itertools.pairwise(edges))
    assert all(e % 64 == 0 for e in edges[1:-1]) and len(edges) - 1 <= blocks
    if d == 2048:
        assert len(edges) - 1 == blocks
    rng = np.random.default_rng(d)
    x = torch.as_tensor(rng.normal(size=(70, d)))
    upper = torch.zeros(d, d, dtype=torch.float64)
    add_gram_upper(upper, x, -(-d // blocks), 64)
    np.testing.assert_allclose(
        symmetric_from_upper(upper).numpy(), (x.T @ x).numpy(), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize(
    ("d", "edges"),
    [
        (128, [0, 128]),
        (384, [0, 192, 384]),
        (768, [0, 256, 512, 768]),
        (1024, [0, 256, 512, 768, 1024]),
        (2048, list(range(0, 2049, 256))),
        (4096, list(range(0, 4097, 512))),
    ],
)
def test_gpu_gram_blocks_are_never_skinny(d, edges):
    """The GPU's column blocks (``gram.gpu_block_width``): d / 8 columns, but none narrower
    than 256 (BERT-base's d = 768 in 3 blocks, not 8 of 96; below 384 one full product), and
    the block triangle still the full product."""
    from embgeom_ray.core import gram

    width = gram.gpu_block_width(d)
    assert gram._column_blocks(d, width, gram.GPU_GRAM_ALIGN) == edges
    assert gram.integer_blocks(d, gpu=True)["block"] == width
    x = torch.as_tensor(np.random.default_rng(d).normal(size=(40, d)))
    upper = torch.zeros(d, d, dtype=torch.float64)
    gram.add_gram_upper(upper, x, width, gram.GPU_GRAM_ALIGN)
    np.testing.assert_allclose(
        gram.symmetric_from_upper(upper).numpy(), (x.T @ x).numpy(), rtol=1e-12, atol=1e-12
    )


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


def comoment_errors(m, x: np.ndarray) -> np.ndarray:
    """|C_ab − C₆₄_ab| / √(C₆₄_aa C₆₄_bb) of a layer's co-moment against the float64 two-pass
    co-moment of its points ``x``."""
    xc = x - x.mean(0)
    ref = xc.T @ xc
    scale = np.sqrt(np.outer(np.diag(ref), np.diag(ref)))
    return np.abs(m.comoment - ref) / np.where(scale > 0, scale, 1.0)


@st.composite
def bounded_batches(draw):
    """Batches of d ≥ 17 (the int8 product's): massive offsets in a few dimensions
    (‖μ‖²/V ~ 1e8 and more), heavy-tailed dimensions, a type seen once, bf16 or float64."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    d = draw(st.sampled_from([17, 24, 40]))
    batches = []
    for _ in range(draw(st.integers(1, 4))):
        h, ids, keep = make_batch(
            rng, n_layers=2, b=draw(st.integers(1, 6)), t=draw(st.integers(2, 24)), d=d,
            vocab=draw(st.integers(2, 30)),
        )  # fmt: skip
        h[..., : draw(st.integers(0, 3))] += draw(st.sampled_from([1e3, 3e4, -1e5]))
        if draw(st.booleans()):
            h[..., 5] = rng.standard_t(1, size=h.shape[:-1])  # Cauchy-like
        ids[0, 0] = 10_000 + len(batches)  # a type seen once
        keep[0, 0] = True
        batches.append((h, ids, keep))
    return d, draw(st.sampled_from(["bfloat16", "float64"])), batches


@settings(max_examples=10, deadline=None)
@given(bounded_batches())
def test_bounded_product_is_within_its_bound_and_merges(params):
    """comoment_precision="bounded" on int8 units: the co-moment within ε √(C_aa C_bb) of the
    float64 two-pass one (ε = integer_gram.bound of the batch's rows), IsoScore and the
    per-dimension variances within 1e-9 relative; every other statistic as the float64 path's
    (per type to 1e-12); batches folded into shards and merged in any order the same."""
    from embgeom_ray.core.integer_gram import bound

    d, dtype, batches = params
    whole = EmbeddingStatistics([0, 1], d, max_positions=24, comoment_precision="bounded")
    exact = EmbeddingStatistics([0, 1], d, max_positions=24)
    shards = [EmbeddingStatistics([0, 1], d, max_positions=24, comoment_precision="bounded")
              for _ in batches]  # fmt: skip
    points = []
    for (h, ids, keep), shard in zip(batches, shards, strict=True):
        ht = torch.as_tensor(h).to(getattr(torch, dtype))
        for stats in (whole, exact, shard):
            stats.update(ht, torch.as_tensor(ids), torch.as_tensor(keep))
        points.append(ht.double().numpy()[:, keep])
    merged = EmbeddingStatistics([0, 1], d, max_positions=24, comoment_precision="bounded")
    for i in np.random.default_rng(len(batches)).permutation(len(shards)):
        merged.merge(shards[i])
    eps = bound(max(int(k.sum()) for _, _, k in batches))
    for li in range(2):
        x = np.concatenate([p[li] for p in points])
        for stats in (whole, merged):
            m = stats.layer(li)
            assert comoment_errors(m, x).max() <= eps + 1e-13
            xc = x - x.mean(0)
            np.testing.assert_allclose(
                isoscore_from_covariance(m.covariance),
                isoscore_from_covariance(xc.T @ xc / len(x)), rtol=1e-9, atol=1e-12,
            )  # fmt: skip
            np.testing.assert_allclose(np.diag(m.comoment), (xc**2).sum(0), rtol=1e-9)
        assert_same_state(whole, exact, rtol=1e-12, comoment_rtol=1e-8)
        assert_same_state(merged, exact, rtol=1e-10, comoment_rtol=1e-8)


class split_sums_forced:
    """``SPLIT_SUMS`` forced on inside a ``with`` block (hypothesis tests take no
    function-scoped fixtures, so no ``monkeypatch``)."""

    def __enter__(self) -> None:
        self.saved = statistics_module.SPLIT_SUMS
        statistics_module.SPLIT_SUMS = True

    def __exit__(self, *exc: object) -> None:
        statistics_module.SPLIT_SUMS = self.saved


def assert_split_bound(m, x: np.ndarray, ids: np.ndarray, batches: int) -> None:
    """The per-type statistics of a fold whose sums took the float32 split, against the float64
    two-pass values of its points ``x`` (ids ``ids``), within the split's bound
    (docs/precision.md): ‖Δμ_t‖ ≤ 2^-35 ‖M‖, |ΔV_t| ≤ 2^-33 ‖M‖ √V_t (Chan's cross terms between
    batches; within a batch second order), M the columns' largest |x|; and within 1e-6 for the
    types conditioned for it (‖μ_t‖ ≥ 1.5e-5 ‖M‖ and √V_t ≥ 6e-5 ‖M‖)."""
    big = float(np.linalg.norm(np.abs(x).max(axis=0)))
    ref = two_pass(x, ids)
    var = type_variances(m)
    for k, t in enumerate(m.type_ids):
        n, mu, v = ref[int(t)]
        assert m.counts[k] == n
        dmu = float(np.linalg.norm(m.means[k] - mu))
        assert dmu <= 2.0**-35 * big + 1e-12 * np.linalg.norm(mu)
        slack = 2.0**-70 * big**2 * batches + 1e-11 * v + 1e-300
        assert abs(var[k] - v) <= 2.0**-33 * big * np.sqrt(v) + slack
        norm, ref_norm = np.linalg.norm(m.means[k]), np.linalg.norm(mu)
        if ref_norm >= 1.5e-5 * big and np.sqrt(v) >= 6e-5 * big:
            np.testing.assert_allclose(norm, ref_norm, rtol=1e-6)
            np.testing.assert_allclose(var[k], v, rtol=1e-6)
            np.testing.assert_allclose(norm**2 + var[k], ref_norm**2 + v, rtol=1e-6)


@settings(max_examples=10, deadline=None)
@given(bounded_batches())
def test_split_sums_fold_within_their_bound(params):
    """``SPLIT_SUMS``: the per-type sums in float32 by the error-free split, on blocks of rows,
    one block and the GPU's way (the module's fixture), massive offsets, heavy-tailed
    dimensions, types seen once, into one accumulator and into shards merged in random order:
    every per-type statistic within the split's bound of the float64 two-pass values, the
    per-position means within 2^-35 of their columns' largest |x|; counts exact; the float64
    reference path takes no split (the same state as without it)."""
    d, dtype, batches = params
    make = lambda precision: EmbeddingStatistics(  # noqa: E731
        [0, 1], d, max_positions=24, comoment_precision=precision
    )
    with split_sums_forced():
        whole, reference = make("bounded"), make("float64")
        shards = [make("bounded") for _ in batches]
        for (h, ids, keep), shard in zip(batches, shards, strict=True):
            ht = torch.as_tensor(h).to(getattr(torch, dtype))
            for stats in (whole, reference, shard):
                stats.update(ht, torch.as_tensor(ids), torch.as_tensor(keep))
        merged = make("bounded")
        for i in np.random.default_rng(len(batches)).permutation(len(shards)):
            merged.merge(shards[i])
    plain = make("float64")
    for h, ids, keep in batches:
        plain.update(torch.as_tensor(h).to(getattr(torch, dtype)), torch.as_tensor(ids),
                     torch.as_tensor(keep))  # fmt: skip
    assert_same_state(reference, plain, rtol=0.0, comoment_rtol=0.0)
    for li in range(2):
        pts = [(torch.as_tensor(h).to(getattr(torch, dtype)).double().numpy()[li][k], i[k])
               for h, i, k in batches]  # fmt: skip
        x = np.concatenate([p for p, _ in pts])
        ids = np.concatenate([i for _, i in pts])
        pos = np.concatenate([np.nonzero(k)[1] for _, _, k in batches])
        for stats in (whole, merged):
            m = stats.layer(li)
            assert_split_bound(m, x, ids, len(batches))
            for p in np.unique(pos):
                want = x[pos == p].mean(axis=0)
                err = np.abs(m.position_means[p] - want)
                assert np.all(err <= 2.0**-35 * np.abs(x).max(axis=0) + 1e-12 * np.abs(want))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_split_sums_of_a_heavy_type_with_massive_activations(dtype, row_block, monkeypatch):
    """Batches of 8,192 rows, one type holding ~80% of them, types seen once, μ²/V ≈ 1e6-1e8 in
    three dimensions, rows in random order: with ``SPLIT_SUMS`` every type's ‖μ_t‖, V_t and Q_t
    within 1e-6 of the float64 two-pass values (and within the split's bound). The CPU's walk
    over blocks in the job's own blocks of rows (8 a batch; ~1,640 blocks of 5 rows took ~7 s)."""
    if row_block == "blocks of 5 rows":
        monkeypatch.setattr(statistics_module, "CPU_ROW_BLOCK", JOB_ROW_BLOCK)
    rng = np.random.default_rng(36)
    d, n = 24, 8192
    stats = EmbeddingStatistics([0], d, comoment_precision="bounded")
    chunks, all_ids = [], []
    for batch in range(2):
        ids = np.where(rng.uniform(size=n) < 0.8, 5, rng.integers(6, 400, size=n))
        ids[:50] = 1_000 + 50 * batch + np.arange(50)  # seen once
        ids = rng.permutation(ids)
        centres = rng.normal(size=(1_100 + 50 * batch, d)) * 3
        h = centres[ids] + rng.normal(size=(n, d))
        h[:, :3] += 3e3  # massive dimensions
        ht = torch.as_tensor(h).to(getattr(torch, dtype))
        with split_sums_forced():
            stats.update(ht.view(1, 1, n, d), torch.as_tensor(ids).view(1, n))
        chunks.append(ht.double().numpy())
        all_ids.append(ids)
    x, ids = np.concatenate(chunks), np.concatenate(all_ids)
    m = stats.layer(0)
    assert m.counts[m.type_ids.tolist().index(5)] > 0.75 * 2 * n
    assert_split_bound(m, x, ids, 2)
    ref = two_pass(x, ids)
    var = type_variances(m)
    for k, t in enumerate(m.type_ids):
        _, mu, v = ref[int(t)]
        norm = np.linalg.norm(m.means[k])
        np.testing.assert_allclose(norm, np.linalg.norm(mu), rtol=1e-6)
        np.testing.assert_allclose(var[k], v, rtol=1e-6, atol=0 if v else 0.0)
        np.testing.assert_allclose(norm**2 + var[k], np.linalg.norm(mu) ** 2 + v, rtol=1e-6)


def _rudman_isoscore(cov: np.ndarray) -> float:
    """IsoScore as Rudman et al. (2022) define it, from the covariance's eigenvalues."""
    n = cov.shape[0]
    lam = np.abs(np.linalg.eigvalsh((cov + cov.T) / 2))
    lam_hat = np.sqrt(n) * lam / np.linalg.norm(lam)
    delta = np.linalg.norm(lam_hat - 1) / np.sqrt(2 * (n - np.sqrt(n)))
    k = (n - delta**2 * (n - np.sqrt(n))) ** 2 / n
    return float((k - 1) / (n - 1))


def _rational_isoscore(cov: np.ndarray) -> float:
    """(tr(C)²/||C||_F² − 1)/(n − 1) of the float64 matrix's exact values, in rationals."""
    from fractions import Fraction

    c = [[Fraction(float(v)) for v in row] for row in (cov + cov.T) / 2]
    n = len(c)
    trace = sum(c[i][i] for i in range(n))
    frob = sum(v * v for row in c for v in row)
    return float((trace * trace / frob - 1) / (n - 1))


def test_isoscore_is_the_participation_ratio_rescaled():
    """Rudman et al.'s k equals the participation ratio, so IsoScore = (PR − 1)/(d − 1): equal
    to the eigenvalue definition on full-rank and rank-deficient covariances, and, where one
    direction's variance is ~1e9 times the others' (a massive activation), equal to the
    matrix's exact value in rational arithmetic, where the eigenvalues are off by > 1e-6."""
    rng = np.random.default_rng(3)
    for m, d in ((400, 12), (7, 30), (50, 50)):
        x = rng.normal(size=(m, d)) * np.exp(rng.normal(size=d)) + 50.0
        xc = x - x.mean(0)
        cov = xc.T @ xc / (m - 1)
        np.testing.assert_allclose(isoscore_from_covariance(cov), _rudman_isoscore(cov), rtol=1e-9)
        pr = participation_ratio(cov)  # the layers.parquet column
        np.testing.assert_allclose(isoscore_from_covariance(cov), (pr - 1) / (d - 1), rtol=1e-12)
    x = rng.normal(size=(256, 16))
    x[::32, 5] += 60 * 4e4  # every 32nd row, far out in one dimension
    xc = x - x.mean(0)
    cov = xc.T @ xc / len(x)
    exact = _rational_isoscore(cov)
    assert abs(_rudman_isoscore(cov) / exact - 1) > 1e-6  # the eigenvalues' rounding
    np.testing.assert_allclose(isoscore_from_covariance(cov), exact, rtol=1e-13)


@pytest.mark.parametrize(("scale", "dtype"), [(3e3, "bfloat16"), (4e4, "float32")])
def test_bounded_product_with_massive_activations(scale, dtype):
    """μ²/V ~ 1e7–1e9 in two dimensions and one row per window far out in a third (a first
    position's massive activation): the bounded product's co-moment within its bound, its IsoScore and
    per-dimension std within 1e-9. In bf16 (8 significant bits) μ²/V stays below ~1e6 unless
    a dimension is constant; float32 hidden states reach 1e9."""
    from embgeom_ray.core.integer_gram import bound

    rng = np.random.default_rng(15)
    stats = EmbeddingStatistics([0], 32, comoment_precision="bounded")
    chunks = []
    for _ in range(4):
        h, ids, keep = make_batch(rng, n_layers=1, b=8, t=32, d=32, vocab=50)
        h[..., :2] += scale
        h[0, :, 0, 7] += 60 * scale  # the first position of every window
        keep[:, 0] = True
        ht = torch.as_tensor(h).to(getattr(torch, dtype))
        stats.update(ht, torch.as_tensor(ids), torch.as_tensor(keep))
        chunks.append(ht.double().numpy()[0][keep])
    x = np.concatenate(chunks)
    m = stats.layer(0)
    variances = np.diag(m.comoment) / m.n
    ratio = 1e9 if dtype == "float32" else 1e5
    assert (m.mean[:2] ** 2 / variances[:2] > ratio).all()  # μ²/V per massive dimension
    assert comoment_errors(m, x).max() <= bound(8 * 32)
    xc = x - x.mean(0)
    np.testing.assert_allclose(
        isoscore_from_covariance(m.covariance), isoscore_from_covariance(xc.T @ xc / len(x)),
        rtol=1e-9,
    )  # fmt: skip
    np.testing.assert_allclose(np.sqrt(np.diag(m.covariance)), x.std(0), rtol=1e-9)


def test_bounded_is_the_float64_product_where_int8_is_not_used(monkeypatch):
    """On a CPU by default (and for d < 17 anywhere) the bounded product is the float64 one:
    the same statistics, bit for bit; "reference" is float64's other name."""
    monkeypatch.setattr(statistics_module, "INTEGER_PRODUCT", None)
    rng = np.random.default_rng(16)
    h, ids, keep = make_batch(rng, n_layers=2, b=5, t=20, d=24, vocab=9, offset=30.0)
    bounded = fold(EmbeddingStatistics([0, 1], 24, comoment_precision="bounded"), h, ids, keep)
    reference = fold(EmbeddingStatistics([0, 1], 24, comoment_precision="reference"), h, ids, keep)
    assert reference.comoment_precision == "float64"
    assert_same_state(bounded, reference)
    with pytest.raises(ValueError, match=r"bounded, float64, float32 \(or reference\)"):
        EmbeddingStatistics([0], 4, comoment_precision="bf16")


@pytest.mark.parametrize(
    ("device", "capability", "dim", "forced", "expected"),
    [
        ("cuda", (9, 0), 2048, None, False),  # Hopper: float64 tensor cores, measured faster
        ("cuda:1", (9, 0), 384, None, False),
        ("cuda", (8, 9), 2048, None, True),  # L4/L40S: no float64 matrix units
        ("cuda", (8, 0), 2048, None, True),  # A100: not measured; int8 by the peak rates
        ("cuda", (12, 0), 2048, None, True),
        ("cuda", (8, 9), 16, None, False),  # too narrow for int8 units anywhere
        ("cpu", None, 2048, None, False),
        ("cpu", None, 2048, True, True),  # forced (the tests' way of running it on a CPU)
        ("cuda", (8, 9), 2048, False, False),
    ],
)
def test_where_the_bounded_product_runs_on_int8_units(
    monkeypatch, device, capability, dim, forced, expected
):
    """The bounded product takes int8 units on CUDA cards without float64 matrix units only:
    on Hopper (compute capability 9.0) the float64 product measured 1.6–3× faster than the
    twelve int8 products (docs/precision.md). The capability is read once a device."""
    monkeypatch.setattr(statistics_module, "INTEGER_PRODUCT", forced)
    asked = []

    def capability_of(dev):
        asked.append(dev)
        return capability

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability_of)
    statistics_module._capability.cache_clear()
    try:
        dev = torch.device(device)
        assert statistics_module.integer_product(dev, dim) is expected
        assert statistics_module.integer_product(dev, dim) is expected
    finally:
        statistics_module._capability.cache_clear()
    assert asked == ([dev] if device.startswith("cuda") and forced is None and dim >= 17 else [])


def test_a_failing_int8_product_warns_once_and_computes_in_float64(monkeypatch):
    """Where the int8 product cannot run (a torch build or device without it), the fold warns
    once and computes the same product in float64 from then on."""
    from embgeom_ray.core import integer_gram

    def broken(a, b):
        raise RuntimeError("_int_mm_out_cuda not compiled for CUDA 11.6")

    monkeypatch.setattr(integer_gram, "int8_matmul", broken)
    monkeypatch.setattr(statistics_module, "_integer_unavailable", False)
    rng = np.random.default_rng(17)
    h, ids, keep = make_batch(rng, n_layers=1, b=4, t=16, d=20, vocab=9, offset=5.0)
    stats = EmbeddingStatistics([0], 20, comoment_precision="bounded")
    with pytest.warns(RuntimeWarning, match=r"int8 co-moment product failed \(RuntimeError: _int_mm"):
        fold(stats, h, ids, keep)
    assert statistics_module._integer_unavailable
    fold(stats, h, ids, keep)  # no second warning (the float64 product now)
    x = np.concatenate([h[0][keep]] * 2)
    assert comoment_errors(stats.layer(0), x).max() < 1e-12


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


# ------------------------------------------------------------------ the file format
FIXTURES = Path(__file__).parents[1] / "data" / "sketch_v1"


def assert_same_state(
    a: EmbeddingStatistics, b: EmbeddingStatistics, rtol: float = 0.0, comoment_rtol: float = 0.0
) -> None:
    """Same arrays: integers exactly, floats to ``rtol`` (the co-moment to ``comoment_rtol``),
    relative to each array's largest entry; exactly by default."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        tol = comoment_rtol if key == "comoment" else rtol
        if sa[key].dtype.kind in "iu" or tol == 0.0:
            np.testing.assert_array_equal(sa[key], sb[key], err_msg=key)
        else:
            scale = max(np.abs(sa[key]).max(), 1.0) if sa[key].size else 1.0
            np.testing.assert_allclose(sa[key], sb[key], rtol=tol, atol=tol * scale, err_msg=key)


@pytest.mark.parametrize("name", ["statistics.safetensors"])
def test_files_written_by_earlier_versions_load(name, tmp_path):
    """Version-1 files written by commit 82b3bd9 (format "embgeom_ray.statistics") load as wholes,
    hold what the same batches give today, merge with today's statistics and are written back in the current version."""
    old = EmbeddingStatistics.load(FIXTURES / name)
    now = sketch_fixtures.fold_statistics(EmbeddingStatistics)
    assert old.partition is None and old.layers == sketch_fixtures.LAYERS
    assert old.dim == sketch_fixtures.DIM and old.max_positions == sketch_fixtures.MAX_POSITIONS
    assert old.clip_dims == sketch_fixtures.CLIP_DIMS and old.comoment_precision == "float32"
    assert old.metadata == sketch_fixtures.METADATA
    assert old.layer(2).nonfinite == 1 and old.layer(0).nonfinite == 0
    # the float32 product's rounding depends on how the fold cuts the rows into blocks
    assert_same_state(old, now, rtol=1e-12, comoment_rtol=1e-6)
    path = tmp_path / "again.safetensors"
    old.save(path)
    again = EmbeddingStatistics.load(path)
    assert again.header() == now.header()
    assert again.header()["format"] == "embgeom_ray.statistics"
    assert again.header()["version"] == statistics_module.FORMAT_VERSION
    assert_same_state(again, old)
    doubled = old.merge(now)
    assert doubled.token_count() == 2 * now.token_count()


def test_reading_names_what_it_cannot_read():
    empty = EmbeddingStatistics([0], 3)
    data = empty.to_bytes()
    future = empty.header() | {"version": 9}
    with pytest.raises(StatisticsMismatchError, match=r"version 9 is not supported.*\[1, 2\]"):
        EmbeddingStatistics.from_state(future, empty.state_dict())
    with pytest.raises(StatisticsMismatchError, match="not an embgeom_ray statistics artefact"):
        EmbeddingStatistics.from_bytes(
            data.replace(b"embgeom_ray.statistics", b"embgeom_ray.statisticz")
        )
    with pytest.raises(StatisticsMismatchError, match="not an embgeom_ray statistics artefact"):
        EmbeddingStatistics.from_bytes(ActivationSample([0], 3).to_bytes())
    stats = fold(EmbeddingStatistics([0], 3), *make_batch(np.random.default_rng(0), 1, d=3))
    arrays = stats.state_dict()
    for key, bad in (("comoment", arrays["comoment"][:, :2]), ("counts", arrays["counts"] * 1.0)):
        with pytest.raises(StatisticsMismatchError, match=f"array '{key}' is"):
            EmbeddingStatistics.from_state(stats.header(), arrays | {key: bad})
    del arrays["m2"]
    with pytest.raises(StatisticsMismatchError, match="lacks array 'm2'"):
        EmbeddingStatistics.from_state(stats.header(), arrays)


def test_update_names_the_argument_of_the_wrong_shape():
    stats = EmbeddingStatistics([0, 1], 3, max_positions=4)
    h, ids = torch.zeros(2, 2, 4, 3), torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="expected 2 hidden-state tensors, got 1"):
        stats.update(h[:1], ids)
    with pytest.raises(ValueError, match=r"hidden state 1 has shape \(2, 4, 2\)"):
        stats.update([h[0], h[1, ..., :2]], ids)
    with pytest.raises(ValueError, match="token_ids must be"):
        stats.update(h, ids.flatten())
    with pytest.raises(ValueError, match="keep mask shape"):
        stats.update(h, ids, torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="positions shape"):
        stats.update(h, ids, None, torch.zeros(2, 3, dtype=torch.long))
    assert stats.num_types == 0 and stats.token_count() == 0


# --------------------------------------------------------------- comoment precision
def test_merge_keeps_the_comoment_precision():
    """An accumulator without co-moments takes the other's precision (the job's reduce starts
    from one); two that both hold co-moments must agree."""
    rng = np.random.default_rng(21)
    batch = make_batch(rng, n_layers=1, d=4)
    f32 = fold(EmbeddingStatistics([0], 4, comoment_precision="float32"), *batch)
    f64 = fold(EmbeddingStatistics([0], 4), *batch)
    empty = EmbeddingStatistics([0], 4)
    assert empty.merge(f32).comoment_precision == "float32"
    assert EmbeddingStatistics.from_bytes(empty.to_bytes()).comoment_precision == "float32"
    assert f32.merge(EmbeddingStatistics([0], 4)).comoment_precision == "float32"
    with pytest.raises(StatisticsMismatchError, match="comoment_precision 'float64' != 'float32'"):
        f32.merge(f64)
    # a part without co-moments (per-type rows only) merges with either
    rows = f64.select(token_range=(0, 3), layer_state=False)
    assert rows.select().merge(f32.select(token_range=(0, 3), layer_state=False)).num_types


# ------------------------------------------------------------------------ partitions
def random_statistics(seed: int, clip: bool, layers=(1, 4, 7)) -> EmbeddingStatistics:
    """Statistics of a few random batches over token ids 0..19, positions, a NaN token."""
    rng = np.random.default_rng(seed)
    stats = EmbeddingStatistics(
        list(layers), 5, max_positions=8, clip_dims=[0, 3] if clip else None,
        metadata={"model_fingerprint": "m"},
    )  # fmt: skip
    for _ in range(3):
        h, ids, keep = make_batch(rng, n_layers=len(layers), b=4, t=8, d=5, vocab=20)
        h[-1, 0, 0, 0] = np.nan  # a type may have a slot but no count in one layer
        fold(stats, h, ids, keep)
    return stats


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    clip=st.booleans(),
    cuts=st.lists(st.integers(0, 24), max_size=4),
    top=st.sampled_from([None, 25, 40]),
    groups=st.lists(st.integers(0, 2), min_size=3, max_size=3),
    separate_layer_state=st.booleans(),
    through_bytes=st.booleans(),
)
def test_selected_parts_combine_back_into_the_whole(
    seed, clip, cuts, top, groups, separate_layer_state, through_bytes
):
    """Any split of the layers into groups and of the token ids into ranges [lo, hi) (the
    per-layer moments with the first range, or in parts of their own), selected, written and
    read, and combined in any order, is the whole again: same header, same arrays, exactly."""
    whole = random_statistics(seed, clip)
    edges = sorted({0, *cuts})
    ranges = [(a, b) for a, b in itertools.pairwise([*edges, top])]
    if top is not None:
        ranges.append((top, None))
    layer_groups = [
        [x for x, g in zip(whole.layers, groups, strict=True) if g == k] for k in set(groups)
    ]
    parts = []
    for layers in layer_groups:
        for i, span in enumerate(ranges):
            parts.append(
                whole.select(layers, span, layer_state=i == 0 and not separate_layer_state)
            )
        if separate_layer_state:
            parts.append(whole.select(layers, (0, 0), layer_state=True))
    for part in parts:
        assert part.partition is not None or len(parts) == 1
        assert set(part.state_dict()["type_ids"]) <= set(whole.state_dict()["type_ids"])
    if through_bytes:
        parts = [EmbeddingStatistics.from_bytes(p.to_bytes()) for p in parts]
    order = np.random.default_rng(seed).permutation(len(parts))
    back = EmbeddingStatistics.combine([parts[i] for i in order])
    assert back.partition is None
    assert back.header() == whole.header()
    assert_same_state(back, whole)
    for layer in whole.layers:
        a, b = back.layer(layer), whole.layer(layer)
        for field in ("type_ids", "counts", "means", "m2", "comoment", "position_means"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    # the per-type sums of a range are the whole's rows of that range
    lo, hi = ranges[-1]
    part = whole.select(token_range=(lo, hi), layer_state=False)
    assert part.token_count() == sum(
        int(c) for t, c in zip(whole.layer(1).type_ids, whole.layer(1).counts, strict=True)
        if t >= lo and (hi is None or t < hi)
    )  # fmt: skip


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(0, 20), st.booleans())
def test_merging_parts_equals_the_part_of_the_merge(seed, cut, layer_state):
    """What reducers do: merging the same part of two statistics gives that part of their
    merge (Chan's update row by row), so parts can be merged where they live."""
    a, b = random_statistics(seed, True), random_statistics(seed + 1, True)
    span = (cut, None) if cut % 2 else (0, cut)
    layers = [1, 7]
    merged_parts = a.select(layers, span, layer_state=layer_state).merge(
        b.select(layers, span, layer_state=layer_state)
    )
    part_of_merged = a.merge(b).select(layers, span, layer_state=layer_state)
    assert merged_parts.header() == part_of_merged.header()
    assert_same_state(merged_parts, part_of_merged)


def test_partitions_are_described_in_the_header_and_checked():
    whole = random_statistics(3, False)
    part = whole.select([4, 7], (5, 12), layer_state=False)
    record = EmbeddingStatistics.from_bytes(part.to_bytes()).header()["partition"]
    assert record == {"of_layers": [1, 4, 7], "token_range": [5, 12], "layer_state": False}
    ids = part.state_dict()["type_ids"]
    assert ids.min() >= 5 and ids.max() < 12 and "comoment" not in part.state_dict()
    assert part.layer(4).n == 0 and part.layer(4).comoment.shape == (5, 5)
    np.testing.assert_array_equal(part.layer(4).counts, whole.layer(4).counts[
        (whole.layer(4).type_ids >= 5) & (whole.layer(4).type_ids < 12)
    ])  # fmt: skip
    with pytest.raises(StatisticsMismatchError, match="partition"):
        whole.merge(part)
    with pytest.raises(ValueError, match="built by select"):
        part.update(torch.zeros(2, 1, 3, 5), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="not within"):
        part.select(token_range=(0, 12))
    with pytest.raises(ValueError, match="no per-layer moments"):
        part.select(layer_state=True)
    with pytest.raises(ValueError, match="not held"):
        part.select([1])
    lower = whole.select(token_range=(0, 6))
    upper = whole.select(token_range=(5, None), layer_state=False)
    with pytest.raises(StatisticsMismatchError, match="overlap"):
        EmbeddingStatistics.combine([lower, upper])
    with pytest.raises(StatisticsMismatchError, match=r"leave token ids \[6, 7\) out"):
        EmbeddingStatistics.combine([lower, whole.select(token_range=(7, None), layer_state=False)])
    with pytest.raises(StatisticsMismatchError, match="per-layer moments must come from one part"):
        EmbeddingStatistics.combine([lower, whole.select(token_range=(6, None))])
    other = random_statistics(3, False, layers=(1, 4))
    with pytest.raises(StatisticsMismatchError, match="of_layers"):
        EmbeddingStatistics.combine([lower, other.select(token_range=(6, None), layer_state=False)])
    arrays = part.state_dict()
    arrays["type_ids"] = arrays["type_ids"] + 10
    with pytest.raises(StatisticsMismatchError, match=r"not increasing ids in \[5, 12\)"):
        EmbeddingStatistics.from_state(part.header(), arrays)
    # a layer subset with everything else is a part that still folds
    layer_part = whole.select([4])
    assert layer_part.partition.of_layers == (1, 4, 7) and layer_part.holds_layer_state
    h, ids, keep = make_batch(np.random.default_rng(9), n_layers=1, b=2, t=8, d=5, vocab=20)
    fold(layer_part, h, ids, keep)
    assert layer_part.token_count() == whole.token_count() + int(keep.sum())


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    clip=st.booleans(),
    layers=st.lists(st.sampled_from([1, 4, 7]), unique=True, max_size=3),
    lo=st.integers(0, 22),
    width=st.one_of(st.none(), st.integers(0, 12)),
    layer_state=st.booleans(),
)
def test_load_part_reads_exactly_the_selected_part(seed, clip, layers, lo, width, layer_state):
    """What a reducer reads of a checkpoint group: the lazily sliced part of a file equals
    the selected part of the loaded whole (same header, same arrays, exactly)."""
    import tempfile

    whole = random_statistics(seed, clip)
    span = (lo, None if width is None else lo + width)
    chosen = layers or None
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "group.safetensors")
        whole.save(path)
        part = EmbeddingStatistics.load_part(path, chosen, span, layer_state=layer_state)
        want = whole.select(chosen, span, layer_state=layer_state)
        assert part.header() == want.header()
        assert_same_state(part, want)
        # a file that is itself a part is read whole and selected
        want.save(path)
        again = EmbeddingStatistics.load_part(path, chosen, span, layer_state=layer_state)
        assert_same_state(again, want)
    with pytest.raises(ValueError, match="not held"):
        with tempfile.TemporaryDirectory() as tmp:
            whole.save(str(Path(tmp) / "g.safetensors"))
            EmbeddingStatistics.load_part(str(Path(tmp) / "g.safetensors"), [2])


@pytest.mark.parametrize("clip", [False, True])
def test_to_bytes_is_the_safetensors_file_of_the_state(clip):
    """Serialising into one buffer (``safetensors_into``) writes the file safetensors' own
    writer makes of ``state_dict``: same arrays, dtypes and header, for a whole, an empty
    one and a part without per-layer state; the file loads back, lazily too."""
    import json

    from safetensors.numpy import load, save

    from embgeom_ray.core.sketch import HEADER_KEY

    rng = np.random.default_rng(3)
    stats = EmbeddingStatistics([0, 1], 5, max_positions=8, clip_dims=[2] if clip else None)
    for _ in range(3):
        h, ids, keep = make_batch(rng, vocab=40, offset=1e4)
        fold(stats, h, ids[:, ::-1].copy(), keep)  # ids first seen out of order
    empty = EmbeddingStatistics([0, 1], 5, max_positions=8)
    for s in (stats, stats.select([1], (7, 30), layer_state=False), empty):
        data = s.to_bytes()
        want = save(s.state_dict(), metadata={HEADER_KEY: json.dumps(s.header())})
        got, ref = load(bytes(data)), load(want)
        assert got.keys() == ref.keys()
        for key in ref:
            assert got[key].dtype == ref[key].dtype, key
            np.testing.assert_array_equal(got[key], ref[key], err_msg=key)
        assert_same_state(EmbeddingStatistics.from_bytes(data), s)
        assert_same_state(EmbeddingStatistics.from_bytes(np.frombuffer(data, np.uint8)), s)


def test_an_empty_token_range_selects_from_any_part():
    """An empty range [lo, lo) holds no rows, so any part holds it (reducers ask a part with
    only per-layer state for its layers' state with such a range)."""
    rng = np.random.default_rng(1)
    stats = EmbeddingStatistics([0, 1], 5, max_positions=8)
    h, ids, keep = make_batch(rng, vocab=40)
    fold(stats, h, ids, keep)
    part = stats.select([1], (10, 20), layer_state=False)
    empty = part.select([1], (50, 50), layer_state=False)
    assert empty.num_types == 0 and empty.token_range == (50, 50)
    with pytest.raises(ValueError, match="not within"):
        part.select([1], (5, 15), layer_state=False)
