"""How much memory every process of a job takes, and how many of each: the job sizes itself.

Engine-free: the formulas in L, V, d, P and the corpus (:mod:`.formulas`), the cluster as
Ray reports it and placing actors on it (:mod:`.nodes`, read by
:func:`embgeom_ray.distributed.cluster.read_cluster`), the decisions made from them and from
the options a user gave, which always win (:mod:`.decisions`), the extractor pool's growth as
nodes join and leave (:mod:`.growth`, which the scheduler polls), and what ``--plan`` prints
(:mod:`.plan`). The pipeline only calls :func:`size_job` before any work and
:func:`size_reduce` once the types seen are known; what cannot fit is refused there, with the
option that fixes it (:class:`~embgeom_ray.errors.ConfigError`). docs/sizing.md states the
policy and every formula.
"""

from __future__ import annotations

from .decisions import (
    EARLY_REDUCERS_MIN_BYTES,
    GPU_WEIGHT_SHARE,
    REDUCER_NODE_SHARE,
    Pool,
    Reduce,
    Sizing,
    check_device,
    driver_reserve,
    gpus_for_weights,
    io_sizes,
    lanes_for,
    plan_pool,
    size_extractors,
    size_job,
    size_reduce,
    size_reducers,
)
from .formulas import (
    CPU_BATCH_TOKENS_MAX,
    CPU_BATCH_TOKENS_MIN,
    DEFAULT_BATCH_TOKENS,
    DRIVER_ALLOWANCE_BYTES,
    DRIVER_BASE_BYTES,
    DRIVER_REDUCE_FACTOR,
    DRIVER_RUN_BYTES,
    EXTRACTOR_BASE_BYTES,
    FOLD_BYTES_PER_TOKEN_DIM,
    GPU_BATCH_BYTES,
    GPU_BATCH_TOKENS_MAX,
    GPU_STATISTICS_SHARE,
    REDUCER_BASE_BYTES,
    REDUCER_MERGE_FACTOR,
    TYPE_ROW_BYTES,
    CorpusShape,
    Shape,
    batch_bytes_per_token,
    cpu_batch_tokens,
    default_batch_tokens,
    driver_bytes,
    extractor_bytes,
    gib,
    gpu_budgets,
    reducer_budget,
    reducer_bytes,
    reducer_ranges,
    reducers_for,
    run_shape,
    statistics_for,
    types_bound,
)
from .growth import (
    Extractor,
    autoscaler_request,
    extractors_held,
    extractors_possible,
    extractors_to_add,
    pool_ceiling,
    pool_target,
)
from .nodes import GPU_MEMORY_BY_TYPE, Cluster, Node, NodeGroup, fits, place, slot_memory
from .plan import describe_plan

__all__ = [
    "CPU_BATCH_TOKENS_MAX", "CPU_BATCH_TOKENS_MIN", "DEFAULT_BATCH_TOKENS",
    "DRIVER_ALLOWANCE_BYTES", "DRIVER_BASE_BYTES", "DRIVER_REDUCE_FACTOR", "DRIVER_RUN_BYTES",
    "EARLY_REDUCERS_MIN_BYTES", "EXTRACTOR_BASE_BYTES", "FOLD_BYTES_PER_TOKEN_DIM",
    "GPU_BATCH_BYTES", "GPU_BATCH_TOKENS_MAX", "GPU_MEMORY_BY_TYPE", "GPU_STATISTICS_SHARE",
    "GPU_WEIGHT_SHARE", "REDUCER_BASE_BYTES", "REDUCER_MERGE_FACTOR", "REDUCER_NODE_SHARE",
    "TYPE_ROW_BYTES", "Cluster", "CorpusShape", "Extractor", "Node", "NodeGroup", "Pool",
    "Reduce", "Shape", "Sizing", "autoscaler_request", "batch_bytes_per_token", "check_device",
    "cpu_batch_tokens", "default_batch_tokens", "describe_plan", "driver_bytes",
    "driver_reserve", "extractor_bytes", "extractors_held", "extractors_possible",
    "extractors_to_add", "fits", "gib", "gpu_budgets", "gpus_for_weights", "io_sizes", "lanes_for", "place",
    "plan_pool", "pool_ceiling", "pool_target", "reducer_budget", "reducer_bytes",
    "reducer_ranges", "reducers_for", "run_shape", "size_extractors", "size_job", "size_reduce",
    "size_reducers", "slot_memory", "statistics_for", "types_bound",
]  # fmt: skip
