"""Passes of the GPU fold fused into one kernel each by ``torch.compile`` (CUDA only).

The fold's second pass needs, for each kept row i of type t(i), the squared deviation from
its type's batch mean, ``‖μ_{t(i)} − x_i‖²`` (float64), summed per type into M2_t (two-pass:
no cancellation, whatever the offset; ``core/statistics.py``). Eagerly that is three passes
over (n × d) float64 rows: gather the means into a scratch matrix, subtract the rows, take
the norms: ~40 bytes of memory traffic per value for 8 of arithmetic. Compiled, it is one
kernel that reads each row and its mean once and writes one number per row.

The compiled kernel is built on the first CUDA batch, once per process (its cost was
measured only in aggregate: README, "On a GPU"), with dynamic shapes, meant to let batches of
other sizes reuse it. Where it cannot be built (no Triton, no C compiler on the node) the fold
warns once and stays eager: the same numbers to float64 rounding (only the order of the
additions of a row's d squares differs).
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

_compiled: dict[str, Callable[..., torch.Tensor]] = {}
_unavailable = False


def squared_deviations_eager(
    means: torch.Tensor, inv: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """``‖means[inv_i] − x_i‖²`` for every row i of ``x`` (n × d): ``means`` (u × d) and
    ``x`` float64, ``inv`` (n,) the row's index into ``means``."""
    return (torch.index_select(means, 0, inv) - x).square().sum(dim=1)


def fused_on(device: torch.device) -> bool:
    """Whether :func:`squared_deviations` on ``device`` runs the compiled kernel."""
    wanted = device.type == "cuda" if FUSE is None else FUSE
    return wanted and not _unavailable


def squared_deviations(means: torch.Tensor, inv: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """:func:`squared_deviations_eager` as one compiled kernel on CUDA (:func:`fused_on`),
    eager elsewhere and where the kernel cannot be built."""
    global _unavailable
    if fused_on(x.device):
        try:
            if BACKEND not in _compiled:
                _compiled[BACKEND] = torch.compile(
                    squared_deviations_eager, dynamic=True, fullgraph=True, backend=BACKEND
                )
            return _compiled[BACKEND](means, inv, x)
        except Exception as e:  # any failure to build the kernel: the eager passes instead
            _unavailable = True
            warnings.warn(
                f"the fold's fused kernel could not be built ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200] if str(e) else ''}); folding with the eager "
                "passes (the same statistics, slower)",
                RuntimeWarning,
                stacklevel=2,
            )
    return squared_deviations_eager(means, inv, x)
