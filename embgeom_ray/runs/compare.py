"""Comparing complete runs layer by layer (``python -m jobs.compare RUN_A RUN_B ... --out DIR``).

The first run is the baseline. :func:`compare_runs` reads each run's ``manifest.json``,
``layers.parquet`` and ``dims.parquet`` and writes to ``DIR``:

- ``comparison.parquet``: every numeric per-layer metric of every run, long:
  ``run, label, layer, depth, metric, value`` (``depth`` = layer / number of blocks);
- ``comparison_wide.parquet``: one row per (metric, layer), one column per run (named by its
  label) — the runs side by side;
- ``changes.parquet``: each later run against the baseline, per metric and matched layer
  (:func:`changes_table`): ``run, metric, layer, run_layer, baseline, value, change, relative,
  score, kind, se_baseline, se_run, se_diff, z, q, within_noise, evidence, small_run,
  samples_differ, not_comparable`` with
  change = value − baseline, relative = change / |baseline| (NaN for a zero baseline),
  score = |change| / the metric's range over all runs and layers (so variances and cosines
  rank on the same footing) and, for a sampled metric with a standard error in both runs,
  z = change / se_diff, se_diff = √(se_baseline² + se_run²), and q its Benjamini–Hochberg
  adjusted p-value among the run's sampled changes with a z (:func:`q_values`); ranked by
  evidence (sampled changes beyond noise by |z|, then exact changes by score, then sampled
  changes without a standard error, then those within noise, then the cluster-adjusted
  metrics of layers whose K-means clustering changed and the clipped metrics of layers where
  the runs zeroed other dimensions, with ``not_comparable`` saying how; changes against a run
  smaller than :func:`size_threshold` after the others of their group); counts (``n_tokens``,
  ``n_types``, ``n_outlier_dims``, ...), the chosen ``kmeans_k`` and the ``*_se`` columns
  themselves are not ranked;
- ``rogue_dims.parquet``: per later run and matched layer, the dimensions flagged as outliers
  (``dims.parquet`` column ``outlier``) that appeared (flagged in the run, not in the baseline)
  or vanished (the reverse), with both runs' mean and std of the dimension and ``reliable``
  (False when either run is smaller than :func:`size_threshold`);
- ``comparison.json``: the runs (with their ``tokens`` and ``sample_size``), how layers were
  matched, the number of non-zero changes per evidence group (``evidence_counts``), the
  largest changes (``largest_changes`` in that order, and the three lists compare prints and
  reports: ``largest_exact``, ``largest_sampled``, ``largest_not_comparable``), how the
  sampled changes stand against chance (``sampled_tests``: :func:`sampled_tests`), the rogue
  dimensions that appeared or vanished (and whether ``reliable``),
  the size warning (``size_warning``, ``size_threshold``, ``small_runs``: :func:`size_warning`),
  notes (the size warning first), and the files;
- ``report.html`` (+ ``plots/compare_metrics.png``): the page of
  :func:`embgeom_ray.report.html.write_comparison_report`.

Layers are matched by index when every run's model has the same number of blocks L. Otherwise
they are matched by relative depth layer / L: each baseline layer is paired with the run's
layer of nearest relative depth (the lower one on a tie), and the output says so. Rogue
dimensions are compared only between runs of the same hidden size (dimension d of two
revisions of one model is the same coordinate; of two different models it is not, whatever
the size: read it accordingly).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from ..core import metric_registry as registry
from ..core.kmeans_selection import ROBUST_SUPPORT
from ..core.options import SampleOptions
from ..core.rogue import flagged_dims
from ..errors import UserError
from ..integrity import Digest, digests_json, seal
from ..io_utils import atomic_write_json, join, location
from ..run_dir import RunDir, RunDirError, now, write_table
from ..run_view import RunView, by_depth
from ..storage import check_input, check_output

SUMMARY = "comparison.json"
LONG, WIDE, CHANGES, ROGUE = "comparison", "comparison_wide", "changes", "rogue_dims"
#: per-layer columns kept in the tables but not ranked among the changes: counts, the k chosen
#: or searched, and the standard errors themselves (they are the yardstick of the changes);
#: the registry's (:mod:`~embgeom_ray.core.metric_registry`) ``ranked=False`` columns
NOT_RANKED = tuple(registry.not_ranked())
#: per-layer metrics estimated on the run's sample (the registry's sampled columns, the sampled
#: clipped cosines and every ``_se`` among them); every other metric is exact (all tokens)
SAMPLED = frozenset(c for c in registry.layer_columns() if registry.kind_of(c) == "sampled")
EXACT, SAMPLED_KIND = "exact", "sampled"
#: |z| below this is within the sampling noise of the two runs (about 95% two-sided)
NOISE_Z = 2.0
#: an exact metric is a change only beyond this relative difference: the bound every exact
#: number keeps against a float64 two-pass computation (docs/numerics.md)
EXACT_BOUND = 1e-6
#: a sampled metric is a change only beyond this relative difference: how far the forward's
#: rounding (another sharding or batch size) moves a sampled metric of the same sample
#: (tests/runs/test_sharding_invariance.py)
SAMPLED_BOUND = 1e-4
#: the evidence of a change, best first: the order of :func:`changes_table`
BEYOND_NOISE, EXACT_CHANGE, NO_SE, WITHIN_NOISE, CLUSTERING_CHANGED, CLIPPING_CHANGED = (
    "beyond noise", "exact", "no standard error", "within noise", "clustering changed",
    "clipping changed",
)  # fmt: skip
K_NOT_ROBUST, AGREE = "k not robust", "agree"
EVIDENCE_ORDER = (
    BEYOND_NOISE, EXACT_CHANGE, NO_SE, WITHIN_NOISE, CLUSTERING_CHANGED, CLIPPING_CHANGED,
    K_NOT_ROBUST, AGREE,
)  # fmt: skip
#: the evidence groups that are not a change: listed in changes.parquet, not among the changes
NOT_A_CHANGE = (K_NOT_ROBUST, AGREE)
#: the three lists compare prints and reports, each in the order of :func:`changes_table`:
#: exact changes (by score), sampled ones (beyond noise by |z|, without a standard error by
#: score, within noise by |z|), and those not comparable (another clustering or clipping)
EXACT_LIST, SAMPLED_LIST, APART_LIST = (
    (EXACT_CHANGE,), (BEYOND_NOISE, NO_SE, WITHIN_NOISE), (CLUSTERING_CHANGED, CLIPPING_CHANGED),
)  # fmt: skip
#: the share of changes that are sampling noise only yet reach |z| ≥ NOISE_Z: 2 · (1 − Φ(2))
#: ≈ 0.0455 for a normal z
CHANCE_BEYOND: float = float(2 * stats.norm.sf(NOISE_Z))
#: the false discovery rate of the Benjamini–Hochberg procedure over a run's sampled changes
FDR = 0.05
#: metrics computed within the reported K-means clusters: not comparable between two runs
#: whose layer chose another number of clusters (``kmeans_k``) or sits at the scan's end in one
#: run only (``kmeans_k_at_cap``); the registry's ``depends_on="kmeans_k"``, with their ``_se``
CLUSTER_ADJUSTED = tuple(registry.depending_on("kmeans_k"))
#: metrics of the fits at the best k (``kmeans_best_k``): not comparable when it differs
BEST_K_DEPENDENT = tuple(registry.depending_on("kmeans_best_k"))
#: metrics computed with dimensions zeroed, by the ``layers.parquet`` text column that lists
#: them: the layer's flagged outlier dimensions (``outlier_dims``: ``isoscore_clipped`` and the
#: sampled clipped cosines) or the run's ``--clip-dims`` (``clip_dims_exact``: the
#: ``*_clipped_exact`` columns). Not comparable between runs that zeroed other dimensions
CLIPPED = {col: tuple(registry.depending_on(col)) for col in ("outlier_dims", "clip_dims_exact")}
#: token counts differing by more than this factor get the size warning
SIZE_RATIO = 10.0
#: the uniform sample size of a run that records none (the job's default ``--sample-size``)
DEFAULT_SAMPLE_SIZE: int = SampleOptions().sample_size
#: column names of the wide table that a label may not take
RESERVED_LABELS = ("metric", "layer", "depth")
BY_INDEX, BY_DEPTH = "layer_index", "relative_depth"


class CompareError(UserError):
    """A directory that is not a complete run, or labels that do not fit the runs."""


def load_run(path: str, label: str) -> RunView:
    """A complete run's view (:meth:`~embgeom_ray.run_view.RunView.complete`: its manifest,
    ``layers`` and ``dims`` read); :class:`CompareError` saying what is wrong."""
    try:
        return RunView.complete(path, label, "comparing")
    except RunDirError as exc:
        raise CompareError(str(exc)) from None


def default_labels(paths: Sequence[str]) -> list[str]:
    """Each run directory's last path component; numbered when two are the same."""
    names = [os.path.basename(str(p).rstrip("/")) or str(p) for p in paths]
    if len(set(names)) < len(names):
        names = [f"{i + 1}:{n}" for i, n in enumerate(names)]
    return names


def check_labels(labels: Sequence[str], n: int) -> list[str]:
    labels = [str(x).strip() for x in labels]
    if len(labels) != n:
        raise CompareError(f"{len(labels)} labels for {n} runs: give one label per run")
    if any(not x for x in labels):
        raise CompareError("labels must not be empty")
    if len(set(labels)) < n:
        raise CompareError(f"labels must be distinct, got {labels}")
    bad = [x for x in labels if x in RESERVED_LABELS or x.startswith("layer:")]
    if bad:
        raise CompareError(f"labels {bad} are column names of the comparison tables; pick others")
    return labels


def metric_columns(runs: Sequence[RunView]) -> list[str]:
    """Numeric per-layer columns (not ``layer``) of any run, in order of first appearance."""
    out: list[str] = []
    for run in runs:
        for col in run.layers.columns:
            s = run.layers[col]
            numeric = pd.api.types.is_numeric_dtype(s) and not pd.api.types.is_bool_dtype(s)
            if col != "layer" and numeric and col not in out:
                out.append(col)
    return out


def layer_matching(runs: Sequence[RunView]) -> tuple[str, str]:
    """(mode, note): by index when all runs have the same number of blocks, else by depth."""
    if not by_depth(runs):
        return BY_INDEX, f"layers matched by index (every model has {runs[0].num_layers} blocks)"
    desc = ", ".join(f"{r.label}: {r.num_layers}" for r in runs)
    return BY_DEPTH, (
        f"the runs have different numbers of blocks ({desc}), so layers are matched by relative "
        "depth layer / blocks: each baseline layer is paired with the run's layer of nearest "
        "relative depth"
    )


def match_layers(base: RunView, other: RunView, mode: str) -> list[tuple[int, int]]:
    """(baseline layer, run layer) pairs."""
    a = [int(x) for x in base.layers["layer"]]
    b = [int(x) for x in other.layers["layer"]]
    if mode == BY_INDEX:
        common = sorted(set(a) & set(b))
        return [(x, x) for x in common]
    # |y/L_o - x/L_b| compared exactly as |y*L_b - x*L_o| (integers); ties go to the lower y
    big_b, big_o = base.num_layers, other.num_layers
    return [(x, min(b, key=lambda y, x=x: (abs(y * big_b - x * big_o), y))) for x in a]


def long_table(runs: Sequence[RunView], metrics: Sequence[str]) -> pd.DataFrame:
    """``run, label, layer, depth, metric, value``: every numeric metric of every run."""
    frames = []
    for run in runs:
        present = [m for m in metrics if m in run.layers.columns]
        values = run.layers[present].apply(pd.to_numeric, errors="coerce").astype(np.float64)
        wide = pd.concat([run.layers[["layer"]], values], axis=1)
        long = wide.melt(id_vars="layer", var_name="metric", value_name="value")
        long["metric_order"] = long["metric"].map({m: i for i, m in enumerate(metrics)})
        long = long.sort_values(["metric_order", "layer"], kind="stable")
        long.insert(0, "run", run.path)
        long.insert(1, "label", run.label)
        long.insert(3, "depth", long["layer"].map(run.depth).astype(np.float64))
        frames.append(long.drop(columns="metric_order"))
    df = pd.concat(frames, ignore_index=True)
    return df[["run", "label", "layer", "depth", "metric", "value"]]


def wide_table(runs: Sequence[RunView], metrics: Sequence[str], mode: str) -> pd.DataFrame:
    """One row per (metric, layer), one value column per run label.

    By index: the layers of any run. By relative depth: the baseline's layers, with the
    matched layer of each later run in ``layer:<label>``.
    """
    base = runs[0]
    if mode == BY_INDEX:
        layers = sorted({int(x) for r in runs for x in r.layers["layer"]})
        pairs = {r.label: {x: x for x in layers} for r in runs}
    else:
        layers = [int(x) for x in base.layers["layer"]]
        pairs = {r.label: dict(match_layers(base, r, mode)) for r in runs}
    rows = []
    for m in metrics:
        for x in layers:
            row: dict[str, Any] = {"metric": m, "layer": x, "depth": base.depth(x)}
            for r in runs:
                row[r.label] = r.value(m, pairs[r.label][x])
            if mode == BY_DEPTH:
                for r in runs[1:]:
                    row[f"layer:{r.label}"] = pairs[r.label][x]
            rows.append(row)
    return pd.DataFrame(rows)


def _metric_span(runs: Sequence[RunView], metric: str) -> float:
    vals = np.concatenate(
        [
            pd.to_numeric(r.layers[metric], errors="coerce").to_numpy(dtype=np.float64)
            for r in runs
            if metric in r.layers.columns
        ]
    )
    vals = vals[np.isfinite(vals)]
    return float(vals.max() - vals.min()) if len(vals) else 0.0


CHANGE_COLUMNS = [
    "run", "metric", "layer", "run_layer", "baseline", "value", "change", "relative", "score",
    "kind", "se_baseline", "se_run", "se_diff", "z", "q", "within_noise", "evidence",
    "small_run", "samples_differ", "not_comparable",
]  # fmt: skip


def metric_kind(metric: str) -> str:
    """``"sampled"`` for a metric estimated on the run's sample, else ``"exact"``."""
    return SAMPLED_KIND if metric in SAMPLED else EXACT


def z_score(change: float, se_baseline: float, se_run: float) -> tuple[float, float]:
    """(se_diff, z) of a change between two independent estimates.

    se_diff = √(se_b² + se_r²), the standard error of the difference of two independent
    estimates (the runs' samples are drawn independently), and z = change / se_diff. NaN for
    both when a standard error is missing or not finite; with se_diff = 0, z is 0 for no change
    and ±inf for any other.
    """
    if not (math.isfinite(se_baseline) and math.isfinite(se_run)):
        return math.nan, math.nan
    se_diff = math.hypot(se_baseline, se_run)
    if se_diff == 0:
        return 0.0, (0.0 if change == 0 else math.copysign(math.inf, change))
    return se_diff, change / se_diff


def _evidence(kind: str, z: float) -> str:
    if kind == EXACT:
        return EXACT_CHANGE
    if math.isnan(z):
        return NO_SE
    return BEYOND_NOISE if abs(z) >= NOISE_Z else WITHIN_NOISE


def clustering_change(base: RunView, b: int, run: RunView, o: int) -> dict[str, str]:
    """Why the clustering of baseline layer ``b`` and run layer ``o`` differ, per affected metric.

    ``{metric: reason}`` for the metrics of :data:`CLUSTER_ADJUSTED` when ``kmeans_k`` or
    ``kmeans_k_at_cap`` differ, and of :data:`BEST_K_DEPENDENT` when ``kmeans_best_k`` does
    (e.g. ``"kmeans_k 2 -> 1"``); empty when the clusterings agree or a run has no K-means. A
    change of these metrics then compares clusters of different partitions, not one quantity
    measured twice: its half-sample standard errors, which hold the clusters fixed, say nothing
    of it. When either run's k decision is not robust (:func:`k_not_robust`), the reason says
    so (``"kmeans_k 2 -> 1; k decision not robust: kmeans_k_support 0.55 -> 0.95"``).
    """

    def pair(col: str) -> tuple[Any, Any] | None:
        a, v = base.value(col, b), run.value(col, o)
        if not (math.isfinite(a) and math.isfinite(v)):
            return None
        return (int(a), int(v)) if col != "kmeans_k_at_cap" else (bool(a), bool(v))

    reasons = [
        f"{col} {x} -> {y}"
        for col in ("kmeans_k", "kmeans_k_at_cap")
        if (xy := pair(col)) is not None and (x := xy[0]) != (y := xy[1])
    ]
    out = {m: "; ".join(reasons) for m in CLUSTER_ADJUSTED} if reasons else {}
    best = pair("kmeans_best_k")
    if best is not None and best[0] != best[1]:
        out |= {m: f"kmeans_best_k {best[0]} -> {best[1]}" for m in BEST_K_DEPENDENT}
    weak = k_not_robust(base, b, run, o)
    return {m: f"{why}; {weak}" for m, why in out.items()} if weak else out


def k_not_robust(base: RunView, b: int, run: RunView, o: int) -> str:
    """``"k decision not robust: kmeans_k_support 0.55 -> 0.95"`` when either run's K-means k
    decision at the layer has a support below :data:`ROBUST_SUPPORT` (the share of bootstrap
    resamples of its sample that take it); empty when both are robust or a run does not say
    (a run of an older version)."""
    a, v = base.value("kmeans_k_support", b), run.value("kmeans_k_support", o)
    if not (math.isfinite(a) and math.isfinite(v)) or min(a, v) >= ROBUST_SUPPORT:
        return ""
    return f"k decision not robust: kmeans_k_support {a:.2f} -> {v:.2f}"


def zeroed_dims(run: RunView, column: str, layer: int) -> frozenset[int] | None:
    """The dimensions ``layers.parquet``'s text ``column`` (``outlier_dims``,
    ``clip_dims_exact``: ``"3,17"``, empty for none) lists at ``layer``; None when the run has
    no such column or layer (a run of an older version)."""
    if column not in run.layers.columns:
        return None
    cell = run.layers.loc[run.layers["layer"] == layer, column]
    if not len(cell):
        return None
    text = cell.iloc[0]
    if not isinstance(text, str):
        return frozenset()  # missing: nothing zeroed (no --clip-dims, or no flagged dimension)
    return frozenset(int(d) for d in text.replace(" ", "").split(",") if d)


def _dims_text(dims: Iterable[int]) -> str:
    return ",".join(str(d) for d in sorted(dims)) or "none"


def clipping_change(base: RunView, b: int, run: RunView, o: int) -> dict[str, str]:
    """Why the clipped metrics of baseline layer ``b`` and run layer ``o`` zero other
    dimensions, per affected metric (:data:`CLIPPED`).

    ``{metric: "outlier_dims 157 -> 351"}``: the dimensions zeroed in the baseline only, then
    in the run only (``none`` for an empty side), for ``isoscore_clipped`` and the sampled
    clipped cosines when the layer's flagged dimensions differ, and likewise
    ``clip_dims_exact ...`` for the ``*_clipped_exact`` columns when the runs' ``--clip-dims``
    differ. Empty when both zeroed the same dimensions or a run does not say which.
    """
    out: dict[str, str] = {}
    for column, metrics in CLIPPED.items():
        x, y = zeroed_dims(base, column, b), zeroed_dims(run, column, o)
        if x is None or y is None or x == y:
            continue
        why = f"{column} {_dims_text(x - y)} -> {_dims_text(y - x)}"
        out |= {m: why for m in metrics}
    return out


def agrees(kind: str, baseline: float, value: float) -> bool:
    """Whether two values of a metric are the same result: within :data:`EXACT_BOUND` (exact)
    or :data:`SAMPLED_BOUND` (sampled) of the larger magnitude."""
    bound = EXACT_BOUND if kind == EXACT else SAMPLED_BOUND
    return abs(value - baseline) <= bound * max(abs(baseline), abs(value))


def changes_table(runs: Sequence[RunView], metrics: Sequence[str], mode: str) -> pd.DataFrame:
    """Every later run against the baseline, per metric and matched layer, best evidence first.

    ``kind``: ``exact`` (over every counted token: no sampling error) or ``sampled`` (on the
    run's sample, :data:`SAMPLED`). For a sampled metric with a standard error ``<metric>_se``
    in both runs (:data:`~embgeom_ray.core.sampled_metrics.SE_METRICS`, from half-samples),
    ``se_diff`` and ``z`` (:func:`z_score`); ``within_noise`` is |z| < :data:`NOISE_Z` (False for
    an exact metric, missing (NA) for a sampled one without standard errors, e.g. of an older
    run). ``evidence`` and the order, by :data:`EVIDENCE_ORDER`:

    1. ``beyond noise``: sampled, |z| ≥ 2, by |z| (largest first);
    2. ``exact``: exact metrics, by ``score`` = |change| / the metric's range over all runs and
       layers (a relative change explodes near a zero baseline; the range does not);
    3. ``no standard error``: sampled without ``_se`` in a run, by ``score``;
    4. ``within noise``: sampled, |z| < 2, by |z|;
    5. ``clustering changed``: a metric computed within K-means clusters at a layer whose
       clustering differs between the runs (:func:`clustering_change`; ``not_comparable``
       says how): not ranked by z (the standard error measures the noise of a fixed
       clustering, not a change of it), by ``score``;
    6. ``clipping changed``: a clipped metric at a layer where the runs zeroed other
       dimensions (:func:`clipping_change`: another set of flagged outlier dimensions, or of
       ``--clip-dims``; ``not_comparable`` says which): its change is partly another
       clipping, not a change of one quantity; by ``score``;
    7. ``k not robust``: the same as 5., at a layer whose k decision is not robust in either run
       (:func:`k_not_robust`): the k moved within what the run's own sample does not decide,
       so neither the k nor these metrics changed in a way the runs can show: not a change;
    8. ``agree``: the same result, within :data:`EXACT_BOUND` (exact) or
       :data:`SAMPLED_BOUND` (sampled) relative (:func:`agrees`): not a change.

    ``small_run``: the run or the baseline has fewer tokens than :func:`size_threshold`;
    ``samples_differ``: a sampled metric of two runs whose samples hold different numbers of
    points (:func:`sample_points`: another ``--sample-size``, or a run smaller than its
    sample). Within each group these changes come after the others: z measures sampling noise
    at each run's own sample size, not how K-means, silhouettes and LID change with the number
    of points. Ties keep the run, metric and layer order.
    """
    base = runs[0]
    small = set(small_runs(runs, size_threshold(runs)))
    points = {r.label: sample_points(r) for r in runs}
    ranked = [m for m in metrics if m not in NOT_RANKED]
    spans = {m: _metric_span(runs, m) for m in ranked}
    rows = []
    for i, run in enumerate(runs[1:], start=1):
        pairs = match_layers(base, run, mode)
        tiny = base.label in small or run.label in small
        unlike = None not in (points[base.label], points[run.label]) and (
            points[base.label] != points[run.label]
        )
        clusterings = {(b, o): clustering_change(base, b, run, o) for b, o in pairs}
        clippings = {(b, o): clipping_change(base, b, run, o) for b, o in pairs}
        for j, m in enumerate(ranked):
            if m not in base.layers.columns or m not in run.layers.columns:
                continue
            kind = metric_kind(m)
            for b, o in pairs:
                a, v = base.value(m, b), run.value(m, o)
                if not (math.isfinite(a) and math.isfinite(v)):
                    continue
                d = v - a
                score = abs(d) / spans[m] if spans[m] > 0 else 0.0
                rel = d / abs(a) if a != 0 else math.nan
                se_b = se_r = se_diff = z = math.nan
                if kind == SAMPLED_KIND:
                    se_b, se_r = base.value(f"{m}_se", b), run.value(f"{m}_se", o)
                    se_diff, z = z_score(d, se_b, se_r)
                why = clusterings[b, o].get(m)
                clipped = clippings[b, o].get(m)
                noise = _evidence(kind, z)
                if why:
                    evidence = K_NOT_ROBUST if "not robust" in why else CLUSTERING_CHANGED
                    z, within = math.nan, pd.NA
                elif clipped:
                    why, evidence = clipped, CLIPPING_CHANGED
                    z, within = math.nan, pd.NA
                else:
                    evidence = AGREE if agrees(kind, a, v) else noise
                    within = pd.NA if noise == NO_SE else noise == WITHIN_NOISE
                tier = EVIDENCE_ORDER.index(evidence)
                strength = abs(z) if evidence in (BEYOND_NOISE, WITHIN_NOISE) else score
                differ = kind == SAMPLED_KIND and unlike
                rows.append(
                    (
                        (tier, tiny or differ, -strength, i, j, b),
                        [run.label, m, b, o, a, v, d, rel, score, kind, se_b, se_r, se_diff, z,
                         math.nan, within, evidence, tiny, differ, why or ""],
                    )
                )  # fmt: skip
    rows.sort(key=lambda r: r[0])
    df = pd.DataFrame([r[1] for r in rows], columns=CHANGE_COLUMNS)
    df["q"] = q_values(df)
    return df.astype(
        {
            "layer": np.int64,
            "run_layer": np.int64,
            "se_baseline": np.float64,
            "se_run": np.float64,
            "se_diff": np.float64,
            "z": np.float64,
            "q": np.float64,
            "within_noise": "boolean",
            "small_run": bool,
            "samples_differ": bool,
        }
    )


def tested(changes: pd.DataFrame) -> pd.Series:
    """The rows of sampled changes tested against their standard errors: those with a z
    (``agree`` ones included: a difference within the bound is a test that found nothing)."""
    return (changes["kind"] == SAMPLED_KIND) & changes["z"].notna()


def q_values(changes: pd.DataFrame) -> pd.Series:
    """Benjamini–Hochberg adjusted p-values of the tested sampled changes, per later run.

    p = 2 · (1 − Φ(|z|)), z taken as normal (a half-sample standard error on each side), and
    q the smallest false discovery rate at which the procedure (Benjamini & Hochberg 1995;
    :func:`scipy.stats.false_discovery_control`) still takes the change as real, over the run's
    tested changes (:func:`tested`) across metrics and layers. The z of one sample's metrics
    are not independent; the procedure holds under their positive dependence, approximately
    otherwise. NaN for the rows without a z.
    """
    q = pd.Series(math.nan, index=changes.index, dtype=np.float64)
    mask = tested(changes)
    for _, rows in changes.loc[mask].groupby("run", sort=False):
        p = 2 * stats.norm.sf(np.abs(rows["z"].to_numpy(dtype=np.float64)))
        q.loc[rows.index] = stats.false_discovery_control(p, method="bh")
    return q


def sampled_tests(changes: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """Per later run, how its sampled changes stand as a whole against chance.

    ``tested`` (the changes with a z, :func:`tested`), ``beyond_noise`` (|z| ≥ 2),
    ``expected_by_chance`` (tested × :data:`CHANCE_BEYOND`: how many would reach |z| ≥ 2 were
    every change sampling noise) and ``discoveries`` (``q`` ≤ :data:`FDR`: the changes the
    Benjamini–Hochberg procedure keeps at a false discovery rate of 5%, :func:`q_values`).
    """
    out: dict[str, dict[str, Any]] = {}
    mask = tested(changes)
    for run in dict.fromkeys(changes["run"]):
        rows = changes.loc[mask & (changes["run"] == run)]
        n = len(rows)
        out[str(run)] = {
            "tested": n,
            "beyond_noise": int((rows["evidence"] == BEYOND_NOISE).sum()),
            "expected_by_chance": round(n * CHANCE_BEYOND, 1),
            "fdr": FDR,
            "discoveries": int((rows["q"] <= FDR).sum()),
        }
    return out


def tests_line(run: str, t: dict[str, Any]) -> str:
    """One run's :func:`sampled_tests` in words."""
    if not t["tested"]:
        return f"{run}: no sampled change has a standard error in both runs"
    return (
        f"{run}: {t['tested']} sampled changes tested against their standard errors, "
        f"{t['beyond_noise']} beyond noise (|z| >= {NOISE_Z:g}) where chance alone would put "
        f"about {t['expected_by_chance']:g} ({CHANCE_BEYOND:.1%} of {t['tested']}); "
        f"{t['discoveries']} remain{'s' if t['discoveries'] == 1 else ''} at a "
        f"{t['fdr']:.0%} false discovery rate "
        f"(Benjamini-Hochberg q <= {t['fdr']:g})"
    )


def size_threshold(runs: Sequence[RunView]) -> int:
    """Tokens below which a run is too small to compare like with like.

    The largest uniform sample size of the runs (:attr:`RunView.sample_size`;
    :data:`DEFAULT_SAMPLE_SIZE` when no run records one). A run with fewer tokens has sampled
    nothing: its "sample" is every token it has, fewer points than another run's sample, so
    its K-means, silhouettes and LIDs (which depend on the number and density of the points)
    are not estimates of the same quantity, and its rogue dimensions are thresholded
    statistics of fewer vectors than one sample of the other runs: dimensions near a
    threshold flip on noise.
    """
    sizes = [s for s in (r.sample_size for r in runs) if s is not None]
    return max(sizes) if sizes else DEFAULT_SAMPLE_SIZE


def sample_points(run: RunView) -> int | None:
    """The points a run's sampled metrics rest on: the uniform sample's points as its manifest
    records them (``sample.uniform_points``), else its ``--sample-size`` (or
    :data:`DEFAULT_SAMPLE_SIZE`) capped by its token count; None when neither is known, or
    the run sampled nothing (``--sample-size 0``: no sampled metrics to compare)."""
    recorded = (run.manifest.sample or {}).get("uniform_points")
    if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded > 0:
        return recorded
    if run.tokens is None or run.config.get("sample_size") == 0:
        return None
    return min(run.sample_size or DEFAULT_SAMPLE_SIZE, int(run.tokens))


def small_runs(runs: Sequence[RunView], threshold: int) -> list[str]:
    """Labels of the runs with fewer tokens than ``threshold`` (runs without a count: none)."""
    return [r.label for r in runs if r.tokens is not None and r.tokens < threshold]


def size_warning(runs: Sequence[RunView]) -> str | None:
    """One line when the runs differ greatly in size, else None.

    Said when the largest token count exceeds :data:`SIZE_RATIO` (10) times the smallest, a run
    has fewer tokens than :func:`size_threshold`, or a run's sample holds fewer points than
    another's for another reason (a smaller ``--sample-size``: :func:`sample_points`). Runs
    without a token count are left out.
    """
    counted = [r for r in runs if r.tokens is not None]
    if not counted:
        return None
    threshold = size_threshold(runs)
    small = small_runs(runs, threshold)
    tokens = [int(r.tokens or 0) for r in counted]
    ratio = max(tokens) / min(tokens) if min(tokens) > 0 else math.inf
    points = {r.label: sample_points(r) for r in counted}
    most = max((p for p in points.values() if p is not None), default=None)
    fewer = [
        r.label for r in counted
        if r.label not in small and None not in (points[r.label], most) and points[r.label] < most
    ]  # fmt: skip
    if ratio <= SIZE_RATIO and not small and not fewer:
        return None
    sizes = "tokens " + ", ".join(f"{r.label}: {r.tokens:,}" for r in counted)
    parts = [f"the runs differ {ratio:,.0f}x in size ({sizes})" if ratio > SIZE_RATIO else sizes]
    if small:
        one = len(small) == 1
        parts.append(
            f"{_join(small)} {'has' if one else 'have'} fewer tokens than the sample size "
            f"{threshold:,}, so {'its' if one else 'their'} sampled metrics rest on fewer points "
            "than a full sample (K-means, silhouettes and LID change with the number of points, "
            "which z, a measure of sampling noise, does not cover) and the rogue dimensions that "
            f"appear or vanish against {'it' if one else 'them'} are not reliable"
        )
    if fewer:
        one = len(fewer) == 1
        held = ", ".join(f"{r.label}: {points[r.label]:,}" for r in counted)
        parts.append(
            f"the samples differ in size (points {held}): {_join(fewer)}'s sampled metrics rest "
            f"on fewer points, so {'its' if one else 'their'} changes of K-means, silhouettes "
            "and LID are not like with like (they change with the number of points, which z, a "
            "measure of sampling noise, does not cover) and come after the others"
        )
    return "; ".join(parts)


def _join(labels: Sequence[str]) -> str:
    return labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + " and " + labels[-1]


ROGUE_COLUMNS = [
    "run", "layer", "run_layer", "dim", "change", "baseline_mean", "run_mean", "baseline_std",
    "run_std", "reliable",
]  # fmt: skip


def _stat(stats: pd.DataFrame, dim: int, col: str) -> float:
    return float(stats.at[dim, col]) if dim in stats.index and col in stats.columns else math.nan


def _outliers(dims: pd.DataFrame) -> dict[int, list[int]]:
    return flagged_dims(dims.assign(outlier=dims["outlier"].fillna(False).astype(bool)))


def _dim_stats(dims: pd.DataFrame, layer: int) -> pd.DataFrame:
    sel = dims.loc[dims["layer"] == layer]
    cols = [c for c in ("mean", "std") if c in sel.columns]
    return sel.set_index("dim")[cols]


def rogue_changes(
    runs: Sequence[RunView], mode: str, unreliable: Sequence[str] = ()
) -> tuple[pd.DataFrame, dict[str, Any], list[str]]:
    """Rogue dimensions that appeared or vanished against the baseline.

    Returns the table, ``{label: {"appeared": {layer: dims}, "vanished": {layer: dims},
    "reliable": bool}}`` (layers as strings, for JSON) and notes on runs that could not be
    compared. ``unreliable``: labels of runs too small for their flags to be trusted
    (:func:`small_runs`); a run's changes are not ``reliable`` when it or the baseline is one.
    """
    base = runs[0]
    notes: list[str] = []
    summary: dict[str, Any] = {}
    rows: list[list[Any]] = []

    def usable(run: RunView) -> bool:
        if run.dims is None:
            notes.append(f"{run.label}: no dims.parquet, rogue dimensions not compared")
            return False
        if not {"layer", "dim", "outlier"} <= set(run.dims.columns):
            notes.append(
                f"{run.label}: dims.parquet has no 'outlier' column (a run of an older version), "
                "rogue dimensions not compared"
            )
            return False
        return True

    if not usable(base):
        return pd.DataFrame(columns=ROGUE_COLUMNS), summary, notes
    base_flags = _outliers(base.dims)
    for run in runs[1:]:
        if not usable(run):
            continue
        if run.hidden_size != base.hidden_size:
            notes.append(
                f"{run.label}: hidden size {run.hidden_size} != {base.hidden_size} of the "
                "baseline, so its dimensions are not the baseline's; rogue dimensions not compared"
            )
            continue
        flags = _outliers(run.dims)
        reliable = run.label not in unreliable and base.label not in unreliable
        appeared: dict[str, list[int]] = {}
        vanished: dict[str, list[int]] = {}
        for b, o in match_layers(base, run, mode):
            if b not in base_flags or o not in flags:
                continue
            before, after = set(base_flags[b]), set(flags[o])
            bstats, rstats = _dim_stats(base.dims, b), _dim_stats(run.dims, o)
            for change, dims, out in (
                ("appeared", sorted(after - before), appeared),
                ("vanished", sorted(before - after), vanished),
            ):
                if dims:
                    out[str(b)] = dims
                rows += [
                    [run.label, b, o, d, change]
                    + [_stat(st, d, col) for col in ("mean", "std") for st in (bstats, rstats)]
                    + [reliable]
                    for d in dims
                ]
        summary[run.label] = {"appeared": appeared, "vanished": vanished, "reliable": reliable}
    df = pd.DataFrame(rows, columns=ROGUE_COLUMNS)
    types = {"layer": np.int64, "run_layer": np.int64, "dim": np.int64, "reliable": bool}
    return df.astype(types), summary, notes


def _fmt(x: float) -> str:
    return "nan" if not math.isfinite(x) else f"{x:.4g}"


def compared_line(labels: Sequence[str]) -> str:
    """``compared 1 run against BASE`` / ``compared N runs against BASE`` (N: the later runs)."""
    n = len(labels) - 1
    return f"compared {n} run{'' if n == 1 else 's'} against {labels[0]}"


def _change_line(r: Any) -> str:
    """One printed change: values, change, relative change, and its evidence."""
    rel = "" if not math.isfinite(r.relative) else f", {r.relative:+.1%}"
    at = f"layer {r.layer}" + (f"/{r.run_layer}" if r.run_layer != r.layer else "")
    if r.evidence in (BEYOND_NOISE, WITHIN_NOISE):
        how = f"z {r.z:+.1f}" + (", within noise" if r.evidence == WITHIN_NOISE else "")
    else:
        how = r.evidence
    return (
        f"{r.run}  {r.metric}  {at}: {_fmt(r.baseline)} -> {_fmt(r.value)} "
        f"({r.change:+.4g}{rel}; {how})"
    )


def _reasons(notes: Iterable[str]) -> str:
    """The metrics' ``not_comparable`` reasons of one layer as one, each part once (every
    cluster-adjusted metric carries the same "k decision not robust" part)."""
    parts = (part for note in notes for part in note.split("; "))
    return "; ".join(dict.fromkeys(parts))


def clustering_notes(changes: pd.DataFrame) -> list[str]:
    """One line per (run, layer) whose K-means clustering changed (:func:`clustering_change`)."""
    moved = changes.loc[changes["evidence"] == CLUSTERING_CHANGED]
    notes = []
    for (run, layer), group in moved.groupby(["run", "layer"], sort=False):
        why = _reasons(group["not_comparable"])
        notes.append(
            f"{run} layer {layer}: the K-means clustering changed ({why}): its "
            f"{len(group)} cluster-dependent metric{'s are' if len(group) != 1 else ' is'} "
            "not comparable and not ranked by z"
        )
    return notes


def clipping_notes(changes: pd.DataFrame, baseline: str) -> list[str]:
    """One line per (run, layer) whose clipped metrics zeroed other dimensions
    (:func:`clipping_change`), by run and layer."""
    moved = changes.loc[changes["evidence"] == CLIPPING_CHANGED]
    order = {run: i for i, run in enumerate(dict.fromkeys(moved["run"]))}
    moved = moved.sort_values("layer", kind="stable").sort_values(
        "run", key=lambda runs: runs.map(order), kind="stable"
    )
    notes = []
    for (run, layer), group in moved.groupby(["run", "layer"], sort=False):
        why = _reasons(group["not_comparable"])
        n = len(group)
        notes.append(
            f"{run} layer {layer}: the runs zeroed other dimensions ({why}: only in {baseline} "
            f"-> only in {run}): its {n} clipped metric{'s are' if n != 1 else ' is'} not "
            "comparable and not ranked among the changes"
        )
    return notes


def not_robust_notes(changes: pd.DataFrame) -> list[str]:
    """One line per (run, layer) whose K-means k moved where the decision is not robust
    (:func:`k_not_robust`): not comparable, not a change."""
    moved = changes.loc[changes["evidence"] == K_NOT_ROBUST]
    notes = []
    for (run, layer), group in moved.groupby(["run", "layer"], sort=False):
        why = _reasons(group["not_comparable"])
        notes.append(
            f"{run} layer {layer}: the K-means k decision is not robust ({why}): not a change, "
            f"and its {len(group)} cluster-dependent metric{'s are' if len(group) != 1 else ' is'}"
            " not comparable"
        )
    return notes


def compare_runs(
    run_dirs: Sequence[str],
    out: str,
    *,
    labels: Sequence[str] | None = None,
    top: int = 20,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Compare complete runs (the first is the baseline); writes ``out``; returns the summary."""
    out = _checked_out(run_dirs, out)
    for url in run_dirs:  # an object store that does not answer: one line at once
        check_input(url, "run")
    check_output(out)
    labels = check_labels(labels if labels is not None else default_labels(run_dirs), len(run_dirs))
    runs = [load_run(d, lab) for d, lab in zip(run_dirs, labels, strict=True)]
    mode, note = layer_matching(runs)
    metrics = metric_columns(runs)
    long = long_table(runs, metrics)
    wide = wide_table(runs, metrics, mode)
    changes = changes_table(runs, metrics, mode)
    threshold = size_threshold(runs)
    small = small_runs(runs, threshold)
    warning = size_warning(runs)
    rogue, rogue_summary, rogue_notes = rogue_changes(runs, mode, small)
    digests: dict[str, Digest] = {}
    files = [
        write_table(out, LONG, long, digests=digests),
        write_table(out, WIDE, wide, digests=digests),
        write_table(out, CHANGES, changes, digests=digests),
        write_table(out, ROGUE, rogue, digests=digests),
    ]
    moved = changes.loc[changes["change"] != 0]
    listed = moved.loc[~moved["evidence"].isin(NOT_A_CHANGE)]
    largest = listed.head(top)
    lists = {name: listed.loc[listed["evidence"].isin(group)].head(top)
             for name, group in (("exact", EXACT_LIST), ("sampled", SAMPLED_LIST),
                                 ("not_comparable", APART_LIST))}  # fmt: skip
    tests = sampled_tests(changes)
    summary: dict[str, Any] = {
        "created_at": now(),
        "baseline": labels[0],
        "runs": [_run_summary(r) for r in runs],
        "layer_matching": mode,
        "layer_matching_note": note,
        "metrics": metrics,
        "not_ranked": [m for m in NOT_RANKED if m in metrics],
        "noise_z": NOISE_Z,
        "evidence_counts": {e: int((moved["evidence"] == e).sum()) for e in EVIDENCE_ORDER},
        "clustering_changed": clustering_notes(changes),
        "clipping_changed": clipping_notes(changes, labels[0]),
        "k_not_robust": not_robust_notes(changes),
        "bounds": {"exact": EXACT_BOUND, "sampled": SAMPLED_BOUND, "robust_support": ROBUST_SUPPORT},
        "largest_changes": _records(largest),
        "largest_exact": _records(lists["exact"]),
        "largest_sampled": _records(lists["sampled"]),
        "largest_not_comparable": _records(lists["not_comparable"]),
        "sampled_tests": tests,
        "chance_beyond_noise": CHANCE_BEYOND,
        "rogue_dims": rogue_summary,
        "size_threshold": threshold,
        "small_runs": small,
        "size_warning": warning,
        "notes": ([warning] if warning else []) + rogue_notes,
        "files": files,
        "digests": digests_json(digests),
    }
    echo(f"{compared_line(labels)}; {note}")
    if warning:
        echo(f"warning: {warning}")
    _echo_changes(changes, lists, moved, tests, labels[0], echo)
    _echo_rogue(rogue_summary, echo)
    for n in summary["clustering_changed"] + summary["clipping_changed"] + summary["k_not_robust"]:
        echo(f"note: {n}")
    for n in rogue_notes:
        echo(f"note: {n}")
    _write_report(runs, out, changes, pd.concat(list(lists.values())), summary, echo)
    atomic_write_json(join(out, SUMMARY), seal(summary))
    echo(f"outputs in {out}: {', '.join([*files, SUMMARY])}")
    return summary


def _records(df: pd.DataFrame) -> list[dict[str, Any]]:
    return json.loads(df.to_json(orient="records", double_precision=15))


def _checked_out(run_dirs: Sequence[str], out: str) -> str:
    """``out`` without a trailing slash, once at least two runs are given and ``out`` is none
    of them, nor any other run (its report.html would replace theirs); a
    :class:`CompareError` otherwise."""
    if len(run_dirs) < 2:
        raise CompareError(f"a comparison needs at least two runs, got {len(run_dirs)}")
    out = str(out).rstrip("/") or "/"
    for d in run_dirs:
        if location(d) == location(out):
            raise CompareError(
                f"--out {out} is one of the runs compared; its report.html would be replaced: "
                "give another directory"
            )
    if RunDir(out).holds_run():
        raise CompareError(
            f"--out {out} holds a run; its report.html would be replaced: give another directory"
        )
    return out


def _run_summary(r: RunView) -> dict[str, Any]:
    """One run's entry in ``comparison.json``'s ``runs``: where it is, what it measured
    (model, revision, corpus, fingerprints), its shape, ``tokens`` and ``sample_size``."""
    return {
        "label": r.label,
        "path": r.path,
        "model": r.manifest.model.id if r.manifest.model else None,
        "revision": r.manifest.model.revision if r.manifest.model else None,
        "corpus": r.manifest.corpus.source,
        "corpus_fingerprint": r.manifest.corpus.fingerprint,
        "fingerprint": r.manifest.fingerprint,
        "num_layers": r.num_layers,
        "hidden_size": r.hidden_size,
        "tokens": r.manifest.counts.tokens if r.manifest.counts else None,
        "sample_size": r.sample_size,
        "layers": [int(x) for x in r.layers["layer"]],
    }


def unchanged_line(changes: pd.DataFrame, baseline: str) -> str:
    """What compare prints, and its report shows, when no list has a change: that no layer
    was matched (``changes`` has no row: runs of one model that measured no layer in common),
    that every difference is within the bounds of the same result (:func:`agrees`), or that
    no metric changed at all."""
    if not len(changes):
        return "no layer of one run was matched with a layer of another: nothing to compare"
    same = int(((changes["change"] != 0) & (changes["evidence"] == AGREE)).sum())
    if same:
        return (
            f"no change: every metric agrees with {baseline}'s (exact ones within "
            f"{EXACT_BOUND:g} relative, sampled ones within {SAMPLED_BOUND:g}; {same} differ "
            "within these bounds)"
        )
    return "no metric changed"


def _echo_changes(
    changes: pd.DataFrame,
    lists: dict[str, pd.DataFrame],
    moved: pd.DataFrame,
    tests: dict[str, dict[str, Any]],
    baseline: str,
    echo: Callable[[str], None],
) -> None:
    """Print the ten largest exact changes, then how the runs' sampled changes stand against
    chance (:func:`sampled_tests`) and the ten first sampled ones, each list in the order of
    :func:`changes_table` (``lists``: ``exact``, ``sampled``, ``not_comparable``), how many of
    the non-zero changes ``moved`` are within noise, not comparable or agree within the
    bounds; or, when no list has a change, :func:`unchanged_line`."""
    same = int((moved["evidence"] == AGREE).sum())
    if not any(len(df) for df in lists.values()):
        echo(unchanged_line(changes, baseline))
        return
    exact, sampled = lists["exact"], lists["sampled"]
    if len(exact):
        echo(
            f"largest exact changes against {baseline} (over every token, no sampling error; "
            "by |change| / the metric's range):"
        )
        for r in exact.head(10).itertuples():
            echo("  " + _change_line(r))
    else:
        echo(f"no exact metric changed against {baseline}")
    echo(f"sampled changes against {baseline} (beyond noise by |z|, then without a standard error):")
    for run, t in tests.items():
        echo("  " + tests_line(run, t))
    for r in sampled.head(10).itertuples():
        echo("  " + _change_line(r))
    quiet = int((moved["evidence"] == WITHIN_NOISE).sum())
    if quiet:
        echo(
            f"{quiet} change{'s' if quiet != 1 else ''} of sampled metrics within noise "
            f"(|z| < {NOISE_Z:g}), ranked after the others"
        )
    apart = int(moved["evidence"].isin(APART_LIST).sum())
    if apart:
        echo(
            f"{apart} change{'s' if apart != 1 else ''} not comparable (another clustering, or "
            "other dimensions zeroed: the notes below), ranked apart"
        )
    if same:
        echo(
            f"{same} difference{'s' if same != 1 else ''} within the bounds of the same result "
            f"(exact {EXACT_BOUND:g}, sampled {SAMPLED_BOUND:g} relative): not changes"
        )


def _echo_rogue(rogue_summary: dict[str, Any], echo: Callable[[str], None]) -> None:
    """Print, per later run, the rogue dimensions that appeared and vanished per layer
    (:func:`rogue_changes`' summary), with a caveat when the comparison is not reliable."""
    for label, s in rogue_summary.items():
        caveat = "" if s["reliable"] else " (not reliable: a run has fewer tokens than the sample)"
        for change in ("appeared", "vanished"):
            by_layer = s[change]
            text = "; ".join(f"layer {k}: {v}" for k, v in by_layer.items()) or "none"
            echo(f"rogue dimensions that {change} in {label}: {text}{caveat if by_layer else ''}")


def _write_report(
    runs: Sequence[RunView],
    out: str,
    changes: pd.DataFrame,
    listed: pd.DataFrame,
    summary: dict[str, Any],
    echo: Callable[[str], None],
) -> None:
    """Write ``report.html`` (:func:`~embgeom_ray.report.html.write_comparison_report`: the
    ``listed`` changes, each list's ``--top`` largest, or, with none, what
    :func:`unchanged_line` says of ``changes``) and record it in ``summary`` (``report`` and ``files``), or, when it fails, record and print
    why (``report_error``): the tables are written already and must not be lost."""
    try:
        from ..report.html import write_comparison_report

        write_comparison_report(
            runs, out, changes=listed,
            matching_note=summary["layer_matching_note"], labels=[r.label for r in runs],
            warning=summary["size_warning"], unchanged=unchanged_line(changes, summary["baseline"]),
            sampled_tests=[tests_line(run, t) for run, t in summary["sampled_tests"].items()],
        )  # fmt: skip
    except Exception as exc:  # the tables are written; a plotting failure must not lose them
        summary["report_error"] = f"{type(exc).__name__}: {exc}"
        echo(f"warning: the report could not be written ({summary['report_error']})")
    else:
        summary["report"] = "report.html"
        summary["files"].append("report.html")
