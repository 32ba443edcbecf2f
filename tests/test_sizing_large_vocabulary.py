"""A Llama-shaped model with Llama 3's 128,256-entry vocabulary, run with the default options
(no memory option): the job sizes itself, and every process stays within its budget.

The model is random (bench.vocabulary: d = 128, 2 blocks, so L = 3 hidden states) and the
corpus generated (200,000 words, half uniform over the vocabulary: ~70,000 types seen), so the
per-type state, 8·L·V_seen·(2d+2) ≈ 0.4 GiB, is more than the job's own process may reduce
within 1 GiB of its start. The job, in a fresh process as a user runs it:

- reduces on reducer actors, the job's own process peaking ≤ 1 GiB above its memory at start;
- each reducer's peak private memory ≤ the memory budget it was sized with;
- each extractor's ≤ the memory it asked Ray for;
- the tables equal those of a ``--reducers 1`` run (the job's own process reducing) to
  float64 rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30


def run(model: str, corpus: str, out: Path, *options: str) -> dict:
    """``python -m jobs.analyze`` in a fresh process (its own private Ray); the manifest."""
    env = os.environ | {"PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "jobs.analyze", "--model", model, "--corpus", corpus,
            "--out", str(out), *options]  # fmt: skip
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1100)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "sizing: " in done.stdout
    return json.loads((out / "manifest.json").read_text())


def test_default_options_size_themselves_within_every_budget(tmp_path):
    from bench.vocabulary import generated_corpus, wordlevel_llama_dir

    model = wordlevel_llama_dir(tmp_path / "model", 128_256, 128, 2)
    corpus = generated_corpus(tmp_path / "corpus.jsonl", 128_256, 200_000)
    m = run(model, corpus, tmp_path / "default")
    sizing, memory = m["sizing"], m["memory"]
    types = sizing["reduce"]["types"]
    assert types > 60_000
    state = 8 * 3 * types * (2 * 128 + 2)
    assert state > 0.35 * GiB  # three times that is more than the job's process may hold
    # decided at the start for V = 128,256 (the corpus is larger than the vocabulary)
    assert sizing["types_bound"] == 128_256
    assert sizing["reducers"]["count"] >= 1 and sizing["reduce"]["count"] >= 1
    assert m["reducers"]["count"] == sizing["reduce"]["count"]
    # the job's own process: ≤ 1 GiB above its memory at start
    assert memory["driver_peak_private_bytes"] - memory["driver_start_private_bytes"] <= GiB
    # each reducer within its budget
    budget = m["reducers"]["memory_budget_bytes"]
    assert budget == sizing["reduce"]["memory"]
    assert all(peak <= budget for peak in memory["reducer_peak_private_bytes"])
    # each extractor within what it asked Ray for
    assert m["workers"]["memory_bytes"] == sizing["extractors"]["memory"]
    assert memory["extractor_peak_private_bytes"] <= m["workers"]["memory_bytes"]

    one = run(model, corpus, tmp_path / "one", "--reducers", "1", "--no-report")
    assert one["sizing"]["reduce"]["count"] == 0 and "reducers" not in one
    for name, keys in (("type_stats", ["layer", "token_id"]), ("dims", ["layer", "dim"]),
                       ("positions", ["layer", "position"]), ("layers", ["layer"])):  # fmt: skip
        a = pd.read_parquet(tmp_path / "default" / f"{name}.parquet")
        b = pd.read_parquet(tmp_path / "one" / f"{name}.parquet")
        a, b = (t.sort_values(keys).reset_index(drop=True) for t in (a, b))
        pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-9, atol=1e-12)
