"""Atomic writes to local paths and fsspec URLs.

Nothing is ever half-written under its final name: local files are written to a temporary
name in the same directory, flushed and fsynced, then renamed with :func:`os.replace`; object
stores (s3://, gs://, …) make a single PUT, or a completed multipart upload, visible
atomically, so they are written directly (S3's large objects in parts a few at a time:
:data:`S3_PART_BYTES`; other stores through their file, a block at a time, discarded on a
failure: :func:`_write_remote`; either way the write's memory stays near the data's own).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from typing import Any, BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem

_UMASK = os.umask(0)
os.umask(_UMASK)

#: how long the job waits for an object store and how often it retries, where fsspec's own
#: configuration (``FSSPEC_S3='{"config_kwargs": {...}}'``, fsspec's config files) says
#: nothing: botocore's timeouts and its "standard" retries, 6 attempts a request with
#: exponential backoff and jitter (waits of up to 1, 2, 4, 8 and 16 s). A store that refuses
#: connections is given up on after those 6 attempts (31 s of waits at most, 15 s on
#: average); a connection dropped mid-request, or one that stalls past ``read_timeout``, is
#: also retried by s3fs's own loop of 5 tries, so a store that accepts and stalls is given up
#: on after 5 × 6 × 20 s = 10 minutes. The job then stops, resumable
#: (:func:`embgeom_ray.storage.resumable`).
STORE_DEFAULTS: dict[str, dict[str, Any]] = {
    "s3": {
        "config_kwargs": {
            "connect_timeout": 10,
            "read_timeout": 20,
            "retries": {"mode": "standard", "total_max_attempts": 6},
        }
    }
}


#: the protocols whose fsspec settings in this process are :data:`STORE_DEFAULTS` alone (no one
#: had set any), as :func:`apply_store_defaults` made them (:func:`store_defaults_only`)
_FROM_DEFAULTS: dict[str, dict[str, Any]] = {}


def store_defaults_only(protocol: str) -> bool:
    """Whether this process's fsspec settings of ``protocol`` are the job's defaults alone, as
    :func:`apply_store_defaults` made them where there were none: settings an extractor takes
    from the job's own process (:func:`embgeom_ray.storage.use_storage_access`) replace them,
    as they would have had the defaults not been applied first."""
    import fsspec.config

    made = _FROM_DEFAULTS.get(protocol)
    return made is not None and fsspec.config.conf.get(protocol) == made


def apply_store_defaults() -> None:
    """Merge :data:`STORE_DEFAULTS` into fsspec's configuration under what it already holds
    (each filesystem made after this applies them; the user's settings win), and send S3
    uploads without ``Expect: 100-continue``.

    botocore asks for that header on every PutObject and UploadPart, and aiohttp (under
    s3fs) then waits for the store's "100 Continue" with no timeout at all: a store that
    accepts the request and stalls hung the job for good (seen through a stalling proxy,
    ``tests/runs/test_storage_faults.py``). Without it the body goes at once and botocore's
    ``read_timeout`` and retries apply to the answer. Done before any botocore session is
    made (a session registers botocore's handlers when it is made)."""
    import fsspec.config

    for protocol, defaults in STORE_DEFAULTS.items():
        conf = fsspec.config.conf.setdefault(protocol, {})
        empty = not conf
        for key, value in defaults.items():
            given = conf.get(key)
            conf[key] = (value | given) if isinstance(value, dict) and isinstance(given, dict) else conf.get(key, value)
        if empty:
            _FROM_DEFAULTS[protocol] = copy.deepcopy(conf)
    try:
        from botocore import handlers
    except ImportError:  # no S3 here
        return
    handlers.BUILTIN_HANDLERS[:] = [
        h for h in handlers.BUILTIN_HANDLERS if h[1] is not handlers.add_expect_header
    ]


apply_store_defaults()  # in every process that reads or writes a run: the driver, actors, tasks


def is_local(url: str) -> bool:
    fs, _ = fsspec.core.url_to_fs(url)
    return isinstance(fs, LocalFileSystem)


#: the URL schemes of fsspec's local filesystem
LOCAL_SCHEMES = ("file://", "local://")


def local_path(url: str) -> str:
    """The filesystem path of a local URL (``file://x`` or ``local://x`` -> ``x``)."""
    scheme = next((s for s in LOCAL_SCHEMES if url.startswith(s)), "")
    return url[len(scheme) :]


def location(url: str) -> str:
    """A comparable form of a file or directory's URL: the absolute real path of a local one
    (links resolved), the URL without a trailing ``/`` of a remote one."""
    return os.path.realpath(local_path(url)) if is_local(url) else url.rstrip("/")


def path_key(url: str) -> str:
    """:func:`location` without touching the filesystem, for many paths at once (a corpus may
    list millions of files): a local path made absolute and normalised (links not resolved),
    a remote URL without a trailing ``/``."""
    if "://" in url and not url.startswith(LOCAL_SCHEMES):
        return url.rstrip("/")
    return os.path.normpath(os.path.abspath(local_path(url)))


def within(url: str, directory: str) -> bool:
    """Whether ``url`` is ``directory`` or lies under it (:func:`location` of both)."""
    here, there = location(url), location(directory)
    return here == there or here.startswith(there.rstrip("/") + "/")


def _write_local(url: str, write: Callable[[BinaryIO], None]) -> None:
    """``write(f)`` into a temporary file beside the local ``url``, synced, then moved into
    place: readers see the old file or the whole new one, and a failed write leaves neither."""
    path = local_path(url)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; give the usual permissions
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(url: str, data: bytes) -> None:
    """Write ``data`` to ``url`` so that readers see the old file or the whole new one."""
    if is_local(url):
        _write_local(url, lambda f: f.write(data))
    elif _protocol(url) in ("s3", "s3a"):  # no "directory" made first: buckets are not made
        _put_s3(url, data)  # by the job
    else:  # one PUT, or an upload of the filesystem's blocks (gcsfs: resumable)
        _write_remote(url, [data], memoryview(data).nbytes)


def _write_remote(url: str, blocks: Iterable[Any], size: int) -> None:
    """``size`` bytes given as ``blocks`` (bytes-like) to an object store other than S3
    (``gs://``, …) through its fsspec file, a slice of the file's block size at a time, so
    that the file's buffer never holds more than a block and a slice (a whole ``write`` of
    the data would copy it into the buffer first). The object is made when the file closes
    (gcsfs: the resumable upload finished); on a failure, or blocks that do not add up to
    ``size``, the upload is discarded instead and nothing is made (:func:`_discard`)."""
    fs, path = fsspec.core.url_to_fs(url)
    f = fs.open(path, "wb")
    try:
        step = int(getattr(f, "blocksize", 0) or 0)  # 0: a file without blocks of its own
        written = 0
        for block in blocks:
            view = memoryview(block).cast("B")
            for at in range(0, view.nbytes, step or max(1, view.nbytes)):
                piece = view[at : at + step] if step else view
                f.write(piece)
                written += piece.nbytes
        if written != size:
            raise ValueError(f"{url}: {size:,} bytes to write, {written:,} given")
    except BaseException:
        _discard(f)
        raise
    f.close()


def _discard(f: Any) -> None:
    """Throw away an fsspec file's upload without making the object: the filesystem's own
    ``discard`` (gcsfs cancels the resumable upload), then the file marked closed, so that
    neither ``close`` nor its collection uploads what it buffered and finishes the object."""
    with contextlib.suppress(Exception):
        f.discard()
    with contextlib.suppress(AttributeError):
        f.closed = True


def atomic_write_blocks(url: str, blocks: Iterable[Any], size: int) -> None:
    """:func:`atomic_write_bytes` of ``size`` bytes given as consecutive ``blocks`` (bytes-like
    objects, each written as it comes and not kept): a file made a block at a time is written
    without a copy of it whole. Raises ValueError, writing nothing, where they do not add up to
    ``size``."""

    def write(f: BinaryIO) -> None:
        written = sum(f.write(block) for block in blocks)
        if written != size:
            raise ValueError(f"{url}: {size:,} bytes to write, {written:,} given")

    if is_local(url):
        _write_local(url, write)
    elif _protocol(url) in ("s3", "s3a") and size >= 2 * s3_part_bytes(size):
        fs, path = fsspec.core.url_to_fs(url)
        fs.pipe_file(
            path, _StreamedParts(blocks, size), chunksize=s3_part_bytes(size),
            max_concurrency=s3_parts_at_once(size),
        )  # fmt: skip
    elif _protocol(url) in ("s3", "s3a"):  # small enough for one request: gathered
        data = io.BytesIO()
        write(data)
        atomic_write_bytes(url, data.getbuffer())
    else:
        _write_remote(url, blocks, size)


#: an S3 object of more than 2 parts is uploaded in parts of this many bytes (more for an
#: object of more than :data:`S3_MAX_PARTS` of them: :func:`s3_part_bytes`), a few at a time
#: (:func:`s3_parts_at_once`, s3fs's ``pipe_file``). Through s3fs's buffered file
#: (``f.write(data)``) a write of 1.18 GB held 3.5 GB beside it, 3 copies of the data: the
#: file's buffer, its parts, the requests' bodies (moto on loopback, peak resident memory);
#: this way 0.44 GB, two copies of each part in flight (:func:`upload_buffer_bytes`). A
#: part's bytes are copied out of the data as it is sent (botocore takes bytes, not views),
#: whatever the data's type (bytes, or a uint8 array from Ray's store)
S3_PART_BYTES = 50 * 2**20
#: the parts of one upload in flight: at least this many ...
S3_PARTS_AT_ONCE = 4
#: ... and at most this many: about 1.3 GiB/s at the ~85–90 MB/s one connection to S3 carries
#: (AWS's S3 performance guidelines: one concurrent request for each 85–90 MB/s wanted), past
#: the 1 GiB/s a writer that the plans' checkpoint intervals take (docs/sizing.md)
S3_PARTS_AT_ONCE_MAX = 16
#: one part in flight for every this many parts of the object (:func:`s3_parts_at_once`)
S3_PARTS_PER_CONNECTION = 8
#: the most parts of one multipart upload (S3, and MinIO's and moto's S3 APIs alike: a part
#: numbered past it is refused, and the upload fails where it gets there)
S3_MAX_PARTS = 10_000
#: the block of another object store's fsspec file, at most (gcsfs: resumable uploads of
#: 50 MiB blocks), which :func:`_write_remote` fills a slice at a time
REMOTE_BLOCK_BYTES = 50 * 2**20


def s3_part_bytes(size: int) -> int:
    """The parts of an S3 upload of ``size`` bytes: :data:`S3_PART_BYTES`, or, for an object
    that would take more than :data:`S3_MAX_PARTS` of those (past 488 GiB: a 70B model's host
    tier of 747 GiB), the least whole number of MiB that keeps it within them (77 MiB)."""
    least = -(-int(size) // S3_MAX_PARTS)
    return max(S3_PART_BYTES, -(-least // 2**20) * 2**20)


def s3_parts_at_once(size: int) -> int:
    """The parts of an S3 upload of ``size`` bytes sent at once: one for every
    :data:`S3_PARTS_PER_CONNECTION` parts of the object, from :data:`S3_PARTS_AT_ONCE` to
    :data:`S3_PARTS_AT_ONCE_MAX`. An object of a few GiB goes up four parts at a time as
    before (a 1.18 GB one: 23 parts, 4 at once); a checkpoint piece of tens or hundreds of GiB
    (an 8B or 70B model's flush) sixteen at a time, which a writer needs for the plans' 1 GiB/s
    (four connections carry ~0.35 GB/s). The parts in flight are what the upload holds beside
    the data (:func:`upload_buffer_bytes`), so they grow with the object: past the least four,
    what they hold is at most a quarter of its size."""
    parts = -(-int(size) // s3_part_bytes(size))
    return min(S3_PARTS_AT_ONCE_MAX, max(S3_PARTS_AT_ONCE, parts // S3_PARTS_PER_CONNECTION))


def upload_buffer_bytes(url: str, size: int) -> int:
    """u: what writing an object of ``size`` bytes to ``url`` holds beside the data, at most
    (the memory formulas of :mod:`embgeom_ray.sizing.formulas` count it for each process that
    writes to the run): nothing on a local disk; on S3 two copies of each part in flight
    (the part's bytes, and the request's body), 2 · min(parts, :func:`s3_parts_at_once`) ·
    :func:`s3_part_bytes` (400 MiB for an object of up to 39 parts of 50 MiB, 1.6 GiB from
    128 parts, 2.4 GiB for a 70B model's 747 GiB host tier in 77 MiB parts), or two copies
    of an object that goes up in one request (gathered, then its body); on other stores the
    file's block and a slice of it, 2 · min(size, :data:`REMOTE_BLOCK_BYTES`)."""
    size = int(size)
    protocol = _protocol(url)
    if protocol in ("file", "local"):
        return 0
    if protocol in ("s3", "s3a"):
        part = s3_part_bytes(size)
        if size < 2 * part:  # one request
            return 2 * size
        return 2 * min(-(-size // part), s3_parts_at_once(size)) * part
    return 2 * min(size, REMOTE_BLOCK_BYTES)


class _PartBytes:
    """``data`` (any bytes-like object) sliced into bytes a part at a time (``pipe_file``
    slices its data by part)."""

    def __init__(self, data: Any) -> None:
        self._view = memoryview(data).cast("B")

    def __len__(self) -> int:
        return self._view.nbytes

    def __getitem__(self, part: slice) -> bytes:
        return self._view[part].tobytes()


class _StreamedParts:
    """``size`` bytes given as consecutive ``blocks``, sliced into bytes a part at a time in
    order (``pipe_file`` slices its data by part, in order, before it sends them): one part
    and one block held at a time."""

    def __init__(self, blocks: Iterable[Any], size: int) -> None:
        self._blocks, self._size = iter(blocks), size
        self._pending = bytearray()
        self._at = 0  # the offset of the next slice

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, part: slice) -> bytes:
        start, stop = part.start or 0, min(part.stop, self._size)
        if start != self._at:
            raise ValueError(f"parts asked out of order: {start:,}, expected {self._at:,}")
        while len(self._pending) < stop - start:
            block = next(self._blocks, None)
            if block is None:
                raise ValueError(f"a stream of {self._size:,} bytes ended at {self._at + len(self._pending):,}")
            self._pending += memoryview(block).cast("B")
        out = bytes(self._pending[: stop - start])
        del self._pending[: stop - start]
        self._at = stop
        if stop == self._size and next(self._blocks, None) is not None:
            raise ValueError(f"a stream of {self._size:,} bytes gave more")
        return out


def _put_s3(url: str, data: Any) -> None:
    """``data`` as the S3 object at ``url``: one PUT, or a multipart upload of
    :data:`S3_PART_BYTES` parts (visible whole once completed, aborted on failure)."""
    fs, path = fsspec.core.url_to_fs(url)
    size = memoryview(data).nbytes
    if size < 2 * s3_part_bytes(size):  # s3fs puts it in one request
        body = data if isinstance(data, (bytes, bytearray)) else memoryview(data).tobytes()
        fs.pipe_file(path, body)
        return
    fs.pipe_file(
        path, _PartBytes(data), chunksize=s3_part_bytes(size),
        max_concurrency=s3_parts_at_once(size),
    )  # fmt: skip


def put_file(path: str, url: str) -> None:
    """The local file ``path`` uploaded as the object ``url`` (made whole once uploaded); S3's
    in the parts of :func:`s3_part_bytes`, :func:`s3_parts_at_once` at a time (what
    :func:`upload_buffer_bytes` counts), not s3fs's own ten at once."""
    fs, key = fsspec.core.url_to_fs(url)
    if _protocol(url) in ("s3", "s3a"):
        size = os.path.getsize(path)
        parts = {"chunksize": s3_part_bytes(size), "max_concurrency": s3_parts_at_once(size)}
        fs.put_file(path, key, **parts)
    else:
        fs.put_file(path, key)


def _protocol(url: str) -> str:
    """The URL's filesystem protocol (``s3`` for ``s3://b/k``; ``file`` for a path)."""
    return url.split("://", 1)[0] if "://" in url else "file"


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
