"""Every column of the per-layer, per-type, per-dimension, per-position and K-means tables,
declared once: :data:`METRICS`.

A :class:`Metric` says which table and section the column belongs to, whether it is exact
(over every counted token) or sampled, whether it has a half-sample standard error (column
``<column>_se``), the function that computes it (``source``, a dotted name), its unit and
display format, its header and tooltip in the report, whether ``jobs.compare`` ranks its
changes and draws it, whether that comparison depends on the chosen K-means k, its one-line
definition and its paper. Everything else reads these declarations:

- the tables' column lists: ``core.metrics.LAYER_COLUMNS``, ``TYPE_COLUMNS`` and
  ``DIM_COLUMNS``, ``core.rogue.FLAG_COLUMNS``, ``core.sampled_metrics.SAMPLED_LAYER_COLUMNS``
  and ``SE_METRICS``, ``core.tables.KMEANS_COLUMNS`` (:func:`columns`);
- the report's per-layer tables (``report.html.COLUMNS``, ``EXACT_COLUMNS``, ``SAMPLED_COLUMNS``:
  :func:`report_columns`);
- the comparison's figure and ranking (``report.figures.compare.COMPARE_METRICS``,
  ``runs.compare.NOT_RANKED``, ``SAMPLED``, ``CLUSTER_ADJUSTED``, ``BEST_K_DEPENDENT``);
- the summary a run prints (``run_dir.format_summary``: :func:`summary_columns`);
- docs/outputs.md's column tables, checked against it by tests/core/test_metric_registry.py.

Adding an exact metric from the layer's moments: its formula in :mod:`~embgeom_ray.core.metrics`
(and its entry in :func:`~embgeom_ray.core.metrics.layer_row_from`), one :class:`Metric`
here, its row in docs/outputs.md, and its test. This module imports nothing of the package,
so every module may read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: the tables (``<table>.parquet`` of a run directory)
LAYERS, TYPE_STATS, DIMS, POSITIONS, KMEANS = "layers", "type_stats", "dims", "positions", "kmeans"
#: the sections of ``layers.parquet`` (docs/outputs.md: one column table each)
EXACT_SECTION, CLIPPING_SECTION, SAMPLED_SECTION = "exact", "clipping", "sampled"
#: the sections of ``dims.parquet``: the moments (``core.metrics``), the rogue-dimension flags
MOMENTS, FLAGS = "moments", "flags"

Kind = Literal["exact", "sampled"]
#: display formats of the report (``report.html.format_column``): int (thousands separators),
#: sci (4 significant digits), unit (3 decimals, values in [−1, 1] or [0, 1]), corr (signed, 2
#: decimals), text (as is), bool
Format = Literal["int", "sci", "unit", "corr", "text", "bool"]

_M = "embgeom_ray.core.metrics"
_R = "embgeom_ray.core.rogue"
_S = "embgeom_ray.core.sampled_metrics"
_K = "embgeom_ray.core.kmeans_selection"
_T = "embgeom_ray.core.tables"


@dataclass(frozen=True)
class Metric:
    """One column of a table, declared once (see the module docstring for what reads it)."""

    column: str
    table: str  # LAYERS, TYPE_STATS, DIMS, POSITIONS or KMEANS
    kind: Kind  # exact: over every counted token; sampled: on the run's bounded sample
    definition: str  # one line: what the number is
    source: str  # the dotted name of the function that computes it
    section: str = ""  # of LAYERS: EXACT_SECTION, CLIPPING_SECTION or SAMPLED_SECTION
    unit: str = ""  # "" for a dimensionless number
    fmt: Format = "sci"
    header: str = ""  # the report's column header; "" for a column the report's tables leave out
    tooltip: str = ""  # the report's header tooltip
    paper: str = ""
    se: bool = False  # has a half-sample standard error, column ``<column>_se``
    ranked: bool = True  # jobs.compare ranks its changes (False: counts, choices, keys)
    plotted: bool = False  # drawn in the comparison's figure (``compare_metrics.png``)
    #: jobs.compare compares it only between runs that chose the same ``kmeans_k`` (and
    #: ``kmeans_k_at_cap``), or the same ``kmeans_best_k``, or zeroed the same dimensions (the
    #: layer's flagged ``outlier_dims``, or the ``--clip-dims`` in ``clip_dims_exact``); ""
    #: when it depends on none of these
    depends_on: Literal["", "kmeans_k", "kmeans_best_k", "outlier_dims", "clip_dims_exact"] = ""
    summary: bool = False  # in the per-layer summary a run prints (``run_dir.format_summary``)

    @property
    def se_column(self) -> str | None:
        """``<column>_se``, or None without a standard error."""
        return f"{self.column}_se" if self.se else None


def _layer(column: str, section: str, kind: Kind, definition: str, source: str, **kw) -> Metric:
    return Metric(column, LAYERS, kind, definition, source, section=section, **kw)


def _exact(column: str, definition: str, source: str, **kw) -> Metric:
    return _layer(column, EXACT_SECTION, "exact", definition, source, **kw)


def _sampled(column: str, definition: str, source: str = f"{_S}.sampled_metrics_of_points",
             **kw) -> Metric:  # fmt: skip
    return _layer(column, SAMPLED_SECTION, "sampled", definition, source, **kw)


def _clip(column: str, kind: Kind, definition: str, source: str, **kw) -> Metric:
    return _layer(column, CLIPPING_SECTION, kind, definition, source, **kw)


def _dim(column: str, section: str, definition: str, source: str, **kw) -> Metric:
    return Metric(column, DIMS, "exact", definition, source, section=section, **kw)


_ROW = f"{_M}.layer_row_from"
_FLAG = f"{_R}.dimension_flags"
_VAR = f"{_M}.variance_decomposition"
_COS = f"{_M}.cosine_metrics"
_KM = f"{_K}.select_k"
_ADJ = f"{_S}.cluster_adjusted"
_LID = f"{_S}.lid_mle"
_CLIP_EXACT = f"{_R}.exact_clipped_cosines_from"
_CLIP_SAMPLED = f"{_R}.sampled_clipped_cosines"
_YAMAGIWA, _ETH, _CAI = "Yamagiwa et al. 2024", "Ethayarajh 2019", "Cai et al. 2021"
_RUDMAN, _LUO, _MICKUS = "Rudman et al. 2022", "Luo 2020", "Mickus et al. 2024"
_LB, _MU = "Levina & Bickel 2004", "Mu & Viswanath 2018"
_SQ, _DIMS = "squared norm", "dimensions"
_W = "size-weighted over clusters of at least --cluster-min-size points"

# fmt: off
#: every column, in each table's column order
METRICS: tuple[Metric, ...] = (
    # ----------------------------------------------------------------- layers.parquet, exact
    _exact("layer", "HF layer index (hidden_states[layer]; 0 = embedding output)", _ROW,
           fmt="int", header="layer", tooltip="hidden_states index; 0 = embedding output",
           ranked=False, summary=True),
    _exact("n_tokens", "tokens counted N", _ROW, unit="tokens", fmt="int", header="tokens",
           tooltip="tokens counted N", ranked=False, summary=True),
    _exact("n_types", "distinct token types counted", _ROW, unit="types", fmt="int",
           header="types", tooltip="distinct token types", ranked=False, summary=True),
    _exact("mean_norm", "‖μ‖, norm of the layer's overall mean", _ROW, unit="norm",
           header="‖μ‖", tooltip="norm of the layer's mean vector", plotted=True, summary=True),
    _exact("total_variance", "V = mean ‖x − μ‖²", _VAR, unit=_SQ, header="V",
           tooltip="total variance, mean ‖x − μ‖²", paper=_YAMAGIWA, plotted=True, summary=True),
    _exact("within_variance", "V_W = Σ (n_t/N) V_t", _VAR, unit=_SQ, header="V_W",
           tooltip="within-type variance Σ (n_t/N) V_t", paper=_YAMAGIWA, plotted=True),
    _exact("between_variance", "V_B = Σ (n_t/N) ‖μ_t − μ‖²; V = V_W + V_B", _VAR, unit=_SQ,
           header="V_B", tooltip="between-type variance Σ (n_t/N) ‖μ_t − μ‖²", paper=_YAMAGIWA,
           plotted=True),
    _exact("within_ratio", "V_W / V", _VAR, fmt="unit", header="V_W/V",
           tooltip="share of the variance within types", paper=_YAMAGIWA, plotted=True,
           summary=True),
    _exact("norm_variance_corr", "Pearson r of ‖μ_t‖ and V_t over types with n_t ≥ --min-count",
           f"{_M}.norm_variance_corr", fmt="corr", header="r(‖μ_t‖,V_t)",
           tooltip="Pearson r over types with n_t ≥ min_count", paper=_YAMAGIWA, plotted=True,
           summary=True),
    _exact("isoscore", "IsoScore of the layer's covariance, over all tokens",
           f"{_M}.isoscore_from_covariance", fmt="unit", header="IsoScore",
           tooltip="IsoScore of the layer covariance (Rudman et al. 2022)", paper=_RUDMAN,
           plotted=True, summary=True),
    _exact("anisotropy", "mean cosine over all pairs of two distinct occurrences (i ≠ j): "
           "(‖U‖² − N) / (N(N − 1)) for the sum U of the N unit vectors", _COS, fmt="unit",
           header="aniso.", tooltip="mean cosine over all pairs of distinct tokens", paper=_ETH,
           plotted=True, summary=True),
    _exact("s_inter", "mean cosine over pairs of tokens of different types", _COS, fmt="unit",
           header="S_inter", tooltip="mean cosine over pairs of different types", paper=_CAI,
           plotted=True, summary=True),
    _exact("s_intra", "unweighted mean of self_similarity over types with n_t ≥ 2", _COS,
           fmt="unit", header="S_intra",
           tooltip="mean self-similarity over types (Ethayarajh 2019)", paper=_ETH, plotted=True,
           summary=True),
    _exact("participation_ratio",
           "(Σλ)² / Σλ² = tr(C)² / ‖C‖_F² of the layer's covariance: how many dimensions the "
           "variance spreads over (1 to d)", f"{_M}.participation_ratio", unit=_DIMS,
           header="PR", tooltip="participation ratio (Σλ)²/Σλ² of the covariance spectrum: "
           "dimensions the variance spreads over (1 to d)", paper="Gao et al. 2017",
           plotted=True),
    # ------------------------------------------------------ layers.parquet, clipping (exact)
    _clip("n_outlier_dims", "exact", "how many dimensions the layer flags", f"{_R}.clipping_row",
          unit=_DIMS, fmt="int", header="flagged dims",
          tooltip="dimensions flagged as outliers in the layer", paper=_LUO, plotted=True,
          ranked=False),  # a count of thresholded flags: compare lists the flags that moved
    _clip("outlier_dims", "exact", "the flagged dimensions, comma-separated",
          f"{_R}.clipping_row", fmt="text", header="which", tooltip="the flagged dimensions",
          ranked=False),
    _clip("isoscore_clipped", "exact", "IsoScore with the flagged dimensions zeroed",
          f"{_R}.clipped_isoscore", fmt="unit", header="IsoScore clipped (exact)",
          tooltip="IsoScore, flagged dims zeroed; exact over every token", paper=_LUO,
          plotted=True, depends_on="outlier_dims"),
    _clip("clip_dims_exact", "exact", "the dimensions --clip-dims zeroed", _CLIP_EXACT,
          fmt="text", header="--clip-dims",
          tooltip="dimensions zeroed for the exact clipped metrics", ranked=False),
    _clip("anisotropy_clipped_exact", "exact", "anisotropy with --clip-dims zeroed", _CLIP_EXACT,
          fmt="unit", header="aniso. clip (exact)", tooltip="--clip-dims zeroed, exact",
          paper=_LUO, plotted=True, depends_on="clip_dims_exact"),
    _clip("s_inter_clipped_exact", "exact", "S_inter with --clip-dims zeroed", _CLIP_EXACT,
          fmt="unit", header="S_inter clip (exact)", tooltip="--clip-dims zeroed, exact",
          paper=_LUO, depends_on="clip_dims_exact"),
    _clip("s_intra_clipped_exact", "exact", "S_intra with --clip-dims zeroed", _CLIP_EXACT,
          fmt="unit", header="S_intra clip (exact)", tooltip="--clip-dims zeroed, exact",
          paper=_LUO, depends_on="clip_dims_exact"),
    _clip("isoscore_clipped_exact", "exact", "IsoScore with --clip-dims zeroed", _CLIP_EXACT,
          fmt="unit", header="IsoScore clip (exact)", tooltip="--clip-dims zeroed, exact",
          paper=_LUO, depends_on="clip_dims_exact"),
    # ------------------------------------------------------------- layers.parquet, sampled
    _sampled("kmeans_k", "K-means clusters chosen: the k of best silhouette, 1 below "
             "--kmeans-min-silhouette", _KM, unit="clusters", fmt="int", header="k",
             tooltip="K-means clusters chosen on the sample (Cai et al. 2021)", paper=_CAI,
             ranked=False, plotted=True),
    _sampled("kmeans_silhouette", "the best silhouette of the K-means scan", _KM, fmt="unit",
             header="silh. (k-m)", tooltip="silhouette of the K-means clustering", paper=_CAI,
             se=True, plotted=True),
    _sampled("adjusted_s_inter", "S_inter (one occurrence per type) inside each cluster, "
             "unweighted mean over clusters", _ADJ, fmt="unit", header="S_inter adj.",
             tooltip="S_inter inside clusters (Cai et al. 2021)", paper=_CAI, se=True,
             plotted=True, depends_on="kmeans_k"),
    _sampled("adjusted_s_intra", "S_intra inside each cluster, unweighted mean over clusters",
             _ADJ, fmt="unit", header="S_intra adj.",
             tooltip="S_intra inside clusters (Cai et al. 2021)", paper=_CAI, se=True,
             plotted=True, depends_on="kmeans_k"),
    _sampled("adjusted_isoscore", "IsoScore inside each cluster, unweighted mean over clusters",
             _ADJ, fmt="unit", header="IsoScore adj.", tooltip="IsoScore inside clusters",
             paper=_CAI, se=True, plotted=True, depends_on="kmeans_k"),
    _sampled("s_inter_type_uniform", "mean cosine between one random occurrence of each type",
             f"{_S}.mean_pairwise_cosine", fmt="unit", header="S_inter (Cai)",
             tooltip="one random occurrence per type", paper=_CAI, se=True, plotted=True),
    _sampled("isoscore_sample", "IsoScore of the uniform sample", f"{_S}.isoscore_points",
             fmt="unit", header="IsoScore (sample)", tooltip="IsoScore of the uniform sample",
             paper=_RUDMAN, se=True, plotted=True),
    _sampled("lid_euclidean", "Levina–Bickel LID, mean over points, true Euclidean distances",
             _LID, unit=_DIMS, header="LID eucl.",
             tooltip="Levina–Bickel LID, true Euclidean distances", paper=_LB, se=True,
             plotted=True),
    _sampled("lid_cosine", "Levina–Bickel LID, mean over points, chord distances "
             "√(2 − 2 cos)", _LID, unit=_DIMS, header="LID cos.",
             tooltip="Levina–Bickel LID, cosine distances", paper=_LB, se=True, plotted=True),
    _sampled("silhouette_types", "silhouette with token types as labels",
             f"{_S}.silhouette_by_labels", fmt="unit", header="silh. (types)",
             tooltip="silhouette with token types as labels", paper=_MICKUS, se=True,
             plotted=True),
    _sampled("partition_isotropy", "Mu & Viswanath's I(W) of the sample",
             f"{_S}.partition_isotropy", header="I(W)",
             tooltip="partition isotropy (Mu & Viswanath 2018)", paper=_MU, plotted=True),
    _sampled("partition_isotropy_centered", "I(W) of the mean-centred sample",
             f"{_S}.partition_isotropy", header="I(W) centred",
             tooltip="partition isotropy, centred", paper=_MU, plotted=True),
    _sampled("kmeans_best_k", "the k of the best silhouette (also when k = 1 is chosen)", _KM,
             unit="clusters", fmt="int", header="best k",
             tooltip="k of the best silhouette (kept even when k = 1 is chosen)", paper=_CAI,
             ranked=False),
    _sampled("kmeans_k_searched", "the largest k fitted by the scan", _KM, unit="clusters",
             fmt="int", header="k scanned to",
             tooltip="largest k fitted: every k to 15, then a 10% grid to it", ranked=False),
    _sampled("kmeans_k_at_cap", "whether the best k is the largest k fitted", _KM, fmt="bool",
             ranked=False),
    _sampled("kmeans_stability", "mean adjusted Rand index of refits from other seedings", _KM,
             fmt="unit", header="k-m stability",
             tooltip="adjusted Rand index of refits from other seedings",
             depends_on="kmeans_best_k"),
    _sampled("kmeans_k_support", "share of 200 bootstrap resamples that take the reported k",
             f"{_K}.decision_support", fmt="unit", header="k support",
             tooltip="share of bootstrap resamples of the sample that take the reported k "
             "(below 0.9: not robust)", ranked=False),
    _sampled("kmeans_structure_support", "share of 200 bootstrap resamples that take the "
             "reported k = 1 vs k ≥ 2 decision", f"{_K}.decision_support", fmt="unit",
             header="k=1/k≥2 support", tooltip="share of bootstrap resamples that make the "
             "same k = 1 vs k ≥ 2 decision", ranked=False),
    _sampled("sample_duplicate_points", "sampled occurrences that repeat another's point",
             f"{_S}.sampled_metrics_of_points", unit="points", fmt="int",
             header="dup. points", tooltip="sampled occurrences whose model input repeats "
             "another's (counted once in K-means, silhouettes, LID)", ranked=False),
    _sampled("adjusted_s_inter_weighted", f"adjusted_s_inter {_W}", _ADJ, fmt="unit",
             header="S_inter adj. (w)", tooltip=_W, paper=_CAI, se=True,
             depends_on="kmeans_k"),
    _sampled("adjusted_s_intra_weighted", f"adjusted_s_intra {_W}", _ADJ, fmt="unit",
             header="S_intra adj. (w)", tooltip=_W, paper=_CAI, se=True,
             depends_on="kmeans_k"),
    _sampled("adjusted_isoscore_weighted", f"adjusted_isoscore {_W}", _ADJ, fmt="unit",
             header="IsoScore adj. (w)", tooltip=_W, paper=_CAI, se=True,
             depends_on="kmeans_k"),
    _sampled("adjusted_clusters_used", "clusters of at least --cluster-min-size points", _ADJ,
             unit="clusters", fmt="int", header="clusters (w)", tooltip="clusters of at least "
             "--cluster-min-size points, used by the size-weighted columns", ranked=False,
             depends_on="kmeans_k"),
    _sampled("adjusted_clusters_left_out", "clusters smaller than --cluster-min-size", _ADJ,
             unit="clusters", fmt="int", header="clusters left out", tooltip="clusters smaller "
             "than --cluster-min-size, left out of the size-weighted columns", ranked=False,
             depends_on="kmeans_k"),
    _sampled("adjusted_s_inter_draws_mean", "Cai's one-occurrence-per-type S_inter inside "
             "clusters: exact mean over every draw", _ADJ, fmt="unit",
             header="S_inter adj. (draws)",
             tooltip="Cai's one-occurrence-per-type S_inter, exact mean over draws", paper=_CAI,
             depends_on="kmeans_k"),
    _sampled("adjusted_s_inter_draws_std", "the spread of one draw of adjusted_s_inter over "
             "--s-inter-draws draws", _ADJ, header="spread of one draw",
             tooltip="standard deviation of Cai's S_inter adj. over --s-inter-draws random "
             "draws", paper=_CAI, depends_on="kmeans_k"),
    _sampled("lid_euclidean_median", "median of the per-point LID MLEs, Euclidean", _LID,
             unit=_DIMS, header="LID eucl. median",
             tooltip="median of the per-point MLEs (robust to the long right tail)", paper=_LB,
             se=True),
    _sampled("lid_cosine_median", "median of the per-point LID MLEs, chord distances", _LID,
             unit=_DIMS, header="LID cos. median",
             tooltip="median of the per-point MLEs, cosine distances", paper=_LB, se=True),
    _sampled("lid_euclidean_cai", "LID in Cai et al.'s convention: squared distances, divided "
             "by k", f"{_S}.lid_cai", unit=_DIMS, header="LID (Cai)",
             tooltip="Cai et al.'s convention: squared distances, divided by k", paper=_CAI),
    # ---------------------------------------------------- layers.parquet, clipping (sampled)
    _clip("anisotropy_clipped", "sampled", "anisotropy of the uniform sample, flagged "
          "dimensions zeroed", _CLIP_SAMPLED, fmt="unit", header="aniso. clipped (sampled)",
          tooltip="flagged dims zeroed; on the uniform sample", paper=_LUO, plotted=True,
          depends_on="outlier_dims"),
    _clip("s_inter_clipped", "sampled", "S_inter of the uniform sample, flagged dimensions "
          "zeroed", _CLIP_SAMPLED, fmt="unit", header="S_inter clipped (sampled)",
          tooltip="flagged dims zeroed; on the uniform sample", paper=_LUO,
          depends_on="outlier_dims"),
    _clip("s_intra_clipped", "sampled", "S_intra of the uniform sample, flagged dimensions "
          "zeroed", _CLIP_SAMPLED, fmt="unit", header="S_intra clipped (sampled)",
          tooltip="flagged dims zeroed; on the uniform sample", paper=_LUO,
          depends_on="outlier_dims"),
    _clip("anisotropy_sampled", "sampled", "anisotropy of the uniform sample, unclipped",
          _CLIP_SAMPLED, fmt="unit", header="aniso. (sampled)", tooltip="anisotropy on the "
          "uniform sample, unclipped: the like-for-like baseline of the sampled clipped value"),
    _clip("s_inter_sampled", "sampled", "S_inter of the uniform sample, unclipped",
          _CLIP_SAMPLED, fmt="unit", header="S_inter (sampled)",
          tooltip="S_inter on the uniform sample, unclipped"),
    _clip("s_intra_sampled", "sampled", "S_intra of the uniform sample, unclipped",
          _CLIP_SAMPLED, fmt="unit", header="S_intra (sampled)", tooltip="S_intra on the "
          "uniform sample, unclipped (types with ≥ 2 sampled occurrences)"),
    # ------------------------------------------------------------------- type_stats.parquet
    Metric("layer", TYPE_STATS, "exact", "HF layer index", f"{_M}.type_stats_rows", fmt="int"),
    Metric("token_id", TYPE_STATS, "exact", "token id", f"{_M}.type_stats_rows", fmt="int"),
    Metric("token", TYPE_STATS, "exact", "the token's string in the tokenizer's vocabulary",
           f"{_M}.with_token_names", fmt="text"),
    Metric("count", TYPE_STATS, "exact", "n_t, occurrences counted", f"{_M}.type_stats_rows",
           unit="tokens", fmt="int"),
    Metric("mean_norm", TYPE_STATS, "exact", "‖μ_t‖, norm of the type's mean embedding",
           f"{_M}.type_stats_rows", unit="norm", paper=_YAMAGIWA),
    Metric("sq_norm_mean", TYPE_STATS, "exact", "Q_t = mean ‖x‖² = ‖μ_t‖² + V_t",
           f"{_M}.type_stats_rows", unit=_SQ, paper=_YAMAGIWA),
    Metric("variance", TYPE_STATS, "exact", "V_t = mean ‖x − μ_t‖²",
           f"{_M}.type_variances", unit=_SQ, paper=_YAMAGIWA),
    Metric("self_similarity", TYPE_STATS, "exact", "mean cosine over all pairs of two distinct "
           "occurrences of the type (i ≠ j): (‖U_t‖² − n_t) / (n_t(n_t − 1))",
           f"{_M}.self_similarity", fmt="unit", paper=_ETH),
    # ------------------------------------------------------------------------- dims.parquet
    _dim("layer", MOMENTS, "HF layer index", f"{_M}.dim_moment_rows", fmt="int"),
    _dim("dim", MOMENTS, "dimension", f"{_M}.dim_moment_rows", fmt="int"),
    _dim("mean", MOMENTS, "the dimension's mean", f"{_M}.dim_moment_rows"),
    _dim("std", MOMENTS, "the dimension's population standard deviation",
         f"{_M}.dim_moment_rows"),
    _dim("variance_ratio", FLAGS, "Var_d / mean_j Var_j", _FLAG, paper=_LUO),
    _dim("mean_zscore", FLAGS, "(μ_d − mean_j μ_j) / std_j μ_j", _FLAG, paper=_LUO),
    _dim("argmax_share", FLAGS, "share of tokens whose largest coordinate is d", _FLAG,
         fmt="unit", paper=_LUO),
    _dim("argmin_share", FLAGS, "share of tokens whose smallest coordinate is d", _FLAG,
         fmt="unit", paper=_LUO),
    _dim("position_corr", FLAGS, "Pearson r of a token's position and its value on d", _FLAG,
         fmt="corr", paper="Luo, Kulmizev & Mao 2021"),
    _dim("outlier", FLAGS, "whether a rule flags the dimension", _FLAG, fmt="bool"),
    _dim("outlier_rule", FLAGS, "the names of the rules that fired", _FLAG, fmt="text"),
    # -------------------------------------------------------------------- positions.parquet
    Metric("layer", POSITIONS, "exact", "HF layer index", f"{_R}.positions_table_from",
           fmt="int"),
    Metric("position", POSITIONS, "exact", "position in the window, special tokens included",
           f"{_R}.positions_table_from", fmt="int"),
    Metric("count", POSITIONS, "exact", "tokens counted at that position",
           f"{_R}.positions_table_from", unit="tokens", fmt="int"),
    Metric("mean_norm", POSITIONS, "exact", "norm of the mean vector at that position",
           f"{_R}.positions_table_from", unit="norm"),
    Metric("dim_<d>", POSITIONS, "exact", "the mean value at that position of each dimension "
           "flagged in any layer", f"{_R}.position_columns",
           paper="Luo, Kulmizev & Mao 2021"),
    # ----------------------------------------------------------------------- kmeans.parquet
    Metric("layer", KMEANS, "sampled", "HF layer index", f"{_T}.kmeans_table", fmt="int"),
    Metric("k", KMEANS, "sampled", "number of clusters", f"{_T}.kmeans_table", fmt="int"),
    Metric("silhouette", KMEANS, "sampled", "the silhouette of that k's partition",
           f"{_K}.select_k", fmt="unit", paper=_CAI),
    Metric("inertia", KMEANS, "sampled", "Σ ‖x − c(x)‖² over the distinct points",
           f"{_K}.select_k", unit=_SQ),
    Metric("best", KMEANS, "sampled", "whether k is kmeans_best_k", f"{_T}.kmeans_table",
           fmt="bool"),
    Metric("chosen", KMEANS, "sampled", "whether k is the reported kmeans_k",
           f"{_T}.kmeans_table", fmt="bool"),
)
# fmt: on


def of_table(table: str, section: str | None = None) -> list[Metric]:
    """The metrics of ``table`` (and of ``section`` of ``layers``), in column order."""
    return [m for m in METRICS if m.table == table and section in (None, m.section)]


def columns(table: str, section: str | None = None, kind: Kind | None = None) -> list[str]:
    """The columns of ``table`` (of ``section``, of ``kind``), in order."""
    return [m.column for m in of_table(table, section) if kind in (None, m.kind)]


def metric(column: str, table: str = LAYERS) -> Metric:
    """The declaration of ``column`` of ``table``; KeyError when none is declared."""
    for m in METRICS:
        if m.column == column and m.table == table:
            return m
    raise KeyError(f"no metric {column!r} of {table}.parquet is declared")


#: the sampled metrics with a half-sample standard error (column ``<metric>_se``)
SE_METRICS: list[str] = [m.column for m in of_table(LAYERS) if m.se]
#: the ``_se`` columns, in the order of :data:`SE_METRICS`
SE_COLUMNS: list[str] = [f"{m}_se" for m in SE_METRICS]


def layer_columns() -> list[str]:
    """Every column ``layers.parquet`` may hold, in its order: exact, clipping (exact), sampled,
    their standard errors, clipping (sampled)."""
    return [
        *columns(LAYERS, EXACT_SECTION),
        *columns(LAYERS, CLIPPING_SECTION, "exact"),
        *columns(LAYERS, SAMPLED_SECTION),
        *SE_COLUMNS,
        *columns(LAYERS, CLIPPING_SECTION, "sampled"),
    ]


def kind_of(column: str) -> Kind | None:
    """``exact`` or ``sampled`` for a ``layers.parquet`` column (an ``_se`` column is sampled);
    None for a column not declared."""
    if column in SE_COLUMNS:
        return "sampled"
    try:
        return metric(column).kind
    except KeyError:
        return None


def report_columns() -> dict[str, tuple[str, str, str]]:
    """``layers.parquet`` columns the report shows: column -> (header, tooltip, format), the
    standard errors last."""
    out = {m.column: (m.header, m.tooltip, m.fmt) for m in of_table(LAYERS) if m.header}
    for m in SE_METRICS:
        out[f"{m}_se"] = (
            f"{out[m][0]} se",
            f"standard error of {m} from random half-samples of the sample (clusters held fixed)",
            "sci",
        )
    return out


def not_ranked() -> list[str]:
    """``layers.parquet`` columns ``jobs.compare`` keeps but does not rank: counts, the k chosen
    or searched, keys, and the standard errors themselves (the yardstick of the changes)."""
    return [m.column for m in of_table(LAYERS) if not m.ranked] + SE_COLUMNS


def plotted() -> list[str]:
    """The metrics the comparison's figure overlays, in order."""
    return [m.column for m in of_table(LAYERS) if m.plotted]


def depending_on(choice: str) -> list[str]:
    """The columns (with their ``_se``) that compare only between runs of the same ``choice``
    (``kmeans_k``, ``kmeans_best_k``, ``outlier_dims`` or ``clip_dims_exact``)."""
    out: list[str] = []
    for m in of_table(LAYERS):
        if m.depends_on == choice:
            out += [m.column] + ([m.se_column] if m.se_column else [])
    return out


def summary_columns() -> list[str]:
    """The columns of the per-layer summary a run prints."""
    return [m.column for m in of_table(LAYERS) if m.summary]
