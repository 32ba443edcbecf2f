"""The content hash of a local model directory, computed once per content and then cached.

A local model is identified by :func:`directory_fingerprint`: sha256 over every file's
relative path and bytes (hidden files and ``__pycache__`` left out), so a run, a resume and
``jobs.reanalyze``'s run key change exactly when the weights, config or tokenizer change.
Hashing reads every byte: ~1.2 GiB/s on one core from the page cache (``bench.fingerprint``,
docs/benchmarks.md; 0.09 s for MiniLM's 88 MB, ~13 s for an 8B model in bf16, ~2 min for a 70B
one, more from a network filesystem), in the driver, before any work, at every run, resume and scheduled
re-analysis.

So the result is cached, keyed by the directory's **stat key**: sha256 over each file's
relative path, size, mtime, ctime, inode and device (:func:`stat_key`). Any write to a file
changes its ctime, which user space cannot set back (``touch`` and ``cp -p`` set mtime
only), and replacing a file changes its inode, so a changed directory gets a new key and is
hashed again; an unchanged one is not read at all. Files modified within the last
:data:`RACY_SECONDS` are not trusted to the cache (their timestamps may not yet tell a second
write in the same clock tick apart, as git's "racily clean" entries): such a directory is
hashed every time until it has been quiet for that long. The value is the same fingerprint
either way (the cache never changes what is computed, only whether it is recomputed).

The cache is one small JSON file per directory under :func:`cache_dir`: ``$EMBGEOM_CACHE_DIR``,
else ``$XDG_CACHE_HOME/embgeom_ray`` (if absolute), else ``~/.cache/embgeom_ray``; none for a
user without a home directory. ``EMBGEOM_CACHE_DIR=off`` turns it off. A cache that cannot be
read or written is ignored (the hash is computed).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

#: the environment variable naming the cache directory (``off``: no cache)
CACHE_ENV = "EMBGEOM_CACHE_DIR"
#: files changed this recently are not trusted to the cache (timestamp granularity)
RACY_SECONDS = 2.0
#: bumped when the cache's format or the fingerprint's definition changes
_FORMAT = 1


def _files(path: str) -> Iterator[tuple[str, str]]:
    """(relative path, full path) of every file hashed, in the hash's order."""
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for name in sorted(files):
            if not name.startswith("."):
                full = os.path.join(root, name)
                yield os.path.relpath(full, path), full


def content_fingerprint(path: str) -> str:
    """sha256 over every file's relative path and bytes: ``"sha256:<hex>"`` (reads everything)."""
    h = hashlib.sha256()
    for rel, full in _files(path):
        h.update(rel.encode() + b"\0")
        with open(full, "rb") as f:
            for block in iter(lambda f=f: f.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return "sha256:" + h.hexdigest()


def stat_key(path: str) -> tuple[str, float]:
    """(sha256 over each file's relative path, size, mtime, ctime, inode and device; the
    newest mtime or ctime among them, in seconds since the epoch)."""
    h = hashlib.sha256(f"{_FORMAT}\0".encode())
    newest = 0.0
    for rel, full in _files(path):
        st = os.stat(full)
        h.update(
            f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}\0{st.st_dev}\0".encode()
        )
        newest = max(newest, st.st_mtime, st.st_ctime)
    return h.hexdigest(), newest


def cache_dir() -> Path | None:
    """Where fingerprints are cached (module docstring), or None when turned off or when there
    is no home directory to put it in."""
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        return None if configured.strip().lower() in {"", "off", "0", "none"} else Path(configured)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):  # the XDG spec: a relative path is ignored
        return Path(xdg) / "embgeom_ray"
    home = os.path.expanduser("~")
    if not os.path.isabs(home):  # no HOME and no passwd entry (a container's arbitrary user)
        return None
    return Path(home) / ".cache" / "embgeom_ray"


def _entry(cache: Path, path: str) -> Path:
    real = os.path.realpath(path)
    return cache / "fingerprints" / (hashlib.sha256(real.encode()).hexdigest()[:32] + ".json")


def _read(entry: Path, key: str) -> str | None:
    try:
        data = json.loads(entry.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("stat_key") != key:
        return None
    value = data.get("fingerprint")
    return value if isinstance(value, str) and value.startswith("sha256:") else None


def _write(entry: Path, path: str, key: str, fingerprint: str) -> None:
    payload = {"path": os.path.realpath(path), "stat_key": key, "fingerprint": fingerprint}
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f)
        os.replace(tmp, entry)  # atomic: a concurrent reader sees the old entry or this one
    except OSError as exc:
        log.debug("fingerprint cache not written (%s): %s", entry, exc)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def directory_fingerprint(path: str) -> str:
    """:func:`content_fingerprint` of ``path``, from the cache when its stat key is unchanged.

    Equal to ``content_fingerprint(path)`` always; the cache only saves reading the files
    again (module docstring).
    """
    cache = cache_dir()
    if cache is None:
        return content_fingerprint(path)
    key, newest = stat_key(path)
    entry = _entry(cache, path)
    cached = _read(entry, key)
    if cached is not None:
        return cached
    fingerprint = content_fingerprint(path)
    # cache only what was stable while it was read, and not too fresh to tell apart
    after, newest_after = stat_key(path)
    if after == key and time.time() - max(newest, newest_after) > RACY_SECONDS:
        _write(entry, path, key, fingerprint)
    return fingerprint
