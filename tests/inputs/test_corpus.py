"""Tests of corpus sources, shard plans and shard readers (embgeom_ray.inputs.corpus, demo_corpus)."""

from __future__ import annotations

import bz2
import dataclasses
import gzip
import importlib.util
import itertools
import json
import lzma
import os
import pickle
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embgeom_ray.inputs.corpus as corpus_mod
from embgeom_ray.errors import ConfigError, CorpusError
from embgeom_ray.inputs.corpus import (
    CorpusSpec,
    Document,
    ReadReport,
    Shard,
    ShardPlan,
    auto_shard_bytes,
    auto_shard_cap,
    document_id,
    ignored_notices,
    plan_shards,
    read_shard,
    shard_rule,
    token_work,
)
from embgeom_ray.inputs.demo_corpus import main as demo_main
from embgeom_ray.inputs.demo_corpus import python_docs_documents

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


# --------------------------------------------------------------------------------------------
# Helpers


def read_all(spec: CorpusSpec, shard_bytes: int | None = None) -> tuple[list[Document], ReadReport]:
    """Plan and read every shard, each with its own report, as independent workers would."""
    plan = plan_shards(spec, shard_bytes)
    total = ReadReport()
    docs: list[Document] = []
    for shard in plan.shards:
        report = ReadReport()
        shard_docs = list(read_shard(shard, spec, report))
        assert report.documents == len(shard_docs)
        docs.extend(shard_docs)
        total.merge(report)
    assert total.documents == len(docs)
    return docs, total


def texts(docs: list[Document]) -> list[str]:
    return [d.text for d in docs]


def write_parquet(path: Path, table: pa.Table, row_group_size: int) -> None:
    pq.write_table(table, path, row_group_size=row_group_size)


@pytest.fixture
def memfs() -> Iterator[tuple[fsspec.AbstractFileSystem, str]]:
    """A fresh folder on fsspec's in-memory file system, removed afterwards."""
    fs = fsspec.filesystem("memory")
    root = f"/embgeom-test-{uuid.uuid4().hex}"
    fs.mkdir(root)
    yield fs, root
    fs.rm(root, recursive=True)


# --------------------------------------------------------------------------------------------
# Every line exactly once


_ALPHABET = st.characters(
    codec="utf-8",
    exclude_characters="\n\r",
    categories=("L", "N", "P", "S", "Zs", "Cc"),
) | st.sampled_from([" ", "\t", "é", "日", "\u2028", "\x85", "\x0c", "🙂"])
_LINES = st.lists(st.text(_ALPHABET, max_size=40), max_size=40)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    lines=_LINES,
    crlf=st.booleans(),
    final_newline=st.booleans(),
    shard_sizes=st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=3),
    chunk=st.integers(min_value=1, max_value=64),
)
def test_every_line_read_exactly_once(
    lines: list[str], crlf: bool, final_newline: bool, shard_sizes: list[int], chunk: int
) -> None:
    newline = "\r\n" if crlf else "\n"
    body = newline.join(lines) + (newline if final_newline and lines else "")
    data = body.encode("utf-8")
    expected, offsets, pos = [], [], 0
    for line in lines:
        if line.strip():
            expected.append(line)
            offsets.append(pos)
        pos += len(line.encode("utf-8")) + len(newline)
    expected_ids = [document_id("a.txt", o) for o in offsets]

    saved_chunk = corpus_mod._READ_CHUNK
    corpus_mod._READ_CHUNK = chunk  # exercise the reader's buffer refills at every boundary
    try:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "a.txt").write_bytes(data)
            spec = CorpusSpec(tmp)
            if not data:
                with pytest.raises(CorpusError, match="has no data: its file is empty"):
                    plan_shards(spec, 1)
                return
            for size in [*shard_sizes, 1, len(data), None]:
                plan = plan_shards(spec, size)
                docs, report = read_all(spec, size)
                assert texts(docs) == expected, size
                assert [d.doc_id for d in docs] == expected_ids, size
                assert len({d.doc_id for d in docs}) == len(docs)
                assert all(0 <= d.doc_id < 2**63 for d in docs)
                assert report.skipped.get("empty", 0) == sum(
                    1
                    for i, ln in enumerate(lines)
                    if not ln.strip() and (ln or i < len(lines) - 1 or final_newline)
                )
                # Shards tile the file: contiguous byte ranges from 0 to its size.
                assert plan.shards[0].start == 0 and plan.shards[-1].stop == len(data)
                for a, b in itertools.pairwise(plan.shards):
                    assert a.stop == b.start
                assert [s.shard_id for s in plan.shards] == sorted(s.shard_id for s in plan.shards)
    finally:
        corpus_mod._READ_CHUNK = saved_chunk


def test_shard_ids_are_stable_and_sortable(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("one\ntwo\nthree\n" * 100)
    (tmp_path / "b.txt").write_text("four\n" * 100)
    spec = CorpusSpec(str(tmp_path))
    first, second = plan_shards(spec, 100), plan_shards(spec, 100)
    assert first == second
    ids = [s.shard_id for s in first.shards]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert ids[0] == "f00000-b000000000000"
    assert ids[1] == "f00000-b000000000100"
    assert {s.file_index for s in first.shards} == {0, 1}
    assert first.files == [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]


def test_text_lines_keep_inner_whitespace_and_skip_blank_lines(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"  indented  \n\n \t \nend\r\nx\ry\n\xef\xbb\xbfnot a bom\n")
    docs, report = read_all(CorpusSpec(str(tmp_path / "a.txt")))
    assert texts(docs) == ["  indented  ", "end", "x\ry", "\ufeffnot a bom"]
    assert report.skipped == {"empty": 2}


def test_utf8_bom_at_file_start_is_dropped(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfhello\n")
    (tmp_path / "b.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "hi"}\n')
    docs, _ = read_all(CorpusSpec(str(tmp_path)))
    assert texts(docs) == ["hello", "hi"]


# --------------------------------------------------------------------------------------------
# JSON Lines


def test_jsonl_unicode_and_crlf(tmp_path: Path) -> None:
    rows = ["héllo wörld", "日本語のテキスト", "emoji 🙂 and \u2028 separator", "tab\tinside"]
    lines = [json.dumps({"text": t, "id": i}, ensure_ascii=i % 2 == 0) for i, t in enumerate(rows)]
    (tmp_path / "a.jsonl").write_bytes(("\r\n".join(lines) + "\r\n").encode("utf-8"))
    for size in (1, 5, 17, None):
        docs, report = read_all(CorpusSpec(str(tmp_path / "a.jsonl")), size)
        assert texts(docs) == rows
        assert report.skipped == {}
    ids = {d.doc_id for d in read_all(CorpusSpec(str(tmp_path)), 3)[0]}
    assert ids == {d.doc_id for d in docs}


def test_jsonl_text_column_and_read_report(tmp_path: Path) -> None:
    lines = [
        '{"body": "first", "text": 1}',
        "",
        '{"body": null}',
        '{"body": 3}',
        '{"body": ["a", "b"]}',
        "{broken",
        '"just a string"',
        '{"other": "no body here"}',
        '{"body": "   "}',
        '{"body": "second"}',
        "also broken}",
    ]
    raw = ("\n".join(lines) + "\n").encode() + b'{"body": "\xff\xfe"}\n'
    (tmp_path / "a.jsonl").write_bytes(raw)
    docs, report = read_all(CorpusSpec(str(tmp_path), text_column="body"), 7)
    assert texts(docs) == ["first", "second"]
    assert report.documents == 2
    assert report.skipped == {
        "empty": 2,
        "non-text value": 3,
        "invalid JSON": 2,
        "not a JSON object": 1,
        "missing column": 1,
        "invalid UTF-8": 1,
    }
    assert report.total_skipped == 10
    assert ReadReport.from_json(json.loads(json.dumps(report.to_json()))) == report


def test_read_report_merge_and_require_documents() -> None:
    a, b = ReadReport(2, {"empty": 1}), ReadReport(3, {"empty": 2, "invalid JSON": 1})
    assert a.merge(b) == ReadReport(5, {"empty": 3, "invalid JSON": 1})
    a.require_documents("x")
    with pytest.raises(CorpusError, match=r"contains no documents \(skipped: 2 empty\)"):
        ReadReport(0, {"empty": 2}).require_documents("corpus.txt")


def test_corpus_of_only_blank_lines_reads_zero_documents(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("\n  \n\t\n")
    docs, report = read_all(CorpusSpec(str(tmp_path)))
    assert docs == [] and report.skipped == {"empty": 3}
    with pytest.raises(CorpusError, match="contains no documents"):
        report.require_documents(str(tmp_path))


# --------------------------------------------------------------------------------------------
# Compressed files


@pytest.mark.parametrize(
    ("suffix", "compress"),
    [(".gz", gzip.compress), (".bz2", bz2.compress), (".xz", lzma.compress)],
)
def test_compressed_files_are_one_shard_each(tmp_path: Path, suffix: str, compress) -> None:
    text_lines = [f"line number {i} ü" for i in range(500)]
    (tmp_path / f"a.txt{suffix}").write_bytes(compress(("\n".join(text_lines) + "\n").encode()))
    rows = [json.dumps({"text": t}) for t in text_lines[:50]]
    (tmp_path / f"b.jsonl{suffix}").write_bytes(compress(("\n".join(rows) + "\n").encode()))
    spec = CorpusSpec(str(tmp_path))
    plan = plan_shards(spec, 16)
    assert [(s.kind, s.start) for s in plan.shards] == [("text", 0), ("jsonl", 0)]
    docs, _ = read_all(spec, 16)
    assert texts(docs) == text_lines + text_lines[:50]
    # Ids use offsets in the decompressed stream, as for the uncompressed file.
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.txt").write_text("\n".join(text_lines) + "\n")
    plain_docs, _ = read_all(CorpusSpec(str(plain)), 64)
    assert [d.doc_id for d in plain_docs] == [document_id("a.txt", d) for d in _offsets(text_lines)]
    assert [d.doc_id for d in docs[:500]] == [
        document_id(f"a.txt{suffix}", o) for o in _offsets(text_lines)
    ]


def _offsets(lines: list[str]) -> list[int]:
    out, pos = [], 0
    for line in lines:
        out.append(pos)
        pos += len(line.encode()) + 1
    return out


def test_corrupt_gzip_is_a_corpus_error(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00" + b"garbage" * 20)
    with pytest.raises(CorpusError, match=r"cannot decompress .*a\.jsonl\.gz"):
        plan_shards(CorpusSpec(str(tmp_path)))
    (tmp_path / "a.jsonl.gz").unlink()
    path = tmp_path / "b.txt.gz"
    path.write_bytes(b"\x1f\x8b\x08\x00" + b"garbage" * 20)
    spec = CorpusSpec(str(tmp_path))
    with pytest.raises(CorpusError, match=r"cannot decompress .*b\.txt\.gz"):
        plan_shards(spec)  # its first bytes are read for their encoding
    shard = Shard("f00000-b000000000000", str(path), "text", 0, path.stat().st_size, 0)
    with pytest.raises(CorpusError, match=r"cannot decompress .*b\.txt\.gz"):
        list(read_shard(shard, spec, ReadReport()))


@pytest.mark.skipif(importlib.util.find_spec("zstandard") is not None, reason="zstandard present")
def test_zstd_without_zstandard_says_what_to_install(tmp_path: Path) -> None:
    (tmp_path / "a.txt.zst").write_bytes(b"(\xb5/\xfd not really zstd")
    with pytest.raises(CorpusError, match="install the 'zstandard' package"):
        plan_shards(CorpusSpec(str(tmp_path)))


# --------------------------------------------------------------------------------------------
# Parquet


def test_parquet_row_groups_planned_into_several_shards(tmp_path: Path) -> None:
    values = [f"document {i} " + "word " * (i % 13) for i in range(1000)]
    values[10] = None
    values[11] = ""
    values[12] = "  "
    table = pa.table({"id": list(range(1000)), "text": values, "extra": [b"x" * 50] * 1000})
    write_parquet(tmp_path / "a.parquet", table, row_group_size=100)
    spec = CorpusSpec(str(tmp_path / "a.parquet"))
    plan = plan_shards(spec, 1500)
    assert len(plan.shards) > 2
    assert all(s.kind == "parquet" for s in plan.shards)
    assert plan.shards[0].start == 0 and plan.shards[-1].stop == 10
    for a, b in itertools.pairwise(plan.shards):
        assert a.stop == b.start and a.stop > a.start
    assert [s.shard_id for s in plan.shards][:2] == [
        "f00000-g000000000000",
        f"f00000-g{plan.shards[1].start:012d}",
    ]
    docs, report = read_all(spec, 1500)
    expected = [v for v in values if isinstance(v, str) and v.strip()]
    assert texts(docs) == expected
    assert report.skipped == {"non-text value": 1, "empty": 2}
    ids = [d.doc_id for d in docs]
    assert ids == [
        document_id("a.parquet", i)
        for i, v in enumerate(values)
        if isinstance(v, str) and v.strip()
    ]
    whole, _ = read_all(spec, 10**9)
    assert len(plan_shards(spec, 10**9).shards) == 1
    assert [d.doc_id for d in whole] == ids


def test_parquet_dictionary_and_large_string_columns(tmp_path: Path) -> None:
    arr = pa.array(["a b", "c d", "a b"]).dictionary_encode()
    pq.write_table(pa.table({"text": arr}), tmp_path / "a.parquet")
    pq.write_table(
        pa.table({"text": pa.array(["e f"], type=pa.large_string())}), tmp_path / "b.parquet"
    )
    docs, _ = read_all(CorpusSpec(str(tmp_path)))
    assert texts(docs) == ["a b", "c d", "a b", "e f"]


def test_parquet_missing_column_lists_columns(tmp_path: Path) -> None:
    pq.write_table(pa.table({"body": ["x"], "n": [1]}), tmp_path / "a.parquet")
    with pytest.raises(CorpusError) as err:
        plan_shards(CorpusSpec(str(tmp_path)))
    assert str(err.value) == f"{tmp_path / 'a.parquet'} has no column 'text'; columns are: body, n"


def test_parquet_non_string_column(tmp_path: Path) -> None:
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "a.parquet")
    with pytest.raises(CorpusError, match=r"column 'text' of .*a\.parquet has type int64"):
        plan_shards(CorpusSpec(str(tmp_path)))


def test_corrupt_parquet_fails_at_plan_time(tmp_path: Path) -> None:
    pq.write_table(pa.table({"text": ["good"]}), tmp_path / "a.parquet")
    (tmp_path / "b.parquet").write_bytes(b"PAR1 this is not parquet at all")
    with pytest.raises(CorpusError, match=r"cannot read Parquet file .*b\.parquet"):
        plan_shards(CorpusSpec(str(tmp_path)))


# --------------------------------------------------------------------------------------------
# Directories, globs, fsspec URLs


def _tree(root: Path) -> None:
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / ".hidden").mkdir()
    (root / "_temporary").mkdir()
    (root / "a.txt").write_text("alpha one\nalpha two\n")
    (root / "sub" / "b.jsonl").write_text('{"text": "beta"}\n')
    (root / "sub" / "deeper" / "c.txt").write_text("gamma\n")
    (root / "z.text").write_text("zeta\n")
    (root / "_SUCCESS").write_text("")
    (root / ".a.txt.crc").write_text("crc\n")
    (root / ".hidden" / "h.txt").write_text("hidden\n")
    (root / "_temporary" / "t.txt").write_text("temporary\n")
    (root / "README.md").write_text("# not corpus\n")


def test_directory_recurses_sorted_and_ignores_hidden(tmp_path: Path) -> None:
    _tree(tmp_path)
    spec = CorpusSpec(str(tmp_path))
    plan = plan_shards(spec)
    rel = [os.path.relpath(f, tmp_path) for f in plan.files]
    assert rel == ["a.txt", "sub/b.jsonl", "sub/deeper/c.txt", "z.text"]
    assert plan.ignored == ["README.md"]  # of no corpus type: named, not read
    assert plan.hidden == [".hidden/h.txt", "_temporary/t.txt"]  # of a corpus type: named too
    docs, _ = read_all(spec)
    assert texts(docs) == ["alpha one", "alpha two", "beta", "gamma", "zeta"]
    assert docs[2].doc_id == document_id("sub/b.jsonl", 0)
    # A trailing slash and a file:// URL name the same corpus.
    assert plan_shards(CorpusSpec(str(tmp_path) + "/")) == plan
    assert plan_shards(CorpusSpec("file://" + str(tmp_path))).fingerprint == plan.fingerprint


def test_files_of_other_types_in_a_directory_are_named(tmp_path: Path) -> None:
    """A directory's files of no corpus type (a .csv export, a README) were left out without a
    word; the plan lists them and :func:`ignored_notice` names them in one line."""
    (tmp_path / "a.jsonl").write_text('{"text": "alpha"}\n')
    for name in ("notes.csv", "README.md", "x.tsv", "y.jsonl.zip", "z.html", "zz.xml"):
        (tmp_path / name).write_text("text\n")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref\n")
    plan = plan_shards(CorpusSpec(str(tmp_path)))
    assert plan.ignored == ["README.md", "notes.csv", "x.tsv", "y.jsonl.zip", "z.html", "zz.xml"]
    assert plan.hidden == []  # .git/HEAD is of no corpus type: not worth a word
    assert ignored_notices(plan, "data/") == [
        "corpus: 6 files in data/ of no corpus type (1 corpus file read; supported: .txt, "
        ".text, .jsonl, .json, .ndjson, .parquet, .pq (line formats also with .gz, .bz2, .xz, "
        ".zst)) left out: README.md, notes.csv, x.tsv, y.jsonl.zip, z.html, ..."
    ]
    only = plan_shards(CorpusSpec(str(tmp_path / "a.jsonl")))
    assert only.ignored == only.hidden == [] and ignored_notices(only, "a.jsonl") == []
    assert ShardPlan.from_json(plan.to_json()).ignored == []  # found again on every run


def test_a_text_column_over_plain_text_files_is_named_as_not_applying(tmp_path: Path) -> None:
    """``--text-column body`` over ``.txt`` files, which have no columns (a line is a
    document), was ignored without a word: one line says so; none with the default column,
    or where every file has columns."""
    from embgeom_ray.inputs.corpus import column_notices

    (tmp_path / "a.txt").write_text("alpha\nbeta\n")
    text = plan_shards(CorpusSpec(str(tmp_path / "a.txt"), "body"))
    assert column_notices(text, "body") == [
        "corpus: --text-column body does not apply to plain text files, where a line is a "
        "document: the corpus is plain text"
    ]
    assert column_notices(text, "text") == []
    (tmp_path / "b.jsonl").write_text('{"body": "gamma"}\n')
    (tmp_path / "c.jsonl").write_text('{"body": "delta"}\n')
    mixed = plan_shards(CorpusSpec(str(tmp_path), "body"))
    assert column_notices(mixed, "body") == [
        "corpus: --text-column body does not apply to plain text files, where a line is a "
        "document: 1 of the corpus's 3 files is plain text, the others are read by that column"
    ]
    jsonl = plan_shards(CorpusSpec(str(tmp_path / "b.jsonl"), "body"))
    assert column_notices(jsonl, "body") == []


def test_corpus_files_under_hidden_names_in_a_directory_are_named(tmp_path: Path) -> None:
    """A directory's ``_train.jsonl`` was left out without a word (and a directory of only
    such files was said to be empty): named, and never read."""
    (tmp_path / "_train.jsonl").write_text('{"text": "train"}\n')
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / ".ipynb_checkpoints" / "a-checkpoint.txt").write_text("copy\n")
    (tmp_path / "_SUCCESS").write_text("")
    with pytest.raises(CorpusError) as err:
        plan_shards(CorpusSpec(str(tmp_path)))
    assert str(err.value).endswith(
        "; a name starting with '.' or '_' is never read); it holds: "
        ".ipynb_checkpoints/a-checkpoint.txt, _train.jsonl"
    )
    (tmp_path / "test.txt").write_text("test\n")
    plan = plan_shards(CorpusSpec(str(tmp_path)))
    assert plan.hidden == [".ipynb_checkpoints/a-checkpoint.txt", "_train.jsonl"]
    assert plan.ignored == []  # _SUCCESS: a marker of no corpus type
    assert ignored_notices(plan, "data/") == [
        "corpus: 2 files in data/ of a corpus type left out, a name in the path starting with "
        "'.' or '_' (hidden files, markers; 1 corpus file read): "
        ".ipynb_checkpoints/a-checkpoint.txt, _train.jsonl"
    ]
    assert texts(read_all(CorpusSpec(str(tmp_path)))[0]) == ["test"]


def test_glob(tmp_path: Path) -> None:
    _tree(tmp_path)
    docs, _ = read_all(CorpusSpec(str(tmp_path / "*.txt")))
    assert texts(docs) == ["alpha one", "alpha two"]
    docs, _ = read_all(CorpusSpec(str(tmp_path / "**" / "*.txt")))
    assert texts(docs) == ["alpha one", "alpha two", "gamma"]
    # Relative paths from the glob's base: the same ids as when reading the directory.
    dir_docs, _ = read_all(CorpusSpec(str(tmp_path)))
    assert {d.doc_id for d in docs} <= {d.doc_id for d in dir_docs}


def test_single_file_and_directory_give_the_same_ids(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("one\ntwo\n")
    single, _ = read_all(CorpusSpec(str(tmp_path / "a.txt")))
    whole, _ = read_all(CorpusSpec(str(tmp_path)))
    assert single == whole


def test_memory_fsspec_url(memfs: tuple[fsspec.AbstractFileSystem, str]) -> None:
    fs, root = memfs
    fs.pipe(f"{root}/data/a.txt", b"first line\nsecond line\n" * 20)
    fs.pipe(f"{root}/data/b.jsonl", b'{"text": "json doc"}\n')
    fs.pipe(f"{root}/data/_SUCCESS", b"")
    buf = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": ["p1", "p2", "p3"]}), buf, row_group_size=1)
    fs.pipe(f"{root}/data/c.parquet", buf.getvalue().to_pybytes())
    spec = CorpusSpec(f"memory://{root}/data")
    plan = plan_shards(spec, 64)
    assert all(s.path.startswith("memory://") for s in plan.shards)
    assert len(plan.shards) > 3
    docs, _ = read_all(spec, 64)
    assert texts(docs) == ["first line", "second line"] * 20 + ["json doc", "p1", "p2", "p3"]
    assert plan_shards(spec, 64).fingerprint == plan.fingerprint
    globbed, _ = read_all(CorpusSpec(f"memory://{root}/data/*.jsonl"))
    assert texts(globbed) == ["json doc"]
    assert globbed[0].doc_id == docs[40].doc_id
    fs.pipe(f"{root}/data/b.jsonl", b'{"text": "json doc changed"}\n')
    assert plan_shards(spec, 64).fingerprint != plan.fingerprint


def test_an_s3_corpus_is_fetched_once_not_by_read_ahead_blocks(tmp_path: Path) -> None:
    """s3fs reads ahead by its default block, 50 MiB, whatever the read is for: the plan's
    look at each line file's head fetched 7.6 MiB of each 8 MB file, and reading one file cut
    into 1 MiB shards fetched 33 MiB of its 7.6 (each shard to the end of the file). Now the
    plan fetches a file's head, and each shard its range and the line that crosses its end."""
    import s3fs

    from tests.object_store import moto_server, s3_env

    with moto_server(tmp_path / "moto.log") as endpoint, pytest.MonkeyPatch.context() as mp:
        for key, value in s3_env(endpoint).items():
            mp.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
        fs.mkdir("heads")
        line = json.dumps({"text": "word " * 100}) + "\n"
        data = (line * (8_000_000 // len(line))).encode()
        fs.pipe("heads/c/a.jsonl", data)
        fs.pipe("heads/c/b.txt", data)
        fs.pipe("heads/c/c.txt.gz", gzip.compress(data))
        fetched: list[int] = []
        fetch = s3fs.core.S3File._fetch_range

        def counted(self, start: int, end: int) -> bytes:
            fetched.append(end - start)
            return fetch(self, start, end)

        mp.setattr(s3fs.core.S3File, "_fetch_range", counted)
        s3fs.S3FileSystem.clear_instance_cache()
        spec = CorpusSpec("s3://heads/c")
        plan = plan_shards(spec, 1 << 20)
        assert len(plan.shards) == 8 + 8 + 1
        # the heads (≤ 64 KiB a file) and the uncompressed line files' last 4 KiB (their tails)
        assert len(fetched) == 3 + 2 and sum(fetched) < 1 << 20
        fetched.clear()
        lines = [s for s in plan.shards if s.kind == "jsonl"]
        docs = [d for s in lines for d in read_shard(s, spec, ReadReport())]
        assert len(docs) == len(data) // len(line)
        assert len(data) <= sum(fetched) < len(data) + len(lines) * 70_000
        # an object written again (another ETag) to the same size ends the run where a shard
        # of it is read; lines "appended" (a larger object, the same planned bytes) do not
        text = plan.shards[-2]
        assert text.path == "s3://heads/c/b.txt" and text.identity.startswith("ETag=")
        fs.pipe("heads/c/b.txt", data.replace(b"word", b"WORD", 1))
        with pytest.raises(CorpusError, match=r"corpus file s3://heads/c/b\.txt changed during"):
            list(read_shard(text, spec, ReadReport()))
        fs.pipe("heads/c/b.txt", data + line.encode())
        assert len(list(read_shard(text, spec, ReadReport()))) > 0
        # a Parquet file's shards fetch the text column's chunks (and the footer), not the
        # other columns' nor the file's rest from each row group on (87.7 MiB of 15.8)
        rng = np.random.default_rng(0)  # text that compresses little, as real text
        texts = [" ".join(f"w{n}" for n in row) for row in rng.integers(0, 10**6, (20_000, 60))]
        table = pa.table({"text": texts, "other": [t.upper() for t in texts]})
        with fs.open("heads/p/a.parquet", "wb") as f:
            pq.write_table(table, f, row_group_size=2000)
        spec = CorpusSpec("s3://heads/p")
        plan = plan_shards(spec, 1 << 20)
        fetched.clear()
        docs = [d for s in plan.shards for d in read_shard(s, spec, ReadReport())]
        assert len(docs) == 20_000 and len(plan.shards) > 1
        meta = pq.ParquetFile(fs.open("heads/p/a.parquet")).metadata
        text_bytes = sum(
            meta.row_group(g).column(0).total_compressed_size for g in range(meta.num_row_groups)
        )
        assert text_bytes <= sum(fetched) < text_bytes + len(plan.shards) * 80_000  # + footer
        s3fs.S3FileSystem.clear_instance_cache()


def test_same_corpus_elsewhere_gives_same_ids_and_fingerprint(tmp_path: Path) -> None:
    src = tmp_path / "one"
    src.mkdir()
    _tree(src)
    shutil.copytree(src, tmp_path / "two")  # copy2 keeps mtimes
    a, b = CorpusSpec(str(src)), CorpusSpec(str(tmp_path / "two"))
    assert plan_shards(a).fingerprint == plan_shards(b).fingerprint
    assert read_all(a) == read_all(b)


# --------------------------------------------------------------------------------------------
# Datasets


def test_save_to_disk_dataset(tmp_path: Path) -> None:
    import datasets

    values = [f"row {i} text" for i in range(50)]
    values[3], values[4] = None, " "
    ds = datasets.Dataset.from_dict({"text": values, "label": list(range(50))})
    ds.save_to_disk(str(tmp_path / "ds"))
    spec = CorpusSpec(str(tmp_path / "ds"))
    plan = plan_shards(spec, 40)
    assert all(s.kind == "hf" for s in plan.shards) and len(plan.shards) > 5
    assert plan.shards[0].start == 0 and plan.shards[-1].stop == 50
    assert plan.shards[0].shard_id == "f00000-r000000000000"
    docs, report = read_all(spec, 40)
    expected = [(i, v) for i, v in enumerate(values) if v and v.strip()]
    assert texts(docs) == [v for _, v in expected]
    assert [d.doc_id for d in docs] == [document_id("", i) for i, _ in expected]
    assert report.skipped == {"non-text value": 1, "empty": 1}
    one_row, _ = read_all(spec, 1)
    assert len(plan_shards(spec, 1).shards) == 50 and one_row == docs
    assert plan_shards(spec, 40).fingerprint == plan.fingerprint
    assert plan_shards(CorpusSpec(str(tmp_path / "ds"), text_column="text"), 41).fingerprint != (
        plan.fingerprint
    )


def test_save_to_disk_dataset_dict_splits(tmp_path: Path) -> None:
    import datasets

    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"content": ["a train doc", "another"]}),
            "test": datasets.Dataset.from_dict({"content": ["a test doc"]}),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    docs, _ = read_all(CorpusSpec(str(tmp_path / "dd"), text_column="content", split="test"))
    assert texts(docs) == ["a test doc"]
    assert docs[0].doc_id == document_id("test", 0)
    with pytest.raises(CorpusError, match="has no split 'validation'; splits are: train, test"):
        plan_shards(CorpusSpec(str(tmp_path / "dd"), text_column="content", split="validation"))
    with pytest.raises(CorpusError, match="has no column 'text'; columns are: content"):
        plan_shards(CorpusSpec(str(tmp_path / "dd")))


def test_hf_dataset_from_local_builder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"text": "hub doc one"}\n{"text": "two"}\n')
    spec = CorpusSpec(f"hf:{tmp_path / 'data'}")
    plan = plan_shards(spec)
    assert [s.kind for s in plan.shards] == ["hf"] and plan.files == [spec.source]
    docs, _ = read_all(spec)
    assert texts(docs) == ["hub doc one", "two"]
    with pytest.raises(CorpusError, match="has no column 'body'; columns are: text"):
        plan_shards(CorpusSpec(spec.source, text_column="body"))


def test_hf_dataset_unreachable_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets
    import huggingface_hub.constants

    # datasets < 2.20 names it HF_DATASETS_OFFLINE
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CorpusError, match="cannot load Hugging Face dataset 'hf:no-such-ds-x:cfg'"):
        plan_shards(CorpusSpec("hf:no-such-ds-x:cfg"))
    with pytest.raises(CorpusError, match="expected hf:NAME or hf:NAME:CONFIG"):
        plan_shards(CorpusSpec("hf:"))


# --------------------------------------------------------------------------------------------
# Errors the user can cause


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match=r"corpus '.*nope\.txt' does not exist"):
        plan_shards(CorpusSpec(str(tmp_path / "nope.txt")))


def test_glob_matching_nothing(tmp_path: Path) -> None:
    (tmp_path / "_SUCCESS").write_text("")
    with pytest.raises(CorpusError, match=r"corpus '.*\*\.jsonl' matches no files"):
        plan_shards(CorpusSpec(str(tmp_path / "*.jsonl")))
    # the files it matches are there, but never read: said so (it said "matches no files")
    (tmp_path / "_train.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(CorpusError) as err:
        plan_shards(CorpusSpec(str(tmp_path / "_*")))
    assert str(err.value) == (
        f"corpus '{tmp_path / '_*'}' matches only files that are never read, a name in their "
        "path starting with '.' or '_' (hidden files, markers such as _SUCCESS): _SUCCESS, "
        "_train.jsonl; rename them to read them"
    )


def test_directory_without_corpus_files(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match=r"contains no corpus files .*; it is empty"):
        plan_shards(CorpusSpec(str(tmp_path)))
    (tmp_path / "notes.md").write_text("x")
    (tmp_path / "data.csv").write_text("text\nx\n")
    (tmp_path / "_SUCCESS").write_text("")
    with pytest.raises(CorpusError) as err:
        plan_shards(CorpusSpec(str(tmp_path)))
    message = str(err.value)
    assert "contains no corpus files (supported: .txt, .text, .jsonl" in message
    assert message.endswith("it holds: data.csv, notes.md")


def test_unsupported_extension(tmp_path: Path) -> None:
    (tmp_path / "data.csv").write_text("text\nx\n")
    with pytest.raises(CorpusError, match=r"data\.csv: unsupported file type '\.csv'; supported"):
        plan_shards(CorpusSpec(str(tmp_path / "data.csv")))
    (tmp_path / "a.txt").write_text("x\n")
    with pytest.raises(CorpusError, match=r"data\.csv: unsupported file type"):
        plan_shards(CorpusSpec(str(tmp_path / "*")))
    (tmp_path / "b.parquet.gz").write_bytes(b"")
    with pytest.raises(CorpusError, match=r"unsupported file type '\.parquet\.gz'"):
        plan_shards(CorpusSpec(str(tmp_path / "b.parquet.gz")))


def test_all_files_empty(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.jsonl").write_text("")
    with pytest.raises(CorpusError, match=r"has no data: its 2 files are all empty"):
        plan_shards(CorpusSpec(str(tmp_path)))


def test_empty_file_among_others_has_no_shard(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.txt").write_text("b\n")
    plan = plan_shards(CorpusSpec(str(tmp_path)))
    assert [s.file_index for s in plan.shards] == [1] and len(plan.files) == 2


def test_jsonl_missing_column_in_first_object(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('\n{"body": "x", "id": 1}\n{"text": "y"}\n')
    with pytest.raises(CorpusError) as err:
        plan_shards(CorpusSpec(str(tmp_path)))
    assert str(err.value) == f"{tmp_path / 'a.jsonl'} has no column 'text'; columns are: body, id"
    # The reader checks it too (for a plan made before the file changed).
    shard = Shard("f00000-b000000000000", str(tmp_path / "a.jsonl"), "jsonl", 0, 100, 0)
    with pytest.raises(CorpusError, match="has no column 'text'; columns are: body, id"):
        list(read_shard(shard, CorpusSpec(str(tmp_path)), ReadReport()))


def test_jsonl_every_line_invalid(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text('{"text": "a",\n"n": 1}\n"x"\n')
    with pytest.raises(CorpusError) as err:
        plan_shards(CorpusSpec(str(tmp_path)))
    assert str(err.value) == (
        f"{tmp_path / 'a.json'} is not JSON Lines: none of its 3 non-empty lines is a JSON "
        """object (line 1: '{"text": "a",')"""
    )
    shard = Shard("f00000-b000000000000", str(tmp_path / "a.json"), "jsonl", 0, 10**6, 0)
    with pytest.raises(CorpusError, match="none of its 3 non-empty lines is a JSON object"):
        list(read_shard(shard, CorpusSpec(str(tmp_path)), ReadReport()))


@pytest.mark.parametrize(
    ("body", "line", "preview"),
    [
        # one object a line, commas between: the last object alone parsed, the others were
        # skipped as invalid JSON (1 document of 3 read, exit status 0)
        (
            '[\n{"text": "alpha one"},\n{"text": "beta two"},\n{"text": "gamma three"}\n]\n',
            1,
            "'['",
        ),
        ('\n  [{"text": "alpha one"},\n{"text": "beta two"}]\n', 2, """'  [{"text": "alpha one"},'"""),
        (json.dumps([{"text": "a"}], indent=2) + "\n", 1, "'['"),
        # a document holding its records, one a line: the last of them alone was read
        ('{\n "data": [\n  {"text": "a"},\n  {"text": "b"}\n ]\n}\n', 1, "'{'"),
    ],
)
def test_a_json_array_or_object_over_several_lines_is_refused(
    tmp_path: Path, body: str, line: int, preview: str
) -> None:
    (tmp_path / "a.json").write_text(body)
    with pytest.raises(CorpusError) as err:
        plan_shards(CorpusSpec(str(tmp_path)))
    what = "a JSON object" if preview == "'{'" else "a JSON array"
    assert str(err.value) == (
        f"{tmp_path / 'a.json'} is not JSON Lines but {what} spread over several lines "
        f"(line {line}: {preview}); write one JSON object per line, without the brackets and "
        "commas between them"
    )


def test_a_single_line_json_array_is_not_json_lines(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text('[{"text": "a"}, {"text": "b"}]\n')
    with pytest.raises(CorpusError, match="none of its 1 non-empty lines is a JSON object"):
        plan_shards(CorpusSpec(str(tmp_path)))


@pytest.mark.parametrize(
    ("codec", "encoding", "name"),
    [
        ("utf-16", "UTF-16", "a.txt"),
        ("utf-16-be", "UTF-16", "a.txt"),
        ("utf-32", "UTF-32", "a.txt"),
        ("utf-16", "UTF-16", "a.jsonl"),
        ("utf-16", "UTF-16", "a.txt.gz"),
    ],
)
def test_a_utf16_or_utf32_file_is_refused(
    tmp_path: Path, codec: str, encoding: str, name: str
) -> None:
    """Read as UTF-8, a UTF-16 text file's lines after the first were documents with a NUL
    between every two characters (and its last a lone NUL): refused, naming the encoding."""
    text = (
        '{"text": "First line"}\r\n{"text": "Second"}\r\n'
        if "jsonl" in name
        else "First line\r\nSecond line of text\r\n"
    )
    data = text.encode(codec)
    if codec == "utf-16-be":
        data = b"\xfe\xff" + data
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    message = (
        f"{path} is {encoding}-encoded (its first bytes are the {encoding} byte-order mark); "
        f"corpus files must be UTF-8: convert it (e.g. iconv -f {encoding} -t UTF-8)"
    )
    with pytest.raises(CorpusError) as err:
        plan_shards(CorpusSpec(str(path)))
    assert str(err.value) == message
    # The reader checks it too (for a plan made before the file changed).
    kind = "jsonl" if "jsonl" in name else "text"
    shard = Shard("f00000-b000000000000", str(path), kind, 0, path.stat().st_size, 0)
    with pytest.raises(CorpusError) as err:
        list(read_shard(shard, CorpusSpec(str(path)), ReadReport()))
    assert str(err.value) == message


def test_bad_shard_size(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x\n")
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ConfigError, match="shard size must be a positive number of bytes"):
            plan_shards(CorpusSpec(str(tmp_path)), bad)  # type: ignore[arg-type]


def test_file_deleted_after_planning(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x\n")
    spec = CorpusSpec(str(tmp_path))
    plan = plan_shards(spec)
    (tmp_path / "a.txt").unlink()
    with pytest.raises(CorpusError, match=r"a\.txt no longer exists"):
        list(read_shard(plan.shards[0], spec, ReadReport()))


@pytest.mark.parametrize("name", ["a.txt", "a.jsonl"])
def test_file_cut_shorter_after_planning_is_an_error(tmp_path: Path, name: str) -> None:
    """A line file cut shorter during the run: its shards past the new end read nothing, and
    the one across it part of its lines (21 of 40 documents read, no word said); now the shard
    that meets the end too soon says the file changed."""
    lines = [f"document number {i} of forty" for i in range(40)]
    if name.endswith(".jsonl"):
        lines = [json.dumps({"text": t}) for t in lines]
    path = tmp_path / name
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(data)
    spec = CorpusSpec(str(path))
    plan = plan_shards(spec, 400)
    assert len(plan.shards) == -(-len(data) // 400)
    stat = path.stat()
    path.write_bytes(data[:500])  # a cut that keeps its mtime (a coarse clock): the reader's
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    message = (
        f"corpus file {path} changed during the run: it is 500 bytes, {{}} or more when the run "
        "was planned; rerun with --overwrite once it no longer changes"
    )
    for shard in plan.shards:
        report = ReadReport()
        if shard.stop <= 500:  # wholly before the cut: read as planned
            assert len(list(read_shard(shard, spec, report))) == report.documents > 0
            continue
        with pytest.raises(CorpusError) as err:
            list(read_shard(shard, spec, report))
        assert str(err.value) == message.format(f"{shard.stop:,}")


def test_a_file_rewritten_shorter_ends_every_shard_of_it(tmp_path: Path) -> None:
    """A line file rewritten shorter with other text (a later mtime): its shards before the
    new end read the new text without a word, the check leaving the cut to the shard that
    meets the new end, which may have run already (or be the one whose end check this was),
    so the run ended with text its fingerprint did not name; now every shard of it says the
    file changed. A cut that kept its mtime is still the reader's (the sizes), as before."""
    path = tmp_path / "a.txt"
    lines = [f"document number {i} of forty" for i in range(40)]
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(data)
    spec = CorpusSpec(str(path))
    plan = plan_shards(spec, 400)
    stat = path.stat()
    path.write_bytes(data[:500].upper())
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    mtime = path.stat().st_mtime
    assert [s.stop for s in plan.shards][:1] == [400]  # one shard wholly before the cut
    for shard in plan.shards:
        with pytest.raises(CorpusError) as err:
            list(read_shard(shard, spec, ReadReport()))
        assert str(err.value) == (
            f"corpus file {path} changed during the run: it was written after the run was "
            f"planned (mtime={stat.st_mtime!r}, {len(data):,} bytes; now mtime={mtime!r}, "
            "500 bytes); rerun with --overwrite once it no longer changes"
        )


@pytest.mark.parametrize("change", ["same size", "larger", "touch", "parquet"])
def test_a_file_written_in_place_during_the_run_ends_it(tmp_path: Path, change: str) -> None:
    """A file rewritten to the same or a larger size (or touched) after planning: its byte
    ranges still read, and the run measured other text than its fingerprint says, without a
    word; now a shard of it says the file changed. A plan saved and read back (a resume) of
    the unchanged file reads it, and one saved before the file states were checks nothing."""
    import os

    name = "a.parquet" if change == "parquet" else "a.txt"
    path = tmp_path / name
    lines = [f"document number {i} of forty" for i in range(40)]
    if change == "parquet":
        pq.write_table(pa.table({"text": lines}), path, row_group_size=10)
    else:
        path.write_text("\n".join(lines) + "\n")
    spec = CorpusSpec(str(path))
    plan = ShardPlan.from_json(json.loads(json.dumps(plan_shards(spec, 400).to_json())))
    assert [len(list(read_shard(s, spec, ReadReport()))) for s in plan.shards]  # unchanged
    stat = path.stat()
    if change == "same size":
        path.write_text("\n".join(t.replace("forty", "FORTY") for t in lines) + "\n")
    elif change == "larger":
        path.write_text("\n".join(t + "!" for t in lines) + "\n")
    elif change == "parquet":
        pq.write_table(pa.table({"text": [t.upper() for t in lines]}), path, row_group_size=10)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a later mtime, surely
    size, mtime = path.stat().st_size, path.stat().st_mtime
    assert size > stat.st_size if change == "larger" else size == stat.st_size
    for shard in plan.shards:
        with pytest.raises(CorpusError) as err:
            list(read_shard(shard, spec, ReadReport()))
        assert str(err.value) == (
            f"corpus file {path} changed during the run: it was written after the run was "
            f"planned (mtime={stat.st_mtime!r}, {stat.st_size:,} bytes; now "
            f"mtime={mtime!r}, {size:,} bytes); rerun with --overwrite once it no longer "
            "changes"
        )
    # an identity of a key the file system's info does not give (an HTTP listing's): unchecked
    other = dataclasses.replace(plan.shards[0], identity="ETag='\"x\"'")
    assert list(read_shard(other, spec, ReadReport()))
    old = plan.to_json()
    del old["file_states"]  # a run.json written before them: read as before
    assert all(s.identity == "" for s in ShardPlan.from_json(old).shards)
    assert list(read_shard(ShardPlan.from_json(old).shards[0], spec, ReadReport()))


def test_another_nodes_copy_is_checked_by_its_size_and_tail(tmp_path: Path) -> None:
    """A local corpus read on a node other than the one that planned it is that node's copy
    or view of it, with modification times of its own (a copy made without ``cp -p``): its
    shards read where the copy holds the same bytes at the planned end, or lines appended;
    one of other text at the same size, or of another size, ends the run naming both hosts.
    On the planner's own host a later modification time still ends it."""
    import os
    import socket

    path = tmp_path / "a.txt"
    lines = [f"document number {i} of forty" for i in range(40)]
    path.write_text("\n".join(lines) + "\n")
    spec = CorpusSpec(str(path))
    plan = ShardPlan.from_json(json.loads(json.dumps(plan_shards(spec, 400).to_json())))
    here = socket.gethostname()
    assert {s.planned_on for s in plan.shards} == {here}
    elsewhere = [dataclasses.replace(s, planned_on="head-node") for s in plan.shards]
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the copy's own mtime
    assert sum(len(list(read_shard(s, spec, ReadReport()))) for s in elsewhere) == 40
    with pytest.raises(CorpusError, match="changed during the run"):
        list(read_shard(plan.shards[0], spec, ReadReport()))  # on the planner's host
    with path.open("a") as f:
        f.write("appended\n")
    assert sum(len(list(read_shard(s, spec, ReadReport()))) for s in elsewhere) == 40
    path.write_text("\n".join(t.replace("forty", "FORTY") for t in lines) + "\n")
    with pytest.raises(CorpusError) as err:
        list(read_shard(elsewhere[0], spec, ReadReport()))
    assert str(err.value) == (
        f"corpus file {path} on {here} is not the file the run planned on head-node "
        f"({stat.st_size:,} bytes; here {stat.st_size:,} bytes, other text at the planned end): "
        "a local --corpus must be the same files on every node (a shared file system, or "
        "identical copies); rerun with --overwrite once they are"
    )
    path.write_text("\n".join(lines[:20]) + "\n")
    with pytest.raises(CorpusError, match=r"planned on head-node \(1,\d+ bytes; here \d+ bytes\)"):
        list(read_shard(elsewhere[0], spec, ReadReport()))
    # a plan saved with three fields a file (before the planner's host): checked as before
    old = plan.to_json()
    old["file_states"] = [state[:3] for state in old["file_states"]]
    assert {s.planned_on for s in ShardPlan.from_json(old).shards} == {""}


def test_lines_appended_after_planning_are_left_to_the_next_run(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    path.write_text("".join(f"line {i}\n" for i in range(30)))
    spec = CorpusSpec(str(path))
    plan = plan_shards(spec, 64)
    with path.open("a") as f:
        f.write("appended one\nappended two\n")
    got = [d.text for s in plan.shards for d in read_shard(s, spec, ReadReport())]
    assert got == [f"line {i}" for i in range(30)]


# --------------------------------------------------------------------------------------------
# Plan identity and persistence


def test_fingerprint_stable_and_sensitive(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("one\ntwo\n")
    (tmp_path / "b.jsonl").write_text('{"text": "three", "t2": "3"}\n')
    spec = CorpusSpec(str(tmp_path))
    base = plan_shards(spec)
    assert plan_shards(spec).fingerprint == base.fingerprint
    assert len(base.fingerprint) == 64 and int(base.fingerprint, 16) >= 0
    assert plan_shards(spec, 3).fingerprint != base.fingerprint
    assert plan_shards(CorpusSpec(str(tmp_path), text_column="t2")).fingerprint != (
        base.fingerprint
    )
    # Same size, new mtime.
    before = os.stat(tmp_path / "a.txt")
    (tmp_path / "a.txt").write_text("one\ntwx\n")
    os.utime(tmp_path / "a.txt", ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    changed = plan_shards(spec)
    assert changed.fingerprint != base.fingerprint
    # Appended text.
    with open(tmp_path / "b.jsonl", "a") as f:
        f.write('{"text": "four"}\n')
    assert plan_shards(spec).fingerprint not in (base.fingerprint, changed.fingerprint)
    assert plan_shards(spec).total_bytes == base.total_bytes + len('{"text": "four"}\n')
    # A new file.
    (tmp_path / "c.txt").write_text("five\n")
    assert len(plan_shards(spec).files) == 3


def test_auto_shard_size() -> None:
    assert auto_shard_bytes(0) == 1024 * 1024
    assert auto_shard_bytes(16 * 1024 * 1024) == 1024 * 1024
    assert auto_shard_bytes(64 * 1024 * 1024) == 4 * 1024 * 1024
    assert auto_shard_bytes(40 << 30) == 16 * 1024 * 1024  # 2,560 shards
    assert auto_shard_bytes(1 << 40) == 16 * 1024 * 1024  # 65,536 shards
    assert auto_shard_bytes(10**13) == -(-(10**13) // 65_536)  # no more shards than that


def test_auto_shard_size_follows_the_models_work_a_token() -> None:
    """Models of more work a token (blocks · d²) than Llama 3 8B get smaller default shards,
    in proportion, never under 1 MiB; MiniLM and the 8B keep 16 MiB."""
    minilm, llama8b, llama70b = token_work(6, 384), token_work(32, 4096), token_work(80, 8192)
    assert auto_shard_cap(minilm) == auto_shard_cap(llama8b) == auto_shard_cap(0) == 16 << 20
    assert auto_shard_cap(llama70b) == (16 << 20) // 10  # 70B: 10× the 8B's work a token
    assert auto_shard_bytes(40 << 30, llama70b) == (16 << 20) // 10  # 25,600 shards
    assert auto_shard_bytes(8 << 20, llama70b) == 1 << 20  # the 16th of the corpus, ≥ 1 MiB
    assert auto_shard_cap(token_work(126, 16384)) == 1 << 20  # 405B: 63×, at the 1 MiB floor
    assert auto_shard_bytes(1 << 40, llama70b) == -(-(1 << 40) // 65_536)  # the plan's bound
    assert "16 MiB ÷ 10" in shard_rule(llama70b) and "÷" not in shard_rule(llama8b)


def test_the_default_shards_of_a_larger_model_are_smaller(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x y z\n" * 6_000_000)  # 36 MB
    work = token_work(80, 8192)  # Llama 3 70B: 10× an 8B's work a token, shards ≤ 1.6 MiB
    small, large = (plan_shards(CorpusSpec(str(tmp_path)), None, w) for w in (0, work))
    assert small.shard_bytes == 36_000_000 // 16 and len(small.shards) == 16
    assert large.shard_bytes == (16 << 20) // 10 and len(large.shards) == 22
    assert small.fingerprint != large.fingerprint  # another plan: a resume refuses the other
    given = [plan_shards(CorpusSpec(str(tmp_path)), 1 << 20, w) for w in (0, work)]
    assert given[0] == given[1]  # --shard-bytes given: the model does not matter


def test_auto_shard_size_used_when_none(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x y z\n" * 500_000)  # 3 MB -> 1 MiB shards
    plan = plan_shards(CorpusSpec(str(tmp_path)))
    assert plan.shard_bytes == 1024 * 1024 and len(plan.shards) == 3
    assert plan.total_bytes == 3_000_000


def test_shard_plan_json_round_trip(tmp_path: Path) -> None:
    _tree(tmp_path)
    pq.write_table(pa.table({"text": ["p"] * 10}), tmp_path / "p.parquet", row_group_size=2)
    plan = plan_shards(CorpusSpec(str(tmp_path)), 8)
    restored = ShardPlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert restored == plan
    assert {s.kind for s in restored.shards} == {"text", "jsonl", "parquet"}
    with pytest.raises(CorpusError, match="invalid saved shard plan"):
        ShardPlan.from_json({"shards": [{"shard_id": "x"}]})


# --------------------------------------------------------------------------------------------
# Demo corpus


def test_demo_corpus_documents() -> None:
    docs = python_docs_documents()
    assert len(docs) > 50
    assert sum(len(d) > 600 for d in docs) > 10
    assert docs == python_docs_documents()  # deterministic
    words = " ".join(docs).split()
    assert len(words) > 20_000
    common = {"the", "of", "a", "is", "to", "and", "in"}
    assert sum(w in common for w in words) > 0.1 * len(words)
    assert all("::=" not in d and ">>>" not in d and "*****" not in d for d in docs)
    assert all(d == d.strip() and "\n" not in d for d in docs)


def test_demo_corpus_main_writes_jsonl(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "nested" / "dir" / "docs.jsonl"
    assert demo_main([str(out)]) == 0
    assert sorted(os.listdir(out.parent)) == ["docs.jsonl"]  # no temporary file left
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["text"] for r in rows] == python_docs_documents()
    assert all(set(r) == {"text", "topic"} for r in rows)
    printed = capsys.readouterr().out
    assert str(out) in printed and f"{len(rows)} documents" in printed
    docs, report = read_all(CorpusSpec(str(out)))
    assert texts(docs) == python_docs_documents() and report.skipped == {}
    assert demo_main([]) == 2


def test_rewritten_dataset_directory_is_reloaded(tmp_path: Path) -> None:
    import datasets

    datasets.Dataset.from_dict({"text": ["old one"]}).save_to_disk(str(tmp_path / "ds"))
    spec = CorpusSpec(str(tmp_path / "ds"))
    first = plan_shards(spec)
    assert texts(read_all(spec)[0]) == ["old one"]
    shutil.rmtree(tmp_path / "ds")
    datasets.Dataset.from_dict({"text": ["new one", "new two"]}).save_to_disk(str(tmp_path / "ds"))
    assert texts(read_all(spec)[0]) == ["new one", "new two"]
    assert plan_shards(spec).fingerprint != first.fingerprint


def test_hf_url_is_a_file_system_path_not_a_dataset_name(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CorpusError, match=r"cannot list corpus 'hf://datasets/x/y/\*\.parquet'"):
        plan_shards(CorpusSpec("hf://datasets/x/y/*.parquet"))


def test_plan_objects_pickle(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("one\ntwo\n")
    spec = CorpusSpec(str(tmp_path))
    plan = plan_shards(spec)
    doc = next(iter(read_shard(plan.shards[0], spec, ReadReport())))
    for obj in (spec, plan, plan.shards[0], doc, ReadReport(1, {"empty": 2})):
        assert pickle.loads(pickle.dumps(obj)) == obj
