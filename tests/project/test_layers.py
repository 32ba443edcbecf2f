"""The package's structure as docs/design.md states it.

- Imports flow one way: the layers of ``[tool.importlinter]`` in pyproject.toml, from the entry
  points down to the leaves, checked by import-linter with no exception listed; no circle of
  imports between the modules of any package; no Ray in the core.
- No private name (``_name``) of the package is used outside its module.

(One protocol serves a run's statistics wherever they live, ``runs/finish.RunStatistics``:
``tests/distributed/test_reducers.py`` holds both implementations to the same answers.)
"""

from __future__ import annotations

import ast
import pkgutil
import sys
from pathlib import Path

import pytest
from importlinter.api import read_configuration
from importlinter.cli import lint_imports

import embgeom_ray

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(embgeom_ray.__file__).parent
CONFIG = ROOT / "pyproject.toml"


@pytest.fixture(scope="module")
def contracts() -> list[dict]:
    return read_configuration(str(CONFIG))["contracts_options"]


def test_imports_flow_one_way_in_no_circle(capsys, monkeypatch):
    """Every contract kept: an import that runs back up a layer, a circle of imports within a
    package or Ray in the core breaks one, and the output names the import chain."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # lint_imports puts the cwd in front
    monkeypatch.chdir(ROOT)
    status = lint_imports(config_filename=str(CONFIG), no_cache=True, no_logo=True)
    out = capsys.readouterr().out
    assert status == 0, out
    assert "0 broken" in out


def test_no_import_is_exempt_and_every_module_has_a_layer(contracts):
    """No contract lists exceptions, and every top-level module of the package is in a layer
    (a module in none would be free to import anything)."""
    assert all(not c.get("ignore_imports") for c in contracts)
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    placed = {m.strip() for layer in layers for m in layer.replace(":", "|").split("|")}
    modules = {f"embgeom_ray.{m.name}" for m in pkgutil.iter_modules([str(PACKAGE)])}
    assert modules == placed


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own(module: str | None, level: int) -> bool:
    """Whether an import of ``module`` (``level`` dots) names the package's own code."""
    return level > 0 or (module or "").split(".")[0] == "embgeom_ray"


def private_names_used_elsewhere(path: Path) -> list[str]:
    """The package's private names that the module at ``path`` imports, or reads as an
    attribute of a module or class it imported from the package (``run_dir._runs``,
    ``ActivationSample._empty``); ``self._x`` and the like are the module's own business."""
    tree = ast.parse(path.read_text(), str(path))
    imported: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _own(node.module, node.level):
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{path.name}:{node.lineno}: imports {alias.name}")
                imported.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _own(alias.name, 0):
                    imported.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and isinstance(node.value, ast.Name)
            and node.value.id in imported
        ):
            found.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    return sorted(found, key=lambda f: int(f.split(":")[1]))


def test_no_private_name_is_used_outside_its_module():
    paths = sorted(PACKAGE.rglob("*.py"))
    found = [f for path in paths for f in private_names_used_elsewhere(path)]
    assert not found


def test_the_check_sees_a_private_name_used_elsewhere(tmp_path):
    code = (
        "from ..run_dir import _runs, row_runs\n"
        "from .samples import ActivationSample\n"
        "from embgeom_ray import config\n"
        "ActivationSample._empty(None)\nconfig._format(1)\nrow_runs._x\nself._own\n"
    )
    (tmp_path / "m.py").write_text(code)
    found = private_names_used_elsewhere(tmp_path / "m.py")
    assert [f.split(": ", 1)[1] for f in found] == [
        "imports _runs", "ActivationSample._empty", "config._format", "row_runs._x"
    ]  # fmt: skip
