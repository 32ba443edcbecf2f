"""Partial sums of a layer's exact metrics over a subset of its token types, and their merge.

The per-type state of a large vocabulary does not fit one process, so it is partitioned by
token id (:meth:`~embgeom_ray.core.statistics.EmbeddingStatistics.select`). Every per-layer
metric that reads the per-type rows is a function of a few sums over types, which each
partition computes for its own types and which add (or, for a correlation, merge by Chan's
formulas) across partitions. With the layer's counted tokens N, mean μ (from the layer's own
state, :class:`~embgeom_ray.core.layer_moments.LayerMoments`), and per type t its count n_t, mean
μ_t, M2_t and unit sum U_t:

- V_W = Σ_t M2_t / N and V_B = Σ_t n_t ||μ_t − μ||² / N (Yamagiwa et al. 2024): the sums
  Σ M2_t and Σ n_t ||μ_t − μ||² (the latter with the layer's μ given to every partition, so no
  cancellation: a large common offset drops out before squaring);
- anisotropy, S_inter, S_intra (Ethayarajh 2019; Cai et al. 2021): :class:`CosineSums`, i.e.
  U = Σ U_t, Σ ||U_t||², Σ n_t, Σ n_t², and Σ SelfSim_t with the number of types with n_t ≥ 2;
- the norm–variance correlation r(||μ_t||, V_t) over types with n_t ≥ min_count:
  :class:`PairMoments` (count, means, centred second moments), merged with Chan et al.'s
  pairwise update, which is exact up to rounding and stable under offsets.

:func:`type_partials` computes a partition's :class:`TypePartials`, :func:`merge_partials`
adds them, and :func:`~embgeom_ray.core.metrics.layer_row` reads a row from the merged sums, so
an unpartitioned run (one partition) and a run split R ways go through the same formulas and
agree to float64 rounding. A partial is O(d) numbers: what crosses between processes per layer
does not grow with the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from .layer_moments import LayerMoments


def mean_cosine_from_unit_sum(
    sq_norm: float | np.ndarray, m: float | np.ndarray
) -> float | np.ndarray:
    """Mean cosine over the m(m − 1) ordered pairs i ≠ j of m unit vectors u_1..u_m.

    With U = Σ u_i: ||U||² = Σ_i Σ_j u_i·u_j = m + Σ_{i≠j} cos(u_i, u_j), so the mean is
    (||U||² − m) / (m(m − 1)), exact. ``sq_norm`` is ||U||²; both arguments may be arrays
    (elementwise, e.g. one value per token type). Undefined (division by 0) for m < 2: callers
    mask those.
    """
    return (sq_norm - m) / (m * (m - 1.0))


def group_sums(u: np.ndarray, group: np.ndarray, n_groups: int) -> np.ndarray:
    """(n_groups, d) Σ_{i: group_i = g} u_i of the rows u (n, d): ``np.add.at``'s sums, bit for bit.

    One weighted ``bincount`` over the flattened rows: it adds in row order, as
    ``np.add.at(zeros, group, u)`` does, so the sums are the same floats, several times faster.
    """
    d = u.shape[1]
    flat = (np.asarray(group, np.int64)[:, None] * d + np.arange(d)[None, :]).ravel()
    return np.bincount(flat, weights=u.ravel(), minlength=n_groups * d).reshape(n_groups, d)


def self_similarities(counts: np.ndarray, unit_sums: np.ndarray) -> np.ndarray:
    """SelfSim_t = (||U_t||² − n_t) / (n_t (n_t − 1)) per type; NaN where n_t < 2."""
    n = counts.astype(np.float64)
    ut2 = np.einsum("td,td->t", unit_sums, unit_sums)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts >= 2, mean_cosine_from_unit_sum(ut2, n), np.nan)


@dataclass(frozen=True)
class CosineSums:
    """The sums over a set of types that the all-token cosine metrics need.

    ``unit`` U = Σ U_t (d,), ``unit_sq`` Σ ||U_t||², ``n`` Σ n_t, ``n_sq`` Σ n_t²,
    ``selfsim`` Σ SelfSim_t over the ``selfsim_types`` types with n_t ≥ 2.
    """

    unit: np.ndarray
    unit_sq: float
    n: float
    n_sq: float
    selfsim: float
    selfsim_types: int

    @classmethod
    def of(cls, counts: np.ndarray, unit_sums: np.ndarray) -> CosineSums:
        n = counts.astype(np.float64)
        ss = self_similarities(counts, unit_sums)
        finite = np.isfinite(ss)
        return cls(
            unit=unit_sums.sum(axis=0),
            unit_sq=float(np.einsum("td,td->", unit_sums, unit_sums)),
            n=float(n.sum()),
            n_sq=float((n**2).sum()),
            selfsim=float(ss[finite].sum()),
            selfsim_types=int(finite.sum()),
        )

    def __add__(self, other: CosineSums) -> CosineSums:
        return CosineSums(
            self.unit + other.unit,
            self.unit_sq + other.unit_sq,
            self.n + other.n,
            self.n_sq + other.n_sq,
            self.selfsim + other.selfsim,
            self.selfsim_types + other.selfsim_types,
        )

    def metrics(self) -> tuple[float, float, float]:
        """(anisotropy, S_inter, S_intra).

        anisotropy = (||U||² − N) / (N(N − 1)); S_inter = (||U||² − Σ ||U_t||²) / (N² − Σ n_t²);
        S_intra = Σ SelfSim_t / #{t: n_t ≥ 2}; NaN where undefined.
        """
        uu = float(self.unit @ self.unit)
        n = self.n
        aniso = float(mean_cosine_from_unit_sum(uu, n)) if n >= 2 else float("nan")
        pairs = n**2 - self.n_sq
        s_inter = (uu - self.unit_sq) / pairs if pairs > 0 else float("nan")
        s_intra = self.selfsim / self.selfsim_types if self.selfsim_types else float("nan")
        return aniso, float(s_inter), float(s_intra)


@dataclass(frozen=True)
class PairMoments:
    """Count, means and centred second moments of pairs (x, y), mergeable (Chan et al. 1979).

    ``m2_x`` = Σ (x − x̄)², ``m2_y`` = Σ (y − ȳ)², ``c_xy`` = Σ (x − x̄)(y − ȳ).
    """

    count: int = 0
    mean_x: float = 0.0
    mean_y: float = 0.0
    m2_x: float = 0.0
    m2_y: float = 0.0
    c_xy: float = 0.0

    @classmethod
    def of(cls, x: np.ndarray, y: np.ndarray) -> PairMoments:
        """Two-pass moments of the pairs (x_i, y_i)."""
        if len(x) == 0:
            return cls()
        dx, dy = x - x.mean(), y - y.mean()
        return cls(len(x), float(x.mean()), float(y.mean()), float(dx @ dx), float(dy @ dy),
                   float(dx @ dy))  # fmt: skip

    def __add__(self, other: PairMoments) -> PairMoments:
        """Chan's merge: with δ the difference of the means and w = n_a n_b / n,
        M2 = M2_a + M2_b + w δ_x², C = C_a + C_b + w δ_x δ_y."""
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        n = self.count + other.count
        dx, dy = other.mean_x - self.mean_x, other.mean_y - self.mean_y
        w = self.count * other.count / n
        return PairMoments(
            n,
            self.mean_x + dx * other.count / n,
            self.mean_y + dy * other.count / n,
            self.m2_x + other.m2_x + w * dx * dx,
            self.m2_y + other.m2_y + w * dy * dy,
            self.c_xy + other.c_xy + w * dx * dy,
        )

    def correlation(self) -> float:
        """Pearson r = C / √(M2_x M2_y); NaN for fewer than 3 pairs or a constant variable."""
        if self.count < 3 or self.m2_x <= 0 or self.m2_y <= 0:
            return float("nan")
        r = self.c_xy / np.sqrt(self.m2_x * self.m2_y)
        return float(np.clip(r, -1.0, 1.0))


def type_variances(m: LayerMoments) -> np.ndarray:
    """V_t = M2_t / n_t = mean ||x − μ_t||² (population variance; exactly 0 when n_t = 1)."""
    v = m.m2 / np.maximum(m.counts, 1)
    return np.where(m.counts == 1, 0.0, v)


@dataclass(frozen=True)
class TypePartials:
    """One layer's sums over a subset of its token types (module docstring).

    ``types`` counts the types with n_t > 0, ``m2`` is Σ M2_t, ``between`` Σ n_t ||μ_t − μ||²
    (μ the layer's mean), ``cosines`` the unclipped :class:`CosineSums`, ``clipped`` those of
    the clipped unit sums (None unless the statistics track ``clip_dims``), ``norm_variance``
    the moments of (||μ_t||, V_t) over types with n_t ≥ ``min_count``.
    """

    layer: int
    min_count: int
    types: int
    m2: float
    between: float
    cosines: CosineSums
    clipped: CosineSums | None
    norm_variance: PairMoments


def type_partials(m: LayerMoments, layer_mean: np.ndarray, min_count: int) -> TypePartials:
    """The :class:`TypePartials` of the types in ``m`` (a layer's view of any partition),
    with ``layer_mean`` the layer's mean μ over all its tokens (every partition's)."""
    dev = m.means - layer_mean
    sel = m.counts >= min_count
    clipped = None
    if m.clip_unit_sums is not None and m.clip_dims is not None:
        clipped = CosineSums.of(m.counts, m.clip_unit_sums)
    return TypePartials(
        layer=m.layer,
        min_count=int(min_count),
        types=int((m.counts > 0).sum()),
        m2=float(m.m2.sum()),
        between=float(m.counts.astype(np.float64) @ np.einsum("td,td->t", dev, dev)),
        cosines=CosineSums.of(m.counts, m.unit_sums),
        clipped=clipped,
        norm_variance=PairMoments.of(np.linalg.norm(m.means[sel], axis=1), type_variances(m)[sel]),
    )


def merge_partials(parts: Sequence[TypePartials]) -> TypePartials:
    """The :class:`TypePartials` of the union of disjoint type sets (one layer, one
    ``min_count``, all clipped or none)."""
    if not parts:
        raise ValueError("merge_partials needs at least one partial")
    first = parts[0]
    if {(p.layer, p.min_count, p.clipped is None) for p in parts} != {
        (first.layer, first.min_count, first.clipped is None)
    }:
        raise ValueError("partials of different layers, min_count or clipping do not merge")
    out = first
    for p in parts[1:]:
        out = replace(
            out,
            types=out.types + p.types,
            m2=out.m2 + p.m2,
            between=out.between + p.between,
            cosines=out.cosines + p.cosines,
            clipped=None if out.clipped is None or p.clipped is None else out.clipped + p.clipped,
            norm_variance=out.norm_variance + p.norm_variance,
        )
    return out
