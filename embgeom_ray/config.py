"""The job's options: one validated pydantic model, filled from a YAML file and command-line flags.

:class:`JobConfig` is the single source of every option: its fields give the command line
(:func:`build_parser` generates each flag, its help and its shown default), the YAML keys, the
result options (fields marked :data:`RESULT`) and the option groups the parts of the job take
(:class:`ExtractionOptions`, :class:`SchedulingOptions`, :class:`TableOptions`,
:class:`SampledOptions`). Flags override the YAML file; both are validated here, so a bad value
fails before any work starts, with one message that names the option.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError, field_validator
from pydantic.fields import FieldInfo

from .core import kmeans_selection as _selection
from .errors import ConfigError

#: marks a field as a result option: its value changes the statistics, so it enters the run
#: fingerprint and the run key of scheduled re-analyses
RESULT = {"result": True}
#: marks a field as a scheduling option: it decides how a run is scheduled (where, how many
#: processes, how much memory), never what its statistics or tables hold
SCHEDULING = {"scheduling": True}
#: marks a field that runs must agree on to be merged (``jobs.merge`` refuses runs that differ)
AGREE = {"agree": True}
#: marks a field as an option of ``jobs.merge`` too (its command line is generated from these)
MERGE = {"merge": True}


class JobConfig(BaseModel):
    """Everything that defines one analysis run; the command line is generated from it.

    Each field is one option: ``--max-length`` for ``max_length``, its help the description,
    its default the field's (shown once, here), a YAML ``--config`` key of the same name.
    Fields marked :data:`RESULT` are the result options (:data:`RESULT_OPTIONS`). The groups
    the parts of the job take (:attr:`extraction`, :attr:`scheduling`, :attr:`tables`,
    :attr:`sampled`) are views of these fields.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="local Hugging Face model directory or hub id (required)")
    revision: str | None = Field(None, description="hub revision: branch, tag or commit hash")
    corpus: str = Field(
        description="a .txt/.jsonl/.parquet file, a glob, a directory, an fsspec URL (s3://, "
        "gs://) or hf:NAME[:CONFIG] (required)"
    )
    out: str = Field(
        description="output directory, local or fsspec URL (required)",
        json_schema_extra=SCHEDULING | MERGE,
    )
    text_column: str = Field(
        "text", description="text column of .jsonl/.parquet/HF corpora", json_schema_extra=RESULT
    )
    split: str = Field("train", description="split of an HF dataset", json_schema_extra=RESULT)
    max_length: int = Field(
        128,
        ge=4,
        le=1_000_000,
        description="tokens per window, special tokens included; longer documents are split "
        "into consecutive windows",
        json_schema_extra=RESULT | AGREE,
    )
    layers: list[int] | None = Field(
        None,
        description="hidden-state layers to measure, e.g. 0,3,-1 (0 = embedding output, -1 = "
        "last) [default: all]",
        json_schema_extra=RESULT,
    )
    address: str | None = Field(
        None,
        description="Ray cluster to join: the head's GCS address HOST:PORT (port 6379 if left "
        "out), ray://HOST:PORT (Ray Client), auto (the cluster `ray start` started on this "
        "machine) or local (a private local Ray). Default: RAY_ADDRESS, or the cluster of a "
        "`ray job submit`, else a private local Ray (never a cluster merely running on this "
        "machine). An address nobody answers on fails at once (exit status 2)",
        json_schema_extra=SCHEDULING | MERGE,
    )
    num_workers: int | None = Field(
        None,
        ge=1,
        description="extractor actors [default: one per --gpus-per-worker GPUs, else CPUs // "
        "cpus-per-worker]",
        json_schema_extra=SCHEDULING,
    )
    cpus_per_worker: int | None = Field(
        None,
        ge=1,
        description="CPUs (torch threads) per extractor actor [default: 1 with a GPU, else "
        "min(4, CPUs)]",
        json_schema_extra=SCHEDULING,
    )
    worker_memory: ByteSize | None = Field(
        None,
        description="bytes of memory each extractor actor asks Ray for and stays within (e.g. "
        "16GiB): its own share (libraries, the weights while they load, a CPU batch, the "
        "sample) plus twice its statistics budget (the running statistics and one serialised "
        "copy). [default: self-sized: what the statistics need unbounded, or, where the nodes "
        "hold less, the smallest share of a node's memory any node hosting extractors gives "
        "each; see --plan]",
        json_schema_extra=SCHEDULING,
    )
    statistics_memory: ByteSize | None = Field(
        None,
        description="bytes an extractor's running statistics may hold (e.g. 8GiB): past it, "
        "within a shard, it spills them to Ray's object store and starts afresh, and flushes a "
        "checkpoint group after that shard, whatever --checkpoint-interval says. Must exceed "
        "the fixed per-layer state 8·L·(d² + 3d + P·(d+1) + 2) [default: what --worker-memory "
        "leaves, and on a GPU no more than its memory holds beside the model and a batch; "
        "none where the whole statistics fit]",
        json_schema_extra=SCHEDULING,
    )
    reducers: int | None = Field(
        None,
        ge=1,
        description="reducer actors holding the statistics, partitioned by token id and layer; "
        "1 merges in the job's own process (same tables to float64 rounding) [default: "
        "self-sized: the job's own process while reducing there keeps it within 1 GiB of its "
        "start (3 · 8·L·V_seen·(2d+2) with the rest), else the fewest reducers the nodes "
        "hold, each needing at most half the largest node's memory; see --plan]",
        json_schema_extra=SCHEDULING | MERGE,
    )
    reducer_memory: ByteSize | None = Field(
        None,
        description="bytes each reducer actor asks Ray for (e.g. 16GiB): the statistics are "
        "then reduced on as many reducer actors as it takes once the run's token types are "
        "known, and at least --reducers (each holds its share of 8·L·V_seen·(2d+2) bytes plus "
        "the per-layer state of its layers, and peaks at three times that while merging, "
        "above 0.5 GiB of its own) [default: self-sized, what the share needs]",
        json_schema_extra=SCHEDULING | MERGE,
    )
    batch_tokens: int | None = Field(
        None,
        ge=16,
        description="padded tokens per forward batch [default: 8192; on a GPU as many as "
        "8 GiB (or half the memory the model and --worker-memory leave free) hold of the "
        "batch's hidden states, activations and fold scratch, 8192 to 65536]",
        json_schema_extra=SCHEDULING,
    )
    docs_per_chunk: int = Field(
        512,
        ge=1,
        description="documents tokenized at a time per actor (bounds memory)",
        json_schema_extra=SCHEDULING,
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="dtype the model runs in; statistics are float64 regardless",
        json_schema_extra=RESULT | AGREE,
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="device of the extractors", json_schema_extra=SCHEDULING
    )
    gpus_per_worker: int | None = Field(
        None,
        ge=1,
        description="GPUs of one node per extractor actor: N > 1 loads a model larger than one "
        "GPU across N GPUs (blocks balanced between them, accelerate's device map) and folds "
        "each layer on the GPU that computed it; needs --device cuda or auto on GPU nodes "
        "[default: self-sized: the fewest GPUs of one node whose memory holds twice the "
        "weights, by Ray's accelerator type; 1 where that does not tell the GPU's memory]",
        json_schema_extra=SCHEDULING,
    )
    keep_special: bool = Field(
        False,
        description="count special tokens ([CLS], [SEP], BOS, …) too [default: excluded]",
        json_schema_extra=RESULT | AGREE,
    )
    dedup: bool = Field(
        False,
        description="drop exact duplicate documents before extraction: the first occurrence in "
        "corpus order of each text is kept, texts compared after NFC normalisation, whitespace "
        "runs collapsed to one space and ends stripped (case kept); decided once in the driver "
        "(one more read of the corpus), counted in the manifest [default: off]",
        json_schema_extra=RESULT,
    )
    min_count: int = Field(
        5,
        ge=2,
        description="minimum occurrences for a type to enter norm_variance_corr",
        json_schema_extra=MERGE,
    )
    shard_bytes: int | None = Field(
        None,
        ge=1024,
        description="bytes of corpus text per shard [default: derived from the corpus size]",
        json_schema_extra=RESULT,
    )
    trust_remote_code: bool = Field(
        False, description="allow model code from the hub (off unless given)", json_schema_extra=RESULT
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
    max_shard_retries: int = Field(
        3,
        ge=0,
        description="times a shard is retried after losing its worker",
        json_schema_extra=SCHEDULING,
    )
    checkpoint_interval: float = Field(
        300.0,
        ge=0,
        description="seconds of work an extractor accumulates over several shards before they "
        "are checkpointed together (at most this much work per worker is redone after a "
        "failure); 0 checkpoints every shard on its own. Not a result option: it only decides "
        "grouping",
        json_schema_extra=SCHEDULING,
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
    outlier_mean_z: float = Field(
        3.0,
        gt=0,
        description="flag a dimension whose mean's z-score among the layer's dimensions "
        "exceeds this",
    )
    outlier_variance_ratio: float = Field(
        5.0,
        gt=1,
        description="flag a dimension whose variance is at least this times the mean variance",
    )
    outlier_tail_share: float = Field(
        0.25,
        gt=0,
        le=1,
        description="flag a dimension that is the argmax or argmin of at least this share of "
        "tokens",
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
    comoment_precision: Literal["bounded", "float64", "reference", "float32"] = Field(
        "bounded",
        description="how the per-batch product of the centred rows behind the covariance "
        "(IsoScore, PCA spectrum, dims std) is computed: bounded (within 2^-29 · sqrt(C_aa "
        "C_bb) of float64 on every entry, docs/precision.md: int8 matrix units on CUDA, float64 "
        "elsewhere), float64 (the reference, also called reference), or float32 (earlier "
        "versions' default, ~1e-6 relative error in practice, no bound). Every per-type "
        "statistic is float64 regardless",
        json_schema_extra=RESULT,
    )
    sample_size: int = Field(
        4096,
        ge=0,
        description="token occurrences in the uniform sample (the same in every layer) for "
        "K-means, LID, silhouette and sampled cosines; 0 turns sampling off",
        json_schema_extra=RESULT | AGREE,
    )
    sample_type_size: int | None = Field(
        None,
        ge=1,
        description="token types in the type-uniform sample (one random occurrence each; Cai's "
        "S_inter) [default: --sample-size]",
        json_schema_extra=RESULT | AGREE,
    )
    sample_seed: int = Field(
        0, description="seed of the sample's random keys", json_schema_extra=RESULT | AGREE
    )
    kmeans_k_max: int = Field(
        _selection.K_MAX,
        ge=2,
        description="K-means fits every k = 2..this and keeps the k of best silhouette (Cai et "
        "al. scan 2..15); a best k at this end is flagged (kmeans_k_at_cap)",
    )
    kmeans_min_silhouette: float = Field(
        _selection.MIN_SILHOUETTE,
        ge=-1,
        le=1,
        description="below this best silhouette, k = 1 (no clusters)",
    )
    kmeans_n_init: int = Field(
        _selection.N_INIT,
        ge=1,
        description="K-means initialisations (k-means++ chains) per k; the lowest inertia wins",
    )
    kmeans_stability_seeds: int = Field(
        _selection.STABILITY_SEEDS,
        ge=0,
        description="refits of the best k from other initialisations; kmeans_stability is their "
        "mean adjusted Rand index with the reported clusters (0: no check)",
    )
    cluster_min_size: int = Field(
        20,
        ge=1,
        description="clusters of fewer points are left out of the size-weighted "
        "cluster-adjusted metrics (adjusted_*_weighted)",
    )
    s_inter_draws: int = Field(
        20,
        ge=2,
        description="random one-occurrence-per-type draws behind the spread of the "
        "cluster-adjusted S_inter (adjusted_s_inter_draws_std)",
    )
    sampled_se_replicates: int = Field(
        10,
        ge=0,
        description="half-samples behind the standard errors of the sampled metrics (*_se "
        "columns); 0 or 1: none",
    )
    lid_k: int = Field(
        20, ge=3, description="nearest neighbours of the LID estimate (Levina-Bickel)"
    )
    silhouette_max_points: int = Field(
        _selection.SILHOUETTE_MAX_POINTS, ge=10, description="points a silhouette is computed on"
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

    @field_validator("comoment_precision")
    @classmethod
    def _reference_is_float64(cls, v: str) -> str:
        """``reference`` is float64's other name: one value in the run's identity."""
        return "float64" if v == "reference" else v

    def result_options(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in RESULT_OPTIONS}

    def _group(self, cls: type[_G]) -> _G:
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})

    @property
    def extraction(self) -> ExtractionOptions:
        """What an extractor needs: the model, the corpus, windows, batches, the sample."""
        return self._group(ExtractionOptions)

    @property
    def scheduling(self) -> SchedulingOptions:
        """What the actor pool needs: where to run, how many actors, checkpoints, retries."""
        return self._group(SchedulingOptions)

    @property
    def tables(self) -> TableOptions:
        """What the exact tables need: the correlation's minimum count, the outlier rules."""
        return self._group(TableOptions)

    @property
    def sampled(self) -> SampledOptions:
        """What the sampled metrics need: K-means model selection, LID, silhouettes."""
        return self._group(SampledOptions)

    def options_digest(self) -> str:
        return hashlib.sha256(
            json.dumps(self.result_options(), sort_keys=True).encode()
        ).hexdigest()


def options_marked(marker: dict[str, Any]) -> tuple[str, ...]:
    """The options (field names, in order) whose ``json_schema_extra`` holds ``marker``."""
    (key,) = marker
    return tuple(
        name
        for name, field in JobConfig.model_fields.items()
        if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get(key)
    )


#: options whose value changes the statistics; they enter the run fingerprint.
RESULT_OPTIONS: tuple[str, ...] = options_marked(RESULT)
#: options that only decide how a run is scheduled, never what its tables hold
SCHEDULING_OPTIONS: tuple[str, ...] = options_marked(SCHEDULING)
#: options that runs must agree on to be merged
AGREE_OPTIONS: tuple[str, ...] = options_marked(AGREE)
#: the options of ``jobs.merge``'s command line
MERGE_OPTIONS: tuple[str, ...] = options_marked(MERGE)


# ---------------------------------------------------------------------------- option groups
# Views of JobConfig's fields (same names), passed to the parts of the job instead of the
# whole configuration. Their values come from JobConfig; they hold no defaults of their own.


@dataclass(frozen=True)
class ExtractionOptions:
    """An extractor's options (:class:`~embgeom_ray.inputs.extractor.ShardProcessor`)."""

    model: str
    revision: str | None
    trust_remote_code: bool
    dtype: str
    device: str
    corpus: str
    text_column: str
    split: str
    max_length: int
    batch_tokens: int | None
    docs_per_chunk: int
    keep_special: bool
    comoment_precision: str
    sample_size: int
    sample_type_size: int | None
    sample_seed: int
    gpus_per_worker: int | None
    worker_memory: int | None
    statistics_memory: int | None


@dataclass(frozen=True)
class SchedulingOptions:
    """The actor pool's options (:mod:`embgeom_ray.distributed.actor_pool`)."""

    address: str | None
    device: str
    num_workers: int | None
    cpus_per_worker: int | None
    checkpoint_interval: float
    max_shard_retries: int
    reducers: int | None
    reducer_memory: int | None
    worker_memory: int | None
    statistics_memory: int | None
    gpus_per_worker: int | None
    batch_tokens: int | None


@dataclass(frozen=True)
class TableOptions:
    """The exact tables' options (:func:`embgeom_ray.core.tables.build_tables`)."""

    min_count: int
    outlier_mean_z: float
    outlier_variance_ratio: float
    outlier_tail_share: float


@dataclass(frozen=True)
class SampledOptions:
    """The sampled metrics' options (:func:`embgeom_ray.core.tables.plan_sampled_metrics`)."""

    kmeans_k_max: int
    kmeans_min_silhouette: float
    kmeans_n_init: int
    kmeans_stability_seeds: int
    sample_seed: int
    lid_k: int
    silhouette_max_points: int
    cluster_min_size: int
    s_inter_draws: int
    sampled_se_replicates: int


_G = TypeVar("_G", ExtractionOptions, SchedulingOptions, TableOptions, SampledOptions)


def _format_validation_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "config"
        name = "--" + loc.replace("_", "-")
        if err["type"] == "missing":
            parts.append(f"{name} is required")
        elif err["type"] == "extra_forbidden":
            parts.append(f"unknown option {loc!r} in the config file")
        else:
            parts.append(f"{name}: {err['msg']} (got {err.get('input')!r})")
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
        raise ConfigError(_format_validation_error(exc)) from None


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
    """argparse keywords for one JobConfig field: type, choices, help with its default (or
    ``shown_default`` in its place)."""
    annotation = field.annotation
    optional = get_origin(annotation) in (Union, types.UnionType)
    kind = next(a for a in get_args(annotation) if a is not type(None)) if optional else annotation
    help_text = field.description or ""
    if shown_default is not None:
        help_text = help_text.split(" [default:")[0] + f" [default: {shown_default}]"
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
    """The command line of ``jobs.analyze`` (every field), or of another command (``options``:
    the fields it takes, e.g. :data:`MERGE_OPTIONS`), generated from :class:`JobConfig`'s
    fields (``shown_defaults``: the default a flag's help shows, where it is not the field's).

    Every field is a flag; a flag left out is ``None`` and does not override the YAML file
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
    for name, field in JobConfig.model_fields.items():
        if options is None or name in options:
            shown = (shown_defaults or {}).get(name)
            parser.add_argument(_flag(name), **_argument(name, field, shown))
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    return parser
