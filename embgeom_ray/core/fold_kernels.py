"""Passes of the GPU fold fused into one kernel each by ``torch.compile`` (CUDA only).

Eagerly, each of the fold's per-row passes reads (and most write) the batch's (n × d) rows
once: on a GPU they are bound by memory traffic, not arithmetic. Compiled, the passes that
read the same rows become one kernel each (``core/statistics.py``, ``_fold_layer``):

* :func:`float64_rows` – pass 1: the rows in float64 (every sum and square is taken there)
  and each row's inverse norm 1/max(‖x_i‖, tiny), the weight of its unit vector x_i/‖x_i‖ in
  the per-type unit-vector sums: one read of the model-dtype rows (2 bytes a value in bf16),
  where the copy and the norm read the float64 rows once more (8 bytes).
* :func:`deviations_and_centred` – pass 2, ``comoment_precision="float64"``: for each row i
  of type t(i) the squared deviation from its type's batch mean, ``‖μ_{t(i)} − x_i‖²`` (summed
  per type into M2_t: two-pass, no cancellation whatever the offset), and the row shifted by
  the layer's running mean c, x_i − c (the co-moment product's input): one read of x where
  the eager passes gather the means into an (n × d) scratch, subtract, take norms and then
  shift x in place, ~56 bytes of traffic a value for 16 of arithmetic.
* :func:`deviations_and_centred32` – the same with ``comoment_precision="float32"``: the
  shifted rows are the model-dtype rows minus c rounded to float32, in float32.
* :func:`~embgeom_ray.core.integer_gram.deviations_and_residues` – the same for the bounded
  product on int8 units (beside that product, in :mod:`~embgeom_ray.core.integer_gram`, built
  by :func:`run_fused` here): instead of the shifted rows, their residues in fixed point
  modulo each of the N moduli, N bytes a value (int8), transposed for the products.
* :func:`~embgeom_ray.core.integer_gram.garner_reconstruct` – the integer co-moment from its N
  residue matrices (Garner's mixed radix, N(N − 1)/2 exact modular steps a value): one read
  of them, one write of the float64 matrix.
* :func:`~embgeom_ray.core.type_moments.chan_merge_eager` and
  :func:`~embgeom_ray.core.layer_state.merge_terms_eager` – the per-type and the per-layer Chan
  merges' terms (counts, weights, δ, the new means, the cross term): small passes, each a
  launch eagerly (about a dozen a layer each), one kernel each compiled
  (``tests/core/test_fold_launches.py`` counts the launches).

Each returns what its eager twin (``*_eager``) returns, to float64 rounding (only the order
of the additions of a row's d squares differs). The kernels are built on the first CUDA
batch, once per process and function (with dynamic shapes: batches of other sizes and widths
reuse them). The first three builds cost the first batch of an extractor process about 7 s on
an H100 (the two merges' were added since, not measured) (inferred from a bench run whose first repeat held them: ``docs/benchmarks.md``,
NVIDIA H100);
inductor keeps built kernels in its on-disk cache for later processes on the node (how much
that saves was not measured). Where they
cannot be built (no Triton, no C compiler on the node) the fold warns once and stays eager:
the same statistics, slower.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

#: fuse: None (default) on CUDA devices only; True or False forces the choice everywhere (the
#: tests run the compiled path on CPUs, with :data:`BACKEND` ``"eager"``: traced, not built)
FUSE: bool | None = None
#: the ``torch.compile`` backend
BACKEND = "inductor"

#: graphs each fused pass may build in a process (dynamo's default, 8, applies elsewhere): one
#: per input dtype and rank (one layer's rows, a stack of layers' rows) and size 0/1 cases,
#: which a process folding several dtypes (the tests, or models of several dtypes) exceeds;
#: past it the fold would warn and stay eager
RECOMPILE_LIMIT = 64

_F64 = torch.float64
_compiled: dict[tuple[str, str], Callable[..., object]] = {}
_unavailable = False


def float64_rows_eager(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, w): the rows (n × d, any float dtype) in float64, and w_i = 1/max(‖x_i‖, tiny)
    (a zero row gets a finite weight, and its unit vector stays 0)."""
    x = rows.to(_F64)
    norms = torch.linalg.vector_norm(x, dim=1)
    return x, norms.clamp_min(torch.finfo(_F64).tiny).reciprocal()


def squared_deviations_eager(
    means: torch.Tensor, inv: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """``‖means[inv_i] − x_i‖²`` for every row i of ``x`` (n × d): ``means`` (u × d) and
    ``x`` float64, ``inv`` (n,) the row's index into ``means``; or of G layers at once, ``x``
    (n × G × d) and ``means`` (u × G × d), an (n × G) result."""
    return (torch.index_select(means, 0, inv) - x).square().sum(dim=-1)


def deviations_and_centred_eager(
    means: torch.Tensor, inv: torch.Tensor, x: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`squared_deviations_eager`, x − c): ``c`` (d,) float64 (G × d for G layers)."""
    return squared_deviations_eager(means, inv, x), x - c


def deviations_and_centred32_eager(
    means: torch.Tensor, inv: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, c32: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`squared_deviations_eager`, rows − c32 in float32): ``rows`` the model-dtype rows
    whose float64 copy is ``x``, ``c32`` (d,) float32; the difference is taken in the wider of
    the two dtypes and rounded once to float32 (for bf16 or float32 rows, one correctly rounded
    float32 subtraction of the model's own values)."""
    return squared_deviations_eager(means, inv, x), torch.sub(rows, c32).to(torch.float32)


def fused_on(device: torch.device) -> bool:
    """Whether the functions below run their compiled kernels on ``device``."""
    wanted = device.type == "cuda" if FUSE is None else FUSE
    return wanted and not _unavailable


def run_fused(eager: Callable[..., object], *args: torch.Tensor) -> object:
    """``eager(*args)`` as one compiled kernel where :func:`fused_on` the arguments' device,
    else (and where it cannot be built: one warning, then eager for good) eagerly."""
    global _unavailable
    if fused_on(args[0].device):
        key = (eager.__name__, BACKEND)
        try:
            if key not in _compiled:
                _compiled[key] = torch.compile(eager, dynamic=True, fullgraph=True, backend=BACKEND)
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                return _compiled[key](*args)
        except Exception as e:  # any failure to build a kernel: the eager passes instead
            _unavailable = True
            warnings.warn(
                f"the fold's fused kernel could not be built ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200] if str(e) else ''}); folding with the eager "
                "passes (the same statistics, slower)",
                RuntimeWarning,
                stacklevel=3,
            )
    return eager(*args)


def float64_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`float64_rows_eager`, fused where :func:`fused_on`."""
    return run_fused(float64_rows_eager, rows)  # type: ignore[return-value]


def deviations_and_centred(
    means: torch.Tensor, inv: torch.Tensor, x: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`deviations_and_centred_eager`, fused where :func:`fused_on`."""
    return run_fused(deviations_and_centred_eager, means, inv, x, c)  # type: ignore[return-value]


def deviations_and_centred32(
    means: torch.Tensor, inv: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, c32: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`deviations_and_centred32_eager`, fused where :func:`fused_on`."""
    return run_fused(  # type: ignore[return-value]
        deviations_and_centred32_eager, means, inv, x, rows, c32
    )
