"""A Llama-shaped model with Llama 3's 128,256-entry vocabulary, run, re-analysed and merged
with the default options (no memory option): every process sizes itself and stays within
its budget.

The model is random (bench.vocabulary: d = 192, 2 blocks, so L = 3 hidden states) and the
corpus generated in two halves of 60,000 words (each half uniform over the vocabulary, half
Zipf: ~30,000 types each, ~55,000 together), so the per-type state, 8·L·V_seen·(2d+2), is
more than the job's own process may reduce within 1 GiB of its start. As users run them, each
in a fresh process, one after the other, each joining the tests' local Ray (``ray_local``)
through ``RAY_ADDRESS``, as a user names a cluster (a private Ray each took ~6 s of CPU to
start, and sizes the job the same: two CPUs, this machine's memory):

1. ``jobs.reanalyze`` of a watch list naming the model, over half A: the run it makes;
2. ``jobs.analyze`` over half B;
3. ``jobs.merge`` of the two runs.

Each job's own process peaks ≤ 1 GiB above its memory at start; every reducer's peak private
memory is ≤ the budget it was sized with; every extractor's ≤ the memory it asked Ray for. The
merge's statistics and tables equal an independent reference: the two runs' statistics
artefacts loaded here, merged by the core in one process
(:meth:`~embgeom_ray.core.statistics.EmbeddingStatistics.merge`) and tabled
(:func:`~embgeom_ray.core.tables.build_tables`), to float64 rounding. (That the merge of two
runs equals one run over the union, and the driver reducing in process, are tested at a small
vocabulary in tests/runs/test_merge_runs.py and tests/distributed/test_reducers.py.)

No option that sizes anything is given: the sample keeps its default size; only the sampled
metrics' work on it is cut (``--kmeans-k-max 3``, ``--sampled-se-replicates 0``,
``--kmeans-stability-seeds 0``, ``--s-inter-draws 2``, ``--silhouette-max-points 1024``: the
K-means scan, the standard errors and the other metrics are tested in tests/core), and run B writes no report (run A's and the merge's do;
the report itself: tests/report).

The corpus is about the least that keeps the assertion below: ~30,300 types in a half (60,000
words), and 8·L·V·(2d+2) > 0.25 GiB needs V > 28,976 at L = 3, d = 192 (the driver would
reduce in process only below ~17,400 types).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
GiB = 2**30
VOCAB, DIM, BLOCKS, WORDS = 128_256, 192, 2, 60_000
#: the sampled metrics' work cut, the sample's size (and every sizing input) left at its default
METRICS = {"kmeans_k_max": 3, "sampled_se_replicates": 0, "kmeans_stability_seeds": 0,
           "s_inter_draws": 2, "silhouette_max_points": 1024}
QUICK_METRICS = [f"--{k.replace('_', '-')}={v}" for k, v in METRICS.items()]


def run(module: str, *argv: str) -> str:
    """``python -m module argv`` in a fresh process (joining the cluster ``RAY_ADDRESS`` names,
    the test's); its stdout."""
    env = os.environ | {"PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", module, *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1500)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def within_budgets(m: dict) -> None:
    """The job's own process, every reducer and every extractor within its budget."""
    memory = m["memory"]
    assert memory["driver_peak_private_bytes"] - memory["driver_start_private_bytes"] <= GiB
    if "reducers" in m:
        budget = m["reducers"]["memory_budget_bytes"]
        assert budget == m["sizing"]["reduce"]["memory"]
        assert all(peak <= budget for peak in memory["reducer_peak_private_bytes"])
    if m.get("workers"):
        assert m["workers"]["memory_bytes"] == m["sizing"]["extractors"]["memory"]
        assert memory["extractor_peak_private_bytes"] <= m["workers"]["memory_bytes"]


def test_default_options_size_themselves_within_every_budget(tmp_path, ray_local, monkeypatch):
    from bench.vocabulary import generated_corpus, wordlevel_llama_dir

    model = wordlevel_llama_dir(tmp_path / "model", VOCAB, DIM, BLOCKS)
    halves = tmp_path / "corpus"
    halves.mkdir()
    a = generated_corpus(halves / "a.jsonl", VOCAB, WORDS, seed=1)
    b = generated_corpus(halves / "b.jsonl", VOCAB, WORDS, seed=2)

    # every job joins the tests' local Ray, as a user names a cluster
    monkeypatch.setenv("RAY_ADDRESS", ray_local.get_runtime_context().gcs_address)
    # 1. the scheduled re-analysis of half A, no memory option in the watch list, then
    # 2. half B (one at a time: two jobs sizing themselves on one cluster would share it)
    watchlist = tmp_path / "models.yaml"
    watchlist.write_text(f"models:\n  - model: {model}\n    options: {json.dumps(METRICS)}\n")
    store = tmp_path / "store"
    run("jobs.reanalyze", "--watchlist", str(watchlist), "--corpus", a, "--store", str(store))
    run("jobs.analyze", "--model", model, "--corpus", b, "--out", str(tmp_path / "b"),
        *QUICK_METRICS, "--no-report")  # fmt: skip
    (run_a,) = (store / "runs").iterdir()
    m_a = json.loads((run_a / "manifest.json").read_text())
    m_b = json.loads((tmp_path / "b" / "manifest.json").read_text())
    for m in (m_a, m_b):
        assert m["sizing"]["types_bound"] == VOCAB  # each half's bytes exceed the vocabulary
        types = m["sizing"]["reduce"]["types"]
        assert 8 * 3 * types * (2 * DIM + 2) > 0.25 * GiB  # too much to reduce in the driver
        assert m["sizing"]["reduce"]["count"] >= 1 and m["reducers"]["count"] >= 1
        within_budgets(m)

    # 3. their merge
    out = run("jobs.merge", "--out", str(tmp_path / "ab"), str(run_a), str(tmp_path / "b"))
    assert "types in the runs: reducers:" in out
    m_ab = json.loads((tmp_path / "ab" / "manifest.json").read_text())
    assert m_ab["sizing"]["reduce"]["count"] >= 1 and m_ab["reducers"]["count"] >= 1
    within_budgets(m_ab)
    assert m_ab["counts"]["tokens"] == m_a["counts"]["tokens"] + m_b["counts"]["tokens"]

    # the reference: the runs' statistics merged by the core in this process, and tabled
    from embgeom_ray.core.options import TableOptions
    from embgeom_ray.core.tables import build_tables
    from embgeom_ray.inputs.model_loading import load_tokenizer
    from embgeom_ray.run_dir import RunDir

    merged = RunDir(str(run_a)).load_statistics().merge(RunDir(str(tmp_path / "b")).load_statistics())
    theirs = RunDir(str(tmp_path / "ab")).load_statistics()
    for layer in (0, 1, 2):
        want, got = merged.layer(layer), theirs.layer(layer)
        assert got.n == want.n == m_ab["counts"]["tokens"]
        np.testing.assert_array_equal(got.type_ids, want.type_ids)
        np.testing.assert_array_equal(got.counts, want.counts)
        for field in ("means", "m2", "mean", "comoment"):
            np.testing.assert_allclose(getattr(got, field), getattr(want, field), rtol=1e-9,
                                       atol=1e-12, err_msg=f"{field} of layer {layer}")  # fmt: skip
    tables = build_tables(merged, load_tokenizer(model, None, False), TableOptions())
    for name, keys in (("type_stats", ["layer", "token_id"]), ("positions", ["layer", "position"]),
                       ("layers", ["layer"]), ("dims", ["layer", "dim"])):  # fmt: skip
        got = pd.read_parquet(tmp_path / "ab" / f"{name}.parquet")
        want = tables[name][[c for c in got.columns if c in tables[name].columns]]
        got = got[want.columns]
        got, want = (t.sort_values(keys).reset_index(drop=True) for t in (got, want))
        pd.testing.assert_frame_equal(got, want, check_exact=False, rtol=1e-9, atol=1e-12,
                                      check_dtype=False, obj=name)  # fmt: skip
