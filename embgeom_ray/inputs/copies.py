"""Another node's copy of a local corpus file, checked by the bytes its shard reads.

A local ``--corpus`` must be the same files on every node. Where a shard is read on a host
other than the planner's (:attr:`~embgeom_ray.inputs.corpus.Shard.planned_on`), its file's
modification time is that node's own, so :func:`~embgeom_ray.inputs.corpus.check_unchanged`
compares only its size and its last 4 KiB there: a copy of the same size and end with other
bytes in between (a fixed-width edit, a file regenerated to the same tail) would pass, and its
shards would fold other text than the run's plan and fingerprint name. So:

* where the copy's modification time is the planned one (``cp -p``, ``rsync -t``, a shared
  file system), it is trusted as rsync's quick check trusts it: no read beyond the shard's;
* where it is not, the extractor that read the shard computes :func:`shard_digest` of its
  copy once the shard has been read (its bytes are then in the page cache), and its result
  carries it with its host (:class:`CopyReading`);
* either way, the copy must not have been written from the shard's opening to the digest's
  end: its inode, size, modification and change times are taken before the read and
  compared after the digest (or the read, where none is needed): a copy rewritten meanwhile
  (an ``rsync`` still running, a regenerated file) ends the run (:class:`CorpusError`), since
  the text read and the bytes hashed could then differ; lines appended meanwhile pass, as
  :func:`~embgeom_ray.inputs.corpus.check_unchanged` lets them;
* the job's own process (the driver: it planned the corpus, so it sees the files) computes the
  same digest of its own copy and compares them (:func:`check_copy`) before any checkpoint
  group holding the shard is committed: a difference ends the run (:class:`CorpusError`).
  A driver not on the planner's host (a resume on another machine) is the reference once its
  copy has passed the same size and tail check.

The unit a digest covers is what the shard's reader reads of the file. An uncompressed line
file's: ``[start - 1, stop)`` (the byte before the range says where its first line begins)
and the rest of the line that crosses ``stop``, to its newline (the reader reads it to its
end, ``_iter_lines``), so a copy whose bytes differ anywhere a shard's text comes from, a
boundary's neighbourhood included, is found wherever each shard is read; lines appended
after the planned end are not read, and not covered. A compressed file's: its whole
compressed bytes (one shard). A Parquet file's: its row groups ``[start, stop)`` by their
byte spans in its footer (every column chunk, from its dictionary or first data page to its
end), and the footer itself (the schema, column names, codecs and encodings that say what
text those bytes hold). Each span's offset and length is hashed before its bytes, a line
file's end after them.
"""

from __future__ import annotations

import os
import socket
from concurrent.futures import CancelledError
from threading import Event
from typing import Any, NamedTuple

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from ..errors import CorpusError
from .corpus import (
    Shard,
    check_unchanged,
    classify,
    file_identity,
    open_error,
    open_exact,
    tail_digest,
)

__all__ = [
    "CopyReading",
    "ShardBytes",
    "check_copy",
    "needs_digest",
    "shard_digest",
]

#: bytes read at a time by :func:`shard_digest`
_CHUNK = 1 << 20
#: bytes read at a time past a line file's range, to the end of the line that crosses it
_LINE_CHUNK = 1 << 16
#: a Parquet file's trailer: its footer's length (4 bytes, little-endian) and ``PAR1``
_PARQUET_TRAILER = 8
#: the digest's name, as a result and an error carry it
ALGORITHM = "xxh3-128"


class ShardBytes(NamedTuple):
    """What :func:`shard_digest` covered of a file: the bytes ``[start, stop)`` it spans (a
    Parquet shard's row groups: from the first's first byte to the last's end) and their
    digest (hex)."""

    digest: str
    start: int
    stop: int


def _parquet_spans(f: Any, path: str, first: int, last: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of row groups ``[first, last)`` of the Parquet file ``f``, from its
    footer: each column chunk from its dictionary page (or first data page) for its compressed
    size; a row group's span from its chunks' first byte to their last."""
    try:
        md = pq.ParquetFile(f).metadata
    except (pa.ArrowException, OSError) as e:
        raise CorpusError(f"cannot read Parquet file {path}: {e}") from e
    spans = []
    for g in range(first, min(last, md.num_row_groups)):
        rg = md.row_group(g)
        lo, hi = None, 0
        for c in range(rg.num_columns):
            col = rg.column(c)
            begin = col.data_page_offset
            if col.has_dictionary_page and col.dictionary_page_offset:
                begin = min(begin, col.dictionary_page_offset)
            lo = begin if lo is None else min(lo, begin)
            hi = max(hi, begin + col.total_compressed_size)
        spans.append((lo or 0, hi - (lo or 0)))
    return spans


def _hash_span(h: Any, f: Any, offset: int, length: int, cancel: Event | None) -> bytes:
    """Hash ``length`` bytes of ``f`` from ``offset`` (fewer at its end), :data:`_CHUNK` at a
    time, stopping early where ``cancel`` is set (:class:`CancelledError`); the last byte
    hashed (b"" where none)."""
    f.seek(offset)
    last, left = b"", length
    while left > 0:
        if cancel is not None and cancel.is_set():
            raise CancelledError
        data = f.read(min(_CHUNK, left))
        if not data:
            break
        h.update(data)
        last, left = data[-1:], left - len(data)
    return last


def _hash_line_end(h: Any, f: Any, stop: int, last: bytes) -> int:
    """Past ``stop``, the rest of the line that crosses it, as the reader reads it to its end
    (``_iter_lines``): hashed up to and with its newline; the offset after it (at EOF: the
    file's end). ``last``: the byte at ``stop - 1``."""
    end = stop
    if last == b"\n":
        return end
    f.seek(stop)
    while data := f.read(_LINE_CHUNK):
        nl = data.find(b"\n")
        if nl >= 0:
            h.update(data[: nl + 1])
            return end + nl + 1
        h.update(data)
        end += len(data)
    return end


def _parquet_footer(f: Any, path: str) -> tuple[int, int]:
    """``(offset, length)`` of the Parquet file ``f``'s footer with its trailer: the schema,
    the column names, each chunk's codec and encodings, which say what text its bytes hold."""
    size = f.seek(0, 2)
    f.seek(max(0, size - _PARQUET_TRAILER))
    trailer = f.read(_PARQUET_TRAILER)
    length = int.from_bytes(trailer[:4], "little") + _PARQUET_TRAILER
    if len(trailer) < _PARQUET_TRAILER or trailer[4:] != b"PAR1" or length > size:
        raise CorpusError(f"cannot read Parquet file {path}: no Parquet footer at its end")
    return size - length, length


def shard_digest(shard: Shard, cancel: Event | None = None) -> ShardBytes:
    """XXH3-128 of the bytes of this host's copy of ``shard``'s file that its reader reads
    (module docstring): an uncompressed line file's ``[start - 1, stop)`` and the rest of the
    line crossing ``stop`` (a compressed file's: its whole compressed size), a Parquet file's
    row groups' byte spans and its footer; each span's ``offset:length`` hashed before its
    bytes, a line file's end after them. One read of those bytes, 1 MiB at a time; XXH3
    hashes at tens of GiB/s on one core, so the read is the cost (docs/benchmarks.md, "copy
    digests"). A file shorter than the range hashes what it holds: the digest then differs.
    ``cancel`` set: :class:`CancelledError` before the next MiB (a run ending)."""
    h = xxhash.xxh3_128()
    try:
        with open_exact(shard.path, None) as f:
            if shard.kind == "parquet":
                spans = _parquet_spans(f, shard.path, shard.start, shard.stop)
                for offset, length in [*spans, _parquet_footer(f, shard.path)]:
                    h.update(f"{offset}:{length};".encode("ascii"))
                    _hash_span(h, f, offset, length, cancel)
                start, stop = (spans[0][0], sum(spans[-1])) if spans else (0, 0)
            elif classify(shard.path)[1]:  # compressed: one shard, the whole file
                h.update(f"{shard.start}:{shard.stop - shard.start};".encode("ascii"))
                _hash_span(h, f, shard.start, shard.stop - shard.start, cancel)
                start, stop = shard.start, shard.stop
            else:  # the byte before the range (where its first line starts), and past it
                start = max(0, shard.start - 1)
                h.update(f"{start}:{shard.stop - start};".encode("ascii"))
                last = _hash_span(h, f, start, shard.stop - start, cancel)
                stop = _hash_line_end(h, f, shard.stop, last)
                h.update(f";{stop}".encode("ascii"))
    except (FileNotFoundError, PermissionError) as e:
        raise open_error(shard.path, e) from e
    return ShardBytes(h.hexdigest(), start, stop)


def needs_digest(shard: Shard) -> bool:
    """Whether a reader of ``shard`` here is to send :func:`shard_digest` of its copy: a local
    line or Parquet file planned on another host, whose modification time here is not the
    planned one. On the planner's host: False without a look at the file (no extra read)."""
    if not _other_hosts_copy(shard):
        return False
    fs, path = fsspec.core.url_to_fs(shard.path)
    try:
        return file_identity(fs, fs.info(path)) != shard.identity
    except (FileNotFoundError, PermissionError) as e:
        raise open_error(shard.path, e) from e


def _other_hosts_copy(shard: Shard) -> bool:
    """Whether ``shard`` is of a local line or Parquet file planned on a host other than this
    one (read here from this node's copy)."""
    return bool(
        shard.identity
        and shard.planned_on
        and shard.planned_on != socket.gethostname()
        and shard.kind in ("text", "jsonl", "parquet")
    )


def _file_state(shard: Shard) -> tuple[int, ...]:
    """This host's copy of ``shard``'s file as ``stat`` gives it: device, inode, size,
    modification and change times (ns). A write changes the change time, which no call can
    set back (``touch``, ``utime`` and ``cp -p`` set it to now), and a replacement
    (``rsync``'s rename) the inode."""
    _, path = fsspec.core.url_to_fs(shard.path)
    try:
        st = os.stat(path)
    except (FileNotFoundError, PermissionError) as e:
        raise open_error(shard.path, e) from e
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _written_since(shard: Shard, before: tuple[int, ...]) -> bool:
    """Whether ``shard``'s file here was written since its state was ``before``, other than by
    lines appended (the same inode, larger, its planned last 4 KiB the same: as
    :func:`~embgeom_ray.inputs.corpus.check_unchanged` lets a line file grow)."""
    now = _file_state(shard)
    if now == before:
        return False
    appended = now[:2] == before[:2] and now[2] > before[2] and bool(shard.tail)
    return not (appended and tail_digest(shard.path, shard.file_size) == shard.tail)


class CopyReading:
    """One read of ``shard`` by an extractor, as far as its copy's check goes: made before the
    shard is read (its file's :func:`_file_state`, and whether a digest is needed,
    :func:`needs_digest`); :meth:`result` after it. On the planner's host, or for a file of
    another kind, nothing (the planner's host compares the modification time as the shard is
    opened and once it has been read: :func:`~embgeom_ray.inputs.corpus.check_unchanged`)."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.before = _file_state(shard) if _other_hosts_copy(shard) else None
        self.needs = self.before is not None and needs_digest(shard)

    def result(self) -> dict[str, str] | None:
        """What the reader's result carries of its copy: its host and :func:`shard_digest`,
        where one is needed, else None; a :class:`CorpusError` where the copy was written
        since this reading began (the text read and the bytes hashed may differ)."""
        if self.before is None:
            return None
        copy = None
        if self.needs:
            copy = {"host": socket.gethostname(), ALGORITHM: shard_digest(self.shard).digest}
        if _written_since(self.shard, self.before):
            raise _written_meanwhile(self.shard, "read")
        return copy


def _written_meanwhile(shard: Shard, done: str) -> CorpusError:
    """The error of a copy written while its shard was ``done`` (read, checked) here."""
    return CorpusError(
        f"corpus file {shard.path} on {socket.gethostname()} was written while shard "
        f"{shard.shard_id} was {done} from it (its inode, size or times changed): a local "
        "--corpus must not change during a run (a copy or an rsync still running?); the same "
        "command resumes once it no longer changes"
    )


def check_copy(shard: Shard, copy: dict[str, str], cancel: Event | None = None) -> None:
    """In the driver: a :class:`CorpusError` where ``copy`` (a reader's :func:`copy_digest`)
    is not the digest of this host's copy of the same bytes, naming the file, both hosts and
    the bytes. This host's copy is checked first as a reader's is (:func:`check_unchanged`:
    on the planner's host its modification time, elsewhere its size and last 4 KiB), and
    must not be written while it is hashed (:func:`_file_state` before and after).
    ``cancel``: as :func:`shard_digest`'s (the scheduler's, set as it shuts down)."""
    check_unchanged(shard)
    before = _file_state(shard)
    mine = shard_digest(shard, cancel)
    if _written_since(shard, before):
        check_unchanged(shard)  # on the planner's host: the run's own message
        raise _written_meanwhile(shard, "checked")
    if mine.digest == copy[ALGORITHM]:
        return
    what = f"bytes [{mine.start:,}, {mine.stop:,})"
    if shard.kind == "parquet":
        what = f"row groups {shard.start}–{shard.stop - 1}, {what} and the footer,"
    raise CorpusError(
        f"corpus file {shard.path} on {copy['host']} is not the file on "
        f"{socket.gethostname()}: its {what} of shard {shard.shard_id} hold other data (same "
        f"size{' and last 4 KiB' if shard.tail else ''}, another modification time): a local "
        "--corpus must be the same files on every node (a shared file system, or copies made "
        "with cp -p or rsync -t); the same command resumes once they are, the shards done so far "
        "checked"
    )
