"""A real S3 API on loopback for the tests: moto's server mode on a free port, and the
environment that points boto (and so s3fs) at it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.ray_processes import free_ports

MOTO = Path(sys.executable).parent / "moto_server"


@dataclass
class S3:
    """A moto server on loopback and the environment that points boto at it."""

    endpoint: str
    env: dict[str, str]

    def fs(self):
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        return s3fs.S3FileSystem(client_kwargs={"endpoint_url": self.endpoint},
                                 key=self.env["AWS_ACCESS_KEY_ID"],
                                 secret=self.env["AWS_SECRET_ACCESS_KEY"])  # fmt: skip


@contextlib.contextmanager
def moto_server(log: Path, **env: str) -> Iterator[str]:
    """``moto_server`` on a free loopback port (its own process group, stopped at the end)."""
    (port,) = free_ports(1)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(MOTO), "-H", "127.0.0.1", "-p", str(port)], stdout=out,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env=os.environ | env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"moto_server did not start:\n{log.read_text()}")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def s3_env(endpoint: str) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": endpoint,
    }  # fmt: skip


class FaultyProxy:
    """A TCP proxy on loopback between the job and an S3 server, which fails on demand.

    ``fault(mode, at=PATTERN, skip=K, requests=N)``: from the (K + 1)-th HTTP request whose
    request line matches ``PATTERN`` (a regex of bytes, e.g. ``rb"PUT /b/run/groups/"``;
    None: the next request) on, the proxy

    - ``"refuse"``: stops listening and drops every connection (a new one is refused); for
      ``requests`` connections only, resets each as it is accepted;
    - ``"stall"``: keeps the connections but forwards nothing more (the client's read times
      out);
    - ``"cut"``: forwards the request's headers and half its body, then closes both sides
      (the connection drops mid-upload);

    for ``requests`` requests (``None``: until :meth:`heal`). ``seen`` lists the requests by
    their first line, ``faults`` counts those failed.
    """

    def __init__(self, upstream: str, cut_after: int = 32 << 10) -> None:
        import re
        import threading

        parts = upstream.removeprefix("http://").split(":")
        self.upstream = (parts[0], int(parts[1]))
        self.cut_after = cut_after
        self._re = re
        self._lock = threading.Lock()
        self.mode, self._at, self._left, self._skip = "pass", None, None, 0
        self.active = False
        self.seen: list[bytes] = []
        self.faults = 0
        (self.port,) = free_ports(1)
        self._socks: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._listen()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _listen(self) -> None:
        import threading

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(64)
        self._listener = sock
        threading.Thread(target=self._accept, args=(sock,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        import threading

        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                reset = self.active and self.mode == "refuse" and bool(self._left)
                if reset:
                    self._left -= 1
                    self.faults += 1
                    if not self._left:
                        self.mode, self.active = "pass", False
            if reset:
                self._close(client)
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._socks |= {client, server}
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def fault(self, mode: str, at: bytes | None = None, requests: int | None = None,
              skip: int = 0) -> None:  # fmt: skip
        with self._lock:
            self.mode, self._at, self._left, self._skip = mode, at, requests, skip
            self.active = at is None
        if self.active and mode == "refuse" and requests is None:
            self._refuse()

    def heal(self) -> None:
        with self._lock:
            self.mode, self.active = "pass", False
            closed = self._listener is None
        if closed:
            self._listen()

    def _refuse(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            socks, self._socks = self._socks, set()
            self.faults += 1
        if listener is not None:
            listener.close()
        for s in socks:
            self._close(s)

    def _cut_at(self, data: bytes) -> int:
        """Where a request starting with ``data`` is cut: after its headers and half its
        body (``cut_after`` bytes without a Content-Length)."""
        end = data.find(b"\r\n\r\n")
        length = self._re.search(rb"(?i)\r\ncontent-length: *(\d+)", data)
        if end < 0 or length is None or int(length.group(1)) < 2:
            return self.cut_after
        return end + 4 + int(length.group(1)) // 2

    @staticmethod
    def _close(s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        with contextlib.suppress(OSError):
            s.close()

    def _pump(self, src: socket.socket, dst: socket.socket, request: bool) -> None:
        cutting = None  # bytes of this request still forwarded before the cut
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if request:
                    line = self._re.match(rb"(GET|PUT|POST|HEAD|DELETE) (\S+)", data)
                    if line:
                        self.seen.append(line.group(0))
                        with self._lock:
                            if not self.active and self._at is not None and self._re.search(self._at, line.group(0)):
                                self._skip -= 1
                                self.active = self._skip < 0
                            if self.active and self._left is not None and self._left <= 0:
                                self.mode, self.active = "pass", False  # its requests failed
                            mode = self.mode if self.active else "pass"
                            if mode != "pass":
                                self.faults += 1
                                if self._left is not None:
                                    self._left -= 1
                        if mode == "refuse" and self._left is None:
                            self._refuse()
                            return
                        if mode == "refuse":  # the next connections are reset: this one too
                            self._close(src)
                            self._close(dst)
                            return
                        if mode == "stall":
                            while src.recv(1 << 16):
                                pass
                            return
                        cutting = self._cut_at(data) if mode == "cut" else None
                    if cutting is not None:
                        dst.sendall(data[:cutting])
                        cutting -= len(data)
                        if cutting <= 0:
                            self._close(src)
                            self._close(dst)
                            return
                        continue
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
