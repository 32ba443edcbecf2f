"""The package runs on the lowest Python that pyproject.toml declares.

Only Python 3.11 is installable on the development machines, so the lowest declared version
(3.10) is checked statically: vermin finds the minimum version every module, import, function
and annotation of the package and its entry points needs (``datetime.UTC``, for one, needs
3.11 and was once used here).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the vermin command installed beside this interpreter (the test extras)
VERMIN = str(Path(sys.executable).with_name("vermin"))


def declared_minimum() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'^requires-python\s*=\s*">=\s*(\d+\.\d+)"', text, re.M)
    assert match, "pyproject.toml declares no requires-python"
    return match.group(1)


def test_package_needs_no_newer_python_than_declared(tmp_path):
    target = declared_minimum()
    proc = subprocess.run(
        [VERMIN, f"--target={target}-", "--violations", "--no-tips",
         "--eval-annotations", "--no-parse-comments", "embgeom_ray", "jobs"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_check_catches_a_newer_api(tmp_path):
    """vermin flags a 3.11-only API under a 3.10 target (the test above can fail)."""
    (tmp_path / "new.py").write_text("from datetime import UTC\n")
    proc = subprocess.run(
        [VERMIN, "--target=3.10-", "--violations", "--no-tips",
         str(tmp_path / "new.py")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "3.11" in proc.stdout
