"""Which Ray the job runs on (``embgeom_ray.distributed.cluster``), and that joining never hangs.

- the rule: ``--address``, else ``RAY_ADDRESS``, else the cluster of a ``ray job submit``, else a
  private local Ray — never a cluster that a ``ray start`` merely left on the machine: neither a
  stale address file naming a dead head, nor a live foreign head;
- a dead explicit address fails at once with one message and exit status 2;
- a process stuck connecting (the TCP connection, or Ray's native join loop) ends within
  seconds on SIGTERM (``ray job stop``, ``kill``) or SIGINT (Ctrl-C), with a message and status
  128 + signal; a head that accepts the connection but never answers ends it after the join
  timeout.

The processes under test get ``TMPDIR`` set to a short private directory: Ray reads its address
file (``ray_current_cluster``) from ``$TMPDIR/ray`` and keeps a local Ray's sockets there, so
nothing here touches (or is touched by) other Ray instances on the machine. The one head these
tests start runs as ``ray start --head --block`` in its own process group, on free ports, with
its own ``--temp-dir``; it is stopped by signalling that process, then killing whatever of it
is left — never with ``ray stop``, which would stop every Ray on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from embgeom_ray.distributed.cluster import (
    ClusterChoice,
    check_credentials,
    choose_cluster,
    probe,
    resolve_address,
)
from embgeom_ray.errors import ConfigError
from tests.conftest import write_jsonl
from tests.ray_processes import free_ports, kill_marked, marked_pids
from tests.tiny_models import make_tiny_bert

REPO = Path(__file__).resolve().parents[2]
RAY_CLI = Path(sys.executable).parent / "ray"


# ------------------------------------------------------------------ helpers


def _env(tmpdir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        TMPDIR=str(tmpdir),
        PYTHONPATH=str(REPO),
        RAY_USAGE_STATS_ENABLED="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PATH=f"{RAY_CLI.parent}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    env.update(extra)
    return env


def _script(body: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(body)]


def _wait_for_line(proc: subprocess.Popen, text: str, timeout: float) -> None:
    """Read ``proc``'s stdout until a line equal to ``text`` (the script is then connecting)."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.strip() == text:
            return
        if not line and proc.poll() is not None:
            break
    pytest.fail(f"the script never printed {text!r}: {proc.communicate(timeout=10)}")


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


# ------------------------------------------------------------- the rule


def test_explicit_address_wins_over_the_environment() -> None:
    env = {"RAY_ADDRESS": "10.0.0.9:6379", "RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"}
    assert choose_cluster(" 10.0.0.5:6379 ", env) == ClusterChoice("10.0.0.5:6379", "--address")


def test_ray_address_then_submitted_job_then_private_local_ray() -> None:
    assert choose_cluster(None, {"RAY_ADDRESS": "h:1"}) == ClusterChoice("h:1", "RAY_ADDRESS")
    # `ray job submit` sets RAY_ADDRESS to the cluster's GCS and marks the job's config
    submitted = {"RAY_ADDRESS": "h:1", "RAY_JOB_CONFIG_JSON_ENV_VAR": '{"runtime_env": {}}'}
    assert choose_cluster(None, submitted) == ClusterChoice("h:1", "ray job submit")
    only_marked = {"RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"}
    assert choose_cluster(None, only_marked) == ClusterChoice("auto", "ray job submit")
    # nothing said: a private local Ray, whatever `ray start` left on the machine
    assert choose_cluster(None, {}).local
    assert choose_cluster("", {"RAY_ADDRESS": " "}).local
    assert choose_cluster("local", {"RAY_ADDRESS": "h:1"}).local
    assert choose_cluster(None, {"RAY_ADDRESS": "local"}).local


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("10.0.0.5:7000", "10.0.0.5:7000"),
        ("head-svc", "head-svc:6379"),
        ("[fd00::5]:7000", "[fd00::5]:7000"),
        ("ray://head-svc", "ray://head-svc:10001"),
        ("ray://10.0.0.5:10002", "ray://10.0.0.5:10002"),
    ],
)
def test_addresses_are_completed(address: str, expected: str) -> None:
    assert resolve_address(ClusterChoice(address, "--address")) == expected


@pytest.mark.parametrize(
    ("address", "fragments"),
    [
        ("http://head:8265", ["RAY_ADDRESS http://head:8265 is a dashboard", "ray job submit"]),
        ("head:port", ["RAY_ADDRESS 'head:port' is not HOST:PORT"]),
        ("head:6379/x", ["is not HOST:PORT"]),
        ("grpc://head:6379", ["unknown scheme grpc://"]),
    ],
)
def test_bad_addresses_are_refused_with_the_fix(address: str, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_address(ClusterChoice(address, "RAY_ADDRESS"))
    for fragment in fragments:
        assert fragment in str(err.value)


def test_auto_reads_the_address_file_ray_start_writes(private_tmp, monkeypatch) -> None:
    """``auto`` is the head named in ``$TMPDIR/ray/ray_current_cluster`` (Ray's own reader)."""
    (private_tmp / "ray").mkdir()
    (private_tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:6390")
    monkeypatch.setenv("TMPDIR", str(private_tmp))
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert resolve_address(ClusterChoice("auto", "--address")) == "127.0.0.1:6390"


def test_only_rays_token_default_notice_is_left_out() -> None:
    """A new local Ray's "token authentication is enabled" warning (Ray's own function, so its
    real wording) does not come before the job's line; Ray's other auth warnings still show."""
    import logging

    from ray._private.authentication import authentication_token_setup as setup

    from embgeom_ray.distributed.cluster import _without_token_notice

    if not hasattr(setup, "_warn_token_auth_enabled"):  # Ray 2.52 (the floor) has no notice
        pytest.skip("this Ray does not turn token authentication on by itself, nor say so")

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(setup.__name__)
    logger.addHandler(handler)
    try:
        setup._warn_token_auth_enabled()
        assert any("Token authentication is enabled for this Ray cluster" in m for m in seen)
        seen.clear()
        with _without_token_notice():
            setup._warn_token_auth_enabled()
            assert seen == []
            setup._warn_token_auth_disabled()
            assert any("Token authentication is disabled" in m for m in seen)
        seen.clear()
        setup._warn_token_auth_enabled()  # the filter is gone again
        assert any("Token authentication is enabled" in m for m in seen)
    finally:
        logger.removeHandler(handler)


# ------------------------------------------------------------------ probe


def test_probe_accepts_a_listening_head_and_refuses_a_dead_one() -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        probe(f"127.0.0.1:{srv.getsockname()[1]}", timeout=5)
    (dead,) = free_ports(1)
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        probe(f"127.0.0.1:{dead}", timeout=5, where="--address")
    assert time.monotonic() - t0 < 2
    message = str(err.value)
    assert f"127.0.0.1:{dead} (--address)" in message and "connection refused" in message


@contextlib.contextmanager
def _black_hole() -> Iterator[int]:
    """A local port whose accept queue is full: new TCP connections hang, like a dead host's."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fill = []
    for _ in range(3):
        c = socket.socket()
        c.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            c.connect(("127.0.0.1", port))
        fill.append(c)
    time.sleep(0.3)
    try:
        yield port
    finally:
        for c in fill:
            c.close()
        srv.close()


def test_probe_of_an_unanswering_host_times_out() -> None:
    with _black_hole() as port:
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match=r"no answer within 1 s"):
            probe(f"127.0.0.1:{port}", timeout=1)
        assert time.monotonic() - t0 < 3


def test_refused_credentials_end_at_once_and_other_failures_are_left_to_ray_init(
    monkeypatch,
) -> None:
    """One request to the GCS with the client's credentials: a refusal is a one-line error
    naming what to set (the head's own refusal end to end:
    :func:`test_a_live_foreign_head_is_not_joined_unless_named`); anything else, and a Ray
    Client address, are left to ``ray.init``."""
    import ray
    import ray._raylet

    calls: list[str] = []

    def refusing(address: str):
        calls.append(address)
        raise ray.exceptions.AuthenticationError(
            "RPC error: InvalidAuthToken: Authentication token is missing or incorrect. Note: …"
        )

    monkeypatch.setattr(ray._raylet, "GcsClient", refusing)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(ConfigError) as err:
        check_credentials("10.0.0.1:6379", "--address")
    assert str(err.value) == (
        "cannot join the Ray cluster at 10.0.0.1:6379 (--address): it refused this client's "
        "credentials (RPC error: InvalidAuthToken: Authentication token is missing or "
        "incorrect). If the cluster uses token authentication, this client needs "
        "RAY_AUTH_MODE=token and the cluster's token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or "
        "~/.ray/auth_token)"
    )
    check_credentials("ray://10.0.0.1:10001")  # Ray Client: not asked
    assert calls == ["10.0.0.1:6379"]

    def timing_out(address: str):
        raise TimeoutError("Timed out while waiting for GCS to become available.")

    monkeypatch.setattr(ray._raylet, "GcsClient", timing_out)
    assert check_credentials("10.0.0.1:6379") is None


# ---------------------------------------------- stuck connecting: signals, deadline

CONNECT_SCRIPT = """
    import signal, sys
    # Ctrl-C as in a foreground terminal, even when the test suite runs in the background
    # (a shell starts background commands with SIGINT ignored, and children inherit that)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from embgeom_ray.distributed.cluster import connect
    print("CONNECTING", flush=True)
    connect(sys.argv[1], probe_timeout_s=float(sys.argv[2]), join_timeout_s=float(sys.argv[3]))
    print("CONNECTED", flush=True)
"""


def _connecting(tmpdir: Path, address: str, probe_s: float, join_s: float) -> subprocess.Popen:
    return subprocess.Popen(
        [*_script(CONNECT_SCRIPT), address, str(probe_s), str(join_s)],
        cwd=REPO,
        env=_env(tmpdir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize(
    ("sig", "phase"),
    [
        (signal.SIGTERM, "tcp"),  # no answer from the host: stuck in the TCP probe
        (signal.SIGTERM, "ray"),  # the port answers, Ray's native join loop never ends
        (signal.SIGINT, "ray"),  # Ctrl-C in the same place
    ],
)
def test_a_signal_ends_a_stuck_connection_promptly(private_tmp, sig, phase) -> None:
    with contextlib.ExitStack() as stack:
        if phase == "tcp":
            port = stack.enter_context(_black_hole())
        else:
            srv = stack.enter_context(socket.create_server(("127.0.0.1", 0), backlog=64))
            port = srv.getsockname()[1]
        proc = _connecting(private_tmp, f"127.0.0.1:{port}", 300, 300)
        try:
            _wait_for_line(proc, "CONNECTING", timeout=60)
            time.sleep(2.0)  # well inside the probe, or inside ray.init
            assert proc.poll() is None, proc.communicate()
            t0 = time.monotonic()
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=10)
            elapsed = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 128 + sig, err
    assert elapsed < 5, elapsed
    name = signal.Signals(sig).name
    assert _error_lines(err) == [
        f"error: interrupted by {name} while connecting to the Ray cluster at "
        f"127.0.0.1:{port} (--address)"
    ], err


START_SCRIPT = """
    import os, signal, sys, threading, time
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a foreground terminal
    from embgeom_ray import sigterm
    from embgeom_ray.distributed import cluster

    signum, cluster.START_GRACE_S = signal.Signals[sys.argv[1]], float(sys.argv[2])
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signum)).start()
    t0 = time.monotonic()
    with sigterm.installed():  # as a command's main
        try:
            with cluster._ConnectGuard("starting a private local Ray", holds_interrupt=True).active():
                time.sleep(float(sys.argv[3]))  # ray.init starting the private Ray
                print("STARTED", round(time.monotonic() - t0, 1), flush=True)
            print("NOT INTERRUPTED", flush=True)
        except SystemExit as exc:
            print("SystemExit", exc.code, sigterm.received(), flush=True)
        except KeyboardInterrupt:
            print("KeyboardInterrupt", flush=True)
        finally:
            print("UNWOUND", flush=True)  # reanalyze marks its index and lets its lock go here
"""


@pytest.mark.parametrize(
    ("sig", "grace", "start_s", "out", "status"),
    [
        ("SIGTERM", 20, 0.6, ["SystemExit 15 True", "UNWOUND"], 0),
        ("SIGINT", 20, 0.6, ["KeyboardInterrupt", "UNWOUND"], 0),
        ("SIGTERM", 0.5, 30, [], 143),  # a start stuck past the grace: ended there
    ],
)
def test_a_signal_while_a_commands_private_ray_starts_is_held_until_it_has_started(
    private_tmp, sig, grace, start_s, out, status
) -> None:
    """SIGTERM (a CronJob's pod deleted) or Ctrl-C while a command's private local Ray
    started ended the process at once by os._exit(143): nothing unwound, so ``reanalyze``
    left its model ``running`` in the store's index for a run nobody ran, and its S3 lock in
    place (other hosts held off 15 minutes). Now the signal is held until the start is done,
    then delivered in the main thread as the same signal a moment later (SystemExit(15),
    noted; KeyboardInterrupt), which unwinds; a start still stuck START_GRACE_S after the
    signal ends the process in one line, as before."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(START_SCRIPT), sig, str(grace), str(start_s)],
        env=_env(private_tmp), cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == status, (done.stdout, done.stderr)
    lines = done.stdout.splitlines()
    if status:
        assert lines == [] and _error_lines(done.stderr) == [
            f"error: interrupted by {sig} while starting a private local Ray (Ray did not "
            f"return within {grace:g} s)"
        ], done.stderr
        return
    started, *rest = lines
    assert started.startswith("STARTED ") and float(started.split()[1]) >= start_s
    assert rest == out, done.stderr


def test_a_head_that_never_answers_ends_after_the_join_timeout(private_tmp) -> None:
    with socket.create_server(("127.0.0.1", 0), backlog=64) as srv:
        port = srv.getsockname()[1]
        proc = _connecting(private_tmp, f"127.0.0.1:{port}", 5, 3)
        try:
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 2, err
    assert "CONNECTED" not in out
    (line,) = _error_lines(err)
    assert f"127.0.0.1:{port} (--address) accepted a connection but Ray did not join" in line
    assert "within 3 s" in line and "RAY_AUTH_MODE=token" in line


# ------------------------------------------------------------ the job itself


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_bert(str(tmp_path_factory.mktemp("m")), max_position=64)


def _job(tmpdir: Path, work: Path, model: str, timeout: float, **options) -> tuple[int, str]:
    """``python -m jobs.analyze --config job.yaml`` (the address through the config file)."""
    corpus = write_jsonl(
        work / "c.jsonl", ["the cat sat on the mat", "a dog barked at the cat", "it rained"]
    )
    config = {
        "model": model,
        "corpus": corpus,
        "out": str(work / "out"),
        "max_length": 16,
        "sample_size": 0,
        "no_report": True,
        "num_workers": 1,
        "cpus_per_worker": 1,
    } | options
    (work / "job.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.analyze", "--config", str(work / "job.yaml")],
        cwd=REPO,
        env=_env(tmpdir),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stderr


@pytest.mark.slow
def test_an_explicit_dead_address_fails_at_once(private_tmp, tmp_path, tiny_model) -> None:
    (dead,) = free_ports(1)
    t0 = time.monotonic()
    code, err = _job(private_tmp, tmp_path, tiny_model, timeout=180, address=f"127.0.0.1:{dead}")
    elapsed = time.monotonic() - t0
    assert code == 2, err
    assert "Traceback" not in err
    (line,) = _error_lines(err)
    assert line.startswith(f"error: cannot reach the Ray cluster at 127.0.0.1:{dead} (--address)")
    assert "connection refused" in line
    assert "ray: " not in err  # no Ray was started or joined
    assert elapsed < 120, elapsed  # imports and the model's config; no connection retries


@pytest.mark.slow
def test_a_stale_address_file_is_ignored(private_tmp, tmp_path, tiny_model) -> None:
    """A head killed without ``ray stop`` leaves its address file; the job does not go there."""
    (dead,) = free_ports(1)
    (private_tmp / "ray").mkdir()
    address_file = private_tmp / "ray" / "ray_current_cluster"
    address_file.write_text(f"127.0.0.1:{dead}")
    # what a plain ray.init() (no RAY_ADDRESS) would have joined: Ray's reader finds the dead head
    from ray._private.services import find_bootstrap_address

    assert find_bootstrap_address(str(private_tmp / "ray")) == f"127.0.0.1:{dead}"

    t0 = time.monotonic()
    code, err = _job(private_tmp, tmp_path, tiny_model, timeout=400)
    elapsed = time.monotonic() - t0
    assert code == 0, err
    ray_lines = [line for line in err.splitlines() if line.startswith("ray: ")]
    assert len(ray_lines) == 1, err
    assert re.fullmatch(r"ray: started a private local Ray \(\d+ CPUs?\)", ray_lines[0]), err
    assert "Token authentication is enabled" not in err  # Ray's notice, left out (above)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    # starting the private Ray is timed on its own, outside the extraction stage's clock
    timings = manifest["timings_s"]
    assert 0.5 < timings["ray_start"] < elapsed and timings["extract_wall"] < timings["total"]
    assert address_file.read_text() == f"127.0.0.1:{dead}"  # left as it was
    assert elapsed < 300, elapsed


FOREIGN_AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


@pytest.fixture
def foreign_head(private_tmp) -> Iterator[str]:
    """A live head started by `ray start --head` under the same TMPDIR (its address file in
    ``$TMPDIR/ray``, where a plain ray.init() looks), with token authentication on (the token
    in ``FOREIGN_TOKEN``); yields its GCS address."""
    temp_dir = private_tmp / "ray"
    (gcs, node_mgr, obj_mgr, rt_env, metrics, client, agent_http, agent_grpc) = free_ports(8)
    log = private_tmp / "head.log"
    cmd = [
        str(RAY_CLI), "start", "--head", "--block",
        "--temp-dir", str(temp_dir),
        "--node-ip-address", "127.0.0.1",
        "--port", str(gcs),
        "--include-dashboard", "false",
        "--node-manager-port", str(node_mgr),
        "--object-manager-port", str(obj_mgr),
        "--runtime-env-agent-port", str(rt_env),
        "--metrics-export-port", str(metrics),
        "--ray-client-server-port", str(client),
        "--dashboard-agent-listen-port", str(agent_http),
        "--dashboard-agent-grpc-port", str(agent_grpc),
        "--min-worker-port", "0",
        "--max-worker-port", "0",
        "--num-cpus", "1",
        "--num-gpus", "0",
        "--object-store-memory", str(80 * 1024**2),
        "--disable-usage-stats",
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            env=_env(private_tmp, HOME=str(private_tmp), **FOREIGN_AUTH),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stopped without `ray stop`
            cwd=private_tmp,
        )
    try:
        address_file = temp_dir / "ray_current_cluster"
        deadline = time.monotonic() + 120
        while not address_file.is_file() or not address_file.read_text().strip():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray start did not come up:\n{log.read_text()}")
            time.sleep(0.5)
        yield address_file.read_text().strip()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=45)
        kill_marked([str(private_tmp)], proc.pid)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        assert not marked_pids([str(private_tmp)], proc.pid), "the test head left processes"


WHERE_SCRIPT = """
    import json, os, sys, time
    import psutil, ray
    from embgeom_ray.distributed.cluster import connect
    from embgeom_ray.errors import UserError
    try:
        if sys.argv[1] == "job":
            connect(None)
        elif sys.argv[1] == "explicit":
            connect(sys.argv[2])
        else:
            ray.init()  # what the job used to do
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    ctx = ray.get_runtime_context()
    out = {"gcs": ctx.gcs_address, "drivers": len(ray._private.state.jobs())}
    if sys.argv[1] == "job":  # the private Ray's waiting workers, and who runs the first tasks
        me = psutil.Process()

        def idle():
            return {p.pid for p in me.children(recursive=True) if p.cmdline()[:1] == ["ray::IDLE"]}

        deadline = time.monotonic() + 60
        while len(idle()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        before = idle()

        @ray.remote(num_cpus=1)
        def where():
            time.sleep(0.5)
            return os.getpid(), os.environ.get("HF_HUB_OFFLINE")

        out |= {"idle": sorted(before), "tasks": ray.get([where.remote() for _ in range(2)])}
    print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_live_foreign_head_is_not_joined_unless_named(private_tmp, foreign_head) -> None:
    """The job's private local Ray, not the live head ``ray start`` left, unless named; a
    head refusing the client's token refused in one line. And on that private Ray the
    driver's ``HF_*`` variables reach the workers through the environment they inherit, not
    a runtime env: Ray's workers started beforehand serve only jobs without one, so with it
    the first tasks (the sampled stage's) waited for fresh workers beside two idle ones
    (~0.9 s). (Checked on this test's private Ray: one of its own was one more Ray.)"""

    def run(mode: str, *args: str, auth: bool = True) -> subprocess.CompletedProcess:
        env = _env(private_tmp, HOME=str(private_tmp), **(FOREIGN_AUTH if auth else {}))
        return subprocess.run(
            [*_script(WHERE_SCRIPT), mode, *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )

    def where(mode: str, *args: str) -> tuple[dict, str]:
        proc = run(mode, *args)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr

    ours, err = where("job")
    assert ours["gcs"] != foreign_head
    assert ours["drivers"] == 1  # a fresh Ray: only this driver ever connected to it
    assert len(ours["idle"]) >= 2
    assert all(env == "1" for _, env in ours["tasks"])  # HF_HUB_OFFLINE, from the driver
    assert {pid for pid, _ in ours["tasks"]} <= set(ours["idle"])  # run on waiting workers
    ray_lines = [line for line in err.splitlines() if line.startswith("ray: ")]
    assert len(ray_lines) == 1, err
    assert re.fullmatch(r"ray: started a private local Ray \(\d+ CPUs?\)", ray_lines[0]), err
    # the control: a plain ray.init() in the same environment (the head's token included) joins
    # the foreign head, and finds itself its only driver there — so the job never registered
    theirs, _ = where("plain")
    assert theirs["gcs"] == foreign_head
    assert theirs["drivers"] == 1
    # and asked to, the job joins it, and says so
    joined, err = where("explicit", foreign_head)
    assert joined["gcs"] == foreign_head and joined["drivers"] == 2
    ray_lines = [line for line in err.splitlines() if line.startswith("ray: ")]
    assert ray_lines == [
        f"ray: joined cluster at {foreign_head} (1 node, 1 CPU, 0 GPUs; address from --address)"
    ], err
    # without the cluster's token: refused, with one message that says what to set
    refused = run("explicit", foreign_head, auth=False)
    assert refused.returncode == 2, refused.stderr
    (line,) = _error_lines(refused.stderr)
    assert line.startswith(f"error: cannot join the Ray cluster at {foreign_head} (--address)")
    assert "needs RAY_AUTH_MODE=token and the cluster's token" in line
