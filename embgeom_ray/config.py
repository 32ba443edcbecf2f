"""The job's options: one validated pydantic model, filled from a YAML file and command-line flags.

Flags override the YAML file; both are validated here, so a bad value fails before any work
starts, with one message that names the option.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import ConfigError

#: options whose value changes the statistics; they enter the run fingerprint.
RESULT_OPTIONS = (
    "max_length",
    "layers",
    "keep_special",
    "dtype",
    "text_column",
    "split",
    "shard_bytes",
    "trust_remote_code",
    "clip_dims",
    "clip_dims_from",
    "sample_size",
    "sample_type_size",
    "sample_seed",
    "comoment_precision",
)


class JobConfig(BaseModel):
    """Everything that defines one analysis run (see ``python -m jobs.analyze --help``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="local model directory or hub id")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit)")
    corpus: str = Field(description="file, glob, directory, fsspec URL or hf:NAME[:CONFIG]")
    out: str = Field(description="output directory (local path or fsspec URL)")
    text_column: str = "text"
    split: str = "train"
    max_length: int = Field(128, ge=4, le=1_000_000)
    layers: list[int] | None = None
    address: str | None = Field(
        None,
        description="Ray cluster to join: the head's GCS address HOST:PORT (port 6379 if left "
        "out), ray://HOST:PORT (Ray Client), auto (the cluster `ray start` started on this "
        "machine) or local (a private local Ray). Default: RAY_ADDRESS, or the cluster of a "
        "`ray job submit`, else a private local Ray (never a cluster merely running on this "
        "machine). An address nobody answers on fails at once (exit status 2)",
    )
    num_workers: int | None = Field(None, ge=1)
    cpus_per_worker: int | None = Field(None, ge=1)
    batch_tokens: int = Field(8192, ge=16, description="padded tokens per forward batch")
    docs_per_chunk: int = Field(512, ge=1, description="documents tokenized at a time")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    keep_special: bool = False
    min_count: int = Field(5, ge=2)
    shard_bytes: int | None = Field(None, ge=1024)
    trust_remote_code: bool = False
    overwrite: bool = False
    max_shard_retries: int = Field(3, ge=0)
    checkpoint_interval: float = Field(
        300.0,
        ge=0,
        description="seconds an extractor folds shards before its statistics are checkpointed "
        "as one group; 0 = after every shard. Not a result option: it only decides grouping",
    )
    keep_checkpoints: bool = Field(
        False,
        description="keep the checkpoint groups (groups/) after the run completes; by default "
        "they are removed, since statistics.safetensors and sample.safetensors hold the same "
        "information",
    )
    outlier_mean_z: float = Field(3.0, gt=0)
    outlier_variance_ratio: float = Field(5.0, gt=1)
    outlier_tail_share: float = Field(0.25, gt=0, le=1)
    clip_dims: list[int] | None = None
    clip_dims_from: str | None = None
    comoment_precision: Literal["float64", "float32"] = "float32"
    sample_size: int = Field(4096, ge=0, description="uniform sample per layer; 0 = no sample")
    sample_type_size: int | None = Field(None, ge=1)
    sample_seed: int = 0
    kmeans_k_max: int = Field(15, ge=2)
    kmeans_min_silhouette: float = Field(0.1, ge=-1, le=1)
    kmeans_n_init: int = Field(3, ge=1)
    lid_k: int = Field(20, ge=3)
    silhouette_max_points: int = Field(4096, ge=10)

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

    def result_options(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in RESULT_OPTIONS}

    def options_digest(self) -> str:
        return hashlib.sha256(
            json.dumps(self.result_options(), sort_keys=True).encode()
        ).hexdigest()


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
