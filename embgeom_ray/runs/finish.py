"""The finishing steps every run shares, an analysis or a merge of runs.

From the corpus statistics and sample to a complete run directory: the exact tables
(:func:`~embgeom_ray.core.tables.build_tables`), the sampled metrics on Ray
(:func:`~embgeom_ray.distributed.sampled_stage.add_sampled_metrics`), the artefacts and tables
written atomically, the manifest marked ``complete`` (:meth:`RunDir.finalise`), the summary
printed, and the report drawn (a report failure is recorded, never loses the run).

The run's statistics come as a :class:`RunStatistics`, wherever they live: in this process
(:class:`StatisticsHere`) or partitioned across reducer actors
(:class:`~embgeom_ray.distributed.reducers.PartitionedStatistics`); the steps here ask the same
of both.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from ..config import JobConfig
from ..core.options import TableOptions
from ..core.sample_layers import SampleLayers, as_layers
from ..core.samples import ActivationSample
from ..core.statistics import EmbeddingStatistics
from ..core.tables import TypeRowsSink, build_tables
from ..counts import Counts
from ..distributed.node_tasks import on_this_node
from ..distributed.process_memory import peak_memory
from ..distributed.sampled_stage import add_sampled_metrics
from ..integrity import Digest
from ..run_dir import MANIFEST, Manifest, RunDir, format_summary
from ..sizing.formulas import on_workers
from ..sizing.peaks import describe_peaks


class RunStatistics(Protocol):
    """A run's merged statistics as the finishing steps use them, wherever they live."""

    #: whether the artefact is written as parts, one directory
    #: (:meth:`~embgeom_ray.run_dir.RunDir.save_artefacts`)
    partitioned: bool

    @property
    def layers(self) -> list[int]:
        """The measured layers, in order."""

    def tables(
        self, tokenizer: Any, options: TableOptions, type_rows: TypeRowsSink | None = None
    ) -> dict[str, Any]:
        """Every exact table (the same wherever the statistics live); ``type_rows``: where
        the ``type_stats`` rows go a layer at a time
        (:func:`~embgeom_ray.core.tables.build_tables_from`)."""

    def token_count(self) -> int:
        """Tokens counted (in the first layer)."""

    def nonfinite(self) -> dict[int, int]:
        """Layer -> the non-finite tokens left out of it."""

    def save(self, path: str) -> Digest | None:
        """Write the statistics artefact at ``path``; the digest of what was written (of a
        partitioned artefact: its index's)."""

    def describe(self) -> dict[str, Any] | None:
        """The manifest's ``reducers`` (None: the statistics are this process's)."""

    def peak_memory(self) -> list[dict[str, int | None]]:
        """Each reducer's peak resident and private memory (none for this process's)."""

    def close(self, wait: bool = False) -> None:
        """Release what holds the statistics (the reducer actors; with ``wait``, their Ray
        memory back when it returns, as before the sampled stage); again: nothing more.
        Nothing is asked of the statistics after it."""


class StatisticsHere:
    """A run's :class:`~embgeom_ray.core.statistics.EmbeddingStatistics` in this process, as a
    :class:`RunStatistics`: the tables built here (:func:`~embgeom_ray.core.tables.build_tables`),
    one artefact file, no reducers. (The sketch itself stays free of the tables, which the
    core builds above it.)"""

    partitioned = False

    def __init__(self, statistics: EmbeddingStatistics) -> None:
        self.statistics = statistics

    @property
    def layers(self) -> list[int]:
        return self.statistics.layers

    def tables(
        self, tokenizer: Any, options: TableOptions, type_rows: TypeRowsSink | None = None
    ) -> dict[str, Any]:
        return build_tables(self.statistics, tokenizer, options, type_rows)

    def token_count(self) -> int:
        return self.statistics.token_count()

    def nonfinite(self) -> dict[int, int]:
        stats = self.statistics
        return {layer: stats.layer(layer).nonfinite for layer in stats.layers}

    def save(self, path: str) -> Digest:
        return self.statistics.save(path)

    def describe(self) -> None:
        return None

    def peak_memory(self) -> list[dict[str, int | None]]:
        return []

    def close(self, wait: bool = False) -> None:
        pass


def memory_of(reducers: list[dict[str, int | None]], manifest: Manifest) -> dict[str, Any]:
    """The manifest's ``memory``: peak resident and private bytes of this process (the
    driver), of the largest extractor (as the actor pool recorded it) and of each reducer
    actor (``reducers``: :meth:`RunStatistics.peak_memory`, asked before they stopped;
    :mod:`~embgeom_ray.distributed.process_memory`: resident includes the object store's
    shared pages a process touched; private is its own heap)."""
    own = peak_memory()
    memory: dict[str, Any] = {
        "driver_peak_rss_bytes": own["rss"],
        "driver_peak_private_bytes": own["private"],
        "driver_start_private_bytes": own["start"],
    }
    workers = manifest.workers or {}
    for key in ("extractor_peak_rss_bytes", "extractor_peak_private_bytes"):
        if workers.get(key):
            memory[key] = workers[key]
    if reducers:
        memory["reducer_peak_rss_bytes"] = [r["rss"] for r in reducers]
        memory["reducer_peak_private_bytes"] = [r["private"] for r in reducers]
    return memory


def counts_of(totals: Counts, merged: RunStatistics) -> Counts:
    """The manifest's ``counts``: the shards' summed counts with the non-finite tokens per
    layer of the run's statistics (every field set, so the manifest writes every counter)."""
    per_layer = {str(layer): int(n) for layer, n in merged.nonfinite().items()}
    return Counts.from_json(totals.to_json() | {"nonfinite_tokens_per_layer": per_layer})


def finish_run(
    run: RunDir,
    manifest: Manifest,
    merged: RunStatistics,
    sample: ActivationSample | SampleLayers | None,
    tokenizer: Any,
    config: JobConfig,
    *,
    t_start: float,
    echo: Callable[[str], None] = print,
    before_report: Callable[[], None] | None = None,
    artefacts: list[str] | None = None,
) -> Manifest:
    """Tables, sampled metrics, artefacts, the complete manifest, the summary and the report.

    ``manifest`` holds what the caller knows (identity, counts, its own timings); this adds
    ``timings_s.metrics``/``write``/``total``, ``sample`` and ``outputs`` and writes it as
    ``complete`` only after every table and artefact is in place. ``sample``: whole, or a
    layer at a time (:mod:`~embgeom_ray.core.sample_layers`); either way the sampled stage
    and ``samples.parquet`` take it one layer at a time, and a large one is handled by Ray
    tasks that read it themselves (:mod:`~embgeom_ray.distributed.sample_tasks`).
    The statistics artefact is written, and ``merged`` closed, before the sampled stage
    (what the manifest records of its reducers asked first): the reducers' Ray memory is
    free for the stage's tasks, and the caller's own ``close`` after is a no-op. A resumed
    run reduces again from the checkpoint groups (and the reducers' checkpoints), which stay
    until the run is complete.
    ``before_report`` runs once the manifest is complete, before the report is drawn: the
    analysis removes its checkpoint groups there, so that the report's file list shows the
    directory as it stays.
    ``artefacts``: the statistics artefact already in place, not written again (a
    re-tabulation's: the artefact it read, the same content; rewriting it would put the run's
    only copy at risk, and on object storage upload it again); its digests are the caller's
    to put in ``run.written``.
    """
    t0 = time.perf_counter()
    with run.table_writer("type_stats") as type_rows:  # a layer's rows at a time, not L·V
        tables = merged.tables(tokenizer, config.tables, type_rows)
    t_tables = time.perf_counter()
    # all the sampled stage and the rest need of the statistics: their artefact (the manifest
    # says ``running`` until every output is in place) and what the manifest records of their
    # reducers; then the reducers are stopped, their Ray memory free for the stage's tasks
    if artefacts is None:
        artefacts = run.save_artefacts(merged)
    reducers, reducer_peaks = merged.describe(), merged.peak_memory()
    merged.close(wait=True)
    layers = as_layers(sample)
    t_saved = time.perf_counter()
    # a large sample is handled by Ray tasks: this process holds no layer of it; the tasks
    # that read it (the stage's inputs, then the rows of samples.parquet) placed once
    large = layers is not None and on_workers(layers)
    where = None
    if large:
        from ..distributed.cluster import connect
        from ..distributed.sample_tasks import placement, table_pieces_on_ray

        connect(config.address)
        where = placement(layers)
    note, clusters = (
        (None, {})
        if layers is None
        else add_sampled_metrics(tables, layers, config.sampled, config.address, where)
    )
    t1 = time.perf_counter()
    saved_s = t_saved - t_tables  # the artefact's write (and the reducers' stop): "write"
    timings = {
        "metrics": round(t1 - t0 - saved_s, 3),
        "tables": round(t_tables - t0, 3),
        "sampled": round(t1 - t_saved, 3),
    }
    manifest.set(sample=note, timings_s=manifest.timings_s | timings)
    id_to_token = tokenizer.convert_ids_to_tokens
    pieces = None
    if large:  # its rows built by Ray tasks, fetched a piece at a time
        pieces = table_pieces_on_ray(
            layers, id_to_token, clusters, config.address, where=where
        )
    run.finalise(
        manifest, tables, None, layers, id_to_token=id_to_token, clusters=clusters,
        written_before=["type_stats.parquet"], sample_pieces=pieces, artefacts=artefacts,
    )  # fmt: skip
    t2 = time.perf_counter()
    manifest.set(
        timings_s=manifest.timings_s
        | {"write": round(t2 - t1 + saved_s, 3), "total": round(t2 - t_start, 3)},
        memory=memory_of(reducer_peaks, manifest),
    )
    if reducers is not None:
        manifest.set(reducers=reducers)
    run.write_manifest(manifest)
    echo(format_summary(tables["layers"]))
    peaks = describe_peaks(manifest.to_json())
    if peaks:
        echo(peaks)
    outputs = manifest.outputs
    names = [*(outputs.tables if outputs else []), *(outputs.artefacts if outputs else [])]
    echo(f"outputs in {run.url}: {', '.join([*names, MANIFEST])}")
    if before_report is not None:
        before_report()
    if config.no_report:
        return manifest
    # matplotlib and the figures imported only here: a run without a report never needs them
    from ..report.html import write_run_report
    from ..report.plots import draw_figures

    # some figures drawn by Ray tasks on this node while this process draws the others
    tasks = on_this_node(draw_figures)
    elsewhere = None if tasks is None else lambda names: tasks(run.url, names)
    # a large sample's PCA views are drawn in tasks too
    write_run_report(run, manifest, echo, elsewhere=elsewhere, draw_here=not large or elsewhere is None)
    return manifest
