"""The actor pool's options, with their defaults: the cluster, the actors, retries, checkpoints.

:class:`SchedulingOptions` is what :mod:`~embgeom_ray.distributed.actor_pool` (and the job's
sizing, :mod:`embgeom_ray.sizing`, which decides every one left out) takes: where to run
(:func:`~embgeom_ray.distributed.cluster.connect`), how many extractor and reducer actors with
what resources (with each extractor's own, :class:`~embgeom_ray.inputs.options.WorkerOptions`),
how often to checkpoint and how often to retry a shard. None of them changes a number of the
run. The job's command line is generated from these fields (:mod:`embgeom_ray.config`).

Pydantic only (no Ray): the command line imports it to print ``--help``.
"""

from __future__ import annotations

from pydantic import ByteSize, ConfigDict, Field

from ..inputs.options import WorkerOptions
from ..options import MERGE, SCHEDULING


class SchedulingOptions(WorkerOptions):
    """The actor pool's options (:mod:`embgeom_ray.distributed.actor_pool`), with each
    extractor's resources."""

    model_config = ConfigDict(title="cluster and scheduling options")

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
        description="the most extractor actors: the pool starts with what the nodes hold and "
        "grows to this as nodes join [default: as many as the shards want: one per "
        "--gpus-per-worker GPUs, else per --cpus-per-worker CPUs, of every node, as nodes join "
        "and leave]",
        json_schema_extra=SCHEDULING,
    )
    cpus_per_worker: int | None = Field(
        None,
        ge=1,
        description="CPUs (torch threads) per extractor actor [default: 1 with a GPU; else "
        "min(4, the largest node's CPUs), or with --num-workers N the cluster's CPUs / N, at "
        "most the largest node's]",
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
    max_shard_retries: int = Field(
        3,
        ge=0,
        description="times a shard is retried after losing its worker",
        json_schema_extra=SCHEDULING,
    )
    checkpoint_interval: float | None = Field(
        None,
        ge=0,
        description="seconds of work an extractor accumulates over several shards before they "
        "are checkpointed together (at most this much work per worker is redone after a "
        "failure); 0 checkpoints every shard on its own. Not a result option: it only decides "
        "grouping [default: sized so that writing checkpoints takes at most 0.05 of the "
        "extraction's time: N · B / (0.05 · W) for N extractors, from the bytes B a flush "
        "writes and the bandwidth W measured on the run's own flushes, within 60 s to 1 h; "
        "see --plan]",
        json_schema_extra=SCHEDULING,
    )
