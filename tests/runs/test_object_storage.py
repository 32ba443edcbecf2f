"""Object storage and several nodes, tested as deployed: a real S3 API on loopback (moto's
server mode, ``moto_server``, on a free port), the corpus and the runs in a bucket there.

- a run, a resume after its driver was killed (SIGKILL), and the merge of two runs, all in the
  bucket, as users run them on a cluster (the killed run ``python -m jobs.analyze`` in a fresh
  process joining the simulated cluster below through ``RAY_ADDRESS``; the resume, the second
  run and the merge through their commands' ``main`` in the test's process, connected to it):
  the merge's tables equal one run's over the whole corpus;
- reducers on two nodes of a simulated cluster, each reading the checkpoint groups from the
  bucket; the self-sized defaults on the same cluster give the same tables (that run over the
  whole corpus is the one the merge above is compared with: one job for both tests);
- storage faults are user errors: an endpoint that answers nothing, refused credentials, a
  missing bucket (for the corpus, and for the run, which is not created) and a run directory
  the job cannot write to each end in one line naming the URL (and the endpoint), exit 2
  (the first through the command in a fresh process, the others through its ``main``).

The jobs' sample has 16 points, fewer than the sampled metrics need
(:data:`~embgeom_ray.core.tables.MIN_SAMPLE_POINTS`): it is drawn, written to the bucket and
merged from it, but no K-means/LID task runs (those are tested in tests/core/test_sampled_metrics.py,
tests/runs/test_job_end_to_end.py and tests/runs/test_merge_runs.py); the tables compared here
are the exact ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest

from embgeom_ray.errors import StorageError
from embgeom_ray.runs.lock_objects import S3Objects
from embgeom_ray.storage import endpoint_of, probe
from tests.object_store import S3, moto_server, s3_env
from tests.ray_processes import free_ports

REPO = Path(__file__).resolve().parents[2]
BUCKET = "embgeom"
#: options of every job here: small and quick (tables compared, not figures; a sample below
#: MIN_SAMPLE_POINTS: stored and merged, no sampled-metrics tasks)
SAMPLE = 16
QUICK = ["--max-length", "32", "--sample-size", str(SAMPLE), "--kmeans-k-max", "3", "--no-report",
         "--comoment-precision", "float64",
         "--shard-bytes", "1024", "--checkpoint-interval", "0"]  # fmt: skip
TABLES = {"type_stats": ["layer", "token_id"], "layers": ["layer"], "dims": ["layer", "dim"],
          "positions": ["layer", "position"]}  # fmt: skip


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> Iterator[S3]:
    with moto_server(tmp_path_factory.mktemp("moto") / "moto.log") as endpoint:
        store = S3(endpoint, s3_env(endpoint))
        store.fs().mkdir(BUCKET)
        yield store


@pytest.fixture(scope="module")
def corpus(s3, tmp_path_factory) -> dict[str, object]:
    """Two halves of an English corpus in the bucket, the whole being the folder that holds
    them (so its shards, and their batches, are the halves'); a tiny BERT."""
    from tests.runs.test_job_end_to_end import english_documents
    from tests.tiny_models import make_tiny_bert

    docs = english_documents(40, 400)
    fs = s3.fs()
    for name, part in (("a", docs[:20]), ("b", docs[20:])):
        fs.pipe(f"{BUCKET}/corpus/{name}.jsonl",
                "".join(json.dumps({"text": t}) + "\n" for t in part).encode())  # fmt: skip
    model = make_tiny_bert(str(tmp_path_factory.mktemp("model") / "bert"))
    return {"model": model, "url": f"s3://{BUCKET}/corpus"}


def read_tables(s3: S3, url: str) -> dict[str, pd.DataFrame]:
    fs = s3.fs()
    out = {}
    for name, keys in TABLES.items():
        with fs.open(f"{url.removeprefix('s3://')}/{name}.parquet", "rb") as f:
            out[name] = pd.read_parquet(f).sort_values(keys).reset_index(drop=True)
    return out


def assert_same_tables(got: dict, want: dict) -> None:
    for name in TABLES:
        pd.testing.assert_frame_equal(got[name], want[name], check_exact=False, rtol=1e-9,
                                      atol=1e-12, obj=name)  # fmt: skip


def manifest(s3: S3, url: str) -> dict:
    return json.loads(s3.fs().cat(f"{url.removeprefix('s3://')}/manifest.json"))


@pytest.fixture(scope="module")
def on_cluster(s3, corpus) -> Iterator[dict[str, object]]:
    """A simulated cluster of a head and two 1-CPU nodes (their processes inherit the bucket's
    endpoint) and, on it, two runs over the whole corpus in the bucket: ``--reducers 2``
    (``two``) and the self-sized defaults (``whole``); their manifests, the worker nodes and
    the cluster's address. The cluster stays up, this process connected to it, for the
    module's tests (the killed run and its resume run on it: a private Ray each took ~6 s of
    CPU to start), and is shut down at the module's end."""
    import ray
    import s3fs
    from ray.cluster_utils import Cluster

    from embgeom_ray.config import build_config
    from embgeom_ray.runs.pipeline import analyze

    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3.env.items():
            mp.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()  # the job's filesystem: this endpoint
        if ray.is_initialized():
            ray.shutdown()
        (port,) = free_ports(1)
        GiB = 2**30
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "memory": 2 * GiB, "gcs_server_port": port, "include_dashboard": False})  # fmt: skip
        nodes = [cluster.add_node(num_cpus=1, memory=3 * GiB) for _ in range(2)]
        try:
            ray.init(address=cluster.address, log_to_driver=False)
            cluster.wait_for_nodes()
            base = {"model": corpus["model"], "corpus": corpus["url"], "max_length": 32,
                    "sample_size": SAMPLE, "kmeans_k_max": 3, "no_report": True,
                    "shard_bytes": 1024, "checkpoint_interval": 0, "device": "cpu",
                    "comoment_precision": "float64"}  # fmt: skip
            out = f"s3://{BUCKET}/cluster"
            two = analyze(build_config(None, base | {"out": f"{out}/two", "reducers": 2}),
                          echo=lambda *_: None)  # fmt: skip
            whole = analyze(build_config(None, base | {"out": f"{out}/whole"}),
                            echo=lambda *_: None)  # fmt: skip
            workers = {n.node_id for n in nodes}
        except BaseException:
            ray.shutdown()
            cluster.shutdown()
            raise
        finally:
            s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield {"two": two, "whole": whole, "workers": workers, "address": cluster.address,
               "two_url": f"{out}/two", "whole_url": f"{out}/whole"}  # fmt: skip
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.slow
@pytest.mark.own_ray_cluster
@pytest.mark.timeout(1200)
def test_reducers_on_two_nodes_read_the_groups_from_the_bucket(s3, on_cluster):
    """A simulated cluster of a head and two 1-CPU nodes (their processes inherit the
    bucket's endpoint): ``--reducers 2`` places one reducer on each worker node, each reading
    every checkpoint group from the bucket; the self-sized defaults give the same tables."""
    two = on_cluster["two"]
    groups = two["shards"]["checkpoint_groups"]
    assert groups > 1 and two["reducers"]["sources_read"] == [groups, groups]
    assert set(two["reducers"]["nodes"]) == on_cluster["workers"]  # one on each worker node
    assert two["workers"]["num_workers"] == 2
    default = on_cluster["whole"]
    assert default["status"] == "complete" and "sizing" in default
    assert_same_tables(read_tables(s3, on_cluster["two_url"]),
                       read_tables(s3, on_cluster["whole_url"]))  # fmt: skip


@pytest.mark.slow
@pytest.mark.own_ray_cluster
@pytest.mark.timeout(1200)
def test_a_run_a_resume_and_a_merge_in_a_bucket(s3, corpus, on_cluster, tmp_path, monkeypatch,
                                                capsys):  # fmt: skip
    """Run a, in a fresh process joining the simulated cluster (:func:`on_cluster`), its
    driver killed, then resumed; and run b; their merge equals the run over the whole corpus
    (the self-sized one on that cluster). The resume, run b and the merge run through their
    commands' ``main`` in this process (the environment pointing at the bucket), connected to
    the same cluster: a fresh process for b beside a's took ~15 s more of the suite's CPU (a
    process's imports, a Ray's start) for the same writes to the bucket, and each private Ray
    of a and of the resume ~6 s."""
    model, url = corpus["model"], corpus["url"]
    runs = f"s3://{BUCKET}/runs"
    whole = manifest(s3, on_cluster["whole_url"])
    assert whole["status"] == "complete" and whole["sizing"]["reduce"]["count"] == 0
    # in the bucket, the extractors (on both nodes) wrote their own groups: the job's process
    # committed them, and measured each writer's bytes and seconds
    checkpoints = whole["sizing"]["checkpoints"]
    assert checkpoints["writers"] == "extractors" and checkpoints["flushes"] >= 2
    assert checkpoints["bytes_written"] > 0 and 0 < checkpoints["write_share"] < 1
    env = os.environ | s3.env | {"PYTHONPATH": str(REPO), "RAY_ADDRESS": on_cluster["address"]}
    # run a: its driver killed once two checkpoint groups are in the bucket, then resumed
    argv = ["--model", model, "--corpus", f"{url}/a.jsonl", "--out", f"{runs}/a", *QUICK,
            "--num-workers", "1"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "jobs.analyze", *argv], cwd=REPO,
                            env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        fs = s3.fs()
        deadline = time.monotonic() + 400
        groups: list[str] = []
        while proc.poll() is None and time.monotonic() < deadline:
            fs.invalidate_cache()
            with contextlib.suppress(FileNotFoundError):
                groups = [p for p in fs.ls(f"{BUCKET}/runs/a/groups") if p.endswith("-n1.json")]
            if len(groups) >= 2:
                break
            time.sleep(0.3)
        assert len(groups) >= 2, "the run did not checkpoint two groups"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver (the cluster ends its actors)
        proc.wait(timeout=30)
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    import s3fs

    from jobs import analyze, merge

    s3fs.S3FileSystem.clear_instance_cache()  # the jobs' filesystem: this endpoint
    capsys.readouterr()
    status = analyze.main(argv)
    resumed = capsys.readouterr()
    assert status == 0, resumed.err[-3000:]
    assert "resuming" in resumed.out
    a = manifest(s3, f"{runs}/a")
    assert a["shards"]["reused_from_checkpoints"] >= 2
    shards = a["shards"]
    assert shards["reused_from_checkpoints"] + shards["computed"] == shards["total"]
    # run b, on the same cluster
    status = analyze.main(["--model", model, "--corpus", f"{url}/b.jsonl", "--out", f"{runs}/b",
                           *QUICK])  # fmt: skip
    assert status == 0, capsys.readouterr().err[-3000:]
    assert manifest(s3, f"{runs}/b")["status"] == "complete"
    # the merge of a (resumed) and b, in the bucket, is the run over the whole corpus
    status = merge.main(["--out", f"{runs}/ab", f"{runs}/a", f"{runs}/b"])
    assert status == 0, capsys.readouterr().err[-3000:]
    ab = manifest(s3, f"{runs}/ab")
    assert ab["counts"]["tokens"] == whole["counts"]["tokens"]
    assert ab["sizing"]["reduce"]["types"] == whole["sizing"]["reduce"]["types"]
    got, want = read_tables(s3, f"{runs}/ab"), read_tables(s3, on_cluster["whole_url"])
    for name in ("type_stats", "dims", "positions"):
        pd.testing.assert_frame_equal(got[name], want[name], check_exact=False, rtol=1e-9,
                                      atol=1e-12, obj=name)  # fmt: skip
    exact = ["layer", "n_tokens", "n_types", "mean_norm", "total_variance", "within_ratio",
             "anisotropy", "s_inter", "s_intra"]  # fmt: skip
    pd.testing.assert_frame_equal(got["layers"][exact], want["layers"][exact],
                                  check_exact=False, rtol=1e-9, atol=1e-12)  # fmt: skip
    # the runs' samples, merged from the bucket (bottom-k): as many points as the whole run's
    assert ab["sample"]["uniform_points"] == whole["sample"]["uniform_points"] == SAMPLE


def test_probe_names_an_endpoint_nobody_listens_on(monkeypatch):
    (port,) = free_ports(1)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    try:
        with pytest.raises(StorageError, match=f"at http://127.0.0.1:{port} for the corpus s3://b/c"):
            probe("s3://b/c.jsonl", "corpus")
        probe("/a/local/path", "corpus")  # nothing to probe
    finally:
        s3fs.S3FileSystem.clear_instance_cache()  # the next test's endpoint is another
    # gs:// against an emulator (gcsfs's STORAGE_EMULATOR_HOST): Google's endpoint was probed
    for host in (f"127.0.0.1:{port}", f"http://127.0.0.1:{port}"):
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", host)
        with pytest.raises(StorageError, match=f"at http://127.0.0.1:{port} for the store gs://b/s"):
            probe("gs://b/s", "store")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "default")  # gcsfs: Google's
    assert endpoint_of("gs://b/s") == "https://storage.googleapis.com"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_storage_faults_end_in_one_line(s3, corpus, tmp_path, monkeypatch, capsys):
    """Each fault: exit status 2, one line on stderr naming the URL (and the endpoint), no
    traceback, within a bounded time. The first through ``python -m jobs.analyze`` in a fresh
    process (the command's exit status and stderr as a user sees them); the others through
    the same command's ``main`` in this process (its status and stderr: what the command
    exits with and prints), sparing a process start each."""
    import s3fs

    from jobs.analyze import main

    model, url = corpus["model"], corpus["url"]

    def refused(argv: list[str], env: dict[str, str], *names: str, fresh: bool = False) -> None:
        argv = ["--model", model, "--max-length", "32", *argv]
        t0 = time.monotonic()
        if fresh:
            done = subprocess.run([sys.executable, "-m", "jobs.analyze", *argv],
                                  cwd=REPO, env=os.environ | env | {"PYTHONPATH": str(REPO)},
                                  capture_output=True, text=True, timeout=300)  # fmt: skip
            status, stderr = done.returncode, done.stderr
        else:
            with monkeypatch.context() as mp:
                for key, value in env.items():
                    mp.setenv(key, value)
                s3fs.S3FileSystem.clear_instance_cache()  # this fault's endpoint
                capsys.readouterr()
                try:
                    status = main(argv)
                finally:
                    s3fs.S3FileSystem.clear_instance_cache()
                stderr = capsys.readouterr().err
        assert time.monotonic() - t0 < 120
        assert status == 2, stderr[-3000:]
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert "Traceback" not in stderr and lines[-1].startswith("error: "), stderr
        for name in names:
            assert name in lines[-1], (name, lines[-1])

    out = str(tmp_path / "run")
    # an endpoint that answers nothing
    (port,) = free_ports(1)
    dead = s3_env(f"http://127.0.0.1:{port}")
    refused(["--corpus", f"{url}/a.jsonl", "--out", out], dead, f"{url}/a.jsonl",
            f"http://127.0.0.1:{port}", "cannot reach", fresh=True)  # fmt: skip
    # a missing bucket: for the corpus, and for the run (never created)
    refused(["--corpus", "s3://no-such-bucket/a.jsonl", "--out", out], s3.env,
            "s3://no-such-bucket/a.jsonl", "no such bucket")  # fmt: skip
    refused(["--corpus", f"{url}/a.jsonl", "--out", "s3://no-such-bucket/run"], s3.env,
            "s3://no-such-bucket/run", "no such bucket", s3.endpoint)  # fmt: skip
    assert "no-such-bucket" not in s3.fs().ls("")
    # a run directory the job cannot write to (below a regular file: even root cannot)
    (tmp_path / "file").write_text("not a directory")
    refused(["--corpus", f"{url}/a.jsonl", "--out", str(tmp_path / "file" / "run")], s3.env,
            str(tmp_path / "file" / "run"), "cannot write")  # fmt: skip
    # credentials the store refuses (a server that checks them)
    with moto_server(tmp_path / "moto-auth.log", INITIAL_NO_AUTH_ACTION_COUNT="0") as endpoint:
        refused(["--corpus", f"s3://{BUCKET}/a.jsonl", "--out", out], s3_env(endpoint),
                f"s3://{BUCKET}/a.jsonl", endpoint, "refused access")  # fmt: skip


@pytest.mark.slow
def test_overwrite_in_a_bucket_keeps_the_users_objects(s3, monkeypatch):
    """``--overwrite`` (``RunDir.clear``) in a bucket whose ``--out`` prefix has the marker
    object a console's "Create folder" makes (``exp/statistics/``): the listing names that
    marker as an entry of the directory, by the directory's own name, a run's entry
    (``statistics``): never removed, nor the user's objects with it."""
    from embgeom_ray.run_dir import RunDir

    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    fs = s3.fs()
    prefix = f"{BUCKET}/exp/statistics"
    fs.pipe({f"{prefix}/": b"", f"{prefix}/my-notes.txt": b"mine",
             f"{prefix}/manifest.json": b"{}", f"{prefix}/plots/a.png": b"png"})  # fmt: skip
    assert sorted(RunDir(f"s3://{prefix}").clear()) == ["manifest.json", "plots"]
    fs.invalidate_cache()
    assert fs.cat(f"{prefix}/my-notes.txt") == b"mine"
    assert not fs.exists(f"{prefix}/manifest.json")


def test_a_stopped_retable_checks_its_artefact_in_a_bucket(s3, monkeypatch):
    """What lets a stopped re-tabulation start again from the statistics artefact
    (``RunDir.statistics_intact``) reads it from the bucket and holds only while every byte
    matches the digest recorded when it was written: a flipped bit, or none recorded, no."""
    from embgeom_ray.integrity import Digest
    from embgeom_ray.run_dir import RunDir

    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    fs = s3.fs()
    url = f"s3://{BUCKET}/retabled"
    data = bytes(range(256)) * 4096  # 1 MiB: one block
    fs.pipe(f"{BUCKET}/retabled/statistics.safetensors", data)
    recorded = {"statistics.safetensors": Digest.of(data)}
    assert RunDir(url, recorded).statistics_intact()
    assert not RunDir(url).statistics_intact()  # no manifest: no digest to check it against
    fs.pipe(f"{BUCKET}/retabled/statistics.safetensors", data[:-1] + bytes([data[-1] ^ 1]))
    fs.invalidate_cache()
    assert not RunDir(url, recorded).statistics_intact()


@pytest.mark.slow
def test_reanalyze_locks_an_s3_store(s3, monkeypatch, capsys):
    """An S3 store had no lock: two invocations at once wrote one run directory and the
    index together. Now ``reanalyze.lock.json`` is written only where absent (If-None-Match),
    renewed and taken over on the condition of its ETag: the whole cycle
    (:func:`tests.runs.lock_cycle.assert_lock_cycle`; its last-renewed time is S3's
    ``LastModified``)."""
    from tests.runs.lock_cycle import assert_lock_cycle

    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    assert_lock_cycle(s3.fs(), f"s3://{BUCKET}/lock-store", monkeypatch, capsys)


@pytest.mark.slow
def test_a_lock_taken_over_while_its_holder_lets_go_stays(s3, monkeypatch):
    """Two holders against the S3 API: A's lock went stale and B takes it over just after A's
    release read the lock's ETag (still A's). The release read the ETag, then removed the
    object: B's lock was removed, and a third invocation would have run beside B. Now the
    removal is one DeleteObject on the condition If-Match A's ETag, which the store refuses
    (412): B's lock stays, and B's own release removes it."""
    from embgeom_ray.runs import object_lock

    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    fs = s3.fs()
    store, path = f"s3://{BUCKET}/race-store", f"{BUCKET}/race-store/reanalyze.lock.json"
    a = object_lock._acquire(store, path, S3Objects(fs), b'{"host": "node-a", "pid": 1}')
    monkeypatch.setattr(object_lock, "STALE_S", -60.0)  # A's lock is old: B may take it
    taken: list[object] = []

    class TakenOverAfterTheCheck:
        """The store as A's release sees it: B takes the lock over after A read its ETag."""

        def __getattr__(self, name):
            return getattr(fs, name)

        def info(self, p):
            out = fs.info(p)
            if not taken:
                taken.append(object_lock._acquire(store, path, S3Objects(s3.fs()), b'{"host": "node-b", "pid": 2}'))
            return out

    a.store.fs = TakenOverAfterTheCheck()
    a.thread.start()
    a.release()
    (b,) = taken
    fs.invalidate_cache()
    assert json.loads(fs.cat_file(path)) == {"host": "node-b", "pid": 2}  # B's, not removed
    assert b.token != a.token and fs.info(path)["ETag"] == b.token
    assert not object_lock._remove(S3Objects(fs), path, a.token)  # A's ETag removes nothing
    b.thread.start()
    b.release()
    assert not fs.exists(path)


def test_a_store_that_ignores_conditional_writes_gets_no_lock(capsys):
    """A server that writes over an object despite If-None-Match: said in one line, no lock
    held, nothing left behind."""
    from embgeom_ray.runs.object_lock import _acquire

    class Ignoring:
        def __init__(self) -> None:
            self.objects: dict[str, bytes] = {}

        def pipe_file(self, path, data, **conditions):
            self.objects[path] = data
            return {"ETag": '"e"'}

        def rm_file(self, path):
            del self.objects[path]

    fs = Ignoring()
    assert _acquire("s3://b/store", "b/store/reanalyze.lock.json", S3Objects(fs), b"{}") is None
    assert fs.objects == {}
    assert "ignores conditional writes" in capsys.readouterr().err


class _PreconditionFailed(Exception):
    """botocore's ClientError as s3fs chains it for a 412 (``response``)."""

    def __init__(self) -> None:
        super().__init__("PreconditionFailed")
        self.response = {"Error": {"Code": "PreconditionFailed"},
                         "ResponseMetadata": {"HTTPStatusCode": 412}}  # fmt: skip


class _FlakyStore:
    """A lock's store whose renewals fail as scripted: ``outcomes`` of each ``pipe_file``,
    "ok", "down" (the endpoint unreachable) or "taken" (412: another writer's ETag)."""

    def __init__(self, outcomes: list[str], holder: bytes = b'{"pid": 1}') -> None:
        self.outcomes, self.calls, self.holder = outcomes, 0, holder

    def pipe_file(self, path, data, **conditions):
        outcome = self.outcomes[min(self.calls, len(self.outcomes) - 1)]
        self.calls += 1
        if outcome == "down":
            raise OSError("Could not connect to the endpoint URL")
        if outcome == "taken":
            raise OSError(22, "At least one of the pre-conditions") from _PreconditionFailed()
        return {"ETag": '"mine"'}

    def invalidate_cache(self, path=None):
        pass

    def info(self, path):
        return {"ETag": '"theirs"', "LastModified": None}

    def cat_file(self, path):
        return self.holder


def test_the_lock_is_still_renewed_after_a_failed_renewal(monkeypatch, capsys):
    """One renewal that failed (the store unreachable for a minute) ended the renewal thread,
    so 15 minutes later another invocation took over a lock whose holder still ran for hours.
    Now a failure is said once and the next renewal tried; a 412 (taken over) ends it."""
    from embgeom_ray.runs import object_lock

    monkeypatch.setattr(object_lock, "RENEW_S", 0.01)
    store = _FlakyStore(["down", "down", "ok", "ok", "ok"])
    held = object_lock._Held(S3Objects(store), "b/s/reanalyze.lock.json", b'{"pid": 2}', '"mine"')
    held.thread.start()
    deadline = time.monotonic() + 10
    while store.calls < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    held.stop.set()
    held.thread.join()
    assert store.calls >= 5  # renewed on after the two failures
    err = capsys.readouterr().err
    assert err.count("could not be renewed (OSError: Could not connect") == 1
    assert "is renewed again" in err

    taken = _FlakyStore(["taken", "ok"])  # another holder's body: given up at the 412
    held = object_lock._Held(S3Objects(taken), "b/s/reanalyze.lock.json", b'{"pid": 2}', '"mine"')
    held.thread.start()
    held.thread.join(timeout=10)
    assert not held.thread.is_alive() and taken.calls == 1
    assert "it is no longer this invocation's" in capsys.readouterr().err

    ours = _FlakyStore(["taken", "ok"], holder=b'{"pid": 2}')  # its answer was lost: ours
    held = object_lock._Held(S3Objects(ours), "b/s/reanalyze.lock.json", b'{"pid": 2}', '"old"')
    held.thread.start()
    while ours.calls < 2 and time.monotonic() < deadline + 10:
        time.sleep(0.01)
    held.stop.set()
    held.thread.join()
    assert ours.calls >= 2 and held.token == '"mine"'
    assert "could not be renewed" not in capsys.readouterr().err


def test_a_held_s3_lock_says_when_it_goes_stale():
    """A second invocation said only 'another reanalyze is running (pid 1 on node-a, …)',
    which a holder killed on another node also reads as: now it says when the lock was last
    renewed and that it is taken over after 15 minutes without a renewal."""
    from datetime import datetime, timedelta, timezone

    from embgeom_ray.runs.lock_holder import StoreBusyError
    from embgeom_ray.runs.object_lock import _acquire

    class Held:
        def pipe_file(self, path, data, **conditions):
            raise FileExistsError(path)

        def invalidate_cache(self, path=None):
            pass

        def info(self, path):
            return {"ETag": '"e"', "LastModified": datetime.now(timezone.utc) - timedelta(seconds=40)}

        def cat_file(self, path):
            return b'{"host": "node-a", "pid": 1, "started_at": "then"}'

    with pytest.raises(StoreBusyError) as busy:
        _acquire("s3://b/store", "b/store/reanalyze.lock.json", S3Objects(Held()), b"{}")
    assert "(pid 1 on node-a, since then); its lock last renewed 40 s ago, taken over once " \
        "15 minutes pass without a renewal: this one ran nothing" in str(busy.value)  # fmt: skip


@pytest.mark.skipif(not os.path.exists("/proc/self/ns/pid"), reason="Linux's PID namespaces")
def test_a_live_holder_of_this_hostname_in_another_pid_namespace_keeps_its_lock(tmp_path, monkeypatch):
    """A holder of this hostname whose pid is not alive here was taken over at once: two
    containers of ``--network host`` (or one ``--hostname``, or machines cloned with theirs)
    share a hostname, not their pids, so a second invocation took a live lock and two wrote
    one store. Now the holder records its PID namespace (boot id, /proc/self/ns/pid) and only
    a holder of this hostname, boot and namespace is taken over from its pid; another, or an
    older version's file without them, waits for STALE_S."""
    import socket
    from datetime import datetime, timedelta, timezone

    from embgeom_ray.runs import lock_holder
    from embgeom_ray.runs.lock_holder import StoreBusyError, this_holder
    from embgeom_ray.runs.object_lock import _acquire, is_stale

    recent = datetime.now(timezone.utc) - timedelta(seconds=40)
    old = datetime.now(timezone.utc) - timedelta(hours=1)
    # a live invocation in a container of --network host: its pid (above any pid_max) is
    # not one of this process's, its namespace another
    container = {"host": socket.gethostname(), "pid": 2**22 + 1, "started_at": "then",
                 "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
                 "pid_ns": "4:4026532999"}
    assert not is_stale(container, recent)  # was taken over at once
    gone = {**this_holder(), "pid": 2**22 + 1, "started_at": "then"}
    assert gone["boot_id"] and gone["pid_ns"]  # Linux: both read
    assert is_stale(gone, recent)  # this namespace, its pid gone: at once, as before
    clone = {**gone, "boot_id": "8c0b2f9e-0000-4000-8000-000000000000"}  # another machine
    older = {k: gone[k] for k in ("host", "pid", "started_at")}  # no namespace recorded
    for holder in (container, clone, older):
        assert not is_stale(holder, recent), holder
        assert is_stale(holder, old), holder  # STALE_S still applies

    class Held:
        """A store whose lock is ``holder``'s, renewed 40 s ago; a takeover is recorded."""

        def __init__(self, holder):
            self.holder, self.taken = holder, False

        def pipe_file(self, path, data, mode="overwrite", **conditions):
            if mode == "create":
                raise FileExistsError(path)
            self.taken = True
            return {"ETag": '"mine"'}

        def invalidate_cache(self, path=None):
            pass

        def info(self, path):
            return {"ETag": '"e"', "LastModified": recent}

        def cat_file(self, path):
            return json.dumps(self.holder).encode()

    host = gone["host"]
    for holder, said in ((container, "not a pid of this container or machine, whose hostname"),
                         (older, "its PID namespace not known, so perhaps not a pid of this")):
        store = Held(holder)
        with pytest.raises(StoreBusyError) as busy:
            _acquire("s3://b/store", "b/store/reanalyze.lock.json", S3Objects(store), b"{}")
        assert not store.taken
        assert f"(pid {2**22 + 1} on {host}, since then; {said}" in str(busy.value)
    assert _acquire("s3://b/store", "b/s/reanalyze.lock.json", S3Objects(Held(gone)), b"{}") is not None

    monkeypatch.setattr(lock_holder, "BOOT_ID", str(tmp_path / "no-boot-id"))  # macOS, no /proc
    unreadable = {**this_holder(), "pid": 2**22 + 1}
    assert (unreadable["boot_id"], unreadable["pid_ns"]) == (None, None)
    assert not is_stale(unreadable, recent) and is_stale(unreadable, old)
    assert not is_stale(container, recent)  # nor one that recorded its namespace
    assert "its PID namespace not known" in lock_holder.describe(container)


def test_an_object_store_without_a_lock_is_said_to_have_none(monkeypatch, capsys):
    """On an object store other than S3 and GCS (Azure's ``abfs://``, …) ``reanalyze`` took
    no lock and said nothing: two invocations at once wrote the same runs and index, silently.
    It still takes none, and now says so in one line; ``gs://`` is locked as ``s3://`` is."""
    from embgeom_ray.runs import store_lock as module
    from embgeom_ray.runs.object_lock import supported
    from embgeom_ray.runs.store_lock import store_lock

    with store_lock("memory://store"):
        pass
    assert "the store memory://store gets no lock (memory:// has none" in capsys.readouterr().err
    monkeypatch.setattr(module, "is_local", lambda store: False)  # adlfs not installed here
    with store_lock("abfs://container/store"):  # nothing is sent
        pass
    err = capsys.readouterr().err
    assert err == ("warning: the store abfs://container/store gets no lock (abfs:// has none: "
                   "only s3:// and gs:// do): another reanalyze on it at once is not kept off "
                   "and would write the same runs; the scheduler must not overlap invocations\n")
    assert all(map(supported, ("s3://b/s", "s3a://b/s", "gs://b/s", "gcs://b/s")))
    assert not supported("abfs://container/store")


def test_a_store_that_refuses_a_conditional_delete_still_lets_go_of_the_lock():
    """A server without conditional deletes that answers ``If-Match`` on a DeleteObject with
    501 Not Implemented (or 400) instead of ignoring it: the release's one conditional delete
    failed, the error was swallowed and the lock stayed, holding every other invocation off
    for 15 minutes (before, it read the ETag and removed the object). Now the lock, still this
    holder's by the ETag read first, is removed by a plain delete; a 412 (taken over) still
    removes nothing, and another error is raised as it was."""
    from botocore.exceptions import ClientError

    from embgeom_ray.runs.object_lock import _remove

    def answer(status, code):
        error = OSError(code)
        error.__cause__ = ClientError(
            {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "DeleteObject")
        return error

    class Store:
        def __init__(self, error):
            self.error, self.objects = error, {"b/store/reanalyze.lock.json": '"mine"'}

        def invalidate_cache(self, path=None):
            pass

        def info(self, path):
            return {"ETag": self.objects[path]}

        def split_path(self, path):
            return "b", path.split("/", 1)[1], None

        def call_s3(self, method, **kwargs):
            assert (method, kwargs["IfMatch"]) == ("delete_object", '"mine"')
            raise self.error

        def rm_file(self, path):
            del self.objects[path]

    path = "b/store/reanalyze.lock.json"
    for status, code in ((501, "NotImplemented"), (400, "InvalidArgument")):
        store = Store(answer(status, code))
        assert _remove(S3Objects(store), path, '"mine"') and store.objects == {}
    taken = Store(answer(412, "PreconditionFailed"))
    assert not _remove(S3Objects(taken), path, '"mine"') and path in taken.objects
    down = Store(answer(503, "ServiceUnavailable"))
    with pytest.raises(OSError, match="ServiceUnavailable"):
        _remove(S3Objects(down), path, '"mine"')
    assert path in down.objects
