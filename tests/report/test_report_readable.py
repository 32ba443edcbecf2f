"""The report says what it shows (issue 19): the k at the cap of the K-means search, layers
where k = 1 was chosen, one number notation per column, the model's short name, and the
clipping figure and table comparing like with like.

A fabricated run (:func:`tests.report.test_report.fabricate_run`) has its ``layers.parquet`` and
manifest rewritten with layers crafted for each case; the checks read the HTML text and the
data the figures plot (:func:`~embgeom_ray.report.figures.clipping.clipping_panels`,
:func:`~embgeom_ray.report.figures.clusters.kmeans_labels`,
:func:`~embgeom_ray.report.figures.pca.pca_cluster_titles`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from embgeom_ray.report.figures.clipping import clipping_pairs, clipping_panels
from embgeom_ray.report.figures.clusters import kmeans_labels
from embgeom_ray.report.figures.pca import NO_CLUSTERS, pca_cluster_titles
from embgeom_ray.report.html import (
    AT_CAP,
    clipping_table_html,
    fmt_value,
    format_column,
    kmeans_cells,
    write_report,
)
from embgeom_ray.report.plots import draw_figures, make_all_plots
from embgeom_ray.run_view import RunView, model_name, short_name
from tests.report.test_report import fabricate_run

MODEL_PATH = "/srv/models/my-minilm-l6/model"


def _craft(out: Path, *, sampled: bool = True) -> Path:
    """A 5-layer run: k = 1 at layer 0, the best k at the cap at layers 1 and 3, I(W) spanning
    5.57e-4 … 0.4, LIDs needing different decimals, a local model path, standard errors."""
    fabricate_run(out, n_layers=5, optional=True)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["model"]["id"] = MODEL_PATH
    manifest["config"] |= {"model": MODEL_PATH, "kmeans_k_max": 60, "kmeans_min_silhouette": 0.1}
    manifest["sample"] = {"uniform_points": 512, "type_uniform_points": 140}
    (out / "manifest.json").write_text(json.dumps(manifest))
    lay = pd.read_parquet(out / "layers.parquet")
    lay = lay.assign(
        kmeans_k=[1, 60, 3, 60, 2],
        kmeans_best_k=[4, 60, 3, 60, 2],
        kmeans_k_searched=[15, 60, 15, 60, 15],
        kmeans_k_at_cap=[False, True, False, True, False],
        kmeans_stability=[0.41, 0.62, 0.97, 0.55, 0.99],
        kmeans_silhouette=[0.08, 0.134, 0.3, 0.2, 0.25],
        partition_isotropy=[5.57e-4, 0.1176, 0.2, 0.3, 0.4],
        lid_euclidean=[19.7, 27.3, 123.46, 9.99996, 5.0],
        lid_euclidean_median=[5.3, 14.6, 12.0, 8.0, 4.0],
        lid_euclidean_cai=[9.1, 13.2, 60.1, 4.9, 2.4],
        adjusted_s_inter_weighted=[0.028, 0.03, 0.04, 0.05, 0.06],
        kmeans_silhouette_se=[0.004, 0.0031, 0.002, 0.0051, 0.0012],
        lid_euclidean_se=[0.4, 0.31, 0.2, 0.51, 0.12],
    )
    if not sampled:
        lay = lay.drop(columns=["anisotropy_sampled", "s_inter_sampled", "s_intra_sampled"])
    lay.to_parquet(out / "layers.parquet", index=False)
    return out


@pytest.fixture(scope="module")
def crafted(tmp_path_factory) -> Path:
    return _craft(tmp_path_factory.mktemp("crafted") / "run")


@pytest.fixture(scope="module")
def crafted_figs(crafted) -> list:
    """Every figure of the crafted run (absent ones included), drawn once for the module: the
    report's figures and the ones whose captions are checked (~6 s to draw)."""
    return make_all_plots(RunView(str(crafted)), include_absent=True, strict=True)


@pytest.fixture(scope="module")
def crafted_html(crafted, crafted_figs) -> str:
    return Path(write_report(str(crafted), figures=crafted_figs)).read_text(encoding="utf-8")


def _table_after(html: str, heading: str) -> str:
    start = html.index(f"<h3>{heading}</h3>")
    return html[start : html.index("</table>", start)]


def _headers(table: str) -> list[str]:
    return re.findall(r"<th[^>]*>([^<]*)</th>", table)


def _rows(table: str) -> list[list[str]]:
    body = table[table.index("<tbody>") :]
    return [
        [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row)]
        for row in re.findall(r"<tr>(.*?)</tr>", body)
    ]


# --------------------------------------------------------------------------------------------
# the number formatter


def test_format_column_one_notation_per_column():
    # a column with a value below 1e-3 is scientific in every cell (I(W) of issue 19)
    assert format_column([5.57e-4, 0.1176, None, float("nan")], "sci") == [
        "5.570e−4",
        "1.176e−1",
        "—",
        "—",
    ]
    # otherwise fixed, 4 significant digits, thousands separated, U+2212 minus
    assert format_column([0.1176, 12.3456, 1234.56, 99999.0, 9.99996, -0.5, 0.00123456]) == [
        "0.1176",
        "12.35",
        "1,235",
        "99,999",
        "10.00",
        "−0.5000",
        "0.001235",
    ]
    assert format_column([2.5e6, 3.0]) == ["2.500e6", "3.000e0"]  # huge values: scientific
    assert format_column([0.0, 0.5]) == ["0", "0.5000"]  # zero does not force scientific
    assert format_column([0.5, -0.25, 1e-5], "unit") == ["0.500", "−0.250", "0.000"]
    assert format_column([-0.43, 0.1], "corr") == ["−0.43", "+0.10"]
    assert format_column([80253, 1.0, None], "int") == ["80,253", "1", "—"]
    assert format_column(["3,7", None, "x" * 60], "text") == ["3, 7", "—", "x" * 47 + "…"]
    # one cell alone is a column of one
    assert fmt_value(5.57e-4) == "5.570e−4" and fmt_value(0.1176) == "0.1176"


def test_report_columns_use_one_notation(crafted_html):
    table = _table_after(crafted_html, "Sampled metrics")
    heads = _headers(table)
    rows = _rows(table)
    col = heads.index("I(W)")
    assert [r[col] for r in rows] == ["5.570e−4", "1.176e−1", "2.000e−1", "3.000e−1", "4.000e−1"]
    col = heads.index("LID eucl.")
    assert [r[col] for r in rows] == ["19.70", "27.30", "123.5", "10.00", "5.000"]
    # nowhere in the report's tables does one column mix notations
    for t in re.findall(r"<table.*?</table>", crafted_html, re.S):
        cells = _rows(t)
        for j in range(max(map(len, cells), default=0)):
            values = [r[j] for r in cells if j < len(r)]
            sci = [bool(re.fullmatch(r"−?\d\.\d{3}e−?\d+", v)) for v in values if v != "—"]
            assert all(sci) or not any(sci), values


# --------------------------------------------------------------------------------------------
# K-means: the cap and k = 1


def test_kmeans_cells():
    cap = pd.Series({"kmeans_k": 60, "kmeans_best_k": 60, "kmeans_k_at_cap": True})
    cap["kmeans_silhouette"] = 0.134
    assert kmeans_cells(cap) == {
        "kmeans_k": f"60 {AT_CAP}",
        "kmeans_best_k": f"60 {AT_CAP}",
        "kmeans_silhouette": "0.134",
    }
    one = pd.Series({"kmeans_k": 1, "kmeans_best_k": 4, "kmeans_silhouette": 0.08})
    cells = kmeans_cells(one)
    assert cells["kmeans_k"] == "1 (best k&gt;1: 4, silhouette 0.080, rejected)"
    assert cells["kmeans_silhouette"] == "(0.080, rejected)"
    # an older run without kmeans_best_k / kmeans_k_at_cap
    old = pd.Series({"kmeans_k": 1, "kmeans_silhouette": 0.05})
    assert kmeans_cells(old)["kmeans_k"] == "1 (silhouette 0.050, rejected)"
    assert kmeans_cells(pd.Series({"kmeans_k": 3, "kmeans_silhouette": 0.3}))["kmeans_k"] == "3"


def test_report_marks_k_at_cap_and_k_1(crafted_html):
    table = _table_after(crafted_html, "Sampled metrics")
    heads, rows = _headers(table), _rows(table)
    k, sil, best = heads.index("k"), heads.index("silh. (k-m)"), heads.index("best k")
    assert [r[k] for r in rows] == [
        "1 (best k&gt;1: 4, silhouette 0.080, rejected)",
        f"60 {AT_CAP}",
        "3",
        f"60 {AT_CAP}",
        "2",
    ]
    assert [r[sil] for r in rows] == ["(0.080, rejected)", "0.134", "0.300", "0.200", "0.250"]
    assert [r[best] for r in rows][:2] == ["4", f"60 {AT_CAP}"]
    # the footnotes say what the mark and the k = 1 rows mean
    assert f"<b>{AT_CAP}</b> (layers 1, 3)" in crafted_html
    assert "--kmeans-k-max 60" in crafted_html and "no interior optimum" in crafted_html
    assert "<b>k = 1</b> (layers 0)" in crafted_html
    assert "below --kmeans-min-silhouette (0.1)" in crafted_html


def test_figures_mark_k_at_cap_and_k_1(crafted, crafted_figs):
    run = RunView(str(crafted))
    assert kmeans_labels(run) == {
        0: "k=1 (best 4 rejected)",
        1: "k=60▲",
        2: "k=3",
        3: "k=60▲",
        4: "k=2",
    }
    assert kmeans_labels(run, short=True)[0] == "k=1"
    titles = pca_cluster_titles(run, [0, 1, 2, 4])
    assert titles == {
        0: NO_CLUSTERS,
        1: "K-means cluster (k=60▲)",
        2: "K-means cluster (k=3)",
        4: "K-means cluster (k=2)",
    }
    assert NO_CLUSTERS == "no clusters (k = 1)"
    figs = {f.name: f for f in crafted_figs}
    assert "Layer 0: no clusters (k = 1)" in figs["pca_2d"].caption
    assert "▲ at cap" in figs["pca_2d"].caption
    assert "hollow point" in figs["intrinsic_dim"].caption
    assert "“k=1, rejected”" in figs["isoscore_silhouette"].caption
    assert "no interior optimum" in figs["intrinsic_dim"].caption
    assert "no interior optimum" in figs["cosine_isotropy"].caption
    # the size-weighted cluster-adjusted cosine is drawn and said so (the run has it)
    assert "Dash-dotted" in figs["cosine_isotropy"].caption
    assert "median" in figs["intrinsic_dim"].caption and "exact convention" in (
        figs["intrinsic_dim"].caption
    )


# --------------------------------------------------------------------------------------------
# the model's name


def test_model_name():
    assert model_name("org/fake-bert") == "org/fake-bert"
    assert model_name("bert-base-uncased") == "bert-base-uncased"
    assert model_name("hf://org/x") == "org/x"
    assert model_name(MODEL_PATH) == "my-minilm-l6"
    assert model_name("/data/checkpoints/run7/") == "run7"
    snap = "/root/.cache/huggingface/hub/models--sentence-transformers--all-MiniLM-L6-v2/"
    assert model_name(snap + "snapshots/" + "0a" * 20) == "sentence-transformers/all-MiniLM-L6-v2"
    assert model_name("s3://bucket/models/my-bert") == "my-bert"


def test_a_merged_runs_corpora_are_named_each_by_its_short_name(tmp_path):
    """A merged run's corpus source is the list of its runs' (a merge of merges: nested):
    named as the corpora joined, each shortened, not as the list's text."""
    run = _craft(tmp_path / "run")
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["corpus"]["source"] = ["/data/a/news.jsonl", ["/data/b/web.parquet", "hf:imdb"]]
    (run / "manifest.json").write_text(json.dumps(manifest))
    view = RunView(str(run))
    assert view.corpus == "/data/a/news.jsonl + /data/b/web.parquet + hf:imdb"
    assert short_name(view.corpus) == "news.jsonl + web.parquet + hf:imdb"
    assert view.tag.endswith("· news.jsonl + web.parquet + hf:imdb")


def test_a_merged_runs_report_says_what_it_merged(tmp_path):
    """A merge's report (a merge of a merge and a run) names it a merge of its runs, lists each
    with its corpora, tokens and end, and gives its corpus and stages as a merge's: the
    corpora joined (not the list's text), load / merge / write (it runs no extraction)."""
    from embgeom_ray.report.html import render_report

    run = _craft(tmp_path / "run")
    manifest = json.loads((run / "manifest.json").read_text())
    manifest |= {
        "kind": "merge",
        "merged_runs": [
            {
                "path": "runs/ab",
                "corpus": ["corpus/a.jsonl", "corpus/b.jsonl"],
                "tokens": 1432,
                "finished_at": "2026-11-30T19:16:11+00:00",
            },
            {
                "path": "runs/c",
                "corpus": "corpus/c.jsonl",
                "tokens": 549,
                "finished_at": "2026-11-30T19:15:16+00:00",
            },
        ],
        "timings_s": {"load": 1.42, "merge": 0.44, "write": 0.86, "total": 15.1},
    }
    manifest["corpus"]["source"] = [["corpus/a.jsonl", "corpus/b.jsonl"], "corpus/c.jsonl"]
    (run / "manifest.json").write_text(json.dumps(manifest))
    page = render_report(RunView(str(run)), [])
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page))
    assert "kind merge of 2 runs (below)" in text
    assert "source corpus/a.jsonl + corpus/b.jsonl + corpus/c.jsonl" in text
    assert "load / merge / write 1.4 s / 0.4 s / 0.9 s" in text
    assert "extract (wall)" not in text and "forward / fold" not in text
    assert _rows(_table_after(page, "Merged runs")) == [
        ["runs/ab", "corpus/a.jsonl + corpus/b.jsonl", "1,432", "2026-11-30 19:16:11 UTC"],
        ["runs/c", "corpus/c.jsonl", "549", "2026-11-30 19:15:16 UTC"],
    ]


def test_report_names_the_model_by_its_short_name(crafted_html):
    title = re.search(r"<title>(.*?)</title>", crafted_html).group(1)
    assert title.startswith("Embedding geometry: my-minilm-l6 · ")
    assert f'<span title="{MODEL_PATH}">my-minilm-l6</span>' in crafted_html  # header, card
    assert f'<span class="mono">{MODEL_PATH}</span>' in crafted_html  # full path in the card
    assert MODEL_PATH not in re.search(r"<h1>.*?</h1>", crafted_html, re.S).group(0).replace(
        f'title="{MODEL_PATH}"', ""
    )


# --------------------------------------------------------------------------------------------
# clipping: like with like


def test_clipping_pairs_never_mix_estimators():
    cols = [
        "isoscore", "anisotropy", "s_inter", "s_intra", "isoscore_clipped",
        "anisotropy_clipped", "s_inter_clipped", "s_intra_clipped", "anisotropy_sampled",
        "s_inter_sampled", "s_intra_sampled", "anisotropy_clipped_exact",
        "s_inter_clipped_exact", "s_intra_clipped_exact", "isoscore_clipped_exact",
    ]  # fmt: skip
    pairs = {(p.base, p.clipped, p.estimator) for p in clipping_pairs(cols)}
    assert pairs == {
        ("isoscore", "isoscore_clipped", "exact"),
        ("anisotropy_sampled", "anisotropy_clipped", "sampled"),
        ("s_inter_sampled", "s_inter_clipped", "sampled"),
        ("s_intra_sampled", "s_intra_clipped", "sampled"),
        ("anisotropy", "anisotropy_clipped_exact", "exact"),
        ("s_inter", "s_inter_clipped_exact", "exact"),
        ("s_intra", "s_intra_clipped_exact", "exact"),
        ("isoscore", "isoscore_clipped_exact", "exact"),
    }
    # without the sampled unclipped columns, the sampled clipped ones have no counterpart
    old = [c for c in cols if not c.endswith("_sampled")]
    lone = {p.clipped for p in clipping_pairs(old) if p.base is None}
    assert lone == {"anisotropy_clipped", "s_inter_clipped", "s_intra_clipped"}


def test_clipping_figure_plots_like_with_like(crafted):
    run = RunView(str(crafted))
    panels = clipping_panels(run)
    by = {p.title: p for p in panels}
    assert list(by) == [
        "Sampled cosines: sampled unclipped vs sampled clipped",
        "Exact cosines: exact unclipped vs exact clipped (--clip-dims)",
        "IsoScore: exact unclipped vs exact clipped",
    ]
    sampled = by["Sampled cosines: sampled unclipped vs sampled clipped"]
    assert [c for c, _, _ in sampled.lines] == [
        "anisotropy_sampled", "anisotropy_clipped", "s_inter_sampled", "s_inter_clipped",
        "s_intra_sampled", "s_intra_clipped",
    ]  # fmt: skip
    assert all(label.endswith("(sampled)") for _, label, _ in sampled.lines)
    exact = by["Exact cosines: exact unclipped vs exact clipped (--clip-dims)"]
    assert [c for c, _, _ in exact.lines] == [
        "anisotropy", "anisotropy_clipped_exact", "s_inter", "s_inter_clipped_exact", "s_intra",
        "s_intra_clipped_exact",
    ]  # fmt: skip
    assert all(label.endswith("(exact)") for _, label, _ in exact.lines)
    assert ("s_intra_clipped_exact", "S_intra, dims 7 zeroed (exact)", ":") in exact.lines
    iso = by["IsoScore: exact unclipped vs exact clipped"]
    assert [c for c, _, _ in iso.lines] == [
        "isoscore",
        "isoscore_clipped",
        "isoscore_clipped_exact",
    ]
    # the plotted values are the columns' own
    lay = pd.read_parquet(crafted / "layers.parquet")
    np.testing.assert_allclose(run.layer_col("s_intra_sampled"), lay["s_intra_sampled"])


def test_clipping_without_sampled_baseline(tmp_path):
    """A run without the sampled unclipped columns: its clipping figure alone is drawn (every
    figure of a run without optional parts: test_report.py's
    test_runs_without_optional_sections_do_not_fail)."""
    run = RunView(str(_craft(tmp_path / "old", sampled=False)))
    titles = [p.title for p in clipping_panels(run)]
    assert not any(t.startswith("Sampled") for t in titles)  # no sampled clipped beside exact
    figs = {f.name: f for f in draw_figures(run, ["clipping"], strict=True)}
    assert "Not drawn: anisotropy_clipped, s_inter_clipped, s_intra_clipped" in (
        figs["clipping"].caption
    )
    table = clipping_table_html(run.layers, clipping_pairs(run.layers.columns))
    heads = _headers(table)
    assert heads[heads.index("S_inter clipped (sampled)") - 1] == "aniso. clipped (sampled)"
    assert "no unclipped counterpart of the same estimator" in table


def test_clipping_table_pairs_like_with_like(crafted_html):
    table = _table_after(crafted_html, "Outlier dimensions and clipping")
    heads = _headers(table)
    for base, clipped in (
        ("IsoScore (exact)", "IsoScore clipped (exact)"),
        ("aniso. (sampled)", "aniso. clipped (sampled)"),
        ("S_inter (sampled)", "S_inter clipped (sampled)"),
        ("S_intra (sampled)", "S_intra clipped (sampled)"),
        ("aniso. (exact)", "aniso. clipped (exact)"),
        ("S_inter (exact)", "S_inter clipped (exact)"),
        ("S_intra (exact)", "S_intra clipped (exact)"),
    ):
        assert heads[heads.index(clipped) - 1] == base, heads
    # every clipped column sits beside a counterpart of the same estimator
    for i, h in enumerate(heads):
        if " clipped (" in h and not h.startswith("IsoScore clipped (exact)"):
            assert heads[i - 1].endswith(h[h.index("(") :]), h
    start = crafted_html.index("<h3>Outlier dimensions and clipping</h3>")
    note = crafted_html[start : crafted_html.index("</p>", start)]
    assert "Like with like" in note and "<b>Sampled</b>" in note and "<b>Exact</b>" in note
    assert "exact cosines with the --clip-dims dims zeroed" in note


def test_clipping_table_without_clip_dims(crafted):
    lay = RunView(str(crafted)).layers
    lay = lay.drop(columns=[c for c in lay.columns if c.endswith("_exact")])
    table = clipping_table_html(lay, clipping_pairs(lay.columns))
    assert "--clip-dims" not in table and "clip (exact)" not in table
    assert _headers(table)[3:5] == ["IsoScore (exact)", "IsoScore clipped (exact)"]


# --------------------------------------------------------------------------------------------
# how to read, standard errors


def test_how_to_read_explains_the_new_columns(crafted_html):
    start = crafted_html.index('id="sec-clusters"')
    howto = crafted_html[start : crafted_html.index("</div>", start)]
    for needle in (
        AT_CAP,
        "no interior optimum",
        "<b>k = 1</b>",
        "<b>Stability</b>",
        "adjusted Rand index",
        "average clusters without weights",
        "“(w)” columns weight clusters by size",
        "the median is robust",
        "“LID (Cai)” is their exact convention",
        "<code>_se</code>",
    ):
        assert needle in howto, needle
    assert "like with like" in crafted_html


def test_standard_errors_table(crafted_html):
    assert "<summary>Standard errors of the sampled metrics</summary>" in crafted_html
    start = crafted_html.index("<summary>Standard errors of the sampled metrics</summary>")
    table = crafted_html[start : crafted_html.index("</table>", start)]
    heads, rows = _headers(table), _rows(table)
    assert heads == ["layer", "silh. (k-m) se", "LID eucl. se"]
    assert [r[1] for r in rows] == ["0.004000", "0.003100", "0.002000", "0.005100", "0.001200"]
    # the sampled table does not repeat them
    assert "se</th>" not in _table_after(crafted_html, "Sampled metrics")


# --------------------------------------------------------------------------------------------
# figures of a MiniLM run: nothing written over the data or over another label

#: layers.parquet values of MiniLM over the demo prose (--max-length 64, --sample-size 256)
MINILM_LAYERS = dict(
    anisotropy=[0.07, 0.128, 0.136, 0.155, 0.191, 0.285, 0.094],
    s_inter=[0.057, 0.116, 0.127, 0.147, 0.184, 0.278, 0.09],
    s_intra=[0.932, 0.892, 0.862, 0.846, 0.849, 0.863, 0.751],
    adjusted_s_inter=[-0.343, -0.416, -0.174, 0.013, 0.009, 0.002, -0.111],
    adjusted_s_intra=[-0.221, -0.46, -0.444, 0.577, 0.548, 0.604, 0.393],
    adjusted_s_inter_weighted=[-0.031, -0.024, -0.037, 0.013, 0.009, 0.003, 0.012],
    adjusted_s_intra_weighted=[0.786, -0.05, 0.227, 0.577, 0.548, 0.586, 0.258],
    s_inter_type_uniform=[0.021, 0.126, 0.139, 0.143, 0.151, 0.163, 0.049],
    kmeans_silhouette=[0.144, 0.221, 0.147, 0.088, 0.087, 0.197, 0.473],
    silhouette_types=[0.525, 0.472, 0.332, 0.248, 0.165, -0.056, -0.122],
    kmeans_k=[60, 51, 51, 1, 1, 2, 2],
    kmeans_best_k=[60, 51, 51, 41, 2, 2, 2],
    kmeans_k_searched=[60] * 7,
    kmeans_k_at_cap=[True] + [False] * 6,
)


@pytest.fixture(scope="module")
def minilm_figs(tmp_path_factory) -> dict:
    """The cosine, silhouette and K-means figures of a 7-layer run with MiniLM's values."""
    from embgeom_ray.report.figures.clusters import plot_intrinsic_dimension, plot_kmeans_curve
    from embgeom_ray.report.figures.common import kept
    from embgeom_ray.report.figures.isotropy import plot_cosine_isotropy

    out = tmp_path_factory.mktemp("minilm") / "run"
    fabricate_run(out, n_layers=7, optional=True)
    lay = pd.read_parquet(out / "layers.parquet").assign(**MINILM_LAYERS)
    lay.to_parquet(out / "layers.parquet", index=False)
    run = RunView(str(out))
    with kept() as figs:
        for draw in (plot_cosine_isotropy, plot_intrinsic_dimension, plot_kmeans_curve):
            draw(run)
    for fig in figs.values():
        fig.canvas.draw()
    return figs


def _points_under_legend(ax) -> list[tuple[str, float, float]]:
    """Every plotted point of ``ax`` that its legend covers: (line label, x, y)."""
    legend = ax.get_legend()
    if legend is None:
        return []
    box = legend.get_window_extent(ax.figure.canvas.get_renderer())
    return [
        (ln.get_label(), float(x), float(y))
        for ln in ax.get_lines()
        for x, y in ln.get_xydata()
        if np.isfinite(y) and box.contains(*ax.transData.transform((x, y)))
    ]


def test_no_legend_covers_a_curve(minilm_figs):
    # the cosine panel's legend ("best" placed among eight curves) covered MiniLM's S_intra at
    # layers 0-3 and the size-weighted cluster-adjusted S_intra of layer 0 (0.786)
    for name, fig in minilm_figs.items():
        for ax in fig.axes:
            assert _points_under_legend(ax) == [], (name, ax.get_title())
    cosine = minilm_figs["cosine_isotropy"].axes[0]
    s_intra = next(ln for ln in cosine.get_lines() if ln.get_label().startswith("S_intra (self"))
    assert s_intra.get_ydata()[0] == pytest.approx(0.932)


def test_k_labels_of_neighbouring_layers_do_not_overlap(minilm_figs):
    # layers 3 and 4 both chose k = 1: "k=1 (best 41 rejected)" and "k=1 (best 2 rejected)"
    # were written on one line beside each point, the first running into the second
    ax = minilm_figs["intrinsic_dim"].axes[1]
    renderer = ax.figure.canvas.get_renderer()
    texts = [t for t in ax.texts if t.get_text().startswith("k=")]
    assert [t.get_text() for t in texts][3:5] == [
        "k=1\n(best 41\nrejected)",
        "k=1\n(best 2\nrejected)",
    ]
    boxes = [t.get_window_extent(renderer) for t in texts]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), (a, b)


def test_k_axis_labels_only_the_chosen_ticks(minilm_figs):
    # the log axis wrote 4×10⁰ and 6×10⁰ at its minor ticks, beside 3 and 5
    ax = minilm_figs["kmeans_curve"].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()][:5] == ["2", "3", "5", "10", "15"]
    assert [t.get_text() for t in ax.get_xticklabels(minor=True) if t.get_text()] == []


def test_sampled_table_says_what_it_was_computed_on(crafted_html, tmp_path):
    # the note said only "the bounded random sample of tokens": not how many occurrences,
    # nor that S_inter (Cai) has its own sample of types
    table = crafted_html[crafted_html.index("<h3>Sampled metrics</h3>") :]
    notes = [re.sub(r"<[^>]+>", "", n) for n in re.findall(r'<p class="note">(.*?)</p>', table)]
    note = next(n for n in notes if n.startswith("From "))
    assert note.startswith(
        "From a uniform random sample of 512 token occurrences per layer (the same occurrences "
        "in every layer, of the 1,500 counted) and, for “S_inter (Cai)”, 140 token types with "
        "one random occurrence each; see samples.parquet."
    ), note
    # a run of an earlier version, without the manifest's counts: the general words
    from embgeom_ray.report.html import sample_note

    out = fabricate_run(tmp_path / "old", n_layers=3)
    assert sample_note(RunView(str(out))) == (
        "From the bounded random sample of tokens (see samples.parquet)."
    )


def test_position_axis_says_where_counted_tokens_start(crafted):
    # "0 = first position" over curves starting at 1: BERT's [CLS] holds position 0 and is
    # not counted (positions.parquet counts the window's special tokens)
    from embgeom_ray.report.figures.common import kept
    from embgeom_ray.report.figures.positions import plot_positional_profile

    with kept() as figs:
        plot_positional_profile(RunView(str(crafted)))
    fig = figs["positional_profile"]
    label = fig._supxlabel.get_text()
    assert label == (
        "position within the window (positions restart in each window)\n"
        "special tokens included: 0 is [CLS] or BOS where the tokenizer adds one, not counted"
    )
    fig.canvas.draw()  # the label fits the figure's width
    box = fig._supxlabel.get_window_extent(fig.canvas.get_renderer())
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width


def test_comparison_figure_marks_sampled_panels_and_their_errors(tmp_path):
    # every panel looked alike: a sampled metric's gap between runs had no yardstick beside it
    from embgeom_ray.report.figures.common import kept
    from embgeom_ray.report.figures.compare import plot_comparison

    runs = [RunView(str(_craft(tmp_path / name))) for name in ("a", "b")]
    metrics = ["anisotropy", "kmeans_silhouette", "lid_euclidean"]
    with kept() as figs:
        plot_comparison(runs, ["a", "b"], str(tmp_path / "cmp"), metrics, {})
    axes = figs["compare_metrics"].axes
    assert [ax.get_title() for ax in axes[:3]] == [
        "anisotropy  (anisotropy)",
        "kmeans_silhouette  (kmeans_silhouette) · sampled",
        "lid_euclidean  (lid_euclidean) · sampled",
    ]
    assert not axes[0].collections  # exact: no band
    band = axes[1].collections[0].get_paths()[0].vertices[:, 1]
    sil, se = runs[0].layer_col("kmeans_silhouette"), runs[0].layer_col("kmeans_silhouette_se")
    assert band.min() == pytest.approx((sil - 2 * se).min())
    assert band.max() == pytest.approx((sil + 2 * se).max())


def test_the_cosine_caption_says_anisotropy_averages_distinct_pairs(tmp_path):
    """The cosine figure's caption defines anisotropy as its registry entry does: pairs of two
    distinct occurrences (it said "all token pairs", as the registry did before)."""
    from embgeom_ray.core import metric_registry as registry
    from embgeom_ray.report.figures.isotropy import plot_cosine_isotropy

    out = tmp_path / "run"
    fabricate_run(out, n_layers=3)
    _, caption = plot_cosine_isotropy(RunView(str(out)))
    assert "all token pairs" not in caption
    assert "mean cosine similarity over all pairs of two distinct occurrences (anisotropy)" in caption
    assert "two distinct occurrences" in registry.metric("anisotropy").definition


# --------------------------------------------------------------------------------------------
# one place per number: the figures read the tables' values, and match layers as compare does


def _panel_r(ax) -> str:
    return next(t.get_text() for t in ax.texts if t.get_text().startswith("r = "))


def test_norm_variance_panels_print_the_tables_norm_variance_corr(tmp_path):
    """Each panel's r is the layer's ``norm_variance_corr`` from layers.parquet; it was
    computed again from the types scattered (a second copy of the correlation). The
    fabricated run's table says −0.5 − 0.08 · layer, its scattered types something else."""
    from embgeom_ray.report.figures.common import kept
    from embgeom_ray.report.figures.norms import plot_norm_variance

    out = fabricate_run(tmp_path / "run", n_layers=3, optional=False)
    with kept() as figs:
        _, caption = plot_norm_variance(RunView(str(out)))
    panels = figs["norm_variance"].axes[:3]
    assert [_panel_r(ax) for ax in panels] == ["r = −0.50", "r = −0.58", "r = −0.66"]
    assert "most negative at layer 2 (−0.66) and largest at layer 0 (−0.50)" in caption


def test_variance_split_draws_the_tables_within_ratio_only(tmp_path):
    """The ratio line is the table's ``within_ratio``; a table without it gets no line, not
    V_W / (V_W + V_B) worked out again in the figure."""
    from embgeom_ray.report.figures.common import kept
    from embgeom_ray.report.figures.norms import plot_variance_split

    out = fabricate_run(tmp_path / "run", n_layers=3, optional=False)
    lay = pd.read_parquet(out / "layers.parquet")
    lay.assign(within_ratio=[0.25, 0.5, 0.75]).to_parquet(out / "layers.parquet", index=False)
    with kept() as figs:
        plot_variance_split(RunView(str(out)))
    line = figs["variance_split"].axes[1].get_lines()[0]
    assert list(line.get_ydata()) == [0.25, 0.5, 0.75]
    lay.drop(columns="within_ratio").to_parquet(out / "layers.parquet", index=False)
    with kept() as figs:
        _, caption = plot_variance_split(RunView(str(out)))
    assert not np.isfinite(figs["variance_split"].axes[1].get_lines()[0].get_ydata()).any()
    assert "Here it goes" not in caption


def test_isoscore_silhouette_r_is_the_manifests_correlation(crafted):
    """The legend's r is :func:`isoscore_silhouette_correlation` of the table, the function
    that writes the manifest's ``sample.isoscore_silhouette_corr``."""
    from embgeom_ray.core.sampled_metrics import isoscore_silhouette_correlation
    from embgeom_ray.report.figures.clusters import plot_isoscore_silhouette
    from embgeom_ray.report.figures.common import fmt, kept

    run = RunView(str(crafted))
    with kept() as figs:
        plot_isoscore_silhouette(run)
    labels = figs["isoscore_silhouette"].axes[0].get_legend_handles_labels()[1]
    r = isoscore_silhouette_correlation(run.layers)
    assert np.isfinite(r) and labels[0] == f"K-means clusters  (r = {fmt(r)})"


def _with_layers(src: Path, out: Path, layers: list[int], blocks: int) -> RunView:
    """A copy of the fabricated run ``src`` holding only ``layers``, of a model of ``blocks``."""
    import shutil

    shutil.copytree(src, out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["model"]["num_layers"] = blocks
    (out / "manifest.json").write_text(json.dumps(manifest))
    lay = pd.read_parquet(out / "layers.parquet").iloc[: len(layers)]
    lay.assign(layer=layers).to_parquet(out / "layers.parquet", index=False)
    return RunView(str(out))


def test_comparison_figure_matches_layers_as_compare_does(tmp_path):
    """x is the layer when compare matches layers by index (same blocks, whatever
    ``--layers`` measured), else ``depth`` = layer / blocks. It went by the number of rows and
    divided by the last layer measured: a run of layers 0..2 of a 4-block model was drawn at
    0, 0.5, 1 beside the other run's 0..4, so its layer 2 sat over the other's layer 4."""
    from embgeom_ray.report.figures.common import kept
    from embgeom_ray.report.figures.compare import plot_comparison
    from embgeom_ray.runs.compare import BY_DEPTH, BY_INDEX, layer_matching

    src = fabricate_run(tmp_path / "src", n_layers=5, optional=False)  # 4 blocks
    full = RunView(str(src), "full")
    cases = {
        "first3": (_with_layers(src, tmp_path / "first3", [0, 1, 2], 4), BY_INDEX),
        "deeper": (_with_layers(src, tmp_path / "deeper", [0, 2, 4, 6, 8], 8), BY_DEPTH),
    }
    xs = {}
    for name, (run, mode) in cases.items():
        assert layer_matching([full, run])[0] == mode
        with kept() as figs:
            plot_comparison([full, run], ["full", name], str(tmp_path / name), ["anisotropy"], {})
        xs[name] = [list(line.get_xdata()) for line in figs["compare_metrics"].axes[0].get_lines()]
    assert xs["first3"] == [[0, 1, 2, 3, 4], [0, 1, 2]]
    quarters = [0.0, 0.25, 0.5, 0.75, 1.0]
    assert xs["deeper"] == [quarters, quarters]


def test_rogue_scores_of_a_moments_only_table_are_the_jobs():
    """A dims.parquet of the moments alone gets its |z| and variance ratio from the functions
    the job writes ``mean_zscore`` and ``variance_ratio`` with (``core.rogue``), not from a
    copy in the figure, which gave NaN where the job gives 0: a layer whose dimensions share
    one mean."""
    from embgeom_ray.report.figures.rogue import _dim_scores

    dims = pd.DataFrame({
        "layer": [0, 0, 0, 1, 1, 1], "dim": [0, 1, 2] * 2,
        "mean": [1.0, 1.0, 1.0, 0.0, 1.0, 2.0], "std": [1.0, 1.0, 2.0, 0.0, 0.0, 0.0],
    })  # fmt: skip
    scores = _dim_scores(dims)
    z = np.sqrt(1.5)  # |0 − 1| / population std of (0, 1, 2)
    np.testing.assert_allclose(scores["abs_mean_z"], [0, 0, 0, z, 0, z], rtol=1e-15)
    np.testing.assert_array_equal(scores["var_ratio"], [0.5, 0.5, 2.0, np.nan, np.nan, np.nan])
