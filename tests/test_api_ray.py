"""The Python API leaves Ray as it found it (``embgeom_ray.distributed.cluster.leave_ray_as_found``):
a call that started a private local Ray (or joined a cluster) shuts it down before it returns,
raises or is interrupted, and puts back what ``ray.init`` changed in the process (``RAY_*`` and
``PYTHONBREAKPOINT``, the SIGTERM handler); a Ray the caller initialised is used and left up,
and an ``address`` naming another Ray is refused, not ignored. Ctrl-C during a call is the
caller's ``KeyboardInterrupt``, never the end of the process (a notebook's kernel): while Ray
starts it is held until the start is done; while joining a cluster the process ends only where
Ray's native join loop keeps the main thread past ``INTERRUPT_GRACE_S``.

The signal tests run in a fresh process each (a command's guard would end the test's own
process); the end-to-end one in a fresh process with a private ``TMPDIR``, as a user's script."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from embgeom_ray.distributed import cluster

REPO = Path(__file__).resolve().parents[1]


def script_env(**extra: str) -> dict[str, str]:
    """The environment of a user's fresh script: none of what a ``ray.init`` in this test
    process (the session's Ray) set in it, which the script would inherit as its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PYTHONBREAKPOINT"))}
    return env | {
        "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra,
    }  # fmt: skip


# ------------------------------------------------------------------ what a call puts back


class FakeRay(SimpleNamespace):
    """``ray`` as :func:`~embgeom_ray.distributed.cluster.leave_ray_as_found` sees it."""

    def is_initialized(self) -> bool:
        return self.up

    def shutdown(self) -> None:
        self.shutdowns += 1
        self.up = False


def test_a_call_shuts_down_the_ray_it_started_and_puts_back_what_ray_init_changed(
    monkeypatch,
) -> None:
    fake = FakeRay(up=False, shutdowns=0)
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("PYTHONBREAKPOINT", raising=False)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="the job failed"):
        with cluster.leave_ray_as_found():
            # what ray.init does to the process
            fake.up = True
            os.environ |= {"RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "1",
                           "PYTHONBREAKPOINT": "ray.util.rpdb._driver_set_trace"}  # fmt: skip
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(15))
            assert cluster._embedded == 1
            raise RuntimeError("the job failed")
    assert fake.shutdowns == 1 and not fake.up
    assert "RAY_AUTH_MODE" not in os.environ and "PYTHONBREAKPOINT" not in os.environ
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0"
    assert signal.getsignal(signal.SIGTERM) == before
    assert cluster._embedded == 0


def test_a_call_leaves_the_callers_ray_up(monkeypatch) -> None:
    fake = FakeRay(up=True, shutdowns=0)
    monkeypatch.setitem(sys.modules, "ray", fake)
    with cluster.leave_ray_as_found():
        pass
    assert fake.shutdowns == 0 and fake.up


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("10.0.0.5:6379", "10.0.0.5:6379", True),
        ("10.0.0.5:6379", "10.0.0.5:6380", False),  # another port: another Ray
        ("10.0.0.5:6379", "10.0.0.6:6379", False),
        ("127.0.0.1:6379", "10.0.0.5:6379", True),  # loopback: given the benefit of the doubt
        ("localhost:41000", "127.0.0.1:41000", True),
        ("127.0.0.1:1", "192.0.2.2:38829", False),
    ],
)
def test_same_gcs(a: str, b: str, same: bool) -> None:
    assert cluster.same_gcs(a, b) is same


def test_an_address_naming_another_ray_than_the_callers_is_refused(monkeypatch) -> None:
    """Ray initialised by the caller (``ray.init()`` before the call): the job runs there, so
    an explicit ``address`` naming another Ray is refused (it was ignored: the job ran on the
    caller's Ray); the same one, or none, is taken."""
    from embgeom_ray.errors import ConfigError

    monkeypatch.setattr(cluster, "_gcs_address", lambda: "192.0.2.2:38829")
    with pytest.raises(ConfigError) as err:
        cluster._check_initialised_ray(cluster.ClusterChoice("127.0.0.1:1", "--address"))
    assert str(err.value) == (
        "Ray is already initialised in this process (its GCS at 192.0.2.2:38829) and --address "
        "127.0.0.1:1 names another Ray: leave the address out to run on the initialised one, "
        "or call ray.shutdown() first"
    )
    for same in (cluster.ClusterChoice("192.0.2.2:38829", "--address"),
                 cluster.ClusterChoice(None, "default")):  # fmt: skip
        assert cluster._check_initialised_ray(same) is None


def test_a_ray_the_call_joined_is_forgotten_with_it(monkeypatch) -> None:
    """A call that joined a cluster (or started a private Ray) forgets its address when it
    shuts that Ray down: the caller's own ``ray.init()`` of that cluster later is the
    caller's Ray, and an ``address`` naming another is refused (it was taken as the job's own
    connection, so the address was ignored and the job ran on the caller's Ray)."""
    from embgeom_ray.errors import ConfigError

    fake = FakeRay(up=False, shutdowns=0)
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr(cluster, "_joined_gcs", None)
    monkeypatch.setattr(cluster, "_private_gcs", None)
    with cluster.leave_ray_as_found():
        fake.up = True  # connect() joined the cluster at 192.0.2.2:6379
        cluster._joined_gcs = cluster._private_gcs = "192.0.2.2:6379"
    assert fake.shutdowns == 1
    assert cluster._joined_gcs is None and cluster._private_gcs is None
    # the caller then initialises Ray on that cluster, and names another in the next call
    monkeypatch.setattr(cluster, "_gcs_address", lambda: "192.0.2.2:6379")
    with pytest.raises(ConfigError, match=r"its GCS at 192\.0\.2\.2:6379\) and --address"):
        cluster._check_initialised_ray(cluster.ClusterChoice("127.0.0.1:1", "--address"))


# ------------------------------------------------------------------ Ctrl-C while connecting

GUARD_SCRIPT = """
    import os, signal, sys, threading, time
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a foreground terminal
    from embgeom_ray.distributed.cluster import (
        _ConnectGuard, _interrupt_after_start, leave_ray_as_found)

    mode = sys.argv[1]
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    try:
        with leave_ray_as_found():
            if mode == "held":  # a private local Ray starting: 2 s of ray.init
                with _ConnectGuard("starting", holds_interrupt=True).active(), \\
                        _interrupt_after_start():
                    time.sleep(2.0)
                    print("STARTED", round(time.monotonic() - t0, 1), flush=True)
            else:  # joining a cluster: Python code, or native code that ignores the signal
                with _ConnectGuard("connecting to the Ray cluster at H:1").active():
                    if mode == "stuck":
                        signal.signal(signal.SIGINT, lambda *_: None)
                    time.sleep(30)
        print("NOT INTERRUPTED", flush=True)
    except KeyboardInterrupt:
        print("KeyboardInterrupt", round(time.monotonic() - t0, 1), flush=True)
    print("ALIVE", flush=True)
"""


def _guarded(mode: str) -> subprocess.CompletedProcess:
    script = textwrap.dedent(GUARD_SCRIPT)
    return subprocess.run([sys.executable, "-c", script, mode], env=script_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_ctrl_c_while_joining_is_the_callers_keyboard_interrupt() -> None:
    done = _guarded("python")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    assert lines[0].startswith("KeyboardInterrupt ") and float(lines[0].split()[1]) < 2.0
    assert lines[1] == "ALIVE" and done.stderr == ""


def test_ctrl_c_while_the_private_ray_starts_is_held_until_it_has_started() -> None:
    done = _guarded("held")
    assert done.returncode == 0, done.stderr
    started, interrupted, alive = done.stdout.split("\n")[:3]
    assert started.startswith("STARTED ") and float(started.split()[1]) >= 2.0
    assert interrupted.startswith("KeyboardInterrupt ") and alive == "ALIVE"


def test_ctrl_c_in_a_join_stuck_in_native_code_ends_the_process_after_the_grace() -> None:
    t0 = time.monotonic()
    done = _guarded("stuck")
    elapsed = time.monotonic() - t0
    assert done.returncode == 130, (done.stdout, done.stderr)
    assert done.stdout == "" and elapsed < 20
    assert done.stderr.splitlines()[-1] == (
        "error: interrupted by SIGINT while connecting to the Ray cluster at H:1 (Ray did not "
        f"return within {cluster.INTERRUPT_GRACE_S:g} s)"
    )


# ------------------------------------------------------------------ a user's script, end to end

@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_script_finds_ray_as_it_left_it(api_script_run) -> None:
    """The second part of the session's shared script of the Python API, a fresh process with a
    private ``TMPDIR`` (tests/shared_runs.py: ``API_SCRIPT``; its first part, the test of
    tests/test_api_progress.py, ends with a plan on no Ray: that plan's private Ray is the
    first checked here)."""
    done = json.loads((api_script_run / "done.json").read_text())
    assert done["returncode"] == 0, done["stderr"][-3000:]
    found = json.loads((api_script_run / "found.json").read_text())
    assert found["workers"] >= 1
    left_alone = {"initialised": False, "processes": [], "auth_mode": None, "breakpoint": None,
                  "sigterm": True}  # fmt: skip
    assert found["plan"] == left_alone
    assert found["raised"] == "KeyboardInterrupt"
    assert found["interrupted"] == left_alone
    assert found["refused"] == (
        "Ray is already initialised in this process (its GCS at GCS) and --address 127.0.0.1:1 "
        "names another Ray: leave the address out to run on the initialised one, or call "
        "ray.shutdown() first"
    )
    assert found["callers"] == {"same": True, "answers": 42}
