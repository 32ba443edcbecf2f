"""``jobs.reanalyze``: each model of a watch list is analysed once per exact revision.

The end-to-end test (slow) runs the real job in-process on a local Ray, on a watch list of two
tiny local BERTs and one hub id: run twice, each local model is analysed exactly once and the
hub id, unresolvable offline, is reported without stopping the others; after one model's
weights change, exactly one new run. Then jobs.compare finds the planted rogue dimension.

The fast tests replace ``pipeline.analyze`` by a stand-in that writes a complete run (manifest
with the real model, tokenizer and corpus fingerprints, and layers.parquet) in milliseconds,
to check failures and retries, dry runs, rebuilding the index, moved model directories, and
``--submit`` against a stand-in Ray job server (stable submission ids, duplicates recognised,
retries after a failed job).
"""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from embgeom_ray.config import JobConfig, build_config
from embgeom_ray.errors import ConfigError, CorpusError, ModelError
from embgeom_ray.inputs.corpus import CorpusSpec, plan_shards
from embgeom_ray.inputs.model_loading import resolve_identity
from embgeom_ray.runs import pipeline, reanalyze
from embgeom_ray.runs.reanalyze import (
    INDEX_COLUMNS,
    analyze_argv,
    load_watchlist,
    read_index,
    resolve_hub_revision,
    submission_id,
)
from jobs import analyze as analyze_cli
from jobs import reanalyze as reanalyze_cli
from tests.conftest import SHORT_DOCS, write_jsonl
from tests.tiny_models import make_tiny_bert, plant_outlier_dimension

REPO = Path(__file__).resolve().parents[2]
HUB_ID = "hf-internal-testing/tiny-random-bert"  # resolving "latest" needs the network
DOCS = SHORT_DOCS
OPTIONS = {"max_length": 32, "sample_size": 256, "kmeans_k_max": 4, "num_workers": 1,
           "no_report": True}  # fmt: skip


def _watchlist(path: Path, models: list[Any]) -> str:
    path.write_text(yaml.safe_dump({"models": models}))
    return str(path)


def _job_config(path: Path, options: dict[str, Any] = OPTIONS) -> str:
    path.write_text(yaml.safe_dump(options))
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {
        "a": make_tiny_bert(root / "tiny-a", seed=0),
        "b": make_tiny_bert(root / "tiny-b", seed=1),
    }


@pytest.fixture
def corpus(tmp_path) -> str:
    return write_jsonl(tmp_path / "corpus.jsonl", DOCS)


# ------------------------------------------------------------------------------------------
# a stand-in for pipeline.analyze: a complete run, without Ray


class FakeAnalyze:
    """Writes what a complete run of ``config`` would: the manifest and layers.parquet."""

    def __init__(self, fail: set[str] | None = None):
        self.calls: list[str] = []
        self.fail = set(fail or ())

    def __call__(self, config: JobConfig, *, echo=print) -> dict[str, Any]:
        self.calls.append(config.model)
        if config.model in self.fail:
            self.fail.discard(config.model)  # fails once
            raise CorpusError("the corpus went away (simulated)")
        return write_complete_run(config)


def write_complete_run(config: JobConfig) -> dict[str, Any]:
    identity, _ = resolve_identity(config.model, config.revision, False)
    spec = CorpusSpec(config.corpus, config.text_column, config.split)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    layers = pd.DataFrame(
        {
            "layer": [0, 1, 2],
            "n_tokens": [50, 50, 50],
            "anisotropy": [0.5, 0.25, 0.125],
            "isoscore": [0.25, 0.5, 0.75],
            "within_ratio": [0.25, 0.5, 0.75],
            "s_intra": [0.75, 0.5, 0.5],
        }
    )
    layers.to_parquet(out / "layers.parquet")
    manifest = {
        "status": "complete",
        "started_at": "2026-01-01T00:00:00+00:00",
        "finished_at": "2026-01-01T00:00:01+00:00",
        "fingerprint": "f" * 64,
        "config": config.model_dump(),
        "model": {
            "id": config.model,
            "revision": identity.revision,
            "model_fingerprint": identity.model_fingerprint,
            "num_layers": 2,
            "hidden_size": 32,
        },
        "tokenizer": {"fingerprint": identity.tokenizer_fingerprint},
        "corpus": {"source": config.corpus, "fingerprint": plan_shards(spec).fingerprint},
        "counts": {"tokens": 50},
        "timings_s": {"total": 1.0},
    }
    (out / "manifest.json").write_text(json.dumps(manifest))
    return manifest


@pytest.fixture
def fake_analyze(monkeypatch) -> FakeAnalyze:
    fake = FakeAnalyze()
    monkeypatch.setattr(pipeline, "analyze", fake)
    return fake


def _run(watchlist: str, corpus: str, store: Path, **kwargs) -> reanalyze.ReanalyzeResult:
    kwargs.setdefault("echo", lambda s: None)
    kwargs.setdefault("warn", lambda s: None)
    return reanalyze.reanalyze(watchlist, str(store), corpus=corpus, **kwargs)


# ------------------------------------------------------------------------------------------
# fast tests


def test_watch_list_format(tmp_path) -> None:
    entries = load_watchlist(str(REPO / "deploy" / "models.yaml"))
    assert [e.revision for e in entries] == ["latest"] * 3
    assert entries[2].options == {"max_length": 256}

    bad = {
        "models: []": "non-empty list 'models:'",
        "models: [{model: m, branch: x}]": "unknown keys ['branch']",
        "models: [{model: m, options: {out: /x}}]": "cannot be set per model",
        "models: [{revision: main}]": "'model' must be a hub id or a directory",
        "models: [": "is not valid YAML",
    }
    for text, message in bad.items():
        (tmp_path / "w.yaml").write_text(text)
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
            load_watchlist(str(tmp_path / "w.yaml"))


def test_a_relative_model_directory_is_found_beside_the_watch_list(tmp_path, monkeypatch) -> None:
    """Cron runs the command in the user's home: a relative model directory of the watch list
    that is not one there is the one beside the watch list (absolute); one in the working
    directory is that one; a hub id, and a directory found nowhere, stay as written."""
    lists, home = tmp_path / "lists", tmp_path / "home"
    (lists / "models" / "tiny").mkdir(parents=True)
    (home / "here").mkdir(parents=True)
    (lists / "here").mkdir()
    (lists / "w.yaml").write_text(
        "models: [models/tiny, ./models/tiny, here, models/typo, sentence-transformers/x]\n"
    )
    monkeypatch.chdir(home)
    got = [e.model for e in load_watchlist(str(lists / "w.yaml"))]
    tiny = str(lists / "models" / "tiny")
    assert got == [tiny, tiny, "here", "models/typo", "sentence-transformers/x"]
    from embgeom_ray.runs.reanalyze import WatchEntry, plan_entry

    with pytest.raises(ModelError, match=f"working directory, {home}, then beside the watch list"):
        plan_entry(WatchEntry("./models/typo"), {}, "c.jsonl", str(tmp_path / "s"), None)


def test_hub_revision_offline_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelError, match="offline mode is on") as info:
        resolve_hub_revision(HUB_ID, "latest")
    assert HUB_ID in str(info.value) and "\n" not in str(info.value)
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert resolve_hub_revision(HUB_ID, commit) == commit  # exact already: no network


def test_analyze_argv_round_trips_through_jobs_analyze() -> None:
    config = build_config(
        None,
        {
            "model": "/models/x y",
            "revision": "abc",
            "corpus": "s3://b/c/",
            "out": "/store/runs/x-1",
            "layers": [-1, 0, 3],
            "clip_dims": [5, 7],
            "keep_special": True,
            "outlier_mean_z": 2.5,
            "sample_size": 256,
            "num_workers": 3,
        },
    )
    argv = shlex.split(shlex.join(analyze_argv(config)))
    assert argv[:4] == ["python", "-m", "embgeom_ray", "analyze"]
    args = analyze_cli.build_parser().parse_args(argv[4:])
    overrides = {k: v for k, v in vars(args).items() if k not in {"config", "verbose"}}
    assert build_config(None, overrides) == config


def test_idempotent_failures_retried_index_rebuilt(models, corpus, tmp_path, fake_analyze) -> None:
    store = tmp_path / "store"
    watch = _watchlist(tmp_path / "models.yaml", [{"model": models["a"]}, {"model": models["b"]}])
    fake_analyze.fail = {models["b"]}

    # dry run: says what would run, writes nothing
    result = _run(watch, corpus, store, dry_run=True)
    assert [o.status for o in result.outcomes] == ["would run", "would run"]
    assert not store.exists() and fake_analyze.calls == []

    # first run: a analysed, b fails (recorded, exit status non-zero)
    result = _run(watch, corpus, store)
    assert [o.status for o in result.outcomes] == ["analysed", "failed"]
    assert "went away" in result.outcomes[1].message
    index = read_index(str(store)).set_index("model")
    assert list(read_index(str(store)).columns) == list(INDEX_COLUMNS)
    assert index.loc[models["a"], "status"] == "complete"
    assert index.loc[models["b"], "status"] == "failed"
    assert "went away" in index.loc[models["b"], "error"]
    assert index.loc[models["a"], "anisotropy_last"] == 0.125
    assert index.loc[models["a"], "within_ratio_mean"] == 0.5
    assert index.loc[models["a"], "n_tokens"] == 50
    assert index.loc[models["a"], "revision"].startswith("sha256:")

    # second run: only the failed one is retried
    result = _run(watch, corpus, store)
    assert [o.status for o in result.outcomes] == ["up to date", "analysed"]
    assert fake_analyze.calls == [models["a"], models["b"], models["b"]]
    index = read_index(str(store)).set_index("model")
    assert index.loc[models["b"], "status"] == "complete"
    assert index.loc[models["b"], "attempts"] == 2
    for key, out in zip(index["key"], index["out"], strict=True):
        assert Path(out).parent == store / "runs" and out.endswith(key[:12])

    # third run: nothing to do
    lines: list[str] = []
    result = _run(watch, corpus, store, echo=lines.append)
    assert result.ok and len(fake_analyze.calls) == 3
    assert lines[-1].startswith("up to date: all 2 models have a complete run")

    # the index is rebuilt from the run directories without running anything
    before = read_index(str(store)).drop(columns=["attempts"]).sort_values("key")
    (store / "runs.parquet").unlink()
    assert _run(watch, corpus, store).ok and len(fake_analyze.calls) == 3
    after = read_index(str(store)).drop(columns=["attempts"]).sort_values("key")
    pd.testing.assert_frame_equal(before.reset_index(drop=True), after.reset_index(drop=True))


def test_a_corrupt_run_or_index_is_refused_in_one_line(models, corpus, tmp_path, fake_analyze, capsys) -> None:
    """What re-analysis reads back is checked: a complete run's manifest (its own digest) and
    tables (the manifest's), and ``runs.parquet`` (the digest of its rows in its metadata).
    One flipped bit (a digit that still parses) ends the invocation in one line, exit
    status 2; nothing is run."""
    from embgeom_ray.run_dir import RunDir

    store = tmp_path / "store"
    watch = _watchlist(tmp_path / "models.yaml", [{"model": models["a"]}])
    argv = ["--watchlist", watch, "--corpus", corpus, "--store", str(store)]
    assert reanalyze_cli.main(argv) == 0
    out = Path(read_index(str(store))["out"].iloc[0])
    run = RunDir(str(out))
    run.write_manifest(run.manifest())  # with its digest, as the job writes it
    assert reanalyze_cli.main(argv) == 0 and len(fake_analyze.calls) == 1  # up to date

    def flip_digit(path: Path, text: bytes) -> None:
        data = bytearray(path.read_bytes())
        at = data.index(text) + len(text) - 1
        data[at] ^= 1  # "50" -> "51": still a number
        path.write_bytes(bytes(data))

    manifest = out / "manifest.json"
    good = manifest.read_bytes()
    flip_digit(manifest, b'"tokens": 50')
    capsys.readouterr()
    assert reanalyze_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "manifest.json is corrupt" in err[0], err
    manifest.write_bytes(good)

    # the index: a digit of a row changed under the metadata it was written with
    index = store / "runs.parquet"
    frame = read_index(str(store))
    frame.loc[0, "n_tokens"] = 51
    table = pa.Table.from_pandas(frame, preserve_index=False)
    pq.write_table(table.replace_schema_metadata(pq.read_schema(index).metadata), index)
    assert reanalyze_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "runs.parquet is corrupt" in err[0] and "move it away" in err[0], err
    assert len(fake_analyze.calls) == 1


def test_one_invocation_at_a_time_per_store(models, corpus, tmp_path, fake_analyze, capsys) -> None:
    """Cron overlap: while another process holds the store, an invocation runs nothing, writes
    nothing and ends at once with one line naming the holder, exit status 75; the holder
    killed (SIGKILL), the lock is gone with it and the next invocation does everything."""
    import os
    import signal
    import subprocess
    import sys

    from embgeom_ray.runs.lock_holder import BUSY_EXIT

    store = tmp_path / "store"
    watch = _watchlist(tmp_path / "models.yaml", [{"model": models["a"]}, {"model": models["b"]}])
    argv = ["--watchlist", watch, "--corpus", corpus, "--store", str(store)]
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from embgeom_ray.runs.store_lock import store_lock\n"
         "with store_lock(sys.argv[1]):\n    print('locked', flush=True); time.sleep(600)",
         str(store)],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        t0 = time.perf_counter()
        assert reanalyze_cli.main(argv) == BUSY_EXIT == 75
        assert time.perf_counter() - t0 < 10  # at once, not after planning the models
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert f"another reanalyze is running on the store {store} (pid {holder.pid} " in err[0]
        assert "ran nothing" in err[0]
        assert fake_analyze.calls == [] and not (store / "runs.parquet").exists()
        assert not (store / "runs").exists()
        # a dry run writes nothing and is not held up
        assert reanalyze_cli.main([*argv, "--dry-run"]) == 0 and fake_analyze.calls == []
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    assert reanalyze_cli.main(argv) == 0
    assert sorted(fake_analyze.calls) == sorted([models["a"], models["b"]])
    assert set(read_index(str(store))["status"]) == {"complete"}


def test_the_holder_of_the_store_is_named_while_it_holds_it(tmp_path) -> None:
    """``STORE/reanalyze.lock.json`` names the invocation holding the store, and goes when it
    lets go (left behind, it named a finished invocation as the store's holder)."""
    import json
    import os

    from embgeom_ray.runs.lock_holder import HOLDER, StoreBusyError
    from embgeom_ray.runs.store_lock import store_lock

    store = tmp_path / "store"
    with store_lock(str(store)):
        assert json.loads((store / HOLDER).read_text())["pid"] == os.getpid()
        with pytest.raises(StoreBusyError, match=rf"\(pid {os.getpid()} on "):
            with store_lock(str(store)):
                pass
    assert not (store / HOLDER).exists()
    with pytest.raises(RuntimeError):
        with store_lock(str(store)):
            raise RuntimeError("the invocation failed")
    assert not (store / HOLDER).exists()
    with store_lock(str(store)):  # released on every path
        pass


def _sigterm_in_ray_wait(then: BaseException) -> None:
    """SIGTERM while the driver waits in ``ray.wait``: the handler's ``SystemExit(15)``,
    which Ray 2.60's wait takes and raises ``then`` instead (``SystemExit(1)``; or an error
    of a cleanup the exit interrupted, raised in its place)."""
    assert callable(signal.getsignal(signal.SIGTERM)), "no handler: SIGTERM would end pytest"
    try:
        signal.raise_signal(signal.SIGTERM)
    except SystemExit:
        raise then from None


@pytest.mark.parametrize(("interrupt", "status", "why"), [
    (SystemExit(15), 143, "SIGTERM"), (KeyboardInterrupt(), 130, "Ctrl-C"),
    ("ray.wait", 143, "SIGTERM"), ("cleanup", 143, "SIGTERM"),
])  # fmt: skip
def test_an_interrupted_run_is_not_left_running_in_the_index(
    models, corpus, tmp_path, monkeypatch, capsys, interrupt, status, why
) -> None:
    """SIGTERM (Ray's handler raises SystemExit(15); within ``ray.wait`` Ray raises
    SystemExit(1) instead, or a cleanup's error may take its place) or Ctrl-C in the middle
    of a run: the command ends with 143 or 130, not going on to the next model, and the index
    says the run was interrupted (it said ``running``, for a run nobody ran, until the next
    invocation); the next one redoes it."""
    store = tmp_path / "store"
    third = make_tiny_bert(tmp_path / "tiny-c", seed=2)
    entries = [{"model": models["a"]}, {"model": models["b"]}, {"model": third}]
    watch = _watchlist(tmp_path / "models.yaml", entries)
    argv = ["--watchlist", watch, "--corpus", corpus, "--store", str(store)]
    calls: list[str] = []

    def interrupted(config, *, echo=print):
        calls.append(config.model)
        if config.model != models["b"]:
            return write_complete_run(config)
        if interrupt == "ray.wait":
            _sigterm_in_ray_wait(SystemExit(1))
        if interrupt == "cleanup":
            _sigterm_in_ray_wait(RuntimeError("a reducer was lost"))
        raise interrupt

    monkeypatch.setattr(pipeline, "analyze", interrupted)
    assert reanalyze_cli.main(argv) == status
    assert calls == [models["a"], models["b"]]  # not on to the third
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "terminated (SIGTERM)" if status == 143 else "interrupted:"
    )
    index = read_index(str(store)).set_index("model")
    assert index.loc[models["a"], "status"] == "complete"
    assert index.loc[models["b"], "status"] == "failed"
    assert index.loc[models["b"], "error"] == f"interrupted ({why}); the next invocation resumes it"
    assert index.loc[models["b"], "attempts"] == 1 and third not in index.index

    monkeypatch.setattr(pipeline, "analyze", FakeAnalyze())
    assert reanalyze_cli.main(argv) == 0
    index = read_index(str(store)).set_index("model")
    assert set(index["status"]) == {"complete"} and index.loc[models["b"], "attempts"] == 2


def test_the_store_lists_its_runs_and_the_latest_ones_compare(
    models, corpus, tmp_path, fake_analyze, capsys
) -> None:
    """``--list`` and ``eg.store_runs``: every run of the store, each model's latest complete
    one marked, failed runs with their error, and the command comparing the latest runs."""
    import embgeom_ray as eg

    store = tmp_path / "store"
    a, b = models["a"], models["b"]
    first = _watchlist(tmp_path / "first.yaml", [{"model": a}, {"model": b}])
    assert _run(first, corpus, store).ok
    # the next night: b with another result option (a new run; the old one stays)
    fake_analyze.fail = {b}
    changed = _watchlist(tmp_path / "changed.yaml",
                         [{"model": a}, {"model": b, "options": {"max_length": 16}}])  # fmt: skip
    assert not _run(changed, corpus, store).ok
    assert _run(changed, corpus, store).ok
    index = read_index(str(store))
    new_b = index[(index["model"] == b) & (index["options"].str.contains('"max_length": 16'))]
    old_b = index[(index["model"] == b) & ~index["key"].isin(new_b["key"])]
    a_out, old_b_out, new_b_out = (index.loc[index["model"] == a, "out"].item(),
                                   old_b["out"].item(), new_b["out"].item())  # fmt: skip

    runs = eg.store_runs(store)
    assert len(runs) == 3 and list(runs["model"]) == [a, b, b]
    assert runs.set_index("out")["latest"].to_dict() == {
        a_out: True, old_b_out: False, new_b_out: True}  # fmt: skip
    latest = eg.store_runs(str(store), latest=True)
    assert list(latest["out"]) == [a_out, new_b_out]
    assert latest["n_tokens"].tolist() == [50, 50]

    capsys.readouterr()
    assert reanalyze_cli.main(["--store", str(store), "--list"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [line.split() for line in lines[1:4]]
    assert [r[0] == "*" for r in rows] == [True, False, True]
    assert [r[-1] for r in rows] == [a_out, old_b_out, new_b_out]
    assert lines[-1] == f"compare the latest runs: embgeom compare {a_out} {new_b_out} --out CMP_DIR"

    # a store that does not exist, or holds no index: one line, status 2, nothing created;
    # no --watchlist without --list: status 2
    assert reanalyze_cli.main(["--store", str(tmp_path / "typo"), "--list"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: the store {tmp_path / 'typo'} does not exist: a mistyped --store, "
                   "or reanalyze has not run there yet"]  # fmt: skip
    assert not (tmp_path / "typo").exists()
    assert reanalyze_cli.main(["--store", str(tmp_path), "--list"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {tmp_path} holds no runs.parquet: not a reanalyze store, "
                   "or nothing has run there yet"]  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        reanalyze_cli.main(["--store", str(store)])
    assert exc.value.code == 2
    assert "--watchlist (except with --list)" in capsys.readouterr().err


def test_listing_an_unreachable_store_speaks_of_the_store(monkeypatch, capsys) -> None:
    """``--list`` on an object store that does not answer: one line naming the store (it said
    "output directory", checking it as a run's output), status 2."""
    import s3fs

    from tests.ray_processes import free_ports

    (port,) = free_ports(1)  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{port}")
    # a filesystem cached by an earlier test of this process has its endpoint, not this one
    s3fs.S3FileSystem.clear_instance_cache()
    assert reanalyze_cli.main(["--store", "s3://bucket/store", "--list"]) == 2
    s3fs.S3FileSystem.clear_instance_cache()
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith(
        f"error: cannot reach the object store at http://127.0.0.1:{port} for the store "
        "s3://bucket/store: connection refused"
    )


def test_a_run_stopped_while_its_report_was_drawn_is_not_up_to_date(
    models, corpus, tmp_path, fake_analyze
) -> None:
    """A complete run whose report was never written (stopped while it was drawn: its
    manifest records outputs without a report, and no report error) is analysed again, which
    draws the report; it was counted up to date, so it never got one. With its report, or
    with a report that failed, it is up to date."""
    store = tmp_path / "store"
    watch = _watchlist(tmp_path / "models.yaml", [{"model": models["a"]}])
    assert _run(watch, corpus, store).ok and len(fake_analyze.calls) == 1
    (out,) = (store / "runs").iterdir()
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps(manifest | {"outputs": {"tables": ["layers"]}}))
    said: list[str] = []
    assert _run(watch, corpus, store, echo=said.append).ok and len(fake_analyze.calls) == 2
    assert said[0].endswith("(attempt 2; its report is missing (the run was stopped while it "
                            "was drawn))"), said  # fmt: skip
    for outputs in ({"tables": ["layers"], "report": "report.html"}, {"tables": ["layers"]}):
        extra = {"outputs": outputs} | ({} if "report" in outputs else {"report_error": "x"})
        (out / "manifest.json").write_text(json.dumps(manifest | extra))
        said.clear()
        assert _run(watch, corpus, store, echo=said.append).ok and len(fake_analyze.calls) == 2
        assert said[0].startswith(f"up to date: {models['a']} ("), said


def test_a_new_run_says_what_changed(models, corpus, tmp_path, fake_analyze) -> None:
    """Each run to be made says why, against the model's last complete run: a model never
    run, a result option's old and new value, the corpus's files changed (an appended line)."""
    import os

    store = tmp_path / "store"
    a, b = models["a"], models["b"]
    config = _job_config(tmp_path / "job.yaml", {"max_length": 32})
    assert _run(_watchlist(tmp_path / "w1.yaml", [{"model": a}]), corpus, store,
                config_path=config).ok  # fmt: skip

    def lines(watch: list[Any], **kwargs: Any) -> list[str]:
        said: list[str] = []
        _run(_watchlist(tmp_path / "w.yaml", watch), corpus, store, config_path=config,
             echo=said.append, **kwargs)  # fmt: skip
        return said[:-1]  # the summary line left out

    night = lines([{"model": a, "options": {"max_length": 16}}, {"model": b}], dry_run=True)
    assert night[0].startswith(f"would analyse: {a} (")
    assert night[0].endswith(" (since the last complete run: max_length 32 -> 16)")
    assert night[1].endswith(" (no complete run of this model yet)")
    with open(corpus, "a") as f:
        f.write('{"text": "One more line, appended tonight."}\n')
    os.utime(corpus, (1_700_000_000, 1_700_000_000))
    (line,) = lines([{"model": a}])
    assert line.startswith(f"analysing {a} (") and line.endswith(
        " (attempt 1; since the last complete run: the corpus's files changed (size or "
        "modification time))"
    )
    assert lines([{"model": a}])[0].startswith(f"up to date: {a} (")
    assert len(fake_analyze.calls) == 2


def test_key_follows_content_and_result_options(models, corpus, tmp_path, fake_analyze) -> None:
    store = tmp_path / "store"
    moved = shutil.copytree(models["a"], tmp_path / "renamed-copy")
    config = _job_config(tmp_path / "job.yaml", OPTIONS)
    watch = _watchlist(
        tmp_path / "models.yaml",
        [
            {"model": models["a"]},
            {"model": models["a"], "options": {"num_workers": 2, "batch_tokens": 64}},
            {"model": models["a"], "options": {"max_length": 16}},
        ],
    )
    result = _run(watch, corpus, store, config_path=config)
    assert [o.status for o in result.outcomes] == ["analysed", "analysed", "analysed"]
    # worker counts and batch sizes do not change the numbers: same key, one run
    assert result.outcomes[1].key == result.outcomes[0].key
    assert result.outcomes[2].key != result.outcomes[0].key
    assert len(fake_analyze.calls) == 2

    # the same weights in another directory: the content hash, so the key, is the same
    watch2 = _watchlist(tmp_path / "moved.yaml", [{"model": str(moved)}])
    result = _run(watch2, corpus, store, config_path=config)
    assert [o.status for o in result.outcomes] == ["up to date"]
    assert result.outcomes[0].out == str(store / "runs" / Path(models["a"]).name) + (
        f"-{result.outcomes[0].key[:12]}"
    )
    assert len(fake_analyze.calls) == 2

    # model, revision, corpus and output cannot come from the shared --config
    bad = _job_config(tmp_path / "bad.yaml", {"out": "/elsewhere"})
    with pytest.raises(ConfigError, match="sets 'out'"):
        _run(watch, corpus, store, config_path=bad)
    # a local directory has no revisions
    bad_watch = _watchlist(tmp_path / "rev.yaml", [{"model": models["a"], "revision": "main"}])
    result = _run(bad_watch, corpus, store)
    assert "applies to hub models only" in result.outcomes[0].message


class FakeJobServer:
    """The part of JobSubmissionClient that reanalyze uses; jobs are finished by the test."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, Any]] = {}
        self.submitted: list[str] = []

    def get_job_info(self, sid: str):
        if sid not in self.jobs:
            raise RuntimeError(f"Request failed with status code 404: Job {sid} does not exist.")
        job = self.jobs[sid]
        return type("Info", (), {"status": job["status"], "message": job.get("message", "")})

    def submit_job(self, *, entrypoint, submission_id, runtime_env, metadata):
        if submission_id in self.jobs:
            raise RuntimeError(f"Job with submission_id {submission_id} already exists.")
        self.jobs[submission_id] = {"status": "PENDING", "entrypoint": entrypoint}
        self.submitted.append(submission_id)
        return submission_id

    def finish(self, sid: str, ok: bool) -> None:
        """Run the job's entrypoint with the stand-in analysis (or fail it)."""
        job = self.jobs[sid]
        if ok:
            argv = shlex.split(job["entrypoint"])
            assert argv[:4] == ["python", "-m", "embgeom_ray", "analyze"]
            args = analyze_cli.build_parser().parse_args(argv[4:])
            overrides = {k: v for k, v in vars(args).items() if k not in {"config", "verbose"}}
            write_complete_run(build_config(None, overrides))
        job.update(status="SUCCEEDED" if ok else "FAILED", message="" if ok else "boom")


def test_submit_stable_ids_duplicates_and_retries(
    models, corpus, tmp_path, fake_analyze, monkeypatch
) -> None:
    store = tmp_path / "store"
    server = FakeJobServer()
    watch = _watchlist(tmp_path / "models.yaml", [{"model": models["a"]}])
    kwargs = {"submit": "http://head:8265", "client": server, "runtime_env": {}, "poll_s": 0.01}

    def run_while_jobs_finish(ok: bool) -> reanalyze.ReanalyzeResult:
        """reanalyze waiting for its jobs, which finish (ok or not) while it waits."""

        def sleep(_: float) -> None:
            for sid, job in server.jobs.items():
                if job["status"] in ("PENDING", "RUNNING"):
                    server.finish(sid, ok=ok)

        with monkeypatch.context() as m:
            m.setattr(reanalyze.time, "sleep", sleep)
            return _run(watch, corpus, store, **kwargs)

    result = _run(watch, corpus, store, wait=False, **kwargs)
    (outcome,) = result.outcomes
    first = submission_id(outcome.key)
    assert outcome.status == "submitted" and outcome.submission_id == first
    assert first == f"embgeom-{outcome.key[:24]}" and server.submitted == [first]
    row = read_index(str(store)).iloc[0]
    assert (row["status"], row["submission_id"], row["attempts"]) == ("submitted", first, 1)

    # still pending: recognised, not submitted again; it fails while we wait
    server.jobs[first]["status"] = "RUNNING"
    result = run_while_jobs_finish(ok=False)
    assert result.outcomes[0].submission_id == first and server.submitted == [first]
    assert result.outcomes[0].status == "failed"
    row = read_index(str(store)).iloc[0]
    assert row["status"] == "failed" and row["error"] == f"Ray job {first} ended FAILED: boom"

    # the next invocation submits attempt 1 under the next stable id, and waits for it
    retry = submission_id(outcome.key, 1)
    assert retry == f"{first}-1"
    result = run_while_jobs_finish(ok=True)
    assert server.submitted == [first, retry]
    assert result.outcomes[0].status == "analysed"
    row = read_index(str(store)).iloc[0]
    assert (row["status"], row["submission_id"], row["attempts"]) == ("complete", retry, 2)
    assert row["anisotropy_last"] == 0.125
    assert fake_analyze.calls == []  # nothing ran in this process

    # and now it is up to date: nothing is submitted
    result = _run(watch, corpus, store, **kwargs)
    assert result.outcomes[0].status == "up to date" and len(server.submitted) == 2


def test_cli_flags_of_the_cronjob_exist() -> None:
    text = reanalyze_cli.build_parser().format_help()
    for flag in ("--watchlist", "--corpus", "--store", "--config", "--dry-run", "--submit"):
        assert flag in text


# ------------------------------------------------------------------------------------------
# end to end: the real job


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_reanalyze_end_to_end(tmp_path, corpus, ray_local, capsys, monkeypatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # even if online
    a = make_tiny_bert(tmp_path / "models" / "tiny-a", seed=0)
    b = make_tiny_bert(tmp_path / "models" / "tiny-b", seed=1)
    store = tmp_path / "store"
    watch = _watchlist(
        tmp_path / "models.yaml",
        [{"model": a}, {"model": HUB_ID, "revision": "latest"}, {"model": b}],
    )
    # no sample: the index's headlines and the rogue dimensions compared below are exact
    # metrics (the sampled stage's first tasks started their workers: ~5 s of the first run)
    config = _job_config(tmp_path / "job.yaml", OPTIONS | {"sample_size": 0})
    argv = ["--watchlist", watch, "--corpus", corpus, "--store", str(store), "--config", config]

    calls: list[str] = []
    real_analyze = pipeline.analyze

    def counting(cfg, **kw):
        calls.append(cfg.model)
        return real_analyze(cfg, **kw)

    pipeline.analyze = counting
    try:
        timings = []
        t0 = time.perf_counter()
        assert reanalyze_cli.main(argv) == 1  # the hub id cannot be resolved offline
        timings.append(time.perf_counter() - t0)
        err = capsys.readouterr().err
        assert f"model 2 ({HUB_ID}): cannot resolve revision 'latest'" in err
        assert "offline mode is on" in err and f"1 model(s) failed: {HUB_ID}" in err
        assert sorted(calls) == sorted([a, b])  # both local models analysed once

        first = read_index(str(store)).set_index("model")
        assert set(first.index) == {a, b} and (first["status"] == "complete").all()
        for model in (a, b):
            row = first.loc[model]
            manifest = json.loads((Path(row["out"]) / "manifest.json").read_text())
            assert manifest["status"] == "complete"
            assert manifest["model"]["revision"] == row["revision"]
            assert manifest["corpus"]["fingerprint"] == row["corpus_fingerprint"]
            assert row["run_fingerprint"] == manifest["fingerprint"]
            assert row["n_tokens"] == manifest["counts"]["tokens"] > 0
            assert row["n_layers"] == 3
            layers = pd.read_parquet(Path(row["out"]) / "layers.parquet")
            assert row["anisotropy_last"] == pytest.approx(layers["anisotropy"].iloc[-1])
            assert row["within_ratio_mean"] == pytest.approx(layers["within_ratio"].mean())

        # second invocation: nothing runs
        t0 = time.perf_counter()
        assert reanalyze_cli.main(argv) == 1
        timings.append(time.perf_counter() - t0)
        out = capsys.readouterr().out
        assert len(calls) == 2 and out.count("up to date: ") == 2
        pd.testing.assert_frame_equal(read_index(str(store)).set_index("model"), first)

        # b's weights change: exactly one new run, b's old run stays in the index
        plant_outlier_dimension(b, dim=5, scale=8.0)
        t0 = time.perf_counter()
        assert reanalyze_cli.main(argv) == 1
        timings.append(time.perf_counter() - t0)
        capsys.readouterr()
        assert calls == [a, b, b]
        index = read_index(str(store))
        assert len(index) == 3 and (index["status"] == "complete").all()
        new_b = index[(index["model"] == b) & (index["key"] != first.loc[b, "key"])]
        assert len(new_b) == 1 and new_b["revision"].iloc[0] != first.loc[b, "revision"]
        print("reanalyze invocations took " + ", ".join(f"{t:.1f}s" for t in timings))
    finally:
        pipeline.analyze = real_analyze

    # jobs.compare on b before and after: the planted dimension appears as a rogue dimension
    from jobs import compare as compare_cli

    old_out, new_out = first.loc[b, "out"], new_b["out"].iloc[0]
    cmp = tmp_path / "cmp"
    assert compare_cli.main([old_out, new_out, "--out", str(cmp), "--labels", "old,new"]) == 0
    rogue = pd.read_parquet(cmp / "rogue_dims.parquet")
    old_flags = pd.read_parquet(Path(old_out) / "dims.parquet").query("outlier")
    new_flags = pd.read_parquet(Path(new_out) / "dims.parquet").query("outlier")
    assert set(new_flags.loc[new_flags["dim"] == 5, "layer"]) == {0, 1, 2}
    appeared = rogue[(rogue["change"] == "appeared") & (rogue["dim"] == 5)]
    assert set(appeared["layer"]) == {0, 1, 2} - set(old_flags.loc[old_flags["dim"] == 5, "layer"])
    assert (cmp / "report.html").is_file()


def test_a_result_option_added_later_counts_as_its_default() -> None:
    """A run made before an option existed (its manifest does not name it) ran as the
    option's default: same key, so an upgrade does not redo every watched run."""
    from embgeom_ray.run_dir import CorpusInfo, Manifest, ModelInfo, TokenizerInfo
    from embgeom_ray.runs.reanalyze import manifest_key

    config = build_config(None, {"model": "m", "corpus": "c", "out": "o"}).model_dump()

    def manifest(cfg: dict) -> Manifest:
        return Manifest(
            status="complete", config=cfg, model=ModelInfo(id="m", model_fingerprint="sha256:a"),
            tokenizer=TokenizerInfo(fingerprint="t"), corpus=CorpusInfo(fingerprint="c"),
        )  # fmt: skip

    old = {k: v for k, v in config.items() if k != "dedup"}
    assert manifest_key(manifest(old)) == manifest_key(manifest(config)) is not None
    assert manifest_key(manifest(config | {"dedup": True})) != manifest_key(manifest(config))


def test_the_working_dir_is_the_checkout_and_uploads_the_whole_package() -> None:
    """The runtime environment a submission uploads: this checkout, every file of the package,
    the jobs and the configs, none of the runs' outputs, builds or the environment (matched
    with Ray's own reader of ``excludes``). The README's ``ray job submit`` lists the same."""
    from ray._private.runtime_env.packaging import _get_excludes

    from embgeom_ray.runs.reanalyze import WORKING_DIR_EXCLUDES, default_runtime_env

    env = default_runtime_env()
    assert Path(env["working_dir"]) == REPO
    excluded = _get_excludes(REPO, env["excludes"])
    kept = [p for d in ("embgeom_ray", "jobs", "configs") for p in (REPO / d).rglob("*.py*")]
    kept = [p for p in kept if "__pycache__" not in p.parts]
    assert len(kept) > 50 and not [p for p in kept if excluded(p)]
    assert (REPO / "embgeom_ray" / "runs" / "pipeline.py") in kept
    for left_out in ("runs/demo/manifest.json", "build/demo/x.jsonl", ".venv/bin/python",
                     ".git/HEAD", "bench/results/fold.json", "embgeom_ray/__pycache__/x.pyc"):
        assert excluded(REPO / left_out), left_out  # fmt: skip
    readme = (REPO / "README.md").read_text()
    shown = json.loads(readme.split("--runtime-env-json '")[1].split("'")[0])["excludes"]
    assert set(shown) <= set(WORKING_DIR_EXCLUDES)


def test_an_unknown_option_is_named_where_it_was_given() -> None:
    """An unknown key among a model's options of the watch list is named there, one of the
    ``--config`` file there (both read as the same job options)."""
    from embgeom_ray.runs.reanalyze import WatchEntry, entry_config

    entry = WatchEntry("org/m", options={"max_lenght": 64}, position=2)
    with pytest.raises(ConfigError, match=r"unknown option 'max_lenght' in the options of model 2 "
                                          r"of the watch list \(did you mean max_length\?\)"):  # fmt: skip
        entry_config(entry, {}, "c.jsonl", "out", None)
    with pytest.raises(ConfigError, match=r"unknown option 'sampel_size' in the config file"):
        entry_config(WatchEntry("org/m"), {"sampel_size": 8}, "c.jsonl", "out", None)
