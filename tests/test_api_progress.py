"""Where the Python API's lines go (``echo``; embgeom_ray/progress.py): a callable gets every
line of the job, the notices the command prints on stderr included, and nothing is drawn or
printed; ``echo=None`` prints nothing at all. Run in a fresh process, as a script of a user's
would: the job starts its own private Ray there, so Ray's lines and its workers' output (the
extractor's model loading) are the job's too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SHORT_DOCS, write_jsonl

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, sys
import embgeom_ray as eg

model, corpus = sys.argv[1], sys.argv[2]
quick = {"max_length": 32, "sample_size": 64, "no_report": True}
lines = []
run = eg.analyze(model=model, corpus=corpus, out="runs/a", echo=lines.append, **quick)
planned = eg.plan(model=model, corpus=corpus, out="runs/planned", echo=None, **quick)
json.dump({"lines": lines, "status": run.manifest.status,
           "workers": planned["extractors"]["num_workers"]}, open("result.json", "w"))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_echo_takes_every_line_and_none_prints_nothing(minilm_dir, tmp_path) -> None:
    corpus = write_jsonl(tmp_path / "short.jsonl", SHORT_DOCS)
    env = os.environ | {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
                        "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", SCRIPT, minilm_dir, corpus], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=540)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # nothing drawn or printed: no bar, no notice, no line of Ray's or of its workers'
    assert done.stdout == "" and done.stderr == "", (done.stdout[-2000:], done.stderr[-2000:])
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "complete" and result["workers"] >= 1
    lines = result["lines"]
    # the notices the command prints on stderr went to echo, with the run's summary
    assert lines[0].startswith("ray: started a private local Ray (")
    assert any(line.startswith("checkpoints: every ") for line in lines), lines
    assert any(line.startswith("outputs in runs/a: ") for line in lines), lines
    assert not (tmp_path / "runs" / "planned").exists()
