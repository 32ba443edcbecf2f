"""What the users' docs (README.md, docs/*.md) name exists, so that they do not go stale as the
code moves:

- every command-line option given for a command in a code span or block (``python -m
  jobs.X``, ``embgeom X``, ``python -m embgeom_ray X``, ``bench.X``) is an option of that
  command; one named alone is an option of some command of the project's, or of a tool's
  (:data:`TOOL_FLAGS`); options after another tool's command (``ray start --head``) are its;
- every bench module named (``bench.X``) is a file of bench/, and every step of ``bench/gpu.sh``
  named (``STEPS=…``) is one of its steps;
- every file of the repository named exists (``tests/…``, ``embgeom_ray/…``, module paths
  relative to the package such as ``runs/pipeline.py``, bare file names such as
  ``conftest.py``), a test node id (``tests/x.py::test_y``) names a test of that module, and a
  module path with a name (``sizing/formulas.on_workers``) a top-level name of that module;
- every link inside the repository resolves to a file and, with ``#anchor``, to a heading of
  it (GitHub's anchors) or an ``<a id>``; no link leaves the repository.

Pure parsing, without torch or Ray: the jobs' parsers are built here (their modules import
pydantic only; ``jobs.merge``'s from the options it takes, as ``cli/merge.py`` builds it), the
benches' flags read from their source. docs/outputs.md's columns are checked against the
metric registry in tests/core/test_metric_registry.py, docs/python.md's examples run in
tests/project/test_python_docs.py.
"""

from __future__ import annotations

import ast
import os
import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: flags named alone in the docs that are another tool's, not the project's
TOOL_FLAGS = {
    "--no-compile": "pip install",
    "--without-pip": "python -m venv (tests/project/test_wheel.py)",
    "--dist": "pytest-xdist (make test's --dist loadgroup)",
}
#: a command of the project's that takes options: the jobs' (``make analyze`` and ``make demo``
#: pass ARGS to ``jobs.analyze``) and the benches'
COMMAND = re.compile(
    r"(?:\bpython -m |\b)(?:jobs\.|embgeom(?:_ray)? )(analyze|merge|compare|reanalyze|report)\b"
    r"|\bbench\.([a-z_]+)\b|\bmake (?:analyze|demo)\b"
)
#: another tool's command: the options after it are its own
TOOL = re.compile(r"(?:^|[\s(`'\"])(ray|kubectl|pip|pytest|git|openssl|huggingface-cli)\s")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
#: a word of a code span that may name a file of the repository
WORD = re.compile(r"(?<![\w./:-])[\w][\w./-]*(?:::[\w:\[\]-]+)?")
#: where the repository's files are: the docs name them from the root, or from the package
TOP = ("embgeom_ray/", "tests/", "bench/", "jobs/", "configs/", "deploy/", "scripts/", "docs/")
IGNORED_DIRS = ("bench/results/",)  # written by the benches, not in the repository


def _without_blocks(text: str) -> str:
    """``text`` with its fenced code blocks blanked, lines kept."""
    return re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.M | re.S)


def code_units(text: str) -> list[tuple[int, str]]:
    """(line, text) of every command line of a fenced block (continuations joined) and every
    inline code span of ``text``."""
    units = []
    for block in re.finditer(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S):
        first = text.count("\n", 0, block.start(1)) + 1
        lines = block.group(1).split("\n")
        joined, start = "", None
        for n, line in enumerate(lines):
            start = first + n if start is None else start
            if line.endswith("\\"):
                joined += line[:-1] + " "
                continue
            units.append((start, joined + line))
            joined, start = "", None
    prose = _without_blocks(text)
    for span in re.finditer(r"`([^`]+)`", prose):
        units.append((prose.count("\n", 0, span.start()) + 1, span.group(1)))
    return units


# ------------------------------------------------------------------------- the commands' flags
def _ast_flags(path: Path) -> set[str]:
    """The flags a module's source adds with ``add_argument`` (``--no-x`` too for a
    ``BooleanOptionalAction``)."""
    flags: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant)
                     and isinstance(a.value, str) and a.value.startswith("--")]  # fmt: skip
            flags.update(names)
            if any(k.arg == "action" and ast.unparse(k.value).endswith("BooleanOptionalAction")
                   for k in node.keywords):  # fmt: skip
                flags.update("--no-" + n[2:] for n in names)
    return flags


def _parser_flags(parser) -> set[str]:
    """Every long flag of an argparse parser (its table of option strings: argparse has no
    public list of them)."""
    return {s for s in parser._option_string_actions if s.startswith("--")}


@cache
def command_flags() -> dict[str, set[str]]:
    """Every command's flags: the jobs' by name (``analyze``), the benches' as ``bench.X``."""
    from embgeom_ray import config
    from embgeom_ray.cli import analyze, compare, reanalyze, report

    flags = {m.__name__.rsplit(".", 1)[1]: _parser_flags(m.build_parser())
             for m in (analyze, compare, reanalyze, report)}  # fmt: skip
    # cli/merge.py imports the merge (torch): its parser is the job's options it takes plus its own
    merge = REPO / "embgeom_ray" / "cli" / "merge.py"
    source = merge.read_text()
    assert "options=MERGE_OPTIONS" in source and "config_file=False" in source, (
        "cli/merge.py builds its parser otherwise now: build it the same way here"
    )
    job = config.build_parser("merge", "", options=config.MERGE_OPTIONS, config_file=False)
    flags["merge"] = _parser_flags(job) | _ast_flags(merge)
    for path in (REPO / "bench").glob("*.py"):
        flags[f"bench.{path.stem}"] = _ast_flags(path)
    return flags


def _command(match: re.Match) -> str:
    job, bench = match.groups()
    return job or (f"bench.{bench}" if bench else "analyze")


def flags_named() -> list[tuple[str, int, str | None, str, str]]:
    """(doc, line, command or None, flag, the code it is in) for every flag the docs name in
    code; a tool's flags left out."""
    found = []
    for doc in DOCS:
        for line, unit in code_units(doc.read_text()):
            events = [(m.start(), "command", _command(m)) for m in COMMAND.finditer(unit)]
            events += [(m.start(1), "tool", None) for m in TOOL.finditer(unit)]
            events += [(m.start(), "flag", m.group(0)) for m in FLAG.finditer(unit)]
            command, tool = None, False
            for _pos, kind, value in sorted(events, key=lambda e: e[0]):
                if kind == "command":
                    command, tool = value, False
                elif kind == "tool":
                    command, tool = None, True
                elif not tool:
                    found.append((doc.name, line, command, value, unit.strip()[:100]))
    return found


def test_every_flag_named_is_an_option_of_its_command() -> None:
    flags = command_flags()
    everything = set().union(*flags.values())
    named = flags_named()
    assert len(named) > 200, "the docs' flags were not found: the parsing above broke"
    wrong = []
    for doc, line, command, flag, unit in named:
        if command is None:
            if flag not in everything and flag not in TOOL_FLAGS:
                wrong.append(f"{doc}:{line}: {flag} is no option of any command ({unit})")
        elif command not in flags:
            wrong.append(f"{doc}:{line}: no command {command} ({unit})")
        elif flag not in flags[command]:
            wrong.append(f"{doc}:{line}: {command} has no {flag} ({unit})")
    assert not wrong, "\n".join(wrong)


def test_every_gpu_step_named_is_a_step_of_gpu_sh() -> None:
    script = (REPO / "bench" / "gpu.sh").read_text()
    steps = {s for names in re.findall(r"^if wanted ([\w -]+);", script, flags=re.M)
             for s in names.split()}  # fmt: skip
    assert {"comoment", "fold", "sums"} <= steps
    wrong = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"STEPS=(\"[^\"]*\"|[\w-]+)", text):
            unknown = [s for s in m.group(1).strip('"').split() if s not in steps]
            if unknown:
                line = text.count("\n", 0, m.start()) + 1
                wrong.append(f"{doc.name}:{line}: bench/gpu.sh has no step {unknown}")
    # the variables set for it (`DEADLINE=540 bash bench/gpu.sh`) are the script's
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"((?:\b[A-Z_]+=\S+\s+)+)bash\s+bench/gpu\.sh", text):
            for var in re.findall(r"\b([A-Z_]+)=", m.group(1)):
                if not re.search(rf"\$\{{?{var}\b", script):
                    line = text.count("\n", 0, m.start()) + 1
                    wrong.append(f"{doc.name}:{line}: bench/gpu.sh reads no {var}")
    assert not wrong, "\n".join(wrong)


# ---------------------------------------------------------------------------------- files
def _top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _defines(path: Path, node_id: str) -> bool:
    """Whether the test module at ``path`` defines ``node_id`` (``test_x``, ``TestY::test_x``,
    a parametrised id's function)."""
    body = ast.parse(path.read_text()).body
    for name in node_id.split("::"):
        name = name.split("[")[0]
        found = [n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.ClassDef)) and n.name == name]  # fmt: skip
        if not found:
            return False
        body = getattr(found[0], "body", [])
    return True


@cache
def _files_by_name() -> dict[str, list[Path]]:
    """The repository's files by name (hidden directories, /build and /runs left out)."""
    found: dict[str, list[Path]] = {}
    for root, dirs, files in os.walk(REPO):
        top = Path(root) == REPO
        dirs[:] = [
            d for d in dirs if not d.startswith(".") and not (top and d in ("build", "runs"))
        ]
        for name in files:
            found.setdefault(name, []).append(Path(root) / name)
    return found


def _resolve(path: str) -> Path | None:
    """The repository's file or directory a doc means by ``path``: from the root, from the
    package (``runs/pipeline.py``), or a bare file name found anywhere (``conftest.py``)."""
    for root in (REPO, REPO / "embgeom_ray"):
        if (root / path).exists():
            return root / path
    if "/" not in path:
        return next(iter(_files_by_name().get(path, [])), None)
    return None


def check_word(word: str) -> str | None:
    """What is wrong with a word of a code span that names a file of the repository (None:
    nothing, or it names none): ``tests/x.py``, ``tests/x.py::test_y``, ``runs/pipeline.py``,
    ``conftest.py``, ``sizing/formulas.on_workers`` (a module and a top-level name of it);
    ``statistics/index.json`` is a run's file, no file of the repository."""
    path, _, node_id = word.rstrip(".,:").partition("::")
    if path.startswith(IGNORED_DIRS) or "*" in path:
        return None
    named = path.endswith(".py") or path.startswith(TOP)
    found = _resolve(path) if named else None
    if found is not None:
        if node_id and not _defines(found, node_id):
            return f"{found.relative_to(REPO)} has no {node_id}"
        return None
    module, dot, name = path.rpartition(".")
    module_file = (
        _resolve(module + ".py") if "/" in module and dot and name.isidentifier() else None
    )
    if module_file is not None and not path.endswith(".py"):
        names = _top_level_names(module_file)
        return None if name in names else f"{module_file.relative_to(REPO)} defines no {name}"
    return "no such file" if named else None


def test_every_file_test_and_module_name_named_exists() -> None:
    wrong, checked = [], 0
    for doc in DOCS:
        for line, unit in code_units(doc.read_text()):
            for m in WORD.finditer(unit):
                checked += "/" in m.group(0) or m.group(0).endswith(".py")
                problem = check_word(m.group(0))
                if problem:
                    wrong.append(f"{doc.name}:{line}: {m.group(0)}: {problem}")
            for m in re.finditer(r"\bbench\.([a-z_]+)\b", unit):
                if not (REPO / "bench" / f"{m.group(1)}.py").is_file():
                    wrong.append(f"{doc.name}:{line}: no bench module bench.{m.group(1)}")
    assert checked > 100, "the docs' paths were not found: the parsing above broke"
    assert not wrong, "\n".join(wrong)


def test_check_word() -> None:
    assert check_word("tests/project/test_docs_references.py::test_check_word") is None
    assert "has no test_gone" in check_word("tests/project/test_docs_references.py::test_gone")
    assert check_word("tests/nowhere.py") == "no such file"
    assert check_word("runs/pipeline.py") is None and check_word("conftest.py") is None
    assert check_word("sizing/formulas.on_workers") is None
    assert "defines no gone" in check_word("sizing/formulas.gone")
    assert check_word("embgeom_ray/distributed/cluster.read_cluster") is None
    assert check_word("statistics/index.json") is None and check_word("bench/results/") is None


# ---------------------------------------------------------------------------------- links
def github_anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but ``-`` and ``_``
    dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    text = path.read_text()
    found, seen = set(), {}
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", _without_blocks(text), flags=re.M):
        slug = github_anchor(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    return frozenset(found)


def test_github_anchor() -> None:
    assert github_anchor("`manifest.json`") == "manifestjson"
    assert github_anchor("Comparisons (`jobs.compare`)") == "comparisons-jobscompare"
    assert (
        github_anchor("The per-type sums: float32, not taken")
        == "the-per-type-sums-float32-not-taken"
    )


@pytest.mark.parametrize("doc", [*DOCS, REPO / "CHANGELOG.md"], ids=lambda p: p.name)
def test_every_link_resolves_inside_the_repository(doc: Path) -> None:
    text = _without_blocks(doc.read_text())
    wrong = []
    for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", text):
        link, line = m.group(1), text.count("\n", 0, m.start()) + 1
        if re.match(r"[a-z]+://|mailto:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (doc.parent / path).resolve() if path else doc
        if REPO not in target.parents:
            wrong.append(f"{doc.name}:{line}: {link} leaves the repository")
        elif not target.exists():
            wrong.append(f"{doc.name}:{line}: {link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            wrong.append(f"{doc.name}:{line}: {link}: no such heading in {target.name}")
    for m in re.finditer(r"\.\./shared|/work/", text):
        wrong.append(f"{doc.name}:{text.count(chr(10), 0, m.start()) + 1}: names {m.group(0)}")
    assert not wrong, "\n".join(wrong)
