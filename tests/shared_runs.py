"""Runs made once per test session and shared by the tests of several modules.

A whole job costs the suite mostly its actors' and Rays' starts, not its tokens
(docs/testing.md), so where tests of several modules check different outputs of the same run,
the run is made once: by whichever test asks for it first, on either pytest-xdist worker, and
handed to the others as a directory to read.

- Where: a directory per run under the session's shared temporary directory
  (``tmp_path_factory.getbasetemp().parent`` under pytest-xdist, the parent of both workers'
  own; the base itself in one process), so that a later session never finds this one's runs.
- Once: the first worker to ask holds a ``filelock.FileLock`` while it makes the run; the
  other waits on the lock, then finds the run recorded. A run is recorded complete (its
  ``.done`` file, with its files' sizes and times) only once its maker returned, so a maker
  that failed leaves nothing the next asker would take: that one makes it again (and fails
  the same way).
- Read only: a test that would change a run (resume it, re-table it, draw its report,
  corrupt it) works on a copy (:func:`copy_run`). Every test that took a run checks, when it
  ends, that the run's files are as recorded (:func:`assert_unchanged`; the tests run as root
  here, so file modes would not keep anyone out).

The makers are here, one per shared run, so that every module asking for a run by its name
makes the same one; their fixtures are in ``tests/conftest.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from filelock import FileLock

#: the directory of the session's shared runs, beside the workers' own temporary directories
SHARED_DIR = "embgeom-shared-runs"


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's directory of shared runs: one for both pytest-xdist workers."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / SHARED_DIR
    root.mkdir(exist_ok=True)
    return root


def _listing(path: Path) -> dict[str, list[int]]:
    """Every file under ``path``: its size and modification time (ns), by relative path."""
    return {
        str(f.relative_to(path)): [f.stat().st_size, f.stat().st_mtime_ns]
        for f in sorted(path.rglob("*"))
        if f.is_file()
    }


def shared_run(
    tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]
) -> Path:
    """The directory of the shared run ``name``, complete: made by ``make(directory)`` (an
    empty directory) the first time a test of this session asks for it, on either worker,
    and found by every later ask. Read it only (:func:`copy_run` to change it)."""
    root = shared_root(tmp_path_factory)
    path, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)  # what a maker that failed left
            path.mkdir()
            t0 = time.monotonic()
            make(path)
            record = {"worker": os.environ.get("PYTEST_XDIST_WORKER", "master"),
                      "seconds": round(time.monotonic() - t0, 1), "files": _listing(path)}  # fmt: skip
            done.write_text(json.dumps(record))
    return path


def assert_unchanged(path: Path) -> None:
    """``path``'s files are those its maker left (sizes and times): no test changed the run."""
    recorded = json.loads(path.with_name(f"{path.name}.done").read_text())["files"]
    assert _listing(path) == recorded, f"a test changed the shared run {path} (copy_run it)"


@contextlib.contextmanager
def taken(tmp_path_factory: pytest.TempPathFactory, name: str, model_dir: str) -> Iterator[Path]:
    """The shared run ``name`` (:func:`shared_run`, by its maker in :data:`MAKERS` with the
    model ``model_dir``) for one test or module; when it is given back, its files are as
    recorded (:func:`assert_unchanged`)."""
    path = shared_run(tmp_path_factory, name, lambda directory: MAKERS[name](directory, model_dir))
    yield path
    assert_unchanged(path)


def copy_run(src: Path, dst: Path) -> Path:
    """A copy of a shared run (or of a run directory in it) to change."""
    return Path(shutil.copytree(src, dst))


# ------------------------------------------------------------------------------ the shared runs

#: tests/runs/test_job_end_to_end.py's MiniLM job, shared with tests/report/test_report.py:
#: the run's directory and its corpus under the shared directory, and its progress on stderr
MINILM_ENGLISH = "minilm-english"


def make_minilm_english(directory: Path, model_dir: str) -> None:
    """MiniLM over 16 documents of the Python Language Reference's prose cut to 500 characters
    (7 KB of JSON lines: 2 shards of 4 KB, every document longer than one 64-token window),
    in this process on the tests' local Ray: a sample of 512 with its default sampled extras
    (half-sample standard errors, K-means stability refits) and a scan to k = 6, and the
    job's own report. ``minilm/`` is the run, ``minilm.jsonl`` its corpus, ``stderr.txt``
    what the job wrote on stderr (its bars)."""
    from embgeom_ray.config import build_config
    from embgeom_ray.inputs.demo_corpus import python_docs_documents
    from embgeom_ray.runs.pipeline import analyze
    from tests.conftest import write_jsonl

    docs = [d[:500] for d in python_docs_documents()[:16]]
    corpus = write_jsonl(directory / "minilm.jsonl", docs)
    options = {"model": model_dir, "corpus": corpus, "out": str(directory / "minilm"),
               "max_length": 64, "shard_bytes": 4096, "sample_size": 512, "kmeans_k_max": 6}  # fmt: skip
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        manifest = analyze(build_config(None, options), echo=lambda *_: None)
    (directory / "stderr.txt").write_text(stderr.getvalue())
    (directory / "returned.json").write_text(json.dumps(manifest))


#: MiniLM's sample over repeated English sentences, every layer
#: (tests/core/test_kmeans_selection_minilm.py, tests/core/test_sampled_metrics_minilm.py)
MINILM_SAMPLE = "minilm-sample"
MINILM_SAMPLE_LAYERS = list(range(7))
MINILM_SAMPLE_SIZE = 2048


def make_minilm_sample(directory: Path, model_dir: str) -> None:
    """MiniLM's bottom-k sample of 2,048 points (one a type in the type-uniform sample) over 900
    of the demo prose's sentences, a third of them repeated (``tests.conftest.
    repeated_sentences``), drawn by the extractor's shard processor in this process (no Ray):
    ``points.npz`` holds each layer's vectors, content keys and token ids."""
    import numpy as np

    from embgeom_ray.config import build_config
    from embgeom_ray.inputs.corpus import CorpusSpec, plan_shards
    from embgeom_ray.inputs.extractor import ShardProcessor
    from tests.conftest import repeated_sentences, write_jsonl

    corpus = write_jsonl(directory / "repeated.jsonl", repeated_sentences(n_sentences=900))
    cfg = build_config(
        None,
        {"model": model_dir, "corpus": corpus, "out": str(directory / "unused"), "max_length": 64,
         "sample_size": MINILM_SAMPLE_SIZE, "sample_type_size": 1},
    )  # fmt: skip
    proc = ShardProcessor(cfg.extraction, MINILM_SAMPLE_LAYERS, {"model_fingerprint": "test"})
    _, sample, _ = proc.process(plan_shards(CorpusSpec(corpus), 1 << 40).shards[0])
    assert sample.num_uniform == MINILM_SAMPLE_SIZE
    arrays = {}
    for layer in MINILM_SAMPLE_LAYERS:
        pts = sample.points(layer)
        arrays |= {f"vectors_{layer}": pts.vectors, f"keys_{layer}": pts.content_keys,
                   f"token_ids_{layer}": pts.token_ids}  # fmt: skip
    np.savez(directory / "points.npz", **arrays)


def load_minilm_sample(directory: Path) -> dict[int, tuple]:
    """layer -> (the sample's rows, their content keys, their token ids), as drawn."""
    import numpy as np

    with np.load(directory / "points.npz") as f:
        return {
            layer: (f[f"vectors_{layer}"], f[f"keys_{layer}"], f[f"token_ids_{layer}"])
            for layer in MINILM_SAMPLE_LAYERS
        }


#: A user's script of the Python API, run in a fresh process with a private ``TMPDIR`` (the
#: process's own private Rays), whose parts two modules check: the lines of a job (``echo``)
#: and a call that prints nothing (tests/test_api_progress.py), then Ray left as the script
#: found it after each call (tests/test_api_ray.py). One process, not one each: a Python, its
#: imports and a private Ray's start fewer (the plan of the first part is the second's first
#: call, as the process's first call of no Ray).
API_SCRIPT = """
import json, os, signal, sys, threading, time
signal.signal(signal.SIGINT, signal.default_int_handler)
import psutil
import embgeom_ray as eg

model, corpus = sys.argv[1], sys.argv[2]
me, found = psutil.Process(), {}
sigterm = signal.getsignal(signal.SIGTERM)

def processes():  # Ray's processes this process started, once they had time to end
    for _ in range(100):
        left = [p.pid for p in me.children(recursive=True) if p.is_running()]
        if not left:
            break
        time.sleep(0.1)
    return left

def after(name):
    import ray
    found[name] = {"initialised": ray.is_initialized(), "processes": processes(),
                   "auth_mode": os.environ.get("RAY_AUTH_MODE"),
                   "breakpoint": os.environ.get("PYTHONBREAKPOINT"),
                   "sigterm": signal.getsignal(signal.SIGTERM) == sigterm}

# test_api_progress: every line to echo; echo=None prints nothing (no Ray in the process:
# each call starts a private one, and stops it)
quick = {"max_length": 32, "sample_size": 64, "no_report": True}
lines = []
run = eg.analyze(model=model, corpus=corpus, out="runs/a", echo=lines.append, **quick)
planned = eg.plan(model=model, corpus=corpus, out="runs/planned", echo=None, **quick)
json.dump({"lines": lines, "status": run.manifest.status,
           "workers": planned["extractors"]["num_workers"]}, open("result.json", "w"))

# test_api_ray: the plan above started a private Ray and stopped it
import ray
found["workers"] = planned["extractors"]["num_workers"]
after("plan")
args = dict(model=model, corpus=corpus, out="runs/plans", max_length=32, echo=None)

# Ctrl-C while the private Ray starts: the caller's KeyboardInterrupt, nothing left running
ray_init = ray.init
def interrupted_init(*a, **k):
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    return ray_init(*a, **k)
ray.init = interrupted_init
try:
    eg.plan(**args)
    found["raised"] = None
except KeyboardInterrupt:
    found["raised"] = "KeyboardInterrupt"
ray.init = ray_init
after("interrupted")

# the caller's own Ray: used, left up and usable; another address refused
ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
gcs = ray.get_runtime_context().gcs_address
eg.plan(**args)
try:
    eg.plan(**args, address="127.0.0.1:1")
except eg.ConfigError as error:
    found["refused"] = str(error).replace(gcs, "GCS")
found["callers"] = {"same": ray.get_runtime_context().gcs_address == gcs,
                    "answers": ray.get(ray.remote(lambda: 41).remote()) + 1}
ray.shutdown()
json.dump(found, open("found.json", "w"))
"""
API_SCRIPT_RUN = "api-script"


def make_api_script(directory: Path, model_dir: str) -> None:
    """:data:`API_SCRIPT` over eight short sentences, in ``directory`` with a private
    ``TMPDIR`` under /tmp (Ray's socket paths stay short; its processes killed after): its
    ``result.json`` and ``found.json``, and ``done.json``: the process's return code, stdout
    and stderr (read by the tests, which say what they expect of them)."""
    import subprocess
    import sys
    import tempfile

    from tests.conftest import SHORT_DOCS, write_jsonl
    from tests.ray_processes import kill_marked
    from tests.test_api_ray import script_env

    corpus = write_jsonl(directory / "short.jsonl", SHORT_DOCS)
    private = Path(tempfile.mkdtemp(prefix="egt-", dir="/tmp"))
    try:
        done = subprocess.run([sys.executable, "-c", API_SCRIPT, model_dir, corpus],
                              cwd=directory, env=script_env(TMPDIR=str(private)), capture_output=True,
                              text=True, timeout=540)  # fmt: skip
    finally:
        kill_marked([str(private)])
        shutil.rmtree(private, ignore_errors=True)
    printed = {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
    (directory / "done.json").write_text(json.dumps(printed))


#: each shared run's maker, by name: ``make(directory, model_dir)``
MAKERS: dict[str, Callable[[Path, str], None]] = {
    MINILM_ENGLISH: make_minilm_english,
    MINILM_SAMPLE: make_minilm_sample,
    API_SCRIPT_RUN: make_api_script,
}
