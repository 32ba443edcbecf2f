"""Digests of the files the job writes, recorded where each is written and checked on every read.

A flipped bit in a float64 array, or a partial object an object store served, still parses:
safetensors and Parquet would hand it over as data, and the tables would be wrong without a
word. So every file the job writes and later reads back (checkpoint groups, the reducers'
checkpoints, the statistics artefact and its parts, the tables, ``samples.parquet``,
``doc_hashes.npy``) gets a :class:`Digest` of its bytes when it is written, recorded in the
JSON that names the file (a group's JSON, a reducer's checkpoint JSON, ``statistics/index.json``,
``manifest.json``'s ``outputs.digests``), and every read checks the bytes it uses against it
(:class:`IntegrityError`, one line, naming the file and the bytes). Files written before
digests existed have none and load as before.

The digest is xxHash's XXH3 (64 bits) of each *block* of the file (4 MiB, larger for files
of more than 4,096 such blocks, at most 64 MiB: :func:`block_size`), as HDFS keeps a CRC per
chunk: a reader of a part of a file (a reducer reads its token range of every group; a layer
of the sample is one byte range; a Parquet reader reads the row groups it filters) checks the
blocks it touches (:class:`VerifiedFile`), not the whole file, and never reads more than a
block beyond each end of what it needs. XXH3 runs at ~26 GiB/s on one core here, so a digest
costs little next to writing the bytes (``docs/benchmarks.md``, "checksums").

:class:`FileRef` is a file's URL with its digest (None: not recorded), what the readers take.

The JSON files the job writes and reads back (``manifest.json``, ``run.json``, a group's JSON,
a reducer's checkpoint JSON, ``comparison.json``) carry their own digest instead, under the
key ``"digest"`` (:func:`seal`): a flipped bit in JSON mostly fails to parse, but one in a
digit (a count, a shard id) parses as another number. It is XXH3-64 of the document's
canonical form (keys sorted, no spaces, the ``"digest"`` key left out), so it holds for the
document's content however it was indented, and :func:`unseal` checks it on every read. A
document without one (an earlier version's) reads as before.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

from .errors import IntegrityError

#: the name recorded with every digest
ALGORITHM = "xxh3_64-blocks"
#: the smallest and largest block a digest covers
MIN_BLOCK, MAX_BLOCK = 4 << 20, 64 << 20
#: the blocks a file is cut into before its blocks grow past :data:`MIN_BLOCK`
TARGET_BLOCKS = 4096
_HASH_BYTES = 8


def block_size(size: int) -> int:
    """The block of a file of ``size`` bytes: :data:`MIN_BLOCK`, doubled while the file has
    more than :data:`TARGET_BLOCKS` blocks, at most :data:`MAX_BLOCK`."""
    block = MIN_BLOCK
    while block < MAX_BLOCK and size > block * TARGET_BLOCKS:
        block *= 2
    return block


def _hash(data: Any) -> bytes:
    return xxhash.xxh3_64_digest(data)


@dataclass(frozen=True)
class Digest:
    """The digests of a file's blocks: ``size`` bytes in blocks of ``block`` bytes (the last
    one shorter), ``hashes`` their XXH3-64 values back to back (8 bytes each)."""

    size: int
    block: int
    hashes: bytes

    @classmethod
    def of(cls, data: Any, block: int | None = None) -> Digest:
        """The digest of ``data`` (bytes, a bytearray, a uint8 array, a memoryview)."""
        view = memoryview(data).cast("B")
        size = view.nbytes
        block = block or block_size(size)
        return cls(size, block, b"".join(_hash(view[i : i + block]) for i in range(0, size, block)))

    @classmethod
    def of_file(cls, url: str) -> Digest:
        """The digest of the file at ``url`` (local path or fsspec URL), read a block at a
        time (a table staged in a temporary file before it is moved into place)."""
        import fsspec

        with fsspec.open(url, "rb") as f:
            size = f.seek(0, io.SEEK_END)
            f.seek(0)
            block = block_size(size)
            hashes = []
            while chunk := f.read(block):
                hashes.append(_hash(chunk))
        return cls(size, block, b"".join(hashes))

    @classmethod
    def of_stream(cls, size: int, blocks: Iterable[Any], into: list[Digest]) -> Iterator[Any]:
        """``blocks`` (consecutive pieces of ``size`` bytes, any bytes-like objects) passed on
        as they come, hashed on the way: once they are all read, their :meth:`of` is appended
        to ``into`` (a write of a file made a block at a time records its digest as it goes).
        Raises ValueError where the pieces do not add up to ``size``."""
        block = block_size(size)
        carry = bytearray()
        hashes: list[bytes] = []
        seen = 0
        for data in blocks:
            view = memoryview(data).cast("B")
            seen += view.nbytes
            if carry:
                take = view[: block - len(carry)]
                carry += take
                view = view[take.nbytes :]
                if len(carry) == block:
                    hashes.append(_hash(carry))
                    carry.clear()
            whole = view.nbytes - view.nbytes % block
            hashes.extend(_hash(view[i : i + block]) for i in range(0, whole, block))
            carry += view[whole:]
            yield data
        if seen != size:
            raise ValueError(f"a stream of {size:,} bytes gave {seen:,}")
        if carry:
            hashes.append(_hash(carry))
        into.append(cls(size, block, b"".join(hashes)))

    @property
    def blocks(self) -> int:
        return len(self.hashes) // _HASH_BYTES

    def block_hash(self, index: int) -> bytes:
        return self.hashes[index * _HASH_BYTES : (index + 1) * _HASH_BYTES]

    def to_json(self) -> dict[str, Any]:
        return {
            "algorithm": ALGORITHM,
            "size": self.size,
            "block": self.block,
            "hashes": base64.b64encode(self.hashes).decode("ascii"),
        }

    @classmethod
    def from_json(cls, record: Mapping[str, Any] | None) -> Digest | None:
        """The digest of a record :meth:`to_json` wrote; None for none, or for a record of an
        algorithm this version does not know (that file is read unchecked)."""
        if not record or record.get("algorithm") != ALGORITHM:
            return None
        return cls(int(record["size"]), int(record["block"]), base64.b64decode(record["hashes"]))

    def check(self, data: Any, url: str) -> None:
        """Raise :class:`IntegrityError` unless ``data`` is the whole file this digests."""
        view = memoryview(data).cast("B")
        if view.nbytes != self.size:
            raise IntegrityError(url, f"it holds {view.nbytes:,} bytes, {self.size:,} were written")
        for i in range(self.blocks):
            start = i * self.block
            self.check_block(i, view[start : start + self.block], url)

    def check_block(self, index: int, data: Any, url: str) -> None:
        """Raise :class:`IntegrityError` unless ``data`` is block ``index`` of the file."""
        if index >= self.blocks or _hash(data) != self.block_hash(index):
            start = index * self.block
            end = min(start + self.block, self.size)
            raise IntegrityError(
                url, f"bytes {start:,}-{end:,} (block {index + 1} of {self.blocks}) do not match "
                "the digest recorded when it was written"
            )


@dataclass(frozen=True)
class FileRef:
    """A file's URL and the digest recorded when it was written (None: none recorded)."""

    url: str
    digest: Digest | None = None

    def __str__(self) -> str:
        return self.url


def as_ref(source: str | FileRef) -> FileRef:
    """``source`` as a :class:`FileRef` (a bare URL has no digest)."""
    return source if isinstance(source, FileRef) else FileRef(str(source))


def digests_json(digests: Mapping[str, Digest]) -> dict[str, Any]:
    """File name -> :meth:`Digest.to_json`."""
    return {name: d.to_json() for name, d in digests.items()}


def digests_from_json(record: Mapping[str, Any] | None) -> dict[str, Digest]:
    """File name -> :class:`Digest` of a record :func:`digests_json` wrote (those of an
    unknown algorithm left out)."""
    out = {}
    for name, value in (record or {}).items():
        digest = Digest.from_json(value)
        if digest is not None:
            out[name] = digest
    return out


def integrity_error(exc: BaseException) -> IntegrityError | None:
    """The :class:`~embgeom_ray.errors.IntegrityError` that ``exc`` is, or that a Ray task or
    actor raised (Ray hands it over wrapped, with the error as its ``cause``); else None."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, IntegrityError):
        return cause
    return exc if isinstance(exc, IntegrityError) else None


def read_verified(source: str | FileRef) -> bytes:
    """The whole file at ``source``, checked against its digest when it has one."""
    from .io_utils import read_bytes

    ref = as_ref(source)
    data = read_bytes(ref.url)
    if ref.digest is not None:
        ref.digest.check(data, ref.url)
    return data


class VerifiedFile(io.RawIOBase):
    """A binary file (open, seekable) whose reads are checked against ``digest``: each block
    a read touches is read whole and checked the first time (the last two blocks read are kept
    for the reads that follow), so a reader of a part checks what it reads and a block more at
    most at each end. Without a digest, the file's own reads."""

    def __init__(self, f: Any, digest: Digest | None, url: str, *, owns: bool = False) -> None:
        super().__init__()
        self._f, self._digest, self.url, self._owns = f, digest, url, owns
        self._pos = 0
        self._checked: set[int] = set()
        self._kept: dict[int, bytes] = {}

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        if self._owns and not self.closed:
            self._f.close()
        super().close()

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            self._pos = offset
        elif whence == io.SEEK_CUR:
            self._pos += offset
        else:
            self._pos = self.size() + offset
        return self._pos

    def size(self) -> int:
        if self._digest is not None:
            return self._digest.size
        here = self._f.tell()
        end = self._f.seek(0, io.SEEK_END)
        self._f.seek(here)
        return end

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(view.nbytes, self.size() - self._pos))
        self.read_range_into(self._pos, view[:n])
        self._pos += n
        return n

    def read_range(self, start: int, end: int) -> bytearray:
        """Bytes ``start`` to ``end`` of the file (a bytearray: writable, so arrays made
        from it need no copy)."""
        out = bytearray(end - start)
        self.read_range_into(start, memoryview(out))
        return out

    def read_range_into(self, start: int, out: memoryview) -> None:
        end = start + out.nbytes
        if self._digest is None:
            self._f.seek(start)
            got = self._f.readinto(out) if hasattr(self._f, "readinto") else None
            if got is None:
                data = self._f.read(out.nbytes)
                out[: len(data)] = data
                got = len(data)
            if got != out.nbytes:
                raise IntegrityError(self.url, f"it ends before byte {end:,}")
            return
        block = self._digest.block
        if end > self._digest.size:
            raise IntegrityError(self.url, f"a read of bytes up to {end:,} is past its end")
        index = start // block
        while start < end:
            lo = index * block
            hi = min(lo + block, self._digest.size)
            if start == lo and end >= hi and index not in self._kept:
                part = out[: hi - lo]  # the whole block lands in the output: read it there
                self._read_block_into(index, part)
            else:
                data = self._block(index)
                part = out[: min(end, hi) - start]
                part[:] = data[start - lo : start - lo + part.nbytes]
            out = out[part.nbytes :]
            start += part.nbytes
            index += 1

    def _read_block_into(self, index: int, out: memoryview) -> None:
        self._f.seek(index * self._digest.block)  # type: ignore[union-attr]
        got = 0
        while got < out.nbytes:
            data = self._f.read(out.nbytes - got)
            if not data:
                break
            out[got : got + len(data)] = data
            got += len(data)
        self._check(index, out[:got])

    def _block(self, index: int) -> bytes:
        if index in self._kept:
            return self._kept[index]
        digest = self._digest
        assert digest is not None
        size = min(digest.block, digest.size - index * digest.block)
        data = bytearray(size)
        self._read_block_into(index, memoryview(data))
        if len(self._kept) >= 2:
            self._kept.pop(next(iter(self._kept)))
        self._kept[index] = bytes(data)
        return self._kept[index]

    def _check(self, index: int, data: memoryview) -> None:
        if index not in self._checked:
            self._digest.check_block(index, data, self.url)  # type: ignore[union-attr]
            self._checked.add(index)


def open_verified(source: str | FileRef) -> VerifiedFile:
    """``source`` opened for reading through :class:`VerifiedFile` (close it, or use it in a
    ``with`` block)."""
    import fsspec

    ref = as_ref(source)
    return VerifiedFile(fsspec.open(ref.url, "rb").open(), ref.digest, ref.url, owns=True)


#: the key of a JSON document's own digest (:func:`seal`)
SEAL_KEY = "digest"
#: the prefix of a sealed document's digest: the algorithm
SEAL_ALGORITHM = "xxh3_64:"


def _canonical(doc: Mapping[str, Any]) -> bytes:
    """``doc`` without its :data:`SEAL_KEY`, as JSON in one canonical form: keys sorted, no
    spaces (values as JSON gives them back: ``default=str`` as the job writes them)."""
    body = {k: v for k, v in doc.items() if k != SEAL_KEY}
    plain = json.loads(json.dumps(body, default=str))
    return json.dumps(plain, sort_keys=True, separators=(",", ":")).encode()


def seal(doc: Mapping[str, Any]) -> dict[str, Any]:
    """``doc`` with its digest under :data:`SEAL_KEY`: ``"xxh3_64:<16 hex digits>"`` of its
    canonical form (any earlier digest replaced)."""
    body = {k: v for k, v in doc.items() if k != SEAL_KEY}
    return body | {SEAL_KEY: SEAL_ALGORITHM + xxhash.xxh3_64_hexdigest(_canonical(body))}


def unseal(doc: Any, url: str) -> Any:
    """``doc`` (a JSON document read from ``url``) without its digest, once it matches;
    :class:`IntegrityError` when it does not. A document without a digest (an earlier
    version's), or with one of another algorithm, or that is not an object, is returned as
    it is."""
    if not isinstance(doc, dict) or not str(doc.get(SEAL_KEY, "")).startswith(SEAL_ALGORITHM):
        return doc
    body = {k: v for k, v in doc.items() if k != SEAL_KEY}
    if SEAL_ALGORITHM + xxhash.xxh3_64_hexdigest(_canonical(body)) != doc[SEAL_KEY]:
        raise IntegrityError(
            url, f"its content does not match the {SEAL_KEY!r} recorded when it was written"
        )
    return body
