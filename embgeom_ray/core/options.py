"""The core's options, with their defaults: the sample's, the exact tables', the sampled metrics'.

Each group is the options of one part of the core, and the one place its defaults are written:
:class:`SampleOptions` (:class:`~embgeom_ray.core.samples.ActivationSample`),
:class:`TableOptions` (:func:`~embgeom_ray.core.tables.build_tables`: the correlation's minimum
count in :mod:`~embgeom_ray.core.metrics`, the outlier rules of :mod:`~embgeom_ray.core.rogue`)
and :class:`SampledOptions` (:func:`~embgeom_ray.core.tables.plan_sampled_metrics`: the K-means
model selection of :mod:`~embgeom_ray.core.kmeans_selection`, the metrics of
:mod:`~embgeom_ray.core.sampled_metrics`). The parts take these models; a function's keyword
default reads its group's (``SampledOptions().lid_k``), so a default is written once, here.
The job's command line is generated from these fields (:mod:`embgeom_ray.config`).

Pydantic only (no numpy, no torch): the command line imports it to print ``--help``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ConfigDict, Field

from ..options import AGREE, MERGE, RESULT, OptionGroup


class SampleOptions(OptionGroup):
    """The activation sample's options (:class:`~embgeom_ray.core.samples.ActivationSample`)."""

    model_config = ConfigDict(title="sample options")

    sample_size: int = Field(
        4096,
        ge=0,
        description="token occurrences in the uniform sample (the same in every layer) for "
        "K-means, LID, silhouette and sampled cosines; 0 turns sampling off",
        json_schema_extra=RESULT | AGREE,
    )
    sample_type_size: int | None = Field(
        None,
        ge=1,
        description="token types in the type-uniform sample (one random occurrence each; Cai's "
        "S_inter) [default: --sample-size]",
        json_schema_extra=RESULT | AGREE,
    )
    sample_seed: int = Field(
        0, description="seed of the sample's random keys", json_schema_extra=RESULT | AGREE
    )


def sample_entries(
    size: int, type_size: int | None = None, type_uniform: bool = True
) -> tuple[int, int]:
    """(uniform, type-uniform) entries, each a row in every layer, that a sample of ``size``
    occurrences and ``type_size`` types (None: ``size``) holds at most: ``size``, and
    ``type_size`` where it keeps the type-uniform sample; none without a sample (``size`` 0:
    ``--sample-size 0``). A run's sample: ``sample_entries(sample_size, sample_type_size)``."""
    if size == 0:
        return 0, 0
    return size, (type_size or size) if type_uniform else 0


def header_entries(header: Mapping[str, Any]) -> tuple[int, int]:
    """(uniform, type-uniform) entries a sample of ``header`` (a sample file's, a run's)
    holds at most (:func:`sample_entries` of its sizes): read without the sample's module,
    which imports torch, by the sizing and the sampled stage's tasks."""
    type_size = header.get("type_size")
    return sample_entries(
        int(header["size"]),
        None if type_size is None else int(type_size),
        bool(header.get("type_uniform", True)),
    )


class TableOptions(OptionGroup):
    """The exact tables' options (:func:`~embgeom_ray.core.tables.build_tables`): the
    correlation's minimum count, the outlier rules (:class:`~embgeom_ray.core.rogue.OutlierRules`)."""

    model_config = ConfigDict(title="exact table options")

    min_count: int = Field(
        5,
        ge=2,
        description="minimum occurrences for a type to enter norm_variance_corr",
        json_schema_extra=MERGE,
    )
    outlier_mean_z: float = Field(
        3.0,
        gt=0,
        description="flag a dimension whose mean's z-score among the layer's dimensions "
        "exceeds this",
    )
    outlier_variance_ratio: float = Field(
        5.0,
        gt=1,
        description="flag a dimension whose variance is at least this times the mean variance",
    )
    outlier_tail_share: float = Field(
        0.25,
        gt=0,
        le=1,
        description="flag a dimension that is the argmax or argmin of at least this share of "
        "tokens",
    )


class SampledOptions(SampleOptions):
    """The sampled metrics' options (:func:`~embgeom_ray.core.tables.plan_sampled_metrics`):
    K-means model selection (:func:`~embgeom_ray.core.kmeans_selection.select_k`), LID,
    silhouettes, the cluster-adjusted metrics and standard errors
    (:func:`~embgeom_ray.core.sampled_metrics.sampled_metrics_of_points`), with the sample's
    (its seed seeds them)."""

    model_config = ConfigDict(title="sampled metric options")

    kmeans_k_max: int = Field(
        60,
        ge=2,
        description="K-means fits every k = 2..15 and then k growing 1.1x a step up to this, and keeps "
        "the k of best silhouette (Cai et al. scan 2..15); a best k at this end is flagged "
        "(kmeans_k_at_cap)",
    )
    kmeans_min_silhouette: float = Field(
        0.1,
        ge=-1,
        le=1,
        description="below this best silhouette, k = 1 (no clusters)",
    )
    kmeans_n_init: int | None = Field(
        None,
        ge=1,
        description="K-means++ seedings per k of 2..15 and warm starts (from the previous k's "
        "partition) per k after the first; each k keeps the lowest inertia of its fits and of "
        "a start from the next k's partition. Default: 3 when the scan goes above k = 15 "
        "(those starts from larger k then reach scikit-learn's 10 seedings), else 10",
    )
    kmeans_stability_seeds: int = Field(
        2,
        ge=0,
        description="refits of the best k from other initialisations; kmeans_stability is their "
        "mean adjusted Rand index with the reported clusters (0: no check)",
    )
    cluster_min_size: int = Field(
        20,
        ge=1,
        description="clusters of fewer points are left out of the size-weighted "
        "cluster-adjusted metrics (adjusted_*_weighted)",
    )
    s_inter_draws: int = Field(
        20,
        ge=2,
        description="random one-occurrence-per-type draws behind the spread of the "
        "cluster-adjusted S_inter (adjusted_s_inter_draws_std)",
    )
    sampled_se_replicates: int = Field(
        10,
        ge=0,
        description="half-samples behind the standard errors of the sampled metrics (*_se "
        "columns); 0 or 1: none",
    )
    lid_k: int = Field(
        20, ge=3, description="nearest neighbours of the LID estimate (Levina-Bickel)"
    )
    silhouette_max_points: int = Field(
        4096, ge=10, description="points a silhouette is computed on"
    )
