"""Which Ray the job runs on, and joining it without hanging.

The rule (``docs/operations.md``, "Which Ray"): the job joins a running cluster only when told
to —

1. an explicit address (``--address`` / ``address:`` in the config file),
2. else ``RAY_ADDRESS``,
3. else, under ``ray job submit``, the cluster the job was submitted to (the job supervisor
   sets ``RAY_ADDRESS`` to it; ``RAY_JOB_CONFIG_JSON_ENV_VAR`` marks a submitted job);

otherwise it starts a **private local Ray** (``ray.init(address="local")``), never the cluster
that some ``ray start`` left on the machine: a stale address file of a dead head made a plain
``ray.init()`` retry the dead GCS forever, and a live head started by something else (a test
suite's, a colleague's) was silently joined.

An address is ``HOST:PORT`` (the head's GCS, port 6379 unless given), ``ray://HOST:PORT``
(Ray Client), ``auto`` (the cluster ``ray start`` started on this machine) or ``local`` (a
private local Ray). Before Ray is asked to join, the head is probed with a plain TCP connection
(``PROBE_TIMEOUT_S``): an address nobody listens on — a dead head, a stale address file, a
typo — fails at once with one :class:`~embgeom_ray.errors.ConfigError`, exit status 2. Ray's
own join is then given ``JOIN_TIMEOUT_S``. While connecting, SIGTERM (``ray job stop``,
``kill``) and SIGINT (Ctrl-C) end the process within a fraction of a second with a message and
status 128 + signal number, even when Ray is blocked in its C++ connection loop (a watcher
thread woken through :func:`signal.set_wakeup_fd` ends the process; the main thread may be
inside native code that never returns to Python). Within the Python API's calls
(:func:`leave_ray_as_found`), Ctrl-C is the caller's ``KeyboardInterrupt`` instead: the
process (a notebook's kernel) goes on.

The first line the job writes to stderr about Ray says which one it runs on:
``ray: started a private local Ray (N CPUs)`` or
``ray: joined cluster at ADDRESS (N nodes, N CPUs, N GPUs; address from SOURCE)``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .. import progress
from ..errors import ConfigError
from ..sigterm import on_sigterm
from ..storage import unreachable

if TYPE_CHECKING:
    from ..sizing import Cluster, NodeGroup

#: seconds a TCP connection to the head may take before the address counts as unreachable
PROBE_TIMEOUT_S = 10.0
#: seconds Ray may take to join a head that accepted the TCP connection
JOIN_TIMEOUT_S = 60.0
#: seconds the Python API's caller waits for Ctrl-C's KeyboardInterrupt while joining a
#: cluster, before the process ends (the main thread stuck in Ray's native join loop)
INTERRUPT_GRACE_S = 2.0
#: seconds a command holds SIGTERM or Ctrl-C that came while its private local Ray starts,
#: for the start to finish (a few seconds) before the signal is delivered, before the process
#: ends without unwinding (Ray's start stuck); within Kubernetes' 30 s before its SIGKILL
START_GRACE_S = 20.0
#: the GCS port of ``ray start --head`` when none is given
DEFAULT_GCS_PORT = 6379
#: the port of a Ray Client server (``ray://``) when none is given
DEFAULT_CLIENT_PORT = 10001
#: set by Ray's job supervisor in the environment of a ``ray job submit`` entrypoint
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"

#: on the private local Ray, Ray keeps an idle worker process this long (ms) before killing
#: it when there are more workers than CPUs (Ray's default: 1 s): the task workers warmed
#: during the extraction (:mod:`~embgeom_ray.distributed.warm_workers`) wait for the sampled stage
IDLE_WORKER_KEEP_MS = 3_600_000

_SIGNAL_NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT"}
#: the GCS address of the private local Ray this process started, if it did
_private_gcs: str | None = None
#: the GCS address of the cluster this process's :func:`connect` last joined, if it did
_joined_gcs: str | None = None
#: the Python API's calls in progress (:func:`leave_ray_as_found`): Ctrl-C while connecting is
#: then the caller's KeyboardInterrupt, not the end of the process
_embedded = 0


@dataclass(frozen=True)
class ClusterChoice:
    """The Ray to run on: ``address`` None = a private local Ray; ``source`` says who chose."""

    address: str | None
    source: str

    @property
    def local(self) -> bool:
        return self.address is None


def choose_cluster(address: str | None, environ: Mapping[str, str] | None = None) -> ClusterChoice:
    """Apply the rule of the module docstring to an explicit ``address`` and the environment.

    Returns the address as given (``auto`` is resolved later, by :func:`connect`); ``local``
    anywhere means a private local Ray.
    """
    env = os.environ if environ is None else environ
    submitted = bool(env.get(JOB_CONFIG_ENV))
    if address and address.strip():
        choice = ClusterChoice(address.strip(), "--address")
    elif env.get("RAY_ADDRESS", "").strip():
        source = "ray job submit" if submitted else "RAY_ADDRESS"
        choice = ClusterChoice(env["RAY_ADDRESS"].strip(), source)
    elif submitted:
        choice = ClusterChoice("auto", "ray job submit")
    else:
        return ClusterChoice(None, "default")
    if choice.address == "local":
        return ClusterChoice(None, choice.source)
    return choice


def split_host_port(
    address: str, default_port: int, where: str = "the Ray address"
) -> tuple[str, int]:
    """``(host, port)`` of ``HOST[:PORT]``, ``[IPV6][:PORT]`` or ``ray://HOST[:PORT]``."""
    text = address if "://" in address else f"//{address}"
    try:
        parts = urlsplit(text)
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise ConfigError(f"{where} {address!r} is not HOST:PORT ({exc})") from None
    if not host or parts.path not in ("", "/") or parts.query:
        raise ConfigError(f"{where} {address!r} is not HOST:PORT (e.g. 10.0.0.5:6379)")
    return host, port or default_port


def resolve_address(choice: ClusterChoice) -> str:
    """The address Ray is asked to join: ``auto`` resolved, the GCS port filled in.

    A dashboard URL (``http://HEAD:8265``, the address ``ray job submit`` takes) is refused
    with the fix: the job joins a cluster through its GCS, or is submitted.
    """
    address = choice.address
    assert address is not None
    where = _where(choice)
    scheme = address.split("://", 1)[0].lower() if "://" in address else ""
    if scheme in {"http", "https"}:
        raise ConfigError(
            f"{where} {address} is a dashboard (job submission) address: submit the job with "
            "`ray job submit --address "
            f"{address} -- python -m jobs.analyze ...`, or give the head's GCS address "
            "(HOST:6379) to join it directly"
        )
    if scheme == "ray":
        host, port = split_host_port(address, DEFAULT_CLIENT_PORT, where)
        return f"ray://{_join(host, port)}"
    if scheme:
        raise ConfigError(f"{where} {address}: unknown scheme {scheme}:// (HOST:PORT or ray://)")
    if address == "auto":
        return _this_machines_cluster(where)
    return _join(*split_host_port(address, DEFAULT_GCS_PORT, where))


def _where(choice: ClusterChoice) -> str:
    return {
        "--address": "--address",
        "RAY_ADDRESS": "RAY_ADDRESS",
        "ray job submit": "the submitted job's Ray address",
    }.get(choice.source, "the Ray address")


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _this_machines_cluster(where: str) -> str:
    """``auto``: the head ``ray start`` recorded in its address file, else the only GCS running."""
    from ray._common.utils import get_ray_address_file
    from ray._private.services import find_bootstrap_address, find_gcs_addresses

    recorded = find_bootstrap_address(None)
    if recorded:
        return recorded
    running = sorted(find_gcs_addresses())
    if len(running) == 1:
        return running[0]
    if not running:
        raise ConfigError(
            f"{where} auto: no Ray cluster runs on this machine (no address in "
            f"{get_ray_address_file(None)}, no GCS process); start one with `ray start --head` "
            "or leave the address out for a private local Ray"
        )
    raise ConfigError(f"{where} auto: several Ray clusters run here ({running}); name one")


def probe(address: str, timeout: float = PROBE_TIMEOUT_S, where: str = "the Ray address") -> None:
    """Raise :class:`ConfigError` unless something accepts a TCP connection at ``address``.

    Refused: nothing listens (a head that died, or whose address file outlived it). Timed
    out: the host does not answer (firewall, wrong network, a node that is gone).
    """
    default = DEFAULT_CLIENT_PORT if address.startswith("ray://") else DEFAULT_GCS_PORT
    host, port = split_host_port(address, default, where)
    reason = unreachable(
        host, port, timeout, refused="no Ray head listens there (dead, or not started yet)"
    )
    if reason is None:
        return
    raise ConfigError(
        f"cannot reach the Ray cluster at {address} ({where}): {reason}. Start the head "
        "(`ray start --head`), fix the address, or leave it out for a private local Ray"
    )


def check_credentials(address: str, where: str = "the Ray address") -> None:
    """Raise :class:`ConfigError` at once if the GCS at ``address`` refuses this client's
    credentials (Ray's token authentication), where ``ray.init`` would retry for ~20 s before
    failing with a message that does not say why. One request (Ray's ``GcsClient``: a few
    milliseconds when the head answers); anything else it meets is left to ``ray.init``, as is
    a Ray Client address (``ray://``)."""
    if address.startswith("ray://"):
        return
    import ray

    try:
        from ray._raylet import GcsClient  # Ray's own client of the GCS (not a public API)
    except ImportError:
        return
    try:
        GcsClient(address=address)
    except ray.exceptions.AuthenticationError as exc:
        raise _credentials_refused(address, where, exc) from None
    except Exception:  # not a refusal of the credentials: ray.init decides
        return


def _credentials_refused(address: str, where: str, exc: Exception) -> ConfigError:
    """The one-line error for a cluster that refused this client's credentials: Ray's first
    sentence, and what to set."""
    said = re.split(r"\.\s", str(exc).splitlines()[0])[0]
    return ConfigError(
        f"cannot join the Ray cluster at {address} ({where}): it refused this client's "
        f"credentials ({said}). {_auth_hint()}"
    )


class _ConnectGuard:
    """While connecting: end the process on SIGTERM/SIGINT, or when the time set by :meth:`arm`
    is up.

    The main thread may be blocked inside Ray's native connection loop, where Python signal
    handlers never run. So the C-level handler's wakeup byte (:func:`signal.set_wakeup_fd`)
    goes to a socket a watcher thread waits on; the watcher prints one line and ends the
    process with :func:`os._exit`, from its own thread. Nothing has been run on the cluster at
    that point (a local Ray's processes end with this one, which they share their fate with).

    A command's private local Ray (``holds_interrupt``) is different: what runs around its
    start holds state a signal must unwind (``reanalyze`` has marked its model ``running`` in
    the store's index and holds the store's lock, an S3 object that outlives the process: ended
    by :func:`os._exit`, the index said ``running`` for a run nobody ran and the lock held other
    hosts off for 15 minutes). There SIGTERM and Ctrl-C are held until the start is done (a
    few seconds), then delivered in the main thread as the same signal a moment later would
    be (``SystemExit(15)``, ``KeyboardInterrupt``: one line, 143 or 130, the index and the
    lock left as after any interruption, Ray stopped by :func:`~embgeom_ray.cli.exit_process`);
    only a start still running :data:`START_GRACE_S` after the signal ends the process there.
    Held from Python, that is: ``ray.init`` puts its own SIGTERM handler (``sys.exit``) in
    place as it begins, so a SIGTERM during the start is in practice its ``SystemExit(15)``,
    raised inside ``ray.init`` as soon as the main thread runs Python again (it unwinds the
    same; the half-started Ray's processes end with this one), and the copy held here is
    delivered after it (:func:`~embgeom_ray.sigterm.on_sigterm` notes it). Ctrl-C is held.

    Within the Python API's calls (:func:`leave_ray_as_found`) Ctrl-C is the caller's
    ``KeyboardInterrupt``: the process ends only where the main thread has not left the
    guarded block :data:`INTERRUPT_GRACE_S` after it (stuck in Ray's native join loop, where
    nothing else would end it); while a private local Ray starts (``holds_interrupt``) it is
    held until the start is done (:func:`_interrupt_after_start`).
    """

    def __init__(self, what: str, timeout_hint: str = "", *, holds_interrupt: bool = False) -> None:
        self.what = what
        self.timeout_hint = timeout_hint
        self.holds_interrupt = holds_interrupt
        self._exit_lock = threading.Lock()
        self._end: float | None = None
        self._interrupted: float | None = None
        #: a command's signal held while its private local Ray starts (delivered after)
        self.held: int | None = None
        self._control: socket.socket | None = None

    def arm(self, seconds: float) -> None:
        """From now on, end the process if the guarded block has not finished in ``seconds``."""
        self._end = time.monotonic() + seconds
        if self._control is not None:
            self._control.send(b"a")

    def exit_now(self, code: int, message: str) -> None:
        with self._exit_lock:
            try:
                # straight to the file descriptor: sys.stderr's lock may be held by the main
                # thread, blocked wherever the signal found it
                os.write(2, (message + "\n").encode(errors="replace"))
            finally:
                os._exit(code)

    def _on_signal(self, signum: int) -> None:
        if _embedded and signum == signal.SIGINT:
            # the caller's KeyboardInterrupt, raised where the main thread runs Python
            if not self.holds_interrupt and self._interrupted is None:
                self._interrupted = time.monotonic() + INTERRUPT_GRACE_S
            return
        if self.holds_interrupt and not _embedded:  # a command's private Ray starting
            if self.held is None:
                self.held = signum
                self._interrupted = time.monotonic() + START_GRACE_S
            return
        self._exit_interrupted(signum)

    def _exit_interrupted(self, signum: int, why: str = "") -> None:
        name = _SIGNAL_NAMES.get(signal.Signals(signum), f"signal {signum}")
        self.exit_now(128 + signum, f"error: interrupted by {name} while {self.what}{why}")

    def _watch(self, wake: socket.socket, control: socket.socket) -> None:
        while True:
            ends = [t for t in (self._end, self._interrupted) if t is not None]
            left = max(0.0, min(ends) - time.monotonic()) if ends else None
            ready, _, _ = select.select([wake, control], [], [], left)
            if wake in ready:  # before `control`: a signal that raced the end is still honoured
                for byte in wake.recv(64):
                    if byte in (signal.SIGTERM, signal.SIGINT):
                        self._on_signal(byte)
            if control in ready:
                if b"x" in control.recv(64):
                    return
            elif not ready:
                now = time.monotonic()
                if self._interrupted is not None and now >= self._interrupted:
                    grace = INTERRUPT_GRACE_S if self.held is None else START_GRACE_S
                    self._exit_interrupted(
                        self.held or signal.SIGINT, f" (Ray did not return within {grace:g} s)"
                    )
                if self._end is not None and now >= self._end:
                    self.exit_now(2, f"error: {self.timeout_hint}")

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        wake_r, wake_w = socket.socketpair()
        stop_r, stop_w = socket.socketpair()
        self._control = stop_w
        for s in (wake_r, wake_w):
            s.setblocking(False)
        in_main = threading.current_thread() is threading.main_thread()
        holding = in_main and self.holds_interrupt and not _embedded
        old_wakeup = -1
        old_term: Any = None
        old_int: Any = None
        if in_main:
            old_wakeup = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
            old_term = signal.signal(signal.SIGTERM, _note_signal)
        # Ctrl-C's KeyboardInterrupt too is held until the start is done (where not ignored,
        # as in a shell's background job)
        hold_int = holding and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
        if hold_int:
            old_int = signal.signal(signal.SIGINT, _note_signal)
        watcher = threading.Thread(
            target=self._watch, args=(wake_r, stop_r), name="ray-connect-guard", daemon=True
        )
        watcher.start()
        try:
            yield
        except (KeyboardInterrupt, SystemExit):
            # Ctrl-C's KeyboardInterrupt, or ray.init's SIGTERM handler (sys.exit), may reach
            # the main thread before the watcher has read the signal's wakeup byte: give the
            # watcher the moment it needs to report the signal and end the process (within
            # the Python API's calls, Ctrl-C stays the caller's KeyboardInterrupt; a held
            # signal is the main thread's already)
            if not _embedded and not holding:
                watcher.join(timeout=2.0)
            raise
        finally:
            stop_w.send(b"x")
            watcher.join(timeout=5)
            self._control = None
            if hold_int:  # Ctrl-C from now on is the main thread's KeyboardInterrupt
                signal.signal(signal.SIGINT, signal.SIG_DFL if old_int is None else old_int)
            if in_main:
                # ray.init installs its own SIGTERM handler (sys.exit: atexit then shuts Ray
                # down cleanly); keep it, and put back the caller's if Ray left ours, or if
                # the caller's is a command's (sigterm.on_sigterm: Ray's, and it notes the
                # signal, which ray.wait turns into SystemExit(1)); the handlers before the
                # wakeup, so that a signal in between still leaves its byte to read below
                if signal.getsignal(signal.SIGTERM) is _note_signal or old_term is on_sigterm:
                    # None: the previous handler was not installed from Python
                    signal.signal(signal.SIGTERM, signal.SIG_DFL if old_term is None else old_term)
                signal.set_wakeup_fd(old_wakeup)
            if holding:
                self._hold_unread(wake_r)
            for s in (wake_r, wake_w, stop_r, stop_w):
                s.close()
            if holding and self.held is not None:
                # delivered in the main thread, as the same signal a moment later would be
                signal.raise_signal(self.held)

    def _hold_unread(self, wake: socket.socket) -> None:
        """A SIGTERM or SIGINT whose wakeup byte the watcher had not read when it stopped
        (it came as the start ended) is held too."""
        with contextlib.suppress(OSError):  # BlockingIOError: nothing left
            for byte in wake.recv(64):
                if byte in (signal.SIGTERM, signal.SIGINT) and self.held is None:
                    self.held = byte


@contextlib.contextmanager
def _interrupt_after_start() -> Iterator[None]:
    """Within the Python API's calls (:func:`leave_ray_as_found`), in the main thread: Ctrl-C
    while ``ray.init`` starts the private local Ray is held until it has started, then
    delivered (the caller's ``KeyboardInterrupt``). Interrupted midway, ``ray.init`` left the
    processes it had started (its GCS, its monitor) running, unknown to ``ray.shutdown``;
    started, they are all stopped by :func:`leave_ray_as_found`. The start takes seconds."""
    if not _embedded or threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    caller = signal.signal(signal.SIGINT, lambda signum, _frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, caller)
        if held:
            signal.raise_signal(signal.SIGINT)


def _note_signal(signum: int, frame: FrameType | None) -> None:
    """SIGTERM while connecting: a Python-level handler, so that the C-level handler writes the
    wakeup byte; the watcher thread does the rest."""


def _auth_hint() -> str:
    """What to check when a head answers but refuses this client: Ray's token authentication
    (a head started with RAY_AUTH_MODE=token drops requests without its token)."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return (
            "If the cluster uses token authentication, this client needs RAY_AUTH_MODE=token "
            "and the cluster's token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
        )
    return (
        "RAY_AUTH_MODE=token is set: check that this client's token (RAY_AUTH_TOKEN, "
        "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) is the cluster's"
    )


def _driver_runtime_env() -> dict[str, Any] | None:
    """The driver's ``HF_*`` / ``TRANSFORMERS_*`` variables (offline mode, caches), for the
    workers of a cluster this process joins (a private local Ray's workers inherit them),
    except those a submitted job's runtime env already sets (Ray refuses a driver runtime env
    that repeats one of the job's env_vars) and the hub token: Ray shows a runtime env in its
    dashboard and writes it to its logs, so the token goes to the extractors as an argument
    instead (:mod:`embgeom_ray.inputs.hub_credentials`)."""
    from ..inputs.hub_credentials import TOKEN_VARIABLES

    env_vars = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(("HF_", "TRANSFORMERS_")) and k not in TOKEN_VARIABLES
    }
    job_config = os.environ.get(JOB_CONFIG_ENV)
    if job_config:
        job_vars = (json.loads(job_config).get("runtime_env") or {}).get("env_vars") or {}
        env_vars = {k: v for k, v in env_vars.items() if k not in job_vars}
    return {"env_vars": env_vars} if env_vars else None


#: the logger of Ray's notice that a new local Ray turned token authentication on by itself
_TOKEN_SETUP_LOGGER = "ray._private.authentication.authentication_token_setup"


class _TokenNoticeFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")


@contextlib.contextmanager
def _without_token_notice() -> Iterator[None]:
    """Leave out Ray's warning that a new local Ray enabled token authentication by default.

    Since Ray 2.52, ``ray.init()`` starting a local Ray with ``RAY_AUTH_MODE`` unset turns token
    authentication on (creating ``~/.ray/auth_token`` if missing) and warns about it, in the
    words "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to
    opt out". For the job's private Ray that is the intended, secure default, and the warning
    would come before the job's own line saying which Ray it runs on; only that notice is
    dropped (any other message of Ray's, e.g. a token that cannot be written, still shows).
    """
    logger = logging.getLogger(_TOKEN_SETUP_LOGGER)
    notice = _TokenNoticeFilter()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


def describe_cluster(choice: ClusterChoice, address: str | None) -> str:
    """The line that says which Ray the job runs on (nodes and resources as Ray reports them)."""
    import ray

    res = ray.cluster_resources()
    cpus, gpus = _count(int(res.get("CPU", 0)), "CPU"), _count(int(res.get("GPU", 0)), "GPU")
    if choice.local:
        extra = f", {gpus}" if res.get("GPU") else ""
        return f"ray: started a private local Ray ({cpus}{extra})"
    nodes = _count(sum(1 for n in ray.nodes() if n.get("Alive")), "node")
    shown = address
    if not (address or "").startswith("ray://"):
        with contextlib.suppress(Exception):
            shown = ray.get_runtime_context().gcs_address
    return f"ray: joined cluster at {shown} ({nodes}, {cpus}, {gpus}; address from {choice.source})"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


#: what ``ray.init`` changes in the process beyond Ray itself, put back by
#: :func:`leave_ray_as_found`: its environment variables (``RAY_*``: ``RAY_AUTH_MODE=token``
#: would go on to a later ``ray.init`` of the caller's; ``PYTHONBREAKPOINT``: ``breakpoint()``
#: would call Ray's debugger)
_RAY_INIT_VARIABLES = ("RAY_", "PYTHONBREAKPOINT")


@contextlib.contextmanager
def leave_ray_as_found() -> Iterator[None]:
    """Within: one call of the Python API (:mod:`embgeom_ray.api`), in a process the caller
    owns (a notebook's kernel, a script). Ctrl-C while Ray starts or is joined is the caller's
    ``KeyboardInterrupt`` (a command's process ends instead: :class:`_ConnectGuard`). On
    leaving, however the block ends, a Ray the block started (the private local Ray: its
    processes and workers stopped; one half started by an interrupted ``ray.init`` too) or
    joined (disconnected) is shut down and its address forgotten, and what ``ray.init`` changed
    in the process is put back: its environment variables and its SIGTERM handler. A Ray the
    caller had initialised is left as it was, up and usable."""
    global _embedded, _private_gcs, _joined_gcs
    ray = sys.modules.get("ray")
    initialised = ray is not None and ray.is_initialized()
    environ = {k: v for k, v in os.environ.items() if k.startswith(_RAY_INIT_VARIABLES)}
    in_main = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if in_main else None
    _embedded += 1
    try:
        yield
    finally:
        _embedded -= 1
        ray = sys.modules.get("ray")
        if not initialised and ray is not None:
            shutdown_ray()
            # gone: a Ray the caller initialises later at that address is the caller's
            # (:func:`_check_initialised_ray`, :func:`started_private_local`)
            _private_gcs = _joined_gcs = None
            for name in [k for k in os.environ if k.startswith(_RAY_INIT_VARIABLES)]:
                if name not in environ:
                    del os.environ[name]
            os.environ.update(environ)
            if in_main and sigterm is not None and signal.getsignal(signal.SIGTERM) != sigterm:
                signal.signal(signal.SIGTERM, sigterm)


def shutdown_ray() -> None:
    """``ray.shutdown()``, a Ray head that this process started (the private local Ray) less
    its autoscaler monitor first.

    Ray's own shutdown stops the raylet and the GCS, then sends the monitor SIGTERM and waits
    up to 1 s before it SIGKILLs it: the monitor's handler reports its exit to the GCS already
    gone and never returns in time, so every command on a private Ray waited that second at
    its exit (1.36 s for the shutdown, 0.36 s with the monitor killed first: 2 cores, Ray
    2.60). The monitor holds nothing of the run's (it scales clusters; a private Ray is one
    node), so it is killed first, as Ray would 1 s later: by SIGKILL, since its SIGTERM handler
    would publish "The autoscaler failed" to this driver while the GCS still runs. Where Ray's
    internals differ (a version without them), ``ray.shutdown()`` alone."""
    import ray

    try:
        node = ray._private.worker._global_node
        monitors = node.all_processes.get("monitor", []) if node is not None and node.head else []
    except AttributeError:
        monitors = []
    for info in monitors:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            info.process.kill()
            info.process.wait(timeout=1.0)
    ray.shutdown()


def started_private_local() -> bool:
    """Whether Ray is initialised here as the private local Ray that :func:`connect` started
    (the job owns that machine and its workers; not a cluster, not a Ray someone else
    initialised in this process)."""
    import ray

    return (
        _private_gcs is not None
        and ray.is_initialized()
        and ray.get_runtime_context().gcs_address == _private_gcs
    )


def _gcs_address() -> str | None:
    """The GCS address of the Ray this process is connected to (None where Ray does not say:
    a Ray Client connection)."""
    import ray

    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:
        return None


def _ips(host: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses ``host`` resolves to (none where it does not)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return set()
    return {ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos}


def same_gcs(a: str, b: str) -> bool:
    """Whether the GCS addresses ``a`` and ``b`` (``HOST:PORT``) may name the same Ray: the
    same port, and hosts that resolve to a common address (a loopback address, or a host that
    does not resolve, is given the benefit of the doubt)."""
    (host_a, port_a), (host_b, port_b) = (split_host_port(x, DEFAULT_GCS_PORT) for x in (a, b))
    if port_a != port_b:
        return False
    ips_a, ips_b = _ips(host_a), _ips(host_b)
    if not ips_a or not ips_b or any(ip.is_loopback for ip in ips_a | ips_b):
        return True
    return bool(ips_a & ips_b)


def _check_initialised_ray(choice: ClusterChoice) -> None:
    """Where Ray was initialised in this process by its caller (``ray.init()`` before an API
    call), the job runs on that Ray: an explicit address naming another one is refused, not
    ignored. A Ray Client address (``ray://``) cannot be compared and is left alone."""
    if choice.source != "--address" or choice.local or choice.address is None:
        return
    current = _gcs_address()
    if current is None or current == _private_gcs or current == _joined_gcs:
        return  # this process's own connect() started or joined it
    if choice.address.startswith("ray://") or "://" in current:
        return
    try:
        target = resolve_address(choice)
    except ConfigError:
        return
    if not same_gcs(target, current):
        raise ConfigError(
            f"Ray is already initialised in this process (its GCS at {current}) and "
            f"--address {choice.address} names another Ray: leave the address out to run on "
            "the initialised one, or call ray.shutdown() first"
        )


def connect(
    address: str | None,
    *,
    probe_timeout_s: float = PROBE_TIMEOUT_S,
    join_timeout_s: float = JOIN_TIMEOUT_S,
) -> ClusterChoice:
    """Join the cluster the user meant (module docstring), else start a private local Ray.

    ``address`` is the job's ``--address`` (``JobConfig.address``); None lets the environment
    decide (``RAY_ADDRESS``, ``ray job submit``), then a private local Ray. Writes one line to
    stderr saying which Ray the job runs on. Does nothing if Ray is already initialised, but
    refuses an explicit ``address`` naming another Ray than the one a caller initialised.
    Raises :class:`ConfigError` for an address that is malformed or that nobody answers on.
    """
    import ray

    choice = choose_cluster(address)
    if ray.is_initialized():
        _check_initialised_ray(choice)
        return choice
    if choice.local:
        guard = _ConnectGuard("starting a private local Ray", holds_interrupt=True)
        with guard.active(), _without_token_notice(), _interrupt_after_start():
            ray.init(
                address="local",
                # no runtime env: the private Ray's processes are this process's children and
                # inherit its environment (the HF_* variables with it), and the workers Ray
                # starts beforehand serve only jobs without one: with it, the first tasks (the
                # sampled stage's) waited ~0.9 s for fresh workers beside two idle ones
                runtime_env=None,
                include_dashboard=False,
                log_to_driver=not progress.is_routed(),
                # Ray's INFO line ("Started a local Ray instance.") says less than the job's
                # own first line, printed below (its warnings still show)
                logging_level=logging.WARNING,
                _system_config={"idle_worker_killing_time_threshold_ms": IDLE_WORKER_KEEP_MS},
            )
        global _private_gcs
        _private_gcs = ray.get_runtime_context().gcs_address
        progress.notice(describe_cluster(choice, None))
        return choice

    where = _where(choice)
    target = resolve_address(choice)
    what = f"connecting to the Ray cluster at {target} ({where})"
    hint = (
        f"the Ray cluster at {target} ({where}) accepted a connection but Ray did not join it "
        f"within {join_timeout_s:g} s: is it a Ray head's GCS port (HOST:6379)? {_auth_hint()}"
    )
    guard = _ConnectGuard(what, hint)
    runtime_env = _driver_runtime_env()
    with guard.active():
        probe(target, probe_timeout_s, where)
        guard.arm(join_timeout_s)
        check_credentials(target, where)
        try:
            ray.init(
                address=target, runtime_env=runtime_env, log_to_driver=not progress.is_routed(),
                logging_level=logging.WARNING if progress.is_routed() else logging.INFO,
            )  # fmt: skip
        except ray.exceptions.AuthenticationError as exc:
            raise _credentials_refused(target, where, exc) from None
        except (ConnectionError, TimeoutError) as exc:
            raise ConfigError(
                f"cannot join the Ray cluster at {target} ({where}): {exc}. {_auth_hint()}"
            ) from None
    global _joined_gcs
    _joined_gcs = _gcs_address()
    progress.notice(describe_cluster(choice, target))
    return choice


def read_cluster() -> Cluster:
    """Ray's view of the cluster the job runs on (joined by :func:`connect`): every live node's
    ``memory`` resource (what actors may reserve), CPUs, GPUs, whether it is the head and its
    GPUs' accelerator type: what :mod:`embgeom_ray.sizing` decides from."""
    import ray

    from ..sizing import Cluster, Node

    nodes = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = n.get("Resources") or {}
        types = [k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")]
        nodes.append(
            Node(
                node_id=str(n.get("NodeID", "")),
                memory=int(res.get("memory", 0)),
                cpus=int(res.get("CPU", 0)),
                gpus=int(res.get("GPU", 0)),
                head="node:__internal_head__" in res,
                gpu_type=types[0] if types else None,
                object_store=int(res.get("object_store_memory", 0)),
            )
        )
    return Cluster(tuple(nodes))


def read_autoscaler_groups() -> tuple[NodeGroup, ...] | None:
    """The node types the cluster's autoscaler may start, with the most nodes of each, as Ray
    shows them: the cluster config an autoscaler reports to Ray's GCS (what Ray Data reads
    too; not a public API). None where none is reported (no autoscaler, or one that does not
    report it: Ray's own cluster launcher and KubeRay's do not, in Ray 2.60) or it cannot be
    read (a Ray Client connection, another Ray)."""
    from ..sizing import NodeGroup

    try:
        from ray._private.state import state

        config = state.get_cluster_config()
    except Exception:  # not this Ray's API, or no GCS to ask: nothing tells
        return None
    if config is None or not config.node_group_configs:
        return None
    return tuple(
        NodeGroup(
            name=group.name,
            cpus=int(group.resources.get("CPU", 0)),
            gpus=int(group.resources.get("GPU", 0)),
            memory=int(group.resources.get("memory", 0)),
            max_count=None if group.max_count < 0 else int(group.max_count),
        )
        for group in config.node_group_configs
    )
