"""Reducer actors: the run's statistics partitioned by token id and by layer (``--reducers R``).

With R reducers, reducer r owns the per-type rows of the token ids in its range for every
measured layer — R ranges that each hold the same number of the token types the run saw
(:meth:`PartitionPlan.balanced`, from the groups' id lists; the last range open) — and the
per-layer state (n, μ, co-moment, tails, positions) of the layers
``layers[r], layers[r + R], …``. Each reducer reads its part of every checkpoint group of
the run, in group-id order, and only those bytes
(:meth:`~embgeom_ray.core.statistics.EmbeddingStatistics.load_part`), and merges it (Chan's update,
row by row), so its part equals the same part of the unpartitioned merge exactly. The driver
never holds a per-type table nor a layer's d × d state: per layer it asks the layer's owner
for its mean, every reducer for the :class:`~embgeom_ray.core.tables.TypeSummary` of its range
(O(d) sums and its ``type_stats`` rows), and the owner for the layer's analysis with the merged
sums (:func:`~embgeom_ray.core.tables.analyse_layer`: its rows of ``layers`` and ``dims``, its
position profile), and builds the tables with
:func:`~embgeom_ray.core.tables.build_tables_from`. Each reducer writes its parts as files of
the partitioned artefact (:mod:`embgeom_ray.run_dir`).

Memory: reducer r holds the per-type rows of its range (⌈V_seen / R⌉ types, the ranges cut
at the quantiles of the ids seen) in every measured layer and the per-layer state of its
⌈L / R⌉ layers, plus its part of one group being read (or one layer's analysis); the driver
the O(d + P) answers and one layer's ``type_stats`` rows. The formulas, and how many reducers of how
much memory a run gets, are :mod:`embgeom_ray.sizing`'s (:func:`~embgeom_ray.sizing.reducer_budget`).

The job starts reducers while the extractors run (:func:`start_reducers`, without a plan), as
many as fit beside them, so the reduce does not wait for R processes to start and import;
each gets the plan (:meth:`Reducer.configure`), cut from the ids seen, before it reads
anything. They are stopped as soon as the run has all it needs of them: the exact tables, the
statistics artefact and what the manifest records of them (:meth:`PartitionedStatistics.close`
in :func:`~embgeom_ray.runs.finish.finish_run`, before the sampled stage, which gets their Ray
memory: ``close(wait=True)`` waits until Ray's view of the nodes has it back, or 1 s after
they are gone; an error's ``close()`` does not wait).

Faults: a reducer's part is a pure function of the group files, which stay on disk until the
run is complete, and a group is applied once (keyed by its URL). Every source comes with the
digest recorded when it was written (:class:`~embgeom_ray.integrity.FileRef`), and every
byte a reducer reads of it is checked (:class:`~embgeom_ray.errors.IntegrityError`, raised to
the driver, which redoes a corrupt group's shards); a reducer's own checkpoint records its
files' digests, and one that does not match is dropped (the groups are read again). In a run, each reducer
checkpoints its partition under ``OUT/reducers/`` whenever ``--checkpoint-interval`` seconds
have passed while it reads groups (with the plan, kept in ``reducers/plan.json`` for the run,
and the groups it covers). A reducer lost at any point (``RayActorError``) is started again,
reads its checkpoint and only the groups after it; so do the reducers of a resumed driver
(after a fault in the sampled stage too: the groups and the reducers' checkpoints stay until the
run is complete; the reducers then hold nothing that is not on disk). The tables are the same
(tested by killing one mid-run, and by resuming after the reduce).

The same reducers merge complete runs partition by partition (``jobs.merge --reducers R``):
their sources are then the runs' artefacts, whole files or ``statistics/`` directories cut
into any other partitions (:func:`~embgeom_ray.run_dir.load_statistics_part`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import ray

from .. import progress
from ..core.options import TableOptions
from ..core.partials import TypePartials
from ..core.rogue import OutlierRules, position_columns
from ..core.statistics import EmbeddingStatistics, LayerMoments
from ..core.tables import (
    LayerAnalysis,
    LayerStates,
    TypeSummary,
    analyse_layer,
    build_tables_from,
    summarise_types,
)
from ..errors import ConfigError, IntegrityError, OutputError
from ..integrity import Digest, FileRef, as_ref, digests_from_json, digests_json, seal, unseal
from ..io_utils import atomic_write_bytes, atomic_write_json, exists, join, read_bytes, remove
from ..run_dir import PARTS_FORMAT, PARTS_INDEX, load_statistics_part, statistics_type_ids
from ..sizing import (
    REDUCER_BASE_BYTES,
    Cluster,
    Reduce,
    reducer_budget,
    reducer_bytes,
    reducers_for,
)
from .process_memory import peak_memory, sampler

#: how often one reducer is started again after it was lost, before the run fails
MAX_REDUCER_RESTARTS = 3

#: the memory formulas of a reducer live with every other process's (:mod:`embgeom_ray.sizing`)
__all__ = [
    "REDUCER_BASE_BYTES", "PartitionPlan", "PartitionedStatistics", "Reducer", "place_where_seen",
    "reducer_budget", "reducer_bytes", "reducers_for", "seen_type_ids", "start_reducers",
    "stop_reducers",
]  # fmt: skip


@dataclass(frozen=True)
class PartitionPlan:
    """Which token ids and which layers' per-layer state each reducer owns."""

    ranges: tuple[tuple[int, int | None], ...]
    state_layers: tuple[tuple[int, ...], ...]
    layers: tuple[int, ...]

    @classmethod
    def of(cls, reducers: int, vocab_size: int, layers: Sequence[int]) -> PartitionPlan:
        """R equal ranges of token ids over [0, V) (the last one open, so an id beyond the
        tokenizer's size still has an owner) and the layers dealt round-robin."""
        if reducers < 1:
            raise ValueError("reducers must be at least 1")
        width = max(1, math.ceil(vocab_size / reducers))
        bounds = [r * width for r in range(reducers)]
        ranges = tuple(
            (lo, bounds[r + 1] if r + 1 < reducers else None) for r, lo in enumerate(bounds)
        )
        layers = tuple(int(x) for x in layers)
        return cls(ranges, tuple(layers[r::reducers] for r in range(reducers)), layers)

    @classmethod
    def balanced(cls, reducers: int, seen: np.ndarray, layers: Sequence[int]) -> PartitionPlan:
        """R ranges holding (within one) the same number of the token ids ``seen`` (the
        increasing ids the run's statistics hold), so every reducer holds about V_seen / R
        types whichever ids are frequent; the layers dealt round-robin. With fewer seen ids
        than reducers, the even plan over [0, max id]."""
        if reducers < 1:
            raise ValueError("reducers must be at least 1")
        seen = np.asarray(seen)
        if len(seen) < reducers:
            return cls.of(reducers, int(seen[-1]) + 1 if len(seen) else 1, layers)
        cuts = [int(seen[math.ceil(r * len(seen) / reducers)]) for r in range(1, reducers)]
        bounds = [0, *cuts]
        ranges = tuple(
            (lo, bounds[r + 1] if r + 1 < reducers else None) for r, lo in enumerate(bounds)
        )
        layers = tuple(int(x) for x in layers)
        return cls(ranges, tuple(layers[r::reducers] for r in range(reducers)), layers)

    @property
    def reducers(self) -> int:
        return len(self.ranges)

    def to_json(self) -> dict[str, Any]:
        return {
            "layers": list(self.layers),
            "ranges": [list(r) for r in self.ranges],
            "state_layers": [list(s) for s in self.state_layers],
        }

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> PartitionPlan:
        return cls(
            tuple((int(lo), None if hi is None else int(hi)) for lo, hi in record["ranges"]),
            tuple(tuple(int(x) for x in s) for s in record["state_layers"]),
            tuple(int(x) for x in record["layers"]),
        )

    def owner(self, layer: int) -> int:
        """The reducer that holds ``layer``'s per-layer state."""
        return next(r for r, held in enumerate(self.state_layers) if layer in held)


def check_memory_offered(memory: int) -> None:
    """Refuse a per-reducer memory request that no live node offers (the actors would wait
    for such a node forever)."""
    offered = [int(n["Resources"].get("memory", 0)) for n in ray.nodes() if n.get("Alive")]
    if offered and memory > max(offered):
        raise ConfigError(
            f"--reducer-memory {memory:,} bytes is more than any node of the cluster offers "
            f"Ray's actors ({max(offered):,} bytes on the largest); give less, or add nodes "
            "with more memory"
        )


def seen_type_ids(sources: Sequence[str | FileRef]) -> np.ndarray:
    """The increasing token ids any of ``sources`` holds rows for (8 bytes each; the ids
    alone are read where the files are local): what :meth:`PartitionPlan.balanced` cuts."""
    seen = np.zeros(0, dtype=np.int64)
    for url in sources:
        seen = np.union1d(seen, statistics_type_ids(url))
    return seen


class Reducer:
    """One partition of the run's statistics (module docstring); a Ray actor.

    With a ``checkpoint_dir``, the reducer writes its partition there whenever
    ``checkpoint_seconds`` have passed since its last checkpoint (or its start) while
    loading, with the sources it covers; a reducer started again (after a loss, or by a
    resumed driver with the same plan) reads its checkpoint and merges only the sources it
    does not cover. A source is applied once, keyed by its URL.
    """

    def __init__(
        self,
        index: int,
        plan: PartitionPlan | None = None,
        checkpoint_dir: str | None = None,
        checkpoint_seconds: float = math.inf,
    ) -> None:
        sampler()  # this process's peak private memory, sampled from now on
        self.index = index
        self.rows: EmbeddingStatistics | None = None
        self.state: EmbeddingStatistics | None = None
        self.applied: list[str] = []
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_seconds = checkpoint_seconds
        if plan is not None:
            self.configure(plan)

    def configure(self, plan: PartitionPlan) -> None:
        """Own reducer ``index``'s part of ``plan`` (a reducer started before the plan was
        known, :func:`start_reducers`, gets it here, before it reads anything)."""
        if self.applied:
            raise ValueError(f"reducer {self.index} has read sources: its plan is fixed")
        self.plan = plan
        self.token_range = plan.ranges[self.index]
        self.layers = list(plan.layers)
        self.state_layers = list(plan.state_layers[self.index])

    def _merge(self, source: FileRef) -> None:
        rows = load_statistics_part(source, self.layers, self.token_range, layer_state=False)
        state = load_statistics_part(source, self.state_layers, (0, 0)) if self.state_layers else None
        # both read (and checked) before either is merged: a corrupt source leaves none of it
        self.rows = rows if self.rows is None else self.rows.merge(rows)
        if state is not None:
            self.state = state if self.state is None else self.state.merge(state)
        self.applied.append(source.url)

    def load(self, sources: Sequence[str | FileRef]) -> dict[str, Any]:
        """Merge this partition of every source (a checkpoint group's statistics file, or a
        run's artefact: :func:`~embgeom_ray.run_dir.load_statistics_part`) not yet applied,
        in the order given (after this reducer's checkpoint, if it has one); the types held,
        the sources restored from the checkpoint and those read (and ``"dropped"``: why a
        checkpoint that did not match its digests was not used, else None)."""
        refs = [as_ref(s) for s in sources]
        restored, dropped = self._restore(refs) if not self.applied else (0, None)
        done = set(self.applied)
        todo = [ref for ref in refs if ref.url not in done]
        last = time.monotonic()
        for ref in todo:
            self._merge(ref)
            if self.checkpoint_dir and time.monotonic() - last >= self.checkpoint_seconds:
                self.checkpoint()
                last = time.monotonic()
        types = 0 if self.rows is None else self.rows.num_types
        return {"types": types, "restored": restored, "read": len(todo), "dropped": dropped}

    # ---------------------------------------------------------------- checkpoints
    def _checkpoint_name(self) -> str:
        return join(self.checkpoint_dir or "", f"reducer-{self.index:04d}.json")

    def checkpoint(self) -> str:
        """Write this partition and the sources it covers: the parts under new names first,
        then the JSON naming them (atomically: a reader sees the old checkpoint or the new
        one), then the old parts are removed. The JSON's URL."""
        if self.checkpoint_dir is None:
            raise ValueError("this reducer has no checkpoint directory")
        previous = self._read_checkpoint()
        stamp = f"{self.index:04d}.{len(self.applied)}"
        files, digests = {}, {}
        for kind, part in (("rows", self.rows), ("state", self.state)):
            if part is not None:
                files[kind] = f"reducer-{stamp}.{kind}.safetensors"
                digests[files[kind]] = part.save(join(self.checkpoint_dir, files[kind]))
        record = {
            "plan": self.plan.to_json(), "applied": self.applied, "files": files,
            "digests": digests_json(digests),
        }  # fmt: skip
        atomic_write_json(self._checkpoint_name(), seal(record))
        for name in (previous or {}).get("files", {}).values():
            if name not in files.values():
                remove(join(self.checkpoint_dir, name))
        return self._checkpoint_name()

    def _read_checkpoint(self, corrupt: list[str] | None = None) -> dict[str, Any] | None:
        """This reducer's checkpoint JSON; None without a readable one (``corrupt`` gets why,
        for one whose content does not match its digest)."""
        if self.checkpoint_dir is None or not exists(self._checkpoint_name()):
            return None
        try:
            return unseal(json.loads(read_bytes(self._checkpoint_name())), self._checkpoint_name())
        except (OSError, ValueError):
            return None
        except IntegrityError as exc:
            if corrupt is not None:
                corrupt.append(str(exc))
            return None

    def _restore(self, sources: Sequence[FileRef]) -> tuple[int, str | None]:
        """Read this reducer's checkpoint if it is of this plan and covers only ``sources``;
        the number of sources it covers (0 without a usable checkpoint), and, for a
        checkpoint whose files do not match their digests (it is then removed and not used),
        what did not match."""
        corrupt: list[str] = []
        record = self._read_checkpoint(corrupt)
        if corrupt:
            remove(self._checkpoint_name())
            return 0, corrupt[0]
        if (
            record is None
            or record.get("plan") != self.plan.to_json()
            or not set(record["applied"]) <= {s.url for s in sources}
        ):
            return 0, None
        files, digests = record["files"], digests_from_json(record.get("digests"))
        parts: dict[str, EmbeddingStatistics] = {}
        try:
            for kind in ("rows", "state"):
                if kind in files:
                    url = join(self.checkpoint_dir or "", files[kind])
                    parts[kind] = EmbeddingStatistics.load(FileRef(url, digests.get(files[kind])))
        except IntegrityError as exc:
            remove(self._checkpoint_name())
            return 0, str(exc)
        self.rows, self.state = parts.get("rows"), parts.get("state")
        self.applied = list(record["applied"])
        return len(self.applied), None

    def layer_state(self, layer: int) -> LayerMoments:
        if self.state is None or layer not in self.state_layers:
            raise ValueError(f"reducer {self.index} does not hold layer {layer}'s state")
        return self.state.layer(layer)

    def layer_counts(self, layer: int) -> tuple[int, int]:
        """(tokens, non-finite tokens) of ``layer``, which this reducer owns."""
        state = self.layer_state(layer)
        return int(state.n), int(state.nonfinite)

    def layer_mean(self, layer: int) -> np.ndarray:
        return self.layer_state(layer).mean

    def analyse_layer(self, layer: int, types: TypePartials, rules: OutlierRules) -> LayerAnalysis:
        """:func:`~embgeom_ray.core.tables.analyse_layer` of ``layer``'s state, here: the
        driver gets O(d + P), not the d × d co-moment."""
        return analyse_layer(self.layer_state(layer), types, rules)

    def position_columns(self, layer: int, dims: list[int]) -> np.ndarray:
        state = self.layer_state(layer)
        return position_columns(state.position_counts, state.position_means, dims)

    def summarise(self, layer: int, layer_mean: np.ndarray, min_count: int) -> TypeSummary:
        if self.rows is None:
            raise ValueError(f"reducer {self.index} has no statistics (load groups first)")
        return summarise_types(self.rows, layer, layer_mean, min_count)

    def peak_memory(self) -> dict[str, int | None]:
        return peak_memory()

    def node(self) -> str:
        """The Ray node this reducer runs on."""
        return ray.get_runtime_context().get_node_id()

    def held(self) -> tuple[str, float]:
        """(this reducer's node, the Ray memory it holds there)."""
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), float(ctx.get_assigned_resources().get("memory", 0.0))

    def save(self, directory: str) -> dict[str, dict[str, Any]]:
        """Write this reducer's parts into ``directory``; their file names, each with its
        digest (:meth:`~embgeom_ray.integrity.Digest.to_json`)."""
        written = {}
        for kind, part in (("rows", self.rows), ("state", self.state)):
            if part is not None:
                name = f"{kind}-{self.index:04d}.safetensors"
                written[name] = part.save(join(directory, name)).to_json()
        return written


class PartitionedStatistics:
    """The driver's handle on R :class:`Reducer` actors holding one run's statistics.

    Offers what the finishing steps need from statistics without holding them
    (:class:`~embgeom_ray.runs.finish.RunStatistics`): :meth:`tables`, :meth:`token_count`,
    :meth:`nonfinite`, :meth:`save`, :meth:`describe`, :meth:`peak_memory`, :meth:`close`.
    """

    #: :meth:`~embgeom_ray.run_dir.RunDir.save_artefacts` writes the partitioned artefact
    partitioned = True

    def __init__(
        self,
        plan: PartitionPlan,
        group_urls: Sequence[str | FileRef],
        *,
        cpus: float = 0,
        memory: int | None = None,
        checkpoint_dir: str | None = None,
        checkpoint_seconds: float = math.inf,
        started: Sequence[Any] = (),
        nodes: Sequence[str] = (),
        pinned: bool = False,
    ) -> None:
        self.plan = plan
        self.group_urls = list(group_urls)
        self.cpus = cpus
        self.memory = memory  # bytes each reducer asks Ray for (``--reducer-memory``)
        #: the node each reducer is placed on (:func:`~embgeom_ray.sizing.place`; a
        #: preference: Ray places it elsewhere when that node is gone), or, ``pinned``, the
        #: one it must run on (:func:`place_where_seen`; when that node is gone, another
        #: of ``nodes`` still alive)
        self.nodes = list(nodes)
        self.pinned = pinned
        if memory:
            check_memory_offered(memory)
        self.checkpoint = (checkpoint_dir, checkpoint_seconds)
        self.restarts = [0] * plan.reducers
        self.closed = False
        #: per reducer: sources restored from its checkpoint, sources read (last load)
        self.restored = [0] * plan.reducers
        self.read = [0] * plan.reducers
        # reducers already started (:func:`start_reducers`, while the extractors ran) get the
        # plan; the others start now; any beyond R are not needed
        self.actors = list(started[: plan.reducers])
        for actor in self.actors:
            actor.configure.remote(plan)
        self.actors += [self._start(r) for r in range(len(self.actors), plan.reducers)]
        stop_reducers(started[plan.reducers :])
        self.prestarted = min(len(started), plan.reducers)
        loading: list[Any] = []
        try:
            loading = [a.load.remote(self.group_urls) for a in self.actors]
            for r, ref in enumerate(loading):
                self._loaded(r, self._get(r, ref, "load"))
        except BaseException:  # a corrupt source, a reducer lost too often: none is left running
            self.close()
            for ref in loading:  # the others' answers taken (an error left unread is logged)
                try:
                    ray.get(ref, timeout=30)
                except Exception:  # the first error is the one raised
                    pass
            raise

    def _loaded(self, r: int, result: Mapping[str, Any] | None) -> None:
        if result is not None:  # None: restored after a loss (recorded by _restore)
            self.restored[r], self.read[r] = result["restored"], result["read"]
            if result.get("dropped"):
                progress.notice(
                    f"reducer {r}: its checkpoint was not used ({result['dropped']}); it reads "
                    "the groups again"
                )

    @property
    def layers(self) -> list[int]:
        return list(self.plan.layers)

    def _start(self, r: int) -> Any:
        nodes = self.nodes[r : r + 1]
        if self.pinned and nodes:
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            nodes = [pinned_node(self.nodes, r, alive)]
        (actor,) = start_reducers(
            1, cpus=self.cpus, memory=self.memory, plan=self.plan, checkpoint=self.checkpoint,
            first=r, nodes=nodes, pinned=self.pinned,
        )  # fmt: skip
        return actor

    def _restore(self, r: int) -> None:
        """Start reducer r again and have it read its checkpoint (if any) and every group
        after it (again, if it is lost while reading), at most :data:`MAX_REDUCER_RESTARTS`
        times."""
        while True:
            self.restarts[r] += 1
            if self.restarts[r] > MAX_REDUCER_RESTARTS:
                raise OutputError(
                    f"reducer {r} was lost {self.restarts[r]} times; giving up (the checkpoint "
                    "groups are kept: rerun the same command to resume)"
                )
            self.actors[r] = self._start(r)
            try:
                self._loaded(r, ray.get(self.actors[r].load.remote(self.group_urls)))
                return
            except ray.exceptions.RayActorError:
                continue

    def _get(self, r: int, ref: Any, method: str, *args: Any) -> Any:
        """``ray.get(ref)`` of reducer r's ``method``; on a lost reducer, restore it and ask
        again (a restored reducer has read every group: a lost ``load`` is not repeated)."""
        self._check_open(method)
        while True:
            try:
                return ray.get(ref)
            except ray.exceptions.RayActorError:
                self._restore(r)
                if method == "load":
                    return None
                ref = getattr(self.actors[r], method).remote(*args)

    def _call(self, r: int, method: str, *args: Any) -> Any:
        self._check_open(method)
        return self._get(r, getattr(self.actors[r], method).remote(*args), method, *args)

    def _check_open(self, method: str) -> None:
        if self.closed:
            raise RuntimeError(f"the reducers were stopped (close()): no {method!r} to ask them")

    def layer_state(self, layer: int) -> LayerMoments:
        return self._call(self.plan.owner(layer), "layer_state", layer)

    def layer_states(self) -> Mapping[int, LayerMoments]:
        """Layer → its state, fetched when read (one layer's d² at a time in the driver)."""
        return _LazyStates(self)

    def states(self) -> LayerStates:
        """The layers' states where they live: each layer analysed by its owner
        (:class:`~embgeom_ray.core.tables.LayerStates`; the driver never holds a d × d state)."""
        return _OwnedStates(self)

    def summaries(self, layer: int, mean: np.ndarray, min_count: int) -> list[TypeSummary]:
        self._check_open("summaries")
        refs = [a.summarise.remote(layer, mean, min_count) for a in self.actors]
        return [
            self._get(r, ref, "summarise", layer, mean, min_count) for r, ref in enumerate(refs)
        ]

    def tables(
        self, tokenizer: Any, options: TableOptions, type_rows: Any = None
    ) -> dict[str, Any]:
        """Every exact table (:func:`~embgeom_ray.core.tables.build_tables_from`; ``type_rows``
        as there)."""
        return build_tables_from(
            self.states(),
            lambda layer, mean: self.summaries(layer, mean, options.min_count),
            tokenizer,
            options,
            type_rows,
        )

    def _on_owner(self, layer: int, method: str, *args: Any) -> Any:
        return self._call(self.plan.owner(layer), method, layer, *args)

    def nonfinite(self) -> dict[int, int]:
        return {layer: self._on_owner(layer, "layer_counts")[1] for layer in self.plan.layers}

    def token_count(self) -> int:
        """Tokens counted in the first measured layer (as ``EmbeddingStatistics``)."""
        return self._on_owner(self.plan.layers[0], "layer_counts")[0]

    def save(self, directory: str) -> Digest:
        """The partitioned artefact: every reducer's parts (written by the reducers at once),
        then the index naming them with their digests; the index's digest."""
        self._check_open("save")
        refs = [actor.save.remote(directory) for actor in self.actors]
        files = [self._get(r, ref, "save", directory) for r, ref in enumerate(refs)]
        index = {
            "format": PARTS_FORMAT,
            **self.plan.to_json(),
            "files": [name for names in files for name in names],
            "digests": {name: d for names in files for name, d in names.items()},
        }
        data = (json.dumps(index, indent=2) + "\n").encode()
        atomic_write_bytes(join(directory, PARTS_INDEX), data)
        return Digest.of(data)

    def describe(self) -> dict[str, Any]:
        """The manifest's ``reducers``: how the statistics were partitioned, restarts."""
        return {
            "count": self.plan.reducers,
            "token_ranges": [list(r) for r in self.plan.ranges],
            "state_layers": [list(s) for s in self.plan.state_layers],
            "memory_budget_bytes": self.memory,
            "nodes": [self._call(r, "node") for r in range(self.plan.reducers)],
            "restarts": list(self.restarts),
            "sources_restored_from_checkpoints": list(self.restored),
            "sources_read": list(self.read),
            "started_during_extraction": self.prestarted,
        }

    def peak_memory(self) -> list[dict[str, int | None]]:
        """Each reducer's peak resident and private memory so far (bytes; see
        :mod:`~embgeom_ray.distributed.process_memory`)."""
        self._check_open("peak_memory")
        refs = [actor.peak_memory.remote() for actor in self.actors]
        return [self._get(r, ref, "peak_memory") for r, ref in enumerate(refs)]

    def close(self, wait: bool = False) -> None:
        """Stop the reducers; with ``wait`` (before the sampled stage, which gets their
        memory), wait until Ray has their memory back (:func:`stop_reducers`): not on an
        error's or a SIGTERM's way out, where it would only delay the exit (``ray job stop``
        kills a job that has not ended a few seconds after its SIGTERM). Once closed, asking
        for anything they held is an error (not a reducer started again). Again: nothing
        more."""
        actors, self.actors, self.closed = self.actors, [], True
        stop_reducers(actors, STOP_WAIT_S if wait else 0.0)


_RemoteReducer = ray.remote(max_restarts=0)(Reducer)


def start_reducers(
    count: int,
    *,
    cpus: float = 0,
    memory: int | None = None,
    plan: PartitionPlan | None = None,
    checkpoint: tuple[str | None, float] = (None, math.inf),
    first: int = 0,
    nodes: Sequence[str] = (),
    pinned: bool = False,
) -> list[Any]:
    """Start reducer actors ``first .. first + count − 1`` (``num_cpus=cpus``, ``memory`` bytes
    each when given; the i-th on ``nodes[i]`` when given: a soft preference, or that node
    alone when ``pinned``, :func:`place_where_seen`). Without a
    ``plan`` they start their processes and imports now and get their plan later
    (:class:`PartitionedStatistics` ``started=``): the job starts reducers while the
    extractors run, so the reduce does not wait for R processes."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options: dict[str, Any] = {"num_cpus": cpus}
    if memory:
        options["memory"] = memory
    actors = []
    for i, r in enumerate(range(first, first + count)):
        where = {}
        if i < len(nodes):
            where["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                nodes[i], soft=not pinned
            )
        actors.append(_RemoteReducer.options(**options, **where).remote(r, plan, *checkpoint))
    return actors


def pinned_node(nodes: Sequence[str], r: int, alive: set[str]) -> str:
    """The node pinned reducer r starts on: its own, ``nodes[r]``, while it is alive, else the
    first of the others (nodes that see the run) still alive, else its own (Ray then fails
    the start, and the reducer counts as lost)."""
    return next((n for n in [nodes[r], *nodes] if n in alive), nodes[r])


def place_where_seen(
    reduce: Reduce,
    cluster: Cluster,
    resize: Callable[[Cluster], Reduce],
    out: str,
    write_marker: Callable[[], dict[str, str]],
    echo: Callable[[str], Any] = print,
    inputs: Sequence[dict[str, str]] = (),
) -> Reduce:
    """``reduce`` placed where its reducers see the local files they read and write.

    The reducers read the checkpoint groups (or runs' artefacts) and write their checkpoints
    and the artefact's parts in the run's directory ``out``; on a local path, a node that does
    not mount it (the driver's own disk) would fail there. So, for a partitioned reduce on a
    cluster of more than one node with ``out`` local, a marker is written there
    (``write_marker``: :func:`~embgeom_ray.shared_out.write_marker` in ``out``) and every
    other node checks that it reads it back, and the ``inputs`` read too (markers of
    :func:`~embgeom_ray.shared_out.file_marker`; :func:`~.node_tasks.nodes_not_seeing`); the
    marker is then removed. Where some node does not, the reduce is sized again by
    ``resize`` on the nodes that do, each reducer pinned to its node (``Reduce.pinned``), and
    ``echo`` says so in one line; a :class:`~embgeom_ray.errors.ConfigError` when they do not
    hold it. In object storage, or on one node, ``reduce`` as it is.
    """
    from ..shared_out import remove_marker
    from ..sizing.checkpoints import needs_check
    from .node_tasks import nodes_not_seeing

    if not reduce.partitioned or not needs_check(out) or len(cluster.nodes) < 2:
        return reduce
    marker = write_marker()
    try:
        hidden = nodes_not_seeing([marker, *inputs], [n.node_id for n in cluster.nodes])
    finally:
        remove_marker(marker)
    if not hidden:
        return reduce
    seeing = Cluster(tuple(n for n in cluster.nodes if n.node_id not in hidden))
    node, why = next(iter(hidden.items()))
    note = f"{len(hidden)} of {len(cluster.nodes)} nodes do not see {out} (node {node[:8]}: {why})"
    try:
        placed = resize(seeing)
    except ConfigError as exc:
        raise ConfigError(
            f"the reducers read and write {out}, and {note}; on the {len(seeing.nodes)} that "
            f"do: {exc}. Or give --out on a filesystem every node mounts, or in object storage"
        ) from None
    where = f"on the {len(seeing.nodes)} nodes that see {out} only: {note}"
    echo(f"reducers: {where}")
    return replace(placed, pinned=placed.partitioned, reason=f"{placed.reason}; {where}")


#: seconds :func:`stop_reducers` waits for Ray to see its reducers' memory back
STOP_WAIT_S = 30.0
#: seconds it waits for the reducers to say what they hold (idle ones answer in milliseconds)
HELD_ASK_S = 2.0
#: seconds it waits, once every reducer is gone, for the nodes' view to show their memory
#: back (10–100 ms measured); past them, memory another job took meanwhile is why it is not
SETTLED_S = 1.0


def stop_reducers(actors: Sequence[Any], wait_s: float = 0.0) -> None:
    """End reducer actors (e.g. started for a reduce that will not happen).

    With ``wait_s``, wait (that long at most) until Ray's view of each node's free memory
    (:func:`~embgeom_ray.distributed.sample_tasks.free_memory`) has the Ray memory they held
    back: ``ray.kill`` returns before the actor's process ends, and the nodes report their
    freed resources some 10–100 ms after Ray says the actor is dead; the sampled stage, which
    follows, sizes its tasks by the memory that view shows free. (Measured on a local Ray:
    memory still held when the stage started without this wait.) The view is the nodes' free
    memory, which other jobs' actors and tasks take and give back meanwhile: one taking some
    of a node's memory after it was read would hold the wait to its end (30 s, measured on a
    local Ray). So the wait also ends :data:`SETTLED_S` after every reducer is gone (a call
    to each has failed: Ray says it is dead), whatever the view says."""
    from .sample_tasks import free_memory

    held: dict[str, float] = {}
    if wait_s > 0 and actors:  # what each still holds, and where (a reducer lost holds nothing;
        # one busy, stopped on an error or SIGTERM mid-reduce, is not waited for)
        refs = [actor.held.remote() for actor in actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=min(wait_s, HELD_ASK_S))
        for ref in ready:
            try:
                node, memory = ray.get(ref)
            except ray.exceptions.RayActorError:
                continue
            held[node] = held.get(node, 0.0) + memory
    before = free_memory() if any(held.values()) else {}
    for actor in actors:
        ray.kill(actor)
    if not before:
        return
    alive = {actor.held.remote(): actor for actor in actors}  # a call fails once it is dead
    deadline, settled = time.monotonic() + wait_s, math.inf
    while time.monotonic() < min(deadline, settled):
        free = free_memory()  # a node gone, or not said: nothing to wait for there
        if all(free.get(n, math.inf) >= before.get(n, 0.0) + m for n, m in held.items()):
            break
        if alive:
            alive = _still_alive(alive)
            settled = time.monotonic() + SETTLED_S if not alive else math.inf
        time.sleep(0.02)


def _still_alive(calls: dict[Any, Any]) -> dict[Any, Any]:
    """``calls`` (a pending call -> its actor) less the actors a failed call says are dead;
    one that answered (the kill not there yet) is asked again."""
    ready, _ = ray.wait(list(calls), num_returns=len(calls), timeout=0)
    out = {ref: actor for ref, actor in calls.items() if ref not in set(ready)}
    for ref in ready:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError:
            continue
        out[calls[ref].held.remote()] = calls[ref]
    return out


class _LazyStates(Mapping[int, LayerMoments]):
    def __init__(self, parts: PartitionedStatistics) -> None:
        self.parts = parts

    def __getitem__(self, layer: int) -> LayerMoments:
        if layer not in self.parts.plan.layers:
            raise KeyError(layer)
        return self.parts.layer_state(layer)

    def __iter__(self) -> Iterator[int]:
        return iter(self.parts.plan.layers)

    def __len__(self) -> int:
        return len(self.parts.plan.layers)


class _OwnedStates:
    """:class:`~embgeom_ray.core.tables.LayerStates` of the layers the reducers own."""

    def __init__(self, parts: PartitionedStatistics) -> None:
        self.parts = parts

    def __iter__(self) -> Iterator[int]:
        return iter(self.parts.plan.layers)

    def mean(self, layer: int) -> np.ndarray:
        return self.parts._on_owner(layer, "layer_mean")

    def analyse(self, layer: int, types: TypePartials, rules: OutlierRules) -> LayerAnalysis:
        return self.parts._on_owner(layer, "analyse_layer", types, rules)

    def position_columns(self, layer: int, dims: Sequence[int]) -> np.ndarray:
        return self.parts._on_owner(layer, "position_columns", list(dims))
