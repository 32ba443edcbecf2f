"""How a command's process ends (:func:`embgeom_ray.cli.exit_process`): with the status given
and everything it printed or logged flushed, Python's finalisation skipped. (That a private
Ray is gone after a job's command: every test that runs one as a process, e.g.
tests/jobs/test_ray_submit.py and tests/project/test_wheel.py; a Ray's processes also end with
the process that started them, so a test of this process alone could not tell.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout buffered
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_the_status_and_what_was_written_are_kept(tmp_path) -> None:
    done = _run(
        """
        import logging, sys
        from embgeom_ray.cli import exit_process
        logging.basicConfig(filename="job.log", level=logging.INFO)
        logging.getLogger("job").info("logged last")
        sys.stdout.write("printed last, no newline")  # a pipe: block-buffered
        sys.stderr.write("error: one line")
        exit_process(5)
        """,
        tmp_path,
    )
    assert done.returncode == 5
    assert done.stdout == "printed last, no newline" and done.stderr == "error: one line"
    assert (tmp_path / "job.log").read_text() == "INFO:job:logged last\n"



def test_a_profiled_command_leaves_through_pythons_exit(tmp_path) -> None:
    """Under ``python -m cProfile -o FILE`` the profile, written once the script leaves, is kept
    (cProfile takes the script's SystemExit and ends with status 0 itself)."""
    script = tmp_path / "command.py"
    script.write_text("from embgeom_ray.cli import exit_process\nexit_process(4)\n")
    env = os.environ | {"PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "cProfile", "-o", "out.prof", str(script)],
                          cwd=tmp_path, env=env, capture_output=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and (tmp_path / "out.prof").stat().st_size > 0
