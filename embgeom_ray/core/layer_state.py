"""The per-layer part of the statistics: moments, tails, positions and non-finite tokens.

Per layer l, :class:`LayerState` holds the per-layer :data:`FIELDS
<embgeom_ray.core.statistics_fields.FIELDS>`:

- ``n``, ``mean`` μ and the d×d co-moment C = Σ_i (x_i − μ)(x_i − μ)ᵀ (covariance C/n,
  IsoScore, PCA spectrum, per-dimension mean/std). A batch's (n_b, μ_b, C_b) is merged into
  the held (n_a, μ_a, C_a) with the pairwise update of Chan, Golub & LeVeque (1979)::

      n = n_a + n_b,  δ = μ_b − μ_a,  μ = μ_a + δ n_b/n,  C = C_a + C_b + δδᵀ n_a n_b / n;

  the batch's C_b is computed by the fold (``core/statistics.py``) from one matrix product
  (:mod:`~embgeom_ray.core.gram`, :mod:`~embgeom_ray.core.integer_gram`);
- ``argmax_counts`` / ``argmin_counts``: how often each dimension is the largest / smallest
  of a token's vector (Luo 2020, "tails"; :func:`extreme_counts`), added;
- ``position_counts`` / ``position_means``: per position p within the window the count and
  mean vector (Luo, Kulmizev & Mao 2021, positional artefacts), merged as count-weighted means;
- ``nonfinite``: tokens whose vector had a NaN/inf and were left out of every sum, added.
"""

from __future__ import annotations

import functools

import torch

from .fold_kernels import run_fused
from .statistics_fields import LAYER_FIELDS, SUM

_F64 = torch.float64


def extreme_counts(
    x: torch.Tensor,
    which: str,
    scratch: torch.Tensor | None = None,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """How many rows of ``x`` (n × d, finite) have their first maximum (``which="max"``) or
    minimum (``"min"``) in each dimension: ``bincount(x.argmax(1), minlength=d)`` (Luo 2020).

    With a float32 ``scratch`` of x's shape (the fold passes one on CPUs), computed as the
    column sums of the 0/1 matrix ``x == rowmax(x)``: vectorised passes, ~4x faster on CPUs
    than the index-tracking ``argmax``. A row whose extreme value is tied between dimensions
    would count twice there; then (the sums exceed n: in bf16, with 8 significant bits, a
    tie somewhere in a block of 1,024 rows is the rule) only the tied rows are taken back
    and counted by their exact argmax.
    Without ``scratch`` (on GPUs, where ``argmax`` is one read of x in its own dtype instead
    of four passes, two of them over a float32 matrix, and a host synchronisation), the
    argmax itself, counted by ``index_add_`` (``bincount`` would synchronise with the host
    on CUDA to size its output); both give ties to the first dimension. With ``into`` (an
    int64 vector of d), the counts are added into it and it is returned.
    """
    n, d = x.shape
    if into is None:
        into = torch.zeros(d, dtype=torch.int64, device=x.device)
    if scratch is None:
        first = x.argmax(dim=1) if which == "max" else x.argmin(dim=1)
        return into.index_add_(0, first, _one(first.device).expand_as(first))
    if n >= 2**24:  # float32 sums of 0/1 values are exact below 2^24
        return extreme_counts(x, which, into=into)
    ext = x.amax(dim=1, keepdim=True) if which == "max" else x.amin(dim=1, keepdim=True)
    eq = torch.eq(x, ext, out=scratch)
    hits = eq.sum(dim=0)
    if int(hits.sum()) == n:  # one extreme per row: exact 0/1 sums
        return into.add_(hits.to(torch.int64))
    tied = (eq.sum(dim=1) > 1).nonzero().squeeze(1)  # the rows counted more than once
    into.add_(hits.to(torch.int64)).sub_(eq.index_select(0, tied).sum(dim=0).to(torch.int64))
    return extreme_counts(x.index_select(0, tied), which, into=into)


def merge_terms_eager(
    n_a: torch.Tensor, nb: torch.Tensor, mean_a: torch.Tensor, shift: torch.Tensor, m_s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(n, δ, δ · w, the mean's step δ · n_b/n) of a layer's Chan merge
    (:meth:`LayerState.merge_product`): n = n_a + n_b (``nb``: n_b as a float64 scalar, exact),
    δ = c + m' − μ_a, w = n_a n_b / n; or of G layers at once (``n_a`` (G,), the vectors
    G × d)."""
    delta = shift + m_s - mean_a
    n = n_a + nb.to(n_a.dtype)
    n_f = n.to(_F64)
    w = ((n_a.to(_F64) * nb) / n_f).unsqueeze(-1)
    return n, delta, delta * w, delta * (nb / n_f).unsqueeze(-1)


@functools.cache
def _one(device: torch.device) -> torch.Tensor:
    """A one (int64) on ``device``, made once: expanded (stride 0), it is the counts' source
    of every ``index_add_`` of the tails without a fill a layer."""
    return torch.ones(1, dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=64)
def _scalar(value: float, device: torch.device) -> torch.Tensor:
    """``value`` as a float64 device scalar, made once a value (a batch's row count is the
    same in every layer): a fill, where ``float / tensor`` would be computed as a reciprocal
    times the float (n_b/n = 1 then off by an ulp). Read only."""
    return torch.full((), value, dtype=_F64, device=device)


class LayerState:
    """The per-layer state of ``n_layers`` layers of hidden size ``dim``, with
    ``max_positions`` positions profiled (module docstring).

    Attributes:
        arrays: the per-layer fields' arrays by name, (L, *tail) each.
    """

    def __init__(self, n_layers: int, dim: int, max_positions: int, device: torch.device) -> None:
        self.max_positions = max_positions
        self.arrays: dict[str, torch.Tensor] = {
            f.name: torch.zeros(
                f.shape(n_layers, 0, dim, max_positions), dtype=f.torch_dtype, device=device
            )
            for f in LAYER_FIELDS
        }

    def nbytes(self) -> int:
        return int(sum(t.numel() * t.element_size() for t in self.arrays.values()))

    def clear(self) -> None:
        """Every layer back to nothing seen (in the same memory)."""
        for a in self.arrays.values():
            a.zero_()

    def add_tails(self, li: int, rows: torch.Tensor, scratch: torch.Tensor | None) -> None:
        """Count the argmax and argmin dimensions of the finite ``rows`` into layer slot ``li``
        (:func:`extreme_counts`; ``scratch``: a float32 buffer of the rows' shape, on CPUs)."""
        extreme_counts(rows, "max", scratch, into=self.arrays["argmax_counts"][li])
        extreme_counts(rows, "min", scratch, into=self.arrays["argmin_counts"][li])

    def add_tail_dims(self, li: int, argmax: torch.Tensor, argmin: torch.Tensor) -> None:
        """Count rows' first argmax and argmin dimensions, already found (``argmax``,
        ``argmin``: (n,) int64; :func:`~embgeom_ray.core.segment_sums.group_sums`), into layer
        slot ``li``, as :meth:`add_tails` counts them on GPUs."""
        for name, first in (("argmax_counts", argmax), ("argmin_counts", argmin)):
            self.arrays[name][li].index_add_(0, first, _one(first.device).expand_as(first))

    def add_tails_stacked(self, lo: int, rows: torch.Tensor) -> None:
        """:meth:`add_tails` of layer slots ``lo``..lo + G − 1 at once from their finite rows
        stacked (n × G × d): each layer's argmax and argmin dimensions (the first on ties, as
        :func:`extreme_counts` counts them on GPUs), counted into its row of the counts by
        one ``index_add_`` over the G·d counts of the layers."""
        _, G, d = rows.shape
        offsets = torch.arange(0, G * d, d, device=rows.device)
        for name, first in (("argmax_counts", rows.argmax(2)), ("argmin_counts", rows.argmin(2))):
            counts = self.arrays[name][lo : lo + G].view(-1)  # rows lo.. of the (L, d) counts
            index = (first + offsets).view(-1)
            counts.index_add_(0, index, _one(rows.device).expand_as(index))

    def merge_moments(
        self, li: int, n_b: torch.Tensor | int, mean_b: torch.Tensor, c_b: torch.Tensor
    ) -> None:
        """Chan-merge (n, mean, co-moment) into layer slot ``li``. The fold passes ``n_b`` as
        a Python int: neither a copy to the device nor a read back."""
        a = self.arrays
        n_a = a["n"][li]
        if int(n_b) == 0:
            return
        if isinstance(n_b, torch.Tensor):
            nb = n_b.to(_F64)
        else:  # a device scalar by a fill (no copy from the host): ``float / tensor`` would
            # be computed as a reciprocal times the float, n_b/n = 1 then off by an ulp
            nb = torch.full((), float(n_b), dtype=_F64, device=n_a.device)
        delta = mean_b - a["mean"][li]
        n = n_a + n_b
        w = (n_a.to(_F64) * nb) / n.to(_F64)
        a["comoment"][li] += c_b + torch.outer(delta, delta) * w
        a["mean"][li] += delta * (nb / n.to(_F64))  # n_b/n correctly rounded: 1 into empty
        a["n"][li] = n

    def merge_product(
        self, li: int, n_b: int, shift: torch.Tensor, m_s: torch.Tensor, upper: torch.Tensor
    ) -> None:
        """Chan-merge a folded batch into layer slot ``li`` from its co-moment product: ``n_b``
        rows of mean μ_b = c + m' (``shift`` c, ``m_s`` m'), and ``upper``, whose upper
        triangle is X'ᵀX' of the rows shifted by c (overwritten here). The batch's co-moment
        C_b = X'ᵀX' − n_b m'm'ᵀ and the cross term δδᵀ n_a n_b / n are added to the upper
        triangle by two rank-one updates, and that triangle is mirrored into C: six d × d
        passes in place and no d × d temporaries, where :meth:`merge_moments` on a symmetric
        C_b makes about a dozen (~1 ms a layer and batch at d = 384 on a CPU, cProfile). C
        stays exactly symmetric."""
        a = self.arrays
        n_a = a["n"][li]
        nb = _scalar(float(n_b), n_a.device)  # as merge_moments
        # the vectors and scalars of the update: one compiled kernel on a GPU (fold_kernels)
        n, delta, delta_w, step = run_fused(merge_terms_eager, n_a, nb, a["mean"][li], shift, m_s)
        upper.addr_(m_s, m_s, alpha=-n_b)
        upper.addr_(delta_w, delta)
        upper.triu_()
        comoment = a["comoment"][li]
        comoment += upper
        upper.diagonal().zero_()
        comoment += upper.T
        a["mean"][li].add_(step)  # in place: no write-back of the row
        a["n"][li] = n

    def merge_product_stacked(
        self, lo: int, n_b: int, shift: torch.Tensor, m_s: torch.Tensor, upper: torch.Tensor
    ) -> None:
        """:meth:`merge_product` of layer slots ``lo``..lo + G − 1 at once: ``shift`` and ``m_s``
        (G × d), ``upper`` (G × d × d, overwritten), the same formulas batched over the layers
        (the rank-one updates as batched products of one column by one row)."""
        a = self.arrays
        hi = lo + upper.shape[0]
        n_a = a["n"][lo:hi]
        nb = _scalar(float(n_b), n_a.device)
        mean = a["mean"][lo:hi]
        n, delta, delta_w, step = run_fused(merge_terms_eager, n_a, nb, mean, shift, m_s)
        upper.baddbmm_(m_s.unsqueeze(2), m_s.unsqueeze(1), alpha=-n_b)
        upper.baddbmm_(delta_w.unsqueeze(2), delta.unsqueeze(1))
        upper.triu_()
        comoment = a["comoment"][lo:hi]
        comoment += upper
        upper.diagonal(dim1=-2, dim2=-1).zero_()
        comoment += upper.transpose(-2, -1)
        mean.add_(step)
        n_a.copy_(n)

    def merge_positions(
        self,
        li: int | slice,
        counts_b: torch.Tensor,
        sums_b: torch.Tensor,
        counts_b_f: torch.Tensor | None = None,
    ) -> None:
        """Merge per-position counts and *sums* into layer slot ``li`` (means need no M2, a
        plain weighted update; ``counts_b_f``: ``counts_b`` in float64, when the caller has
        it). ``li`` a slice of layers: their sums stacked (layers × P × d), one batch's
        counts for all of them, each element's arithmetic that of its own layer's merge."""
        counts, means = self.arrays["position_counts"], self.arrays["position_means"]
        n = counts[li] + counts_b
        seen = n > 0
        cb = counts_b.to(_F64) if counts_b_f is None else counts_b_f
        upd = sums_b - cb.unsqueeze(-1) * means[li]
        upd /= n.to(_F64).clamp_min(1.0).unsqueeze(-1)
        means[li] = torch.where(seen.unsqueeze(-1), means[li] + upd, 0.0)
        counts[li] = n

    def merge(self, other: LayerState) -> None:
        """Merge ``other`` (the same layers, hidden size and positions), layer by layer: the
        moments by Chan's update, the positions' means weighted by their counts, the rest
        added."""
        dev = self.arrays["n"].device
        o = {name: a.to(dev) for name, a in other.arrays.items()}
        for li in range(o["n"].shape[0]):
            self.merge_moments(li, o["n"][li], o["mean"][li], o["comoment"][li])
            if self.max_positions:
                counts = o["position_counts"][li]
                sums = o["position_means"][li] * counts.to(_F64).unsqueeze(-1)
                self.merge_positions(li, counts, sums)
        for f in LAYER_FIELDS:
            if f.merge == SUM:
                self.arrays[f.name] += o[f.name]
