"""A run's own options, with their defaults: where it goes, which layers and clip dimensions it
measures, and what it does with an earlier run, its checkpoints and its report.

:class:`RunOptions` are what the driver (:mod:`embgeom_ray.runs.pipeline`) resolves and decides
before and after the work it hands to the extractors: the output directory and whether to
resume it, the layers and clip dimensions (resolved against the model), ``--plan``, the
checkpoint groups once complete, the report and the warmed workers. The job's command line is
generated from these fields (:mod:`embgeom_ray.config`).

Pydantic only: the command line imports it to print ``--help``.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field, field_validator

from ..options import AGREE, MERGE, RESULT, SCHEDULING, OptionGroup


class RunOptions(OptionGroup):
    """The driver's options (:func:`embgeom_ray.runs.pipeline.analyze`)."""

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
        description="discard an earlier run in --out instead of resuming it",
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
    )
    no_warm_workers: bool = Field(
        False,
        description="on a private local Ray, do not start the sampled-metrics and figure tasks' "
        "worker processes (and their imports, at nice 19) on the CPUs the extractors leave "
        "free while they run. Not a result option",
    )

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
