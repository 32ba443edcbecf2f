"""Where the Python API's lines go (``echo``; embgeom_ray/progress.py): a callable gets every
line of the job, the notices the command prints on stderr included, and nothing is drawn or
printed; ``echo=None`` prints nothing at all. Run in a fresh process, as a script of a user's
would: the job starts its own private Ray there, so Ray's lines and its workers' output (the
extractor's model loading) are the job's too. The script (tests/shared_runs.py:
``API_SCRIPT``) is the session's shared one: its first part is this test's, its second
tests/test_api_ray.py's, and nothing of either may be printed."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_echo_takes_every_line_and_none_prints_nothing(api_script_run) -> None:
    done = json.loads((api_script_run / "done.json").read_text())
    assert done["returncode"] == 0, done["stderr"][-3000:]
    # nothing drawn or printed: no bar, no notice, no line of Ray's or of its workers'
    assert done["stdout"] == "" and done["stderr"] == "", (
        done["stdout"][-2000:], done["stderr"][-2000:]
    )  # fmt: skip
    result = json.loads((api_script_run / "result.json").read_text())
    assert result["status"] == "complete" and result["workers"] >= 1
    lines = result["lines"]
    # the notices the command prints on stderr went to echo, with the run's summary
    assert lines[0].startswith("ray: started a private local Ray (")
    assert any(line.startswith("checkpoints: every ") for line in lines), lines
    assert any(line.startswith("outputs in runs/a: ") for line in lines), lines
    assert not (api_script_run / "runs" / "planned").exists()
