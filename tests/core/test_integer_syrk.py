"""The bounded product's int8 products in one Triton kernel (core/integer_syrk.py), run on the
CPU by Triton's interpreter (``TRITON_INTERPRET=1``): its remainders against Python's exact
integers, and the whole product and fold against the ``torch._int_mm`` path bit for bit (integer
sums are exact in any order, so the card's tensor cores compute these same bytes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from embgeom_ray.core import integer_gram, integer_syrk
from embgeom_ray.core import statistics as statistics_module
from embgeom_ray.core.integer_gram import MODULI, IntegerGram, residues_eager
from embgeom_ray.core.statistics import EmbeddingStatistics
from tests.core.test_integer_gram import assert_within_bound, hard_rows

pytest.importorskip("triton", reason="Triton (make test installs it) runs the kernel's interpreter")


@pytest.fixture
def interpreter(monkeypatch):
    """Triton's interpreter on CPU tensors."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert integer_syrk.available(torch.device("cpu"))


def exact_remainders(r: torch.Tensor, m: int) -> torch.Tensor:
    """(RᵀR) mod m with Python's integers: r (D, K) int8."""
    z = r.to(torch.int64).numpy().astype(object)
    return torch.as_tensor((z.dot(z.T) % m).astype(np.int64)).to(torch.uint8)


@pytest.mark.parametrize(("d", "k"), [(32, 32), (64, 96), (96, 224)])
def test_remainders_are_the_exact_products_modulo_each_modulus(interpreter, d, k):
    """Every upper-triangle entry of (R_kᵀR_k) mod m_k, also for residues at the int8 extremes
    (the largest sums, n · 2^14), and zeros in the tiles below the diagonal."""
    rng = np.random.default_rng(d + k)
    r = torch.as_tensor(rng.integers(-128, 128, size=(len(MODULI), d, k)), dtype=torch.int8)
    r[0] = -128  # the largest sum of products: k · 2^14
    r[1, :, : k // 2] = 127
    out = integer_syrk.remainders(r, MODULI)
    assert out.shape == (len(MODULI), d, d) and out.dtype == torch.uint8
    tile = integer_syrk.INTERPRETER_CONFIG[0]
    below = torch.zeros(d, d, dtype=torch.bool)
    for i in range(d // tile):
        below[(i + 1) * tile :, i * tile : (i + 1) * tile] = True
    for j, m in enumerate(MODULI):
        want = exact_remainders(r[j], m)
        assert torch.equal(torch.triu(out[j]), torch.triu(want)), m
        assert not out[j][below].any()


def test_misaligned_residues_are_refused(interpreter):
    with pytest.raises(ValueError, match="multiple of 32"):
        integer_syrk.remainders(torch.zeros(2, 40, 32, dtype=torch.int8), MODULI[:2])


def gram_upper(x: torch.Tensor, triton: bool, monkeypatch) -> np.ndarray:
    """The upper triangle of IntegerGram's X'ᵀX' (x' = x − its mean), by the Triton kernel or
    by ``torch._int_mm`` blocks."""
    monkeypatch.setattr(integer_gram, "TRITON_SYRK", triton)
    shift = x.to(torch.float64).mean(0)
    gram = IntegerGram(x, shift)
    assert gram.triton == (triton and integer_syrk.available(x.device))
    for g, s, e in gram.pieces(0, x.shape[0]):
        res = residues_eager(
            x[s:e].to(torch.float64), gram.shift, g.scale, g.moduli, *gram.padding(g, s, e)
        )
        gram.put(g, s, e, res)
    upper = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64)
    gram.add_upper(upper)
    return np.triu(upper.numpy())


@settings(max_examples=25, deadline=None)
@given(hard_rows())
def test_the_kernels_product_is_int_mms_to_the_bit_and_within_the_bound(x):
    """On the rows that make fixed point hard (massive offsets, heavy tails, one row far out,
    constant columns, bf16), the Triton kernel's co-moment equals ``_int_mm``'s bit for bit,
    and so lies within the stated bound of the float64 product."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        fast = gram_upper(x, True, mp)
        slow = gram_upper(x, False, mp)
    np.testing.assert_array_equal(fast, slow)
    full = fast + np.triu(fast, 1).T
    assert_within_bound(x, x.to(torch.float64).mean(0), full)


def test_groups_of_rows_each_take_the_kernel(interpreter, monkeypatch):
    """Batches longer than MAX_ROWS: each group's residues through the kernel, the sum the same
    as ``_int_mm``'s."""
    monkeypatch.setattr(integer_gram, "MAX_ROWS", 64)
    rng = np.random.default_rng(9)
    x = torch.as_tensor(rng.normal(size=(150, 20)) * 10.0 ** rng.uniform(-2, 2, size=20))
    x[100:] *= 1e3
    np.testing.assert_array_equal(
        gram_upper(x, True, monkeypatch), gram_upper(x, False, monkeypatch)
    )


def test_the_fold_with_the_kernel_is_the_int_mm_fold_to_the_bit(interpreter, monkeypatch):
    """The GPU's way of folding (one block of rows, sparse sums, the bounded product on int8
    units), with the Triton kernel against ``_int_mm``: every array of the statistics equal."""
    monkeypatch.setattr(statistics_module, "GPU_FOLD", True)
    monkeypatch.setattr(statistics_module, "INTEGER_PRODUCT", True)
    states = []
    for triton in (True, False):
        monkeypatch.setattr(integer_gram, "TRITON_SYRK", triton)
        stats = EmbeddingStatistics([0, 1], 40, comoment_precision="bounded")
        batch_rng = np.random.default_rng(11)
        for _ in range(3):
            h = batch_rng.normal(size=(2, 3, 30, 40)) + np.array([1e4] + [0.0] * 39)
            ids = batch_rng.integers(0, 25, size=(3, 30))
            stats.update(torch.as_tensor(h).to(torch.bfloat16), torch.as_tensor(ids))
        states.append(stats.state_dict())
    assert states[0].keys() == states[1].keys()
    for name in states[0]:
        np.testing.assert_array_equal(states[0][name], states[1][name], err_msg=name)


def test_a_kernel_that_cannot_run_warns_once_and_int_mm_multiplies(interpreter, monkeypatch):
    """Where the Triton kernel fails (not built for this card, out of resources), one warning,
    the same numbers by ``torch._int_mm``, and ``_int_mm`` from then on."""

    def broken(*args):
        raise ValueError("no kernel for this card")

    rng = np.random.default_rng(12)
    x = torch.as_tensor(rng.normal(size=(70, 30)) + 50.0)
    want = gram_upper(x, False, monkeypatch)
    monkeypatch.setattr(integer_syrk, "remainders", broken)
    with pytest.warns(RuntimeWarning, match=r"Triton int8 kernel failed \(ValueError: no kernel"):
        got = gram_upper(x, True, monkeypatch)
    np.testing.assert_array_equal(got, want)
    assert integer_gram.TRITON_SYRK is False
