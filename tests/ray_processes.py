"""Helpers of the tests that start their own Ray heads: free ports, finding and stopping only
the processes a test started (other agents' and CI's Ray processes may share the machine),
and Ray nodes started as a user starts them (``ray start --block``), with token
authentication.

Stopping. ``ray stop`` would stop every Ray on the machine (other people's too), so the tests
never call it. Each node runs as ``ray start --block`` in a new session; SIGTERM to that one
process makes it drain the node and stop every process it started (GCS, raylet, agents,
workers). Anything of a test's still alive afterwards (in the node's process group, or with
the test's private directories on its command line) gets SIGTERM, then SIGKILL, by pid."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
RAY_CLI = VENV_BIN / "ray"


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 right now (held open together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def marked_pids(markers: Sequence[str], pgid: int | None = None) -> list[int]:
    """Live processes in process group ``pgid`` or whose command line names a marker."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            in_group = pgid is not None and os.getpgid(pid) == pgid
        except (OSError, IndexError):
            continue
        if state != "Z" and (in_group or any(m in cmdline for m in markers)):
            pids.append(pid)
    return pids


def kill_marked(markers: Sequence[str], pgid: int | None = None) -> None:
    """SIGTERM, then SIGKILL, the processes :func:`marked_pids` finds, waiting for each."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        for pid in marked_pids(markers, pgid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while marked_pids(markers, pgid) and time.monotonic() < deadline:
            time.sleep(0.2)


def ray_env(token: str) -> dict[str, str]:
    """The environment of a test's Ray nodes and of their clients: token authentication with
    ``token`` (the variable takes precedence over token files; ``RAY_AUTH_TOKEN_PATH`` is
    removed, so what is in ``~/.ray`` does not matter), offline Hugging Face, this
    virtualenv's ``bin`` first on the PATH."""
    env = {k: v for k, v in os.environ.items() if k not in {"RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH"}}
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=token,
        RAY_USAGE_STATS_ENABLED="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    return env


@dataclass
class RayNode:
    """A ``ray start --block`` process in a session of its own (module docstring), its log,
    and the markers on the command lines of the processes it starts."""

    proc: subprocess.Popen
    log: Path
    markers: list[str]

    def stop(self) -> list[int]:
        """Stop this node only; returns the pids that had to be killed after it stopped."""
        # SIGTERM to `ray start --block` alone: it drains the node and stops the processes it
        # started (a few seconds). SIGTERM to the whole group races with that drain.
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=45)
        pgid = self.proc.pid
        leftovers = marked_pids(self.markers, pgid)
        kill_marked(self.markers, pgid)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        return leftovers


def start_ray_node(
    args: Sequence[str],
    env: dict[str, str],
    log: Path,
    markers: list[str],
    cwd: Path,
    hidden: Path | None = None,
) -> RayNode:
    """``ray start --block ARGS`` in a session of its own (stopped by :meth:`RayNode.stop`,
    never by ``ray stop``), its output in ``log``. ``hidden``: a directory the node does not
    see (:func:`hiding_command`)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*hiding_command(hidden), str(RAY_CLI), "start", "--block", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # our own process group: stopped without `ray stop`
            cwd=cwd,
        )
    return RayNode(proc, log, markers)


def hiding_command(hidden: Path | None) -> list[str]:
    """The prefix that runs a command in a mount namespace of its own with an empty tmpfs over
    ``hidden``: a local directory of this machine that the command's processes do not see, as
    a cluster node does not see another node's own disk ([] for None)."""
    if hidden is None:
        return []
    script = f'mount -t tmpfs none "{hidden}" && exec "$0" "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]


def can_hide_directories() -> bool:
    """Whether :func:`hiding_command` works here (it needs mount namespaces: root, or a user
    namespace)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "seen").write_text("x")
        try:
            done = subprocess.run(
                [*hiding_command(Path(d)), "sh", "-c", f'test ! -e "{d}/seen"'],
                capture_output=True, timeout=30,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0 and (Path(d) / "seen").exists()


#: ports each node's servers take (:func:`node_args`)
NODE_PORTS = 6


def node_args(
    temp_dir: Path, ports: Sequence[int], *, cpus: int, object_store_bytes: int = 80 * 2**20
) -> list[str]:
    """``ray start`` arguments every test node takes: its own ``--temp-dir`` (keep it short:
    Ray's unix sockets under it are limited to ~107 bytes), 127.0.0.1, the free ``ports``
    (:data:`NODE_PORTS` of them, from one :func:`free_ports` with the caller's others, so
    that none is handed out twice) for its servers, ``cpus`` CPUs, no GPU, a small object
    store."""
    node_mgr, obj_mgr, rt_env, metrics, agent_http, agent_grpc = ports
    return [
        "--temp-dir", str(temp_dir),
        "--node-ip-address", "127.0.0.1",
        "--node-manager-port", str(node_mgr),
        "--object-manager-port", str(obj_mgr),
        "--runtime-env-agent-port", str(rt_env),
        "--metrics-export-port", str(metrics),
        "--dashboard-agent-listen-port", str(agent_http),
        "--dashboard-agent-grpc-port", str(agent_grpc),
        "--min-worker-port", "0",
        "--max-worker-port", "0",
        "--num-cpus", str(cpus),
        "--num-gpus", "0",
        "--object-store-memory", str(object_store_bytes),
        "--disable-usage-stats",
    ]  # fmt: skip
