"""``jobs.compare``: per-layer metrics side by side, largest changes, rogue dims that changed.

The runs are fabricated (manifest.json, layers.parquet, dims.parquet with an ``outlier``
column), small enough that every expected row is written out by hand. Values are binary
fractions, so changes compare exactly. A comparison of two real runs is in
tests/runs/test_reanalyze.py (a planted rogue dimension appears).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from embgeom_ray.runs.compare import (
    BY_DEPTH,
    BY_INDEX,
    CompareError,
    compare_runs,
    load_run,
    match_layers,
)
from jobs import compare as compare_cli
from tests.report.test_report import bare_lt

HIDDEN = 4


def make_run(
    path: Path,
    layers: dict[str, list],
    outliers: dict[int, list[int]],
    *,
    num_layers: int | None = None,
    status: str = "complete",
    model: str = "org/model",
    hidden: int = HIDDEN,
    sample_size: int | None = 64,
    tokens: int | None = None,
) -> str:
    """A run directory: manifest, layers.parquet (given columns), dims.parquet (flags given).

    The manifest counts ``tokens`` (default: layer 0's ``n_tokens``) and records
    ``sample_size`` in its config (None: not recorded).
    """
    path.mkdir(parents=True)
    table = pd.DataFrame(layers)
    n_layers = num_layers if num_layers is not None else int(table["layer"].max())
    manifest = {
        "status": status,
        "fingerprint": f"fp-{path.name}",
        "model": {
            "id": model,
            "revision": f"rev-{path.name}",
            "num_layers": n_layers,
            "hidden_size": hidden,
        },
        "corpus": {"source": "corpus.jsonl", "fingerprint": "c0ffee"},
        "counts": {"tokens": int(table["n_tokens"].iloc[0]) if tokens is None else tokens},
        "config": {"model": model, "corpus": "corpus.jsonl", "min_count": 5},
    }
    if sample_size is not None:
        manifest["config"]["sample_size"] = sample_size
    (path / "manifest.json").write_text(json.dumps(manifest))
    table.to_parquet(path / "layers.parquet")
    rows = []
    for layer in table["layer"]:
        for d in range(hidden):
            rows.append(
                {
                    "layer": int(layer),
                    "dim": d,
                    "mean": float(10 * layer + d),
                    "std": float(d + 1) / 4,
                    "outlier": d in outliers.get(int(layer), []),
                }
            )
    pd.DataFrame(rows).to_parquet(path / "dims.parquet")
    return str(path)


BASE_LAYERS = {
    "layer": [0, 1, 2],
    "n_tokens": [100, 100, 100],
    "anisotropy": [0.125, 0.25, 0.375],
    "isoscore": [0.5, 0.375, 0.25],
    "within_ratio": [0.25, 0.5, 0.5],
    "outlier_dims": ["", "1", "1,3"],  # text: not a metric
}
OTHER_LAYERS = {
    "layer": [0, 1, 2],
    "n_tokens": [120, 120, 120],
    "anisotropy": [0.125, 0.5, 0.375],  # layer 1: +0.25
    "isoscore": [0.5, 0.375, 0.0],  # layer 2: -0.25
    "within_ratio": [0.25, 0.5, 0.625],  # layer 2: +0.125
    "outlier_dims": ["2", "1", "1"],
}
BASE_OUTLIERS = {1: [1], 2: [1, 3]}
OTHER_OUTLIERS = {0: [2], 1: [1], 2: [1]}  # layer 0: 2 appeared; layer 2: 3 vanished


@pytest.fixture
def two_runs(tmp_path) -> tuple[str, str]:
    a = make_run(tmp_path / "runs" / "base", BASE_LAYERS, BASE_OUTLIERS)
    b = make_run(tmp_path / "runs" / "new", OTHER_LAYERS, OTHER_OUTLIERS)
    return a, b


def test_compare_two_runs(two_runs, tmp_path, capsys) -> None:
    a, b = two_runs
    out = tmp_path / "cmp"
    assert compare_cli.main([a, b, "--out", str(out), "--labels", "v1,v2"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("compared 1 run against v1; layers matched by index")
    assert "warning" not in printed  # 100 and 120 tokens, neither below the sample size
    assert "rogue dimensions that appeared in v2: layer 0: [2]" in printed
    assert "rogue dimensions that vanished in v2: layer 2: [3]" in printed

    # the change table: every (metric, layer) of the ranked metrics, largest first
    changes = pd.read_parquet(out / "changes.parquet")
    assert list(changes.columns) == [
        "run", "metric", "layer", "run_layer", "baseline", "value", "change", "relative", "score",
        "kind", "se_baseline", "se_run", "se_diff", "z", "q", "within_noise", "evidence",
        "small_run", "samples_differ", "not_comparable",
    ]  # fmt: skip
    # every metric here is exact: no standard error, never within noise, ranked by score; the
    # unchanged ones agree (listed last, not among the changes)
    assert (changes["kind"] == "exact").all()
    assert changes["evidence"].tolist() == ["exact"] * 3 + ["agree"] * 6
    assert changes[["se_baseline", "se_run", "se_diff", "z"]].isna().all().all()
    assert not changes["within_noise"].any()
    got = list(changes[["metric", "layer", "baseline", "value", "change"]].itertuples(index=False))
    assert [tuple(r) for r in got] == [
        ("anisotropy", 1, 0.25, 0.5, 0.25),  # score 0.25 / (0.5 - 0.125)
        ("isoscore", 2, 0.25, 0.0, -0.25),  # 0.25 / 0.5
        ("within_ratio", 2, 0.5, 0.625, 0.125),  # 0.125 / (0.625 - 0.25)
        ("anisotropy", 0, 0.125, 0.125, 0.0),
        ("anisotropy", 2, 0.375, 0.375, 0.0),
        ("isoscore", 0, 0.5, 0.5, 0.0),
        ("isoscore", 1, 0.375, 0.375, 0.0),
        ("within_ratio", 0, 0.25, 0.25, 0.0),
        ("within_ratio", 1, 0.5, 0.5, 0.0),
    ]
    assert (changes["run"] == "v2").all() and (changes["run_layer"] == changes["layer"]).all()
    np.testing.assert_allclose(changes["score"][:3], [2 / 3, 1 / 2, 1 / 3])
    np.testing.assert_allclose(changes["relative"][:3], [1.0, -1.0, 0.25])
    assert "n_tokens" not in set(changes["metric"])  # counts are not ranked

    # rogue dimensions: exactly one appeared and one vanished, with both runs' statistics
    rogue = pd.read_parquet(out / "rogue_dims.parquet")
    assert rogue[["run", "layer", "run_layer", "dim", "change"]].to_dict("records") == [
        {"run": "v2", "layer": 0, "run_layer": 0, "dim": 2, "change": "appeared"},
        {"run": "v2", "layer": 2, "run_layer": 2, "dim": 3, "change": "vanished"},
    ]
    assert rogue["baseline_mean"].tolist() == [2.0, 23.0]
    assert rogue["run_std"].tolist() == [0.75, 1.0]

    # long table: every numeric metric of every run
    long = pd.read_parquet(out / "comparison.parquet")
    assert list(long.columns) == ["run", "label", "layer", "depth", "metric", "value"]
    assert len(long) == 2 * 3 * 4  # runs x layers x (n_tokens, anisotropy, isoscore, within)
    assert set(long["metric"]) == {"n_tokens", "anisotropy", "isoscore", "within_ratio"}
    row = long[(long["label"] == "v2") & (long["metric"] == "isoscore") & (long["layer"] == 2)]
    assert row["value"].tolist() == [0.0] and row["depth"].tolist() == [1.0]
    assert set(long.loc[long["label"] == "v1", "run"]) == {a}

    # wide table: the runs side by side
    wide = pd.read_parquet(out / "comparison_wide.parquet")
    assert list(wide.columns) == ["metric", "layer", "depth", "v1", "v2"]
    aniso = wide[wide["metric"] == "anisotropy"]
    assert aniso["v1"].tolist() == [0.125, 0.25, 0.375]
    assert aniso["v2"].tolist() == [0.125, 0.5, 0.375]

    summary = json.loads((out / "comparison.json").read_text())
    assert summary["baseline"] == "v1"
    assert summary["layer_matching"] == BY_INDEX
    assert [c["metric"] for c in summary["largest_changes"]] == [
        "anisotropy",
        "isoscore",
        "within_ratio",
    ]
    assert summary["rogue_dims"] == {
        "v2": {"appeared": {"0": [2]}, "vanished": {"2": [3]}, "reliable": True}
    }
    assert summary["size_warning"] is None and summary["small_runs"] == []
    assert [r["revision"] for r in summary["runs"]] == ["rev-base", "rev-new"]
    assert summary["report"] == "report.html"
    html = (out / "report.html").read_text()
    assert "v1" in html and "v2" in html
    assert (out / "plots" / "compare_metrics.png").is_file()


def test_different_depths_matched_by_relative_depth(tmp_path) -> None:
    base = make_run(tmp_path / "small", BASE_LAYERS, BASE_OUTLIERS)
    deep_layers = {
        "layer": [0, 1, 2, 3, 4],
        "n_tokens": [100] * 5,
        "anisotropy": [0.125, 0.0, 0.25, 0.0, 0.5],
        "isoscore": [0.5, 0.0, 0.375, 0.0, 0.25],
    }
    deep = make_run(tmp_path / "deep", deep_layers, {0: [0], 4: [1, 3]})
    runs = [load_run(base, "small"), load_run(deep, "deep")]
    assert match_layers(runs[0], runs[1], BY_DEPTH) == [(0, 0), (1, 2), (2, 4)]
    assert match_layers(runs[1], runs[0], BY_DEPTH) == [(0, 0), (1, 0), (2, 1), (3, 1), (4, 2)]

    summary = compare_runs([base, deep], str(tmp_path / "cmp"), echo=lambda s: None)
    assert summary["layer_matching"] == BY_DEPTH
    assert "relative depth" in summary["layer_matching_note"]
    assert summary["report"] == "report.html", summary.get("report_error")
    changes = pd.read_parquet(tmp_path / "cmp" / "changes.parquet")
    moved = changes[changes["change"] != 0]
    assert moved[["metric", "layer", "run_layer", "change"]].values.tolist() == [
        ["anisotropy", 2, 4, 0.125]
    ]
    wide = pd.read_parquet(tmp_path / "cmp" / "comparison_wide.parquet")
    assert list(wide.columns) == ["metric", "layer", "depth", "small", "deep", "layer:deep"]
    assert wide.loc[wide["metric"] == "anisotropy", "layer:deep"].tolist() == [0, 2, 4]
    assert summary["rogue_dims"] == {
        "deep": {"appeared": {"0": [0]}, "vanished": {"1": [1]}, "reliable": True}
    }


def test_other_hidden_size_skips_rogue_dims(tmp_path) -> None:
    a = make_run(tmp_path / "a", BASE_LAYERS, BASE_OUTLIERS)
    b = make_run(tmp_path / "b", OTHER_LAYERS, OTHER_OUTLIERS, hidden=8)
    summary = compare_runs([a, b], str(tmp_path / "cmp"), echo=lambda s: None)
    assert summary["rogue_dims"] == {}
    assert any("hidden size 8 != 4" in n for n in summary["notes"])
    assert pd.read_parquet(tmp_path / "cmp" / "rogue_dims.parquet").empty


def test_clear_errors(two_runs, tmp_path, capsys) -> None:
    a, b = two_runs
    running = make_run(tmp_path / "running", BASE_LAYERS, {}, status="running")
    (tmp_path / "empty").mkdir()
    out = str(tmp_path / "cmp")
    cases = [
        ([a, str(tmp_path / "empty")], "is not a run directory of jobs.analyze"),
        ([a, str(tmp_path / "missing")], "does not exist"),
        ([a, running], "is not complete (status 'running')"),
        ([a, b, "--labels", "only-one"], "1 labels for 2 runs"),
        ([a, b, "--labels", "x,x"], "labels must be distinct"),
        ([a], "at least two runs"),
    ]
    for argv, message in cases:
        assert compare_cli.main([*argv, "--out", out]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert compare_cli.main([a, b, "--out", a]) == 2
    assert "is one of the runs compared" in capsys.readouterr().err
    other = make_run(tmp_path / "other", BASE_LAYERS, {})  # a run not compared: its report stays
    (Path(other) / "report.html").write_text("the other run's report")
    assert compare_cli.main([a, b, "--out", other]) == 2
    assert "holds a run; its report.html would be replaced" in capsys.readouterr().err
    assert (Path(other) / "report.html").read_text() == "the other run's report"
    (Path(b) / "layers.parquet").unlink()
    with pytest.raises(CompareError, match=r"says it is complete but has no layers\.parquet"):
        load_run(b, "b")


# --- sampled metrics: standard errors, z and the ranking by evidence ------------------------
# One layer, so each metric's range over both runs is its change (score 1). Standard errors are
# binary fractions in 3-4-5 proportion, so se_diff and z are exact.
SAMPLED_BASE = {
    "layer": [0],
    "n_tokens": [1000],
    "anisotropy": [0.25],  # exact
    "silhouette_types": [0.5],  # sampled, se 3/512
    "silhouette_types_se": [3 / 512],
    "lid_euclidean": [10.0],  # sampled, se 3
    "lid_euclidean_se": [3.0],
    "kmeans_silhouette": [0.0625],  # sampled, se 3/8
    "kmeans_silhouette_se": [0.375],
    "lid_cosine": [8.0],  # sampled, se 3/8
    "lid_cosine_se": [0.375],
    "isoscore_sample": [0.25],  # sampled, no standard error in any version
    "adjusted_s_inter": [0.125],  # sampled, se only in the baseline
    "adjusted_s_inter_se": [0.25],
}
SAMPLED_OTHER = {
    "layer": [0],
    "n_tokens": [1200],
    "anisotropy": [0.5],  # +0.25, exact
    "silhouette_types": [0.53125],  # +1/32 (+6.25%), se 4/512: se_diff 5/512, z 3.2
    "silhouette_types_se": [4 / 512],
    "lid_euclidean": [20.0],  # +10 (+100%), se 4: se_diff 5, z 2.0 (beyond noise: |z| >= 2)
    "lid_euclidean_se": [4.0],
    "kmeans_silhouette": [0.3125],  # +0.25 (+400%), se 1/2: se_diff 5/8, z 0.4
    "kmeans_silhouette_se": [0.5],
    "lid_cosine": [9.0],  # +1 (+12.5%), se 1/2: se_diff 5/8, z 1.6
    "lid_cosine_se": [0.5],
    "isoscore_sample": [0.375],
    "adjusted_s_inter": [0.25],  # its _se column is missing (a run of an older version)
}


def test_sampled_changes_ranked_by_z(tmp_path, capsys) -> None:
    from embgeom_ray.runs.compare import changes_table, metric_columns

    a = make_run(tmp_path / "a", SAMPLED_BASE, {}, num_layers=1)
    b = make_run(tmp_path / "b", SAMPLED_OTHER, {}, num_layers=1)
    runs = [load_run(a, "a"), load_run(b, "b")]
    changes = changes_table(runs, metric_columns(runs), BY_INDEX)
    got = changes[["metric", "kind", "evidence"]].values.tolist()
    assert got == [
        ["silhouette_types", "sampled", "beyond noise"],  # small (+6%) but z 3.2
        ["lid_euclidean", "sampled", "beyond noise"],  # z 2.0
        ["anisotropy", "exact", "exact"],
        ["isoscore_sample", "sampled", "no standard error"],  # ties by score: column order
        ["adjusted_s_inter", "sampled", "no standard error"],
        ["lid_cosine", "sampled", "within noise"],  # z 1.6
        ["kmeans_silhouette", "sampled", "within noise"],  # big (+400%) but z 0.4: last
    ]
    assert not any(m.endswith("_se") for m in changes["metric"])  # the yardsticks: not ranked
    by = changes.set_index("metric")
    se_b = np.array([3 / 512, 3.0, 0.375, 0.375])
    se_o = np.array([4 / 512, 4.0, 0.5, 0.5])
    d = np.array([1 / 32, 10.0, 0.25, 1.0])
    rows = ["silhouette_types", "lid_euclidean", "kmeans_silhouette", "lid_cosine"]
    assert by.loc[rows, "se_baseline"].tolist() == se_b.tolist()
    assert by.loc[rows, "se_run"].tolist() == se_o.tolist()
    assert by.loc[rows, "change"].tolist() == d.tolist()
    assert by.loc[rows, "se_diff"].tolist() == np.sqrt(se_b**2 + se_o**2).tolist()
    assert by.loc[rows, "se_diff"].tolist() == [5 / 512, 5.0, 0.625, 0.625]
    assert by.loc[rows, "z"].tolist() == [3.2, 2.0, 0.4, 1.6]
    assert by.loc[rows, "within_noise"].tolist() == [False, False, True, True]
    # exact: no standard error, never within noise; sampled without se: z NaN, unknown
    assert by.loc["anisotropy", ["se_diff", "z"]].isna().all()
    assert by.loc["anisotropy", "within_noise"] == False  # noqa: E712 (pandas' boolean)
    for m in ("isoscore_sample", "adjusted_s_inter"):
        assert math.isnan(by.loc[m, "z"]) and pd.isna(by.loc[m, "within_noise"])
    assert by.loc["adjusted_s_inter", "se_baseline"] == 0.25
    assert math.isnan(by.loc["adjusted_s_inter", "se_run"])
    assert by.loc["kmeans_silhouette", "relative"] == 4.0  # what used to rank first

    # the same through jobs.compare: the files, the summary and what it prints
    out = tmp_path / "cmp"
    summary = compare_runs([a, b], str(out), echo=print)
    printed = capsys.readouterr().out
    saved = pd.read_parquet(out / "changes.parquet")
    pd.testing.assert_frame_equal(saved, changes)
    assert [c["metric"] for c in summary["largest_changes"]][:2] == rows[:2]
    assert summary["largest_changes"][0]["z"] == 3.2
    assert summary["largest_changes"][-1]["within_noise"] is True
    assert summary["largest_changes"][3]["within_noise"] is None  # no standard error
    assert summary["evidence_counts"] == {
        "beyond noise": 2, "exact": 1, "no standard error": 2, "within noise": 2,
        "clustering changed": 0, "clipping changed": 0, "k not robust": 0, "agree": 0,
    }  # fmt: skip
    assert "silhouette_types  layer 0: 0.5 -> 0.5312 (+0.03125, +6.2%; z +3.2)" in printed
    assert "anisotropy  layer 0: 0.25 -> 0.5 (+0.25, +100.0%; exact)" in printed
    assert (
        "kmeans_silhouette  layer 0: 0.0625 -> 0.3125 (+0.25, +400.0%; z +0.4, within noise)"
        in printed
    )
    assert "2 changes of sampled metrics within noise (|z| < 2), ranked after the others" in printed
    # the report says |z| < 2 in its note and in the within-noise rows' tooltips, escaped
    html = (out / "report.html").read_text()
    assert bare_lt(html) == [] and "(|z| &lt; 2)" in html and 'title="|z| &lt; 2: within' in html


def test_exact_and_sampled_changes_are_listed_apart(tmp_path, capsys) -> None:
    """With --top 2, the two sampled changes beyond noise filled the whole list and the certain
    exact change (anisotropy +100%) was not shown. Now each kind has its own list, printed and
    in the report, and the sampled one says how many changes were tested: 4 with a standard
    error, so about 4 × 4.55% = 0.2 would reach |z| ≥ 2 by chance; of the 2 that do, 1 keeps a
    false discovery rate of 5% (Benjamini–Hochberg)."""
    from embgeom_ray.runs.compare import CHANCE_BEYOND

    a = make_run(tmp_path / "a", SAMPLED_BASE, {}, num_layers=1)
    b = make_run(tmp_path / "b", SAMPLED_OTHER, {}, num_layers=1)
    out = tmp_path / "cmp"
    assert compare_cli.main([a, b, "--out", str(out), "--top", "2"]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "comparison.json").read_text())
    # the list ranked by evidence, as before: the exact change is not among its first two
    assert [c["metric"] for c in summary["largest_changes"]] == [
        "silhouette_types", "lid_euclidean",
    ]  # fmt: skip
    assert [c["metric"] for c in summary["largest_exact"]] == ["anisotropy"]
    assert [c["metric"] for c in summary["largest_sampled"]] == [
        "silhouette_types", "lid_euclidean",
    ]  # fmt: skip
    assert summary["largest_not_comparable"] == []
    # two-sided normal p of z 3.2, 2.0, 0.4, 1.6, and their Benjamini–Hochberg q over the 4:
    # p sorted 0.0013743, 0.0455003, 0.1095986, 0.6891565; q = min over ranks ≥ i of p · 4 / rank
    assert CHANCE_BEYOND == pytest.approx(0.0455003)
    changes = pd.read_parquet(out / "changes.parquet").set_index("metric")
    q = changes.loc[["silhouette_types", "lid_euclidean", "lid_cosine", "kmeans_silhouette"], "q"]
    np.testing.assert_allclose(q, [0.0054971, 0.0910005, 0.1461314, 0.6891565], rtol=1e-5)
    assert changes.loc[["anisotropy", "isoscore_sample", "adjusted_s_inter"], "q"].isna().all()
    assert summary["sampled_tests"] == {
        "b": {"tested": 4, "beyond_noise": 2, "expected_by_chance": 0.2, "fdr": 0.05,
              "discoveries": 1},
    }  # fmt: skip
    lines = printed.splitlines()
    exact_at = lines.index(
        "largest exact changes against a (over every token, no sampling error; by |change| / "
        "the metric's range):"
    )
    assert lines[exact_at + 1] == "  b  anisotropy  layer 0: 0.25 -> 0.5 (+0.25, +100.0%; exact)"
    assert lines[exact_at + 2 :: 1][:2] == [
        "sampled changes against a (beyond noise by |z|, then without a standard error):",
        "  b: 4 sampled changes tested against their standard errors, 2 beyond noise "
        "(|z| >= 2) where chance alone would put about 0.2 (4.6% of 4); 1 remains at a 5% "
        "false discovery rate (Benjamini-Hochberg q <= 0.05)",
    ]
    assert lines[exact_at + 4].startswith("  b  silhouette_types  layer 0:")
    assert lines[exact_at + 5].startswith("  b  lid_euclidean  layer 0:")
    # the report: an exact table, then a sampled one under the same count
    html = (out / "report.html").read_text()
    exact_at, sampled_at = html.index("<h3>Exact metrics</h3>"), html.index("<h3>Sampled metrics")
    assert exact_at < sampled_at and "Not comparable</h3>" not in html
    exact_table = html[exact_at:sampled_at]
    assert exact_table.count("<tr><td") == 1 and ">anisotropy</td>" in exact_table
    sampled_table = html[sampled_at : html.index("</table>", sampled_at)]
    assert "4 sampled changes tested against their standard errors" in sampled_table
    assert sampled_table.count("<tr><td") == 2 and "z +3.2 · q 0.0055</b>" in sampled_table


def test_a_changed_clustering_is_not_ranked_by_z(tmp_path, capsys) -> None:
    """Layer 0 chose k = 2 in the baseline and k = 1 in the run: its cluster-adjusted metrics
    compare different partitions, so they are flagged, not ranked by z; layer 1 kept k = 3 and
    its changes rank as usual; layer 2's best k moved, which only kmeans_stability depends on."""
    from embgeom_ray.runs.compare import CLUSTER_ADJUSTED, changes_table, metric_columns

    base = {
        "layer": [0, 1, 2], "n_tokens": [1000] * 3, "kmeans_k": [2, 3, 1],
        "kmeans_best_k": [2, 3, 4], "kmeans_k_at_cap": [False, False, False],
        "adjusted_s_inter": [0.125, 0.125, 0.125], "adjusted_s_inter_se": [0.0625] * 3,
        "kmeans_stability": [0.5, 0.5, 0.5],
    }  # fmt: skip
    other = base | {
        "kmeans_k": [1, 3, 1], "kmeans_best_k": [2, 3, 5],
        "adjusted_s_inter": [0.625, 0.25, 0.25], "kmeans_stability": [0.75, 0.75, 0.75],
    }  # fmt: skip
    a = make_run(tmp_path / "a", base, {}, num_layers=2)
    b = make_run(tmp_path / "b", other, {}, num_layers=2)
    runs = [load_run(a, "a"), load_run(b, "b")]
    changes = changes_table(runs, metric_columns(runs), BY_INDEX)
    rows = changes.set_index(["metric", "layer"])
    flagged = rows.loc[("adjusted_s_inter", 0)]
    assert flagged["evidence"] == "clustering changed" and math.isnan(flagged["z"])
    assert flagged["not_comparable"] == "kmeans_k 2 -> 1" and pd.isna(flagged["within_noise"])
    kept = rows.loc[("adjusted_s_inter", 1)]  # z = 0.125 / √(2 · 0.0625²) = √2
    assert kept["evidence"] == "within noise" and kept["not_comparable"] == ""
    assert kept["z"] == pytest.approx(math.sqrt(2))
    stability = rows.loc[("kmeans_stability", 2)]
    assert stability["evidence"] == "clustering changed"
    assert stability["not_comparable"] == "kmeans_best_k 4 -> 5"
    assert rows.loc[("kmeans_stability", 1), "evidence"] == "no standard error"
    assert changes["evidence"].tolist()[-2:] == ["clustering changed"] * 2  # ranked last
    assert "adjusted_s_inter" in CLUSTER_ADJUSTED and "adjusted_isoscore_se" in CLUSTER_ADJUSTED
    summary = compare_runs([a, b], str(tmp_path / "cmp"), echo=print)
    assert summary["evidence_counts"]["clustering changed"] == 2
    assert summary["clustering_changed"] == [
        "b layer 0: the K-means clustering changed (kmeans_k 2 -> 1): its 1 cluster-dependent "
        "metric is not comparable and not ranked by z",
        "b layer 2: the K-means clustering changed (kmeans_best_k 4 -> 5): its 1 "
        "cluster-dependent metric is not comparable and not ranked by z",
    ]
    assert summary["clustering_changed"][0] in capsys.readouterr().out


def test_clipped_metrics_of_other_zeroed_dimensions_are_not_comparable(tmp_path, capsys) -> None:
    """Layer 0 flags dimensions 1, 3 in the baseline and 1, 2 in the run: its clipped metrics
    zero other dimensions, so they are not comparable and not ranked among the changes (as
    MiniLM at 32 and 64 tokens, which flag 157 and 351 at layer 5). Layer 1 flags the same
    dimension in both: its clipped metrics rank as usual. The runs' --clip-dims differ at
    layer 1 only, which the *_clipped_exact columns depend on."""
    from embgeom_ray.runs.compare import CLIPPED, changes_table, metric_columns

    base = {
        "layer": [0, 1], "n_tokens": [1000] * 2, "outlier_dims": ["1,3", "2"],
        "isoscore_clipped": [0.5, 0.25], "anisotropy_clipped": [0.125, 0.25],
        "clip_dims_exact": ["0", "0"], "anisotropy_clipped_exact": [0.25, 0.25],
    }  # fmt: skip
    other = base | {
        "outlier_dims": ["1,2", "2"], "isoscore_clipped": [0.625, 0.5],
        "anisotropy_clipped": [0.25, 0.5], "clip_dims_exact": ["0", "0,1"],
        "anisotropy_clipped_exact": [0.5, 0.5],
    }  # fmt: skip
    a = make_run(tmp_path / "a", base, {0: [1, 3], 1: [2]}, num_layers=1)
    b = make_run(tmp_path / "b", other, {0: [1, 2], 1: [2]}, num_layers=1)
    runs = [load_run(a, "a"), load_run(b, "b")]
    changes = changes_table(runs, metric_columns(runs), BY_INDEX)
    got = changes[["metric", "layer", "evidence", "not_comparable"]].values.tolist()
    assert got == [
        ["anisotropy_clipped_exact", 0, "exact", ""],  # the same --clip-dims 0; score 1
        ["isoscore_clipped", 1, "exact", ""],  # +0.25 over a range of 0.375
        ["anisotropy_clipped", 1, "no standard error", ""],
        ["anisotropy_clipped_exact", 1, "clipping changed", "clip_dims_exact none -> 1"],
        ["isoscore_clipped", 0, "clipping changed", "outlier_dims 3 -> 2"],  # score 1/3
        ["anisotropy_clipped", 0, "clipping changed", "outlier_dims 3 -> 2"],  # score 1/3
    ]
    moved = changes[changes["evidence"] == "clipping changed"]
    assert moved["z"].isna().all() and moved["within_noise"].isna().all()
    assert moved["change"].tolist() == [0.25, 0.125, 0.125]
    np.testing.assert_allclose(moved["score"], [1.0, 1 / 3, 1 / 3])
    assert set(CLIPPED["outlier_dims"]) == {
        "isoscore_clipped", "anisotropy_clipped", "s_inter_clipped", "s_intra_clipped",
    }  # fmt: skip
    summary = compare_runs([a, b], str(tmp_path / "cmp"), echo=print)
    printed = capsys.readouterr().out
    assert summary["evidence_counts"]["clipping changed"] == 3
    assert summary["clipping_changed"] == [
        "b layer 0: the runs zeroed other dimensions (outlier_dims 3 -> 2: only in a -> only "
        "in b): its 2 clipped metrics are not comparable and not ranked among the changes",
        "b layer 1: the runs zeroed other dimensions (clip_dims_exact none -> 1: only in a -> "
        "only in b): its 1 clipped metric is not comparable and not ranked among the changes",
    ]
    assert f"note: {summary['clipping_changed'][0]}" in printed
    html = (tmp_path / "cmp" / "report.html").read_text()
    assert html.count(">clipping changed</span>") == 3


def test_the_count_of_flagged_dimensions_is_not_ranked(tmp_path, capsys) -> None:
    """n_outlier_dims 8 -> 10 is +25% and the whole range of the count: ranked by score it came
    first among the exact changes (MiniLM at 32 and 64 tokens, layer 2). It counts dimensions
    past a threshold: kept in the tables, not ranked; the rogue-dimension lines say which."""
    from embgeom_ray.runs.compare import NOT_RANKED

    base = {"layer": [0, 1], "n_tokens": [1000] * 2, "n_outlier_dims": [8, 3],
            "total_variance": [10.0, 20.0]}  # fmt: skip
    other = base | {"n_outlier_dims": [10, 3], "total_variance": [10.0, 15.0]}
    a = make_run(tmp_path / "a", base, {0: [1]}, num_layers=1)
    b = make_run(tmp_path / "b", other, {0: [1, 2]}, num_layers=1)
    summary = compare_runs([a, b], str(tmp_path / "cmp"), echo=print)
    printed = capsys.readouterr().out
    assert "n_outlier_dims" in NOT_RANKED and "n_outlier_dims" in summary["not_ranked"]
    assert [(c["metric"], c["layer"]) for c in summary["largest_changes"]] == [
        ("total_variance", 1)
    ]
    changes = pd.read_parquet(tmp_path / "cmp" / "changes.parquet")
    assert "n_outlier_dims" not in set(changes["metric"])
    wide = pd.read_parquet(tmp_path / "cmp" / "comparison_wide.parquet")
    assert wide.loc[wide["metric"] == "n_outlier_dims", "b"].tolist() == [10, 3]  # kept
    assert "n_outlier_dims" not in printed
    assert "rogue dimensions that appeared in b: layer 0: [2]" in printed


def test_differences_within_the_bounds_are_no_change(tmp_path, capsys) -> None:
    """Two runs of one corpus: an exact metric 6e-9 apart (float64 rounding, within the stated
    1e-6 relative) and sampled metrics 1e-6 apart (the forward's rounding of one sample, within
    1e-4): the runs agree, nothing is listed as a change; 2e-6 and 2e-4 are changes."""
    from embgeom_ray.runs.compare import EXACT_BOUND, SAMPLED_BOUND, agrees

    base = {
        "layer": [0, 1], "n_tokens": [5000, 5000], "norm_variance_corr": [-0.5, 0.25],
        "isoscore": [0.125, 0.5], "kmeans_silhouette": [0.25, 0.125],
        "kmeans_silhouette_se": [0.01, 0.01], "lid_euclidean_cai": [8.0, 9.0],
    }  # fmt: skip
    same = base | {
        "norm_variance_corr": [-0.5 - 6e-9, 0.25], "kmeans_silhouette": [0.25 * (1 + 1e-6), 0.125],
        "lid_euclidean_cai": [8.0 * (1 - 1e-6), 9.0],
    }  # fmt: skip
    a = make_run(tmp_path / "one_shard", base, {}, num_layers=1)
    b = make_run(tmp_path / "many_shards", same, {}, num_layers=1)
    summary = compare_runs([a, b], str(tmp_path / "cmp"), echo=print)
    printed = capsys.readouterr().out
    assert summary["largest_changes"] == []
    assert "no change: every metric agrees with one_shard's" in printed
    assert "3 differ within these bounds" in printed
    html = (tmp_path / "cmp" / "report.html").read_text()
    assert "No change: every metric agrees with one_shard&#x27;s (exact ones within 1e-06" in html
    assert summary["evidence_counts"]["agree"] == 3
    assert sum(n for e, n in summary["evidence_counts"].items() if e != "agree") == 0
    changes = pd.read_parquet(tmp_path / "cmp" / "changes.parquet")
    assert (changes["evidence"] == "agree").all()
    assert summary["bounds"]["exact"] == EXACT_BOUND == 1e-6
    assert summary["bounds"]["sampled"] == SAMPLED_BOUND == 1e-4
    # beyond the bounds, the same differences are changes
    assert not agrees("exact", -0.5, -0.5 * (1 + 2e-6)) and agrees("exact", -0.5, -0.5 - 4e-7)
    assert not agrees("sampled", 8.0, 8.0 * (1 + 2e-4)) and agrees("sampled", 8.0, 8.0 * (1 + 5e-5))
    assert agrees("exact", 0.0, 0.0) and not agrees("exact", 0.0, 1e-300)
    moved = base | {"norm_variance_corr": [-0.5 * (1 + 2e-6), 0.25]}
    c = make_run(tmp_path / "moved", moved, {}, num_layers=1)
    summary = compare_runs([a, c], str(tmp_path / "cmp2"), echo=print)
    assert [r["metric"] for r in summary["largest_changes"]] == ["norm_variance_corr"]
    assert summary["largest_changes"][0]["evidence"] == "exact"


def test_the_report_says_what_compare_prints_when_nothing_changed(tmp_path, capsys) -> None:
    """With no change to list, compare prints one line and its report shows the same
    (``unchanged_line``): the report decided on its own and said "No layer is shared by the
    runs" of two runs that share every layer and agree bit for bit, while compare printed
    "no metric changed" of two runs that share no layer."""
    a = make_run(tmp_path / "a", BASE_LAYERS, {})
    cases = {
        "same": (make_run(tmp_path / "same", BASE_LAYERS, {}), "no metric changed"),
        "deeper": (
            make_run(tmp_path / "deeper", BASE_LAYERS | {"layer": [3, 4, 5]}, {}, num_layers=2),
            "no layer of one run was matched with a layer of another: nothing to compare",
        ),
    }
    for name, (run, line) in cases.items():
        summary = compare_runs([a, run], str(tmp_path / f"cmp-{name}"), echo=print)
        assert line in capsys.readouterr().out.splitlines(), name
        assert summary["layer_matching"] == BY_INDEX and summary["largest_changes"] == []
        html = (tmp_path / f"cmp-{name}" / "report.html").read_text()
        assert f'<p class="note">{line[0].upper()}{line[1:]}.</p>' in html, name


def test_the_report_lists_changes_by_compares_evidence_and_bounds() -> None:
    """The report cannot import runs.compare (it sits below it): its lists name compare's
    evidence groups, and its texts compare's bounds. A group renamed in one place only would
    leave its rows out of the report's lists."""
    from embgeom_ray.report import html
    from embgeom_ray.runs import compare

    assert [groups for _, groups, _ in html.CHANGE_LISTS] == [
        compare.EXACT_LIST, compare.SAMPLED_LIST, compare.APART_LIST,
    ]  # fmt: skip
    assert html.NOT_A_CHANGE == compare.NOT_A_CHANGE
    (_, _, exact), (_, _, sampled), _ = html.CHANGE_LISTS

    def text(bound: float) -> str:
        return f"{bound:.0e}".replace("e-0", "e-")  # 1e-6, as the texts write it

    assert f"beyond {text(compare.EXACT_BOUND)} relative" in exact
    assert f"|z| ≥ {compare.NOISE_Z:g}" in sampled and f"(|z| < {compare.NOISE_Z:g})" in sampled
    row = dict.fromkeys(compare.CHANGE_COLUMNS, 0.0) | {
        "run": "b", "metric": "isoscore", "layer": 1, "run_layer": 1, "change": 0.5,
        "kind": "exact", "evidence": "exact", "not_comparable": "",
    }  # fmt: skip
    page = html._changes_html(pd.DataFrame([row]), "a", "layers matched by index")
    bounds = f"exact metrics {text(compare.EXACT_BOUND)}, sampled {text(compare.SAMPLED_BOUND)}"
    assert f"({bounds} relative)" in page


def test_a_k_that_moved_without_a_robust_decision_is_not_a_change(tmp_path, capsys) -> None:
    """Layer 0 chose k = 2 and then k = 1, but the baseline's decision had the support of 55%
    of its resamples only: not comparable, not a change. Layer 1 moved from k = 3 to 4 with
    both decisions robust: the clustering changed."""
    base = {
        "layer": [0, 1], "n_tokens": [4000] * 2, "kmeans_k": [2, 3], "kmeans_best_k": [2, 3],
        "kmeans_k_at_cap": [False, False], "kmeans_k_support": [0.55, 0.975],
        "kmeans_structure_support": [0.55, 1.0], "adjusted_s_inter": [0.125, 0.125],
        "adjusted_s_inter_se": [0.0625] * 2,
    }  # fmt: skip
    other = base | {
        "kmeans_k": [1, 4], "kmeans_best_k": [2, 4], "kmeans_k_support": [0.95, 0.925],
        "adjusted_s_inter": [0.5, 0.5],
    }  # fmt: skip
    a = make_run(tmp_path / "a", base, {}, num_layers=1)
    b = make_run(tmp_path / "b", other, {}, num_layers=1)
    summary = compare_runs([a, b], str(tmp_path / "cmp"), echo=print)
    printed = capsys.readouterr().out
    changes = pd.read_parquet(tmp_path / "cmp" / "changes.parquet").set_index(["metric", "layer"])
    weak = changes.loc[("adjusted_s_inter", 0)]
    assert weak["evidence"] == "k not robust" and math.isnan(weak["z"])
    assert weak["not_comparable"] == (
        "kmeans_k 2 -> 1; k decision not robust: kmeans_k_support 0.55 -> 0.95"
    )
    assert changes.loc[("adjusted_s_inter", 1), "evidence"] == "clustering changed"
    assert [r["layer"] for r in summary["largest_changes"]] == [1]  # the robust one only
    assert summary["k_not_robust"] == [
        "b layer 0: the K-means k decision is not robust (kmeans_k 2 -> 1; k decision not "
        "robust: kmeans_k_support 0.55 -> 0.95): not a change, and its 1 cluster-dependent "
        "metric is not comparable"
    ]
    assert summary["k_not_robust"][0] in printed
    assert summary["clustering_changed"] and "layer 1" in summary["clustering_changed"][0]
    assert "kmeans_k_support" in summary["not_ranked"]
    # a layer's metrics of k and of the best k share the robustness part: said once
    from embgeom_ray.runs.compare import _reasons

    weak = "k decision not robust: kmeans_k_support 0.65 -> 1.00"
    assert _reasons([f"kmeans_k 3 -> 2; {weak}", f"kmeans_best_k 3 -> 2; {weak}"]) == (
        f"kmeans_k 3 -> 2; {weak}; kmeans_best_k 3 -> 2"
    )


def test_z_score_edges() -> None:
    from embgeom_ray.runs.compare import z_score

    assert z_score(-1.5, 0.9, 1.2) == (1.5, -1.0)
    assert z_score(0.0, 0.0, 0.0) == (0.0, 0.0)
    assert z_score(0.5, 0.0, 0.0) == (0.0, math.inf)
    assert z_score(-0.5, 0.0, 0.0) == (0.0, -math.inf)
    for se in [(math.nan, 1.0), (1.0, math.nan), (math.inf, 1.0)]:
        se_diff, z = z_score(1.0, *se)
        assert math.isnan(se_diff) and math.isnan(z)


def test_sampled_metrics_are_known() -> None:
    """Every sampled column of layers.parquet is classed as sampled, every exact one as exact."""
    from embgeom_ray.core.metrics import LAYER_COLUMNS
    from embgeom_ray.core.rogue import sampled_clipped_cosines
    from embgeom_ray.core.sampled_metrics import SAMPLED_LAYER_COLUMNS, SE_METRICS
    from embgeom_ray.runs.compare import NOT_RANKED, metric_kind

    rng = np.random.default_rng(0)
    clipped = sampled_clipped_cosines(rng.normal(size=(6, 4)), np.array([0, 0, 1, 1, 2, 2]), [1])
    for col in [*SAMPLED_LAYER_COLUMNS, *clipped]:
        assert metric_kind(col) == "sampled", col
    for col in [*LAYER_COLUMNS, "isoscore_clipped", "s_inter_clipped_exact", "n_outlier_dims"]:
        assert metric_kind(col) == "exact", col
    assert {f"{m}_se" for m in SE_METRICS} <= set(NOT_RANKED)


# --- the size warning -------------------------------------------------------------------------


def _sized_runs(tmp_path: Path, tokens: list[int], sample_size: int | None = 64) -> list[str]:
    layers = [BASE_LAYERS, OTHER_LAYERS, OTHER_LAYERS]
    outliers = [BASE_OUTLIERS, OTHER_OUTLIERS, OTHER_OUTLIERS]
    return [
        make_run(tmp_path / f"r{i}", layers[i], outliers[i], tokens=n, sample_size=sample_size)
        for i, n in enumerate(tokens)
    ]


def _loaded(dirs: list[str]) -> list:
    return [load_run(d, lab) for d, lab in zip(dirs, "abc", strict=False)]


@pytest.mark.parametrize(
    ("tokens", "warns"),
    [
        ([8000, 800], False),  # exactly 10x: not more than 10x
        ([800, 8000], False),
        ([8000, 799], True),  # 10.01x
        ([799, 8000], True),  # either way round
        ([8000, 6400, 640], True),  # 12.5x between two later runs
        ([8000, 6400, 800], False),
    ],
)
def test_size_warning_at_ratio(tmp_path, tokens, warns) -> None:
    from embgeom_ray.runs.compare import size_warning

    runs = [load_run(d, f"r{i}") for i, d in enumerate(_sized_runs(tmp_path, tokens))]
    warning = size_warning(runs)
    assert (warning is not None) == warns
    if warns:
        ratio = max(tokens) / min(tokens)
        sizes = ", ".join(f"r{i}: {n:,}" for i, n in enumerate(tokens))
        assert warning == f"the runs differ {ratio:.0f}x in size (tokens {sizes})"


def test_small_run_warning_and_unreliable_rogue_dims(tmp_path, capsys) -> None:
    """The demo against a 609-token run: one warning line, rogue changes not reliable."""
    from embgeom_ray.runs.compare import size_threshold, size_warning

    a, b = _sized_runs(tmp_path, [80_253, 609], sample_size=4096)
    summary = compare_runs([a, b], str(tmp_path / "cmp"), labels=["demo", "tiny"], echo=print)
    printed = capsys.readouterr().out
    warning = (
        "the runs differ 132x in size (tokens demo: 80,253, tiny: 609); tiny has fewer tokens "
        "than the sample size 4,096, so its sampled metrics rest on fewer points than a full "
        "sample (K-means, silhouettes and LID change with the number of points, which z, a "
        "measure of sampling noise, does not cover) and the rogue dimensions that appear or "
        "vanish against it are not reliable"
    )
    assert printed.count("warning:") == 1 and f"\nwarning: {warning}\n" in printed
    assert summary["size_warning"] == warning and summary["notes"][0] == warning
    assert summary["size_threshold"] == 4096 and summary["small_runs"] == ["tiny"]
    assert [r["tokens"] for r in summary["runs"]] == [80_253, 609]
    assert summary["rogue_dims"]["tiny"]["reliable"] is False
    assert "rogue dimensions that appeared in tiny: layer 0: [2] (not reliable" in printed
    rogue = pd.read_parquet(tmp_path / "cmp" / "rogue_dims.parquet")
    assert len(rogue) == 2 and not rogue["reliable"].any()

    # a small run within 10x: the threshold alone warns; at the threshold, nothing
    runs = _loaded(_sized_runs(tmp_path / "x", [8000, 4095], 4096))
    assert size_threshold(runs) == 4096
    assert size_warning(runs).startswith(
        "tokens a: 8,000, b: 4,095; b has fewer tokens than the sample size 4,096, so its sampled "
        "metrics rest on fewer points"
    )
    runs = _loaded(_sized_runs(tmp_path / "y", [8000, 4096], 4096))
    assert size_warning(runs) is None
    # no sample size recorded: the job's default --sample-size
    runs = _loaded(_sized_runs(tmp_path / "z", [8000, 4095], None))
    assert size_threshold(runs) == 4096 and size_warning(runs) is not None


def test_changes_against_small_runs_come_last_in_their_group(tmp_path) -> None:
    from embgeom_ray.runs.compare import changes_table, metric_columns, size_warning

    # base 8000 tokens; "small" 600 < the sample size 1000; "ok" 7000 — the same changes
    dirs = [
        make_run(tmp_path / name, layers, {}, tokens=n, sample_size=1000)
        for name, layers, n in [
            ("base", BASE_LAYERS, 8000),
            ("small", OTHER_LAYERS, 600),
            ("ok", OTHER_LAYERS, 7000),
        ]
    ]
    runs = [load_run(d, lab) for d, lab in zip(dirs, ["base", "small", "ok"], strict=True)]
    changes = changes_table(runs, metric_columns(runs), BY_INDEX)
    moved = changes[changes["change"] != 0]
    assert moved[["run", "metric", "layer", "small_run"]].values.tolist() == [
        ["ok", "anisotropy", 1, False],
        ["ok", "isoscore", 2, False],
        ["ok", "within_ratio", 2, False],
        ["small", "anisotropy", 1, True],
        ["small", "isoscore", 2, True],
        ["small", "within_ratio", 2, True],
    ]
    assert size_warning(runs) == (
        "the runs differ 13x in size (tokens base: 8,000, small: 600, ok: 7,000); small has "
        "fewer tokens than the sample size 1,000, so its sampled metrics rest on fewer points "
        "than a full sample (K-means, silhouettes and LID change with the number of points, "
        "which z, a measure of sampling noise, does not cover) and the rogue dimensions that "
        "appear or vanish against it are not reliable"
    )
    # two small runs: plural
    runs[2].manifest.counts.tokens = 900
    warning = size_warning(runs)
    assert "small and ok have fewer tokens than the sample size 1,000, so their" in warning
    assert warning.endswith("appear or vanish against them are not reliable")


def test_compared_wording(tmp_path, capsys) -> None:
    from embgeom_ray.runs.compare import compared_line

    assert compared_line(["base", "new"]) == "compared 1 run against base"
    assert compared_line(["base", "b", "c"]) == "compared 2 runs against base"
    a, b, c = _sized_runs(tmp_path, [100, 110, 120])
    compare_runs([a, b, c], str(tmp_path / "cmp"), labels=["v1", "v2", "v3"], echo=print)
    assert capsys.readouterr().out.startswith("compared 2 runs against v1; ")


def test_samples_of_different_sizes_warn_and_their_sampled_changes_come_last(tmp_path, capsys):
    """Runs of 9,000 tokens each, one of them sampled with --sample-size 512 against 4,096: no
    run is small, yet its LID rests on an eighth of the points. The warning says so, and its
    sampled changes come after those of the run with the baseline's sample, whatever their z;
    its exact changes are not flagged."""
    lid = {"lid_euclidean_se": [0.1, 0.1, 0.1]}
    dirs = [
        make_run(tmp_path / name, layers | {"lid_euclidean": values} | lid, {}, tokens=9000,
                 sample_size=size)
        for name, layers, values, size in [
            ("base", BASE_LAYERS, [10.0, 12.0, 14.0], 4096),
            ("same", OTHER_LAYERS, [10.0, 13.0, 14.0], 4096),  # layer 1: +1, z 7.1
            ("quick", OTHER_LAYERS, [10.0, 15.0, 14.0], 512),  # layer 1: +3, z 21.2
        ]
    ]
    summary = compare_runs(dirs, str(tmp_path / "cmp"), labels=["base", "same", "quick"],
                           echo=print)  # fmt: skip
    warning = (
        "tokens base: 9,000, same: 9,000, quick: 9,000; the samples differ in size (points "
        "base: 4,096, same: 4,096, quick: 512): quick's sampled metrics rest on fewer points, so "
        "its changes of K-means, silhouettes and LID are not like with like (they change with "
        "the number of points, which z, a measure of sampling noise, does not cover) and come "
        "after the others"
    )
    assert summary["size_warning"] == warning and summary["small_runs"] == []
    assert f"\nwarning: {warning}\n" in capsys.readouterr().out
    changes = pd.read_parquet(tmp_path / "cmp" / "changes.parquet")
    beyond = changes[changes["evidence"] == "beyond noise"]
    assert beyond[["run", "metric", "layer", "samples_differ"]].values.tolist() == [
        ["same", "lid_euclidean", 1, False],
        ["quick", "lid_euclidean", 1, True],
    ]
    assert beyond["z"].round(1).tolist() == [7.1, 21.2]
    exact = changes[changes["kind"] == "exact"]
    assert not exact["samples_differ"].any() and not changes["small_run"].any()
    # the same two samples: no warning, nothing flagged
    same = compare_runs(dirs[:2], str(tmp_path / "cmp2"), echo=lambda _: None)
    assert same["size_warning"] is None
    assert not pd.read_parquet(tmp_path / "cmp2" / "changes.parquet")["samples_differ"].any()
    # against a run that sampled nothing (--sample-size 0), the 512-point sample is not the
    # smaller one: no warning
    none = make_run(tmp_path / "none", OTHER_LAYERS, {}, tokens=9000, sample_size=0)
    assert compare_runs([dirs[2], none], str(tmp_path / "cmp3"), echo=lambda _: None)[
        "size_warning"
    ] is None
