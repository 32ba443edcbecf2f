"""Where a job's bars and notices go (embgeom_ray/progress.py): on a terminal the bar is redrawn
in place; in a log (stderr not a terminal: ``ray job submit``, a scheduler, a redirect) each
drawing of the bar is a line of its own and every notice a line between them, with no ``\\r``
that would glue them into one line of the log."""

from __future__ import annotations

import io
import sys

import pytest

from embgeom_ray import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run_bar() -> None:
    with progress.bar(total=3, desc="shards", unit="shard") as bar:
        for k in range(3):
            bar.update(1)
            if k == 0:
                progress.notice("pool: 2 extractors")


def test_in_a_log_each_drawing_of_the_bar_and_each_notice_is_a_line(monkeypatch) -> None:
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    _run_bar()
    text = log.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    # the first drawing, the notice, the last drawing: updates within LOG_INTERVAL_S draw nothing
    assert len(lines) == 3, lines
    assert lines[0].startswith("shards:") and "0/3" in lines[0]
    assert lines[1] == "pool: 2 extractors"
    assert lines[2].startswith("shards: 100%") and "3/3" in lines[2]


def test_on_a_terminal_the_bar_is_redrawn_in_place(monkeypatch) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    _run_bar()
    text = terminal.getvalue()
    assert "\r" in text and "pool: 2 extractors\n" in text
    assert text.rstrip("\n").rsplit("\r", 1)[-1].startswith("shards: 100%")


@pytest.mark.parametrize("stream", [io.StringIO, _Terminal])
def test_a_routed_job_draws_nothing(monkeypatch, stream) -> None:
    out = stream()
    monkeypatch.setattr(sys, "stderr", out)
    got: list[str] = []
    with progress.routed(got.append):
        _run_bar()
    assert out.getvalue() == "" and got == ["pool: 2 extractors"]


def test_in_a_log_the_bar_draws_a_line_at_most_every_log_interval(monkeypatch) -> None:
    """A bar updated every second for 100 s (a clock of tqdm's own, its monitor thread awake):
    lines 30 s apart at least. With the miniters tqdm adapts, its monitor redraws a bar not
    drawn for ``maxinterval`` (10 s by default) whatever its ``mininterval``, without noting
    when: the log got lines at 0, 30, 40, 60, 70 s (with maxinterval = 30 s: 0, 30, 50, 60)."""
    import itertools
    import re
    import time

    import tqdm._monitor
    import tqdm.std

    clock = [1000.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: clock[0])
    monkeypatch.setattr(tqdm._monitor, "time", lambda: clock[0])
    # a monitor of its own, awake every 2 ms (on the class the bars are made of)
    monkeypatch.setattr(progress.tqdm, "monitor_interval", 0.002)
    monkeypatch.setattr(progress.tqdm, "monitor", None)
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    with progress.bar(total=100, desc="shards") as bar:
        for _ in range(100):
            clock[0] += 1.0
            bar.update(1)
            time.sleep(0.01)  # the monitor's turn
    elapsed = [int(m) * 60 + int(s) for m, s in re.findall(r"\[(\d+):(\d\d)<", log.getvalue())]
    assert elapsed[0] == 0 and elapsed[-1] == 100, elapsed
    gaps = [b - a for a, b in itertools.pairwise(elapsed[:-1])]  # the last one: the end
    assert gaps and min(gaps) >= progress.LOG_INTERVAL_S, elapsed


def test_a_notebooks_widget_bar_is_drawn_in_place(monkeypatch) -> None:
    """In a Jupyter kernel, whose stderr is no terminal, tqdm.auto's bars are widgets: drawn in
    place as on a terminal, not a line every 30 s."""
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    monkeypatch.setattr(progress, "WIDGETS", True)
    with progress.bar(total=3, desc="shards") as bar:
        assert bar.mininterval == 2.0
        bar.update(3)
    assert "\r" in out.getvalue()
