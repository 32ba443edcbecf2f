"""Corpus sources, a deterministic shard plan, and shard readers.

A corpus is named by one string (:class:`CorpusSpec.source`):

* a file, a glob or a directory, local or any fsspec URL (``s3://``, ``gs://``, ``memory://``,
  ``file://``). Directories are searched recursively; hidden files and folders (``.name``) and
  markers such as ``_SUCCESS`` or ``_temporary/`` (``_name``) are ignored, as are files of other
  types. Supported files: ``.txt``/``.text`` (one document per non-empty line),
  ``.jsonl``/``.json``/``.ndjson`` (JSON Lines, the text in ``text_column``) and
  ``.parquet``/``.pq`` (the ``text_column``), the line formats optionally compressed (``.gz``,
  ``.bz2``, ``.xz``, ``.zst``);
* a directory written by ``datasets.Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``),
  detected automatically and opened with ``datasets.load_from_disk``;
* ``hf:NAME`` or ``hf:NAME:CONFIG``, a Hugging Face dataset opened with
  ``datasets.load_dataset(NAME, CONFIG, split=split)``.

:func:`plan_shards` cuts the corpus into shards that depend only on the corpus and the shard
size (by default from the corpus's size and the model's work a token), never on the number of
workers, so shard ids are stable and a resumed run can skip the
shards it has finished. Line files are cut at byte offsets like Hadoop input splits: a shard owns
every line whose first byte lies in ``[start, stop)``, so every line is read exactly once
whatever the shard size. Parquet files are cut between row groups, datasets between rows.

:func:`read_shard` yields :class:`Document` objects whose ``doc_id`` depends only on the file's
path relative to the corpus root and the line's byte offset (or the row index), never on the
sharding. Items that are not documents (empty lines, invalid JSON, non-text values, ...) are
skipped and counted by reason in a :class:`ReadReport`; mistakes the user must fix (missing
files, missing columns, unreadable files) raise :class:`~embgeom_ray.errors.CorpusError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gzip
import hashlib
import json
import lzma
import posixpath
import re
import socket
import zlib
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

import fsspec
import fsspec.compression
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from embgeom_ray.errors import ConfigError, CorpusError
from embgeom_ray.storage import check_input, storage_error, user_errors

__all__ = [
    "SUPPORTED_EXTENSIONS",
    "CorpusSpec",
    "Document",
    "ReadReport",
    "Shard",
    "ShardPlan",
    "auto_shard_bytes",
    "auto_shard_cap",
    "column_notices",
    "document_id",
    "ignored_notices",
    "plan_shards",
    "read_shard",
    "shard_rule",
    "token_work",
]

#: File extension -> shard kind.
SUPPORTED_EXTENSIONS: dict[str, str] = {
    ".txt": "text",
    ".text": "text",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
}
#: Compression suffix -> fsspec compression name (line formats only).
COMPRESSION_EXTENSIONS: dict[str, str] = {
    ".gz": "gzip",
    ".bz2": "bz2",
    ".xz": "xz",
    ".zst": "zstd",
}

#: the default shard's bytes of text lie within these, a 16th of the corpus between them
#: (:func:`auto_shard_bytes`). An extractor folds many shards into one running state, so a
#: shard costs no statistics of its own; what its size sets is time: flushes come between
#: shards, so a shard is the least work a failure can cost an extractor, and the last shards
#: of a run are the tail its other extractors wait through. 16 MiB is ≈ 4.2 M tokens: ≈ 200 s
#: of an 8B model's extractor on an H100 (docs/sizing.md), minutes of MiniLM's on a CPU; a
#: model of more work a token gets the same ≈ 200 s in fewer bytes (:func:`auto_shard_cap`)
MIN_AUTO_SHARD_BYTES = 1 << 20
MAX_AUTO_SHARD_BYTES = 16 << 20
#: a model's work a token, as the default shard counts it: its blocks · d² (a block's weights
#: and the fold of its hidden state both grow as d²); this is Llama 3 8B's (32 blocks,
#: d = 4,096), whose extractor takes ≈ 200 s for 16 MiB. A model of W times this gets default
#: shards of at most 16 MiB / W, so that its shard too is ≈ 200 s of its extractor, well within
#: the checkpoint interval's ceiling of 1 h (Llama 3 70B: 80 blocks at d = 8,192, W = 10,
#: 1.6 MiB instead of ≈ 2,000 s)
REFERENCE_TOKEN_WORK = 32 * 4096**2
#: past this many shards the default shard grows instead: the shard plan is held and saved
#: whole by the job's own process (a few hundred bytes a shard), so a corpus of any size
#: keeps its plan within tens of MiB
MAX_AUTO_SHARDS = 65_536
#: Lines inspected at plan time to decide that a JSON Lines file holds no JSON object at all.
JSONL_HEAD_LINES = 64

_PLAN_FORMAT = 1
_READ_CHUNK = 1 << 20
#: what the plan reads of a line file's head (its encoding, its first JSON object) at a time,
#: and a shard's reader of the line that crosses its end
_HEAD_CHUNK = 1 << 16
_BATCH_ROWS = 1024
_PLAN_THREADS = 16
_BOM = b"\xef\xbb\xbf"
#: byte-order marks of the encodings a text file may be in that are not UTF-8 (longest first:
#: UTF-32 LE's begins with UTF-16 LE's). Their text read as UTF-8 would be every other byte NUL.
_FOREIGN_BOMS = (
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe", "UTF-16"),
    (b"\xfe\xff", "UTF-16"),
)
_MAGIC = re.compile(r"[*?\[]")
# A remote file's cheap identity: the first of these keys that its fsspec `info` has.
_IDENTITY_KEYS = (
    "ETag",
    "etag",
    "md5Hash",
    "crc32c",
    "checksum",
    "generation",
    "mtime",
    "LastModified",
    "last_modified",
    "modified",
    "created",
)
_DECOMPRESSION_ERRORS = (EOFError, zlib.error, lzma.LZMAError, gzip.BadGzipFile)


# --------------------------------------------------------------------------------------------
# Public types


@dataclass(frozen=True)
class CorpusSpec:
    """Where the corpus is and which column holds the text.

    ``source`` is a file, a glob, a directory (local or fsspec URL), a ``save_to_disk`` dataset
    directory, or ``hf:NAME`` / ``hf:NAME:CONFIG``. ``text_column`` applies to JSON Lines,
    Parquet and datasets; ``split`` to datasets only.
    """

    source: str
    text_column: str = "text"
    split: str = "train"


class FileState(NamedTuple):
    """A corpus file as the plan found it: its ``identity`` (:func:`file_identity`: the
    modification time; an object's ETag, checksum or generation: what the fingerprint holds),
    its ``file_size``, and for an uncompressed line file the ``tail``: the BLAKE2b digest of its
    last :data:`TAIL_BYTES` bytes (:func:`tail_digest`), which lines appended since leave as
    they were; for a local file, ``planned_on``: the host whose file system the identity is
    of (a copy of the corpus on another node has modification times of its own).
    :func:`check_unchanged` compares them with the file's as a shard is read."""

    identity: str
    file_size: int
    tail: str
    planned_on: str = ""


#: the Shard fields :meth:`ShardPlan.to_json` leaves out of each shard: dedup's ``drop``
#: (found again on every run) and the file's state (saved once a file: ``file_states``)
_PER_FILE = ("drop", *FileState._fields)


@dataclass(frozen=True)
class Shard:
    """One unit of work: a byte range, a range of row groups, or a range of rows of one file.

    ``start``/``stop`` are byte offsets for ``text``/``jsonl`` (a compressed file is one shard
    covering its whole compressed size), row-group indices for ``parquet`` and row indices for
    ``hf``; ``stop`` is exclusive. ``file_index`` indexes :attr:`ShardPlan.files`.
    ``drop`` holds the ids of the shard's documents that :func:`read_shard` leaves out:
    duplicates of an earlier document, decided for the whole corpus by
    :func:`~embgeom_ray.inputs.dedup.plan_dedup` (``--dedup``); it is not part of the saved
    plan (:meth:`ShardPlan.to_json`), since it is derived from the corpus again on every run.
    ``identity``, ``file_size`` and ``tail`` are the file's state when the plan was cut
    (:attr:`ShardPlan.file_states`), which :func:`read_shard` checks (:func:`check_unchanged`);
    the plan saves them once a file, not with each shard. An empty ``identity``: not checked
    (a dataset's rows, an object store that gives none, a plan saved before they were).
    """

    shard_id: str
    path: str
    kind: str
    start: int
    stop: int
    file_index: int
    drop: tuple[int, ...] = ()
    identity: str = ""
    file_size: int = 0
    tail: str = ""
    planned_on: str = ""


@dataclass(frozen=True)
class Document:
    """A document: a stable 63-bit id (see :func:`document_id`) and its text."""

    doc_id: int
    text: str


@dataclass
class ShardPlan:
    """The shards of a corpus, in order, and the corpus identity they were cut from.

    ``fingerprint`` is a SHA-256 hex digest over each file's path relative to the corpus root,
    its size and a cheap identity (mtime for local files; ETag, checksum or generation from
    fsspec for remote ones; name, config, split and fingerprint for datasets), the text column
    and the shard size. ``files[i]`` is the file of the shards with ``file_index == i``.
    ``total_bytes`` is the files' total size (compressed size for compressed files); for a
    dataset, an estimate of its text column's size. ``shard_bytes`` is the shard size the plan
    was cut with (the resolved value when planned with auto). ``ignored`` lists the files of a
    directory corpus that are not read, being of no supported type (``README.md``, ``.csv``),
    and ``hidden`` those of a supported type that are not read, a name in their path starting
    with ``.`` or ``_`` (``_train.jsonl``, ``.ipynb_checkpoints/…``), each by its path
    relative to the corpus root; like ``Shard.drop`` they are not saved (:meth:`to_json`),
    being found again on every run, nor compared. ``file_states[i]`` is ``files[i]``'s state
    when planned (:class:`FileState`; none for a dataset, or a plan saved before them).
    """

    shards: list[Shard]
    fingerprint: str
    total_bytes: int
    files: list[str]
    shard_bytes: int = 0
    ignored: list[str] = field(default_factory=list, compare=False)
    hidden: list[str] = field(default_factory=list, compare=False)
    file_states: list[FileState] = field(default_factory=list)

    def with_file_states(self) -> ShardPlan:
        """Give each shard its file's :attr:`file_states` (in place, where there are any);
        returns this plan."""
        if self.file_states:
            self.shards = [
                dataclasses.replace(s, **self.file_states[s.file_index]._asdict())
                for s in self.shards
            ]
        return self

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict that :meth:`from_json` turns back into an equal plan."""
        return {
            "format": _PLAN_FORMAT,
            "fingerprint": self.fingerprint,
            "total_bytes": self.total_bytes,
            "shard_bytes": self.shard_bytes,
            "files": list(self.files),
            "file_states": [list(state) for state in self.file_states],
            "shards": [
                {k: v for k, v in dataclasses.asdict(s).items() if k not in _PER_FILE}
                for s in self.shards
            ],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ShardPlan:
        """Rebuild a plan saved with :meth:`to_json`."""
        try:
            if d.get("format", _PLAN_FORMAT) != _PLAN_FORMAT:
                raise ValueError(f"unknown plan format {d.get('format')!r}")
            states = [FileState(str(i), int(n), str(t), *map(str, host))
                      for i, n, t, *host in d.get("file_states", [])]  # fmt: skip
            return cls(
                shards=[
                    Shard(
                        shard_id=str(s["shard_id"]),
                        path=str(s["path"]),
                        kind=str(s["kind"]),
                        start=int(s["start"]),
                        stop=int(s["stop"]),
                        file_index=int(s["file_index"]),
                    )
                    for s in d["shards"]
                ],
                fingerprint=str(d["fingerprint"]),
                total_bytes=int(d["total_bytes"]),
                files=[str(f) for f in d["files"]],
                shard_bytes=int(d.get("shard_bytes", 0)),
                file_states=states,
            ).with_file_states()
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorpusError(f"invalid saved shard plan: {type(e).__name__}: {e}") from e


@dataclass
class ReadReport:
    """What :func:`read_shard` yielded and what it skipped, by reason.

    Reasons: ``"empty"`` (empty or whitespace-only line or text), ``"invalid UTF-8"``,
    ``"invalid JSON"``, ``"not a JSON object"``, ``"missing column"`` (a later JSON object
    without the text column), ``"non-text value"`` (null, number, list, ... in the text column).
    """

    documents: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    #: documents left out as duplicates of an earlier one (``Shard.drop``, ``--dedup``)
    duplicates: int = 0

    def skip(self, reason: str, n: int = 1) -> None:
        """Count ``n`` skipped items for ``reason``."""
        self.skipped[reason] = self.skipped.get(reason, 0) + n

    @property
    def total_skipped(self) -> int:
        """Number of skipped items, all reasons together."""
        return sum(self.skipped.values())

    def merge(self, other: ReadReport) -> ReadReport:
        """Add ``other``'s counts into this report (in place) and return it."""
        self.documents += other.documents
        self.duplicates += other.duplicates
        for reason, n in other.skipped.items():
            self.skip(reason, n)
        return self

    def to_json(self) -> dict[str, Any]:
        """``{"documents": n, "skipped": {reason: count}}`` with reasons sorted, and
        ``"duplicates"`` when some were dropped."""
        out = {"documents": self.documents, "skipped": dict(sorted(self.skipped.items()))}
        return out | ({"duplicates": self.duplicates} if self.duplicates else {})

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ReadReport:
        """Inverse of :meth:`to_json`."""
        skipped = {str(k): int(v) for k, v in d["skipped"].items()}
        return cls(int(d["documents"]), skipped, int(d.get("duplicates", 0)))

    def require_documents(self, source: str) -> None:
        """Raise :class:`CorpusError` if no document was read (call it on the merged report)."""
        if self.documents == 0:
            why = ", ".join(f"{n} {r}" for r, n in sorted(self.skipped.items()))
            raise CorpusError(
                f"corpus {source!r} contains no documents"
                + (f" (skipped: {why})" if why else " (no lines or rows)")
            )


def document_id(relpath: str, offset: int) -> int:
    """The id of the document at ``offset`` (byte offset or row index) of ``relpath``.

    BLAKE2b (8-byte digest) of ``relpath + "\\0" + str(offset)``, shifted right by one bit: a
    non-negative 63-bit integer that fits int64. ``relpath`` is the file's path relative to the
    corpus root (its name for a single-file corpus), so ids survive moving the corpus.
    """
    return _doc_id(_id_prefix(relpath), offset)


def token_work(blocks: int, dim: int) -> int:
    """A model's work a token as the default shard counts it: blocks · d²."""
    return int(blocks) * int(dim) ** 2


def auto_shard_cap(work: int = 0) -> int:
    """The largest default shard for a model of ``work`` a token (:func:`token_work`; 0: not
    known): 16 MiB, or 16 MiB · :data:`REFERENCE_TOKEN_WORK` / ``work`` for a model of more
    work a token than Llama 3 8B, at least 1 MiB."""
    if work <= REFERENCE_TOKEN_WORK:
        return MAX_AUTO_SHARD_BYTES
    return max(MIN_AUTO_SHARD_BYTES, MAX_AUTO_SHARD_BYTES * REFERENCE_TOKEN_WORK // int(work))


def auto_shard_bytes(total_bytes: int, work: int = 0) -> int:
    """Default shard size: ``clamp(total_bytes // 16, 1 MiB, auto_shard_cap(work))`` (the cap:
    16 MiB, less for a model of more work a token than an 8B), or more where that would cut
    the corpus into more than :data:`MAX_AUTO_SHARDS` shards (⌈total_bytes /
    MAX_AUTO_SHARDS⌉)."""
    size = max(MIN_AUTO_SHARD_BYTES, min(auto_shard_cap(work), total_bytes // 16))
    return max(size, -(-total_bytes // MAX_AUTO_SHARDS))


def shard_rule(work: int = 0) -> str:
    """How :func:`auto_shard_bytes` sized the shards, for the plan."""
    cap = auto_shard_cap(work)
    rule = f"a 16th of the corpus within [1 MiB, {cap / 2**20:.3g} MiB]"
    if cap < MAX_AUTO_SHARD_BYTES:
        rule += (
            f": 16 MiB ÷ {work / REFERENCE_TOKEN_WORK:.3g}, the model's work a token "
            "(blocks · d²) against an 8B's, whose 16 MiB take ≈ 200 s of an H100 extractor"
        )
    return rule + f"; more past {MAX_AUTO_SHARDS:,} shards"


# --------------------------------------------------------------------------------------------
# Planning


@dataclass(frozen=True)
class _File:
    path: str  # what fsspec.open takes: an absolute local path or a URL
    relpath: str
    size: int
    identity: str
    kind: str
    compression: str | None


def plan_shards(spec: CorpusSpec, shard_bytes: int | None = None, work: int = 0) -> ShardPlan:
    """Cut the corpus of ``spec`` into shards of about ``shard_bytes`` each.

    ``shard_bytes=None`` picks :func:`auto_shard_bytes` of the corpus size and the model's
    ``work`` a token (:func:`token_work`; 0: not known). Line files are cut
    at byte offsets (compressed ones are one shard each), Parquet files between row groups
    (about ``shard_bytes`` of compressed text-column data per shard, from the footers only), and
    datasets between rows (about ``shard_bytes`` of text per shard, at least one row).

    Raises :class:`CorpusError` when the source matches nothing, holds no corpus files, names a
    file of an unsupported type, holds only empty files, or when a file cannot be read or lacks
    the text column (checked on each Parquet footer and each JSON Lines file's first object).
    """
    if shard_bytes is not None and (
        isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes <= 0
    ):
        raise ConfigError(f"shard size must be a positive number of bytes, got {shard_bytes!r}")
    if not spec.source:
        raise CorpusError("no corpus given (the corpus source is an empty string)")
    if not spec.text_column:
        raise CorpusError("the text column name is empty")
    if _is_hub_dataset(spec.source):
        return _plan_dataset(spec, _hub_path(spec.source), shard_bytes, work)
    check_input(spec.source, "corpus")  # an object store answers, within seconds; the bucket exists
    with user_errors(spec.source, "corpus"):
        return _plan_files(spec, shard_bytes, work)


def _plan_files(spec: CorpusSpec, shard_bytes: int | None, work: int) -> ShardPlan:
    """:func:`plan_shards` of files (or a saved dataset directory), local or remote."""
    fs, root = _url_to_fs(spec.source)
    try:
        saved = _saved_dataset_dir(fs, root)
        listing = _Listing([]) if saved is not None else _list_files(spec.source, fs, root)
        files = listing.files
    except OSError as e:  # no credentials, no permission, no network: the user must act
        error = storage_error(e, spec.source, "corpus")
        if error is not None:
            raise error from None
        raise CorpusError(f"cannot list corpus {spec.source!r}: {type(e).__name__}: {e}") from e
    if saved is not None:
        return _plan_dataset(spec, saved, shard_bytes, work)
    total = sum(f.size for f in files)
    if total == 0:
        raise CorpusError(
            f"corpus {spec.source!r} has no data: "
            + ("its file is empty" if len(files) == 1 else f"its {len(files)} files are all empty")
        )
    size = shard_bytes if shard_bytes is not None else auto_shard_bytes(total, work)
    width = max(5, len(str(len(files) - 1)))

    def file_shards(index: int) -> tuple[list[Shard], FileState]:
        f = files[index]
        try:
            shards = _file_shards(f, index, width, spec.text_column, size)
            lines = f.kind != "parquet" and not f.compression and f.size > 0
            tail = tail_digest(f.path, f.size) if lines else ""
        except (FileNotFoundError, PermissionError) as e:
            raise open_error(f.path, e) from e
        host = socket.gethostname() if isinstance(fs, LocalFileSystem) else ""
        return shards, FileState(f.identity, f.size, tail, host)

    # Footers and first lines are small reads; overlap them for remote corpora of many files.
    # `map` keeps the order, so the first bad file in sorted order is the one reported.
    if len(files) == 1:
        per_file = [file_shards(0)]
    else:
        with ThreadPoolExecutor(max_workers=min(_PLAN_THREADS, len(files))) as pool:
            per_file = list(pool.map(file_shards, range(len(files))))
    shards = [s for group, _ in per_file for s in group]
    if not shards:
        raise CorpusError(f"corpus {spec.source!r} has no data: its Parquet files have no rows")
    fingerprint = _digest(
        {
            "format": _PLAN_FORMAT,
            "text_column": spec.text_column,
            "shard_bytes": size,
            "files": [[f.relpath, f.size, f.identity, f.kind] for f in files],
        }
    )
    paths = [f.path for f in files]
    states = [state for _, state in per_file]
    return ShardPlan(
        shards, fingerprint, total, paths, size, listing.ignored, listing.hidden, states
    ).with_file_states()


def _file_shards(f: _File, index: int, width: int, column: str, size: int) -> list[Shard]:
    """The shards of one file; checks its Parquet footer or its first JSON object."""
    if f.kind == "parquet":
        return [
            Shard(_shard_id(index, width, "g", a), f.path, f.kind, a, b, index)
            for a, b in _parquet_ranges(f.path, column, size)
        ]
    if f.size == 0:
        return []
    _check_compression(f.path, f.compression)
    if f.kind == "jsonl":
        _check_jsonl_head(f.path, f.compression, column)
    else:
        _check_text_head(f.path, f.compression)
    if f.compression:  # not splittable: one shard over the whole (compressed) file
        return [Shard(_shard_id(index, width, "b", 0), f.path, f.kind, 0, f.size, index)]
    return [
        Shard(_shard_id(index, width, "b", a), f.path, f.kind, a, min(a + size, f.size), index)
        for a in range(0, f.size, size)
    ]


def _plan_dataset(
    spec: CorpusSpec, path: str, shard_bytes: int | None, work: int = 0
) -> ShardPlan:
    ds, key, identity = _load_dataset(path, spec.split)
    column = _check_dataset_column(ds, path, spec)
    rows = len(ds)
    if rows == 0:
        raise CorpusError(f"dataset {_dataset_name(path, spec.split)} has no rows")
    total = _dataset_text_bytes(ds, column)
    size = shard_bytes if shard_bytes is not None else auto_shard_bytes(total, work)
    rows_per_shard = max(1, size * rows // max(1, total))
    shards = [
        Shard(_shard_id(0, 5, "r", a), path, "hf", a, min(a + rows_per_shard, rows), 0)
        for a in range(0, rows, rows_per_shard)
    ]
    fingerprint = _digest(
        {
            "format": _PLAN_FORMAT,
            "text_column": column,
            "shard_bytes": size,
            "dataset": [key, identity, rows],
        }
    )
    return ShardPlan(shards, fingerprint, total, [path], size)


def _shard_id(file_index: int, width: int, unit: str, start: int) -> str:
    return f"f{file_index:0{width}d}-{unit}{start:012d}"


def _digest(payload: dict[str, Any]) -> str:
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _url_to_fs(source: str) -> tuple[fsspec.AbstractFileSystem, str]:
    try:
        fs, root = fsspec.core.url_to_fs(source)
    except (ImportError, ValueError) as e:
        raise CorpusError(f"cannot open corpus {source!r}: {e}") from e
    return fs, _strip_slash(root)


def _strip_slash(path: str) -> str:
    stripped = path.rstrip("/")
    return stripped if stripped else path


def has_magic(path: str) -> bool:
    return _MAGIC.search(path) is not None


def glob_base(pattern: str) -> str:
    """The directory part of a glob before its first component with a wildcard."""
    parts = pattern.split("/")
    for i, part in enumerate(parts):
        if has_magic(part):
            return "/".join(parts[:i]) or "/"
    return posixpath.dirname(pattern)


def _relative_path(root: str, path: str) -> str:
    """``path`` relative to the corpus root ``root`` (a file, a directory or a glob)."""
    if path == root:
        return posixpath.basename(path)
    base = root
    if has_magic(root) and not path.startswith(root.rstrip("/") + "/"):
        base = glob_base(root)
    prefix = base.rstrip("/") + "/"
    if path.startswith(prefix):
        return path[len(prefix) :]
    return posixpath.basename(path)


def plain_text_bytes(shard: Shard) -> int | None:
    """The bytes of plain text a shard spans (an uncompressed text or JSON Lines byte range,
    which bounds the text it holds), or None (compressed, Parquet, a dataset)."""
    if shard.kind not in ("text", "jsonl") or classify(shard.path)[1] is not None:
        return None
    return shard.stop - shard.start


def _is_hidden(relpath: str) -> bool:
    return any(part.startswith((".", "_")) for part in relpath.split("/"))


def classify(name: str) -> tuple[str | None, str | None]:
    """(kind, compression) from a file name; kind is None when the type is unsupported."""
    lower = posixpath.basename(name).lower()
    compression = None
    for suffix, comp in COMPRESSION_EXTENSIONS.items():
        if lower.endswith(suffix):
            compression, lower = comp, lower[: -len(suffix)]
            break
    kind = SUPPORTED_EXTENSIONS.get(posixpath.splitext(lower)[1])
    if kind == "parquet" and compression:
        kind = None
    return kind, compression


def _supported_list() -> str:
    return (
        ", ".join(SUPPORTED_EXTENSIONS)
        + " (line formats also with "
        + ", ".join(COMPRESSION_EXTENSIONS)
        + ")"
    )


def _extension(name: str) -> str:
    base = posixpath.basename(name)
    return base[base.find(".", 1) :] if "." in base[1:] else "(none)"


def file_identity(fs: fsspec.AbstractFileSystem, info: dict[str, Any]) -> str:
    """A file's cheap identity from its ``info``, as the fingerprint and :class:`FileState`
    hold it (``mtime=…`` for a local file; an object's ETag, checksum or generation, …), or
    "" where ``info`` has none."""
    keys = ("mtime",) if isinstance(fs, LocalFileSystem) else _IDENTITY_KEYS
    for key in keys:
        if info.get(key) is not None:
            return _identity_as(key, info[key])
    return ""


def _identity_as(key: str, value: Any) -> str:
    """``key=value``, as the fingerprint holds an identity (a time as its timestamp)."""
    if isinstance(value, datetime):
        value = value.timestamp()
    return f"{key}={value!r}"


def _display_path(fs: fsspec.AbstractFileSystem, path: str) -> str:
    return path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)


def _make_file(
    fs: fsspec.AbstractFileSystem, path: str, relpath: str, info: dict[str, Any]
) -> _File:
    kind, compression = classify(path)
    if kind is None:
        raise CorpusError(
            f"{_display_path(fs, path)}: unsupported file type {_extension(path)!r}; "
            f"supported: {_supported_list()}"
        )
    return _File(
        path=_display_path(fs, path),
        relpath=relpath,
        size=int(info.get("size") or 0),
        identity=file_identity(fs, info),
        kind=kind,
        compression=compression,
    )


@dataclass(frozen=True)
class _Listing:
    """The corpus's files, and a directory's files left out (:attr:`ShardPlan.ignored`,
    :attr:`ShardPlan.hidden`)."""

    files: list[_File]
    ignored: list[str] = field(default_factory=list)
    hidden: list[str] = field(default_factory=list)


def _list_files(source: str, fs: fsspec.AbstractFileSystem, root: str) -> _Listing:
    if fs.exists(root):
        if fs.isdir(root):
            return _list_directory(source, fs, root)
        return _Listing([_make_file(fs, root, _relative_path(root, root), fs.info(root))])
    if not has_magic(root):
        raise CorpusError(f"corpus {source!r} does not exist")
    matches = fs.glob(root, detail=True)
    files, hidden = [], []
    for path, info in sorted(matches.items()):
        if info.get("type") == "directory":
            continue
        relpath = _relative_path(root, path)
        if _is_hidden(relpath):
            hidden.append(relpath)
            continue
        files.append(_make_file(fs, path, relpath, info))
    if not files and hidden:
        shown = ", ".join(hidden[:5]) + (", ..." if len(hidden) > 5 else "")
        raise CorpusError(
            f"corpus {source!r} matches only files that are never read, a name in their path "
            f"starting with '.' or '_' (hidden files, markers such as _SUCCESS): {shown}; "
            "rename them to read them"
        )
    if not files:
        raise CorpusError(f"corpus {source!r} matches no files")
    return _Listing(sorted(files, key=lambda f: f.relpath))


def _list_directory(source: str, fs: fsspec.AbstractFileSystem, root: str) -> _Listing:
    infos = fs.find(root, withdirs=False, detail=True)
    files, others, hidden = [], [], []
    for path, info in sorted(infos.items()):
        relpath = _relative_path(root, path)
        if _is_hidden(relpath):
            if classify(path)[0] is not None:
                hidden.append(relpath)
            continue
        if classify(path)[0] is None:
            others.append(relpath)
            continue
        files.append(_make_file(fs, path, relpath, info))
    if not files:
        held = _names(others + hidden, 5)
        raise CorpusError(
            f"directory {source!r} contains no corpus files (supported: {_supported_list()}"
            + ("; a name starting with '.' or '_' is never read" if hidden else "")
            + "); "
            + (f"it holds: {held}" if others or hidden else "it is empty")
        )
    return _Listing(sorted(files, key=lambda f: f.relpath), others, hidden)


def _names(names: list[str], shown: int) -> str:
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")


def column_notices(plan: ShardPlan, text_column: str) -> list[str]:
    """A line where ``--text-column`` names a column and some of the corpus's files are plain
    text, which have none (a line is a document): the option is ignored there."""
    if text_column == CorpusSpec.text_column:
        return []
    text = sorted({s.file_index for s in plan.shards if s.kind == "text"})
    if not text:
        return []
    where = "the corpus is plain text" if len(text) == len(plan.files) else (
        f"{len(text)} of the corpus's {len(plan.files)} files {'is' if len(text) == 1 else 'are'} "
        "plain text, the others are read by that column"
    )
    return [
        f"corpus: --text-column {text_column} does not apply to plain text files, where a line "
        f"is a document: {where}"
    ]


def ignored_notices(plan: ShardPlan, source: str, shown: int = 5) -> list[str]:
    """Lines naming the files of directory ``source`` that are not read, the first ``shown``
    of each kind: those of no supported type (``plan.ignored``), and those of a supported type
    under a name starting with ``.`` or ``_`` (``plan.hidden``)."""
    read = _plural(len(plan.files), "corpus file")
    lines = []
    if plan.ignored:
        lines.append(
            f"corpus: {_plural(len(plan.ignored), 'file')} in {source} of no corpus type "
            f"({read} read; supported: {_supported_list()}) left out: "
            + _names(plan.ignored, shown)
        )
    if plan.hidden:
        lines.append(
            f"corpus: {_plural(len(plan.hidden), 'file')} in {source} of a corpus type left "
            f"out, a name in the path starting with '.' or '_' (hidden files, markers; {read} "
            "read): " + _names(plan.hidden, shown)
        )
    return lines


def _saved_dataset_dir(fs: fsspec.AbstractFileSystem, root: str) -> str | None:
    """The path to give ``load_from_disk`` if ``root`` was written by ``save_to_disk``."""
    try:
        if not fs.isdir(root):
            return None
        names = {posixpath.basename(_strip_slash(p)) for p in fs.ls(root, detail=False)}
    except (FileNotFoundError, NotADirectoryError):
        return None
    if "dataset_dict.json" in names or {"state.json", "dataset_info.json"} <= names:
        return _display_path(fs, root)
    return None


def _check_compression(path: str, compression: str | None) -> None:
    if compression and compression not in fsspec.compression.compr:
        package = "zstandard" if compression == "zstd" else compression
        raise CorpusError(
            f"{path} is {compression}-compressed; install the {package!r} package to read it"
        )


def _check_jsonl_head(path: str, compression: str | None, column: str) -> None:
    """Fail early if the file's first JSON object lacks ``column`` or it holds no JSON object.

    Looks at the file's first :data:`JSONL_HEAD_LINES` non-empty lines at most.
    """
    bad = 0
    first_bad: tuple[int, bytes] | None = None
    eof = True
    with _decompressing(path, compression), open_exact(path, compression) as f:
        for number, (_, raw) in enumerate(_iter_lines(f, 0, None, chunk=_HEAD_CHUNK), 1):
            if number == 1:
                _check_encoding(path, raw)
                raw = raw.removeprefix(_BOM)
            if not raw.strip():
                continue
            obj = _parse_json_line(raw)
            if isinstance(obj, dict):
                if column not in obj:
                    raise _missing_json_column(path, column, obj)
                return
            opening = raw.strip()
            if bad == 0 and obj is None and (opening[:1] == b"[" or opening == b"{"):
                what = "a JSON array" if opening[:1] == b"[" else "a JSON object"
                raise CorpusError(
                    f"{path} is not JSON Lines but {what} spread over several lines "
                    f"(line {number}: {_preview(raw)}); write one JSON object per line, "
                    "without the brackets and commas between them"
                )
            bad += 1
            first_bad = first_bad or (number, raw)
            if bad >= JSONL_HEAD_LINES:
                eof = False
                break
    if first_bad is not None:
        number, raw = first_bad
        which = f"none of its {bad} non-empty lines" if eof else f"none of its first {bad} lines"
        raise CorpusError(
            f"{path} is not JSON Lines: {which} is a JSON object (line {number}: {_preview(raw)})"
        )


def _check_encoding(path: str, head: bytes) -> None:
    """Refuse a file whose first bytes are a UTF-16 or UTF-32 byte-order mark: read as UTF-8,
    its text would be every other byte NUL (a Windows editor's "Unicode" saves this way)."""
    for bom, encoding in _FOREIGN_BOMS:
        if head.startswith(bom):
            raise CorpusError(
                f"{path} is {encoding}-encoded (its first bytes are the {encoding} byte-order "
                "mark); corpus files must be UTF-8: convert it (e.g. iconv -f "
                f"{encoding} -t UTF-8)"
            )


@contextlib.contextmanager
def open_exact(path: str, compression: str | None) -> Iterator[Any]:
    """``path`` opened for reads of part of it: a remote file fetches the bytes each read asks
    for, not its file system's read-ahead block past them (s3fs's is 50 MiB: the plan's look
    at a file's head fetched 7.6 MiB of an 8 MB file, reading one file in 1 MiB shards fetched
    it 4.3 times, and a Parquet file's shards fetched 5.5 times its size, every column's
    bytes and each row group's to the end of the file, where the text column's were needed).
    A compressed file, read whole, is opened as ``fsspec.open`` does."""
    if compression is not None:
        with fsspec.open(path, "rb", compression=compression) as f:
            yield f
        return
    fs, stripped = fsspec.core.url_to_fs(path)
    with fs.open(stripped, "rb", cache_type="none") as f:
        yield f


def _check_text_head(path: str, compression: str | None) -> None:
    """Fail early if a text file is UTF-16 or UTF-32 (:func:`_check_encoding`)."""
    with _decompressing(path, compression), open_exact(path, compression) as f:
        head = f.read(len(_FOREIGN_BOMS[0][0]))
    _check_encoding(path, head)


@contextlib.contextmanager
def _decompressing(path: str, compression: str | None) -> Iterator[None]:
    """Within: a corrupt compressed stream is a :class:`CorpusError` naming ``path`` (bz2
    raises a plain OSError); other I/O errors pass as they are."""
    try:
        yield
    except OSError as e:
        if not _is_corrupt_stream(e, compression):
            raise
        raise CorpusError(f"cannot decompress {path}: {e}") from e
    except _DECOMPRESSION_ERRORS as e:
        raise CorpusError(f"cannot decompress {path}: {e}") from e


def _parse_json_line(raw: bytes) -> Any:
    """The parsed value, or None for a line that is not valid UTF-8 JSON."""
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None


def _preview(raw: bytes, n: int = 60) -> str:
    text = raw.decode("utf-8", errors="replace").rstrip("\r")
    return repr(text[:n] + ("..." if len(text) > n else ""))


def _missing_json_column(path: str, column: str, obj: dict[str, Any]) -> CorpusError:
    columns = ", ".join(map(str, obj)) or "(none: the first object is empty)"
    return CorpusError(f"{path} has no column {column!r}; columns are: {columns}")


def _parquet_file(f: Any, path: str) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as e:
        raise CorpusError(f"cannot read Parquet file {path}: {e}") from e


def _parquet_column(pf: pq.ParquetFile, path: str, column: str) -> None:
    schema = pf.schema_arrow
    if column not in schema.names:
        raise CorpusError(
            f"{path} has no column {column!r}; columns are: {', '.join(schema.names)}"
        )
    typ = schema.field(column).type
    if pa.types.is_dictionary(typ):
        typ = typ.value_type
    string_view = getattr(pa.types, "is_string_view", None)  # pyarrow ≥ 16
    if not (
        pa.types.is_string(typ)
        or pa.types.is_large_string(typ)
        or (string_view is not None and string_view(typ))
    ):
        raise CorpusError(f"column {column!r} of {path} has type {typ}, not string")


def _in_column(path_in_schema: str, column: str) -> bool:
    return path_in_schema == column or path_in_schema.startswith(column + ".")


def _parquet_ranges(path: str, column: str, shard_bytes: int) -> list[tuple[int, int]]:
    """Consecutive row-group ranges of about ``shard_bytes`` compressed text-column bytes."""
    with open_exact(path, None) as f:
        pf = _parquet_file(f, path)
        _parquet_column(pf, path, column)
        md = pf.metadata
        sizes = []
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            sizes.append(
                sum(
                    rg.column(c).total_compressed_size
                    for c in range(rg.num_columns)
                    if _in_column(rg.column(c).path_in_schema, column)
                )
            )
    ranges: list[tuple[int, int]] = []
    start, acc = 0, 0
    for g, size in enumerate(sizes):
        if g > start and acc + size > shard_bytes:
            ranges.append((start, g))
            start, acc = g, 0
        acc += size
    if sizes:
        ranges.append((start, len(sizes)))
    return ranges


# --------------------------------------------------------------------------------------------
# Datasets


def _is_hub_dataset(source: str) -> bool:
    """``hf:NAME[:CONFIG]``; ``hf://...`` is a path on fsspec's Hugging Face file system."""
    return source.startswith("hf:") and not source.startswith("hf://")


def _hub_path(source: str) -> str:
    name = source[3:].split(":", 1)[0]
    if not name:
        raise CorpusError(f"corpus {source!r}: expected hf:NAME or hf:NAME:CONFIG")
    return source


def _dataset_name(path: str, split: str) -> str:
    return f"{path!r} (split {split!r})"


def _load_dataset(path: str, split: str) -> tuple[Any, str, str]:
    """(dataset, key for document ids, identity for the fingerprint), cached per process.

    The cache is keyed on the directory's ``save_to_disk`` metadata too, so a directory
    written again in the same process is loaded again.
    """
    return _load_dataset_cached(path, split, _saved_dataset_stamp(path))


def _saved_dataset_stamp(path: str) -> str:
    if _is_hub_dataset(path):
        return ""
    try:
        fs, root = fsspec.core.url_to_fs(path)
        infos = fs.ls(root, detail=True)
    except (OSError, ValueError, ImportError):
        return ""
    return repr(sorted((i["name"], i.get("size"), file_identity(fs, i)) for i in infos))


@functools.lru_cache(maxsize=4)
def _load_dataset_cached(path: str, split: str, stamp: str) -> tuple[Any, str, str]:
    del stamp  # only part of the cache key
    import datasets  # heavy: only for dataset corpora

    if _is_hub_dataset(path):
        name, _, config = path[3:].partition(":")
        try:
            ds = datasets.load_dataset(name, config or None, split=split)
        except Exception as e:  # the hub and builders raise many types; all mean "cannot load"
            raise CorpusError(
                f"cannot load Hugging Face dataset {path!r} (split {split!r}): "
                f"{type(e).__name__}: {e}"
            ) from e
        key = f"{name}:{config}:{split}"
    else:
        try:
            obj = datasets.load_from_disk(path)
        except Exception as e:
            raise CorpusError(f"cannot load dataset directory {path!r}: {e}") from e
        if isinstance(obj, datasets.DatasetDict):
            if split not in obj:
                raise CorpusError(
                    f"dataset directory {path!r} has no split {split!r}; "
                    f"splits are: {', '.join(obj)}"
                )
            ds, key = obj[split], split
        else:
            ds, key = obj, ""
    if not isinstance(ds, datasets.Dataset):
        raise CorpusError(f"dataset {_dataset_name(path, split)} is not a map-style Dataset")
    identity = f"{key}:{getattr(ds, '_fingerprint', '')}"
    return ds, key, identity


def _check_dataset_column(ds: Any, path: str, spec: CorpusSpec) -> str:
    column = spec.text_column
    if column not in ds.column_names:
        raise CorpusError(
            f"dataset {_dataset_name(path, spec.split)} has no column {column!r}; "
            f"columns are: {', '.join(ds.column_names)}"
        )
    dtype = getattr(ds.features[column], "dtype", None)
    if dtype not in ("string", "large_string", "string_view"):
        raise CorpusError(
            f"column {column!r} of dataset {_dataset_name(path, spec.split)} holds "
            f"{ds.features[column]}, not strings"
        )
    return column


def _dataset_text_bytes(ds: Any, column: str) -> int:
    """Bytes of the text column over the dataset's rows (scaled when it is a selection)."""
    table = ds.data
    nbytes = int(table.column(column).nbytes)
    if table.num_rows and table.num_rows != len(ds):
        nbytes = nbytes * len(ds) // table.num_rows
    return max(nbytes, len(ds))


# --------------------------------------------------------------------------------------------
# Reading


def read_shard(shard: Shard, spec: CorpusSpec, report: ReadReport) -> Iterator[Document]:
    """Yield the documents of ``shard`` in file order, counting skipped items in ``report``.

    Text: one document per line, the trailing newline (``\\n`` or ``\\r\\n``) removed; empty and
    whitespace-only lines are skipped. JSON Lines: the string in ``spec.text_column`` of each
    object. Parquet and datasets: the string values of the column. Document ids come from
    :func:`document_id` of the file's path relative to the corpus root and the line's byte
    offset (in the decompressed stream for compressed files) or the row index.

    Documents whose id is in ``shard.drop`` (duplicates, ``--dedup``) are left out and counted
    in ``report.duplicates``, not in ``report.documents``.
    """
    if shard.kind in ("text", "jsonl"):
        docs = _unchanged(shard, _read_lines(shard, spec, report))
    elif shard.kind == "parquet":
        docs = _unchanged(shard, _read_parquet(shard, spec, report))
    elif shard.kind == "hf":
        docs = _read_dataset(shard, spec, report)
    else:
        raise ValueError(f"unknown shard kind {shard.kind!r}")
    return _without(docs, frozenset(shard.drop), report) if shard.drop else docs


#: bytes at the end of a line file whose digest tells lines appended from a rewrite
TAIL_BYTES = 4096


def tail_digest(path: str, size: int) -> str:
    """The BLAKE2b digest (hex) of the file's last :data:`TAIL_BYTES` bytes before ``size``
    (its planned size): one small read, the same after lines are appended."""
    with open_exact(path, None) as f:
        start = max(0, size - TAIL_BYTES)
        f.seek(start)
        data = f.read(size - start)
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def check_unchanged(shard: Shard) -> None:
    """A :class:`CorpusError` naming ``shard``'s file when it was written since the plan: its
    identity (modification time; an object's ETag, checksum or generation) is not the planned
    one (:class:`FileState`), and it is not only longer by lines appended after its planned
    bytes (a line file of a larger size whose last planned bytes are the same: those lines
    are left to the next run). So a file rewritten to the same, a larger or a smaller size
    ends the run, which its byte ranges alone do not show, and so does a ``touch``: the
    corpus's fingerprint, a resume's and ``reanalyze``'s, is no longer the run's. A file cut
    shorter is said by each of its shards, not left to the one that meets the new end (which
    may have run before the cut, the others then reading the new text without a word); a cut
    that kept the planned identity is still the reader's (:func:`_read_lines`, with the
    sizes). The listing's cache is dropped first, so an object store is asked again (a HEAD
    request). A local file read on a host other than the one that planned it is another
    node's copy or view of it, whose modification time is its own: there its size and tail
    are compared instead (:func:`_other_hosts_copy_changed`), and where its modification time
    is not the planned one, its shard's bytes by digest in the job's own process
    (:mod:`embgeom_ray.inputs.copies`)."""
    if not shard.identity:
        return
    fs, path = fsspec.core.url_to_fs(shard.path)
    if shard.planned_on and shard.planned_on != socket.gethostname():
        _other_hosts_copy_changed(shard, fs, path)
        return
    fs.invalidate_cache(path)
    key = shard.identity.partition("=")[0]
    try:
        info = fs.info(path)
        if info.get(key) is None:
            return  # this file system's info lacks what its listing gave: nothing to compare
        now = _identity_as(key, info[key])
        if now == shard.identity:
            return
        size = int(info.get("size") or 0)
        if shard.tail and size > shard.file_size:
            if tail_digest(shard.path, shard.file_size) == shard.tail:
                return  # lines appended: read up to the planned size, as documented
    except (FileNotFoundError, PermissionError) as e:
        raise open_error(shard.path, e) from e
    raise CorpusError(
        f"corpus file {shard.path} changed during the run: it was written after the run was "
        f"planned ({shard.identity}, {shard.file_size:,} bytes; now {now}, "
        f"{size:,} bytes); rerun with --overwrite once it no longer changes"
    )


def _other_hosts_copy_changed(shard: Shard, fs: fsspec.AbstractFileSystem, path: str) -> None:
    """:func:`check_unchanged` of a local file on a host other than the planner's: a
    :class:`CorpusError` where its size is not the planned one (larger: unless only by lines
    appended, its planned tail the same) or, at the planned size, its tail is another (a line
    file; other files: the size alone). A copy kept by ``cp -p``, ``rsync -t`` or a shared
    file system passes as on the planner's host; one without its modification times too, its
    shards' bytes then compared with the job's own copy (:mod:`embgeom_ray.inputs.copies`)."""
    try:
        size = int(fs.info(path).get("size") or 0)
        same_tail = not shard.tail or (
            size >= shard.file_size and tail_digest(shard.path, shard.file_size) == shard.tail
        )
    except (FileNotFoundError, PermissionError) as e:
        raise open_error(shard.path, e) from e
    if same_tail and (size == shard.file_size or (shard.tail and size > shard.file_size)):
        return
    raise CorpusError(
        f"corpus file {shard.path} on {socket.gethostname()} is not the file the run planned on "
        f"{shard.planned_on} ({shard.file_size:,} bytes; here {size:,} bytes"
        + (", other text at the planned end" if size >= shard.file_size else "")
        + "): a local --corpus must be the same files on every node (a shared file system, or "
        "identical copies); rerun with --overwrite once they are"
    )


def _unchanged(shard: Shard, docs: Iterator[Document]) -> Iterator[Document]:
    """``docs``, with :func:`check_unchanged` as the shard's file is opened and once it has
    been read (a file rewritten while its own shard was read)."""
    check_unchanged(shard)
    yield from docs
    check_unchanged(shard)


def _without(docs: Iterator[Document], drop: frozenset[int], report: ReadReport) -> Iterator[Document]:
    """``docs`` without the ids in ``drop``, moved from ``report.documents`` to ``duplicates``."""
    for doc in docs:
        if doc.doc_id in drop:
            report.documents -= 1
            report.duplicates += 1
        else:
            yield doc


def _id_prefix(relpath: str) -> Any:
    h = hashlib.blake2b(digest_size=8)
    h.update(relpath.encode("utf-8"))
    h.update(b"\0")
    return h


def _doc_id(prefix: Any, offset: int) -> int:
    h = prefix.copy()
    h.update(str(offset).encode("ascii"))
    return int.from_bytes(h.digest(), "big") >> 1


def _shard_relpath(shard: Shard, spec: CorpusSpec) -> str:
    fs, root = _url_to_fs(spec.source)
    return _relative_path(root, _strip_slash(fs._strip_protocol(shard.path)))


class _LineReader:
    """Iterates the lines whose first byte lies in ``[start, stop)``; knows if it hit EOF."""

    def __init__(self, f: Any, start: int, stop: int | None) -> None:
        self.f, self.start, self.stop = f, start, stop
        self.eof = False

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        return _iter_lines(self.f, self.start, self.stop, self)


def _iter_lines(
    f: Any,
    start: int,
    stop: int | None,
    state: _LineReader | None = None,
    chunk: int | None = None,
) -> Iterator[tuple[int, bytes]]:
    """Yield ``(offset, line)`` for every line of ``f`` whose first byte is in ``[start, stop)``.

    Hadoop-style split reading: unless ``start == 0``, the line straddling ``start`` belongs to
    the previous range and is skipped (reading from ``start - 1`` makes a line that begins
    exactly at ``start`` ours); the line straddling ``stop`` is read to its end. ``stop=None``
    reads to the end. ``line`` excludes the ``\\n``.

    Reads ``chunk`` bytes at a time (default :data:`_READ_CHUNK`), never past ``stop`` but
    to finish the line that crosses it, :data:`_HEAD_CHUNK` at a time: a remote file opened by
    :func:`open_exact` fetches little more than the range.
    """
    full = chunk or _READ_CHUNK
    if start > 0:
        f.seek(start - 1)
        base, skipping = start - 1, True
    else:
        base, skipping = 0, False
    buf = bytearray()
    line_start, scan, eof = base, 0, False
    while True:
        nl = buf.find(b"\n", scan)
        if nl < 0:
            if eof:
                if state is not None:
                    state.eof = True
                rest = line_start - base
                if not skipping and rest < len(buf) and (stop is None or line_start < stop):
                    yield line_start, bytes(buf[rest:])
                return
            if line_start > base:
                del buf[: line_start - base]
                base = line_start
            scan = len(buf)
            want = full
            if stop is not None:
                ahead = stop - (base + len(buf))
                want = min(full, ahead) if ahead > 0 else min(full, _HEAD_CHUNK)
            data = f.read(want)
            if data:
                buf += data
            else:
                eof = True
            continue
        if skipping:
            skipping = False
        else:
            yield line_start, bytes(buf[line_start - base : nl])
        line_start, scan = base + nl + 1, nl + 1
        if stop is not None and line_start >= stop:
            return


def _is_corrupt_stream(e: OSError, compression: str | None) -> bool:
    """Whether ``e`` says the compressed stream is corrupt (bz2 raises a plain OSError)."""
    return isinstance(e, gzip.BadGzipFile) or (
        compression is not None and "Invalid data stream" in str(e)
    )


def open_error(path: str, e: Exception) -> CorpusError:
    """The :class:`CorpusError` of a corpus file that could not be opened or decompressed."""
    if isinstance(e, FileNotFoundError):
        return CorpusError(f"corpus file {path} no longer exists (deleted after planning?)")
    if isinstance(e, PermissionError):
        return CorpusError(f"corpus file {path} cannot be read: permission denied")
    return CorpusError(f"cannot decompress {path}: {e}")


def _read_lines(shard: Shard, spec: CorpusSpec, report: ReadReport) -> Iterator[Document]:
    prefix = _id_prefix(_shard_relpath(shard, spec))
    compression = classify(shard.path)[1]
    _check_compression(shard.path, compression)
    jsonl = shard.kind == "jsonl"
    column = spec.text_column
    first_checked = shard.start != 0  # the file's first JSON object must have the column
    objects = invalid = 0
    try:
        with open_exact(shard.path, compression) as f:
            lines = _LineReader(f, shard.start, None if compression else shard.stop)
            for offset, raw in lines:
                if offset == 0:
                    _check_encoding(shard.path, raw)
                    raw = raw.removeprefix(_BOM)
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    report.skip("invalid UTF-8")
                    invalid += 1
                    continue
                if jsonl:
                    if not text.strip():
                        report.skip("empty")
                        continue
                    try:
                        obj = json.loads(text)
                    except (ValueError, RecursionError):
                        report.skip("invalid JSON")
                        invalid += 1
                        continue
                    if not isinstance(obj, dict):
                        report.skip("not a JSON object")
                        invalid += 1
                        continue
                    objects += 1
                    if not first_checked:
                        first_checked = True
                        if column not in obj:
                            raise _missing_json_column(shard.path, column, obj)
                    if column not in obj:
                        report.skip("missing column")
                        continue
                    text = obj[column]
                    if not isinstance(text, str):
                        report.skip("non-text value")
                        continue
                elif text.endswith("\r"):
                    text = text[:-1]
                if not text.strip():
                    report.skip("empty")
                    continue
                report.documents += 1
                yield Document(_doc_id(prefix, offset), text)
            # the plan cut the file at its size then: lines past its end now were not read
            cut = compression is None and lines.eof and f.seek(0, 2) < shard.stop
            size = f.tell() if cut else 0
    except (*_DECOMPRESSION_ERRORS, FileNotFoundError, PermissionError) as e:
        raise open_error(shard.path, e) from e
    except OSError as e:
        if not _is_corrupt_stream(e, compression):
            raise  # I/O trouble (network, disk) is not the user's to fix: let the task retry
        raise open_error(shard.path, e) from e
    if jsonl and shard.start == 0 and lines.eof and objects == 0 and invalid > 0:
        raise CorpusError(
            f"{shard.path} is not JSON Lines: none of its {invalid} non-empty lines "
            "is a JSON object"
        )
    if cut:
        raise CorpusError(
            f"corpus file {shard.path} changed during the run: it is {size:,} bytes, "
            f"{shard.stop:,} or more when the run was planned; rerun with --overwrite once it "
            "no longer changes"
        )


def _emit_values(
    values: Iterable[Any], first_row: int, prefix: Any, report: ReadReport
) -> Iterator[Document]:
    for row, value in enumerate(values, start=first_row):
        if not isinstance(value, str):
            report.skip("non-text value")
        elif not value.strip():
            report.skip("empty")
        else:
            report.documents += 1
            yield Document(_doc_id(prefix, row), value)


def _read_parquet(shard: Shard, spec: CorpusSpec, report: ReadReport) -> Iterator[Document]:
    prefix = _id_prefix(_shard_relpath(shard, spec))
    try:
        with open_exact(shard.path, None) as f:
            pf = _parquet_file(f, shard.path)
            _parquet_column(pf, shard.path, spec.text_column)
            md = pf.metadata
            if shard.stop > md.num_row_groups:
                raise CorpusError(
                    f"{shard.path} has {md.num_row_groups} row groups, the plan expects "
                    f"{shard.stop}: the file changed after planning"
                )
            row = sum(md.row_group(g).num_rows for g in range(shard.start))
            groups = list(range(shard.start, shard.stop))
            if not groups:
                return
            try:
                batches = pf.iter_batches(
                    batch_size=_BATCH_ROWS, row_groups=groups, columns=[spec.text_column]
                )
                for batch in batches:
                    yield from _emit_values(batch.column(0).to_pylist(), row, prefix, report)
                    row += batch.num_rows
            except pa.ArrowException as e:
                raise CorpusError(f"cannot read Parquet file {shard.path}: {e}") from e
    except (FileNotFoundError, PermissionError) as e:
        raise open_error(shard.path, e) from e


def _read_dataset(shard: Shard, spec: CorpusSpec, report: ReadReport) -> Iterator[Document]:
    ds, key, _ = _load_dataset(shard.path, spec.split)
    column = _check_dataset_column(ds, shard.path, spec)
    prefix = _id_prefix(key)
    texts = ds.select_columns([column]).with_format(None)  # plain Python strings
    stop = min(shard.stop, len(ds))
    for a in range(shard.start, stop, _BATCH_ROWS):
        b = min(a + _BATCH_ROWS, stop)
        yield from _emit_values(texts[a:b][column], a, prefix, report)
