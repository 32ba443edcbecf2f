"""The thin Ray layer: connect, size the actor pool, run shards on extractor actors.

The driver only plans and gathers: each :class:`ShardExtractActor` loads the model once and
folds whole shards (:class:`~embgeom_ray.extractor.ShardProcessor`), returning the shard's
statistics as safetensors bytes. The scheduler keeps one shard in flight per actor; an actor
that dies (process killed, node lost, spot preemption) is replaced and its shard goes back to
the queue. Results reach ``on_result`` in the driver, which checkpoints them: a shard counts
as done only there, so a shard's result is merged exactly once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from .config import JobConfig
from .corpus import Shard
from .errors import ConfigError, UserError
from .extractor import ShardCounts, ShardProcessor

log = logging.getLogger(__name__)


def connect(address: str | None = None) -> None:
    """Join a running cluster (``ray job submit``, ``RAY_ADDRESS``), else start a local Ray.

    ``HF_*`` / ``TRANSFORMERS_*`` variables of the driver (offline mode, caches, tokens) are
    forwarded to the workers, except those the submitted job's runtime env already sets: Ray
    refuses a driver runtime env that repeats one of the job's env_vars.
    """
    if ray.is_initialized():
        return
    env_vars = {k: v for k, v in os.environ.items() if k.startswith(("HF_", "TRANSFORMERS_"))}
    job_config = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if job_config:
        job_vars = (json.loads(job_config).get("runtime_env") or {}).get("env_vars") or {}
        env_vars = {k: v for k, v in env_vars.items() if k not in job_vars}
    env = {"env_vars": env_vars} if env_vars else None
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=True)
    else:
        ray.init(runtime_env=env, include_dashboard=False, log_to_driver=True)


@dataclass
class PoolPlan:
    num_workers: int
    num_gpus: float
    num_cpus: int
    workers_lost: int = 0


def plan_pool(config: JobConfig, num_shards: int) -> PoolPlan:
    """The extractor pool: one actor per GPU, else CPU actors of ``cpus_per_worker`` CPUs.

    With ``--device cuda`` GPU actors are requested even if the cluster shows no GPU yet, so
    an autoscaling cluster whose GPU workers start at 0 adds them (``--num-workers`` of them,
    default 1 until GPUs are visible).
    """
    res = ray.cluster_resources()
    gpus = int(res.get("GPU", 0))
    cpus = max(int(res.get("CPU", 1)), 1)
    # an actor lives on one node: never ask for more CPUs than the largest node has
    node_cpus = [int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n.get("Alive")]
    largest = max([c for c in node_cpus if c > 0], default=cpus)
    if config.device == "cuda" or (gpus and config.device == "auto"):
        n = config.num_workers or max(gpus, 1)
        return PoolPlan(min(n, num_shards), 1.0, config.cpus_per_worker or 1)
    if config.num_workers:
        per = config.cpus_per_worker or max(1, min(largest, cpus // config.num_workers))
        n = config.num_workers
    else:
        per = config.cpus_per_worker or min(4, largest)
        n = max(1, cpus // per)
    if per > largest:
        raise ConfigError(
            f"--cpus-per-worker {per} exceeds the CPUs of the largest node ({largest}); "
            "an extractor actor runs on one node"
        )
    return PoolPlan(max(1, min(n, num_shards)), 0.0, per)


class ShardExtract:
    """Actor body: a :class:`ShardProcessor` with torch limited to the actor's CPUs.

    An error while loading (bad weights, missing files, …) is kept and raised again by
    :meth:`ready`, so the driver sees the original exception instead of a dead actor, and
    does not retry what cannot succeed.
    """

    def __init__(
        self,
        config_json: dict[str, Any],
        layers: list[int],
        metadata: dict[str, str],
        threads: int,
        clip_dims: list[int] | None = None,
    ) -> None:
        import torch

        torch.set_num_threads(max(1, threads))
        self.error: Exception | None = None
        try:
            self.processor = ShardProcessor(JobConfig(**config_json), layers, metadata, clip_dims)
        except Exception as exc:
            self.error = exc

    def ready(self) -> str:
        if self.error is not None:
            raise self.error
        return self.processor.device

    def process(self, shard_json: dict[str, Any]) -> tuple[bytes, bytes | None, dict[str, Any]]:
        stats, sample, counts = self.processor.process(Shard(**shard_json))
        return stats.to_bytes(), None if sample is None else sample.to_bytes(), counts.to_json()


ShardExtractActor = ray.remote(ShardExtract)


def _unwrap_user_error(exc: BaseException) -> UserError | None:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, UserError):
        return cause
    return exc if isinstance(exc, UserError) else None


def run_shards(
    config: JobConfig,
    layers: list[int],
    metadata: dict[str, str],
    shards: list[Shard],
    on_result: Callable[[Shard, bytes, bytes | None, ShardCounts], None],
    clip_dims: list[int] | None = None,
) -> PoolPlan:
    """Process ``shards`` on a pool of extractor actors; call ``on_result`` once per shard."""
    pool = plan_pool(config, len(shards))
    if not shards:
        return pool
    options: dict[str, Any] = {"num_cpus": pool.num_cpus, "max_restarts": 0}
    if pool.num_gpus:
        options["num_gpus"] = pool.num_gpus
    actor_cls = ShardExtractActor.options(**options)
    args = (config.model_dump(), layers, metadata, pool.num_cpus, clip_dims)
    queue: deque[Shard] = deque(shards)
    losses: dict[str, int] = {}
    in_flight: dict[Any, tuple[Any, Shard]] = {}  # process() ref -> (actor, shard)
    starting: dict[Any, Any] = {}  # ready() ref -> actor not yet known to be placed
    idle: list[Any] = []
    start_failures = 0

    def start_actor() -> None:
        actor = actor_cls.remote(*args)
        starting[actor.ready.remote()] = actor

    def dispatch() -> None:
        while idle and queue:
            actor, shard = idle.pop(), queue.popleft()
            in_flight[actor.process.remote(dataclasses.asdict(shard))] = (actor, shard)

    for _ in range(pool.num_workers):
        start_actor()
    try:
        while queue or in_flight:
            if not in_flight and not starting:
                start_actor()  # every actor was lost: start again rather than stall
            ready, _ = ray.wait([*in_flight, *starting], num_returns=1)
            ref = ready[0]
            if ref in starting:
                actor = starting.pop(ref)
                try:
                    ray.get(ref)
                except ray.exceptions.RayTaskError as exc:  # loading failed: no retry helps
                    user = _unwrap_user_error(exc)
                    if user is not None:
                        raise user from None
                    raise RuntimeError(f"an extractor could not start: {exc}") from exc
                except ray.exceptions.RayActorError as exc:  # its process or node died
                    start_failures += 1
                    if start_failures > 2 * pool.num_workers + 1:
                        raise RuntimeError(
                            f"extractor actors keep dying while starting ({start_failures} "
                            f"times); last error: {exc}"
                        ) from exc
                    log.warning("an extractor died while starting (%s); starting another", exc)
                    start_actor()
                    continue
                idle.append(actor)
                dispatch()
                continue
            actor, shard = in_flight.pop(ref)
            try:
                data, sample_data, counts = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as exc:
                losses[shard.shard_id] = losses.get(shard.shard_id, 0) + 1
                pool.workers_lost += 1
                if losses[shard.shard_id] > config.max_shard_retries:
                    raise RuntimeError(
                        f"shard {shard.shard_id} lost its worker {losses[shard.shard_id]} times "
                        f"(last: {type(exc).__name__}); giving up"
                    ) from exc
                log.warning(
                    "worker lost on shard %s (%s); the shard is queued again and a "
                    "replacement actor started",
                    shard.shard_id,
                    type(exc).__name__,
                )
                ray.kill(actor, no_restart=True)
                queue.appendleft(shard)
                start_actor()
                dispatch()
                continue
            except ray.exceptions.RayTaskError as exc:
                user = _unwrap_user_error(exc)
                if user is not None:
                    raise user from None
                raise
            on_result(shard, data, sample_data, ShardCounts.from_json(counts))
            idle.append(actor)
            dispatch()
    finally:
        for ref in in_flight:
            ray.cancel(ref, force=True)
        for actor in [*starting.values(), *idle, *(a for a, _ in in_flight.values())]:
            ray.kill(actor, no_restart=True)
    return pool
