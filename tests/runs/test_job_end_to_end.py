"""The job's tables against an independent float64 computation (tests/reference.py).

The reference runs every window alone (no padding) straight through transformers and computes
every column two-pass in float64, cosines by brute force over all pairs; the job runs padded,
length-bucketed batches on Ray actors and folds moments. Agreement is to float32 noise.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest

from embgeom_ray.config import build_config
from embgeom_ray.core.statistics import EmbeddingStatistics
from embgeom_ray.integrity import SEAL_KEY
from embgeom_ray.runs import pipeline
from embgeom_ray.runs.pipeline import analyze
from tests.conftest import write_jsonl
from tests.reference import reference_tables
from tests.shared_runs import copy_run
from tests.tiny_models import make_tiny_bert, make_tiny_gpt2, make_tiny_llama, make_tiny_roberta

pytestmark = pytest.mark.slow

COSINE_COLUMNS = {"self_similarity", "anisotropy", "s_inter", "s_intra"}

#: for runs whose sampled metrics are not what a test checks: no half-sample standard errors
#: (tests/core/test_sampled_robust.py) and no K-means stability refits
#: (tests/core/test_kmeans_selection.py); the MiniLM test below runs them with their defaults
LIGHT_SAMPLED = {"sampled_se_replicates": 0, "kmeans_stability_seeds": 0}


def english_documents(n: int, max_chars: int) -> list[str]:
    """Real English prose: the Python Language Reference's text that ships with CPython."""
    from embgeom_ray.inputs.demo_corpus import python_docs_documents

    docs = python_docs_documents()
    return [d[:max_chars] for d in docs[:n]]


def run_job(
    tmp_path, model_dir: str, docs: list[str], name: str, corpus_name: str | None = None, **options
) -> tuple[dict, dict]:
    corpus = write_jsonl(tmp_path / (corpus_name or f"{name}.jsonl"), docs)
    out = tmp_path / name
    # sampling is exercised with a small sample (K-means model selection dominates otherwise);
    # the report only where a test asks for it (its figures take seconds a run)
    options = {"sample_size": 512, "kmeans_k_max": 6, "no_report": True} | options
    cfg = build_config(None, {"model": model_dir, "corpus": corpus, "out": str(out), **options})
    manifest = analyze(cfg, echo=lambda *_: None)
    names = ("type_stats", "layers", "dims", "positions", "samples")
    tables = {t: pd.read_parquet(out / f"{t}.parquet") for t in names}
    return manifest, tables


def assert_tables_close(ours: dict, ref: dict, *, rtol: float, cos_atol: float) -> None:
    # type_stats: same rows, counts exact, floats close
    a = ours["type_stats"].sort_values(["layer", "token_id"]).reset_index(drop=True)
    b = ref["type_stats"].sort_values(["layer", "token_id"]).reset_index(drop=True)
    assert len(a) == len(b)
    np.testing.assert_array_equal(
        a[["layer", "token_id", "count"]], b[["layer", "token_id", "count"]]
    )
    assert (a["token"].astype(str) == b["token"].astype(str)).all()
    for col in ("mean_norm", "sq_norm_mean", "variance"):
        scale = float(np.abs(b[col]).max())
        np.testing.assert_allclose(a[col], b[col], rtol=rtol, atol=rtol * scale, err_msg=col)
    np.testing.assert_allclose(
        a["self_similarity"], b["self_similarity"], rtol=0, atol=cos_atol, err_msg="self_similarity"
    )
    # layers
    la, lb = ours["layers"].set_index("layer"), ref["layers"].set_index("layer")
    assert la.index.tolist() == lb.index.tolist()
    np.testing.assert_array_equal(la["n_tokens"], lb["n_tokens"])
    np.testing.assert_array_equal(la["n_types"], lb["n_types"])
    for col in lb.columns:
        if col in {"n_tokens", "n_types"}:
            continue
        if col in COSINE_COLUMNS:
            np.testing.assert_allclose(la[col], lb[col], rtol=0, atol=cos_atol, err_msg=col)
        elif col == "norm_variance_corr":
            np.testing.assert_allclose(la[col], lb[col], rtol=0, atol=1e-4, err_msg=col)
        else:
            # absolute floor: float64 rounding of quantities that are exactly 0 (e.g. within-type
            # variance of a layer-0 embedding without position embeddings), far below rtol
            floor = 1e-12 * float(np.abs(lb["total_variance"]).max())
            np.testing.assert_allclose(la[col], lb[col], rtol=rtol, atol=floor, err_msg=col)
    # dims
    da = ours["dims"].sort_values(["layer", "dim"]).reset_index(drop=True)
    db = ref["dims"].sort_values(["layer", "dim"]).reset_index(drop=True)
    for col in ("mean", "std"):
        scale = float(np.abs(db[col]).max())
        np.testing.assert_allclose(da[col], db[col], rtol=rtol, atol=rtol * scale, err_msg=col)


def test_minilm_on_real_english_equals_float64_reference(
    tmp_path, minilm_english_run, minilm_dir, monkeypatch
):
    # 16 documents of 500 characters (7 KB of JSON lines): 2 shards of 4 KB, every document
    # longer than one 64-token window; the job is the session's shared run (tests/shared_runs.py:
    # make_minilm_english, run_job's options and the report), made by the first test that asks
    # (tests/report/test_report.py's test_report_of_a_real_run takes it too), and copied here,
    # where it is re-run and re-tabled
    docs = english_documents(16, 500)
    shared = minilm_english_run
    corpus = (shared / "minilm.jsonl").read_text().splitlines()
    assert [json.loads(line)["text"] for line in corpus] == docs
    manifest = json.loads((shared / "returned.json").read_text())  # what analyze returned
    out = copy_run(shared / "minilm", tmp_path / "minilm")
    names = ("type_stats", "layers", "dims", "positions", "samples")
    ours = {t: pd.read_parquet(out / f"{t}.parquet") for t in names}
    # the sampled stage shows its progress by layer, with each layer's K-means result
    bar = (shared / "stderr.txt").read_text().replace("\r", "\n")
    last = {int(m[1]): (int(m[2]), int(m[3])) for m in re.finditer(
        r"layer (\d+): k = (\d+) \(best silhouette at k = (\d+)\)", bar)}  # fmt: skip
    assert re.search(r"sampled metrics: 100%.* 7/7 ", bar), bar
    layers = ours["layers"].set_index("layer")
    assert last and all(
        (layers.at[layer, "kmeans_k"], layers.at[layer, "kmeans_best_k"]) == ks
        for layer, ks in last.items()
    ), (last, layers[["kmeans_k", "kmeans_best_k"]])
    ref = reference_tables(minilm_dir, docs, max_length=64)
    assert manifest["status"] == "complete"
    assert manifest["shards"]["total"] > 1
    assert_tables_close(ours, ref, rtol=1e-5, cos_atol=1e-6)
    # documents longer than max_length were split, nothing dropped
    assert manifest["counts"]["windows"] > len(docs)
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["status"] == "complete" and on_disk["counts"]["tokens"] == int(
        ref["layers"]["n_tokens"].iloc[0]
    )
    # the report is written after the tables and its time recorded with the other stages
    assert on_disk["outputs"]["report"] == "report.html"
    assert on_disk["timings_s"]["report"] > 0
    assert 0 <= on_disk["timings_s"]["ray_start"] < 1.0  # the tests' Ray is already running
    timings = on_disk["timings_s"]  # metrics: the exact tables, then the sampled stage
    assert timings["tables"] > 0 and timings["sampled"] > 0
    assert timings["tables"] + timings["sampled"] == pytest.approx(timings["metrics"], abs=0.01)
    # real positions = counted tokens + [CLS]/[SEP] of every window; padding is what the model
    # ran beyond them, recorded as a ratio
    counts = on_disk["counts"]
    assert counts["positions"] == counts["tokens"] + 2 * counts["windows"]
    assert counts["padding_ratio"] == pytest.approx(counts["padded_tokens"] / counts["positions"])
    # (shards of 4 KB: their last, tiny batches are merged into wider ones; on whole corpora
    # the bound is 1.02, tests/inputs/test_windows.py)
    assert 1.0 <= counts["padding_ratio"] <= 1.10
    assert counts["unk_tokens"] == 0 and counts["unk_share"] == 0.0
    # the checkpoint groups are removed once the run is complete; a rerun of the same command
    # finds the complete run and does nothing (here in the copy: --out is not a result option)
    assert not (out / "groups").exists() and (out / "statistics.safetensors").exists()
    # ... before the report lists the run's files: its list is the directory as it stays
    # (it listed groups/, removed just after it was written)
    files = (out / "report.html").read_text().split('id="sec-files"')[1]
    assert "statistics.safetensors" in files and "samples.parquet" in files
    assert "groups/" not in files, files
    # the statistics say which product they hold: the job's default, bounded (its reduce once
    # started from a float64 accumulator and said float64; float64's own: the test below)
    saved = EmbeddingStatistics.load(out / "statistics.safetensors")
    assert saved.header()["comoment_precision"] == "bounded"
    said: list[str] = []
    again = analyze(build_config(None, on_disk["config"] | {"out": str(out)}), echo=said.append)
    # (NaN-safe; the file carries its own digest beside the manifest)
    assert json.dumps(again) == json.dumps({k: v for k, v in on_disk.items() if k != SEAL_KEY})
    assert "already holds this complete run" in said[0]
    # a rerun with another table option rebuilds the tables from the run's own artefacts
    # (no extraction): norm_variance_corr over types with at least 2 occurrences (its report
    # and sampled extras left out: the run above drew them)
    said.clear()
    artefact = out / "statistics.safetensors"
    before = (artefact.stat().st_ino, artefact.stat().st_mtime_ns, artefact.read_bytes())
    retable = on_disk["config"] | {"out": str(out), "min_count": 2, "no_report": True}
    retable |= LIGHT_SAMPLED
    again = analyze(build_config(None, retable), echo=said.append)
    assert "rebuilt" in said[0] and "min_count" in said[0]
    assert again["config"]["min_count"] == 2 and again["counts"] == on_disk["counts"]
    # the re-tabulation kept the artefact it read as it was (not written again) and records
    # the same digest for it
    assert (artefact.stat().st_ino, artefact.stat().st_mtime_ns, artefact.read_bytes()) == before
    digest = on_disk["outputs"]["digests"]["statistics.safetensors"]
    assert again["outputs"]["digests"]["statistics.safetensors"] == digest
    types = pd.read_parquet(out / "type_stats.parquet")
    layers = pd.read_parquet(out / "layers.parquet").set_index("layer")
    for layer, rows in types.loc[types["count"] >= 2].groupby("layer"):
        r = np.corrcoef(rows["mean_norm"], rows["variance"])[0, 1]
        assert layers.at[layer, "norm_variance_corr"] == pytest.approx(r, abs=1e-9)
    assert_retable_resumes(out, retable | {"min_count": 3}, digest, monkeypatch)


def assert_retable_resumes(out, options: dict, digest: dict, monkeypatch) -> None:
    """A re-tabulation of the complete run at ``out`` stopped in its sampled stage leaves it
    ``running``; the same command again re-tabulates it from its statistics artefact (checked
    against ``digest``), never extracts it again, and a corrupt artefact is not re-tabulated."""
    from embgeom_ray.run_dir import RunDir
    from embgeom_ray.runs import finish

    def stopped(*_args, **_kwargs):
        raise KeyboardInterrupt  # as a SIGTERM in the sampled stage

    with monkeypatch.context() as patch:
        patch.setattr(finish, "add_sampled_metrics", stopped)
        with pytest.raises(KeyboardInterrupt):
            analyze(build_config(None, options), echo=lambda _line: None)
    running = json.loads((out / "manifest.json").read_text())
    assert running["status"] == "running" and not (out / "groups").exists()
    assert running["outputs"]["artefacts"] == ["statistics.safetensors"]
    assert running["outputs"]["digests"]["statistics.safetensors"] == digest
    # a flipped byte in the artefact: not this run's statistics, so not re-tabulated from them
    run = RunDir(str(out))
    artefact = out / "statistics.safetensors"
    data = artefact.read_bytes()
    assert pipeline.already_complete(run, running["fingerprint"]) is not None
    artefact.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert pipeline.already_complete(run, running["fingerprint"]) is None
    artefact.write_bytes(data)
    # nor is one whose samples.parquet is not the one recorded (the new one moved into place
    # just before the stop): the re-tabulation could not read it
    samples = out / "samples.parquet"
    table = samples.read_bytes()
    samples.write_bytes(table[:-9] + bytes([table[-9] ^ 1]) + table[-8:])
    assert pipeline.already_complete(run, running["fingerprint"]) is None
    samples.write_bytes(table)
    assert pipeline.already_complete(run, running["fingerprint"]) is not None
    said: list[str] = []
    again = analyze(build_config(None, options), echo=said.append)
    assert "stopped while its tables were rebuilt" in said[0], said
    assert not any("shards already done" in line for line in said), said
    assert again["status"] == "complete" and again["config"]["min_count"] == 3
    assert "extract_wall" not in again["timings_s"] and again["timings_s"]["sampled"] > 0
    assert again["outputs"]["digests"]["statistics.safetensors"] == digest
    assert artefact.read_bytes() == data
    # the tables are the new options': norm_variance_corr over types seen at least 3 times
    types = pd.read_parquet(out / "type_stats.parquet")
    layers = pd.read_parquet(out / "layers.parquet").set_index("layer")
    for layer, rows in types.loc[types["count"] >= 3].groupby("layer"):
        r = np.corrcoef(rows["mean_norm"], rows["variance"])[0, 1]
        assert layers.at[layer, "norm_variance_corr"] == pytest.approx(r, abs=1e-9)


@pytest.mark.parametrize(
    "builder", [make_tiny_bert, make_tiny_gpt2, make_tiny_llama, make_tiny_roberta]
)
def test_tiny_random_models_with_long_documents(tmp_path, ray_local, builder):
    from transformers import AutoTokenizer

    model_dir = builder(str(tmp_path / "model"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    # ASCII prose (tiny Llama's tokenizer maps non-ASCII to <unk>, a special token)
    # 6 documents of up to 900 characters (5 KB): 3 shards of 2 KB, each document several
    # 32-token windows
    docs = [d.encode("ascii", "ignore").decode() for d in english_documents(6, 900)]
    docs = [d for d in docs if d.strip()]
    manifest, ours = run_job(
        tmp_path, model_dir, docs, "run", max_length=32, shard_bytes=2048, batch_tokens=256,
        **LIGHT_SAMPLED,
    )  # fmt: skip
    expected_tokens = sum(len(tok(d, add_special_tokens=False)["input_ids"]) for d in docs)
    assert manifest["counts"]["tokens"] == expected_tokens
    assert manifest["counts"]["windows"] > len(docs)
    ref = reference_tables(model_dir, docs, max_length=32)
    assert_tables_close(ours, ref, rtol=1e-5, cos_atol=1e-6)
    # no --checkpoint-interval: sized, from what the run's own flushes measured
    pace = manifest["sizing"]["checkpoints"]
    assert pace["given_s"] is None and pace["flushes"] == manifest["shards"]["checkpoint_groups"]
    assert pace["bytes_written"] > 0 and pace["bandwidth_bytes_per_s"] > 0
    assert 60 <= pace["interval_s"] <= 3600 and 0 < pace["write_share"] < 1


def test_one_and_two_workers_agree(tmp_path, ray_local, minilm_dir, monkeypatch):
    docs = english_documents(16, 400)  # 6 KB: 3 shards of 2 KB for the two workers
    # the exact co-moment product: one and two workers agree to 1e-9 (the float32 default's
    # product depends on the batch order through its shift: ~1e-8). One torch thread in each
    # extractor: a shard gets the same batches whatever the worker, but the forward's float32
    # rounding may follow the thread count (on an AVX-512 CPU, 1 thread against 2 moved MiniLM's
    # layer 6 by up to 1.2e-6 relative, on half of the types)
    opts = {"max_length": 48, "shard_bytes": 2048, "layers": [0, 3, 6], "cpus_per_worker": 1}
    opts["comoment_precision"] = "float64"
    opts |= LIGHT_SAMPLED  # the sampled columns checked below are filled without them
    m1, t1 = run_job(tmp_path, minilm_dir, docs, "w1", "c.jsonl", num_workers=1, **opts)
    # the warm-up of task workers (embgeom_ray.distributed.warm_workers) is decided once, when
    # the first pool of two extractors has been asked for; on the tests' Ray (not private)
    # nothing is warmed
    calls: list[int] = []
    real = pipeline.warm_workers_wanted

    def wanted(config, layers):
        calls.append(real(config, layers))
        return calls[-1]

    monkeypatch.setattr(pipeline, "warm_workers_wanted", wanted)
    m2, t2 = run_job(tmp_path, minilm_dir, docs, "w2", "c.jsonl", num_workers=2, **opts)
    assert m2["shards"]["total"] > 2 and calls == [0]
    assert m1["workers"]["num_workers"] == 1 and m2["workers"]["num_workers"] == 2
    for name in ("w1", "w2"):  # the statistics say which product they hold
        saved = EmbeddingStatistics.load(tmp_path / name / "statistics.safetensors")
        assert saved.header()["comoment_precision"] == "float64"
    # MiniLM's CPU default (6 KiB a token of d_ff within 32 MiB), as each extractor chose it
    assert m2["workers"]["batch_tokens"] == 5120
    for name in ("type_stats", "layers", "dims", "positions"):
        a, b = t1[name], t2[name]
        pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-9, atol=0)
    # the sample is the same occurrences whatever the number of workers
    s1, s2 = t1["samples"], t2["samples"]
    pd.testing.assert_frame_equal(
        s1.drop(columns=["vector", "cluster"]), s2.drop(columns=["vector", "cluster"])
    )
    np.testing.assert_allclose(np.stack(s1["vector"]), np.stack(s2["vector"]), rtol=1e-5, atol=1e-5)
    # every sampled metric is filled and finite
    sampled = [
        "kmeans_k",
        "kmeans_silhouette",
        "adjusted_s_inter",
        "adjusted_s_intra",
        "adjusted_isoscore",
        "s_inter_type_uniform",
        "isoscore_sample",
        "lid_euclidean",
        "lid_cosine",
        "silhouette_types",
        "partition_isotropy",
        "partition_isotropy_centered",
        "anisotropy_clipped",
    ]
    assert np.isfinite(t1["layers"][sampled].to_numpy(dtype=float)).all()
    assert t1["layers"]["layer"].tolist() == [0, 3, 6]


def test_a_corrupt_checkpoint_group_is_redone(tmp_path, ray_local, monkeypatch):
    """One flipped byte deep in a checkpoint group's statistics, found by the reducer that
    reads that part of it (digests of 4 KiB blocks here, so that no other read touches it):
    the group is discarded and its shards redone, in one line; nothing of it is merged, and
    the tables equal the reference."""
    from embgeom_ray import integrity
    from embgeom_ray.runs.checkpoints import CheckpointStore

    monkeypatch.setattr(integrity, "MIN_BLOCK", 4096)  # the groups' digests, made here
    model_dir = make_tiny_bert(str(tmp_path / "model"))
    docs = [d.encode("ascii", "ignore").decode() for d in english_documents(6, 900)]
    docs = [d for d in docs if d.strip()]
    commit_group, flipped = CheckpointStore.commit_group, []

    def corrupting(store, files, counts):  # whoever wrote the files, the driver commits them
        group = commit_group(store, files, counts)
        if not flipped:
            path = tmp_path / "run" / "groups" / group.file_names()[0]
            data = bytearray(path.read_bytes())
            data[len(data) * 2 // 3] ^= 0x04
            path.write_bytes(bytes(data))
            flipped.append(group.group_id)
        return group

    monkeypatch.setattr(CheckpointStore, "commit_group", corrupting)
    said: list[str] = []
    corpus = write_jsonl(tmp_path / "c.jsonl", docs)
    options = {"sample_size": 0, "no_report": True, "max_length": 32, "shard_bytes": 2048}
    options |= {"batch_tokens": 256, "checkpoint_interval": 0, "reducers": 2}  # a group a shard
    config = build_config(None, {"model": model_dir, "corpus": corpus, "out": str(tmp_path / "run"), **options})
    manifest = analyze(config, echo=said.append)
    (line,) = [line for line in said if "is corrupt" in line]
    assert line.startswith(f"checkpoint group {flipped[0]} is corrupt ({flipped[0]}.safetensors: bytes ")
    assert line.endswith("its 1 shard(s) are redone")
    assert manifest["status"] == "complete" and manifest["reducers"]["count"] == 2
    assert manifest["shards"]["checkpoint_groups"] == manifest["shards"]["total"] == 3
    names = ("type_stats", "layers", "dims", "positions")
    ours = {t: pd.read_parquet(tmp_path / "run" / f"{t}.parquet") for t in names}
    assert_tables_close(ours, reference_tables(model_dir, docs, max_length=32), rtol=1e-5, cos_atol=1e-6)


def test_a_run_stopped_while_its_report_is_drawn_gets_it_on_the_rerun(
    tmp_path, ray_local, monkeypatch
):
    """SIGTERM or Ctrl-C once the manifest is written complete, while the report is drawn
    (its last seconds): the run is complete without plots/ and report.html. The same command
    again said "already holds this complete run; nothing to do" and exited 0 without the
    report; now it draws the report, and only that."""
    from embgeom_ray.report import html

    model_dir = make_tiny_bert(str(tmp_path / "model"))
    corpus = write_jsonl(tmp_path / "c.jsonl", ["the cat sat on the mat", "a dog ran off"] * 8)
    options = {"model": model_dir, "corpus": corpus, "out": str(tmp_path / "run")}
    options |= {"sample_size": 0, "max_length": 16}
    config = build_config(None, options)
    draw = html.write_report

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt  # the signal, where it lands: as the drawing starts

    monkeypatch.setattr(html, "write_report", stopped)
    with pytest.raises(KeyboardInterrupt):
        analyze(config, echo=lambda *_: None)
    out = tmp_path / "run"
    stopped_run = json.loads((out / "manifest.json").read_text())
    assert stopped_run["status"] == "complete" and stopped_run["outputs"].get("report") is None
    assert not (out / "report.html").exists()
    tables = (out / "layers.parquet").read_bytes()

    monkeypatch.setattr(html, "write_report", draw)
    said: list[str] = []
    again = analyze(config, echo=said.append)
    assert said[0] == f"{out} holds this complete run without its report (the run was stopped while it was drawn): drawing it"
    assert said[-1] == f"report: {out / 'report.html'}"
    assert again["outputs"]["report"] == "report.html" and (out / "report.html").stat().st_size > 0
    assert (out / "layers.parquet").read_bytes() == tables  # the tables left as they were
    said.clear()
    analyze(config, echo=said.append)  # and then nothing is left to do
    assert said == [f"{out} already holds this complete run; nothing to do (--overwrite redoes it)"]
