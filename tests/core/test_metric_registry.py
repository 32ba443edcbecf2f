"""The metric registry (core/metric_registry.py) against what reads it: every column declared
once, docs/outputs.md's column tables, the report's and the comparison's lists.

That each table the job builds holds exactly the registry's columns, in order, is checked where
the tables are built (tests/core/test_tables.py, ``test_sampled_stage_parts``).
"""

from __future__ import annotations

import importlib
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from embgeom_ray.core import metric_registry as registry
from embgeom_ray.core import metrics
from embgeom_ray.core.statistics import EmbeddingStatistics
from tests.outputs_doc import documented_columns

LAYER_SECTIONS = {
    registry.EXACT_SECTION: "`layers.parquet`: exact columns",
    registry.CLIPPING_SECTION: "`layers.parquet`: clipping columns",
    registry.SAMPLED_SECTION: "`layers.parquet`: sampled columns",
}
TABLES = {
    registry.TYPE_STATS: "`type_stats.parquet`",
    registry.DIMS: "`dims.parquet`",
    registry.POSITIONS: "`positions.parquet`",
    registry.KMEANS: "`kmeans.parquet`",
}


def test_outputs_md_documents_exactly_the_declared_columns() -> None:
    """Each column table of docs/outputs.md names the columns the registry declares for it, no
    more and none fewer; the ``<metric>_se`` row lists the metrics with a standard error."""
    for section, heading in LAYER_SECTIONS.items():
        documented, se = documented_columns(heading)
        declared = registry.columns(registry.LAYERS, section)
        assert sorted(documented) == sorted(declared), heading
        if section == registry.SAMPLED_SECTION:
            assert se == registry.SE_METRICS
        else:
            assert se == []
    documented, _ = documented_columns(LAYER_SECTIONS[registry.EXACT_SECTION])
    assert documented == registry.columns(registry.LAYERS, registry.EXACT_SECTION)
    for table, heading in TABLES.items():
        assert documented_columns(heading) == (registry.columns(table), []), heading


def test_each_column_is_declared_once_and_consistently() -> None:
    twice = [
        key for key, n in Counter((m.table, m.column) for m in registry.METRICS).items() if n > 1
    ]
    assert twice == []
    layer_columns = registry.layer_columns()
    assert len(layer_columns) == len(set(layer_columns))
    for m in registry.METRICS:
        assert m.definition and m.source, m.column
        assert m.kind in ("exact", "sampled") and m.fmt in (
            "int",
            "sci",
            "unit",
            "corr",
            "text",
            "bool",
        )
        if m.table != registry.LAYERS:
            assert not (m.header or m.se or m.plotted or m.summary or m.depends_on), m.column
            continue
        assert m.section in LAYER_SECTIONS, m.column
        assert bool(m.header) == bool(m.tooltip), m.column
        # a standard error, or a dependence on the chosen k, is of a sampled metric; a
        # dependence on the dimensions zeroed, of a clipped one
        k_dependent = m.depends_on in ("kmeans_k", "kmeans_best_k")
        assert m.kind == "sampled" or not (m.se or k_dependent), m.column
        if m.depends_on in ("outlier_dims", "clip_dims_exact"):
            assert m.section == registry.CLIPPING_SECTION and "_clipped" in m.column, m.column
        # the sampled section is sampled, the exact section exact
        if m.section != registry.CLIPPING_SECTION:
            assert m.kind == m.section, m.column
    assert registry.kind_of("kmeans_silhouette_se") == "sampled"
    assert registry.kind_of("participation_ratio") == "exact"
    assert registry.kind_of("no_such_column") is None


def test_every_source_names_a_function_of_the_package() -> None:
    for m in registry.METRICS:
        module, name = m.source.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(module), name)), m.source


def test_what_reads_the_registry() -> None:
    from embgeom_ray.core import rogue, sampled_metrics, tables
    from embgeom_ray.report import html
    from embgeom_ray.report.figures.compare import COMPARE_METRICS
    from embgeom_ray.runs import compare

    exact = registry.columns(registry.LAYERS, registry.EXACT_SECTION)
    assert metrics.LAYER_COLUMNS == html.EXACT_COLUMNS == exact
    assert metrics.TYPE_COLUMNS == registry.columns(registry.TYPE_STATS)
    assert rogue.DIMS_COLUMNS == registry.columns(registry.DIMS)
    assert tables.KMEANS_COLUMNS == registry.columns(registry.KMEANS)
    assert sampled_metrics.SE_METRICS == registry.SE_METRICS
    assert sampled_metrics.SAMPLED_LAYER_COLUMNS == [
        *registry.columns(registry.LAYERS, registry.SAMPLED_SECTION),
        *registry.SE_COLUMNS,
    ]
    layer_columns = set(registry.layer_columns())
    # the lists the report and the comparison still write out name declared columns
    for listed in (html.COLUMNS, html.SAMPLED_COLUMNS, COMPARE_METRICS, compare.NOT_RANKED,
                   compare.SAMPLED, compare.CLUSTER_ADJUSTED, compare.BEST_K_DEPENDENT):  # fmt: skip
        assert set(listed) <= layer_columns
    assert compare.BEST_K_DEPENDENT == ("kmeans_stability",)
    assert "adjusted_s_inter_se" in compare.CLUSTER_ADJUSTED
    assert compare.SAMPLED == {c for c in layer_columns if registry.kind_of(c) == "sampled"}
    # the report shows every column with a header, the standard errors by their metric's
    assert html.COLUMNS["participation_ratio"] == (
        "PR",
        registry.metric("participation_ratio").tooltip,
        "sci",
    )
    assert html.COLUMNS["lid_cosine_se"][0] == "LID cos. se"
    assert "kmeans_k_at_cap" not in html.COLUMNS  # shown beside kmeans_k, not as a column


def _stats() -> EmbeddingStatistics:
    rng = np.random.default_rng(3)
    stats = EmbeddingStatistics([0, 2], 6)
    h = rng.normal(size=(2, 4, 9, 6)) + 5.0
    stats.update(torch.as_tensor(h), torch.as_tensor(rng.integers(0, 5, size=(4, 9))))
    return stats


def test_layer_row_and_summary_follow_the_registry() -> None:
    """The exact row :func:`~embgeom_ray.core.metrics.layer_row_from` writes out holds the
    registry's exact section, in order; the printed summary its ``summary`` columns."""
    from embgeom_ray.run_dir import format_summary

    stats = _stats()
    row = metrics.layer_row(stats.layer(2))
    assert list(row) == registry.columns(registry.LAYERS, registry.EXACT_SECTION)
    table = metrics.layers_table(stats)
    header = format_summary(pd.concat([table, table.assign(isoscore_sample=0.5)])).splitlines()[0]
    assert header.split() == registry.summary_columns()


@pytest.mark.parametrize("column", ["participation_ratio", "isoscore", "kmeans_silhouette"])
def test_a_metric_is_one_lookup(column: str) -> None:
    m = registry.metric(column)
    assert m.table == registry.LAYERS and m.plotted and m.paper
    with pytest.raises(KeyError, match="no metric"):
        registry.metric(column, registry.DIMS)


def test_cosine_definitions_say_which_pairs() -> None:
    """anisotropy leaves out each token's pair with itself (at N = 80,253 MiniLM tokens that is
    0.069869 against 0.069881 with it): its definition says so, in the registry and the docs."""
    definition = registry.metric("anisotropy").definition
    assert "(i ≠ j)" in definition and "(‖U‖² − N) / (N(N − 1))" in definition
    docs = (Path(__file__).parents[2] / "docs" / "outputs.md").read_text(encoding="utf-8")
    row = next(r for r in docs.splitlines() if r.startswith("| `anisotropy` |"))
    assert "i ≠ j" in row and "(‖U‖² − N) / (N(N − 1))" in row
    # the same of a type's self-similarity, whose "all ordered pairs" read as if each
    # occurrence's pair with itself counted
    definition = registry.metric("self_similarity", registry.TYPE_STATS).definition
    row = next(r for r in docs.splitlines() if r.startswith("| `self_similarity` |"))
    for text in (definition, row):
        assert "i ≠ j" in text and "(‖U_t‖² − n_t) / (n_t(n_t − 1))" in text


def test_the_reports_tables_and_figures_read_declared_columns() -> None:
    """The report's tables take their columns from the registry: the sampled table is its
    sampled section (a hand-kept list of the clipping columns decided what it left out, so a
    new clipping column would have landed in it), the clipping table its clipping section.
    Every column a figure draws is declared: a renamed column would otherwise vanish from the
    figure without a word (``RunView.layer_col`` gives None for a column a run lacks)."""
    from embgeom_ray.report import html
    from embgeom_ray.report.figures import clusters, isotropy
    from embgeom_ray.report.figures.clipping import clipping_pairs

    sampled = registry.columns(registry.LAYERS, registry.SAMPLED_SECTION)
    assert html.SAMPLED_COLUMNS == [c for c in sampled if registry.metric(c).header]
    assert not {"anisotropy_clipped", "s_inter_sampled"} & set(html.SAMPLED_COLUMNS)
    every = registry.layer_columns()
    pairs = clipping_pairs(every)
    clipped = {c for p in pairs for c in (p.base, p.clipped)}
    clipping = set(registry.columns(registry.LAYERS, registry.CLIPPING_SECTION))
    keys = {"n_outlier_dims", "outlier_dims", "clip_dims_exact"}  # the table's own columns
    assert clipping - keys <= clipped <= set(every)
    drawn = [c for c, *_ in (*isotropy.COSINE_LINES, *isotropy.ISOTROPY_LINES)]
    drawn += [*clusters.LID_COLUMNS, *clusters.LID_LABELS, *clusters.SILHOUETTE_LABELS]
    drawn += ["norm_variance_corr", "within_variance", "between_variance", "within_ratio"]
    assert set(drawn) <= set(every)


def test_the_k_support_texts_state_the_codes_numbers() -> None:
    """The registry imports nothing of the package, so its texts (and docs/outputs.md's) spell
    the support's resamples and its robustness bound: they must be the code's
    (``kmeans_selection.SUPPORT_RESAMPLES``, ``ROBUST_SUPPORT``, which compare and the report
    read; compare kept its own 0.9 before)."""
    from embgeom_ray.core.kmeans_selection import ROBUST_SUPPORT, SUPPORT_RESAMPLES
    from embgeom_ray.runs import compare

    assert compare.ROBUST_SUPPORT is ROBUST_SUPPORT
    resamples, below = f"{SUPPORT_RESAMPLES} bootstrap resamples", f"below {ROBUST_SUPPORT:g}"
    for column in ("kmeans_k_support", "kmeans_structure_support"):
        assert resamples in registry.metric(column).definition, column
    assert below in registry.metric("kmeans_k_support").tooltip
    docs = (Path(__file__).parents[2] / "docs" / "outputs.md").read_text(encoding="utf-8")
    row = next(r for r in docs.splitlines() if r.startswith("| `kmeans_k_support`"))
    assert resamples in row and f"{below} the sample does not settle it" in row


def test_column_ranges_in_the_docs_span_a_whole_section() -> None:
    """A doc that names the columns of a section as a range, `first` … `last`, names that
    section's first and last column: docs/operations.md's exact metrics ran `n_tokens` …
    `s_intra`, leaving out `participation_ratio`, declared exact after it."""
    import re

    root = Path(__file__).parents[2]
    sections = [
        registry.columns(registry.LAYERS, s)
        for s in (registry.EXACT_SECTION, registry.CLIPPING_SECTION, registry.SAMPLED_SECTION)
    ]
    ranges = []
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = doc.read_text(encoding="utf-8")
        for first, last in re.findall(r"`([a-z_]+)` … `([a-z_]+)`", text):
            if registry.kind_of(first) and registry.kind_of(last):
                ranges.append((doc.name, first, last))
                # first: the section's first column, or its second after the key ``layer``
                assert any(
                    first in cols[:2] and last == cols[-1] for cols in sections
                ), (doc.name, first, last)
    assert ("operations.md", "n_tokens", "participation_ratio") in ranges


def test_the_stores_headlines_read_declared_exact_columns() -> None:
    """runs.parquet's headline columns are read from declared exact columns of layers.parquet
    (a renamed column would have left them NaN without a word)."""
    from embgeom_ray.runs import reanalyze

    heads = reanalyze.LAST_LAYER_HEADLINES | reanalyze.MEAN_HEADLINES
    assert {c for c in reanalyze.INDEX_COLUMNS if c.endswith(("_last", "_mean"))} == set(heads)
    assert all(registry.kind_of(column) == "exact" for column in heads.values())
