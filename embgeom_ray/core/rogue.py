"""Rogue ("outlier", "tail") dimensions, positional artefacts and the effect of clipping them.

Luo (2020, "Catch the Tails of BERT") and Luo, Kulmizev & Mao (2021, "Positional Artefacts
Propagate Through Masked Language Model Embeddings") found a few dimensions of BERT and
RoBERTa that are almost always the largest or smallest value of every vector (BERT-base 557;
RoBERTa-base 588 and 77), tied to position embeddings and the main cause of anisotropy;
zeroing ("clipping") them improves similarity structure. Timkey & van Schijndel (2021) call
such dimensions rogue. Everything here is an exact function of the corpus statistics.

Outlier rules (:class:`OutlierRules`, each configurable; a dimension is flagged when any holds):

- ``mean_z``: |z| > 3, where z is the dimension's mean standardised among the layer's
  per-dimension means, z_d = (μ_d − mean_j μ_j) / std_j μ_j;
- ``variance_ratio``: Var_d / mean_j Var_j ≥ 5;
- ``tail_share``: the dimension is the argmax, or the argmin, of at least 25% of the layer's
  token vectors (a uniform share would be 1/d; Luo's tails are the extreme of most).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from . import metric_registry as registry
from .layer_moments import LayerMoments
from .metrics import (
    DIM_COLUMNS,
    cosines_from_unit_sums,
    dim_moment_rows,
    dim_variances,
    isoscore_from_covariance,
)
from .options import TableOptions
from .partials import TypePartials, group_sums, type_partials

if TYPE_CHECKING:  # the tables read moments only: no torch (core/layer_moments.py)
    from .statistics import EmbeddingStatistics

#: the columns of :func:`dimension_flags`, after :data:`~embgeom_ray.core.metrics.DIM_COLUMNS`
FLAG_COLUMNS = registry.columns(registry.DIMS, registry.FLAGS)
#: the columns of ``dims.parquet``
DIMS_COLUMNS = DIM_COLUMNS + FLAG_COLUMNS


_DEFAULTS = TableOptions()


@dataclass(frozen=True)
class OutlierRules:
    """When a dimension is flagged as an outlier (defaults: the ``outlier_*`` options of
    :class:`~.options.TableOptions`)."""

    mean_z: float = _DEFAULTS.outlier_mean_z
    variance_ratio: float = _DEFAULTS.outlier_variance_ratio
    tail_share: float = _DEFAULTS.outlier_tail_share

    @classmethod
    def of(cls, options: TableOptions) -> OutlierRules:
        return cls(options.outlier_mean_z, options.outlier_variance_ratio, options.outlier_tail_share)

    def describe(self) -> str:
        return (
            f"|mean z| > {self.mean_z:g}, or variance >= {self.variance_ratio:g} x the mean "
            f"variance, or argmax/argmin share >= {self.tail_share:g}"
        )


def position_correlation(m: LayerMoments) -> np.ndarray:
    """Pearson r between a token's position in its window and each dimension, over all tokens.

    Exact from per-position means m_{p,·} and counts n_p:
    cov(p, x_d) = Σ_p n_p (p − p̄)(m_{p,d} − μ_d) / N,  r_d = cov / (σ_p σ_d).
    NaN where a standard deviation is 0 or positions were not profiled.
    """
    counts = m.position_counts.astype(np.float64)
    n = counts.sum()
    d = m.dim
    if n == 0:
        return np.full(d, np.nan)
    p = np.arange(counts.shape[0], dtype=np.float64)
    p_bar = float(counts @ p) / n
    var_p = float(counts @ (p - p_bar) ** 2) / n
    cov = ((counts * (p - p_bar)) @ (m.position_means - m.mean)) / n
    var_d = np.diag(m.comoment) / max(m.n, 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = cov / np.sqrt(var_p * var_d)
    return np.where((var_p > 0) & (var_d > 0), r, np.nan)


def variance_ratios(variances: np.ndarray) -> np.ndarray:
    """``variance_ratio``: Var_d / mean_j Var_j over a layer's dimensions; NaN when every
    variance is 0."""
    mean_var = variances.mean()
    return variances / mean_var if mean_var > 0 else np.full_like(variances, np.nan)


def mean_zscores(means: np.ndarray) -> np.ndarray:
    """``mean_zscore``: (μ_d − mean_j μ_j) / std_j μ_j over a layer's dimensions (population
    std); 0 when every dimension has the same mean."""
    sd_means = means.std()
    return (means - means.mean()) / sd_means if sd_means > 0 else np.zeros_like(means)


def dimension_flags(m: LayerMoments, rules: OutlierRules) -> pd.DataFrame:
    """Per dimension: variance_ratio, mean_zscore, argmax/argmin share, position_corr, flags.

    Columns :data:`FLAG_COLUMNS`; the rules are the module docstring's (:class:`OutlierRules`),
    ``outlier_rule`` names those that hold ("" for an unflagged dimension).
    """
    ratio = variance_ratios(dim_variances(m))
    z = mean_zscores(m.mean)
    total = max(int(m.argmax_counts.sum()), 1)
    amax = m.argmax_counts / total
    amin = m.argmin_counts / total
    hits = {
        "mean_z": np.abs(z) > rules.mean_z,
        "variance_ratio": ratio >= rules.variance_ratio,
        "tail_share": np.maximum(amax, amin) >= rules.tail_share,
    }
    rule_text = [",".join(name for name, mask in hits.items() if mask[i]) for i in range(m.dim)]
    return pd.DataFrame(
        {
            "variance_ratio": ratio,
            "mean_zscore": z,
            "argmax_share": amax,
            "argmin_share": amin,
            "position_corr": position_correlation(m),
            "outlier": np.array([bool(t) for t in rule_text]),
            "outlier_rule": rule_text,
        }
    )


def dims_rows(m: LayerMoments, rules: OutlierRules) -> pd.DataFrame:
    """One layer's rows of ``dims.parquet`` (:data:`DIMS_COLUMNS`), one per dimension.

    The per-dimension mean and population std
    (:func:`~embgeom_ray.core.metrics.dim_moment_rows`) and :func:`dimension_flags`.
    """
    return pd.concat([dim_moment_rows(m), dimension_flags(m, rules)], axis=1)


def rogue_dims_table(stats: EmbeddingStatistics, rules: OutlierRules) -> pd.DataFrame:
    """``dims.parquet`` of a statistics object: :func:`dims_rows` of every layer.

    A convenience for this one table; :func:`embgeom_ray.core.tables.build_tables` builds it
    with the other tables, reading each layer's view once.
    """
    frames = [dims_rows(stats.layer(layer), rules) for layer in stats.layers]
    return pd.concat(frames, ignore_index=True)


def flagged_dims(dims: pd.DataFrame) -> dict[int, list[int]]:
    """Per layer, the dimensions flagged as outliers in a ``dims.parquet`` table."""
    out: dict[int, list[int]] = {}
    for layer, group in dims.groupby("layer"):
        out[int(layer)] = sorted(int(d) for d in group.loc[group["outlier"], "dim"])
    return out


def position_profile(counts: np.ndarray, means: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(``counts`` (P,), ‖mean‖ at each position seen) of a layer's ``position_counts`` and
    ``position_means`` (P, d)."""
    return counts, np.linalg.norm(means[counts > 0], axis=1)


def position_columns(counts: np.ndarray, means: np.ndarray, dims: Sequence[int]) -> np.ndarray:
    """The position means (P, d) at dimensions ``dims``, at the positions seen: (seen, len(dims))."""
    return means[counts > 0][:, list(dims)]


def positions_table_from(
    profiles: Mapping[int, tuple[np.ndarray, np.ndarray, np.ndarray]], dims: Sequence[int]
) -> pd.DataFrame:
    """``positions.parquet``: per (layer, position) count, ‖mean‖ and the mean of flagged dims.

    ``profiles``: layer -> (counts (P,), ‖mean‖ at the positions seen, the means at ``dims``
    there): :func:`position_profile` and :func:`position_columns` of the layer's
    ``position_counts`` and ``position_means`` (P, d), what a layer's owner sends,
    O(P · (1 + len(dims))) rather than its P × d means. ``dims``: every dimension flagged in
    any layer (:func:`flagged_dims`), sorted. One row per position seen; a column ``dim_<d>``
    for each of ``dims``."""
    frames = []
    for layer, (counts, norms, columns) in profiles.items():
        seen = counts > 0
        pos = np.flatnonzero(seen)
        frame = {
            "layer": np.full(pos.shape, layer, dtype=np.int64),
            "position": pos.astype(np.int64),
            "count": counts[seen].astype(np.int64),
            "mean_norm": norms,
        }
        for j, d in enumerate(dims):
            frame[f"dim_{d}"] = columns[:, j]
        frames.append(pd.DataFrame(frame))
    return pd.concat(frames, ignore_index=True)


def clipped_isoscore(m: LayerMoments, dims: list[int]) -> float:
    """IsoScore of the layer's covariance with ``dims`` zeroed (their rows and columns set to 0).

    Exact: zeroing coordinates of every vector zeroes those rows/columns of the covariance.
    """
    cov = m.covariance.copy()
    if dims:
        cov[dims, :] = 0.0
        cov[:, dims] = 0.0
    return isoscore_from_covariance(cov)


def clipping_row(m: LayerMoments, dims: list[int]) -> dict[str, float | str | int]:
    """Per-layer metrics with ``dims`` clipped (zeroed), exact where the statistics allow.

    ``isoscore_clipped`` is always exact (from the covariance). The cosine metrics need the
    unit vectors of the clipped activations, so they are exact only when the statistics were
    folded with the same ``clip_dims`` (``--clip-dims``); otherwise they are left to the
    sampled estimates.
    """
    row: dict[str, float | str | int] = {
        "n_outlier_dims": len(dims),
        "outlier_dims": ",".join(str(d) for d in dims),
        "isoscore_clipped": clipped_isoscore(m, dims),
    }
    return row


def exact_clipped_cosines(m: LayerMoments) -> dict[str, float | str]:
    """Exact anisotropy, S_inter and S_intra of the activations with ``m.clip_dims`` zeroed
    (:func:`exact_clipped_cosines_from` a whole layer view)."""
    return exact_clipped_cosines_from(m, type_partials(m, m.mean, 1))


def exact_clipped_cosines_from(state: LayerMoments, types: TypePartials) -> dict[str, float | str]:
    """:func:`exact_clipped_cosines` from the layer's own state (its covariance) and the
    clipped :class:`~.partials.CosineSums` of all its types, merged over partitions. Empty
    unless the statistics track ``clip_dims``."""
    if types.clipped is None or state.clip_dims is None:
        return {}
    aniso, s_inter, s_intra = types.clipped.metrics()
    return {
        "clip_dims_exact": ",".join(str(d) for d in state.clip_dims),
        "anisotropy_clipped_exact": aniso,
        "s_inter_clipped_exact": s_inter,
        "s_intra_clipped_exact": s_intra,
        "isoscore_clipped_exact": clipped_isoscore(state, list(state.clip_dims)),
    }


def _sampled_cosines(x: np.ndarray, token_ids: np.ndarray) -> tuple[float, float, float]:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    unit = x / np.maximum(norms, np.finfo(np.float64).tiny)
    types, inverse = np.unique(token_ids, return_inverse=True)
    sums = group_sums(unit, inverse.reshape(-1), len(types))
    counts = np.bincount(inverse, minlength=len(types))
    aniso, s_inter, s_intra, _ = cosines_from_unit_sums(counts, sums)
    return aniso, s_inter, s_intra


def sampled_clipped_cosines(
    vectors: np.ndarray, token_ids: np.ndarray, dims: list[int]
) -> dict[str, float]:
    """Anisotropy, S_inter, S_intra of the uniform sample with ``dims`` zeroed, and without.

    The sampled estimates of :func:`exact_clipped_cosines` (same formulas, over the sample's
    occurrences; available on every run, whatever dimensions the run flags):
    ``anisotropy_clipped``, ``s_inter_clipped``, ``s_intra_clipped`` with ``dims`` zeroed (Luo
    2020), and their like-for-like counterparts ``anisotropy_sampled``, ``s_inter_sampled``,
    ``s_intra_sampled``: the same formulas over the same occurrences, unclipped. Compare
    clipped with these, not with the exact (all-token) metrics: sampled S_intra covers only
    the types with ≥ 2 sampled occurrences and differs from the exact one even unclipped. With
    no dimension to clip, the two sets are equal. Every occurrence counts, exact duplicates
    included (as in the exact metrics these estimate). Empty for fewer than 2 occurrences.
    """
    x = np.array(vectors, dtype=np.float64)
    if len(x) < 2:
        return {}
    token_ids = np.asarray(token_ids)
    aniso, s_inter, s_intra = _sampled_cosines(x, token_ids)
    if len(dims):
        x[:, dims] = 0.0
        clipped = _sampled_cosines(x, token_ids)
    else:
        clipped = (aniso, s_inter, s_intra)
    return {
        "anisotropy_clipped": clipped[0],
        "s_inter_clipped": clipped[1],
        "s_intra_clipped": clipped[2],
        "anisotropy_sampled": aniso,
        "s_inter_sampled": s_inter,
        "s_intra_sampled": s_intra,
    }
