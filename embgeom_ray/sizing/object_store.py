"""What the job puts in Ray's object store at its peak: the arrays that travel between its
processes as ``ray.put`` objects, task arguments and return values.

Ray keeps them in each node's shared-memory object store (plasma: by default 30% of the node's
memory, fixed when Ray starts, beside the ``memory`` resource actors and tasks reserve; a node
whose store fills spills objects to its disk, slow but not fatal). Phase by phase (N the
extractors, L the measured layers, d, s = n + t the sample's entries, n its uniform ones,
m = ``--silhouette-max-points``, Q the sample, B a flush's piece):

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
- **sampled stage** (:mod:`~embgeom_ray.distributed.sampled_stage`): every layer's tasks are
  submitted at once, so every layer's inputs wait in the store: the uniform and type-uniform
  points in float64 with the token ids and content keys, L · (8·s·d + 16·n) (put by the job's
  own process, on its node, unless the sample is handled by Ray tasks, which return them where
  they run, the job's own node where they read local files, and read the sample from one
  ``ray.put``: + Q at most); a selection's distance
  matrix of the distinct points, 8·n², returned for its metrics task, which is submitted C
  selections later (C: the CPUs Ray has free as the stage starts, the job's own actors gone):
  min(L, C + 1) of them (none where the metrics compute their own: n > m, a layer too large
  for one process, a sample handled by tasks). Where a selection spreads its fits over
  :class:`~embgeom_ray.distributed.kmeans.RayFits` tasks, the points it puts for them
  (``ray.put`` of the float64 and float32 points and their norms, 12·n·d + 8·n) and what
  those tasks return, the fits of the seedings' step and of the stability refits' (each fit
  its labels and centres, 8·n + 8·k·d; the selection keeps each k's best, whose arrays,
  read without a copy, hold their task's whole return in the store until it ends):
  F · Σ_{k≤15} (8·n + 8·k·d) + S · (8·n + 8·k_max·d), F the seedings per k, S
  ``--kmeans-stability-seeds``. A selection splits its fits only where a CPU is free, so at
  most min(L, C_s, C − 1) do at once, C_s the CPUs the selections can run on: each node's,
  at most as many as its Ray memory holds selections (each asks for its peak); where memory
  holds fewer than C, every selection running (C_s) has free CPUs to split on. A layer too
  large for one process (n·d past
  :data:`~embgeom_ray.core.kmeans_selection.LOCAL_FIT_MAX_ELEMENTS`) splits no fits; its
  partitioned fit puts its centred distinct points twice, whole and cut into partitions,
  for every layer at once (all are submitted together): L · 16·n·d.
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
    #: what of it lands on the job's own node: the inputs its process puts, or where Ray tasks
    #: make them, the sample they read (at most Q: file URLs where it is not in memory), and
    #: the inputs too where those tasks read local files (pinned to this node, they return
    #: them here)
    on_driver_node: int
    #: what the fit-share tasks of the selections splitting at once return
    fit_results: int = 0
    #: the partitioned fits' points, whole and in partitions (layers too large for one process)
    partitions: int = 0

    @property
    def total(self) -> int:
        return (self.inputs + self.distances + self.fit_points + self.fit_results
                + self.partitions + self.sample)  # fmt: skip


def share_results_bytes(n: int, d: int, k_max: int, n_init: int | None, stability_seeds: int) -> int:
    """What one selection's fit-share tasks return at most (module docstring): every fit of the
    seedings' step, F of each k ≤ 15, and of the S stability refits at the chosen k ≤ k_max,
    each its labels (n int64) and centres (k × d float64): F · Σ_{k≤15} (8·n + 8·k·d) +
    S · (8·n + 8·k_max·d)."""
    from .sampled_tasks import K_DENSE, seedings

    F, top = seedings(k_max, n_init), min(int(k_max), n - 1)
    dense = sum(F * (8 * n + 8 * k * d) for k in range(2, min(K_DENSE, n - 1) + 1))
    return dense + int(stability_seeds) * (8 * n + 8 * top * d)


def selection_slots(cluster: Any, each: int) -> int:
    """C_s: the CPUs the sampled stage's selections can run on, each node's with a CPU, at most
    as many as its Ray memory holds selections of ``each`` bytes (what each asks Ray for; a
    node offering none counts its CPUs: they ask it for none)."""
    return sum(min(n.cpus, n.memory // each) if each and n.memory else n.cpus
               for n in cluster.nodes if n.cpus >= 1)  # fmt: skip


def stage_bytes(
    layers: int,
    n: int,
    entries: int,
    d: int,
    cpus: int,
    hands_distances: bool,
    sample_on_tasks: bool,
    sample: int,
    *,
    slots: int | None = None,
    share_results: int = 0,
    partitioned: bool = False,
    tasks_here: bool = False,
) -> StagePhase:
    """The sampled stage's objects for ``layers`` layers of ``n`` uniform points among
    ``entries`` (s) of dimension ``d`` on ``cpus`` CPUs free (C; ``slots``: C_s, the CPUs
    its selections can run on, :func:`selection_slots`, default C; min(L, C_s, C − 1) of
    them split their fits at once), ``hands_distances``: a
    selection returns its 8·n² distances for the metrics; ``sample_on_tasks``: Ray tasks make
    the inputs from the sample, ``sample`` bytes put once; ``share_results``: what a splitting
    selection's fit-share tasks return (:func:`share_results_bytes`); ``partitioned``: the
    layers are fitted by the partitioned route, which splits no fits and puts its points twice;
    ``tasks_here``: the sample's tasks read local files, so run on the job's own node, where
    what they return is stored)."""
    c = max(1, int(cpus))
    # a selection splits where a CPU is free beside the running ones: C_s at once where the
    # nodes' memory holds fewer selections than C, C − 1 where every CPU runs one
    running = c if slots is None else max(0, int(slots))
    splitting = 0 if partitioned else min(layers, running, c - 1)
    inputs = layers * (8 * entries * d + 16 * n)
    return StagePhase(
        inputs=inputs,
        distances=min(layers, c + 1) * 8 * n * n if hands_distances else 0,
        fit_points=splitting * (12 * n * d + 8 * n),
        sample=sample if sample_on_tasks else 0,
        on_driver_node=(sample + (inputs if tasks_here else 0)) if sample_on_tasks else inputs,
        fit_results=splitting * share_results,
        partitions=layers * 16 * n * d if partitioned else 0,
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
            "sampled_stage_fit_results_bytes": stage.fit_results if stage else 0,
            "sampled_stage_partitions_bytes": stage.partitions if stage else 0,
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
    from ..core.kmeans_selection import LOCAL_FIT_MAX_ELEMENTS
    from ..core.options import SampledOptions
    from .formulas import TYPE_ROW_BYTES, sample_on_workers

    q, d = shape.sample_bytes, shape.dim
    on_tasks = sample_on_workers(shape.sample_entries, d)
    tasks = shape.sampled_tasks()
    stage = None
    if tasks is not None:
        hands = not tasks.own_distances and tasks.n <= (tasks.m or tasks.n)
        seeds = (shape.sampled.kmeans_stability_seeds if shape.sampled is not None
                 else SampledOptions().kmeans_stability_seeds)  # fmt: skip
        stage = stage_bytes(
            shape.layers, tasks.n, shape.sample_entries, d, cluster.cpus, hands, on_tasks, q,
            slots=selection_slots(cluster, tasks.kmeans),
            share_results=share_results_bytes(tasks.n, d, tasks.k_max, tasks.n_init, seeds),
            partitioned=tasks.n * d > LOCAL_FIT_MAX_ELEMENTS, tasks_here=shape.sample_local,
        )  # fmt: skip
    return ObjectStorePeak(
        extraction=extraction,
        reduce=types * TYPE_ROW_BYTES + 8 * d * d if partitioned else 0,
        stage=stage,
        pieces=pieces_bytes(shape.sample_entries, d, q, on_tasks) if shape.sample_entries else 0,
    )
