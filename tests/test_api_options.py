"""The Python API's option names: an unknown one is refused before any work, naming the option
it is close to (``report`` for ``no_report``, a typo), as the config file's keys are."""

from __future__ import annotations

import pandas as pd
import pytest

import embgeom_ray as eg
from embgeom_ray.config import JobConfig, did_you_mean


def test_an_unknown_analyze_option_names_the_one_meant(tmp_path) -> None:
    with pytest.raises(eg.UserError) as err:
        eg.analyze(model="m", corpus="c.jsonl", out=tmp_path / "o", report=False)
    assert str(err.value).startswith("unknown option(s) ['report'] (did you mean no_report?): ")
    assert not (tmp_path / "o").exists()
    with pytest.raises(eg.UserError, match=r"\['zzz'\]: the options are"):
        eg.analyze(model="m", corpus="c.jsonl", out=tmp_path / "o", zzz=1)


def test_analyze_refuses_the_plan_whether_given_as_an_argument_or_in_its_config(tmp_path) -> None:
    """A config file's ``plan_json:`` (or ``plan: true``) made ``eg.analyze`` print the plan,
    write the JSON, run nothing and then fail to open the run ('… does not exist'); now it is
    refused at once as the arguments are, naming the file, and nothing is written."""
    config = tmp_path / "run.yaml"
    config.write_text(f"plan_json: {tmp_path / 'plan.json'}\n")
    with pytest.raises(eg.ConfigError) as err:
        eg.analyze(model="m", corpus="c.jsonl", out=tmp_path / "o", config=config, echo=None)
    assert str(err.value) == (
        f"plan_json={str(tmp_path / 'plan.json')!r} (set in {config}) runs nothing: call "
        "embgeom_ray.plan(...) for the plan"
    )
    assert not (tmp_path / "plan.json").exists() and not (tmp_path / "o").exists()
    with pytest.raises(eg.ConfigError, match=r"^plan_json='p.json' runs nothing: call "):
        eg.analyze(model="m", corpus="c.jsonl", out=tmp_path / "o", plan_json="p.json")


def test_an_unknown_merge_option_names_the_one_meant(tmp_path) -> None:
    with pytest.raises(eg.UserError, match=r"\['min_cont'\] \(did you mean min_count\?\); "):
        eg.merge([tmp_path / "a", tmp_path / "b"], out=tmp_path / "ab", min_cont=3)


def test_did_you_mean() -> None:
    known = list(JobConfig.model_fields)
    assert did_you_mean(["max_lenght"], known) == " (did you mean max_length?)"
    assert did_you_mean(["report", "sampel_size", "zzz"], known) == (
        " (did you mean no_report for report, sample_size for sampel_size?)"
    )
    assert did_you_mean(["zzz"], known) == ""


def test_one_run_where_a_list_is_expected_is_refused_and_labels_may_be_one_string(
    tmp_path,
) -> None:
    """``merge("runs/a", "runs/ab")`` and ``compare("runs/a", …)`` name the mistake (iterated,
    the path would be its characters); ``compare``'s labels may be the command line's
    comma-separated string."""
    from tests.runs.test_compare import BASE_LAYERS, OTHER_LAYERS, make_run

    for call in (eg.merge, eg.compare):
        with pytest.raises(eg.ConfigError, match=r"takes a list of runs, got one \('runs/a'\)"):
            call("runs/a", tmp_path / "out")
    a = make_run(tmp_path / "a", BASE_LAYERS, {})
    b = make_run(tmp_path / "b", OTHER_LAYERS, {})
    comparison = eg.compare([a, b], tmp_path / "cmp", labels="before, after", echo=None)
    assert comparison.summary["runs"][1]["label"] == "after"


def test_a_run_url_of_an_unknown_protocol_and_a_column_not_in_a_table_are_one_line(
    tmp_path,
) -> None:
    from embgeom_ray.run_dir import RunDir, RunDirError
    from tests.runs.test_compare import BASE_LAYERS, make_run

    with pytest.raises(eg.UserError, match=r"^unknown protocol foo:// for the run directory foo"):
        eg.open_run("foo://bucket/run")
    run = RunDir(make_run(tmp_path / "a", BASE_LAYERS, {}))
    with pytest.raises(RunDirError) as err:
        run.read_table("layers", columns=["layer", "nope"])
    assert str(err.value) == (
        "layers.parquet has no column(s) ['nope']; its columns are "
        f"{list(pd.read_parquet(tmp_path / 'a' / 'layers.parquet').columns)}"
    )


def test_an_echo_that_is_not_callable_and_a_top_that_is_not_an_integer_are_refused_at_once(
    tmp_path,
) -> None:
    """``echo=5`` was a TypeError at the job's first line, after its model had loaded;
    ``top="5"`` a TypeError comparing a string with 1."""
    with pytest.raises(eg.ConfigError) as err:
        eg.analyze(model="m", corpus="c.jsonl", out=tmp_path / "o", echo=5)
    assert str(err.value) == (
        "echo must be a callable taking one line (print, a logger's method) or None, got 5"
    )
    assert not (tmp_path / "o").exists()
    for top in ("5", 2.5, True, 0):
        with pytest.raises(eg.UserError) as err:
            eg.compare([tmp_path / "a", tmp_path / "b"], tmp_path / "cmp", top=top)
        assert str(err.value) == f"top must be an integer of at least 1, got {top!r}"


def test_calls_from_several_threads_run_one_after_another(monkeypatch) -> None:
    """What a call sets up is the process's (the Ray it starts and then shuts down, where its
    lines go): a call from a second thread waits for the first to end, so the first's exit
    cannot shut down a Ray the second is running on. A call made within a call (an ``echo``
    that calls the API) does not wait on itself."""
    import contextlib
    import threading
    import time

    from embgeom_ray import api
    from embgeom_ray.distributed import cluster

    inside, most, events = 0, 0, []
    lock = threading.Lock()

    @contextlib.contextmanager
    def counted():
        nonlocal inside, most
        with lock:
            inside += 1
            most = max(most, inside)
        try:
            yield
        finally:
            with lock:
                inside -= 1

    monkeypatch.setattr(cluster, "leave_ray_as_found", counted)

    def one(name: str) -> None:
        with api._call(None):
            events.append(f"{name} in")
            time.sleep(0.3)
            with api._call(None):  # nested, in the same thread
                events.append(f"{name} nested")
            events.append(f"{name} out")

    threads = [threading.Thread(target=one, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert most == 2  # the nested call, never the other thread's
    first, second = events[0][0], events[3][0]
    assert events == [f"{first} in", f"{first} nested", f"{first} out",
                      f"{second} in", f"{second} nested", f"{second} out"]  # fmt: skip


def test_a_call_that_waits_for_another_threads_says_so(monkeypatch) -> None:
    """A call behind another thread's (an analysis of hours) waited without a word, and looked
    hung; it now says once, to its own ``echo``, that it waits, and a call that does not wait
    (nested, or alone) says nothing."""
    import contextlib
    import threading

    from embgeom_ray import api
    from embgeom_ray.distributed import cluster

    monkeypatch.setattr(cluster, "leave_ray_as_found", contextlib.nullcontext)
    first_in, lines, mine = threading.Event(), [], []

    def first() -> None:
        with api._call(mine.append):
            with api._call(mine.append):  # nested: does not wait on itself
                first_in.set()
                for _ in range(1000):  # until the second call has said it waits (≤ 10 s)
                    if lines:
                        break
                    threading.Event().wait(0.01)

    thread = threading.Thread(target=first)
    thread.start()
    assert first_in.wait(30)
    with api._call(lines.append):
        lines.append("ran")
    thread.join(timeout=30)
    assert lines == [api.WAITING, "ran"]
    assert mine == []


def test_the_plan_json_help_names_the_calls_that_return_its_plan() -> None:
    """``--plan-json``'s help (``embgeom analyze`` and ``embgeom merge``) named
    ``embgeom_ray.merge with plan=True``, which ``eg.merge`` refuses: a merge's plan is
    ``eg.plan_merge``; every ``embgeom_ray.NAME`` it names is the API's."""
    import re

    from embgeom_ray.cli.merge import build_parser

    (help_text,) = [a.help for a in build_parser()._actions if a.dest == "plan_json"]
    assert "embgeom_ray.plan_merge" in help_text and "plan=True" not in help_text
    named = set(re.findall(r"embgeom_ray\.(\w+)", help_text))
    assert named and named <= set(eg.__all__), named
