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
