"""The benchmarks' work folders (``bench.common.work_dir``): made where ``EMBGEOM_BENCH_WORK``
says, removed however the benchmark ends unless ``EMBGEOM_BENCH_KEEP_WORK=1``, and the only
way a benchmark makes a lasting temporary folder (the smoke tests of tests/bench then check
that each leaves nothing behind)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from bench.common import KEEP_WORK_ENV, REPO, WORK_ENV, work_dir


def test_the_work_folder_is_made_where_asked_and_removed_on_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv(WORK_ENV, str(tmp_path / "scratch"))
    monkeypatch.delenv(KEEP_WORK_ENV, raising=False)
    with pytest.raises(RuntimeError, match="the benchmark failed"):
        with work_dir("probe") as work:
            assert work.parent == tmp_path / "scratch" and work.name.startswith("embgeom-bench-probe-")
            (work / "run").mkdir()
            (work / "run" / "big.bin").write_bytes(b"x" * 1024)
            raise RuntimeError("the benchmark failed")
    assert list((tmp_path / "scratch").iterdir()) == []


def test_the_work_folder_is_kept_when_asked(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(WORK_ENV, str(tmp_path))
    monkeypatch.setenv(KEEP_WORK_ENV, "1")
    with work_dir("probe") as work:
        (work / "corpus.jsonl").write_text("{}\n")
    assert (work / "corpus.jsonl").exists()
    assert f"kept the work folder {work}" in capsys.readouterr().err


def test_no_benchmark_makes_a_temporary_folder_it_would_leave():
    """``tempfile.mkdtemp`` (which nothing removes) only in bench/common.py's ``work_dir``;
    ``TemporaryDirectory`` removes itself and is allowed."""
    offenders = []
    for path in sorted((REPO / "bench").glob("*.py")):
        if path.name == "common.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute | ast.Name) and "mkdtemp" in (
                node.attr if isinstance(node, ast.Attribute) else node.id
            ):
                offenders.append(f"{Path(path).name}:{node.lineno}")
    assert offenders == []
