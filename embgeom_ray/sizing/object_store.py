"""What the job puts in Ray's object store at its peak: the arrays that travel between its
processes as ``ray.put`` objects, task arguments and return values.

Ray keeps them in each node's shared-memory object store (plasma: by default 30% of the node's
memory, fixed when Ray starts, beside the ``memory`` resource actors and tasks reserve; a node
whose store fills spills objects to its disk, slow but not fatal). Phase by phase (N the
extractors, L the measured layers, d, s = n + t the sample's entries, n its uniform ones,
m = ``--silhouette-max-points``, C the CPUs of the cluster, Q the sample, B a flush's piece):

- **extraction** (:mod:`embgeom_ray.distributed.actor_pool`): under a statistics budget an
  extractor's spills (``ray.put``, a piece ≤ B each) stay in the store until its flush writes
  them; where the job's own process writes the checkpoint groups (a local run the extractors'
  nodes do not see), a flush's last piece and its sample return through the store:
  N · (B [spilling] + B + Q [the job writes]). One spill a flush is counted: a flush follows
  the shard in which the budget filled.
- **reduce** (:mod:`embgeom_ray.distributed.reducers`): the reducers read the groups from the
  run's files, not the store; what they return is a layer's type summaries at a time
  (160 B a type: V · 160) and one layer's d × d state. The reducers' state is in their heap,
  so no term here depends on whether they live through the sampled stage or stop before it.
- **sampled stage** (:mod:`embgeom_ray.distributed.sampled_stage`): every layer's tasks are
  submitted at once, so every layer's inputs wait in the store: the uniform and type-uniform
  points in float64 with the token ids and content keys, L · (8·s·d + 16·n) (put by the job's
  own process, on its node, unless the sample is handled by Ray tasks, which return them where
  they run and read the sample from one ``ray.put``: + Q at most); a selection's distance
  matrix of the distinct points, 8·n², returned for its metrics task, which is submitted C
  selections later: min(L, C + 1) of them (none where the metrics compute their own: n > m, a
  layer too large for one process, a sample handled by tasks); and the points a selection
  spreads its fits over :class:`~embgeom_ray.distributed.kmeans.RayFits` tasks with
  (``ray.put`` of the float64 and float32 points and their norms, 12·n·d + 8·n): a selection
  splits its fits only where a CPU is free, so at most min(L, C − 1) at once.
- **samples.parquet** (:func:`~embgeom_ray.distributed.sample_tasks.table_pieces_on_ray`,
  where Ray tasks write it): two layers' rows at a time, 2 · s · (4·d + 96), and the sample Q.

The peak is the largest phase's: they follow one another. The job's own process puts the
stage's inputs on its own node, so that node's store must hold them; the rest lands where
the tasks run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .units import gib


@dataclass(frozen=True)
class StagePhase:
    """The sampled stage's objects (module docstring), in bytes."""

    inputs: int
    distances: int
    fit_points: int
    sample: int
    #: what of it the job's own process puts on its node: the inputs, or where Ray tasks
    #: make them, the sample they read (at most Q: file URLs where it is not in memory)
    on_driver_node: int

    @property
    def total(self) -> int:
        return self.inputs + self.distances + self.fit_points + self.sample


def stage_bytes(
    layers: int,
    n: int,
    entries: int,
    d: int,
    cpus: int,
    hands_distances: bool,
    sample_on_tasks: bool,
    sample: int,
) -> StagePhase:
    """The sampled stage's objects for ``layers`` layers of ``n`` uniform points among
    ``entries`` (s) of dimension ``d`` on ``cpus`` CPUs (``hands_distances``: a selection
    returns its 8·n² distances for the metrics; ``sample_on_tasks``: Ray tasks make the inputs
    from the sample, ``sample`` bytes put once)."""
    c = max(1, int(cpus))
    inputs = layers * (8 * entries * d + 16 * n)
    return StagePhase(
        inputs=inputs,
        distances=min(layers, c + 1) * 8 * n * n if hands_distances else 0,
        fit_points=min(layers, c - 1) * (12 * n * d + 8 * n),
        sample=sample if sample_on_tasks else 0,
        on_driver_node=sample if sample_on_tasks else inputs,
    )


def extraction_bytes(extractors: int, piece: int, sample: int, spills: bool, job_writes: bool) -> int:
    """N · (B [spills under a budget] + B + Q [the job's own process writes the groups])."""
    return extractors * ((piece if spills else 0) + ((piece + sample) if job_writes else 0))


def pieces_bytes(entries: int, d: int, sample: int, on_tasks: bool) -> int:
    """samples.parquet's rows made by Ray tasks: two layers' at a time, and the sample put."""
    return 2 * entries * (4 * d + 96) + sample if on_tasks else 0


@dataclass(frozen=True)
class ObjectStorePeak:
    """Each phase's bytes in Ray's object store, the peak (the largest), and what the
    cluster's stores hold."""

    extraction: int
    reduce: int
    stage: StagePhase | None
    pieces: int
    #: the job's own process writes the checkpoint groups, so the flushes come through the
    #: store (else what extraction puts there is the extractors' spills alone)
    job_writes: bool = False

    @property
    def peak(self) -> int:
        return max(self.extraction, self.reduce, self.stage.total if self.stage else 0, self.pieces)

    @property
    def phase(self) -> str:
        phases = {"extraction": self.extraction, "reduce": self.reduce,
                  "sampled stage": self.stage.total if self.stage else 0,
                  "samples.parquet": self.pieces}  # fmt: skip
        return max(phases, key=lambda k: phases[k])

    def to_json(self) -> dict[str, int]:
        """``--plan-json``'s ``object_store``: each phase's bytes and the peak."""
        stage = self.stage
        return {
            "peak_bytes": self.peak,
            "extraction_bytes": self.extraction,
            "reduce_bytes": self.reduce,
            "sampled_stage_bytes": stage.total if stage else 0,
            "sampled_stage_inputs_bytes": stage.inputs if stage else 0,
            "sampled_stage_distances_bytes": stage.distances if stage else 0,
            "sampled_stage_fit_points_bytes": stage.fit_points if stage else 0,
            "sampled_stage_sample_bytes": stage.sample if stage else 0,
            "sampled_stage_driver_node_bytes": stage.on_driver_node if stage else 0,
            "samples_table_bytes": self.pieces,
        }

    def warning(self, stores: list[int], head_store: int) -> str | None:
        """The one line saying the peak passes the cluster's object stores (``stores``: each
        node's, ``head_store``: the job's own node's; 0: not known): Ray spills the rest to
        disk, slower; None where it fits or nothing is known."""
        total = sum(stores)
        on_head = self.stage.on_driver_node if self.stage else 0
        fix = "lower --sample-size or --sample-type-size, or measure fewer --layers"
        if total and self.peak > total:
            over = f"more than the {gib(total)} of the cluster's object stores"
            if self.phase == "extraction":  # what the extraction puts there, not the sample
                fix = ("an --out every extractor's node sees has them write their own groups"
                       if self.job_writes else
                       "the extractors spill their statistics past their budget σ there: "
                       "measure fewer --layers, or give each more memory (fewer "
                       "--num-workers, nodes with more)")  # fmt: skip
        elif head_store and on_head > head_store:
            over = (f"what the job's own process puts there for the sampled stage alone "
                    f"({gib(on_head)}) more than its node's {gib(head_store)}")  # fmt: skip
        else:
            return None
        return (f"Ray's object store: ≈ {gib(self.peak)} at its peak ({self.phase}), {over}: Ray "
                f"spills the rest to disk (slower, not fatal); {fix}")


def plan_object_store(sizing: Any, piece: int, writers: str) -> ObjectStorePeak:
    """The job's :class:`ObjectStorePeak` from its :class:`~embgeom_ray.sizing.decisions.Sizing`
    (``piece``: a flush's piece B, :func:`~embgeom_ray.sizing.decisions.io_sizes`; ``writers``:
    who writes the checkpoint groups, :func:`~embgeom_ray.sizing.checkpoints.writers_for`)."""
    from .checkpoints import DRIVER

    shape, pool = sizing.shape, sizing.pool
    extraction = extraction_bytes(pool.num_workers, piece, shape.sample_bytes,
                                  pool.statistics is not None, writers == DRIVER)  # fmt: skip
    peak = after_extraction(shape, sizing.cluster, sizing.types, sizing.reduce.partitioned, extraction)
    return replace(peak, job_writes=writers == DRIVER)


def after_extraction(
    shape: Any, cluster: Any, types: int, partitioned: bool, extraction: int = 0
) -> ObjectStorePeak:
    """:class:`ObjectStorePeak` of the phases a merge runs too (the reduce, of ``types`` on
    reducers where ``partitioned``; the sampled stage on the ``cluster``'s CPUs;
    samples.parquet), beside ``extraction``'s bytes (0: a merge extracts nothing)."""
    from .formulas import TYPE_ROW_BYTES, sample_on_workers

    q, d = shape.sample_bytes, shape.dim
    on_tasks = sample_on_workers(shape.sample_entries, d)
    tasks = shape.sampled_tasks()
    stage = None
    if tasks is not None:
        hands = not tasks.own_distances and tasks.n <= (tasks.m or tasks.n)
        cpus = sum(n.cpus for n in cluster.nodes)
        stage = stage_bytes(shape.layers, tasks.n, shape.sample_entries, d, cpus, hands, on_tasks, q)
    return ObjectStorePeak(
        extraction=extraction,
        reduce=types * TYPE_ROW_BYTES + 8 * d * d if partitioned else 0,
        stage=stage,
        pieces=pieces_bytes(shape.sample_entries, d, q, on_tasks) if shape.sample_entries else 0,
    )
