"""The GPU fold's fused kernel (``core/fold_kernels.py``) against float64 references, on CPUs."""

from __future__ import annotations

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


@pytest.mark.parametrize("offset", [0.0, 1e6])
def test_squared_deviations_equal_a_float64_loop(offset):
    """‖μ_t(i) − x_i‖², also with every value offset by 1e6 (the deviations stay exact)."""
    rng = np.random.default_rng(7)
    means, inv, x = _case(rng, 300, 40, 17, offset)
    got = fold_kernels.squared_deviations_eager(means, inv, x).numpy()
    np.testing.assert_allclose(got, _reference(means, inv, x), rtol=1e-12, atol=0)


def test_the_compiled_path_traces_whole_and_takes_every_shape(monkeypatch):
    """Forced on (as the tests of the GPU's fold do), the kernel is traced as one graph
    (``fullgraph``: no break falls back to Python) and gives the eager values for batches of
    other sizes without a new trace per size (dynamic shapes)."""
    monkeypatch.setattr(fold_kernels, "FUSE", True)
    monkeypatch.setattr(fold_kernels, "BACKEND", "eager")
    monkeypatch.setattr(fold_kernels, "_compiled", {})
    rng = np.random.default_rng(8)
    assert fold_kernels.fused_on(torch.device("cpu"))
    for n, u in ((200, 30), (257, 41), (64, 9)):
        means, inv, x = _case(rng, n, u, 12, 100.0)
        got = fold_kernels.squared_deviations(means, inv, x)
        np.testing.assert_allclose(got.numpy(), _reference(means, inv, x), rtol=1e-12)
    assert set(fold_kernels._compiled) == {"eager"} and not fold_kernels._unavailable


def test_a_kernel_that_cannot_be_built_warns_once_and_folds_eagerly(monkeypatch):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C compiler found\nsecond line")

    monkeypatch.setattr(fold_kernels, "FUSE", True)
    monkeypatch.setattr(fold_kernels, "_compiled", {})
    monkeypatch.setattr(fold_kernels, "_unavailable", False)
    monkeypatch.setattr(fold_kernels.torch, "compile", no_compiler)
    rng = np.random.default_rng(9)
    means, inv, x = _case(rng, 50, 7, 5, 0.0)
    with pytest.warns(RuntimeWarning, match="could not be built .RuntimeError: no C compiler"):
        got = fold_kernels.squared_deviations(means, inv, x)
    np.testing.assert_allclose(got.numpy(), _reference(means, inv, x), rtol=1e-12)
    assert not fold_kernels.fused_on(torch.device("cpu"))  # not tried again
