"""Checkpoints under the output directory, and resuming from them.

An extractor actor folds many shards into one running statistics object and flushes it now
and then (``--checkpoint-interval``; always when the queue is drained); each flush becomes one
*checkpoint group*, written by the extractor itself where its node reaches the run (object
storage, or a local path every extractor's node sees), else by the driver (below).
Layout under ``OUT``::

    run.json                               fingerprint of what determines the result + plan
    groups/<group_id>.safetensors          the group's merged statistics (written first)
    groups/<group_id>.sample.safetensors   its merged activation sample (when sampling is on)
    groups/<group_id>.json                 the shard ids it covers, their summed counts and
                                           the digest of each of its files; written last, so
                                           its presence marks every one of those shards done
    reducers/plan.json, reducers/reducer-<r>.json, reducers/reducer-<r>.<n>.*.safetensors
                                           with ``--reducers``: the partition plan, and each
                                           reducer's partition after the groups it names
                                           (:class:`~embgeom_ray.distributed.reducers.Reducer`)

Every file is written atomically. ``group_id`` is ``<first shard id>-n<number of shards>``:
completed groups cover disjoint shards, so their ids never collide; a group redone after a
crash overwrites, or is cleaned of, the files of a half-written one (statistics without its
JSON), which are never read.

A group's JSON is written by the driver alone, and only once every other file of the group is
written: by the driver itself after it has received a whole flush, or, where the extractors
write their own flushes (``sizing.checkpoints.decide_writers``), by the extractor,
which hands the driver the files' names and digests (:meth:`CheckpointStore.write_group_files`,
:meth:`CheckpointStore.commit_group`). So the driver alone decides what is done, and a shard is
merged exactly once: the done shards are the union of the
completed groups' shard ids, and the reduce checks that the groups cover the plan exactly once
and merges them in group-id order. A rerun of the same command finds ``run.json`` with the
same fingerprint, reuses the saved plan and skips the done shards. A run with another
fingerprint refuses to mix with them. ``--checkpoint-interval`` is not part of the
fingerprint: a resume may group shards differently. Once the run is complete the groups are
removed (:meth:`CheckpointStore.remove_groups`; ``--keep-checkpoints`` keeps them): the run's
own ``statistics.safetensors`` and ``samples.parquet`` hold the same information.

Every file of a group has its digest in the group's JSON (:mod:`embgeom_ray.integrity`), and
every read of it (the reduce, the reducers, the sample's layers) is checked against it. A
group whose bytes do not match is *corrupt*: :meth:`CheckpointStore.discard_group` removes it
(its JSON first, so its shards are no longer done) and the reducers' checkpoints that read
it, and the run redoes its shards (:func:`~embgeom_ray.runs.pipeline.analyze`). Groups
written before digests existed have none and are read unchecked.

The JSON files here carry their own digest (:func:`~embgeom_ray.integrity.seal`): a group's
JSON whose content does not match (a flipped digit in a shard id or a count parses) is
discarded on resume with the group's files, and its shards redone
(:meth:`CheckpointStore.discard_incomplete`, :attr:`CheckpointStore.corrupt`); a corrupt
``run.json`` is refused (it holds the plan).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np

from ..core.samples import ActivationSample
from ..core.statistics import EmbeddingStatistics
from ..core.statistics_io import BYTES_LIKE
from ..counts import Counts
from ..errors import IntegrityError, OutputError
from ..inputs.corpus import ShardPlan
from ..integrity import Digest, FileRef, digests_from_json, digests_json, seal, unseal
from ..io_utils import (
    atomic_write_blocks,
    atomic_write_bytes,
    atomic_write_json,
    exists,
    is_local,
    join,
    local_path,
    read_bytes,
)
from ..run_dir import GROUPS, MANIFEST, REDUCERS, RUN_JSON, RunDir
from ..shared_out import remove_marker, write_marker

#: the reducer actors' partition plan, in :data:`~embgeom_ray.run_dir.REDUCERS`
REDUCER_PLAN = "plan.json"
GROUP_FORMAT = "embgeom-checkpoint-group/1"
STATS_SUFFIX, SAMPLE_SUFFIX, DONE_SUFFIX = ".safetensors", ".sample.safetensors", ".json"


@dataclass(frozen=True)
class CheckpointGroup:
    """A completed checkpoint: the statistics of ``shard_ids`` merged, and their counts."""

    group_id: str
    shard_ids: tuple[str, ...]
    counts: Counts
    #: statistics files: the extractor's pieces of these shards (spilled under
    #: ``--worker-memory``), merged in order
    parts: int = 1
    #: file name -> the digest of its bytes, recorded when the group was written (empty for
    #: groups of versions before digests)
    digests: Mapping[str, Digest] = field(default_factory=dict)

    def file_names(self) -> list[str]:
        """The group's statistics pieces in fold order, then its sample (which a run without
        a sample does not write)."""
        return [piece_name(self.group_id, i) for i in range(self.parts)] + [
            self.group_id + SAMPLE_SUFFIX
        ]


def group_id_for(shard_ids: Iterable[str]) -> str:
    """``<first shard id>-n<count>``: unique among completed groups (they are disjoint)."""
    ids = sorted(shard_ids)
    if not ids:
        raise ValueError("a checkpoint group covers at least one shard")
    return f"{ids[0]}-n{len(ids)}"


#: the mark of a group's further statistics files: ``<group>.part-<i>.safetensors``
PART_MARK = ".part-"


def piece_name(group_id: str, index: int) -> str:
    """File name of a group's ``index``-th statistics piece (the first has no mark)."""
    return group_id + (f"{PART_MARK}{index}" if index else "") + STATS_SUFFIX


def _stem(name: str) -> str | None:
    """The group id of a checkpoint file name; None for anything else (temporary files, …)."""
    if name.startswith("."):
        return None
    for suffix in (SAMPLE_SUFFIX, STATS_SUFFIX, DONE_SUFFIX):
        if name.endswith(suffix):
            return name[: -len(suffix)].split(PART_MARK)[0]
    return None


class CheckpointStore:
    def __init__(self, out: str) -> None:
        self.out = out.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.out)
        #: one line for each completed group found corrupt and discarded on resume
        #: (:meth:`discard_incomplete`), for the run to print
        self.corrupt: list[str] = []

    def _path(self, *parts: str) -> str:
        return join(self.out, *parts)

    def absolute_out(self) -> str:
        """The run's location as any process reads it: a local path made absolute (an
        extractor's working directory is not the driver's), a URL as it is."""
        return self.out if not is_local(self.out) else os.path.abspath(local_path(self.out))

    def write_marker(self) -> dict[str, str]:
        """A new marker in ``groups/`` for each extractor to check that its node sees this
        local run (:func:`~embgeom_ray.shared_out.write_marker`); a dot-file, never a group's,
        cleaned with the half-written groups if the job dies before :meth:`remove_marker`."""
        return write_marker(join(self.absolute_out(), GROUPS))

    def remove_marker(self, marker: dict[str, str]) -> None:
        remove_marker(marker)

    def check_writable(self) -> None:
        try:
            self.fs.makedirs(self.root, exist_ok=True)
            probe = self._path(".write-probe")
            atomic_write_bytes(probe, b"ok")
            self.fs.rm(join(self.root, ".write-probe"))
        except OSError as exc:
            raise OutputError(f"cannot write to the output directory {self.out}: {exc}") from None

    def load_run(self) -> dict[str, Any] | None:
        """``run.json``, or None; a corrupt one is refused (:class:`OutputError`)."""
        if not exists(self._path(RUN_JSON)):
            return None
        try:
            return self._read_json(RUN_JSON)
        except IntegrityError as exc:
            raise OutputError(f"{exc}; pass --overwrite to start over") from None

    def start(
        self, fingerprint: str, identity: dict[str, Any], plan: ShardPlan, overwrite: bool
    ) -> tuple[ShardPlan, bool]:
        """Open the store for this run: (plan to use, whether this resumes an earlier run).

        On resume, the files of half-written groups are removed. Checkpoints without a
        ``run.json`` are refused: nothing says what they measured.
        """
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
            self.discard_incomplete()
            return ShardPlan.from_json(previous["plan"]), True
        if overwrite:
            self.clear()
        elif self._names(GROUPS):
            raise OutputError(
                f"{self.out} holds checkpoints but no run.json saying what they measured; "
                "pass --overwrite to discard them, or choose another --out"
            )
        elif exists(self._path(MANIFEST)):  # a merge's, or a run whose run.json is gone
            raise OutputError(
                f"{self.out} already holds a run (manifest.json) that is not this one; pass "
                "--overwrite to replace it, or choose another --out"
            )
        atomic_write_json(
            self._path(RUN_JSON),
            seal({"fingerprint": fingerprint, "identity": identity, "plan": plan.to_json()}),
        )
        return plan, False

    def clear(self) -> None:
        """Remove what an earlier run left in the output directory (``--overwrite``), and
        nothing of the user's (:meth:`~embgeom_ray.run_dir.RunDir.clear`)."""
        RunDir(self.out).clear()

    def _names(self, directory: str) -> list[str]:
        base = join(self.root, directory)
        if not self.fs.exists(base):
            return []
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(base, detail=False)]

    def discard_incomplete(self) -> list[str]:
        """Remove the files of groups without their JSON, and temporary files; returns them.
        A group whose JSON does not parse or does not match its digest is one of them (its
        JSON too), with the reducer checkpoints that read its files (as :meth:`discard_group`),
        and a line saying so is added to :attr:`corrupt`."""
        names = self._names(GROUPS)
        done = {n[: -len(DONE_SUFFIX)] for n in names if n.endswith(DONE_SUFFIX)}
        for group_id in sorted(done):
            path = self._path(GROUPS, group_id + DONE_SUFFIX)
            try:  # a store that fails here is raised: a group is discarded only when corrupt
                unseal(json.loads(read_bytes(path)), path)
                continue
            except IntegrityError as exc:
                why = exc.detail
            except ValueError:
                why = "it is not valid JSON"
            done.discard(group_id)  # its JSON and files are stale: removed below
            self._discard_reducers_reading(
                {self._path(GROUPS, n) for n in names if _stem(n) == group_id}
            )
            self.corrupt.append(
                f"checkpoint group {group_id} is corrupt ({group_id}{DONE_SUFFIX}: {why}); its "
                "shards are redone"
            )
        stale = [n for n in names if _stem(n) not in done]
        for name in stale:
            self.fs.rm(join(self.root, GROUPS, name))
        return stale

    # ------------------------------------------------------------------ reading
    def _read_json(self, *parts: str) -> dict[str, Any]:
        """A JSON file of the store (``run.json``, a group's counts)."""
        path = self._path(*parts)
        try:
            doc = json.loads(read_bytes(path))
        except (OSError, ValueError) as exc:
            raise OutputError(
                f"{path} is unreadable ({exc}); use --overwrite to start over"
            ) from None
        return unseal(doc, path)

    def completed_groups(self) -> list[CheckpointGroup]:
        """Every completed group, in group-id order."""
        groups = []
        for name in self._names(GROUPS):
            if name.endswith(DONE_SUFFIX) and not name.startswith("."):
                d = self._read_json(GROUPS, name)
                groups.append(
                    CheckpointGroup(
                        name[: -len(DONE_SUFFIX)],
                        tuple(d["shards"]),
                        Counts.from_json(d["counts"]),
                        int(d.get("parts", 1)),
                        digests_from_json(d.get("digests")),
                    )
                )
        return sorted(groups, key=lambda g: (g.shard_ids[0], g.group_id))

    def done_shards(self) -> set[str]:
        """The shards of every completed group."""
        return {s for g in self.completed_groups() for s in g.shard_ids}

    def groups_covering(self, shard_ids: Iterable[str]) -> list[CheckpointGroup]:
        """The completed groups, checked to cover ``shard_ids`` each exactly once."""
        wanted = set(shard_ids)
        groups = self.completed_groups()
        seen: dict[str, str] = {}
        for g in groups:
            for s in g.shard_ids:
                if s in seen or s not in wanted:
                    why = f"in groups {seen[s]} and {g.group_id}" if s in seen else "not planned"
                    raise OutputError(
                        f"the checkpoints in {self.out} are inconsistent (shard {s} {why}); "
                        "use --overwrite to start over"
                    )
                seen[s] = g.group_id
        missing = sorted(wanted - set(seen))
        if missing:
            raise OutputError(
                f"{len(missing)} shard(s) have no checkpoint in {self.out} (first: {missing[0]})"
            )
        return groups

    def _ref(self, group: CheckpointGroup, name: str) -> FileRef:
        return FileRef(self._path(GROUPS, name), group.digests.get(name))

    def group_urls(self, group: CheckpointGroup) -> list[FileRef]:
        """Where ``group``'s statistics pieces are, in fold order, each with its digest (read
        by the reducer actors themselves)."""
        return [self._ref(group, piece_name(group.group_id, i)) for i in range(group.parts)]

    def sample_url(self, group: CheckpointGroup) -> FileRef:
        """Where ``group``'s merged sample is, with its digest (read a layer at a time at the
        finish: :func:`~embgeom_ray.core.sample_layers.sample_layers`)."""
        return self._ref(group, group.group_id + SAMPLE_SUFFIX)

    def group_of(self, url: str) -> CheckpointGroup | None:
        """The completed group that ``url`` is a file of; None for any other file."""
        prefix = self._path(GROUPS) + "/"
        if not str(url).startswith(prefix):
            return None
        stem = _stem(str(url)[len(prefix) :])
        return next((g for g in self.completed_groups() if g.group_id == stem), None)

    def discard_group(self, group: CheckpointGroup) -> None:
        """Remove a corrupt ``group``: its JSON first (its shards are then not done), then its
        files, and every reducer checkpoint that read any of them (that partition is read
        again from the groups)."""
        self.fs.rm(join(self.root, GROUPS, group.group_id + DONE_SUFFIX))
        urls = {self._path(GROUPS, name) for name in group.file_names()}
        for name in group.file_names():
            path = join(self.root, GROUPS, name)
            if self.fs.exists(path):
                self.fs.rm(path)
        self._discard_reducers_reading(urls)

    def _discard_reducers_reading(self, urls: set[str]) -> None:
        """Remove every reducer checkpoint that read any of ``urls`` (or that cannot say)."""
        for name in self._names(REDUCERS):
            if not (name.startswith("reducer-") and name.endswith(".json")):
                continue
            try:
                record = self._read_json(REDUCERS, name)
            except (OutputError, IntegrityError):
                record = {"applied": list(urls)}
            if urls & set(record.get("applied", [])):
                self.fs.rm(join(self.root, REDUCERS, name))
                for part in record.get("files", {}).values():
                    path = join(self.root, REDUCERS, part)
                    if self.fs.exists(path):
                        self.fs.rm(path)

    def load_sample(self, group: CheckpointGroup) -> ActivationSample:
        return ActivationSample.load(self.sample_url(group))

    def load_group(
        self, group: CheckpointGroup, with_sample: bool
    ) -> tuple[EmbeddingStatistics, ActivationSample | None]:
        """``group``'s statistics (its pieces merged in order) and sample, each file checked
        against its digest (:class:`~embgeom_ray.errors.IntegrityError`)."""
        refs = self.group_urls(group)
        stats = EmbeddingStatistics.load(refs[0])
        for ref in refs[1:]:
            stats.merge(EmbeddingStatistics.load(ref))
        return stats, self.load_sample(group) if with_sample else None

    def remove_groups(self) -> None:
        """Remove every checkpoint group and the reducers' checkpoints (once the run's own
        artefacts are written)."""
        for directory in (GROUPS, REDUCERS):
            base = join(self.root, directory)
            if self.fs.exists(base):
                self.fs.rm(base, recursive=True)

    # ------------------------------------------------------------------ reducers
    def reducer_dir(self) -> str:
        """Where the reducer actors (``--reducers``) checkpoint their partitions."""
        return self._path(REDUCERS)

    def reducer_plan(self) -> dict[str, Any] | None:
        """The partition plan the reducers' checkpoints were made with, if any."""
        path = self._path(REDUCERS, REDUCER_PLAN)
        return self._read_json(REDUCERS, REDUCER_PLAN) if exists(path) else None

    def save_reducer_plan(self, plan: dict[str, Any]) -> None:
        atomic_write_json(self._path(REDUCERS, REDUCER_PLAN), seal(plan))

    # ------------------------------------------------------------------ writing
    def save_group(
        self,
        shard_ids: Iterable[str],
        stats_pieces: bytes | Iterable[Any],
        sample_bytes: bytes | np.ndarray | None,
        counts: Counts,
    ) -> CheckpointGroup:
        """Statistics (one piece, or the pieces an extractor spilled, each written as it
        comes), then sample, then the JSON that marks all of ``shard_ids`` done
        (:meth:`write_group_files`, then :meth:`commit_group`)."""
        files = self.write_group_files(shard_ids, stats_pieces, sample_bytes)
        return self.commit_group(files, counts)

    def write_group_files(
        self,
        shard_ids: Iterable[str],
        stats_pieces: bytes | Iterable[Any],
        sample_bytes: bytes | np.ndarray | None,
    ) -> GroupFiles:
        """A group's statistics pieces (bytes, or files made a block at a time:
        :data:`~embgeom_ray.core.statistics_io.BYTES_LIKE`) and sample, each written atomically
        with its digest,
        but not its JSON: the shards are not done until :meth:`commit_group` (in the job's own
        process, the one that decides what is done). An extractor writing its own flush
        (:data:`~embgeom_ray.sizing.checkpoints.EXTRACTORS`) calls this, the driver the
        commit."""
        ids = tuple(sorted(shard_ids))
        group_id = group_id_for(ids)
        single = isinstance(stats_pieces, BYTES_LIKE) or hasattr(stats_pieces, "size")
        pieces = [stats_pieces] if single else stats_pieces
        parts = 0
        digests: dict[str, Digest] = {}
        for data in pieces:
            name = piece_name(group_id, parts)
            if isinstance(data, BYTES_LIKE):
                atomic_write_bytes(self._path(GROUPS, name), data)
                digests[name] = Digest.of(data)
            else:  # a file made a block at a time (``size``; iterating gives its blocks)
                made: list[Digest] = []
                blocks = Digest.of_stream(data.size, data, made)
                atomic_write_blocks(self._path(GROUPS, name), blocks, data.size)
                digests[name] = made[0]
            parts += 1
            del data  # before the next piece is fetched
        if parts == 0:
            raise ValueError("a checkpoint group holds at least one statistics piece")
        if sample_bytes is not None:
            name = group_id + SAMPLE_SUFFIX
            atomic_write_bytes(self._path(GROUPS, name), sample_bytes)
            digests[name] = Digest.of(sample_bytes)
        return GroupFiles(ids, parts, digests)

    def commit_group(self, files: GroupFiles, counts: Counts) -> CheckpointGroup:
        """Write the JSON that marks every shard of ``files`` done (their files written)."""
        group = CheckpointGroup(
            group_id_for(files.shard_ids), files.shard_ids, counts, files.parts, files.digests
        )
        atomic_write_json(
            self._path(GROUPS, group.group_id + DONE_SUFFIX),
            seal({
                "format": GROUP_FORMAT,
                "group": group.group_id,
                "shards": list(group.shard_ids),
                "counts": counts.to_json(),
                "parts": files.parts,
                "digests": digests_json(dict(files.digests)),
            }),
        )  # fmt: skip
        return group


@dataclass(frozen=True)
class GroupFiles:
    """A checkpoint group's files as written (:meth:`CheckpointStore.write_group_files`), not
    yet committed: its shards, statistics pieces and each file's digest."""

    shard_ids: tuple[str, ...]
    parts: int
    digests: Mapping[str, Digest]

    @property
    def nbytes(self) -> int:
        """The bytes of its files."""
        return sum(d.size for d in self.digests.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "shards": list(self.shard_ids),
            "parts": self.parts,
            "digests": digests_json(dict(self.digests)),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GroupFiles:
        return cls(tuple(data["shards"]), int(data["parts"]), digests_from_json(data["digests"]))


def write_group(
    out: str,
    shard_ids: Iterable[str],
    stats_pieces: Iterable[bytes | np.ndarray],
    sample_bytes: bytes | np.ndarray | None,
) -> dict[str, Any]:
    """An extractor's own write of its flush to the run at ``out`` (a URL, or an absolute
    local path its node sees): the group's files (:meth:`CheckpointStore.write_group_files`),
    returned as :meth:`GroupFiles.to_json` for the driver to commit. Bound to ``out`` by the driver and
    sent with each flush, so that the Ray layer needs nothing of this module."""
    return CheckpointStore(out).write_group_files(shard_ids, stats_pieces, sample_bytes).to_json()


def _describe_differences(old: dict[str, Any], new: dict[str, Any]) -> str:
    """The keys of two runs' identities that differ, those of a nested dict (the result
    options) by their own names: "differs in: corpus, max_length"."""

    def changed(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
        out = []
        for key in sorted(set(a) | set(b)):
            x, y = a.get(key), b.get(key)
            if x != y:
                nested = isinstance(x, dict) and isinstance(y, dict)
                out.extend(changed(x, y) if nested else [key])
        return out

    keys = list(dict.fromkeys(changed(old, new)))  # layers: in the options and on their own
    return "differs in: " + ", ".join(keys) if keys else ""
