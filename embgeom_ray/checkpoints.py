"""Per-shard checkpoints under the output directory, and resuming from them.

Layout under ``OUT``::

    run.json                          fingerprint of what determines the result + shard plan
    shards/<shard_id>.safetensors     the shard's statistics (written first, atomically)
    shards/<shard_id>.sample.safetensors  its activation sample (when sampling is on)
    shards/<shard_id>.json            its counts; written last, so its presence marks the
                                      shard done

Only the driver writes here, and only after it has received a shard's whole result, so the
driver alone decides what is done, and a shard is merged exactly once. A rerun of the same
command finds ``run.json`` with the same fingerprint, reuses the saved plan and loads finished
shards instead of recomputing them. A run with another fingerprint refuses to mix with them.
"""

from __future__ import annotations

import json
from typing import Any

import fsspec

from .corpus import ShardPlan
from .errors import OutputError
from .extractor import ShardCounts
from .io_utils import atomic_write_bytes, atomic_write_json, exists, join, read_bytes
from .samples import ActivationSample
from .statistics import EmbeddingStatistics


class CheckpointStore:
    def __init__(self, out: str) -> None:
        self.out = out.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.out)

    def _path(self, *parts: str) -> str:
        return join(self.out, *parts)

    def check_writable(self) -> None:
        try:
            self.fs.makedirs(self.root, exist_ok=True)
            probe = self._path(".write-probe")
            atomic_write_bytes(probe, b"ok")
            self.fs.rm(join(self.root, ".write-probe"))
        except OSError as exc:
            raise OutputError(f"cannot write to the output directory {self.out}: {exc}") from None

    def load_run(self) -> dict[str, Any] | None:
        path = self._path("run.json")
        if not exists(path):
            return None
        try:
            return json.loads(read_bytes(path))
        except (OSError, ValueError) as exc:
            raise OutputError(
                f"{path} is unreadable ({exc}); use --overwrite to start over"
            ) from None

    def start(
        self, fingerprint: str, identity: dict[str, Any], plan: ShardPlan, overwrite: bool
    ) -> tuple[ShardPlan, bool]:
        """Open the store for this run: (plan to use, whether this resumes an earlier run)."""
        self.check_writable()
        previous = self.load_run()
        if previous is not None and not overwrite:
            if previous.get("fingerprint") != fingerprint:
                diffs = _describe_differences(previous.get("identity", {}), identity)
                raise OutputError(
                    f"{self.out} holds a run of a different configuration"
                    + (f" ({diffs})" if diffs else "")
                    + "; pass --overwrite to discard it and start over, or choose another --out"
                )
            return ShardPlan.from_json(previous["plan"]), True
        if overwrite:
            self.clear()
        atomic_write_json(
            self._path("run.json"),
            {"fingerprint": fingerprint, "identity": identity, "plan": plan.to_json()},
        )
        return plan, False

    def clear(self) -> None:
        """Remove checkpoints, tables and manifest of an earlier run (``--overwrite``)."""
        if not self.fs.exists(self.root):
            return
        for entry in self.fs.ls(self.root, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if (
                name in {"shards", "run.json", "manifest.json"}
                or name.endswith(".safetensors")
                or (name.endswith((".parquet", ".png", ".html")))
            ):
                self.fs.rm(entry, recursive=True)

    def done_shards(self) -> set[str]:
        base = join(self.root, "shards")
        if not self.fs.exists(base):
            return set()
        names = [p.rsplit("/", 1)[-1] for p in self.fs.ls(base, detail=False)]
        return {n[: -len(".json")] for n in names if n.endswith(".json") and not n.startswith(".")}

    def save_shard(
        self, shard_id: str, stats_bytes: bytes, sample_bytes: bytes | None, counts: ShardCounts
    ) -> None:
        """Statistics, then sample, then the counts that mark the shard done."""
        atomic_write_bytes(self._path("shards", f"{shard_id}.safetensors"), stats_bytes)
        if sample_bytes is not None:
            atomic_write_bytes(self._path("shards", f"{shard_id}.sample.safetensors"), sample_bytes)
        atomic_write_json(self._path("shards", f"{shard_id}.json"), counts.to_json())

    def load_shard(
        self, shard_id: str, with_sample: bool
    ) -> tuple[EmbeddingStatistics, ActivationSample | None, ShardCounts]:
        stats = EmbeddingStatistics.load(self._path("shards", f"{shard_id}.safetensors"))
        sample = (
            ActivationSample.load(self._path("shards", f"{shard_id}.sample.safetensors"))
            if with_sample
            else None
        )
        counts = ShardCounts.from_json(
            json.loads(read_bytes(self._path("shards", f"{shard_id}.json")))
        )
        return stats, sample, counts


def _describe_differences(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = sorted(set(old) | set(new))
    changed = [k for k in keys if old.get(k) != new.get(k)]
    return "differs in: " + ", ".join(changed) if changed else ""
