"""An extractor actor without a model, for the scheduler's tests: the same calls and answers
as :class:`~embgeom_ray.distributed.actor_pool.ShardExtract` (``ready``, ``process``,
``flush``), each shard taking ``delay`` seconds, and reporting a peak memory of 1 MiB, each
flush ``flush_peak`` bytes (0: none reported); ``copy_host``: each shard's result carries a
copy's digest from that host, as one read on another node's copy of a local file does
(:data:`~embgeom_ray.distributed.actor_pool.COPY`); ``die_in_flush``: its process ends in its
first flush, as a lost node's does. In a module of its own that imports no
torch: Ray's workers import it to build the actor, in a fraction of a second."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import ray

from embgeom_ray.counts import Counts

#: :data:`embgeom_ray.distributed.actor_pool.WRITTEN` (not imported here: that module imports
#: torch)
WRITTEN = "written_group"
#: :data:`embgeom_ray.distributed.actor_pool.COPY`
COPY = "copy"


class FakeExtract:
    def __init__(
        self,
        delay: float,
        out_unseen: str | None = None,
        flush_peak: int = 0,
        copy_host: str | None = None,
        die_in_flush: bool = False,
    ) -> None:
        self.delay, self.flush_peak = delay, flush_peak
        self.copy_host, self.die_in_flush = copy_host, die_in_flush
        self.shard_ids: list[str] = []
        #: why its node does not see the run's local directory (None: it does)
        self.out_unseen = out_unseen

    def _where(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def ready(self) -> dict[str, Any]:
        ready = {"device": "cpu", "batch_tokens": 0, "statistics_budget": None}
        return ready | self._where() | {"out_unseen": self.out_unseen}

    def process(self, shard_json: dict[str, Any]) -> dict[str, Any]:
        time.sleep(self.delay)
        self.shard_ids.append(shard_json["shard_id"])
        counts = Counts(documents=1).to_json()
        held = {"unflushed": len(self.shard_ids), "state_bytes": 0, "peak_private_bytes": 1 << 20}
        copy = {COPY: {"host": self.copy_host, "xxh3-128": "0" * 32}} if self.copy_host else {}
        return {"counts": counts} | held | self._where() | copy

    def flush(self, writer: Any = None) -> tuple[list[str], list[Any], None, dict[str, Any]]:
        """As the real one's: with ``writer``, it writes the group's files itself."""
        if self.die_in_flush:
            os._exit(1)
        shard_ids, self.shard_ids = self.shard_ids, []
        pieces = [np.zeros(1, dtype=np.uint8)]
        counts = Counts().to_json() | ({"peak_private_bytes": self.flush_peak} if self.flush_peak else {})
        if writer is None:
            return shard_ids, pieces, None, counts
        written = writer(shard_ids, pieces, None)
        return shard_ids, [], None, counts | {WRITTEN: written, "write_s": 0.01}


FakeExtractActor = ray.remote(FakeExtract)
