"""Atomic writes to local paths and fsspec URLs.

Nothing is ever half-written under its final name: local files are written to a temporary
name in the same directory, flushed and fsynced, then renamed with :func:`os.replace`; object
stores (s3://, gs://, …) make a single PUT visible atomically, so they are written directly.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

_UMASK = os.umask(0)
os.umask(_UMASK)


def is_local(url: str) -> bool:
    fs, _ = fsspec.core.url_to_fs(url)
    return isinstance(fs, LocalFileSystem)


def local_path(url: str) -> str:
    """The filesystem path of a local URL (``file://x`` -> ``x``)."""
    return url[len("file://") :] if url.startswith("file://") else url


def atomic_write_bytes(url: str, data: bytes) -> None:
    """Write ``data`` to ``url`` so that readers see the old file or the whole new one."""
    if is_local(url):
        path = local_path(url)
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
        try:
            os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; give the usual permissions
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    else:
        with fsspec.open(url, "wb") as f:
            f.write(data)


def atomic_write_json(url: str, obj: Any) -> None:
    atomic_write_bytes(
        url, (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode()
    )


def join(base: str, *parts: str) -> str:
    """Join URL or path parts with '/'."""
    out = base.rstrip("/")
    for p in parts:
        out = f"{out}/{p.strip('/')}"
    return out


def exists(url: str) -> bool:
    fs, path = fsspec.core.url_to_fs(url)
    return bool(fs.exists(path))


def read_bytes(url: str) -> bytes:
    with fsspec.open(url, "rb") as f:
        return f.read()


def remove(url: str) -> None:
    """Remove a file or directory tree at ``url`` if it exists."""
    fs, path = fsspec.core.url_to_fs(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)
