"""Every input a user can get wrong: one clear message, exit status 2, nothing left as complete."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.analyze import main
from tests.conftest import write_jsonl
from tests.tiny_models import make_tiny_bert

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_bert(str(tmp_path_factory.mktemp("m")), max_position=256)


@pytest.fixture
def corpus(tmp_path) -> str:
    return write_jsonl(tmp_path / "c.jsonl", ["the cat sat on the mat", "a dog barked"])


def run(capsys, *argv: str) -> tuple[int, str]:
    # (the runs that succeed need no report: tests/report/test_report.py draws them)
    code = main([*argv, "--no-report"])
    err = capsys.readouterr().err
    return code, err


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def assert_user_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2, err
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_missing_model(capsys, tmp_path, corpus):
    code, err = run(
        capsys,
        "--model",
        str(tmp_path / "no-such-model"),
        "--corpus",
        corpus,
        "--out",
        str(tmp_path / "o"),
    )
    assert_user_error(code, err, "cannot load", "no-such-model", "no such directory")
    assert "hub id" not in err and "Repo id" not in err  # a path, not an id of the hub
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_unreadable_model_weights(capsys, tmp_path, model, corpus, ray_local):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    code, err = run(
        capsys, "--model", str(broken), "--corpus", corpus, "--out", str(tmp_path / "o")
    )
    assert_user_error(code, err, "cannot load the weights", "broken")
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["status"] == "running"


def test_missing_corpus(capsys, tmp_path, model):
    code, err = run(
        capsys,
        "--model",
        model,
        "--corpus",
        str(tmp_path / "nothing*.jsonl"),
        "--out",
        str(tmp_path / "o"),
    )
    assert_user_error(code, err, "nothing")


#: a corpus directory whose text is in another column, with items that are no documents and
#: a file of no corpus type: refused without --text-column, read with it. One run with it,
#: shared by the tests of what it reads (each of them a whole job before: ~7 CPU-s each)
MIXED_ROWS = [
    {"body": "the cat sat"},
    {"body": 42},
    {"body": None},
    {"body": "   "},
    {"body": ""},
    {"body": "a dog"},
]


@pytest.fixture(scope="module")
def mixed_corpus(tmp_path_factory) -> Path:
    corpus = tmp_path_factory.mktemp("mixed") / "corpus"
    corpus.mkdir()
    (corpus / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MIXED_ROWS))
    (corpus / "more.csv").write_text("text\nthe bird sang\n")
    return corpus


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory, model, mixed_corpus):
    """``run(capsys)``: the job over :func:`mixed_corpus` with ``--text-column body`` (run by
    the first test that asks, on the tests' Ray its ``ray_local`` holds), as ``(status, stdout,
    stderr, out directory)``."""
    out = tmp_path_factory.mktemp("mixed-run") / "o"
    done: list[tuple[int, str, str, Path]] = []

    def run_once(capsys) -> tuple[int, str, str, Path]:
        if not done:
            capsys.readouterr()
            argv = ["--model", model, "--corpus", str(mixed_corpus), "--out", str(out)]
            code = main([*argv, "--text-column", "body", "--no-report"])
            printed = capsys.readouterr()
            done.append((code, printed.out, printed.err, out))
        return done[0]

    return run_once


def test_missing_text_column(capsys, tmp_path, model, mixed_corpus, mixed_run, ray_local):
    """Refused once the job has started Ray (the session's here: a private one took ~5 s)."""
    code, err = run(capsys, "--model", model, "--corpus", str(mixed_corpus), "--out",
                    str(tmp_path / "o"))  # fmt: skip
    assert_user_error(code, err, "no column 'text'", "body")
    code, _, err, _ = mixed_run(capsys)  # the same corpus, --text-column body
    assert code == 0, err


def test_non_text_values_and_empty_documents_are_skipped_and_counted(capsys, mixed_run, ray_local):
    code, out, err, run_dir = mixed_run(capsys)
    assert code == 0, err
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert manifest["counts"]["documents"] == 2
    assert manifest["skipped"] == {"non-text value": 2, "empty": 2}
    # said at the end of the run, not only in the manifest (the empty ones are not)
    warnings = [line for line in (out + err).splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: 2 item(s) of the corpus could not be read as documents and were left out "
        "(2 non-text value; 2 documents read); manifest.json's skipped counts them"
    ]


def test_files_of_other_types_in_a_corpus_directory_are_named(
    capsys, tmp_path, model, mixed_corpus, mixed_run, ray_local
):
    """A directory's .csv (not a corpus type) was left out without a word: named in one line,
    by --plan and by the run, which reads the rest."""
    notice = f"corpus: 1 file in {mixed_corpus} of no corpus type (1 corpus file read; supported: "
    argv = ["--model", model, "--corpus", str(mixed_corpus), "--out", str(tmp_path / "o")]
    assert main([*argv, "--text-column", "body", "--plan"]) == 0
    out, err = capsys.readouterr()
    assert [line for line in out.splitlines() if line.startswith("corpus: 1 file")] == [
        notice + ".txt, .text, .jsonl, .json, .ndjson, .parquet, .pq (line formats also with "
        ".gz, .bz2, .xz, .zst)) left out: more.csv"
    ]
    code, out, err, run_dir = mixed_run(capsys)
    assert code == 0, err
    assert (out + err).count(notice) == 1
    assert json.loads((run_dir / "manifest.json").read_text())["counts"]["documents"] == 2


def test_empty_corpus(capsys, tmp_path, model, ray_local):
    path = tmp_path / "empty.txt"
    path.write_text("\n   \n\n")
    code, err = run(capsys, "--model", model, "--corpus", str(path), "--out", str(tmp_path / "o"))
    assert_user_error(code, err, "no tokens", "empty")
    assert list((tmp_path / "o").iterdir()) == []  # nothing measured: no run left to resume
    path.write_text("the corpus corrected\n")  # another fingerprint: a fresh run, not refused
    code, err = run(capsys, "--model", model, "--corpus", str(path), "--out", str(tmp_path / "o"))
    assert code == 0, err
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["status"] == "complete"


def test_corrupt_parquet(capsys, tmp_path, model):
    good = tmp_path / "corpus" / "a.parquet"
    good.parent.mkdir()
    pq.write_table(pa.table({"text": ["fine text"]}), good)
    (tmp_path / "corpus" / "b.parquet").write_bytes(b"PAR1 this is not parquet")
    code, err = run(
        capsys, "--model", model, "--corpus", str(tmp_path / "corpus"), "--out", str(tmp_path / "o")
    )
    assert_user_error(code, err, "b.parquet")


@pytest.mark.parametrize("layers", ["9", "-4", "0,0"])
def test_unknown_or_repeated_layer(capsys, tmp_path, model, corpus, layers):
    code, err = run(
        capsys,
        "--model",
        model,
        "--corpus",
        corpus,
        "--out",
        str(tmp_path / "o"),
        "--layers",
        layers,
    )
    assert_user_error(code, err, "layer")
    if layers == "9":
        assert "0..2" in err


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--max-length", "2"], "--max-length"),
        (["--max-length", "4096"], "exceeds"),
        (["--num-workers", "0"], "--num-workers"),
        (["--outlier-tail-share", "2"], "--outlier-tail-share"),
        (["--clip-dims", "5000"], "outside"),
        (["--clip-dims", "1", "--clip-dims-from", "/x"], "not both"),
        # refused once the job has sized the reduce: after it has started a private Ray, where
        # no Ray is up (make test-fast: ~10 s), so slow
        pytest.param(
            ["--reducer-memory", "1KiB"],
            "--reducer-memory 1,024 bytes cannot hold",
            marks=pytest.mark.slow,
        ),
        (["--reducer-memory", "lots"], "--reducer-memory"),
        (["--clip-dims", "-1"], "--clip-dims: dimensions are non-negative, got [-1]"),
    ],
)
def test_invalid_options(capsys, tmp_path, model, corpus, flags, fragment):
    code, err = run(
        capsys, "--model", model, "--corpus", corpus, "--out", str(tmp_path / "o"), *flags
    )
    assert_user_error(code, err, fragment)


def test_missing_required_option(capsys, corpus):
    code, err = run(capsys, "--corpus", corpus)
    assert_user_error(code, err, "--model is required", "--out is required")


def test_bad_config_file(capsys, tmp_path, model, corpus):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("max_length: [unclosed\n")
    code, err = run(
        capsys,
        "--config",
        str(cfg),
        "--model",
        model,
        "--corpus",
        corpus,
        "--out",
        str(tmp_path / "o"),
    )
    assert_user_error(code, err, "not valid YAML")
    cfg.write_text("max_lenght: 64\n")
    code, err = run(
        capsys,
        "--config",
        str(cfg),
        "--model",
        model,
        "--corpus",
        corpus,
        "--out",
        str(tmp_path / "o"),
    )
    assert_user_error(code, err, "unknown option 'max_lenght' in the config file (did you mean max_length?)")
    # a list option in the flag's own form is the list it names; a bad one says so once
    from embgeom_ray.config import build_config

    cfg.write_text('layers: "0,-1"\nclip_dims: "3"\n')
    config = build_config(str(cfg), {"model": model, "corpus": corpus, "out": "o"})
    assert (config.layers, config.clip_dims) == ([0, -1], [3])
    cfg.write_text('layers: "0,x"\n')
    code, err = run(capsys, "--config", str(cfg), "--model", model, "--corpus", corpus, "--out",
                    str(tmp_path / "o"))  # fmt: skip
    assert_user_error(code, err, "--layers: give integers separated by commas")
    assert err.count("(got '0,x')") == 1


def test_ctrl_c_and_sigterm_are_one_line_and_their_own_status(capsys):
    """Ctrl-C's KeyboardInterrupt, and SIGTERM as Ray's handler raises it (``SystemExit(15)``:
    ``ray job stop``, a pod deleted): one line each, 130 and 143; another SystemExit passes."""
    from embgeom_ray.cli import INTERRUPTED, TERMINATED, exit_status

    def interrupted() -> None:
        raise KeyboardInterrupt

    assert exit_status(interrupted) == INTERRUPTED == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("interrupted: ") and "resumes" in err
    assert exit_status(lambda: sys.exit(15)) == TERMINATED == 143
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("terminated (SIGTERM): ") and "resumes" in err
    with pytest.raises(SystemExit):
        exit_status(lambda: sys.exit(3))


@pytest.mark.parametrize("then", [SystemExit(1), RuntimeError("a reducer was lost")])
def test_sigterm_is_143_whatever_ray_wait_makes_of_it(capsys, then):
    """SIGTERM while the driver waits in ``ray.wait``/``ray.get``: the handler's
    ``SystemExit(15)`` comes out of Ray 2.60's wait as ``SystemExit(1)`` (or a cleanup's
    error takes its place); the command still says one line and ends with 143, and the
    handler the caller had is back afterwards."""
    import signal

    from embgeom_ray.cli import TERMINATED, exit_status

    def sigterm_in_ray_wait() -> None:
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # else: pytest ends
        try:
            signal.raise_signal(signal.SIGTERM)
        except SystemExit as exc:
            assert exc.code == 15
            raise then from None

    before = signal.getsignal(signal.SIGTERM)
    assert exit_status(sigterm_in_ray_wait) == TERMINATED
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("terminated (SIGTERM): "), err
    assert signal.getsignal(signal.SIGTERM) is before
    with pytest.raises(SystemExit):  # without a SIGTERM, SystemExit(1) is not one
        exit_status(lambda: sys.exit(1))


@pytest.mark.slow
@pytest.mark.parametrize("signum", [2, 15], ids=["SIGINT", "SIGTERM"])
def test_a_signal_ends_the_command_by_itself(tmp_path, signum):
    """A command's process ends by the signal itself after its line, as an uncaught one
    would, so the shell running it sees the signal: after Ctrl-C it stops too (a loop over
    models, a script) instead of going on to its next line as after an ordinary exit status;
    after SIGTERM (as ``ray.init``'s handler turns it into ``SystemExit(15)``) it reads 143."""
    import os
    import signal

    child = tmp_path / "command.py"
    child.write_text("import signal, sys, time\n"
                     "from embgeom_ray.cli import exit_process, exit_status\n"
                     "signal.signal(signal.SIGTERM, lambda s, f: sys.exit(s))  # as ray.init\n"
                     "exit_process(exit_status(lambda: print('ready', flush=True) or "
                     "time.sleep(60)))\n")  # fmt: skip
    shell = subprocess.Popen(
        ["bash", "-c", f"{sys.executable} {child}; echo the shell went on: $?"], cwd=REPO,
        env=os.environ | {"PYTHONPATH": str(REPO)}, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    assert shell.stdout.readline() == "ready\n"  # the command's imports done, in its "run"
    if signum == signal.SIGINT:
        os.killpg(shell.pid, signum)  # Ctrl-C: the terminal signals the whole group
    else:  # SIGTERM to the command alone (ray job stop signals the job's process)
        (pid,) = [int(p) for p in subprocess.run(["pgrep", "-P", str(shell.pid)], text=True,
                                                 capture_output=True).stdout.split()]  # fmt: skip
        os.kill(pid, signum)
    out, _ = shell.communicate(timeout=60)
    if signum == signal.SIGINT:
        assert out.startswith("interrupted: ") and "the shell went on" not in out, out
        assert shell.returncode == -signum
    else:  # a shell goes on after a child's SIGTERM, as after any child's ordinary end
        assert out.startswith("terminated (SIGTERM): ") and out.endswith("the shell went on: 143\n")


def test_output_directory_cannot_be_written(capsys, tmp_path, model, corpus, ray_local):
    """Refused once the job has started Ray (the session's here: a private one took ~10 s)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, err = run(capsys, "--model", model, "--corpus", corpus, "--out", str(blocker / "out"))
    assert_user_error(code, err, "cannot write to the output directory")


def test_different_run_in_output_directory_is_refused(
    capsys, tmp_path, model, mixed_corpus, mixed_run, ray_local
):
    """A complete run in --out (a copy of the module's run: not a job of its own) is refused
    to another configuration, and replaced with --overwrite."""
    import shutil

    code, _, err, run_dir = mixed_run(capsys)
    assert code == 0, err
    shared = (run_dir / "manifest.json").read_bytes()
    assert json.loads(shared)["config"]["max_length"] != 32  # the default
    out = str(tmp_path / "o")
    shutil.copytree(run_dir, out)
    argv = ["--model", model, "--corpus", str(mixed_corpus), "--text-column", "body"]
    code, err = run(capsys, *argv, "--out", out, "--max-length", "32")
    assert_user_error(code, err, "different configuration", "differs in: max_length", "--overwrite")
    code, err = run(capsys, *argv, "--out", out, "--max-length", "32", "--overwrite")
    assert code == 0, err
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert manifest["config"]["max_length"] == 32 and manifest["status"] == "complete"
    assert (run_dir / "manifest.json").read_bytes() == shared  # the module's run left as it was


@pytest.mark.parametrize(
    "where", ["the corpus directory", "a directory in it", "a glob's match", "a run's name"]
)
def test_output_directory_apart_from_the_corpus(capsys, tmp_path, model, where):
    """An --out where a rerun would read the run's files as corpus (in the corpus directory,
    read recursively, or where a glob corpus matches what a run writes) is refused before
    anything is written, and so is one holding a corpus file under a name a run writes
    (--overwrite would remove it). A corpus beside the run's files otherwise may stay."""
    from embgeom_ray.runs.pipeline import check_apart

    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "c.jsonl", ["the cat sat on the mat", "a dog barked"])
    pq.write_table(pa.table({"text": ["a parquet corpus"]}), data / "layers.parquet")
    corpus, out = {
        "the corpus directory": (data, data),
        "a directory in it": (data, data / "run"),
        "a glob's match": (data / "**" / "*.parquet", data / "run"),  # run/layers.parquet
        "a run's name": (data / "layers.parquet", data),
    }[where]
    code, err = run(capsys, "--model", model, "--corpus", str(corpus), "--out", str(out),
                    "--overwrite")  # fmt: skip
    assert_user_error(code, err, f"--out {out}", "corpus")
    assert sorted(p.name for p in data.iterdir()) == ["c.jsonl", "layers.parquet"]
    for corpus, out in [(data / "c.jsonl", data), (data / "*.jsonl", data), (data, tmp_path)]:
        check_apart(str(corpus), [str(data / "c.jsonl")], str(out))  # not refused


@pytest.mark.slow
def test_exit_status_of_the_real_command(tmp_path, corpus):
    """The same through a real process: status 2 and one line on stderr, no traceback."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.analyze",
            "--model",
            str(tmp_path / "nope"),
            "--corpus",
            corpus,
            "--out",
            str(tmp_path / "o"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: cannot load") and "Traceback" not in proc.stderr
    help_text = subprocess.run(
        [sys.executable, "-m", "jobs.analyze", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    for flag in (
        "--model",
        "--corpus",
        "--out",
        "--max-length",
        "--num-workers",
        "--layers",
        "--config",
        "--clip-dims",
        "--trust-remote-code",
    ):
        assert flag in help_text


def test_a_store_nobody_answers_is_one_line_in_every_command(capsys, tmp_path, model, corpus,
                                                            monkeypatch):  # fmt: skip
    """An object store's fault is one line and exit status 2 in report, compare and
    reanalyze too, as in analyze and merge (they printed a botocore traceback, status 1);
    reanalyze checks its store before it plans or runs any model (--dry-run included)."""
    import s3fs

    from jobs import compare, reanalyze, report
    from tests.ray_processes import free_ports

    (port,) = free_ports(1)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    s3fs.S3FileSystem.clear_instance_cache()
    watchlist = tmp_path / "models.yaml"
    watchlist.write_text(f"models:\n  - model: {model}\n")
    commands = [
        (report.main, ["s3://b/run"]),
        (compare.main, ["s3://b/a", "s3://b/b", "--out", str(tmp_path / "cmp")]),
        (reanalyze.main, ["--watchlist", str(watchlist), "--corpus", corpus, "--store",
                          "s3://b/store", "--dry-run"]),
    ]  # fmt: skip
    try:
        for main, argv in commands:
            assert_user_error(main(argv), capsys.readouterr().err, f"127.0.0.1:{port}")
    finally:
        s3fs.S3FileSystem.clear_instance_cache()  # the next test's endpoint is another
    assert not (tmp_path / "cmp").exists()


def test_a_relative_out_in_a_submitted_jobs_working_directory_is_refused(capsys, tmp_path,
                                                                        model, corpus,
                                                                        monkeypatch):  # fmt: skip
    """Under ``ray job submit --working-dir``, the job runs in the copy Ray unpacked (and
    later removes): a relative --out would land there. Refused before any work; an absolute
    one is not."""
    from embgeom_ray.storage import RAY_WORKING_DIR_PART, check_output

    unpacked = tmp_path / "session" / RAY_WORKING_DIR_PART.strip("/") / "_ray_pkg_0123"
    unpacked.mkdir(parents=True)
    monkeypatch.chdir(unpacked)
    code, err = run(capsys, "--model", model, "--corpus", corpus, "--out", "runs/rel")
    assert_user_error(code, err, "runs/rel is a relative path", "absolute path")
    assert not (unpacked / "runs").exists()
    check_output(str(tmp_path / "runs" / "abs"))  # an absolute one: not refused
    # --plan-json too: written there, the plan said so and Ray removed it
    code, err = run(capsys, "--model", model, "--corpus", corpus,
                    "--out", str(tmp_path / "runs" / "abs"), "--plan-json", "plan.json")  # fmt: skip
    assert_user_error(code, err, "plan.json is a relative path", "absolute path")
    assert not (unpacked / "plan.json").exists()


def test_another_nodes_copy_with_other_bytes_ends_the_run_before_its_group(
    capsys, tmp_path, model, monkeypatch, ray_local
):
    """A node's copy of a local corpus of the same size and last 4 KiB, with other bytes in
    one shard's range and a modification time of its own: its shards read there without a
    word before; now the job's own process compares the digest its extractor sends with its
    own copy's, and ends the run (one line, exit 2) before that shard's group is committed.

    The test's seam: the job's process believes it is on ``head-node`` (its corpus module's
    host name), so the extractor (a Ray worker, of the machine's own name) reads as another
    node; the one file is that node's copy while the extractor reads (from the extraction's
    start) and the planner's, its planned mtime back, while the driver checks (each check is
    done before the extractor is given its next shard: every shard is a group of its own,
    ``--checkpoint-interval 0``, one extractor)."""
    import os
    import types

    from embgeom_ray.distributed import actor_pool
    from embgeom_ray.inputs import copies
    from embgeom_ray.inputs import corpus as corpus_mod
    from embgeom_ray.inputs.corpus import TAIL_BYTES
    from embgeom_ray.runs.checkpoints import CheckpointStore

    head = types.SimpleNamespace(gethostname=lambda: "head-node")
    monkeypatch.setattr(corpus_mod, "socket", head)
    monkeypatch.setattr(copies, "socket", head)
    path = tmp_path / "c.txt"
    path.write_text("".join(f"the cat number {i:04d} sat on the mat\n" for i in range(400)))
    planned, stat = path.read_bytes(), path.stat()
    assert len(planned) > 2 * 4096 + TAIL_BYTES  # shard 2's middle lies before the last 4 KiB
    node_copy = bytearray(planned)
    node_copy[2 * 4096 + 1000 : 2 * 4096 + 1003] = b"dog"  # a cat in shard 2 is a dog there
    real_run_shards, real_check = actor_pool.run_shards, actor_pool.check_copy

    def as_node_copy() -> None:
        path.write_bytes(node_copy)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))

    def run_shards(*args, **kwargs):
        as_node_copy()
        return real_run_shards(*args, **kwargs)

    checked = []

    def check_copy(shard, copy, cancel):
        checked.append((shard.shard_id, copy["host"]))
        path.write_bytes(planned)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        try:
            real_check(shard, copy, cancel)
        finally:
            as_node_copy()

    monkeypatch.setattr(actor_pool, "run_shards", run_shards)
    monkeypatch.setattr(actor_pool, "check_copy", check_copy)
    out = tmp_path / "o"
    code, err = run(
        capsys, "--model", model, "--corpus", str(path), "--out", str(out), "--shard-bytes",
        "4096", "--num-workers", "1", "--checkpoint-interval", "0", "--sample-size", "0",
    )  # fmt: skip
    bad = "f00000-b000000008192"
    assert_user_error(
        code, err, f"corpus file {path} on {socket.gethostname()} is not the file on head-node: "
        f"its bytes [8,191, 12,320) of shard {bad} hold other data (same size and last "
        "4 KiB, another modification time)", "the same command resumes once they are",
    )  # fmt: skip
    assert [shard for shard, _ in checked] == ["f00000-b000000000000", "f00000-b000000004096", bad]
    assert {host for _, host in checked} == {socket.gethostname()}
    assert json.loads((out / "manifest.json").read_text())["status"] == "running"
    assert not (out / "statistics.safetensors").exists()
    done = CheckpointStore(str(out)).done_shards()
    assert done == {"f00000-b000000000000", "f00000-b000000004096"}  # the others committed
