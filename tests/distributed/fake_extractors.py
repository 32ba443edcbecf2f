"""An extractor actor without a model, for the scheduler's tests: the same calls and answers
as :class:`~embgeom_ray.distributed.actor_pool.ShardExtract` (``ready``, ``process``,
``flush``), each shard taking ``delay`` seconds. In a module of its own that imports no
torch: Ray's workers import it to build the actor, in a fraction of a second."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import ray

from embgeom_ray.counts import Counts


class FakeExtract:
    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.shard_ids: list[str] = []

    def _where(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def ready(self) -> dict[str, Any]:
        return {"device": "cpu", "batch_tokens": 0, "statistics_budget": None} | self._where()

    def process(self, shard_json: dict[str, Any]) -> dict[str, Any]:
        time.sleep(self.delay)
        self.shard_ids.append(shard_json["shard_id"])
        counts = Counts(documents=1).to_json()
        return {"counts": counts, "unflushed": len(self.shard_ids), "state_bytes": 0} | self._where()

    def flush(self) -> tuple[list[str], list[Any], None, dict[str, Any]]:
        out = (self.shard_ids, [np.zeros(1, dtype=np.uint8)], None, Counts().to_json())
        self.shard_ids = []
        return out


FakeExtractActor = ray.remote(FakeExtract)
