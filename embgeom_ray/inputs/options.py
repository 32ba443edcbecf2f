"""An extractor's options, with their defaults: the model, the corpus, the windows, its resources.

:class:`ExtractionOptions` is what :class:`~embgeom_ray.inputs.extractor.ShardProcessor` takes:
the model (:mod:`~embgeom_ray.inputs.model_loading`), the corpus and its shards
(:mod:`~embgeom_ray.inputs.corpus`, :mod:`~embgeom_ray.inputs.dedup`), the windows
(:mod:`~embgeom_ray.inputs.windows`), the statistics' arithmetic, the sample
(:class:`~embgeom_ray.core.options.SampleOptions`) and the resources of one extractor
(:class:`WorkerOptions`, which the actor pool places and :mod:`embgeom_ray.sizing` decides when
they are left out). The job's command line is generated from these fields
(:mod:`embgeom_ray.config`).

Pydantic only (no torch): the command line imports it to print ``--help``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ByteSize, ConfigDict, Field, field_validator

from ..core.options import SampleOptions
from ..options import AGREE, RESULT, SCHEDULING, OptionGroup


class WorkerOptions(OptionGroup):
    """What one extractor actor runs on and holds: its device and GPUs, its batch, its memory.
    Left out (None), the job sizes them (:func:`embgeom_ray.sizing.size_extractors`)."""

    model_config = ConfigDict(title="extractor resource options")

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
    batch_tokens: int | None = Field(
        None,
        ge=16,
        description="padded tokens per forward batch [default: on a CPU as many as keep one "
        "layer's largest tensor within 32 MiB, 1024 to 8192 (5120 for MiniLM); on a GPU as "
        "many as 8 GiB (or half the memory the model and --worker-memory leave free) hold of "
        "the batch's hidden states, activations and fold scratch, 8192 to 65536]",
        json_schema_extra=SCHEDULING,
    )
    cpu_lanes: int | None = Field(
        None,
        ge=1,
        description="batches a CPU extractor runs through the model at once, each on its own "
        "thread, folded in batch order (the same statistics); each lane holds one batch "
        "[default: one a CPU of the extractor]",
        json_schema_extra=SCHEDULING,
    )
    worker_memory: ByteSize | None = Field(
        None,
        description="bytes of memory each extractor actor asks Ray for and stays within (e.g. "
        "16GiB): its own share (libraries, the weights while they load, a CPU batch, the "
        "sample) plus twice its statistics budget (the running statistics and one serialised "
        "copy; once on a GPU, whose statistics live in device memory). [default: self-sized: "
        "what the statistics need unbounded, or, where the nodes hold less, the smallest "
        "share of a node's memory any node hosting extractors gives each; see --plan]",
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
    host_statistics_memory: ByteSize | None = Field(
        None,
        description="bytes of host memory an extractor merges its spilled statistics into, type "
        "by type, before anything goes to Ray's object store (e.g. 128GiB): past "
        "--statistics-memory the running statistics are merged here instead of spilled as a "
        "piece, so a checkpoint writes each token type once per this much rather than once per "
        "spill (on a GPU, whose memory holds few types of a large vocabulary, many times fewer "
        "bytes). Must exceed the statistics budget; counted in --worker-memory with one 64 MiB "
        "block of its file more (it is written a block at a time) [default: off]",
        json_schema_extra=SCHEDULING,
    )


class ExtractionOptions(SampleOptions, WorkerOptions):
    """An extractor's options (:class:`~embgeom_ray.inputs.extractor.ShardProcessor`): the
    model, the corpus, the windows, the statistics' arithmetic, with the sample's and its
    resources'."""

    model_config = ConfigDict(title="model and corpus options")

    model: str = Field(description="local Hugging Face model directory or hub id (required)")
    revision: str | None = Field(None, description="hub revision: branch, tag or commit hash")
    trust_remote_code: bool = Field(
        False, description="allow model code from the hub (off unless given)", json_schema_extra=RESULT
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="dtype the model runs in; statistics are float64 regardless",
        json_schema_extra=RESULT | AGREE,
    )
    corpus: str = Field(
        description="a .txt/.jsonl/.parquet file, a glob, a directory, an fsspec URL (s3://, "
        "gs://) or hf:NAME[:CONFIG] (required)"
    )
    text_column: str = Field(
        "text", description="text column of .jsonl/.parquet/HF corpora", json_schema_extra=RESULT
    )
    split: str = Field("train", description="split of an HF dataset", json_schema_extra=RESULT)
    shard_bytes: int | None = Field(
        None,
        ge=1024,
        description="bytes of corpus text per shard [default: a 16th of the corpus within 1 MiB "
        "and 16 MiB, less for models of more work a token than an 8B]",
        json_schema_extra=RESULT,
    )
    dedup: bool = Field(
        False,
        description="drop exact duplicate documents before extraction: the first occurrence in "
        "corpus order of each text is kept, texts compared after NFC normalisation, whitespace "
        "runs collapsed to one space and ends stripped (case kept); decided once in the driver "
        "(one more read of the corpus), counted in the manifest [default: off]",
        json_schema_extra=RESULT,
    )
    max_length: int = Field(
        128,
        ge=4,
        le=1_000_000,
        description="tokens per window, special tokens included; longer documents are split "
        "into consecutive windows",
        json_schema_extra=RESULT | AGREE,
    )
    keep_special: bool = Field(
        False,
        description="count special tokens ([CLS], [SEP], BOS, …) too [default: excluded]",
        json_schema_extra=RESULT | AGREE,
    )
    docs_per_chunk: int = Field(
        512,
        ge=1,
        description="documents tokenized at a time per actor (bounds memory)",
        json_schema_extra=SCHEDULING,
    )
    comoment_precision: Literal["bounded", "float64", "reference", "float32"] = Field(
        "bounded",
        description="how the per-batch product of the centred rows behind the covariance "
        "(IsoScore, PCA spectrum, dims std) is computed: bounded (within 2^-29 · sqrt(C_aa "
        "C_bb) of float64 on every entry, docs/precision.md: int8 matrix units on CUDA cards "
        "without float64 ones, float64 on CPUs and H100/H200), float64 (the reference, also "
        "called reference), or float32 (earlier versions' default, ~1e-6 relative error in "
        "practice, no bound). Every per-type statistic is float64 regardless",
        json_schema_extra=RESULT,
    )

    @field_validator("comoment_precision")
    @classmethod
    def _reference_is_float64(cls, v: str) -> str:
        """``reference`` is float64's other name: one value in the run's identity."""
        return "float64" if v == "reference" else v
