"""``--plan``: what will run where, before anything runs.

MiniLM on the tests' local Ray: the plan's decisions are the ones the run records. 8B- and
70B-shaped Llama models (their configs alone, no weights: bench.plans) on a simulated cluster
of fake H100 GPUs: the plan exits 0 with the decisions the policy gives (checked here against
the formulas written out), and on a cluster that cannot hold them the plan refuses with the
message the run would give.
"""

from __future__ import annotations

import json
import math

import pytest

from embgeom_ray.config import build_config
from embgeom_ray.errors import ConfigError
from embgeom_ray.sizing.formulas import gib
from tests.conftest import write_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

GiB = 2**30


def test_minilm_plan_is_what_the_run_records(ray_local, minilm_dir, tmp_path, capsys):
    from embgeom_ray.runs.pipeline import analyze
    from jobs.analyze import main
    from tests.runs.test_job_end_to_end import english_documents

    corpus = write_jsonl(tmp_path / "c.jsonl", english_documents(8, 300))
    # a sample of 16 points: drawn and sized (Q), too small for the sampled metrics' tasks
    # (MIN_SAMPLE_POINTS; those are tested in tests/core/test_sampled_metrics.py)
    argv = ["--model", minilm_dir, "--corpus", corpus, "--out", str(tmp_path / "run"),
            "--sample-size", "16", "--kmeans-k-max", "3", "--no-report"]  # fmt: skip
    assert main([*argv, "--plan"]) == 0
    printed = capsys.readouterr().out
    assert not (tmp_path / "run").exists()
    for what in ("model: ", "6 blocks, d = 384", "V = 30,522 tokenizer entries", "extractors:",
                 "memory each:", "reduce", "driver (the job's own process)", "artefact:",
                 "checkpoints: every T = B / (5% · W) s (W: one writer's) within [60 s, 3600 s]",
                 "written by each extractor (1 writers at once) where every extractor's node sees "
                 "the run's directory"):  # fmt: skip
        assert what in printed, what
    # a CPU's batch from MiniLM's shape: d_ff = 1,536 float32 values a token within 32 MiB
    assert "5,120 padded tokens a batch (a CPU's: one layer's largest tensor" in printed
    config = build_config(None, {"model": minilm_dir, "corpus": corpus,
                                 "out": str(tmp_path / "run"), "sample_size": 16,
                                 "kmeans_k_max": 3, "no_report": True})  # fmt: skip
    planned = analyze(config.model_copy(update={"plan": True}), echo=lambda *_: None)
    manifest = analyze(config, echo=lambda *_: None)
    recorded = dict(manifest["sizing"])
    recorded.pop("reduce")
    # what the run measured of its checkpoints' writes, by the rule the plan states
    checkpoints = recorded.pop("checkpoints")
    assert checkpoints["given_s"] is None and checkpoints["flushes"] >= 1
    assert recorded == json.loads(json.dumps(planned))
    assert manifest["workers"]["memory_bytes"] == planned["extractors"]["memory"]
    assert manifest["workers"]["num_workers"] == planned["extractors"]["num_workers"]
    assert manifest["workers"]["batch_tokens"] == planned["extractors"]["batch_tokens"] == 5120
    assert manifest["memory"]["extractor_peak_private_bytes"] <= planned["extractors"]["memory"]


@pytest.fixture(scope="module")
def h100_cluster():
    """A head of 64 GiB (8 CPUs) and two nodes of 8 fake H100s, 96 CPUs and 2 TiB each."""
    import ray

    from bench.plans import start_cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = start_cluster(2, 8, "H100", 96, 2048 * GiB, 64 * GiB)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def state(layers: int, d: int, types: int, positions: int = 128) -> int:
    """8·L·V·(2d+2) + 8V + 8·L·(d² + 3d + P(d+1) + 2)."""
    rows = 8 * (layers * types * (2 * d + 2) + types)
    return rows + 8 * layers * (d * d + 3 * d + positions * (d + 1) + 2)


@pytest.mark.own_ray_cluster
@pytest.mark.parametrize(("size", "layers", "d", "gpus"), [("8b", 33, 4096, 1), ("70b", 81, 8192, 4)])
def test_llama_plans_follow_the_policy(h100_cluster, tmp_path, capsys, size, layers, d, gpus):
    from bench.plans import llama_config_dir, sparse_corpus
    from jobs.analyze import main

    model = llama_config_dir(tmp_path / size, size)
    corpus = sparse_corpus(tmp_path / "corpus.jsonl", 40 * GiB)
    argv = ["--model", model, "--corpus", corpus, "--out", str(tmp_path / "run"),
            "--dtype", "bfloat16", "--sample-size", "256"]  # fmt: skip
    # --plan-json: the plan printed, and its decisions written as JSON for a platform's tools
    assert main([*argv, "--plan-json", str(tmp_path / "plan.json")]) == 0
    printed = capsys.readouterr().out
    assert not (tmp_path / "run").exists()
    assert f"V_seen ≤ V = {128_256:,}" in printed  # the corpus (40 GiB) bounds nothing
    assert f"plan: its decisions as JSON in {tmp_path / 'plan.json'}" in printed
    # default shards: 16 MiB for the 8B, a tenth for the 70B's 10× the work a token
    shards = {"8b": "2,560 shards of 16 MiB", "70b": "25,601 shards of 1.6 MiB"}[size]
    assert f"{shards} (a 16th of the corpus within [1 MiB, {shards.split(' of ')[1]}]" in printed
    from embgeom_ray.runs.pipeline import analyze

    planned = analyze(build_config(None, {"model": model, "corpus": corpus, "out": "o",
                                          "dtype": "bfloat16", "sample_size": 256,
                                          "plan": True}), echo=lambda *_: None)  # fmt: skip
    pool, reduce = planned["extractors"], planned["reducers"]
    assert json.loads((tmp_path / "plan.json").read_text()) == planned  # what eg.plan returns
    assert f"memory each: {gib(pool['memory'])} asked of Ray" in printed
    # GPUs: the fewest of one node holding twice the weights (80 GB an H100)
    assert pool["num_gpus"] == gpus and pool["num_workers"] == 16 // gpus
    assert pool["batch_tokens"] is None  # decided on each GPU, once the model is loaded
    # reducers: the fewest of at most half the largest offer (2 TiB), that the nodes hold
    whole = state(layers, d, 128_256)
    assert reduce["count"] >= math.ceil(3 * whole / (1024 * GiB))
    share = -(-128_256 // reduce["count"])
    held = state(layers, d, share) - state(layers, d, 0) + state(-(-layers // reduce["count"]), d, 0)
    assert reduce["memory"] == 512 * 2**20 + 3 * held <= 1024 * GiB
    assert len(reduce["nodes"]) == reduce["count"]
    assert f"reducers: {reduce['count']} actor(s)" in printed
    assert "--layers every 4th layer" in printed


@pytest.mark.own_ray_cluster
def test_a_plan_that_cannot_fit_refuses_as_the_run_would(h100_cluster, tmp_path, capsys):
    """The 70B model's weights on one GPU each (--gpus-per-worker 1): the host memory a node
    offers 8 extractors cannot load them; the plan and the run refuse with the same words."""
    from bench.plans import llama_config_dir, sparse_corpus
    from jobs.analyze import main

    model = llama_config_dir(tmp_path / "70b", "70b")
    corpus = sparse_corpus(tmp_path / "corpus.jsonl", 40 * GiB)
    argv = ["--model", model, "--corpus", corpus, "--out", str(tmp_path / "run"),
            "--dtype", "bfloat16", "--gpus-per-worker", "1", "--num-workers", "16"]  # fmt: skip
    assert main([*argv, "--plan"]) == 2
    planned = capsys.readouterr().err
    assert main(argv) == 2
    ran = capsys.readouterr().err
    assert "an extractor needs at least" in planned and "--num-workers" in planned
    assert planned.splitlines()[-1] == ran.splitlines()[-1]
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="--gpus-per-worker 16 exceeds"):
        main_config = build_config(None, {"model": model, "corpus": corpus, "out": "o",
                                          "gpus_per_worker": 16, "plan": True})  # fmt: skip
        from embgeom_ray.runs.pipeline import analyze

        analyze(main_config, echo=lambda *_: None)
