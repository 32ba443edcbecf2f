"""Smoke tests of the benchmark scripts: each ``main()`` at its tiniest sizes, so they cannot rot.

Results go to a temporary folder (``bench.common.RESULTS`` is patched), never over the real
``bench/results/*.json``. The numbers are not checked, only that every script runs end to end
and writes its JSON with the keys the tables of ``docs/benchmarks.md`` are built from.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    """The results' folder; the benchmark's work folders are made in ``work`` beside it, which
    must be empty once the test ends (nothing of a run left behind)."""
    import bench.common

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    work = tmp_path / "work"
    monkeypatch.setenv(bench.common.WORK_ENV, str(work))
    monkeypatch.delenv(bench.common.KEEP_WORK_ENV, raising=False)
    yield tmp_path
    assert not work.exists() or list(work.iterdir()) == [], "a work folder was left behind"


def read(results_dir, name: str) -> dict:
    path = results_dir / f"{name}.json"
    assert path.exists(), f"{name}.json was not written"
    result = json.loads(path.read_text())
    assert {"command", "args", "machine"} <= result.keys()
    return result


def test_extraction_smoke(results_dir):
    """On one document of the demo prose (``--tokens 100``: its first, ~150 tokens)."""
    from bench import extraction

    extraction.main(
        ["--models", "minilm", "--tokens", "100", "--repeats", "1", "--bare-batch-tokens", "1024"]
    )
    (res,) = read(results_dir, "extraction")["results"]
    assert res["model"] == "minilm" and res["tokens"] > 0
    assert {"bare_forward", "bare_forward_1024", "extractor", "extractor_one_lane"} <= res[
        "tokens_per_s"
    ].keys()
    assert res["ratio_to_bare_forward"]["extractor"] > 0
    best = res["bare_forward_best"]
    assert best["batch_tokens"] in (1024, res["batch_tokens"])
    seconds = res["seconds"]
    bares = [k for k in seconds if k.startswith("bare_forward")]
    assert ("bare_forward_lanes" in bares) == (res["lanes"] > 1)  # in the extractor's lanes too
    assert best["seconds"] == min(seconds[k] for k in bares)
    assert res["ratio_to_best_bare_forward"]["extractor"] == pytest.approx(
        best["seconds"] / res["seconds"]["extractor"]
    )


def test_bare_forward_sweep_smoke(tmp_path):
    """bench.bare_forward's sweep (a process per thread count) and its timed run, on 8
    documents cut to 1,500 characters (~20 windows of 128: a few batches in each batching,
    so two lanes run two at once; whole, two of them alone were 3 of every 4 characters):
    one lane, and two where there are two threads."""
    from bench.bare_forward import best_bare_forward, timed_bare_forward
    from bench.common import english_jsonl, minilm_dir

    lines = open(english_jsonl(tmp_path / "full.jsonl")).read().splitlines()
    docs = [json.loads(line) for line in lines[:8]]
    corpus = tmp_path / "small.jsonl"
    corpus.write_text("".join(json.dumps(d | {"text": d["text"][:1500]}) + "\n" for d in docs))
    res = best_bare_forward(
        minilm_dir(), str(corpus), 128, ["rows:8", "tokens:1024"], [1, 2], ["reuse"],
        repeats=1, rounds=1, lanes=(1, 2),
    )  # fmt: skip
    batchings = ("rows:8", "tokens:1024")
    configs = {f"{b} lanes:1 threads:{n} reuse" for b in batchings for n in (1, 2)}
    configs |= {f"{b} lanes:2 threads:2 reuse" for b in batchings}  # lanes ≤ threads
    assert set(res["positions_per_s"]) == configs
    best = res["best"]
    key = f"{best['batching']} lanes:{best['lanes']} threads:{best['threads']} {best['allocator']}"
    assert best["positions_per_s"] == max(r[0] for r in res["positions_per_s"].values())
    assert res["positions_per_s"][key] == [best["positions_per_s"]]
    assert res["padding"]["tokens:1024"] >= 1.0
    timed = timed_bare_forward(minilm_dir(), str(corpus), 128, best)
    assert timed["tokens"] > 0 and timed["seconds"] > 0 and timed["padding"] >= 1.0


def test_kmeans_smoke(results_dir, ray_local):
    """On the tests' local Ray (the bench uses a Ray already up as is)."""
    from bench import kmeans

    kmeans.main(
        "--sizes 32,64 --ks 2,3 --repeats 1 --n-init 1 --selection 64 --selection-k-max 3".split()
    )
    result = read(results_dir, "kmeans")
    assert result["points"]["dim"] == 384
    assert [(r["n"], r["k"]) for r in result["results"]] == [(32, 2), (32, 3), (64, 2), (64, 3)]
    for r in result["results"]:
        assert {"inertia_ratio", "time_ratio", "seconds", "inertia"} <= r.keys()
        assert 0.5 < r["inertia_ratio"] < 2.0
    sel = result["selection"]
    assert sel["n"] == 64 and sel["dim"] == 384 and sel["layers"] == list(range(7))
    assert set(sel["seconds"]) == {"distributed", "one_task_per_layer", "stage"}
    for route in ("distributed", "one_task_per_layer"):
        assert all(r["k"] in (1, 2, 3) for r in sel["per_layer"][route].values())


def test_kmeans_shares_smoke(results_dir, ray_local):
    """On the tests' local Ray (the bench uses a Ray already up as is)."""
    from bench import kmeans_shares

    kmeans_shares.main("--size 300 --layers 2,3 --seeds 0 --repeats 1".split())
    (result,) = read(results_dir, "kmeans_shares")["results"]
    assert result["same_results"] is True  # the fits spread over tasks change nothing
    assert set(result["seconds"]) == {"one_share", "shares"}
    assert set(result["k_searched"]) == {"2", "3"}
    assert all(15 <= k <= 60 for k in result["k_searched"].values())


def test_scaling_smoke(results_dir, ray_local):
    """The throughput section on the tests' local Ray of 2 CPUs (``--address``), not on a
    simulated cluster of its own, which shut the tests' Ray down (restarted by the next test
    that needs it: ~5 s, and its workers' imports again)."""
    from bench import scaling

    address = ray_local.get_runtime_context().gcs_address
    scaling.main(
        (
            "--tokens 1000 --shards 4 --sample-size 0 --copies 1,2 --memory-parallel "
            "--layers 2 --vocab 50,100 --dims 8,16 --reduce-shards 2,3 --reduce-tokens 128 "
            f"--address {address}"
        ).split()
    )
    assert ray_local.is_initialized()  # the tests' Ray, still up
    result = read(results_dir, "scaling")
    assert set(scaling.SECTIONS) <= result.keys()
    tp = result["throughput"]
    assert set(tp["tokens_per_s"]) == {"1", "2"} and tp["ratio_2_to_1"] > 0
    assert tp["cluster"] == address and address in tp["note"]  # not "2 simulated nodes"
    assert tp["runs"]["1"][0]["shards"] >= 2
    mem = result["memory"]
    assert [r["copies"] for r in mem["runs"]] == [1, 2]
    assert mem["runs"][1]["tokens"] == 2 * mem["runs"][0]["tokens"]
    assert all(r["peak_rss_mib"] > 0 for r in mem["runs"])
    art = result["artefact"]["runs"]
    assert len(art) == 4
    for r in art:  # the formula counts every array byte; only the JSON header is extra
        assert r["formula_bytes"] <= r["bytes"] < r["formula_bytes"] + 4096
    red = result["reduce"]["runs"]
    assert [r["shards"] for r in red] == [2, 3]
    assert all(r["reduce_s_per_shard"] > 0 for r in red)


def test_sampled_stage_smoke(results_dir):
    import subprocess

    from bench import sampled_stage
    from bench.common import REPO

    # the baseline is this checkout's HEAD (its package imported under another name)
    git = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], check=False, capture_output=True
    )
    baseline = "HEAD" if git.returncode == 0 else "none"
    sampled_stage.main(f"--size 128 --layers 0 --repeats 1 --baseline {baseline}".split())
    (res,) = read(results_dir, "sampled_stage")["results"]
    assert res["layer"] == 0 and res["n"] == 128 and res["seconds"]["current"]["select_k"] > 0
    assert {"select_k", "total", "no_se", "se", "layer"} <= res["seconds"]["current"].keys()
    if baseline == "HEAD":  # the same code on both sides: the same selection
        assert res["k"]["baseline"] == res["k"]["current"] and res["ratio"] > 0


def test_sampled_stage_synthetic_smoke(results_dir):
    """``--synthetic-dim``: the stage timed on synthetic points of a given shape (a large
    model's, which MiniLM cannot give), every point distinct, of the asked dimension."""
    from bench import sampled_stage

    X, tok, tv, keys = sampled_stage.synthetic_layer(300, 48, seed=1)
    assert X.shape == (300, 48) and X.dtype == np.float32 and len(np.unique(keys)) == 300
    assert len(tv) == len(np.unique(tok)) >= 2
    sampled_stage.main("--size 200 --layers 0,1 --repeats 1 --baseline none --synthetic-dim 24".split())
    res = read(results_dir, "sampled_stage")
    assert res["points"] == {"model": "synthetic", "dim": 24}
    assert [r["n"] for r in res["results"]] == [200, 200]
    assert all(r["seconds"]["current"]["layer"] > 0 for r in res["results"])


def test_sampled_schedule_smoke(results_dir, ray_local):
    """The stage's two orders of tasks replayed as sleeps (1/200 of the measured seconds) on
    the tests' Ray of 2 CPUs (one of them may be held by another test's actor in ``make test``:
    the bench replays on the CPUs free when it starts): two tasks a layer no faster than the
    bound of all the Ray's CPUs (a CPU held at the start may be freed during the replay)."""
    import ray

    from bench import sampled_schedule

    sampled_schedule.main("--scale 200 --repeats 1".split())
    res = read(results_dir, "sampled_schedule")
    assert res["cpus"] in (1, 2) and len(res["times"]) == 7
    work = res["bound"] * res["cpus"]  # the layers' seconds, replayed
    assert res["seconds"]["two_tasks_a_layer"] >= work / ray.cluster_resources()["CPU"] * 0.99


def test_kmeans_quality_smoke(results_dir):
    from bench import kmeans_quality

    kmeans_quality.main("--size 200 --layers 3 --k-max 17".split())
    (res,) = read(results_dir, "kmeans_quality")["results"]
    assert res["layer"] == 3 and sorted(map(int, res["ratio"])) == [*range(2, 16), 17]
    assert res["max_low"] >= res["median_low"] > 0 and res["max_high"] > 0
    assert {"k", "best_k", "k_support"} <= res["ours"].keys() and res["sklearn"]["best_k"] >= 2


def test_vocabulary_fold_smoke(results_dir, tmp_path):
    from bench import vocabulary

    vocabulary.main(
        "--vocab 600 --dim 256 --blocks 1 --tokens 3000 --fold-tokens 1000 --no-jobs "
        "--fold-budget 1MiB --batch-tokens 512,1024 --profile".split()
    )
    small, fold = read(results_dir, "vocabulary")["folds"]  # one per --batch-tokens
    assert (small["batch_tokens"], fold["batch_tokens"]) == (512, 1024)
    assert small["types"] == fold["types"] and small["device"] == "cpu"
    assert fold["vocab"] == 600 and fold["tokens"] >= 1000 and 0 < fold["types"] <= 600
    assert (fold["layers"], fold["blocks"], fold["dim"]) == (2, 1, 256)
    assert fold["forward_us_per_token_block"] > 0 and fold["fold_seen_us_per_token_layer"] > 0
    assert fold["state_peak_device_bytes"] is None  # a GPU's only
    assert fold["forward_s"] > 0 and fold["fold_s"] > 0 and fold["fold_seen_over_forward"] > 0
    # under a 1 MiB budget (~200 types of d = 256, L = 2) the fold spills
    assert fold["budget_bytes"] == 2**20 and fold["spills"] >= 1
    assert fold["fold_budget_us_per_token"] > 0
    # the model keeps Llama 3's proportions at any width: MLP 3.5 d, heads of 128, 4:1 GQA
    cfg = json.loads(
        (vocabulary.Path(vocabulary.wordlevel_llama_dir(tmp_path / "m", 600, 512, 1)) / "config.json")
        .read_text()
    )
    assert (cfg["intermediate_size"], cfg["num_attention_heads"]) == (1792, 4)
    assert cfg["num_key_value_heads"] == 1 and cfg["hidden_size"] == 512


def test_comoment_smoke(results_dir):
    from bench import comoment

    comoment.main("--dims 64 --rows 256 --repeats 2 --device cpu".split())
    res = read(results_dir, "comoment")["dims"]["64"]
    # the float64 products agree with the float64 reference to rounding, float32 to ~1e-6
    assert res["f64_upper"]["rel_frobenius"] < 1e-13 and res["f64_full"]["rel_frobenius"] < 1e-13
    assert 0 < res["f32_upper"]["rel_frobenius"] < 1e-5
    assert res["f32_upper"]["over_f32_upper"] == 1.0 and res["f64_full"]["seconds"] > 0
    # on a CPU the bf16 products are emulated (exact products, float32 sums): two pieces of
    # a float32 hold 16 of its 24 bits (~1e-5), three hold all of them (float32's ~1e-7)
    assert 1e-6 < res["bf16x3_full"]["rel_frobenius"] < 1e-4
    assert 0 < res["bf16_split3"]["rel_frobenius"] < 5 * res["f32_upper"]["rel_frobenius"]
    # the bounded int8 product: float64's accuracy here (ε_n bounds it); the bf16 split over
    # chunks of 256 rows on the H100 model: float32's
    assert res["int8_upper"]["rel_frobenius"] < 1e-13
    assert 0 < res["bf16_pairs_k256"]["rel_frobenius"] < 1e-5


def test_comoment_variants_smoke(results_dir):
    """``--variants`` runs only the named ones (the GPU's block counts among them)."""
    from bench import comoment

    comoment.main("--dims 100 --rows 128 --repeats 1 --device cpu --variants "
                  "f64_upper4,f64_upper8,f32_upper8".split())  # fmt: skip
    res = read(results_dir, "comoment")["dims"]["100"]
    assert set(res) == {"f64_upper4", "f64_upper8", "f32_upper8"}
    assert res["f64_upper8"]["rel_frobenius"] < 1e-13 and res["f32_upper8"]["rel_frobenius"] < 1e-5
    with pytest.raises(SystemExit):
        comoment.main("--variants f64_upper5".split())


def test_fold_smoke(results_dir, tmp_path):
    """The fold against a baseline package given as a folder (as on a machine without .git):
    here this checkout's own package, so both fold to the same state."""
    import shutil

    from bench import fold
    from bench.common import REPO

    shutil.copytree(REPO / "embgeom_ray", tmp_path / "embgeom_ray")
    fold.main(
        f"--device cpu --dims 48 --batch-tokens 1024 --repeats 2 --warmup 1 --scatter "
        f"--baseline {tmp_path / 'embgeom_ray'}".split()
    )
    res = read(results_dir, "fold")
    # the default: this checkout's bounded product against the baseline's float32 (the default
    # before it), and float64 against float64
    assert [(r["dim"], r["comoment_precision"], r["baseline_precision"]) for r in res["folds"]] == [
        (48, "bounded", "float32"),
        (48, "float64", "float64"),
    ]
    bounded, exact = res["folds"]
    for row in res["folds"]:
        assert row["tokens"] == 1024 - 1024 // 128  # one special token a window left out
        assert row["state"]["same"]  # counts and tails
        assert row["ratio"] > 0 and row["us_per_token_layer"]["current"] > 0
        # this checkout's product alone on the same batch, timed beside the fold
        assert set(row["fold_to_product"]) == {"current"}
        product = row["product_us_per_token_layer"]["current"]
        assert row["fold_to_product"]["current"] == row["us_per_token_layer"]["current"] / product
    assert exact["state"]["max_rel_diff"] == 0.0
    assert 0 < bounded["state"]["max_rel_diff"] < 1e-5  # float32's product against float64's
    (scatter,) = res["scatter"]
    assert scatter["rows"] == 1024 and 0 < scatter["types"] <= 1024
    for way in ("index_add", "segment_reduce", "csr_matmul"):
        assert scatter[way]["max_rel_err"] < 1e-12, way


def test_precision_smoke(results_dir):
    """Every table of the bounded path (int8 products, forced on the CPU) against the float64
    path's on the same hidden states with planted massive activations."""
    from bench import precision

    precision.main("--device cpu --dims 40 --batch-tokens 512 --vocab 300".split())
    (res,) = read(results_dir, "precision")["results"]
    assert res["integer_product"] and res["tokens"] == 2 * 512
    assert res["mu2_over_var_max"] > 1e4  # the planted massive dimensions (bf16)
    assert 0 <= res["max_relative_difference"] < 1e-6
    diffs = res["relative_differences"]
    assert set(diffs) == {"type_stats", "layers", "dims", "positions"}
    assert all(not t["unequal_columns"] for t in diffs.values())
    assert diffs["type_stats"]["variance"] < 1e-13  # per-type: float64 either way (rounding)
    assert diffs["layers"]["isoscore"] < 1e-9


def test_gpu_script_smoke(tmp_path):
    """bench/gpu.sh end to end on the CPU at tiny sizes (``SMOKE=1``): its cheaper steps, each
    JSON copied to $OUT."""
    import os
    import subprocess
    import sys

    from bench.common import KEEP_WORK_ENV, REPO, WORK_ENV

    out, work = tmp_path / "out", tmp_path / "work"
    env = {k: v for k, v in os.environ.items() if k != KEEP_WORK_ENV} | {
        "SMOKE": "1", "OUT": str(out), "PYTHON": sys.executable, WORK_ENV: str(work),
        "STEPS": "triton-build host-tier precision comoment fold fold-stacked"}  # fmt: skip
    done = subprocess.run(["bash", "bench/gpu.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=3000)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (out / "log.txt").read_text()
    assert "FAILED" not in log and "skipped" not in log
    for name in ("gpu-triton-build", "gpu-host-tier", "gpu-precision", "gpu-comoment", "gpu-fold",
                 "gpu-fold-stacked"):  # fmt: skip
        assert "command" in json.loads((out / f"{name}.json").read_text()), name
    tier = json.loads((out / "gpu-host-tier.json").read_text())
    assert tier["max_rel_diff"] < 1e-12 and tier["host_merges"] > 0
    assert tier["bytes"]["tier"] < tier["bytes"]["spills"]
    assert (out / "results.tar").stat().st_size > 0
    assert not work.exists() or list(work.iterdir()) == [], "a work folder was left behind"
    # the Triton kernel (its interpreter here): the same product as _int_mm's, to the bit, and
    # the fold with it the same state as the default fold's
    for d, res in json.loads((out / "gpu-comoment.json").read_text())["dims"].items():
        assert res["int8_triton"]["rel_frobenius"] == res["int8_upper"]["rel_frobenius"], d
        assert res["syrk_alone"]["seconds"] > 0 and res["syrk_alone"]["d_pad"] % 32 == 0
    for row in json.loads((out / "gpu-fold.json").read_text())["folds"]:
        assert row["int8-triton_state"]["same"] and row["int8-triton_ratio"] > 0
        assert row["int8-triton_state"]["max_rel_diff"] < 1e-12
        # pass 1 in Triton: on a CPU the entry folds the CPU's way (tests/core/test_segment_sums.py
        # runs the kernel there), so the same state to the bit
        assert row["triton-sums_state"]["max_rel_diff"] == 0.0 and row["triton-sums_ratio"] > 0


def test_fingerprint_smoke(results_dir):
    import os

    from bench import fingerprint

    before = os.environ.get("EMBGEOM_CACHE_DIR")
    fingerprint.main("--gib 0.01 --files 2 --repeats 1".split())
    res = read(results_dir, "fingerprint")
    assert res["content_s"][0] > 0 and res["cached_s"][0] > 0 and res["ratio"] > 0
    assert os.environ.get("EMBGEOM_CACHE_DIR") == before  # the bench's own cache, then put back


def test_overlap_smoke(results_dir):
    """One batch of 256 padded tokens (the job's batches of 8,192: ``bench.overlap``'s default)."""
    from bench import overlap

    overlap.main("--max-batches 1 --batch-tokens 256 --repeats 1".split())
    res = read(results_dir, "overlap")
    assert res["batches"] == 1 and res["tokens"] > 0
    # the overlapped fold folds the same batches in the same order: the same state, exactly
    assert res["state"]["same"] and res["state"]["max_rel_diff"] == 0.0
    assert set(res["ratio_to_bare"]) == {"sequential", "overlapped"}


def test_warm_workers_smoke(results_dir, ray_local, capfd):
    """One cold and one warm job over one document, with no sampled stage and no report (the
    stage on the warm workers: tests/distributed/test_warm_workers.py), so no worker is warmed
    in either: the jobs join the tests' local Ray (``--address``) instead of each starting a
    private one (~5 s of CPU a job)."""
    from bench import warm_workers

    address = ray_local.get_runtime_context().gcs_address
    warm_workers.main(["--docs", "1", "--repeats", "1", "--address", address,
                       "--extra-args", "--sample-size 0 --no-report"])  # fmt: skip
    res = read(results_dir, "warm_workers")
    assert set(res["runs"]) == {"cold", "warm"} and len(res["runs"]["warm"]) == 1
    assert res["median_s"]["warm"]["wall"] > 0 and res["ratio_warm_to_cold"]["wall"] > 0
    assert capfd.readouterr().err.count("ray: joined cluster at") == 2  # the jobs' own lines



def test_checksums_smoke(results_dir):
    from bench import checksums

    checksums.main("--gib 0.01 --repeats 1".split())
    res = read(results_dir, "checksums")
    assert res["times_s"]["digest"][0] > 0 and res["digest_share_of_write"] > 0


def test_host_tier_smoke(results_dir, ray_local, monkeypatch):
    """Two jobs over a small Zipf corpus, with and without a host tier: the tier writes fewer
    bytes, and the exact tables agree to float64 rounding. The jobs' processes join the
    tests' local Ray (``RAY_ADDRESS``, as a user's cluster is named) instead of each starting
    a private one (~5 s a job: what they write does not depend on the cluster)."""
    from bench import host_tier

    monkeypatch.setenv("RAY_ADDRESS", ray_local.get_runtime_context().gcs_address)

    host_tier.main(
        "--vocab 3000 --dim 16 --blocks 1 --tokens 20000 --statistics-types 150 --host-gib 0.01 "
        "--shard-bytes 16384".split()
    )
    res = read(results_dir, "host_tier")
    assert set(res["runs"]) == {"spills", "tier"}
    assert res["runs"]["tier"]["host_merges"] > 0 and res["runs"]["spills"]["spills"] > 0
    assert res["bytes_ratio_tier_to_spills"] < 1 and res["tables_max_rel_diff"] < 1e-9


def test_object_store_peak_smoke(results_dir, ray_local, tmp_path):
    """A command that joins the session's Ray and holds a 48 MiB object for two seconds: the
    peak read from the cluster's plasma usage counts it, and is compared with a plan's."""
    import sys

    from bench import object_store_peak

    address = ray_local.get_runtime_context().gcs_address
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"object_store": {"peak_bytes": 64 << 20}}))
    hold = (f"import time, numpy, ray; ray.init(address={address!r}, logging_level='ERROR'); "
            "ref = ray.put(numpy.ones(6 << 20)); time.sleep(2)")  # fmt: skip
    object_store_peak.main(["--address", address, "--plan-json", str(plan), "--",
                            sys.executable, "-c", hold])  # fmt: skip
    res = read(results_dir, "object_store_peak")
    assert res["exit_status"] == 0 and res["command"][-1] == hold
    assert 48 <= res["peak_mib"] < 64 and res["objects"] >= 1
    assert res["plan_peak_mib"] == 64 and res["measured_share_of_plan"] == round(res["peak_mib"] / 64, 3)
