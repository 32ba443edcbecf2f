"""The tables of the output contract, engine-free (no Ray): exact ones and the sampled stage's.

:func:`build_tables` builds every exact table (``type_stats``, ``layers``, ``dims``,
``positions``) from the corpus statistics, whole or cut into parts by token range and layer,
reading each layer's view of each part
(:meth:`~embgeom_ray.core.statistics.EmbeddingStatistics.layer`: an argsort of the types and a
float64 copy of their arrays) once for all four tables. The per-layer quantities are
:mod:`~embgeom_ray.core.metrics`' and :mod:`~embgeom_ray.core.rogue`'s functions of the
layer's own state and of :mod:`~embgeom_ray.core.partials`' sums over its token types, which
each part computes for its types (:func:`summarise_types`) and which merge exactly: one
partition or R give the same tables (:func:`build_tables_from`).

The sampled stage (K-means, LID, silhouettes, cluster-adjusted and clipped cosines on the
activation sample) is split in three: :func:`plan_sampled_metrics` (the samples table, the rule
that skips too small a sample, each layer's inputs and options), one :func:`sampled_row` and
one :func:`~embgeom_ray.core.kmeans_selection.select_k` per layer (run as Ray tasks by
:func:`embgeom_ray.distributed.sampled_stage.add_sampled_metrics`, or anywhere else), and
:func:`finish_sampled_metrics` (clusters into the samples table, the rows into ``layers``, the
manifest's note).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import pandas as pd

from . import metric_registry as registry
from .layer_moments import LayerMoments
from .metrics import layer_row_from, type_stats_rows, with_token_names
from .options import SampledOptions, TableOptions
from .partials import TypePartials, merge_partials, type_partials
from .partitions import range_key
from .rogue import (
    OutlierRules,
    clipping_row,
    dims_rows,
    exact_clipped_cosines_from,
    flagged_dims,
    position_columns,
    position_profile,
    positions_table_from,
    sampled_clipped_cosines,
)

if TYPE_CHECKING:  # the sampled stage's tasks run this module's functions: no torch
    from .kmeans_selection import SelectKResult
    from .samples import ActivationSample
    from .statistics import EmbeddingStatistics

#: fewer uniform sampled points than this and the sampled metrics are left empty (NaN)
MIN_SAMPLE_POINTS = 32
#: the manifest's statement of the LID convention (:func:`~.sampled_metrics.lid_mle`)
LID_CONVENTION = (
    "true (not squared) distances; cosine LID on chord distances sqrt(2 - 2 cos); "
    "lid_euclidean_cai: squared distances, divided by k (Cai et al.'s released code)"
)


class LayerAnalysis(NamedTuple):
    """What one layer's own state gives the exact tables, with its token types' merged
    partials (:func:`analyse_layer`): O(d + P), never its d × d co-moment."""

    row: dict[str, Any]  # its row of layers.parquet
    dims: pd.DataFrame  # its rows of dims.parquet
    positions: tuple[np.ndarray, np.ndarray]  # position counts (P,), ‖mean‖ at the positions seen


def analyse_layer(state: LayerMoments, types: TypePartials, rules: OutlierRules) -> LayerAnalysis:
    """A layer's row of ``layers.parquet`` (:func:`~.metrics.layer_row_from`,
    :func:`~.rogue.clipping_row` with its flagged dimensions,
    :func:`~.rogue.exact_clipped_cosines_from`), its rows of ``dims.parquet``
    (:func:`~.rogue.dims_rows`) and its position profile (:func:`~.rogue.position_profile`),
    from its own state (n, μ, C, tails, positions) and ``types``, the merged partials of its
    token types. Runs where the state lives (e.g. the reducer actor that owns the layer)."""
    dims = dims_rows(state, rules)
    flagged = flagged_dims(dims).get(state.layer, [])
    row = (
        layer_row_from(state, types)
        | clipping_row(state, flagged)
        | exact_clipped_cosines_from(state, types)
    )
    return LayerAnalysis(row, dims, position_profile(state.position_counts, state.position_means))


class LayerStates(Protocol):
    """Each measured layer's own state, where it lives: what :func:`build_tables_from` asks
    of it (O(d + P) answers)."""

    def __iter__(self) -> Iterator[int]:
        """The layers, in order."""

    def mean(self, layer: int) -> np.ndarray:
        """The layer's mean μ (d,)."""

    def analyse(self, layer: int, types: TypePartials, rules: OutlierRules) -> LayerAnalysis:
        """:func:`analyse_layer` of the layer's state."""

    def position_columns(self, layer: int, dims: Sequence[int]) -> np.ndarray:
        """The layer's position means at ``dims``, at the positions seen
        (:func:`~.rogue.position_columns`)."""


class StatesHere:
    """:class:`LayerStates` of states in this process (layer -> :class:`LayerMoments`)."""

    def __init__(self, states: Mapping[int, LayerMoments]) -> None:
        self.states = states

    def __iter__(self) -> Iterator[int]:
        return iter(self.states)

    def mean(self, layer: int) -> np.ndarray:
        return self.states[layer].mean

    def analyse(self, layer: int, types: TypePartials, rules: OutlierRules) -> LayerAnalysis:
        return analyse_layer(self.states[layer], types, rules)

    def position_columns(self, layer: int, dims: Sequence[int]) -> np.ndarray:
        state = self.states[layer]
        return position_columns(state.position_counts, state.position_means, dims)


class TypeSummary(NamedTuple):
    """What a partition of the token types contributes to one layer's exact tables: the
    sums of :mod:`~embgeom_ray.core.partials` and its rows of ``type_stats.parquet``."""

    partials: TypePartials
    rows: pd.DataFrame


def summarise_types(
    part: EmbeddingStatistics | LayerMoments, layer: int, layer_mean: np.ndarray, min_count: int
) -> TypeSummary:
    """The :class:`TypeSummary` of the token types ``part`` holds in ``layer`` (its view is
    read once; or the view itself), ``layer_mean`` the layer's mean over all its tokens. Runs
    where the part lives (e.g. a reducer actor): what it returns is O(d + its types), not
    O(types x d)."""
    m = part if isinstance(part, LayerMoments) else part.layer(layer)
    return TypeSummary(type_partials(m, layer_mean, min_count), type_stats_rows(m))


#: layer -> its token partitions' summaries, given the layer's mean (in token-id order)
Summariser = Callable[[int, np.ndarray], Sequence[TypeSummary]]


#: receives each layer's rows of ``type_stats.parquet`` in turn (token names set)
TypeRowsSink = Callable[[pd.DataFrame], None]


def build_tables(
    merged: EmbeddingStatistics | Iterable[EmbeddingStatistics],
    tokenizer: Any,
    options: TableOptions,
    type_rows: TypeRowsSink | None = None,
) -> dict[str, pd.DataFrame]:
    """Every exact table of the output contract, from the corpus statistics alone.

    ``merged`` is the whole statistics object or its parts, in any iterable
    (:meth:`~embgeom_ray.core.statistics.EmbeddingStatistics.select`: token ranges, layers, the
    per-layer state in one part per layer), summarised here one layer and one part at a time;
    the tables are the same to float64 rounding however the statistics are cut.
    See :func:`build_tables_from` for the tables.
    """
    # one statistics object (it has its token range), or its parts in any iterable; told apart
    # without importing the statistics' module (torch)
    parts = [merged] if hasattr(merged, "token_range") else list(merged)
    by_range = sorted(parts, key=lambda p: range_key(p.token_range))
    states = {}
    for p in parts:
        if p.holds_layer_state:
            states.update({layer: p for layer in p.layers})
    order = [x for x in parts[0].of_layers if x in states]
    if not order or any(x not in states for p in parts for x in p.layers):
        raise ValueError("every measured layer needs the one part that holds its per-layer state")

    layer_states = {layer: states[layer].layer(layer) for layer in order}

    def summaries(layer: int, mean: np.ndarray) -> list[TypeSummary]:
        holders = [p for p in by_range if layer in p.layers]
        return [
            summarise_types(
                layer_states[layer] if p is states[layer] else p, layer, mean, options.min_count
            )
            for p in holders
        ]

    return build_tables_from(layer_states, summaries, tokenizer, options, type_rows)


def build_tables_from(
    layer_states: Mapping[int, LayerMoments] | LayerStates,
    summaries: Summariser,
    tokenizer: Any,
    options: TableOptions,
    type_rows: TypeRowsSink | None = None,
) -> dict[str, pd.DataFrame]:
    """Every exact table from each layer's own state and its token partitions' summaries.

    - ``type_stats``: :func:`~.metrics.type_stats_rows` of every layer, token names from
      ``tokenizer.convert_ids_to_tokens`` (:func:`~.metrics.with_token_names`);
    - ``layers``: per layer :func:`~.metrics.layer_row_from` (``options.min_count``), then
      :func:`~.rogue.clipping_row` with the layer's flagged dimensions and
      :func:`~.rogue.exact_clipped_cosines_from` (when the statistics track ``clip_dims``);
    - ``dims``: :func:`~.rogue.dims_rows` of every layer (``options.outlier_*`` rules);
    - ``positions``: :func:`~.rogue.positions_table_from` with the dimensions flagged in any layer.

    ``layer_states``: layer -> its state here, or a :class:`LayerStates` that analyses each
    layer where its state lives (:func:`analyse_layer`; a partitioned run, on the reducer
    that owns the layer), so that only O(d + P) per layer meets here, never a d × d state.
    ``summaries(layer, mean)`` gives the layer's :class:`TypeSummary` per token partition, in
    token-id order (:func:`build_tables` computes them here; a partitioned run, where the
    partitions live). Only the O(d) partials and the type rows meet here.

    ``type_rows``: given, each layer's ``type_stats`` rows go to it as soon as the layer is
    summarised (the same rows, in the same order) and are let go of, and the result has no
    ``type_stats``: a caller writing them a layer at a time holds one layer's V rows, not L·V.
    """
    rules = OutlierRules.of(options)
    states = StatesHere(layer_states) if isinstance(layer_states, Mapping) else layer_states
    parts: dict[int, LayerAnalysis] = {}
    types = []
    for layer in states:
        found = summaries(layer, states.mean(layer))
        parts[layer] = states.analyse(layer, merge_partials([s.partials for s in found]), rules)
        rows = pd.concat([s.rows for s in found], ignore_index=True)
        del found
        if type_rows is not None:
            type_rows(with_token_names(rows, tokenizer.convert_ids_to_tokens))
        else:
            types.append(rows)
        del rows
    dims = pd.concat([p.dims for p in parts.values()], ignore_index=True)
    flagged = flagged_dims(dims)
    columns = sorted({d for ds in flagged.values() for d in ds})
    profiles = {
        layer: (*p.positions, states.position_columns(layer, columns)) for layer, p in parts.items()
    }
    streamed = type_rows is not None
    return {
        **(
            {}
            if streamed
            else {"type_stats": with_token_names(pd.concat(types, ignore_index=True), tokenizer.convert_ids_to_tokens)}
        ),
        "layers": pd.DataFrame([p.row for p in parts.values()]),
        "dims": dims,
        "positions": positions_table_from(profiles, columns),
    }


def sampled_row(
    X: np.ndarray,
    token_ids: np.ndarray,
    type_vectors: np.ndarray | None,
    kmeans_result: SelectKResult,
    clip_dims: list[int],
    **options: Any,
) -> dict[str, Any]:
    """One layer's sampled ``layers.parquet`` columns, from its uniform sample X.

    :func:`~.sampled_metrics.sampled_metrics_of_points` (``options``: its keyword arguments)
    and :func:`~.rogue.sampled_clipped_cosines` with ``clip_dims`` (the layer's flagged
    dimensions) zeroed, beside the same cosines unclipped over the same points. The per-layer
    task of the sampled stage.
    """
    from .sampled_metrics import sampled_metrics_of_points

    return sampled_metrics_of_points(
        X, token_ids, type_vectors, kmeans_result, **options
    ) | sampled_clipped_cosines(X, token_ids, clip_dims)


def sampled_selection(
    X: np.ndarray,
    content_keys: np.ndarray | None,
    kmeans_options: dict[str, Any],
    map_fits: Any = None,
) -> tuple[SelectKResult, np.ndarray | None]:
    """One layer's K-means model selection and the distance matrix of its distinct points
    (:func:`~.kmeans_selection.distinct_distances`; None when the selection takes a subsample),
    which :func:`sampled_row` reads as ``distances``: (the selection, the distances). The
    first of a layer's two tasks in the sampled stage, when the layer is fitted in one process."""
    from .kmeans_selection import distinct_distances, select_k

    shared = distinct_distances(X, content_keys, kmeans_options.get("silhouette_max_points"))
    km = select_k(X, groups=content_keys, map_fits=map_fits, shared=shared, **kmeans_options)
    return km, None if shared is None else shared[1]


def sampled_layer_results(
    X: np.ndarray,
    token_ids: np.ndarray,
    type_vectors: np.ndarray | None,
    clip_dims: list[int],
    content_keys: np.ndarray | None,
    kmeans_options: dict[str, Any],
    row_options: dict[str, Any],
    map_fits: Any = None,
) -> tuple[dict[str, Any], SelectKResult]:
    """One layer's K-means model selection and :func:`sampled_row`, from one distance matrix of
    its distinct points (:func:`sampled_selection`): (the row, the selection). The same numbers
    as :func:`~.kmeans_selection.select_k` and :func:`sampled_row` run apart, and as the
    sampled stage's two tasks of the layer (:func:`sampled_selection`, then
    :func:`sampled_row` with its distances)."""
    km, distances = sampled_selection(X, content_keys, kmeans_options, map_fits)
    row = sampled_row(
        X, token_ids, type_vectors, km, clip_dims, groups=content_keys, distances=distances,
        **row_options,
    )  # fmt: skip
    return row, km


@dataclass(frozen=True)
class SampledLayer:
    """One layer's inputs to :func:`sampled_row` (and its K-means on ``vectors``)."""

    vectors: np.ndarray  # (n, d) the uniform sample, canonical order
    token_ids: np.ndarray  # (n,)
    type_vectors: np.ndarray | None  # the type-uniform sample; None without one of >= 2 types
    clip_dims: list[int]  # the layer's flagged dimensions (dims.parquet)
    content_keys: np.ndarray | None = None  # (n,) which rows are one point (core.distinct)


@dataclass(frozen=True)
class SampledPlan:
    """The sampled stage, engine-free: what to compute per layer, and the partial results.

    ``layers`` is empty when the stage is skipped (``note["skipped"]`` says why).
    ``kmeans_options`` are :func:`~.kmeans.select_k`'s keyword arguments (those of
    :func:`embgeom_ray.distributed.kmeans.submit_layers_on_ray` too), ``row_options``
    :func:`sampled_row`'s.
    """

    samples: pd.DataFrame  # samples.parquet, cluster column still empty
    note: dict[str, Any]  # what the manifest records
    layers: dict[int, SampledLayer] = field(default_factory=dict)
    kmeans_options: dict[str, Any] = field(default_factory=dict)
    row_options: dict[str, Any] = field(default_factory=dict)

    @property
    def skipped(self) -> bool:
        return "skipped" in self.note


def plan_sampled_metrics(
    sample: ActivationSample, dims: pd.DataFrame, tokenizer: Any, options: SampledOptions
) -> SampledPlan:
    """The samples table and, unless the sample is too small, each layer's inputs.

    Skipped (no sampled metrics, NaN columns) when the uniform sample has fewer than
    :data:`MIN_SAMPLE_POINTS` points (:func:`sampled_note`). Otherwise K-means fits the fixed
    scan of k up to min(``kmeans_k_max``, n − 1) (every k = 2..15, then a 10% grid:
    :func:`~.kmeans_selection.scan_ks`; :func:`~.kmeans_selection.select_k`) on the distinct
    points by content key, and LID uses k = min(``lid_k``, n − 1) neighbours, n the uniform
    points (:func:`sampled_options`); the clipped cosines zero the layer's dimensions flagged
    in ``dims`` (``dims.parquet``; :func:`sampled_layer`). A whole sample in memory; the run
    itself plans a layer at a time (:func:`embgeom_ray.distributed.sampled_stage.add_sampled_metrics`).
    """
    samples = sample.to_table(tokenizer.convert_ids_to_tokens)
    samples["cluster"] = pd.array([None] * len(samples), dtype="Int64")
    note = sampled_note(sample)
    if "skipped" in note:
        return SampledPlan(samples, note)
    flagged = flagged_dims(dims)
    layers = {layer: sampled_layer(sample, layer, flagged.get(layer, [])) for layer in sample.layers}
    return SampledPlan(samples, note, layers, *sampled_options(options, sample.num_uniform))


def sampled_note(sample: ActivationSample) -> dict[str, Any]:
    """The manifest's note of the sampled stage as planned: the points of each sample, and
    ``skipped`` (why) when the uniform sample has fewer than :data:`MIN_SAMPLE_POINTS`."""
    n_points = sample.num_uniform
    note: dict[str, Any] = {"uniform_points": n_points, "type_uniform_points": sample.num_types}
    if n_points < MIN_SAMPLE_POINTS:
        note["skipped"] = f"sample of {n_points} points < {MIN_SAMPLE_POINTS}: no sampled metrics"
    return note


def sampled_options(options: SampledOptions, n_points: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(K-means options, :func:`sampled_row` options) of every layer, for ``n_points``
    uniform points."""
    kmeans_options = {
        "k_max": options.kmeans_k_max,
        "min_silhouette": options.kmeans_min_silhouette,
        "n_init": options.kmeans_n_init,
        "seed": options.sample_seed,
        "silhouette_max_points": options.silhouette_max_points,
        "stability_seeds": options.kmeans_stability_seeds,
    }
    row_options = {
        "lid_k": min(options.lid_k, n_points - 1),
        "silhouette_max_points": options.silhouette_max_points,
        "seed": options.sample_seed,
        "cluster_min_size": options.cluster_min_size,
        "s_inter_draws": options.s_inter_draws,
        "se_replicates": options.sampled_se_replicates,
    }
    return kmeans_options, row_options


def sampled_layer(sample: ActivationSample, layer: int, clip_dims: list[int]) -> SampledLayer:
    """Layer ``layer``'s inputs (``sample`` holds it: the whole sample or its one-layer
    sample): the uniform points in canonical order, their token ids and content keys, the
    type-uniform points (None without >= 2 types) and the layer's flagged dimensions."""
    pts = sample.points(layer)
    with_types = sample.type_uniform and sample.num_types >= 2
    types = sample.type_points(layer).vectors if with_types else None
    return SampledLayer(pts.vectors, pts.token_ids, types, clip_dims, pts.content_keys)


#: columns of ``kmeans.parquet`` (:func:`kmeans_table`)
KMEANS_COLUMNS = registry.columns(registry.KMEANS)


def kmeans_table(results: Mapping[int, SelectKResult]) -> pd.DataFrame:
    """``kmeans.parquet``: each layer's K-means scan, one row per k fitted.

    ``silhouette`` and ``inertia`` of that k's partition (the lowest inertia of its fits:
    :meth:`~.kmeans_selection.SelectKResult.curve`), ``best`` whether it is the k of best
    silhouette (``kmeans_best_k``: one row per layer, also when k = 1 is chosen), ``chosen``
    whether it is the reported ``kmeans_k`` (the same row when k ≥ 2 is chosen; no row when
    k = 1 is: the best silhouette is below the threshold, and k = 1 is not fitted). The curve shows whether k = 1 means no structure at any k, or structure
    that the threshold rejected.
    """
    rows = [
        {"layer": layer, **point, "best": point["k"] == res.best_k, "chosen": point["k"] == res.k}
        for layer, res in results.items()
        for point in res.curve()
    ]
    df = pd.DataFrame(rows, columns=KMEANS_COLUMNS)
    return df.astype({"layer": np.int64, "k": np.int64, "silhouette": np.float64,
                      "inertia": np.float64, "best": bool, "chosen": bool})  # fmt: skip


def finish_sampled_metrics(
    tables: dict[str, pd.DataFrame],
    plan: SampledPlan,
    rows: Mapping[int, Mapping[str, Any]],
    kmeans: Mapping[int, SelectKResult],
) -> dict[str, Any]:
    """Put the sampled stage's results into ``tables``; return the manifest's note.

    ``rows``: layer -> :func:`sampled_row`; ``kmeans``: layer -> its
    :class:`~.kmeans_selection.SelectKResult` (both for every layer of ``plan``; ignored when skipped).
    Sets ``tables["samples"]`` (each uniform occurrence's K-means ``cluster``) and
    ``tables["kmeans"]`` (:func:`kmeans_table`), adds the
    sampled columns to ``tables["layers"]``, and adds to the note the IsoScore–silhouette
    correlation across layers (:func:`~.sampled_metrics.isoscore_silhouette_correlation`) and
    the LID convention.
    """
    samples = plan.samples
    tables["samples"] = samples
    if plan.skipped:
        return dict(plan.note)
    for layer in plan.layers:
        uniform = (samples["layer"] == layer) & (samples["sample"] == "uniform")
        samples.loc[uniform, "cluster"] = np.asarray(kmeans[layer].labels, dtype=np.int64)
    return finish_sampled_columns(tables, plan.note, list(plan.layers), rows, kmeans)


def finish_sampled_columns(
    tables: dict[str, pd.DataFrame],
    note: Mapping[str, Any],
    layers: Sequence[int],
    rows: Mapping[int, Mapping[str, Any]],
    kmeans: Mapping[int, SelectKResult],
) -> dict[str, Any]:
    """:func:`finish_sampled_metrics` but the samples table (which the run writes a layer at a
    time): ``tables["kmeans"]``, the sampled columns of ``tables["layers"]``, the note."""
    from .sampled_metrics import isoscore_silhouette_correlation

    tables["kmeans"] = kmeans_table({layer: kmeans[layer] for layer in layers})
    sampled = pd.DataFrame([{"layer": layer} | dict(rows[layer]) for layer in layers])
    merged = tables["layers"].merge(sampled, on="layer", how="left")
    tables["layers"] = merged
    return dict(note) | {
        "isoscore_silhouette_corr": isoscore_silhouette_correlation(merged),
        "lid_convention": LID_CONVENTION,
    }
