"""The GPU fold's pass 1 and per-type merge in Triton (``core/segment_sums.py``), run on the
CPU in Triton's interpreter: its per-group sums, unit-vector sums and tails against the sparse
products of the rows' float64 copy and the eager argmax (groups across chunks, single rows, a
zero row, massive offsets, bf16 ties, rows taken through a permutation with empty groups); the
merge against the two-pass moments of the rows merged and the eager merge; and the fold with
them against the fold without, the same statistics in every precision, with positions and a
layer holding a NaN, and against the float64 two-pass reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import embgeom_ray.core.statistics as statistics_module
from embgeom_ray.core import fold_kernels, segment_sums
from embgeom_ray.core import gram as gram_module
from embgeom_ray.core.group_sums import GroupMatrix
from embgeom_ray.core.statistics import EmbeddingStatistics
from tests.core.test_stacked_fold import assert_same_statistics, massive_batches

pytest.importorskip("triton", reason="Triton (make test installs it) runs the kernels' interpreter")


@pytest.fixture(autouse=True)
def interpreter():
    """Triton's interpreter on CPU tensors: tests/conftest.py sets ``TRITON_INTERPRET=1`` for
    the whole run (the kernels are wrapped once, when first imported), so with Triton
    installed these tests run, never skip."""
    assert segment_sums.available(torch.device("cpu")), "TRITON_INTERPRET=1 is not set"


_F64 = torch.float64
R = segment_sums.INTERPRETER_CONFIG[0]  # rows a chunk in the interpreter


def reference(x: torch.Tensor, gm: GroupMatrix) -> tuple[torch.Tensor, ...]:
    """The float64 sums and unit-vector sums as the GPU fold takes them: sparse products of
    the rows' float64 copy, weighted by 1/max(‖x‖, tiny) (``fold_kernels.float64_rows``); and
    the sums of their absolute values (the sums' condition)."""
    xf, inv_norms = fold_kernels.float64_rows_eager(x)
    return gm.sums(xf), gm.sums(xf, inv_norms), gm.sums(xf.abs()), gm.sums(xf.abs(), inv_norms)


def assert_close(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, n: int) -> None:
    """|got − want| within two float64 sums' rounding in any order, of at most ``n`` terms
    whose absolute values sum to ``scale``: 2 (n − 1) 2^-53 Σ|x| each way."""
    assert bool(((got - want).abs() <= 4 * n * 2.0**-53 * scale).all())


@st.composite
def batches(draw):
    """(rows, counts): a batch's rows in group order and each group's rows; groups from one
    row to several chunks, a zero row, an offset column, one of three dtypes."""
    counts = draw(st.lists(st.integers(1, 3 * R + 2), min_size=1, max_size=6))
    n, d = sum(counts), draw(st.integers(1, 40))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float32, torch.float64]))
    offset = draw(st.sampled_from([0.0, 1e4, -3e6]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(n, d, generator=gen, dtype=_F64) * 3
    x[:, draw(st.integers(0, d - 1))] += offset
    x[draw(st.integers(0, n - 1))] = 0.0  # a zero row: its unit vector is 0
    return x.to(dtype), torch.tensor(counts)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],  # no shrinking: the interpreter is slow
)  # fmt: skip
@given(batches())
def test_sums_units_and_tails_equal_the_sparse_products_and_argmax(batch):
    x, counts = batch
    gm = GroupMatrix.of_sorted(counts, x.shape[0])
    # the unit-vector sums added to rows of a target holding values already, in another order
    target = torch.randn(gm.groups + 3, x.shape[1], dtype=_F64)
    at = torch.randperm(gm.groups + 3)[: gm.groups]
    want = target.clone()
    got = segment_sums.group_sums(
        x, gm.keys(), gm.crow, gm.groups, add_units_to=(target, at), tails=True
    )
    sums, units, abs_sums, abs_units = reference(x, gm)
    n = int(counts.max()) + 1  # the target's value is one term more
    assert_close(got.sums, sums, abs_sums, n)
    scale = want.abs().index_add_(0, at, abs_units)
    assert_close(target, want.index_add_(0, at, units), scale, n)
    assert torch.equal(got.argmax, x.argmax(dim=1))
    assert torch.equal(got.argmin, x.argmin(dim=1))


def test_tails_take_the_first_of_tied_dimensions_across_column_blocks():
    """bf16 ties (8 significant bits) within a column block and across blocks: the first
    dimension, as ``argmax`` on a GPU."""
    x = torch.zeros(3, 40, dtype=torch.bfloat16)
    x[0, [5, 7, 30]] = 2.0  # in the first block and the second
    x[1, [20, 21]] = -1.0  # the minimum tied in the second block
    x[2] = 1.0  # every dimension tied
    gm = GroupMatrix.of_sorted(torch.tensor([3]), 3)
    got = segment_sums.group_sums(x, gm.keys(), gm.crow, 1, tails=True)
    assert got.argmax.tolist() == x.float().argmax(dim=1).tolist() == [5, 0, 0]
    assert got.argmin.tolist() == x.float().argmin(dim=1).tolist() == [0, 20, 0]


def test_rows_through_a_permutation_with_empty_groups_sum_as_the_sparse_product():
    """The per-position sums: rows in window order, grouped by position through the
    grouping's permutation; positions without rows stay 0."""
    rng = np.random.default_rng(3)
    pos = torch.as_tensor(rng.integers(0, 9, size=5 * R + 3))
    pos[pos == 4] = 5  # position 4 empty, as are 9..11
    counts = torch.bincount(pos, minlength=12)
    x = (torch.randn(pos.numel(), 24, dtype=_F64) + 50.0).to(torch.bfloat16)
    gm = GroupMatrix.of_labels(pos, counts)
    got = segment_sums.group_sums(x, gm.keys(), gm.crow, 12, order=gm.col, every_group=False)
    sums, _, abs_sums, _ = reference(x, gm)
    assert_close(got.sums, sums, abs_sums, int(counts.max()))
    assert not got.sums[[4, 9, 10, 11]].any()


def test_the_sums_do_not_depend_on_the_chunk(monkeypatch):
    """Chunks of 16 or 4 rows (the pieces joined across more chunk edges): the same sums to
    float64 rounding; and the same bits when run twice."""
    x = (torch.randn(100, 20, dtype=_F64) * 5 + 1e3).to(torch.bfloat16)
    gm = GroupMatrix.of_sorted(torch.tensor([1, 40, 3, 50, 6]), 100)

    def sums() -> tuple[torch.Tensor, torch.Tensor]:
        units = torch.zeros(5, 20, dtype=_F64)
        at = torch.arange(5)  # each group's own row
        got = segment_sums.group_sums(x, gm.keys(), gm.crow, 5, add_units_to=(units, at))
        return got.sums, units

    a, again = sums(), sums()
    assert torch.equal(a[0], again[0]) and torch.equal(a[1], again[1])
    monkeypatch.setattr(segment_sums, "INTERPRETER_CONFIG", (4, 8, 1))
    b = sums()
    _, _, abs_sums, abs_units = reference(x, gm)
    assert_close(b[0], a[0], abs_sums, 50)
    assert_close(b[1], a[1], abs_units, 50)


@st.composite
def merges(draw):
    """(running rows, batch rows) of each of a few types: a type new to the statistics (no
    running rows), or seen; one to a few rows a side; an offset column of up to 3·10⁶ whose
    spread within a type is ~1 (the massive activations' case of cancelling means)."""
    u, d = draw(st.integers(1, 9)), draw(st.integers(1, 40))
    offset = draw(st.sampled_from([0.0, 1e4, -3e6]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    sides = []
    for _ in range(u):
        n_a, n_b = draw(st.integers(0, 5)), draw(st.integers(1, 5))
        centre = torch.randn(d, generator=gen, dtype=_F64) * 4
        centre[0] += offset
        rows = (centre + torch.randn(k, d, generator=gen, dtype=_F64) for k in (n_a, n_b))
        sides.append(tuple(rows))
    return sides


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)  # fmt: skip
@given(merges())
def test_the_merge_of_a_batch_into_the_types_equals_the_two_pass_moments_of_both(sides):
    """:func:`segment_sums.merge_types`: the running (count, mean, M2) of each type at its
    slot, updated by the batch's, equal the two-pass moments of both sides' rows together;
    the other slots untouched; and the eager merge's (``TypeMoments.merge_rows`` without it)
    to float64 rounding."""
    u, d = len(sides), sides[0][1].shape[1]
    capacity = u + 3
    slots = torch.randperm(capacity)[:u]
    means = torch.randn(capacity, d, dtype=_F64)  # the slots not merged hold values too
    counts = torch.randint(0, 4, (capacity,))
    m2 = torch.rand(capacity, dtype=_F64)
    mean_b, m2_b = torch.empty(u, d, dtype=_F64), torch.empty(u, dtype=_F64)
    n_b = torch.tensor([len(b) for _, b in sides])
    for j, (a, b) in enumerate(sides):
        s = int(slots[j])
        counts[s] = len(a)
        means[s] = a.mean(0) if len(a) else 0.0
        m2[s] = ((a - a.mean(0)) ** 2).sum() if len(a) else 0.0
        mean_b[j], m2_b[j] = b.mean(0), ((b - b.mean(0)) ** 2).sum()
    state = (means.clone(), counts.clone(), m2.clone())
    segment_sums.merge_types(*state, slots, n_b, mean_b, m2_b)
    others = torch.ones(capacity, dtype=torch.bool)
    others[slots] = False
    for got, before in zip(state, (means, counts, m2), strict=True):
        assert torch.equal(got[others], before[others])
    for j, (a, b) in enumerate(sides):
        s, rows = int(slots[j]), torch.cat([a, b])
        assert int(state[1][s]) == len(rows)
        mu = rows.mean(0)
        torch.testing.assert_close(state[0][s], mu, rtol=1e-13, atol=1e-13 * float(mu.abs().max()))
        want = float(((rows - mu) ** 2).sum())
        assert abs(float(state[2][s]) - want) <= 1e-9 * want + 1e-9, (float(state[2][s]), want)
    # the eager merge of the same rows: the same to float64 rounding
    from embgeom_ray.core.type_moments import TypeMoments

    types = TypeMoments(1, d, torch.device("cpu"), clip=False, capacity=capacity)
    for name, x in (("means", means), ("counts", counts), ("m2", m2)):
        types.arrays[name][0, :capacity] = x
    scratch = lambda name, n: torch.empty(n, d, dtype=_F64)  # noqa: E731
    types.merge_rows(0, slots, n_b, mean_b, m2_b, [(0, u)], scratch)
    for i, name in enumerate(("means", "counts", "m2")):
        want = types.arrays[name][0, :capacity]
        scale = float(want.abs().max()) or 1.0
        assert float((state[i] - want).abs().max()) <= 1e-15 * scale * 4, name


# ------------------------------------------------------------------------------- the fold
LAYERS, D, BATCHES = 2, 24, 3


@pytest.fixture
def gpu_way(monkeypatch):
    """The GPU's fold on the CPU, one layer at a time (``_fold_layer``, where pass 1 may run
    in Triton), fused kernels traced."""
    monkeypatch.setattr(statistics_module, "GPU_FOLD", True)
    monkeypatch.setattr(statistics_module, "STACK_LAYERS", False)
    monkeypatch.setattr(gram_module, "CPU_SYRK", False)
    monkeypatch.setattr(fold_kernels, "BACKEND", "eager")


def folded(precision: str, nan_at: int | None, *, triton: bool, monkeypatch) -> EmbeddingStatistics:
    """Three :func:`massive_batches` (bf16; float64 for the reference precision) with
    positions, folded with pass 1 in Triton or as sparse products."""
    monkeypatch.setattr(segment_sums, "TRITON_SUMS", triton)
    stats = EmbeddingStatistics(
        list(range(LAYERS)), D, max_positions=16, comoment_precision=precision
    )
    dtype = torch.float64 if precision == "float64" else torch.bfloat16
    for h, ids, keep in massive_batches(LAYERS, D, BATCHES, nan_at):
        stats.update(torch.as_tensor(h).to(dtype), torch.as_tensor(ids), torch.as_tensor(keep))
    return stats


@pytest.mark.parametrize(
    "precision, fuse, integer, nan_at",
    [
        ("bounded", True, False, None),
        ("bounded", False, False, 1),
        ("bounded", True, True, None),
        ("float64", True, False, 1),
        ("float32", True, False, None),
        ("float32", False, False, 0),
    ],
)
def test_the_fold_with_pass_1_in_triton_equals_the_fold_without(
    gpu_way, precision, fuse, integer, nan_at, monkeypatch
):
    """Pass 2 then reads the model's rows (no float64 copy from pass 1): compiled where
    fused, else converted first; the int8 product's residues from a float64 copy. The fold of
    the default precision also against the float64 two-pass reference."""
    monkeypatch.setattr(fold_kernels, "FUSE", fuse)
    monkeypatch.setattr(statistics_module, "INTEGER_PRODUCT", integer)
    calls = []
    for name in ("group_sums", "merge_types"):
        real = getattr(segment_sums, name)

        def counted(*a, name=name, real=real, **k):
            calls.append(name)
            return real(*a, **k)

        monkeypatch.setattr(segment_sums, name, counted)
    with_triton = folded(precision, nan_at, triton=True, monkeypatch=monkeypatch)
    # the types' and the positions' sums of every layer, then the types' merge
    assert calls == ["group_sums", "group_sums", "merge_types"] * LAYERS * BATCHES
    without = folded(precision, nan_at, triton=False, monkeypatch=monkeypatch)
    assert len(calls) == 3 * LAYERS * BATCHES
    assert_same_statistics(with_triton, without)
    if (precision, fuse, integer) == ("bounded", True, False):
        assert_meets_the_reference(with_triton)


def assert_meets_the_reference(stats: EmbeddingStatistics) -> None:
    """Per-type means, M2 and unit sums, the layer's covariance and tails of :func:`folded`'s
    bf16 rows with a massive dimension, against numpy's float64 two-pass moments of the same
    values."""
    rows, ids = [], []
    for h, i, keep in massive_batches(LAYERS, D, BATCHES):  # folded()'s, in bf16
        h = torch.as_tensor(h).to(torch.bfloat16).to(_F64).numpy()
        rows.append(h[:, keep])
        ids.append(i[keep])
    x, t = np.concatenate(rows, axis=1), np.concatenate(ids)
    for li in range(LAYERS):
        m = stats.layer(li)
        xl = x[li]
        mu = xl.mean(axis=0)
        cov = (xl - mu).T @ (xl - mu) / len(xl)
        np.testing.assert_allclose(m.covariance, cov, rtol=1e-9, atol=1e-9 * np.abs(cov).max())
        np.testing.assert_array_equal(m.argmax_counts, np.bincount(xl.argmax(1), minlength=D))
        np.testing.assert_array_equal(m.argmin_counts, np.bincount(xl.argmin(1), minlength=D))
        for j, tid in enumerate(m.type_ids):
            r = xl[t == tid]
            np.testing.assert_allclose(m.means[j], r.mean(axis=0), rtol=1e-12, atol=1e-12)
            m2 = ((r - r.mean(axis=0)) ** 2).sum()
            np.testing.assert_allclose(m.m2[j], m2, rtol=1e-9, atol=1e-9)
            units = (r / np.linalg.norm(r, axis=1, keepdims=True)).sum(axis=0)
            np.testing.assert_allclose(m.unit_sums[j], units, rtol=1e-12, atol=1e-12)


def test_a_kernel_triton_cannot_build_leaves_the_sparse_sums_with_one_warning(gpu_way, monkeypatch):
    """A kernel failing (either grouping's sums: the positions' first, then the types'; or the
    types' merge, after pass 1 ran in Triton): one warning, the batch folded the sparse way
    or merged eagerly, and no Triton from then on: the same statistics."""
    monkeypatch.setattr(fold_kernels, "FUSE", True)
    without = folded("bounded", None, triton=False, monkeypatch=monkeypatch)
    real_sums, real_merge = segment_sums.group_sums, segment_sums.merge_types
    for failing in ("positions", "types", "merge"):
        monkeypatch.setattr(segment_sums, "_unavailable", False)

        def broken(*args, failing=failing, **kwargs):
            if failing != "merge" and (kwargs.get("order") is None) == (failing == "types"):
                raise RuntimeError("PassManager::run failed")
            return real_sums(*args, **kwargs)

        def broken_merge(*args):
            raise RuntimeError("PassManager::run failed")

        monkeypatch.setattr(segment_sums, "group_sums", broken)
        monkeypatch.setattr(
            segment_sums, "merge_types", broken_merge if failing == "merge" else real_merge
        )
        with pytest.warns(RuntimeWarning, match="Triton kernels failed") as caught:
            stats = folded("bounded", None, triton=True, monkeypatch=monkeypatch)
        assert len(caught) == 1 and not segment_sums.on(torch.device("cpu"))
        assert_same_statistics(stats, without)
