"""docs/outputs.md as a contract the tests check: the files its "A run directory" table lists,
the keys its ``manifest.json`` table documents, and the columns of its column tables
(:func:`documented_columns`, checked against the metric registry by
tests/core/test_metric_registry.py, and against the comparison's and reanalyze's tables by
tests/runs/test_outputs.py).

:func:`assert_documented_outputs` checks that a run directory holds every file the table
lists whose condition holds for the run's options (:data:`CONDITIONS`: a file the table lists
and this mapping does not know is one every run writes). The end-to-end tests call it on runs
whose options together cover every condition (tests/project/test_python_docs.py: a default run
with its report; tests/inputs/test_dedup.py: ``--dedup`` with ``--keep-checkpoints``, and with
``--reducers 2``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[1] / "docs" / "outputs.md"

#: a listed file written only by some runs -> whether the run of this manifest writes it
CONDITIONS: dict[str, Callable[[dict[str, Any]], bool]] = {
    "samples.parquet": lambda m: m["config"].get("sample_size", 1) > 0,
    "kmeans.parquet": lambda m: "skipped" not in (m.get("sample") or {"skipped": True}),
    "statistics.safetensors": lambda m: not _partitioned(m),
    "statistics/": lambda m: _partitioned(m),
    "doc_hashes.npy": lambda m: bool(m["config"].get("dedup")),
    "report.html": lambda m: not m["config"].get("no_report"),
    "plots/": lambda m: not m["config"].get("no_report"),
    "groups/": lambda m: bool(m["config"].get("keep_checkpoints")),
    "reducers/": lambda m: bool(m["config"].get("keep_checkpoints")) and _partitioned(m),
}


def _partitioned(manifest: dict[str, Any]) -> bool:
    return (manifest["config"].get("reducers") or 1) > 1


def _section(heading: str) -> str:
    """The text under ``## heading`` (or ``### heading``) up to the next heading of its level
    or above."""
    text = DOC.read_text()
    marks = "##" if f"\n## {heading}\n" in text else "###"
    start = text.index(f"\n{marks} {heading}\n")
    ends = [e for e in (text.find(f"\n{m} ", start + 1) for m in ("##", "###")[: len(marks) - 1])
            if e >= 0]  # fmt: skip
    return text[start : min(ends) if ends else None]


def _first_cells(section: str) -> list[str]:
    """The first cell of every row of the section's first table (header and rule left out)."""
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [row.split("|")[1].strip() for row in rows[2:]]


def _column_cells(section: str) -> list[tuple[str, str]]:
    """(first cell, second cell) of every row of the section's ``| column | meaning |`` tables."""
    rows, inside = [], False
    for line in section.splitlines():
        if not line.startswith("|"):
            inside = False
        elif line.replace(" ", "") == "|column|meaning|":
            inside = True
        elif inside and not set(line) <= set("|- "):
            cells = line.split("|")
            rows.append((cells[1].strip(), "|".join(cells[2:-1]).strip()))
    return rows


def documented_columns(heading: str) -> tuple[list[str], list[str]]:
    """(columns, standard-error metrics): every column the ``| column | meaning |`` tables of
    the section ``## heading`` name in their first cells, in order, and the metrics its
    ``<metric>_se`` row lists (after ``SE_METRICS``: up to the sentence's end)."""
    columns: list[str] = []
    se: list[str] = []
    for first, meaning in _column_cells(_section(heading)):
        names = re.findall(r"`([^`]+)`", first)
        if names == ["<metric>_se"]:
            listed = meaning.split("`SE_METRICS`:", 1)[1].split(". ", 1)[0]
            se += re.findall(r"`([^`]+)`", listed)
        else:
            columns += names
    return columns, se


def documented_files() -> list[str]:
    """Every file and directory the "A run directory" table lists (``plots/`` with its ``/``)."""
    names = []
    for cell in _first_cells(_section("A run directory")):
        names += re.findall(r"`([^`]+)`", cell)
    return names


def documented_manifest_keys() -> set[str]:
    """Every top-level key the ``manifest.json`` table documents."""
    keys: set[str] = set()
    for cell in _first_cells(_section("`manifest.json`")):
        keys |= set(re.findall(r"`([^`]+)`", cell))
    return keys


def assert_documented_outputs(run: Path, manifest: dict[str, Any]) -> None:
    """Every file docs/outputs.md lists, whose condition holds for the run (its ``manifest``),
    is in ``run``."""
    listed = documented_files()
    assert listed, f"no files listed in {DOC}"
    missing = [
        name
        for name in listed
        if CONDITIONS.get(name, lambda _m: True)(manifest) and not (run / name.rstrip("/")).exists()
    ]
    assert not missing, f"{run} lacks {missing}, which docs/outputs.md lists as written"
