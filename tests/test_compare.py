"""``jobs.compare``: per-layer metrics side by side, largest changes, rogue dims that changed.

The runs are fabricated (manifest.json, layers.parquet, dims.parquet with an ``outlier``
column), small enough that every expected row is written out by hand. Values are binary
fractions, so changes compare exactly. A comparison of two real runs is in
tests/test_reanalyze.py (a planted rogue dimension appears).
"""

from __future__ import annotations

import json
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
        "kind", "se_baseline", "se_run", "se_diff", "z", "within_noise", "evidence",
    ]  # fmt: skip
    # every metric here is exact: no standard error, never within noise, ranked by score
    assert (changes["kind"] == "exact").all() and (changes["evidence"] == "exact").all()
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
    (Path(b) / "layers.parquet").unlink()
    with pytest.raises(CompareError, match=r"says it is complete but has no layers\.parquet"):
        load_run(b, "b")
