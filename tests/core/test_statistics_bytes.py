"""Statistics files as the one-module ``core/statistics.py`` wrote them.

``EmbeddingStatistics`` was one module until it was split into its per-type moments
(``core/type_moments.py``), per-layer state (``core/layer_state.py``), column-block products
(``core/gram.py``), partitions (``core/partitions.py``) and files (``core/statistics_io.py``).
The split changed no arithmetic: this module folds the same batches with the statistics of
:data:`BEFORE_SPLIT` (imported from git, beside this checkout's package, by
:func:`bench.common.baseline_module`) and with this checkout's, along every route of the fold
(CPU blocks, the GPU's way, each co-moment precision, positions, clipped sums, non-finite rows,
bf16 and massive activations), and through merge, select, combine, clear, budgets, partial
reads and round trips. Each file must have the same header byte for byte (layout, shapes,
metadata), the same integer arrays (counts, tails) and float arrays equal to float64 rounding:
the fold's arithmetic has since changed in rounding only (the CPU's product by ``dsyrk``, the
co-moment merged in place, unit vectors as x · (1/‖x‖)), which a byte comparison would flag.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest
import torch
from safetensors.numpy import load as load_arrays

from bench.common import baseline_module
from embgeom_ray.core import fold_kernels
from embgeom_ray.core import statistics as current

#: the last commit with ``EmbeddingStatistics`` in one module
BEFORE_SPLIT = "f4deeb6a7b14965575ab1e91f918a6460d2f5b80"
LAYERS = [0, 3, 5]
D = 24  # >= 17: the bounded product runs on int8 units where asked
P = 12
METADATA = {"model_fingerprint": "m", "tokenizer_fingerprint": "t", "keep_special": "False"}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: tiny scatters on a shared 2-core machine otherwise wait ms each
    for the other thread (both packages fold under the same setting)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def fresh_kernels(monkeypatch):
    """Both packages' fused functions traced afresh for each test. Dynamo traces a function
    again for each new dtype or specialisation and, past its recompile limit (8), runs it
    uncompiled: after the rest of ``tests/core`` in one process this checkout's functions had
    passed the limit and the baseline's, imported here, had not, and an uncompiled pass may
    round differently from its traced graph (seen on "the GPU's way": float64 and float32
    files that differed in the last bits)."""
    torch._dynamo.reset()
    monkeypatch.setattr(fold_kernels, "_compiled", {})
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def before(tmp_path_factory) -> ModuleType:
    return baseline_module(BEFORE_SPLIT, tmp_path_factory.mktemp("before-split"), "core.statistics")


def batches(seed: int, n: int = 4, vocab: int = 40) -> list[tuple[torch.Tensor, ...]]:
    """``n`` batches (hidden (L, B, T, d), ids, keep, positions): float32 and bf16 hidden
    states, two massive dimensions, a NaN in one layer of one batch."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        b, t = 3 + i % 2, P
        h = rng.normal(size=(len(LAYERS), b, t, D))
        h[..., :2] += 3e3 * rng.random()  # massive activations
        h[1] += 40.0
        if i == 1:
            h[2, 0, 3, 5] = np.nan
        hidden = torch.as_tensor(h, dtype=torch.bfloat16 if i == 2 else torch.float32)
        ids = torch.as_tensor(rng.integers(0, vocab, size=(b, t)) * (1 + i % 3))
        keep = torch.as_tensor(rng.random((b, t)) > 0.15)
        pos = torch.as_tensor(rng.permutation(np.tile(np.arange(t), (b, 1)).T).T.copy())
        out.append((hidden, ids, keep, pos))
    return out


def new(module: ModuleType, precision: str, **options) -> object:
    return module.EmbeddingStatistics(
        LAYERS, D, max_positions=P, metadata=METADATA, clip_dims=[2, 7],
        comoment_precision=precision, **options,
    )  # fmt: skip


def folded(module: ModuleType, precision: str, seed: int, **options) -> object:
    stats = new(module, precision, **options)
    for hidden, ids, keep, pos in batches(seed):
        stats.update(hidden, ids, keep, pos)
    return stats


def files(module: ModuleType, precision: str, tmp) -> dict[str, bytes]:
    """Every file this test compares, made by ``module``'s statistics."""
    cls = module.EmbeddingStatistics
    a, b = folded(module, precision, 1), folded(module, precision, 2, initial_types=3)
    out = {"fold a": a.to_bytes(), "fold b": b.to_bytes()}
    out["merge"] = bytes(cls.from_bytes(out["fold a"]).merge(b).to_bytes())
    whole = cls.from_bytes(out["merge"])
    low = whole.select([0, 5], (0, 30))
    high = whole.select([0, 5], (30, None), layer_state=False)
    out["select low"] = low.to_bytes()
    out["select high"] = high.to_bytes()
    out["merge parts"] = cls.from_bytes(out["select low"]).merge(low).to_bytes()
    out["combine"] = cls.combine([high, low]).to_bytes()
    path = tmp / f"{module.__name__}-{precision}.safetensors"
    whole.save(path)
    out["load_part"] = cls.load_part(str(path), [3], (10, 50), layer_state=False).to_bytes()
    out["load"] = cls.load(str(path)).to_bytes()
    a.clear()
    for hidden, ids, keep, pos in batches(3, n=2):
        a.update(hidden, ids, keep, pos)
    out["cleared and folded"] = a.to_bytes()
    budget = new(module, precision, initial_types=2)
    budget.fit_budget(budget.held_bytes() + 5_000)
    for hidden, ids, keep, pos in batches(4, vocab=300):
        budget.update(hidden, ids, keep, pos)
    into = np.zeros(2 * len(budget.to_bytes()), dtype=np.uint8)
    out["under a budget, into a buffer"] = budget.to_bytes(into)
    out["empty"] = new(module, precision).to_bytes()
    return {k: bytes(memoryview(v).cast("B")) for k, v in out.items()}


ROUTES: dict[str, Callable[[ModuleType], None]] = {
    "CPU, blocks of 5 rows": lambda m: setattr(m, "CPU_ROW_BLOCK", 5),
    "CPU, one block": lambda m: None,
    "the GPU's way": lambda m: setattr(m, "GPU_FOLD", True),
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("precision", ["float64", "float32", "bounded"])
def test_files_are_those_of_the_statistics_before_the_split(
    before, route, precision, monkeypatch, tmp_path
):
    kernels = [fold_kernels, sys.modules[before.__name__.replace("statistics", "fold_kernels")]]
    monkeypatch.setattr(kernels[1], "_compiled", {})
    for module, kernel in zip([current, before], kernels, strict=True):
        monkeypatch.setattr(module, "INTEGER_PRODUCT", True)  # bounded: int8 units, as on CUDA
        monkeypatch.setattr(module, "GPU_FOLD", False)
        monkeypatch.setattr(module, "CPU_ROW_BLOCK", 1024)
        monkeypatch.setattr(kernel, "FUSE", route == "the GPU's way")
        monkeypatch.setattr(kernel, "BACKEND", "eager")
        ROUTES[route](module)
    now, then = files(current, precision, tmp_path), files(before, precision, tmp_path)
    assert list(now) == list(then)
    differ = {k: d for k in now if (d := difference(now[k], then[k]))}
    assert not differ
    assert current.EmbeddingStatistics.from_bytes(now["merge"]).token_count() > 100


def difference(now: bytes, then: bytes, rtol: float = 1e-12) -> str:
    """Why two statistics files differ beyond float64 rounding ("" where they do not): the
    headers (a length and the JSON of the arrays' layout and the metadata) byte for byte, the
    integer arrays exactly, a float array within ``rtol`` of its largest magnitude."""
    size = 8 + struct.unpack("<Q", now[:8])[0]
    if now[:size] != then[:size] or len(now) != len(then):
        return "header or length"
    new, old = load_arrays(now), load_arrays(then)
    for name, a in new.items():
        b = old[name]
        if a.dtype.kind != "f":
            if not np.array_equal(a, b):
                return f"{name}: integers"
        else:
            scale = float(np.nanmax(np.abs(b), initial=0.0))
            if not np.allclose(a, b, rtol=0.0, atol=rtol * scale, equal_nan=True):
                return f"{name}: {float(np.nanmax(np.abs(a - b))) / max(scale, 1e-300):.1e}"
    return ""
