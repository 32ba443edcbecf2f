"""The Python API's option names: an unknown one is refused before any work, naming the option
it is close to (``report`` for ``no_report``, a typo), as the config file's keys are."""

from __future__ import annotations

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
