"""The GPU fold's fused kernels (``core/fold_kernels.py``) against float64 references, on CPUs."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from embgeom_ray.core import fold_kernels


def _case(rng: np.random.Generator, n: int, u: int, d: int, offset: float):
    inv = np.sort(rng.integers(0, u, size=n))
    x = rng.normal(size=(n, d)) + offset
    means = rng.normal(size=(u, d)) * 0.1 + offset
    return torch.as_tensor(means), torch.as_tensor(inv), torch.as_tensor(x)


def _reference(means, inv, x) -> np.ndarray:
    m, i, x = means.numpy(), inv.numpy(), x.numpy()
    return np.array([float(np.sum((m[i[r]] - x[r]) ** 2)) for r in range(len(i))])


def _check_all(rng: np.random.Generator, n: int, u: int, d: int, offset: float) -> None:
    """Each function's values against numpy's float64 loops, one row at a time."""
    means, inv, x = _case(rng, n, u, d, offset)
    want = _reference(means, inv, x)
    np.testing.assert_allclose(
        fold_kernels.squared_deviations_eager(means, inv, x).numpy(), want, rtol=1e-12, atol=0
    )
    rows = x.to(torch.bfloat16)
    x64, w = fold_kernels.float64_rows(rows)
    exact = rows.float().double().numpy()  # bf16 -> float64 is exact
    assert x64.dtype == torch.float64 and np.array_equal(x64.numpy(), exact)
    np.testing.assert_allclose(w.numpy(), 1 / np.linalg.norm(exact, axis=1), rtol=1e-14)
    c = torch.as_tensor(rng.normal(size=d) + offset)
    sq, xs = fold_kernels.deviations_and_centred(means, inv, x, c)
    np.testing.assert_allclose(sq.numpy(), want, rtol=1e-12, atol=0)
    assert np.array_equal(xs.numpy(), x.numpy() - c.numpy())  # one rounding each
    c32 = c.to(torch.float32)
    sq, xs32 = fold_kernels.deviations_and_centred32(means, inv, x, rows, c32)
    np.testing.assert_allclose(sq.numpy(), want, rtol=1e-12, atol=0)
    assert xs32.dtype == torch.float32
    assert np.array_equal(xs32.numpy(), rows.float().numpy() - c32.numpy())
    _, xs32 = fold_kernels.deviations_and_centred32(means, inv, x, x, c32)  # float64 rows
    assert np.array_equal(xs32.numpy(), (x.numpy() - c32.numpy()).astype(np.float32))


@pytest.mark.parametrize("offset", [0.0, 1e6])
def test_every_kernel_equals_a_float64_loop(offset):
    """‖μ_t(i) − x_i‖², also with every value offset by 1e6 (the deviations stay exact); the
    float64 rows and their inverse norms; the shifted rows, in float64 and float32."""
    _check_all(np.random.default_rng(7), 300, 40, 17, offset)


def test_a_zero_row_gets_a_finite_weight():
    x, w = fold_kernels.float64_rows(torch.zeros(3, 4, dtype=torch.bfloat16))
    assert torch.isfinite(w).all() and (x * w.unsqueeze(1) == 0).all()


def test_the_compiled_path_traces_whole_and_takes_every_shape(monkeypatch):
    """Forced on (as the tests of the GPU's fold do), each kernel is traced as one graph
    (``fullgraph``: no break falls back to Python) and gives the eager values for batches of
    other sizes and widths."""
    # dynamo's caches and its recompile limit are the process's: a test that compiled the same
    # kernels before in this worker must not leave them at their limit (they then run eagerly)
    torch._dynamo.reset()
    monkeypatch.setattr(fold_kernels, "FUSE", True)
    monkeypatch.setattr(fold_kernels, "BACKEND", "eager")
    monkeypatch.setattr(fold_kernels, "_compiled", {})
    monkeypatch.setattr(fold_kernels, "_unavailable", False)
    rng = np.random.default_rng(8)
    assert fold_kernels.fused_on(torch.device("cpu"))
    for n, u, d in ((200, 30, 12), (257, 41, 12), (64, 9, 20)):
        _check_all(rng, n, u, d, 100.0)
    assert set(fold_kernels._compiled) == {
        ("float64_rows_eager", "eager"),
        ("deviations_and_centred_eager", "eager"),
        ("deviations_and_centred32_eager", "eager"),
    }
    assert not fold_kernels._unavailable


def test_a_kernel_that_cannot_be_built_warns_once_and_folds_eagerly(monkeypatch):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C compiler found\nsecond line")

    monkeypatch.setattr(fold_kernels, "FUSE", True)
    monkeypatch.setattr(fold_kernels, "_compiled", {})
    monkeypatch.setattr(fold_kernels, "_unavailable", False)
    monkeypatch.setattr(fold_kernels.torch, "compile", no_compiler)
    rng = np.random.default_rng(9)
    means, inv, x = _case(rng, 50, 7, 5, 0.0)
    c = torch.zeros(5, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="could not be built .RuntimeError: no C compiler"):
        sq, _ = fold_kernels.deviations_and_centred(means, inv, x, c)
    np.testing.assert_allclose(sq.numpy(), _reference(means, inv, x), rtol=1e-12)
    assert not fold_kernels.fused_on(torch.device("cpu"))  # not tried again
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        fold_kernels.float64_rows(x)
