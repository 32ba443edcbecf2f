"""The store lock's whole cycle on one object store, as both stores' tests run it
(tests/runs/test_object_storage.py on S3, tests/runs/test_gcs_lock.py on GCS)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest

from embgeom_ray.runs import object_lock
from embgeom_ray.runs.lock_holder import HOLDER, StoreBusyError, this_holder
from embgeom_ray.runs.store_lock import store_lock


def assert_lock_cycle(fs: Any, store: str, monkeypatch, capsys) -> None:
    """On ``store`` (its filesystem ``fs``, the lock ``STORE/reanalyze.lock.json``): a second
    invocation is refused (exit status 75) with its holder and when it was last renewed; a
    lock let go is gone; a stale lock (its holder's pid gone on this host, or not renewed for
    STALE_S) is taken over and said; another node's is refused and left; a held lock is
    renewed without a word; a holder whose lock was taken says so and leaves the new
    holder's lock in place."""
    key = f"{fs._strip_protocol(store)}/{HOLDER}"

    def holder() -> dict:
        fs.invalidate_cache()
        return json.loads(fs.cat_file(key)) if fs.exists(key) else {}

    with store_lock(store):
        assert holder()["pid"] == os.getpid()
        with pytest.raises(StoreBusyError, match=rf"\(pid {os.getpid()} on ") as busy:
            with store_lock(store):
                pass
        assert busy.value.exit_code == 75
        assert "its lock last renewed" in str(busy.value)  # the store's last-written time
    assert holder() == {}  # let go
    fs.pipe_file(key, json.dumps({**this_holder(), "pid": 2**22 + 1}).encode())
    with store_lock(store):  # its holder is gone (this host's pids): taken over at once
        assert holder()["pid"] == os.getpid()
    assert "the stale lock on the store" in capsys.readouterr().err
    assert holder() == {}
    elsewhere = {"host": "another-node", "pid": 1, "started_at": "now"}
    fs.pipe_file(key, json.dumps(elsewhere).encode())
    with pytest.raises(StoreBusyError, match=r"\(pid 1 on another-node, since now\)"):
        with store_lock(store):
            pass
    assert holder() == elsewhere  # a refused invocation leaves it
    monkeypatch.setattr(object_lock, "STALE_S", -60.0)  # every lock is old
    monkeypatch.setattr(object_lock, "RENEW_S", 0.05)
    with store_lock(store):
        assert holder()["pid"] == os.getpid()
        time.sleep(0.3)  # renewed: a new version each time, still this one's
        assert holder()["pid"] == os.getpid()
        assert "could not be renewed" not in capsys.readouterr().err
        fs.pipe_file(key, json.dumps(elsewhere).encode())  # taken over by another
        time.sleep(0.5)
    assert "could not be renewed: it is no longer this invocation's" in capsys.readouterr().err
    assert holder() == elsewhere  # not removed by the holder whose lock was taken
    fs.rm_file(key)
