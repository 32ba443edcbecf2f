"""How many kernels the GPU's fold launches per layer and batch, counted on the CPU with the
GPU's path forced (``GPU_FOLD``, the fused kernels traced) and a dispatch counter: each ATen
operator that computes (views and metadata excluded) is one launch, each fused kernel one,
the Triton product one. At the job's batch sizes a small-d fold is bound by these launches
(docs/benchmarks.md, NVIDIA H200), so the counts may shrink but must not grow: the budgets
below are today's counts."""

from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from embgeom_ray.core import (
    fold_kernels,
    integer_gram,
    integer_syrk,
    layer_state,
    segment_sums,
    type_moments,
)
from embgeom_ray.core import gram as gram_module
from embgeom_ray.core import statistics as statistics_module
from embgeom_ray.core.statistics import EmbeddingStatistics

#: operators that launch no kernel: views, shape queries, allocations without a fill, and the
#: sparse matrix made from existing index and value tensors (metadata only)
NO_LAUNCH = frozenset({
    "view", "_unsafe_view", "slice", "t", "expand", "as_strided", "select", "unsqueeze",
    "squeeze", "_reshape_alias", "detach", "alias", "permute", "transpose", "unbind", "split",
    "split_with_sizes", "lift_fresh", "empty", "empty_strided", "narrow", "diagonal",
    "sym_size", "sym_stride", "sym_numel", "_local_scalar_dense", "sparse_compressed_tensor",
    "scalar_tensor", "new_empty", "new_empty_strided",
})  # fmt: skip

#: product: (per layer, per batch), the launches of today's fold of 64 rows, d = 48, 16
#: positions. The float64 product folds the layers together, their rows stacked
#: (``STACK_LAYERS``): one launch a layer (the batch's finite check, ``finite_layers``) and 90
#: a batch, where one layer at a time ("float64, layer by layer", still taken by layers with
#: a NaN and by the int8 product) launches 38 a layer and 49 a batch (80 and 33 before the
#: casts and fills made once a batch, the positions' means merged for all layers at once, and
#: the merges' vector and scalar terms fused).
#: With pass 1 in Triton (``segment_sums.TRITON_SUMS``; one layer at a time) a layer's
#: float64 copy, tails and three sparse products are five Triton launches (the rows' norms and
#: tails, and each grouping's sums and join), the unit-vector sums added in place, and the
#: types' merge (two gathers, its terms, two scatters and M2's sum) one more: 31 a layer, 48
#: a batch, and about 40 bytes of traffic a value fewer (``core/segment_sums.py``).
#: Of a layer's, the product takes: float64 1 (one column block); int8 the scales, residues
#: and reconstruction (~20), plus the Triton kernel's 1, or ``_int_mm``'s 11 moduli × (product,
#: remainder, zeros, copies)
BUDGETS = {
    "float64": (1, 90),
    "float64, layer by layer": (38, 49),
    "float64, layer by layer, Triton sums": (31, 48),
    "int8-triton": (55, 49),
    "int8-int-mm": (120, 49),
}


class LaunchCounter(TorchDispatchMode):
    """Counts the operators that launch a kernel, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_LAUNCH:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def as_one_launch(
    fn: Callable[..., object], name: str, counter: list[LaunchCounter | None]
) -> Callable[..., object]:
    """``fn`` counted as one launch under the active counter, its own operators not."""

    def wrapped(*args: object, **kwargs: object) -> object:
        if counter[0] is not None:
            counter[0].ops[name] += 1
        with _disable_current_modes():
            return fn(*args, **kwargs)

    return wrapped


@pytest.fixture
def gpu_path(monkeypatch):
    """The GPU's fold on the CPU: one block, sparse sums, argmax tails, fused kernels traced;
    each fused kernel and the Triton product counted as one launch."""
    monkeypatch.setattr(statistics_module, "GPU_FOLD", True)
    monkeypatch.setattr(gram_module, "CPU_SYRK", False)
    monkeypatch.setattr(fold_kernels, "FUSE", True)
    monkeypatch.setattr(fold_kernels, "BACKEND", "eager")
    counter: list[LaunchCounter | None] = [None]

    def fused(eager, *args):
        return as_one_launch(eager, "fused:" + eager.__name__, counter)(*args)

    for module in (fold_kernels, integer_gram, layer_state, type_moments):
        monkeypatch.setattr(module, "run_fused", fused)
    for name, eager in (
        ("float64_rows", fold_kernels.float64_rows_eager),
        ("deviations_and_centred", fold_kernels.deviations_and_centred_eager),
        ("deviations_and_centred32", fold_kernels.deviations_and_centred32_eager),
        ("deviations_and_residues", integer_gram.deviations_and_residues_eager),
    ):
        monkeypatch.setattr(statistics_module, name, lambda *a, eager=eager: fused(eager, *a))
    monkeypatch.setattr(
        integer_syrk, "remainders", as_one_launch(integer_syrk.remainders, "triton", counter)
    )
    kernels = segment_sums._kernels

    def counted() -> tuple[Launches, ...]:
        names = ("row_stats", "sums", "join", "merge_types")
        return tuple(Launches(k, name, counter) for k, name in zip(kernels(), names, strict=True))

    monkeypatch.setattr(segment_sums, "_kernels", counted)
    return counter


class Launches:
    """A Triton kernel whose launches (``kernel[grid](...)``) count as one each, as
    ``triton:NAME``."""

    def __init__(self, kernel: object, name: str, counter: list[LaunchCounter | None]) -> None:
        self.kernel, self.name, self.counter = kernel, name, counter

    def __getitem__(self, grid: object) -> Callable[..., object]:
        return as_one_launch(self.kernel[grid], f"triton:{self.name}", self.counter)


def launches(counter, product: str, monkeypatch) -> tuple[float, float, collections.Counter]:
    """(per layer, per batch, the per-layer operators): a steady batch (its types seen) of 2
    and of 6 layers, the difference per layer."""
    monkeypatch.setattr(statistics_module, "INTEGER_PRODUCT", not product.startswith("float64"))
    triton_sums = product.endswith("Triton sums")
    monkeypatch.setattr(statistics_module, "STACK_LAYERS", None if product == "float64" else False)
    monkeypatch.setattr(integer_gram, "TRITON_SYRK", product == "int8-triton")
    rng = np.random.default_rng(0)
    ops = {}
    for n_layers in (2, 6):
        stats = EmbeddingStatistics(
            list(range(n_layers)), 48, max_positions=16, comoment_precision="bounded"
        )
        batches = [
            (
                torch.as_tensor(rng.normal(size=(n_layers, 4, 16, 48))).to(torch.bfloat16),
                torch.as_tensor(rng.integers(0, 20, size=(4, 16))),
            )
            for _ in range(3)
        ]
        batches[-1] = (batches[-1][0], batches[0][1])  # the counted batch: every type seen
        for i, (h, ids) in enumerate(batches):
            if i < len(batches) - 1:  # (pass 1 in Triton for the counted batch only: the
                stats.update(h, ids)  # interpreter takes ~0.3 s a launch)
                continue
            monkeypatch.setattr(segment_sums, "TRITON_SUMS", triton_sums)
            counter[0] = LaunchCounter()
            with counter[0]:
                stats.update(h, ids)
            ops[n_layers], counter[0] = counter[0].ops, None
            monkeypatch.setattr(segment_sums, "TRITON_SUMS", False)
    per_layer = collections.Counter({k: (ops[6][k] - ops[2][k]) / 4 for k in ops[6] | ops[2]})
    total = sum(per_layer.values())
    return total, sum(ops[2].values()) - 2 * total, per_layer


@pytest.mark.parametrize("product", list(BUDGETS))
def test_the_gpu_fold_launches_no_more_kernels_than_today(gpu_path, product, monkeypatch):
    """Per layer and batch, and per batch: at most today's launches."""
    if "riton" in product:
        pytest.importorskip("triton")
    per_layer, per_batch, ops = launches(gpu_path, product, monkeypatch)
    layer_budget, batch_budget = BUDGETS[product]
    assert per_layer <= layer_budget, sorted(ops.items(), key=lambda kv: -kv[1])
    assert per_batch <= batch_budget
    # a layer's product kernels: the float64 product of one block, Triton's one kernel, or
    # one _int_mm a modulus; none where the layers' products are one batched product a batch
    products = ops["addmm_"] + ops["triton"] + ops["_int_mm"] + ops["baddbmm_"]
    moduli = len(integer_gram.moduli_for(64))
    expected = {"float64": 0, "int8-triton": 1}
    expected |= {"float64, layer by layer": 1, "float64, layer by layer, Triton sums": 1}
    assert products == expected.get(product, moduli)


def test_casts_and_fills_made_once_a_batch_serve_every_layer(gpu_path, monkeypatch):
    """The batch's counts in float64, the sparse sums' ones and the tails' ones are made once
    a batch, the positions' means merged for all layers at once, and the per-type and
    per-layer merges' terms each one fused kernel: no fill (``ones``), no cast and no
    positions' ``where`` a layer."""
    _, _, ops = launches(gpu_path, "float64, layer by layer", monkeypatch)
    assert ops["ones"] == 0 and ops["ones_like"] == 0 and ops["full"] == 0
    assert ops["_to_copy"] == 0 and ops["where"] == 1, ops  # where: the layer's shift c
    assert ops["fused:chan_merge_eager"] == ops["fused:merge_terms_eager"] == 1
