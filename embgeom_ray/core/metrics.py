"""Exact corpus-scale metrics: pure functions of :class:`~embgeom_ray.core.layer_moments.LayerMoments`.

Notation (``docs/design.md``, Formulas): a layer's counted tokens x_1..x_N fall into token types
t with n_t occurrences, mean μ_t and M2_t = Σ ||x − μ_t||²; μ is the layer mean, C the
co-moment matrix, U_t = Σ x/||x|| over type t and U = Σ_t U_t.

Nothing here samples: every number is exact over all counted tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from . import metric_registry as registry
from .layer_moments import LayerMoments
from .options import TableOptions
from .partials import (
    CosineSums,
    TypePartials,
    self_similarities,
    type_partials,
    type_variances,
)

if TYPE_CHECKING:  # the tables read moments only: no torch (core/layer_moments.py)
    from .statistics import EmbeddingStatistics

#: the columns of ``type_stats.parquet``, of ``layers.parquet``'s exact section, and the
#: moments of ``dims.parquet``: declared in :mod:`~embgeom_ray.core.metric_registry`
TYPE_COLUMNS = registry.columns(registry.TYPE_STATS)
LAYER_COLUMNS = registry.columns(registry.LAYERS, registry.EXACT_SECTION)
DIM_COLUMNS = registry.columns(registry.DIMS, registry.MOMENTS)

#: default minimum count of a type in norm_variance_corr (:class:`~.options.TableOptions`)
MIN_COUNT: int = TableOptions().min_count


def self_similarity(m: LayerMoments, unit_sums: np.ndarray | None = None) -> np.ndarray:
    """Mean cosine over all ordered pairs i ≠ j of a type's occurrences (Ethayarajh 2019).

    SelfSim_t = (||U_t||² − n_t) / (n_t (n_t − 1)), exact over all pairs (not a 1000-pair
    sample); NaN when n_t < 2. ``unit_sums`` replaces U_t (e.g. the sums of clipped vectors).
    """
    return self_similarities(m.counts, m.unit_sums if unit_sums is None else unit_sums)


def variance_decomposition(m: LayerMoments) -> tuple[float, float, float]:
    """(V, V_W, V_B): total, within-type and between-type variance (Yamagiwa et al. 2024).

    V = trace(C)/N, V_W = Σ (n_t/N) V_t = Σ M2_t / N, V_B = Σ (n_t/N) ||μ_t − μ||²;
    V = V_W + V_B (law of total variance) up to float64 rounding. The type sums are
    :func:`~.partials.type_partials`' (one partition: all of ``m``'s types).
    """
    return _variances(m, type_partials(m, m.mean, MIN_COUNT))


def _variances(state: LayerMoments, p: TypePartials) -> tuple[float, float, float]:
    if state.n == 0:
        return float("nan"), float("nan"), float("nan")
    return float(np.trace(state.comoment)) / state.n, p.m2 / state.n, p.between / state.n


def norm_variance_corr(m: LayerMoments, min_count: int = MIN_COUNT) -> float:
    """Pearson r between ||μ_t|| and V_t over types with n_t ≥ min_count (Yamagiwa et al. 2024).

    NaN when fewer than 3 types qualify or either quantity is constant
    (:class:`~.partials.PairMoments`).
    """
    return type_partials(m, m.mean, min_count).norm_variance.correlation()


def cosines_from_unit_sums(
    counts: np.ndarray, unit_sums: np.ndarray
) -> tuple[float, float, float, np.ndarray]:
    """(anisotropy, S_inter, S_intra, SelfSim_t) from per-type counts n_t and unit sums U_t.

    With U = Σ_t U_t and N = Σ_t n_t (Ethayarajh 2019; Cai et al. 2021):
    anisotropy = (||U||² − N) / (N(N − 1)), the mean cosine over all ordered token pairs;
    S_inter = (||U||² − Σ_t ||U_t||²) / (N² − Σ_t n_t²), over pairs of different types;
    SelfSim_t = (||U_t||² − n_t) / (n_t (n_t − 1)), NaN when n_t < 2
    (both :func:`~.partials.mean_cosine_from_unit_sum`);
    S_intra = unweighted mean of SelfSim_t over types with n_t ≥ 2. The sums are
    :class:`~.partials.CosineSums`, which also add across partitions of the types.
    """
    aniso, s_inter, s_intra = CosineSums.of(counts, unit_sums).metrics()
    return aniso, s_inter, s_intra, self_similarities(counts, unit_sums)


def cosine_metrics(
    m: LayerMoments, unit_sums: np.ndarray | None = None
) -> tuple[float, float, float]:
    """(anisotropy, S_inter, S_intra) of a layer, exact over all tokens.

    See :func:`cosines_from_unit_sums`. S_inter here is over all pairs of different types;
    Cai's S_inter (one random occurrence per type) is the sampled ``s_inter_type_uniform``.
    ``unit_sums`` replaces the U_t (e.g. sums of clipped unit vectors, :mod:`.rogue`).
    """
    return CosineSums.of(m.counts, m.unit_sums if unit_sums is None else unit_sums).metrics()


def isoscore_from_covariance(cov: np.ndarray) -> float:
    """IsoScore (Rudman et al. 2022) of a covariance (or co-moment, or Gram) matrix C:
    (PR − 1)/(n − 1) with PR its :func:`participation_ratio` and n = dim, without an
    eigendecomposition.

    Rudman et al. define it from the eigenvalues λ ≥ 0: λ̂ = √n λ / ||λ||, δ = ||λ̂ − 1|| /
    √(2(n − √n)), k = (n − δ²(n − √n))² / n, IsoScore = (k − 1)/(n − 1). Since
    ||λ̂ − 1||² = 2n − 2√n Σλ/||λ||, n − δ²(n − √n) = √(n · PR) with PR = (Σλ)²/Σλ², so k = PR:
    the "number of dimensions used uniformly" is the participation ratio.

    PR − 1 = ((Σλ)² − Σλ²)/Σλ² = Σ_{i≠j} (C_ii C_jj − C_ij²) / ||C||_F²: the sum of C's
    2 × 2 principal minors (2 e₂(λ)), each ≥ 0 and computed without the cancellation of
    tr(C)² − ||C||_F², which loses ~λ_max / Σ_{others} λ of relative precision. A massive
    activation makes that ratio ~1e9 (``tests/core/test_statistics.py``): there the minors
    give the IsoScore of the given matrix to 1 ulp, tr² − F² to 5e-7 and the eigenvalues
    (LAPACK's, absolute errors ~ε λ_max each) to 7e-6. O(n²), in blocks of rows (no n × n
    temporary). Invariant to scale and to the basis (e₂ is a coefficient of the
    characteristic polynomial), so the m × m Gram matrix of m < n centred points gives
    their covariance's value (:func:`~.sampled_metrics.isoscore_points`). NaN for a zero
    matrix or n < 2.
    """
    c = np.asarray(cov, dtype=np.float64)
    n = c.shape[0]
    if n < 2:
        return float("nan")
    diag = np.diagonal(c)
    block = max(1, (1 << 20) // n)
    frob = minors = 0.0
    for a in range(0, n, block):
        rows = 0.5 * (c[a : a + block] + c[:, a : a + block].T)  # (C + Cᵀ)/2
        sq = rows * rows
        frob += float(sq.sum())
        minors += float((diag[a : a + block, None] * diag[None, :] - sq).sum())
    if not frob > 0:
        return float("nan")
    return minors / frob / (n - 1)


def participation_ratio(comoment: np.ndarray) -> float:
    """Participation ratio of a covariance spectrum (Gao et al. 2017): PR = (Σλ)² / Σλ².

    With λ the eigenvalues of the symmetric C, Σλ = tr(C) and Σλ² = ‖C‖_F², so
    PR = tr(C)² / ‖C‖_F², no eigendecomposition (O(d²)). Scale invariant: ``comoment`` may be
    the co-moment Σ (x − μ)(x − μ)ᵀ or the covariance; it is symmetrised, (C + Cᵀ)/2, as for
    IsoScore. Between 1 (all variance along one direction) and d (isotropic): the number of
    dimensions the variance spreads over. NaN for a zero matrix.
    """
    c = np.asarray(comoment, dtype=np.float64)
    sq = 0.5 * (float(np.einsum("ij,ij->", c, c)) + float(np.einsum("ij,ji->", c, c)))
    if not sq > 0:
        return float("nan")
    return float(np.trace(c)) ** 2 / sq


def layer_row(m: LayerMoments, min_count: int = MIN_COUNT) -> dict[str, float | int]:
    """One row of ``layers.parquet`` (the exact, moment-based columns) of a whole layer view:
    :func:`layer_row_from` with ``m``'s own :func:`~.partials.type_partials`."""
    return layer_row_from(m, type_partials(m, m.mean, min_count))


def layer_row_from(state: LayerMoments, types: TypePartials) -> dict[str, float | int]:
    """One row of ``layers.parquet`` from the layer's own state (``state``: n, μ, C; its
    per-type rows are not read) and the :class:`~.partials.TypePartials` of all its types,
    merged over partitions (:func:`~.partials.merge_partials`). Its keys are
    :data:`LAYER_COLUMNS` (the registry's exact section), in that order."""
    total, within, between = _variances(state, types)
    aniso, s_inter, s_intra = types.cosines.metrics()
    return {
        "layer": state.layer,
        "n_tokens": int(state.n),
        "n_types": types.types,
        "mean_norm": float(np.linalg.norm(state.mean)),
        "total_variance": total,
        "within_variance": within,
        "between_variance": between,
        "within_ratio": within / total if total > 0 else float("nan"),
        "norm_variance_corr": types.norm_variance.correlation(),
        "isoscore": isoscore_from_covariance(state.covariance) if state.n >= 2 else float("nan"),
        "anisotropy": aniso,
        "s_inter": s_inter,
        "s_intra": s_intra,
        "participation_ratio": (
            participation_ratio(state.comoment) if state.n >= 2 else float("nan")
        ),
    }


def type_stats_rows(m: LayerMoments) -> pd.DataFrame:
    """One layer's rows of ``type_stats.parquet``: :data:`TYPE_COLUMNS` but ``token``.

    mean_norm = ||μ_t||, sq_norm_mean Q_t = mean ||x||² = ||μ_t||² + V_t (Yamagiwa et al.
    2024: Q_t = M_t + V_t), variance V_t (:func:`type_variances`), self_similarity as
    :func:`self_similarity`; rows in token-id order.
    """
    var = type_variances(m)
    mean_sq = np.einsum("td,td->t", m.means, m.means)
    return pd.DataFrame(
        {
            "layer": np.full(m.type_ids.shape, m.layer, dtype=np.int64),
            "token_id": m.type_ids.astype(np.int64),
            "count": m.counts.astype(np.int64),
            "mean_norm": np.sqrt(mean_sq),
            "sq_norm_mean": mean_sq + var,
            "variance": var,
            "self_similarity": self_similarity(m),
        }
    )


def with_token_names(
    rows: pd.DataFrame, id_to_token: Callable[[Sequence[int]], Sequence[str]] | None
) -> pd.DataFrame:
    """``type_stats.parquet`` from :func:`type_stats_rows` (of any layers, concatenated).

    Adds the ``token`` column to ``rows`` (in place), ``id_to_token`` (e.g. a tokenizer's
    ``convert_ids_to_tokens``) called once on the distinct ids (None: the column is left
    empty), and returns the columns in :data:`TYPE_COLUMNS` order.
    """
    if id_to_token is not None and len(rows):
        ids = np.unique(rows["token_id"].to_numpy())
        names = dict(zip(ids.tolist(), id_to_token(ids.tolist()), strict=True))
        rows["token"] = rows["token_id"].map(names).astype("string")
    else:
        rows["token"] = pd.Series([None] * len(rows), dtype="string")
    return rows[TYPE_COLUMNS]


def dim_variances(m: LayerMoments) -> np.ndarray:
    """Var_d = C_dd / N, each dimension's population variance over all counted tokens.

    Clipped at 0 (float64 rounding of the co-moment's diagonal may leave −1e-17).
    """
    return np.clip(np.diag(m.comoment) / max(m.n, 1), 0.0, None)


def dim_moment_rows(m: LayerMoments) -> pd.DataFrame:
    """One layer's per-dimension mean μ_d and population std √Var_d (:data:`DIM_COLUMNS`).

    The moment columns of ``dims.parquet``, whose rows :func:`embgeom_ray.core.rogue.dims_rows`
    builds (these and the outlier flags).
    """
    return pd.DataFrame(
        {
            "layer": np.full(m.dim, m.layer, dtype=np.int64),
            "dim": np.arange(m.dim, dtype=np.int64),
            "mean": m.mean,
            "std": np.sqrt(dim_variances(m)),
        }
    )


# Whole-table conveniences over a statistics object, one table each. The job builds every
# table at once with :func:`embgeom_ray.core.tables.build_tables`, which reads each layer's
# view (:meth:`EmbeddingStatistics.layer`, an argsort and a copy) once for all of them.


def layers_table(stats: EmbeddingStatistics, min_count: int = MIN_COUNT) -> pd.DataFrame:
    """The exact columns of ``layers.parquet`` (:data:`LAYER_COLUMNS`), one row per layer."""
    rows = [layer_row(stats.layer(layer), min_count) for layer in stats.layers]
    return pd.DataFrame(rows, columns=LAYER_COLUMNS)


def type_stats_table(
    stats: EmbeddingStatistics,
    id_to_token: Callable[[Sequence[int]], Sequence[str]] | None = None,
) -> pd.DataFrame:
    """``type_stats.parquet``: :func:`type_stats_rows` of every layer, :func:`with_token_names`."""
    rows = [type_stats_rows(stats.layer(layer)) for layer in stats.layers]
    return with_token_names(pd.concat(rows, ignore_index=True), id_to_token)


def dims_table(stats: EmbeddingStatistics) -> pd.DataFrame:
    """Per (layer, dim) mean and population std: :func:`dim_moment_rows` of every layer."""
    frames = [dim_moment_rows(stats.layer(layer)) for layer in stats.layers]
    return pd.concat(frames, ignore_index=True)
