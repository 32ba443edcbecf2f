"""How a command's process ends (:func:`embgeom_ray.cli.exit_process`): with the status given
and everything it printed or logged flushed, Python's finalisation skipped. (That a private
Ray is gone after a job's command: every test that runs one as a process, e.g.
tests/jobs/test_ray_submit.py and tests/project/test_wheel.py; a Ray's processes also end with
the process that started them, so a test of this process alone could not tell.)"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.ray_processes import kill_marked

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout buffered
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_the_status_and_what_was_written_are_kept(tmp_path) -> None:
    done = _run(
        """
        import logging, sys
        from embgeom_ray.cli import exit_process
        logging.basicConfig(filename="job.log", level=logging.INFO)
        logging.getLogger("job").info("logged last")
        sys.stdout.write("printed last, no newline")  # a pipe: block-buffered
        sys.stderr.write("error: one line")
        exit_process(5)
        """,
        tmp_path,
    )
    assert done.returncode == 5
    assert done.stdout == "printed last, no newline" and done.stderr == "error: one line"
    assert (tmp_path / "job.log").read_text() == "INFO:job:logged last\n"



def test_a_profiled_command_leaves_through_pythons_exit(tmp_path) -> None:
    """Under ``python -m cProfile -o FILE`` the profile, written once the script leaves, is kept
    (cProfile takes the script's SystemExit and ends with status 0 itself)."""
    script = tmp_path / "command.py"
    script.write_text("from embgeom_ray.cli import exit_process\nexit_process(4)\n")
    env = os.environ | {"PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "cProfile", "-o", "out.prof", str(script)],
                          cwd=tmp_path, env=env, capture_output=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and (tmp_path / "out.prof").stat().st_size > 0


#: a command's process (its entry point's ``exit_process(exit_status(run))``) whose ``run``
#: waits on a task that never ends, as a job's driver waits for its extractors; argv[1]:
#: ``wait``/``get`` (in ``ray.wait``/``ray.get`` on the private local Ray a command starts) or
#: ``sleep`` (in Python, before any Ray)
WAITING_COMMAND = """
    import sys, time
    from embgeom_ray.cli import exit_process, exit_status

    def run():
        if sys.argv[1] == "sleep":
            print("WAITING", flush=True)
            time.sleep(600)
        import ray
        from embgeom_ray.distributed.cluster import connect

        connect(None)
        ref = ray.remote(lambda: time.sleep(600)).remote()
        print("WAITING", flush=True)
        try:
            ray.wait([ref]) if sys.argv[1] == "wait" else ray.get(ref)
        except SystemExit as exc:  # what Ray made of the signal, for the test to read
            print(f"RAISED {exc.code}", flush=True)
            raise

    exit_process(exit_status(run))
"""


@pytest.mark.parametrize("where", [
    pytest.param("wait", marks=pytest.mark.slow), pytest.param("get", marks=pytest.mark.slow),
    "sleep",
])  # fmt: skip
def test_sigterm_while_the_driver_waits_on_ray_ends_with_one_line(where) -> None:
    """SIGTERM to a command's process while its driver waits in ``ray.wait``/``ray.get`` (a
    job's extraction, reduce, sampled stage): Ray 2.60's native wait takes the handler's
    ``SystemExit(15)`` and raises ``SystemExit(1)`` instead, which ended the process through
    Python's exit with status 1 or an abort in its finalisation (134) with a native stack;
    now one line and the signal itself (embgeom_ray.sigterm), without Ray's native stack of
    the SIGTERM. ``sleep``: before any Ray (the process had no handler: killed without a
    line)."""
    base = Path(tempfile.mkdtemp(prefix="egx-", dir="/tmp"))  # Ray's sockets: a short path
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env |= {"PYTHONPATH": str(REPO), "TMPDIR": str(base), "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(WAITING_COMMAND), where],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "WAITING\n", proc.communicate(timeout=60)
        time.sleep(2.0)  # in the wait: the task never ends
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_marked([str(base)])
        shutil.rmtree(base, ignore_errors=True)
    assert proc.returncode == -signal.SIGTERM, err
    if where != "sleep":  # it was in Ray's wait: SystemExit(1) in Ray 2.60 (15 if Ray mends it)
        assert out in ("RAISED 1\n", "RAISED 15\n"), out
    lines = err.strip().splitlines()
    assert lines[-1].startswith("terminated (SIGTERM): the same command run again resumes"), err
    assert "SIGTERM received" not in err and "Traceback" not in err, err


class _Process:
    """A Ray process of :func:`_node`: what is done to it goes to ``events``."""

    def __init__(self, name: str, events: list) -> None:
        self.name, self.events = name, events

    def kill(self) -> None:
        self.events.append(("kill", self.name))

    def wait(self, timeout: float | None = None) -> int:
        self.events.append(("wait", self.name))
        return -signal.SIGKILL


def _node(head: bool, events: list):
    """A stand-in for Ray's ``_global_node``: a head this process started, or a joined one."""

    class Info:
        def __init__(self, name: str) -> None:
            self.process = _Process(name, events)

    class Node:
        def __init__(self) -> None:
            self.head = head
            self.all_processes = {"raylet": [Info("raylet")], "monitor": [Info("monitor")]}

    return Node()


def test_a_private_rays_monitor_is_killed_before_rays_own_shutdown(monkeypatch) -> None:
    """Ray's shutdown stops the GCS, then waits 1 s for its autoscaler monitor to take SIGTERM,
    which it never does in time: a command's exit (``exit_process``) now kills the monitor of
    a head it started first (1.36 s → 0.36 s for the shutdown), and leaves a joined Ray's
    processes to ``ray.shutdown()``."""
    import ray

    from embgeom_ray import cli
    from embgeom_ray.distributed import cluster

    events: list = []
    monkeypatch.setattr(ray, "shutdown", lambda: events.append(("shutdown",)))
    monkeypatch.setattr(ray._private.worker, "_global_node", _node(True, events))
    cluster.shutdown_ray()
    assert events == [("kill", "monitor"), ("wait", "monitor"), ("shutdown",)]
    events.clear()
    monkeypatch.setattr(ray._private.worker, "_global_node", _node(False, events))
    cluster.shutdown_ray()
    assert events == [("shutdown",)]

    # the command's exit goes through it, for a Ray this process initialised
    class Exited(Exception):
        pass

    def _exit(code: int):
        raise Exited(code)

    events.clear()
    monkeypatch.setattr(ray._private.worker, "_global_node", _node(True, events))
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(cli.logging, "shutdown", lambda: None)
    monkeypatch.setattr(cli.os, "_exit", _exit)
    monkeypatch.setattr(cli.sys, "gettrace", lambda: None)
    monkeypatch.setattr(cli.sys, "getprofile", lambda: None)
    monkeypatch.delitem(sys.modules, "coverage", raising=False)
    with pytest.raises(Exited):
        cli.exit_process(0)
    assert events == [("kill", "monitor"), ("wait", "monitor"), ("shutdown",)]
