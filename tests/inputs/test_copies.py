"""Another node's copy of a local corpus file, checked by its shards' bytes
(embgeom_ray.inputs.copies).

One machine plays both hosts: the planner's (the job's own process, which checks) and another
node's (an extractor, which reads the shard and sends its copy's digest). Between the two, the
file is swapped for the other node's copy (:func:`on_node_b`): other bytes and a modification
time of its own, ``socket.gethostname`` answering ``node-b``; the planner's file, mtime
included, is put back before the driver's check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import itertools
import os
import re
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import CancelledError
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash

import embgeom_ray.inputs.copies as copies
from embgeom_ray.errors import CorpusError
from embgeom_ray.inputs.copies import CopyReading, check_copy, shard_digest
from embgeom_ray.inputs.corpus import TAIL_BYTES, CorpusSpec, ReadReport, plan_shards, read_shard

HERE = socket.gethostname()
LINES = [f"document number {i:03d} of the copies' corpus, read on every node" for i in range(200)]


@contextlib.contextmanager
def on_node_b(
    monkeypatch: pytest.MonkeyPatch, path: Path, data: bytes | None = None, mtime_s: int = 1
) -> Iterator[None]:
    """Within: ``path`` is node-b's copy (``data``, else the same bytes; its mtime ``mtime_s``
    seconds later than the planner's, 0: the same), and this host is node-b. On leaving the
    planner's bytes and mtime are back, and so is the host name."""
    planned, stat = path.read_bytes(), path.stat()
    if data is not None:
        assert len(data) == len(planned)
        path.write_bytes(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + mtime_s * 10**9))
    with monkeypatch.context() as m:
        m.setattr(socket, "gethostname", lambda: "node-b")
        yield
    path.write_bytes(planned)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def read_on_node_b(shard, spec: CorpusSpec) -> tuple[list[str], dict[str, str] | None]:
    """What an extractor on node-b does: read the shard, then its copy's digest."""
    reading = CopyReading(shard)
    texts = [d.text for d in read_shard(shard, spec, ReadReport())]
    return texts, reading.result()


@pytest.fixture
def line_file(tmp_path: Path) -> tuple[Path, CorpusSpec, list]:
    path = tmp_path / "c.txt"
    path.write_text("\n".join(LINES) + "\n")
    spec = CorpusSpec(str(path))
    plan = plan_shards(spec, 4096)
    assert len(plan.shards) >= 3 and path.stat().st_size > 2 * TAIL_BYTES + 4096
    return path, spec, plan.shards


def test_a_copy_of_the_same_size_and_tail_with_a_byte_changed_is_refused(
    monkeypatch: pytest.MonkeyPatch, line_file
) -> None:
    """One byte changed in the middle of a shard's range, outside the last 4 KiB, the size
    kept: node-b's size and tail check passes and its shard reads other text; the driver's
    digest of its own copy refuses it, naming the file, both hosts and the shard's bytes. The
    shards whose bytes are the same pass."""
    path, spec, shards = line_file
    data = bytearray(path.read_bytes())
    bad = shards[1]
    middle = (bad.start + bad.stop) // 2
    assert middle < len(data) - TAIL_BYTES
    data[middle : middle + 1] = b"#" if data[middle : middle + 1] != b"#" else b"%"
    with on_node_b(monkeypatch, path, bytes(data)):
        read = {s.shard_id: read_on_node_b(s, spec) for s in shards}
    assert [t for s in shards for t in read[s.shard_id][0]] != LINES  # other text, no word
    for shard in shards:
        copy = read[shard.shard_id][1]
        assert copy is not None and copy["host"] == "node-b"
        if shard is not bad:
            check_copy(shard, copy)
    with pytest.raises(CorpusError) as err:
        check_copy(bad, read[bad.shard_id][1])
    end = path.read_bytes().index(b"\n", bad.stop - 1) + 1  # the line crossing its end, too
    assert str(err.value) == (
        f"corpus file {path} on node-b is not the file on {HERE}: its bytes "
        f"[{bad.start - 1:,}, {end:,}) of shard {bad.shard_id} hold other data (same size and "
        "last 4 KiB, another modification time): a local --corpus must be the same files on "
        "every node (a shared file system, or copies made with cp -p or rsync -t); the same "
        "command resumes once they are, the shards done so far checked"
    )


def test_an_identical_copy_with_another_mtime_passes(
    monkeypatch: pytest.MonkeyPatch, line_file
) -> None:
    path, spec, shards = line_file
    with on_node_b(monkeypatch, path):
        read = [read_on_node_b(s, spec) for s in shards]
    assert [t for texts, _ in read for t in texts] == LINES
    for shard, (_, copy) in zip(shards, read, strict=True):
        assert copy is not None
        check_copy(shard, copy)


def test_a_copy_with_the_planned_mtime_is_not_read_again(
    monkeypatch: pytest.MonkeyPatch, line_file
) -> None:
    """A copy that kept its modification time (``cp -p``, ``rsync -t``, a shared file
    system), and any shard on the planner's own host: no digest, no read beyond the shard's."""
    path, spec, shards = line_file
    digests = []
    monkeypatch.setattr(copies, "shard_digest", lambda s: digests.append(s) or shard_digest(s))
    with on_node_b(monkeypatch, path, mtime_s=0):
        read = [read_on_node_b(s, spec) for s in shards]
    here = [read_on_node_b(s, spec) for s in shards]  # on the planner's host
    assert read == here and [t for texts, _ in read for t in texts] == LINES
    assert [copy for _, copy in read + here] == [None] * 2 * len(shards)
    assert digests == []
    with on_node_b(monkeypatch, path):  # the spy sees the reads it is to see
        assert CopyReading(shards[0]).result() is not None
    assert digests == [shards[0]]


def test_the_shards_digests_cover_the_bytes_their_reader_reads(tmp_path: Path, line_file) -> None:
    """A line file's shard's digest is of what its reader reads: from the byte before its
    range (where its first line begins) to the end of the line that crosses its end, so the
    shards' spans cover [0, size) and overlap at each boundary; a compressed file's one
    shard's, of its whole compressed bytes."""
    path, _, shards = line_file
    data = path.read_bytes()
    covered = [shard_digest(s) for s in shards]
    for shard, c in zip(shards, covered, strict=True):
        end = data.index(b"\n", shard.stop - 1) + 1
        assert (c.start, c.stop) == (max(0, shard.start - 1), end)
        assert shard.stop < end or data[shard.stop - 1 : shard.stop] == b"\n"
        head = f"{c.start}:{shard.stop - c.start};".encode()
        expected = xxhash.xxh3_128(head + data[c.start : c.stop] + f";{c.stop}".encode())
        assert c.digest == expected.hexdigest()
    assert covered[0].start == 0 and covered[-1].stop == len(data)
    assert all(b.start < a.stop for a, b in itertools.pairwise(covered))  # boundaries: both
    packed = tmp_path / "c.txt.gz"
    packed.write_bytes(gzip.compress(data))
    (shard,) = plan_shards(CorpusSpec(str(packed))).shards
    raw = packed.read_bytes()
    assert shard_digest(shard) == (
        xxhash.xxh3_128(f"0:{len(raw)};".encode() + raw).hexdigest(), 0, len(raw)
    )


@pytest.mark.parametrize("where", ["byte before", "line past"])
def test_a_copy_other_at_a_shards_boundary_is_refused_for_the_shard_that_read_it(
    monkeypatch: pytest.MonkeyPatch, line_file, where: str
) -> None:
    """The bytes a shard's reader reads outside its range: the byte before it (a newline
    there, and the rest of the line it cuts is the shard's first) and the rest of the line
    crossing its end (read to its end). Changed on node-b alone, the
    shard read there folds other text, and its own check refuses it, whatever node reads the
    shard whose range holds those bytes (the driver's copy: its digest is never asked)."""
    path, spec, shards = line_file
    data = bytearray(path.read_bytes())
    shard = shards[1]
    if where == "byte before":  # a newline there: the part of a line after it is read
        at = shard.start - 1
        assert data[at : at + 1] != b"\n"
        data[at : at + 1] = b"\n"
    else:
        assert data[shard.stop - 1 : shard.stop] != b"\n"
        at = data.index(b"\n", shard.stop) - 2  # in the line past the range, before its end
        data[at : at + 1] = b"#"
    with on_node_b(monkeypatch, path, bytes(data)):
        texts, copy = read_on_node_b(shard, spec)
    assert texts != [d.text for d in read_shard(shard, spec, ReadReport())]  # other text
    assert copy is not None
    with pytest.raises(CorpusError, match=rf"its bytes \[{shard.start - 1:,}, "):
        check_copy(shard, copy)


def test_a_copy_with_lines_appended_passes(monkeypatch: pytest.MonkeyPatch, line_file) -> None:
    """node-b's copy holds lines appended after the plan (its own mtime): its shards read
    the planned lines, as the planner's would, and every check passes, the last shard's
    too (its range ends at the planned size, after a newline)."""
    path, spec, shards = line_file
    planned = path.read_bytes()
    with on_node_b(monkeypatch, path):
        with path.open("ab") as f:
            f.write(b"a line appended on node-b after the plan\n")
        read = [read_on_node_b(s, spec) for s in shards]
        path.write_bytes(planned)
    assert [t for texts, _ in read for t in texts] == LINES
    for shard, (_, copy) in zip(shards, read, strict=True):
        assert copy is not None
        check_copy(shard, copy)


def test_a_parquet_row_group_changed_at_the_same_size_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A Parquet file (uncompressed pages, no statistics: a value edited in place leaves a
    valid file of the same size and footer) whose second row group holds another letter on
    node-b: its shard reads other text there; the driver refuses that shard, naming its row
    group and its bytes, and passes the others."""
    path = tmp_path / "c.parquet"
    rows = [f"row {i:02d} of the table" for i in range(40)]
    pq.write_table(
        pa.table({"text": rows}), path, row_group_size=10, compression="NONE",
        write_statistics=False, use_dictionary=False,
    )  # fmt: skip
    spec = CorpusSpec(str(path))
    shards = plan_shards(spec, 1).shards
    assert [(s.start, s.stop) for s in shards] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    data = path.read_bytes()
    at = data.index(b"row 15 of")
    with on_node_b(monkeypatch, path, data[:at] + b"ROW" + data[at + 3 :]):
        read = [read_on_node_b(s, spec) for s in shards]
    assert [t for texts, _ in read for t in texts] == [
        "ROW 15 of the table" if i == 15 else t for i, t in enumerate(rows)
    ]
    spans = [shard_digest(s) for s in shards]
    assert spans[0].start > 0 and spans[-1].stop < len(data)  # the head and footer: not text
    assert all(a.stop == b.start for a, b in itertools.pairwise(spans))
    assert spans[1].start <= at < spans[1].stop
    for shard, (_, copy) in zip(shards, read, strict=True):
        if shard is not shards[1]:
            check_copy(shard, copy)
    with pytest.raises(CorpusError) as err:
        check_copy(shards[1], read[1][1])
    assert (
        f"corpus file {path} on node-b is not the file on {HERE}: its row groups 1–1, bytes "
        f"[{spans[1].start:,}, {spans[1].stop:,}) and the footer, of shard {shards[1].shard_id} hold other "
        "data (same size, another modification time)"
    ) in str(err.value)


def test_a_parquet_footer_naming_other_columns_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """node-b's copy with the names of two columns of the same width swapped in its footer
    (the same size, the same column chunks' bytes and offsets): its shards read the other
    column's text; the digest covers the footer, so each is refused."""
    path = tmp_path / "c.parquet"
    table = pa.table({"text": [f"text {i}" for i in range(20)], "txet": ["other"] * 20})
    pq.write_table(table, path, row_group_size=10, compression="NONE", store_schema=False)
    spec = CorpusSpec(str(path))
    shards = plan_shards(spec, 1).shards
    data = path.read_bytes()
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    names = {b"text": b"txet", b"txet": b"text"}
    swapped = re.sub(rb"text|txet", lambda m: names[m[0]], data[footer:])
    assert swapped.count(b"txet") == data[footer:].count(b"text") > 0
    with on_node_b(monkeypatch, path, data[:footer] + swapped):
        read = [read_on_node_b(s, spec) for s in shards]
    assert [t for texts, _ in read for t in texts] == ["other"] * 20
    for shard, (_, copy) in zip(shards, read, strict=True):
        with pytest.raises(CorpusError, match="and the footer, of shard"):
            check_copy(shard, copy)


def test_a_driver_off_the_planners_host_is_the_reference(
    monkeypatch: pytest.MonkeyPatch, line_file
) -> None:
    """A resume on another machine: the driver's copy, once its size and tail pass, is what
    node-b's is compared with."""
    path, spec, shards = line_file
    elsewhere = [dataclasses.replace(s, planned_on="head-node") for s in shards]
    with on_node_b(monkeypatch, path):
        read = [read_on_node_b(s, spec) for s in elsewhere]
    for shard, (_, copy) in zip(elsewhere, read, strict=True):
        check_copy(shard, copy)
    data = bytearray(path.read_bytes())
    data[10:11] = b"#"
    with on_node_b(monkeypatch, path, bytes(data)):
        copy = CopyReading(elsewhere[0]).result()
    with pytest.raises(CorpusError, match=rf"on node-b is not the file on {HERE}: its bytes \[0,"):
        check_copy(elsewhere[0], copy)


def test_a_check_cancelled_stops_before_its_next_read(line_file) -> None:
    """The scheduler's event set as the run ends: a check still reading raises
    ``CancelledError`` before its next MiB instead of reading on (a prompt exit)."""
    _, _, shards = line_file
    cancel = threading.Event()
    assert shard_digest(shards[0], cancel) == shard_digest(shards[0])
    cancel.set()
    with pytest.raises(CancelledError):
        shard_digest(shards[0], cancel)


@pytest.mark.parametrize("mtime_s", [1, 0], ids=["own-mtime", "planned-mtime"])
def test_a_copy_written_while_its_shard_was_read_is_refused(
    monkeypatch: pytest.MonkeyPatch, line_file, mtime_s: int
) -> None:
    """node-b's copy is other bytes of the same size as its shard is read, then rewritten to
    the planner's bytes with its modification time put back (a copy still being made, as
    ``rsync -t`` or ``cp -p`` leave it) before the digest: the text read was other, and the
    digest alone would match the driver's (or, at the planned mtime, not be asked). The
    reading's file state (inode, size, times: the change time no call sets back) refuses
    it, whether or not a digest was asked; a copy left alone passes."""
    path, spec, shards = line_file
    planned = path.read_bytes()
    other = bytearray(planned)
    shard = shards[1]
    middle = (shard.start + shard.stop) // 2
    other[middle : middle + 1] = b"#"
    with on_node_b(monkeypatch, path, bytes(other), mtime_s=mtime_s):
        stat = path.stat()
        reading = CopyReading(shard)
        texts = [d.text for d in read_shard(shard, spec, ReadReport())]
        path.write_bytes(planned)  # the copy finished: the planner's bytes, its mtime put back
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        with pytest.raises(CorpusError) as err:
            reading.result()
        copy = CopyReading(shard).result()  # the finished copy, left alone while read
    assert texts != [d.text for d in read_shard(shard, spec, ReadReport())]  # other text read
    assert str(err.value) == (
        f"corpus file {path} on node-b was written while shard {shard.shard_id} was read from "
        "it (its inode, size or times changed): a local --corpus must not change during a run "
        "(a copy or an rsync still running?); the same command resumes once it no longer "
        "changes"
    )
    if mtime_s:  # its digest is the planner's: only the state told the reading apart
        check_copy(shard, copy)
    else:  # no digest asked at the planned mtime: only the state told
        assert copy is None


def test_the_drivers_copy_written_while_it_is_hashed_is_refused(
    monkeypatch: pytest.MonkeyPatch, line_file
) -> None:
    """The driver's own copy rewritten while it hashes it: at the planned mtime (put back) its
    change time says so; at another mtime, the run's own message (the file changed during the
    run). Either way no digest of bytes that were moving is compared."""
    path, spec, shards = line_file
    with on_node_b(monkeypatch, path):
        _, copy = read_on_node_b(shards[0], spec)
    stat = path.stat()
    real = copies.shard_digest

    def rewritten(mtime_ns: int):
        def digest(shard, cancel=None):
            found = real(shard, cancel)
            path.write_bytes(path.read_bytes())
            os.utime(path, ns=(stat.st_atime_ns, mtime_ns))
            return found

        return digest

    monkeypatch.setattr(copies, "shard_digest", rewritten(stat.st_mtime_ns))
    with pytest.raises(CorpusError, match=rf"on {HERE} was written while shard \S+ was checked"):
        check_copy(shards[0], copy)
    monkeypatch.setattr(copies, "shard_digest", rewritten(stat.st_mtime_ns + 10**9))
    with pytest.raises(CorpusError, match="changed during the run"):
        check_copy(shards[0], copy)
    monkeypatch.setattr(copies, "shard_digest", real)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    check_copy(shards[0], copy)


def test_lines_appended_while_a_shard_is_read_pass(monkeypatch: pytest.MonkeyPatch, line_file) -> None:
    """A line file on node-b that grows as its shard is read (lines appended, as to a log):
    its planned bytes are the same, so the reading passes, as the size and tail check lets
    a file grow; the same growth at another inode (a rewrite renamed into place) does not."""
    path, spec, shards = line_file
    planned = path.read_bytes()
    with on_node_b(monkeypatch, path):
        reading = CopyReading(shards[0])
        texts = [d.text for d in read_shard(shards[0], spec, ReadReport())]
        with path.open("ab") as f:
            f.write(b"a line appended on node-b while the run read it\n")
        copy = reading.result()
        path.write_bytes(planned)
        reading = CopyReading(shards[0])
        replaced = path.with_name("c.txt.new")
        replaced.write_bytes(planned + b"a line appended to a new file\n")
        replaced.replace(path)
        with pytest.raises(CorpusError, match="was written while shard"):
            reading.result()
        path.write_bytes(planned)
    assert texts == LINES[: len(texts)] and copy is not None
    check_copy(shards[0], copy)
