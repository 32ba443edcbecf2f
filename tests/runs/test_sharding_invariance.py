"""Sampled results do not depend on the sharding: MiniLM on real English with repeated sentences,
run as one shard and as many shards over two workers with another batch size.

The two runs draw the same sample (bottom-k keys), but their forwards batch the windows
differently, so the sampled vectors differ in their last bits. Repeats are recognised by
content key, not by float equality, and K-means fits a fixed set of k from seedings drawn by
exponential races, keeping the lowest inertia under canonical labels: every sampled column
agrees, discrete ones exactly, continuous ones to 1e-4 relative, and comparing the runs finds
no change at all.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from embgeom_ray.config import build_config
from embgeom_ray.core.sampled_metrics import SAMPLED_LAYER_COLUMNS
from embgeom_ray.runs.compare import AGREE, BEYOND_NOISE, CLUSTERING_CHANGED, compare_runs
from embgeom_ray.runs.pipeline import analyze
from tests.conftest import repeated_sentences, write_jsonl

pytestmark = pytest.mark.slow

#: sampled columns that are counts, choices or flags: equal exactly
DISCRETE = {
    "kmeans_k", "kmeans_best_k", "kmeans_k_searched", "kmeans_k_at_cap",
    "kmeans_k_support", "kmeans_structure_support",
    "sample_duplicate_points", "adjusted_clusters_used", "adjusted_clusters_left_out",
}  # fmt: skip


@pytest.fixture(scope="module")
def two_shardings(tmp_path_factory, minilm_dir, _ray_session):
    tmp = tmp_path_factory.mktemp("sharding")
    corpus = write_jsonl(tmp / "repeated.jsonl", repeated_sentences())
    runs = {
        "one_shard": {"num_workers": 1},
        "many_shards": {"shard_bytes": 4096, "num_workers": 2, "batch_tokens": 512},
    }
    out = {}
    for name, options in runs.items():
        cfg = build_config(
            None,
            {
                "model": minilm_dir, "corpus": corpus, "out": str(tmp / name), "max_length": 64,
                "sample_size": 1024, "cpus_per_worker": 1, "no_report": True, **options,
            },
        )  # fmt: skip
        manifest = analyze(cfg, echo=lambda *_: None)
        tables = {t: pd.read_parquet(tmp / name / f"{t}.parquet") for t in ("layers", "samples", "kmeans")}
        out[name] = (tmp / name, manifest, tables)
    return out


def test_every_sampled_column_agrees_between_shardings(two_shardings):
    (_, ma, a), (_, mb, b) = two_shardings["one_shard"], two_shardings["many_shards"]
    assert ma["shards"]["total"] == 1 and mb["shards"]["total"] >= 4
    # the same sample, vectors that differ in their last bits, and repeats in it
    ua = a["samples"][a["samples"]["sample"] == "uniform"].reset_index(drop=True)
    ub = b["samples"][b["samples"]["sample"] == "uniform"].reset_index(drop=True)
    for col in ("layer", "key", "token_id", "doc_id", "window", "position", "content_key"):
        np.testing.assert_array_equal(ua[col], ub[col], err_msg=col)
    va, vb = np.stack(ua["vector"]), np.stack(ub["vector"])
    assert (va != vb).any(axis=1).sum() > 10, "the two batchings should round differently"
    np.testing.assert_allclose(va, vb, rtol=0, atol=1e-4)
    la, lb = a["layers"].set_index("layer"), b["layers"].set_index("layer")
    for layer, rows in ua.groupby("layer"):  # repeats by content (and, at layer 0, by bits)
        repeats = len(rows) - rows["content_key"].nunique()
        assert la.at[layer, "sample_duplicate_points"] >= repeats > 20
    # every sampled column: discrete exactly, continuous to 1e-4 relative
    for col in SAMPLED_LAYER_COLUMNS:
        x, y = la[col].to_numpy(), lb[col].to_numpy()
        if col in DISCRETE:
            np.testing.assert_array_equal(x, y, err_msg=col)
        else:
            np.testing.assert_allclose(
                x.astype(float), y.astype(float), rtol=1e-4, atol=1e-9, err_msg=col
            )
    # the clusters of every occurrence, and the K-means curve of every layer
    np.testing.assert_array_equal(ua["cluster"], ub["cluster"])
    ka, kb = a["kmeans"], b["kmeans"]
    np.testing.assert_array_equal(ka[["layer", "k", "best", "chosen"]], kb[["layer", "k", "best", "chosen"]])
    np.testing.assert_allclose(ka["silhouette"], kb["silhouette"], rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(ka["inertia"], kb["inertia"], rtol=1e-4)
    # the scan is the same fixed set of k in every layer, 2..15 then the grid to 60
    assert set(ka.groupby("layer")["k"].max()) == {60}


def test_compare_of_two_shardings_reports_no_change(two_shardings, tmp_path):
    """Every difference, exact (float64 rounding of another order of sums) or sampled (the
    forward's rounding), is within its bound: compare lists no change and says so."""
    (pa, _, _), (pb, _, _) = two_shardings["one_shard"], two_shardings["many_shards"]
    printed: list[str] = []
    summary = compare_runs([str(pa), str(pb)], str(tmp_path / "cmp"), echo=printed.append)
    assert summary["largest_changes"] == [] and summary["k_not_robust"] == []
    assert {e for e, n in summary["evidence_counts"].items() if n} <= {AGREE}
    assert any(line.startswith("no change: every metric agrees") for line in printed), printed
    assert summary["evidence_counts"][BEYOND_NOISE] == 0
    assert summary["evidence_counts"][CLUSTERING_CHANGED] == 0
    assert summary["clustering_changed"] == [] and summary["clipping_changed"] == []
    assert summary["largest_exact"] == summary["largest_sampled"] == []
    (tests,) = summary["sampled_tests"].values()  # real z of one sample, rounded differently
    assert tests["tested"] > 50 and tests["beyond_noise"] == tests["discoveries"] == 0
    changes = pd.read_parquet(tmp_path / "cmp" / "changes.parquet")
    sampled = changes[changes["kind"] == "sampled"]
    with_se = sampled["z"].notna()
    assert with_se.sum() > 50 and (sampled.loc[with_se, "z"].abs() < 1e-2).all()
    assert (sampled["relative"].abs().fillna(0) < 1e-4).all()  # those without a standard error
