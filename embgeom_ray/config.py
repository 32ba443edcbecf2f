"""The job's options: one validated pydantic model assembled from the option groups, filled from
a YAML file and command-line flags.

Each part of the job declares its options, with their defaults, bounds and help, beside its code
(:class:`~embgeom_ray.options.OptionGroup`): an extractor's
(:class:`~embgeom_ray.inputs.options.ExtractionOptions`, with the sample's
:class:`~embgeom_ray.core.options.SampleOptions` and its resources'
:class:`~embgeom_ray.inputs.options.WorkerOptions`), the actor pool's
(:class:`~embgeom_ray.distributed.options.SchedulingOptions`), the run's own
(:class:`RunOptions`, declared here), the exact tables'
(:class:`~embgeom_ray.core.options.TableOptions`) and the sampled metrics'
(:class:`~embgeom_ray.core.options.SampledOptions`). :class:`JobConfig` inherits them all, so
every option keeps one flat name: its flag (:func:`build_parser` generates each flag, its help
and its shown default from the fields, in one section per group), its YAML key, its place in
the result options (fields marked :data:`~embgeom_ray.options.RESULT`). Flags override the YAML
file; both are validated here, so a bad value fails before any work starts, with one message
that names the option.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import ConfigDict, Field, ValidationError, field_validator
from pydantic.fields import FieldInfo

from .core.options import SampledOptions, SampleOptions, TableOptions
from .distributed.options import SchedulingOptions
from .errors import ConfigError
from .inputs.options import ExtractionOptions, WorkerOptions
from .options import AGREE, MERGE, RESULT, SCHEDULING, OptionGroup, options_marked, own_fields


class RunOptions(OptionGroup):
    """A run's own options: where it goes, which layers and clip dimensions it measures, and
    what it does with an earlier run, its checkpoints and its report; what the driver
    (:func:`embgeom_ray.runs.pipeline.analyze`) resolves and decides before and after the work
    it hands to the extractors. Declared here, where the groups are assembled, since the
    driver's package (:mod:`embgeom_ray.runs`) sits above this module."""

    model_config = ConfigDict(title="run options")

    out: str = Field(
        description="output directory, local or fsspec URL (required)",
        json_schema_extra=SCHEDULING | MERGE,
    )
    layers: list[int] | None = Field(
        None,
        description="hidden-state layers to measure, e.g. 0,3,-1 (0 = embedding output, -1 = "
        "last) [default: all]",
        json_schema_extra=RESULT,
    )
    clip_dims: list[int] | None = Field(
        None,
        description="dimensions to zero for exact clipped cosine metrics over the whole corpus, "
        "e.g. 12,300",
        json_schema_extra=RESULT | AGREE,
    )
    clip_dims_from: str | None = Field(
        None,
        description="take --clip-dims from an earlier run's output: every dimension flagged in "
        "its dims.parquet",
        json_schema_extra=RESULT,
    )
    overwrite: bool = Field(
        False,
        description="discard an earlier run in --out instead of resuming it (or refusing "
        "another run there): the files and folders a run writes, never other files",
        json_schema_extra=SCHEDULING | MERGE,
    )
    plan: bool = Field(
        False,
        description="print what will run where and exit before any work: the shards, the "
        "actors and their CPUs and GPUs, the batch tokens, every process's memory as number "
        "and formula, the reducers and their ranges, the bytes per flush, the checkpoints' "
        "disk and the artefact's and tables' sizes (reads the model's config and tokenizer, "
        "never its weights; the corpus's listing; the cluster's resources). Refuses what "
        "cannot fit with the message the run would give",
        json_schema_extra=SCHEDULING | MERGE,
    )
    plan_json: str | None = Field(
        None,
        description="as --plan, and write the plan's decisions as JSON to this file (local or "
        "fsspec URL): what embgeom_ray.plan (a merge's: embgeom_ray.plan_merge) returns, the "
        "'sizing' a run would record at its start (memory in bytes; docs/outputs.md)",
        json_schema_extra=SCHEDULING | MERGE,
    )
    keep_checkpoints: bool = Field(
        False,
        description="keep the checkpoint groups (groups/) after the run completes; by default "
        "they are removed, since statistics.safetensors and sample.safetensors hold the same "
        "information",
        json_schema_extra=SCHEDULING,
    )
    no_report: bool = Field(
        False,
        description="write the tables and artefacts only, without plots/ and report.html "
        "(python -m jobs.report OUT draws them later from the run directory). Not a result "
        "option",
        json_schema_extra=MERGE,
    )
    no_warm_workers: bool = Field(
        False,
        description="on a private local Ray, do not start the sampled-metrics and figure tasks' "
        "worker processes (one per CPU, their imports at idle priority) while the extractors "
        "run. Not a result option",
    )

    @field_validator("layers", "clip_dims", mode="before")
    @classmethod
    def _int_list(cls, v: Any) -> Any:
        """A config file's ``layers: "0,3,-1"`` (the flag's own form) as the list it means."""
        if isinstance(v, str):
            try:
                return parse_int_list(v)
            except argparse.ArgumentTypeError as exc:
                raise ValueError(str(exc)) from None
        return v

    @field_validator("layers")
    @classmethod
    def _distinct_layers(cls, v: list[int] | None) -> list[int] | None:
        if v is not None:
            if not v:
                raise ValueError("give at least one layer, or leave it out for all layers")
            if len(set(v)) != len(v):
                raise ValueError(f"layers must be distinct, got {v}")
        return v

    @field_validator("clip_dims")
    @classmethod
    def _clip_dims(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(d < 0 for d in v):
            raise ValueError(f"dimensions are non-negative, got {v}")
        return v


#: the groups that declare the job's options, in the order ``--help`` lists their sections;
#: each option is declared by exactly one of them
GROUPS: tuple[type[OptionGroup], ...] = (
    ExtractionOptions, RunOptions, SampleOptions, TableOptions, SampledOptions, WorkerOptions,
    SchedulingOptions,
)  # fmt: skip


class JobConfig(ExtractionOptions, RunOptions, SchedulingOptions, TableOptions, SampledOptions):
    """Everything that defines one analysis run; the command line is generated from it.

    The option groups together (:data:`GROUPS`): each field is one option, ``--max-length``
    for ``max_length``, its help the description, its default the field's (written once, in
    its group), a YAML ``--config`` key of the same name. Fields marked :data:`RESULT` are the
    result options (:data:`RESULT_OPTIONS`). The parts of the job take their group
    (:attr:`extraction`, :attr:`scheduling`, :attr:`tables`, :attr:`sampled`), never the whole
    configuration.
    """

    model_config = ConfigDict(title="job")

    def result_options(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in RESULT_OPTIONS}

    @property
    def extraction(self) -> ExtractionOptions:
        """What an extractor needs: the model, the corpus, windows, batches, the sample."""
        return ExtractionOptions.of(self)

    @property
    def scheduling(self) -> SchedulingOptions:
        """What the actor pool needs: where to run, how many actors, checkpoints, retries."""
        return SchedulingOptions.of(self)

    @property
    def tables(self) -> TableOptions:
        """What the exact tables need: the correlation's minimum count, the outlier rules."""
        return TableOptions.of(self)

    @property
    def sampled(self) -> SampledOptions:
        """What the sampled metrics need: K-means model selection, LID, silhouettes."""
        return SampledOptions.of(self)

    def options_digest(self) -> str:
        return hashlib.sha256(
            json.dumps(self.result_options(), sort_keys=True).encode()
        ).hexdigest()


#: options whose value changes the statistics; they enter the run fingerprint.
RESULT_OPTIONS: tuple[str, ...] = options_marked(JobConfig, RESULT)
#: options that only decide how a run is scheduled, never what its tables hold
SCHEDULING_OPTIONS: tuple[str, ...] = options_marked(JobConfig, SCHEDULING)
#: options that runs must agree on to be merged
AGREE_OPTIONS: tuple[str, ...] = options_marked(JobConfig, AGREE)
#: the options of ``jobs.merge``'s command line
MERGE_OPTIONS: tuple[str, ...] = options_marked(JobConfig, MERGE)


def did_you_mean(names: Sequence[str], known: Sequence[str]) -> str:
    """`` (did you mean max_length?)`` for the unknown ``names`` that are close to a ``known``
    option (:func:`difflib.get_close_matches`: a typo, ``report`` for ``no_report``), else
    ``""``."""
    import difflib

    close = {n: difflib.get_close_matches(n, known, n=1, cutoff=0.6) for n in names}
    hints = [f"{m[0]} for {n}" if len(names) > 1 else m[0] for n, m in close.items() if m]
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def format_validation_error(exc: ValidationError, source: str = "the config file") -> str:
    """pydantic's errors of the job's options as one line that names each option as its flag
    (``--max-length: ...``), a missing one, or an unknown key of the YAML file (``source``:
    where the keys came from)."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "config"
        name = "--" + loc.replace("_", "-")
        if err["type"] == "missing":
            parts.append(f"{name} is required")
        elif err["type"] == "extra_forbidden":
            parts.append(
                f"unknown option {loc!r} in {source}"
                + did_you_mean([loc], list(JobConfig.model_fields))
            )
        else:  # our validators' messages say what they got
            msg = err["msg"].removeprefix("Value error, ")
            got = "" if "got " in msg else f" (got {err.get('input')!r})"
            parts.append(f"{name}: {msg}{got}")
    return "invalid options: " + "; ".join(parts)


def load_yaml(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of option: value")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def build_config(yaml_path: str | None, overrides: dict[str, Any]) -> JobConfig:
    """YAML options, then non-None ``overrides`` on top, validated into a :class:`JobConfig`."""
    data = load_yaml(yaml_path) if yaml_path else {}
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return JobConfig(**data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


# ---------------------------------------------------------------------------- command line


def parse_int_list(text: str) -> list[int]:
    """``"0,3,-1"`` (or spaces) -> ``[0, 3, -1]``, for list options such as ``--layers``."""
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"give integers separated by commas, e.g. 0,3,-1 (got {text!r})"
        ) from None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _argument(name: str, field: FieldInfo, shown_default: str | None = None) -> dict[str, Any]:
    """argparse keywords for one option: type, choices, help with its default (or
    ``shown_default`` in its place, where the option is then not required)."""
    annotation = field.annotation
    optional = get_origin(annotation) in (Union, types.UnionType)
    kind = next(a for a in get_args(annotation) if a is not type(None)) if optional else annotation
    help_text = field.description or ""
    if shown_default is not None:
        help_text = help_text.split(" [default:")[0].removesuffix(" (required)")
        help_text += f" [default: {shown_default}]"
    required = field.is_required()
    default = None if required else field.get_default(call_default_factory=True)
    if "[default:" not in help_text and default is not None and kind is not bool:
        help_text += f" [default: {default}]"
    kw: dict[str, Any] = {"help": help_text, "default": None, "dest": name}
    if kind is bool:
        kw["action"] = "store_true"
    elif get_origin(kind) is Literal:
        kw["choices"] = list(get_args(kind))
        kw["metavar"] = "{" + ",".join(kw["choices"]) + "}"
    elif get_origin(kind) is list:
        kw["type"], kw["metavar"] = parse_int_list, "N,N,…"
    elif kind in (int, float):
        kw["type"] = kind
    return kw


def add_options(
    parser: argparse.ArgumentParser,
    options: tuple[str, ...] | None = None,
    shown_defaults: dict[str, str] | None = None,
) -> None:
    """Add to ``parser`` a flag for every option of :class:`JobConfig` (``options``: those
    only), each from its field, in one section per option group (:data:`GROUPS`, headed by the
    group's title); ``shown_defaults``: the default a flag's help shows, where it is not the
    field's. A flag left out is ``None``."""
    for group in GROUPS:
        names = [n for n in own_fields(group) if options is None or n in options]
        if names:
            section = parser.add_argument_group(group.model_config.get("title"))
            for name in names:
                field = JobConfig.model_fields[name]
                shown = (shown_defaults or {}).get(name)
                section.add_argument(_flag(name), **_argument(name, field, shown))


def build_parser(
    prog: str,
    description: str,
    epilog: str = "",
    *,
    options: tuple[str, ...] | None = None,
    usage: str | None = None,
    config_file: bool = True,
    shown_defaults: dict[str, str] | None = None,
) -> argparse.ArgumentParser:
    """The command line of ``jobs.analyze`` (every option), or of another command
    (``options``: the options it takes, e.g. :data:`MERGE_OPTIONS`), generated from the option
    groups' fields (:func:`add_options`).

    Every option is a flag; a flag left out is ``None`` and does not override the YAML file
    (or, for ``jobs.merge``, the first run's options).
    """
    parser = argparse.ArgumentParser(
        prog=prog,
        usage=usage or f"{prog} --model M --corpus C --out DIR [options]",
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if config_file:
        parser.add_argument(
            "--config",
            help="YAML file of options (keys as below, with underscores); flags override it",
        )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    add_options(parser, options, shown_defaults)
    return parser
