"""Merging complete runs over disjoint corpora into the run over their union.

Each run's ``statistics.safetensors`` holds mergeable sufficient statistics and its
``samples.parquet`` a mergeable bottom-k sample (``sample.safetensors`` in runs of earlier
versions: :meth:`RunDir.load_sample` reads either), so the merge is exact: the output gets the
statistics, sample, tables and manifest that one analysis over all the corpora would have
written (counts equal, floats equal up to float64 rounding; the sample is the same occurrences).

The runs must be complete and measure the same thing: same model and tokenizer (content
fingerprints), same layers, max_length, dtype, special-token option, clip dims and sample
options. Two runs over the same corpus are refused, since every token would be counted twice;
corpora that merely overlap cannot be detected and are the caller's responsibility, but copies
of the same files under the same names are warned of (:func:`overlap_warnings`). A merged run
can itself be merged. ``python -m jobs.merge`` is the command-line entry point.

Runs made with ``--dedup`` merge exactly too, as long as no document is in two of them: each
run keeps the keys of its distinct documents (``doc_hashes.npy``), and runs that share a key
are refused with the number of shared documents, since the statistics can add a document but
never take one back out (one ``--dedup`` run over the union of the corpora is the way then).
Disjoint ``--dedup`` runs merge into a ``--dedup`` run whose keys and counts are the sums, as
one run over the union would have. A ``--dedup`` run and a run without it are refused: the
merge would be neither.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import ValidationError

from ..config import (
    AGREE_OPTIONS,
    MERGE_OPTIONS,
    SCHEDULING_OPTIONS,
    JobConfig,
    format_validation_error,
)
from ..core.options import sample_entries
from ..core.sample_layers import SampleLayers, merged_layers
from ..core.statistics import EmbeddingStatistics
from ..counts import Counts
from ..errors import ConfigError, ModelError, OutputError, StatisticsMismatchError
from ..inputs.dedup import shared_documents
from ..inputs.model_loading import load_tokenizer, tokenizer_fingerprint
from ..integrity import FileRef, integrity_error
from ..io_utils import is_local, local_path, location, path_key
from ..run_dir import (
    STATISTICS,
    CorpusInfo,
    DedupInfo,
    Manifest,
    RunDir,
    RunDirError,
    load_statistics_part,
    now,
    versions,
)
from ..sizing import Cluster, Reduce, Shape, gib, reducer_ranges, size_reduce
from ..sizing.decisions import stage_task_refusal
from ..sizing.object_store import after_extraction
from ..sizing.plan import sample_task_lines, sampled_task_lines, store_lines
from ..storage import REDOES, check_input, check_output, resumable, user_errors
from .finish import RunStatistics, StatisticsHere, counts_of, finish_run
from .run_samples import run_samples

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from ..distributed.reducers import PartitionedStatistics

#: manifest keys that describe what the merged runs share (taken from the first run)
SHARED_KEYS = ("model", "tokenizer", "clip_dims", "outlier_rules")

#: how a run's manifest marks a local model directory's revision (its content hash; a hub
#: model's is a commit)
LOCAL_REVISION = "sha256:"

#: a run that cannot be merged (missing, incomplete, unreadable)
RunError = RunDirError


def load_manifest(run: str) -> Manifest:
    """The manifest of a complete run, or a :class:`RunError` saying what is wrong."""
    return RunDir(run).complete_manifest("merging")


def _model_label(manifest: Manifest) -> str:
    """``ID (FINGERPRINT…)``: the model a run measured, as its manifest names it."""
    model = manifest.model
    if model is None:
        return "no model named"
    fp = model.model_fingerprint or model.revision
    return f"{model.id} ({fp[:19]}…)" if fp else model.id


def model_mismatch(run: str, manifest: Manifest, first: str, first_manifest: Manifest) -> str | None:
    """Why ``run`` cannot merge into ``first`` by what their manifests say they measured: other
    model weights (the content fingerprint: a hub commit or a directory's hash, whatever its
    path) or another tokenizer (its fingerprint); None when both agree or one does not say.
    Checked before the options and layers, which a different model also changes."""
    a, b = first_manifest.model, manifest.model
    fa, fb = (a.model_fingerprint if a else None), (b.model_fingerprint if b else None)
    ta = first_manifest.tokenizer.fingerprint if first_manifest.tokenizer else None
    tb = manifest.tokenizer.fingerprint if manifest.tokenizer else None
    other_tokenizer = bool(ta and tb and ta != tb)
    if fa and fb and fa != fb:
        return (
            f"runs of different models: {run} measured {_model_label(manifest)}, {first} "
            f"measured {_model_label(first_manifest)}"
            + (" (their tokenizers differ too)" if other_tokenizer else "")
        )
    if other_tokenizer:
        why = (
            f"runs with different tokenizers of the same model: {run}'s is {tb[:19]}…, "
            f"{first}'s {ta[:19]}… (a token id would name other tokens)"
        )
        va, vb = (m.versions.get("transformers") for m in (first_manifest, manifest))
        if va and vb and va != vb:
            why += f"; they ran transformers {vb} and {va}"
        return why
    return None


def agreed_value(manifest: Manifest, key: str) -> Any:
    """What the option ``key`` (one of :data:`~embgeom_ray.config.AGREE_OPTIONS`) measured in
    the run of ``manifest``: its config value, but ``clip_dims`` as resolved (the manifest's
    sorted ``clip_dims``, whether given by ``--clip-dims`` in any order or by
    ``--clip-dims-from``) and ``sample_type_size`` as the sample keeps it (None: the
    ``--sample-size``; none without a sample), so that a default and the same value given
    agree."""
    cfg = manifest.config
    if key == "clip_dims":
        dims = manifest.clip_dims if manifest.clip_dims is not None else cfg.get("clip_dims")
        return None if dims is None else sorted(set(dims))
    if key == "sample_type_size" and cfg.get("sample_size") is not None:
        return sample_entries(int(cfg["sample_size"]), cfg.get("sample_type_size"))[1]
    return cfg.get(key)


def check_mergeable(runs: list[str], manifests: list[Manifest]) -> None:
    """Refuse runs of other models or tokenizers, whose options differ or whose corpora
    repeat, naming the runs and what differs."""
    first = runs[0]
    for run, manifest in zip(runs[1:], manifests[1:], strict=True):
        why = model_mismatch(run, manifest, first, manifests[0])
        if why:
            raise StatisticsMismatchError(f"cannot merge {run} into {first}: {why}")
        values = [  # the options marked AGREE: they change the statistics
            (key, agreed_value(manifest, key), agreed_value(manifests[0], key))
            for key in AGREE_OPTIONS
        ]
        diffs = [f"{key} {ours!r} != {theirs!r}" for key, ours, theirs in values if ours != theirs]
        if diffs:
            raise StatisticsMismatchError(
                f"cannot merge {run} into {first}: runs with different options: " + "; ".join(diffs)
            )
        if manifest.layers != manifests[0].layers:
            raise StatisticsMismatchError(
                f"cannot merge {run} into {first}: runs of different layers "
                f"({manifest.layers} != {manifests[0].layers})"
            )
    seen: dict[str, str] = {}
    for run, manifest in zip(runs, manifests, strict=True):
        for fp in manifest.corpus.leaves():
            if fp in seen:
                raise StatisticsMismatchError(
                    f"{run} and {seen[fp]} cover the same corpus (fingerprint {fp}); merging "
                    "them would count every token twice"
                )
            seen[fp] = run


def _dedup(manifest: Manifest) -> bool:
    return bool(manifest.config.get("dedup", False))


def check_dedup(runs: list[str], manifests: list[Manifest]) -> tuple[np.ndarray, DedupInfo] | None:
    """The merged run's kept-document keys and dedup counts when every run is a ``--dedup``
    run with no document in common; None when none is; a refusal otherwise."""
    flags = [_dedup(m) for m in manifests]
    if not any(flags):
        return None
    if not all(flags):
        with_, without = runs[flags.index(True)], runs[flags.index(False)]
        raise StatisticsMismatchError(
            f"cannot merge {without} (run without --dedup) with {with_} (run with --dedup): "
            "the merged run would be neither de-duplicated nor a plain run; rerun "
            f"{without} with --dedup, or {with_} without it"
        )
    hashes = [RunDir(run).read_doc_hashes() for run in runs]
    for j in range(1, len(runs)):
        for i in range(j):
            shared = shared_documents(hashes[i], hashes[j])
            if shared:
                raise StatisticsMismatchError(
                    f"cannot merge {runs[j]} with {runs[i]}: they share {shared} "
                    f"{'document' if shared == 1 else 'documents'} (identical after "
                    "normalisation) that each run counted once; a merge cannot take a "
                    "document back out of the statistics, so run --dedup once over the union "
                    "of their corpora instead"
                )
    parts = [m.dedup or DedupInfo() for m in manifests]
    info = DedupInfo(
        documents_read=sum(p.documents_read for p in parts),
        duplicates_dropped=sum(p.duplicates_dropped for p in parts),
        distinct_kept=sum(p.distinct_kept for p in parts),
        normalisation=parts[0].normalisation,
        hash=parts[0].hash,
    )
    return np.concatenate(hashes), info


def _corpus_label(corpus: Any) -> str:
    if isinstance(corpus, list):
        return " + ".join(_corpus_label(c) for c in corpus)
    return str(corpus)


def run_config(manifest: Manifest, out: str, options: dict[str, Any]) -> JobConfig:
    """The first run's options (they decide how the tables are computed), with its scheduling
    options back at their defaults (the merge sizes itself), writing to ``out``, under the
    merge's own ``options`` (``jobs.merge``'s flags: :data:`~embgeom_ray.config.MERGE_OPTIONS`,
    those given)."""
    fields = JobConfig.model_fields
    known = {
        k: v
        for k, v in manifest.config.items()
        if k in fields and k not in SCHEDULING_OPTIONS
    }
    # the corpus does not enter the tables; a merged run keeps the list of its corpora there
    # (and a merged run gets its report, whatever the first run's --no-report, unless the
    # merge's own options say no_report)
    known |= {"out": out, "corpus": _corpus_label(known.get("corpus")), "no_report": False}
    known |= {k: v for k, v in options.items() if v is not None}
    try:
        return JobConfig(**known)
    except ValidationError as exc:
        message = format_validation_error(exc)
        given = [k for k in options if k in message.replace("-", "_")]
        if given:
            raise ConfigError(message) from None
        raise RunError(f"the options of the first run cannot be read back: {message}") from None


def load_statistics(run: str) -> EmbeddingStatistics:
    rd = RunDir(run)
    if not rd.has_statistics():
        raise RunError(f"run {run} says it is complete but has no {STATISTICS}")
    return rd.load_statistics()


def check_statistics(
    runs: list[str], layers: list[int]
) -> tuple[list[FileRef], EmbeddingStatistics]:
    """Each run's statistics artefact (file or ``statistics/`` directory), after checking
    that they measure the same thing (model and tokenizer, layers, dim, clip dims, co-moment
    precision) from their first layer's state alone, without reading any per-type row; and
    the first run's first-layer state (dim, positions, clip dims). Each artefact comes with
    the digest its run's manifest records, and every read of it is checked against it."""
    urls: list[FileRef] = []
    probes = []
    for run in runs:
        rd = RunDir(run)
        if not rd.has_statistics():
            raise RunError(f"run {run} says it is complete but has no {STATISTICS}")
        urls.append(rd.statistics_ref())
        try:
            probes.append(load_statistics_part(urls[-1], layers[:1], (0, 0)))
        except (ValueError, StatisticsMismatchError) as exc:
            raise StatisticsMismatchError(f"cannot merge {run} into {runs[0]}: {exc}") from None
    for run, probe in zip(runs[1:], probes[1:], strict=True):
        problems = probes[0].mismatches(probe)
        if problems:
            raise StatisticsMismatchError(
                f"cannot merge {run} into {runs[0]}: statistics of different measurements: "
                + "; ".join(problems)
            )
    return urls, probes[0]


def merge_shape(
    probe: EmbeddingStatistics,
    layers: list[int],
    config: JobConfig,
    vocab: int,
    samples: Sequence[Mapping[str, Any] | None] = (),
    runs: Sequence[str] = (),
) -> Shape:
    """The merge's :class:`~embgeom_ray.sizing.Shape`: the runs' layers, d, positions and
    clipped dimensions (from the first run's first-layer state) and their sample, whose
    sampled stage (``sample_points``, ``sampled``) runs as an analysis's does: of the merged
    sample's entries (:func:`merged_sample_entries` of the runs' manifests' ``samples``),
    read from the ``runs`` (a local one where any is: the sample's tasks then run on the
    job's own node, whatever ``--out``)."""
    uniform, types = merged_sample_entries(config, samples)
    source = next((r for r in runs if is_local(r)), runs[0]) if runs else None
    return Shape(
        layers=len(layers), dim=probe.dim, positions=probe.max_positions, vocab=vocab,
        clip=len(probe.clip_dims or []), sample_entries=uniform + types, name="merge",
        store=config.out, sample_points=uniform, sampled=config.sampled, sample_source=source,
    )  # fmt: skip


def merged_sample_entries(
    config: JobConfig, samples: Sequence[Mapping[str, Any] | None] = ()
) -> tuple[int, int]:
    """(uniform, type-uniform) entries the merged sample holds at most: the bottom-k of the
    runs' samples holds ``--sample-size`` (``--sample-type-size``) of them, or all the runs
    have where they have fewer (corpora smaller than the sample; their manifests' ``sample``
    say how many: ``uniform_points``, ``type_uniform_points``), so that a merge's plan does
    not size, or refuse, a sampled stage larger than the one it runs. Without every run's
    counts (``samples`` empty, or a run's manifest without them), the options'."""
    uniform, types = sample_entries(config.sample_size, config.sample_type_size)
    counts = [(s or {}).get("uniform_points") for s in samples]
    if samples and all(isinstance(c, int) for c in counts):
        uniform = min(uniform, sum(counts))
        held = [(s or {}).get("type_uniform_points") for s in samples]
        if all(isinstance(c, int) for c in held):
            types = min(types, sum(held))
    return uniform, types


def size_merge(
    urls: list[FileRef], shape: Shape, config: JobConfig, echo=print
) -> tuple[Reduce, np.ndarray]:
    """Where the runs' statistics are merged (:func:`~embgeom_ray.sizing.size_reduce`, with the
    types they hold, read from their files alone, and Ray's view of the cluster, joined here),
    printed once; and those types' ids."""
    from ..distributed.cluster import (
        connect,
        read_autoscaler_groups,
        read_cluster,
        started_private_local,
    )
    from ..distributed.reducers import seen_type_ids

    connect(config.address)
    seen = seen_type_ids(urls)
    cluster = read_cluster()
    groups = () if started_private_local() else read_autoscaler_groups()
    # the merged sample's tasks and its sampled stage's, as an analysis's
    refused = stage_task_refusal(shape, cluster, groups)
    if refused:
        raise ConfigError(refused)
    reduce = size_reduce(shape, len(seen), cluster, config.scheduling)
    echo(f"sizing: {len(seen):,} types in the runs: {reduce.describe()}")
    return reduce, seen


def merge_partitioned(
    urls: list[FileRef], layers: list[int], reduce: Reduce, seen: np.ndarray
) -> PartitionedStatistics:
    """The runs' statistics (``urls``: their artefacts, whole or cut into other partitions)
    merged by ``reduce.count`` reducer actors of ``reduce.memory`` bytes each, partition by
    partition: each reads its token range and layers from every run and merges them in the
    order given, so no process holds more than its partition
    (:mod:`~embgeom_ray.distributed.reducers`)."""
    from ..distributed.reducers import PartitionedStatistics, PartitionPlan

    plan = PartitionPlan.balanced(reduce.count, seen, layers)
    return PartitionedStatistics(
        plan, urls, memory=reduce.memory, nodes=reduce.nodes, pinned=reduce.pinned
    )


def where_seen(
    reduce: Reduce, runs: list[str], out: str, shape: Shape, types: int, config: JobConfig,
    echo=print,
) -> Reduce:
    """``reduce`` on the nodes that see the merge's local directory ``out`` and the local
    runs it reads (each by its ``manifest.json``): sized again on those nodes alone, each
    reducer pinned there, where some other node does not
    (:func:`~embgeom_ray.distributed.reducers.place_where_seen`)."""
    from ..distributed.cluster import read_cluster
    from ..distributed.reducers import place_where_seen
    from ..shared_out import file_marker, write_marker

    inputs = [
        file_marker(os.path.join(local_path(r), "manifest.json")) for r in runs if is_local(r)
    ]

    def resize(nodes: Cluster) -> Reduce:
        return size_reduce(shape, types, nodes, config.scheduling)

    return place_where_seen(
        reduce, read_cluster(), resize, out, lambda: write_marker(local_path(out)), echo, inputs
    )


def describe_merge_plan(
    shape: Shape, reduce: Reduce, runs: list[str], cluster: Cluster | None = None
) -> list[str]:
    """What ``jobs.merge --plan`` prints: its sizing, and the lines of the merged sample's
    Ray tasks, of its sampled stage's and of Ray's object store, as an analysis's plan has
    them (the sample's tasks and the object store where the ``cluster`` is given)."""
    state = shape.statistics_bytes(reduce.types)
    lines = [
        f"merge: {len(runs)} runs, L = {shape.layers} layers, d = {shape.dim:,}, P = "
        f"{shape.positions}, V_seen = {reduce.types:,} types (read from the runs' artefacts)",
        f"statistics S(V) + F = {gib(state)}; sample Q = {gib(shape.sample_bytes)}",
        reduce.describe(),
    ]
    if reduce.partitioned:
        ranges = reducer_ranges(reduce.count, reduce.types)
        lines.append(
            f"  = {reduce.formula}; {len(ranges)} ranges of equal numbers of the ids seen"
        )
    if cluster is None:
        return lines + sampled_task_lines(shape)
    store = after_extraction(shape, cluster, reduce.types, reduce.partitioned)
    return (lines + sample_task_lines(shape, cluster) + sampled_task_lines(shape)
            + store_lines(store, cluster))  # fmt: skip


def merge_decisions(shape: Shape, reduce: Reduce, runs: list[str], cluster: Cluster) -> dict[str, Any]:
    """The merge's plan as numbers (``--plan-json``; what ``embgeom_ray.plan_merge``
    returns), the numbers :func:`describe_merge_plan` prints, under the keys an analysis's
    plan has them (:meth:`~embgeom_ray.sizing.decisions.Sizing.to_json`: ``reducers``,
    ``driver_bytes``, ``sampled_tasks``, ``object_store``), with what a merge reads of its
    runs: their types (``types_seen``), L, d, P, the statistics' and the sample's bytes."""
    tasks = shape.sampled_tasks()
    store = after_extraction(shape, cluster, reduce.types, reduce.partitioned)
    return {
        "runs": list(runs),
        "layers": shape.layers,
        "dim": shape.dim,
        "positions": shape.positions,
        "types_seen": reduce.types,
        "statistics_bytes": shape.statistics_bytes(reduce.types),
        "sample_bytes": shape.sample_bytes,
        "reducers": asdict(reduce),
        "driver_bytes": reduce.driver,
        **({"sampled_tasks": {"kmeans_memory": tasks.kmeans, "metrics_memory": tasks.metrics}}
           if tasks is not None else {}),
        "object_store": store.to_json(),
    }  # fmt: skip


def show_merge_plan(
    shape: Shape, reduce: Reduce, runs: list[str], config: JobConfig, echo=print
) -> dict[str, Any]:
    """``--plan`` (and ``--plan-json``): the merge's plan in words to ``echo``; returns its
    numbers (:func:`merge_decisions`), also written to the ``--plan-json`` file where given.
    Nothing is merged or written besides."""
    from ..distributed.cluster import read_cluster
    from .pipeline import write_plan_json

    cluster = read_cluster()
    for line in describe_merge_plan(shape, reduce, runs, cluster):
        echo(line)
    decisions = merge_decisions(shape, reduce, runs, cluster)
    if config.plan_json:
        write_plan_json(config.plan_json, decisions, echo)
    return decisions


def merge_statistics(runs: list[str]) -> EmbeddingStatistics:
    """Load every run's statistics and merge them in the order given."""
    merged = load_statistics(runs[0])
    for run in runs[1:]:
        try:
            merged.merge(load_statistics(run))
        except StatisticsMismatchError as exc:
            raise StatisticsMismatchError(f"cannot merge {run} into {runs[0]}: {exc}") from None
    return merged


def merge_samples(runs: list[str]) -> SampleLayers | None:
    """Every run's sample merged (bottom-k: the sample of the union), a layer at a time when
    the run finishes (:func:`~embgeom_ray.core.sample_layers.merged_layers`: the job's process
    holds one layer of it), or None; samples that cannot merge are refused here."""
    dirs = [RunDir(run) for run in runs]
    present = [rd.has_sample() for rd in dirs]
    if not any(present):
        return None
    if not all(present):
        missing = [run for run, ok in zip(runs, present, strict=True) if not ok]
        raise RunError(
            f"runs {missing} have no sample while the others do; they were run "
            "with different sampling options"
        )
    return merged_layers([run_samples(rd) for rd in dirs], runs)


#: the columns of ``samples.parquet`` that say where an occurrence was and what the model saw
OCCURRENCE_COLUMNS = ("key", "doc_id", "window", "position", "content_key")


def sampled_occurrences(run: str) -> set[tuple[int, ...]]:
    """The occurrences of ``run``'s uniform sample, each as :data:`OCCURRENCE_COLUMNS`: its
    first layer's rows of ``samples.parquet`` (every layer holds the same occurrences), those
    columns alone, not the vectors. Empty for a run without one (or of an earlier version,
    whose sample is ``sample.safetensors``, and whose content keys hash the vectors)."""
    rd = RunDir(run)
    header = rd.table_header("samples")
    if header is None or not header.get("layers"):
        return set()
    filters = [("layer", "=", int(header["layers"][0])), ("sample", "=", "uniform")]
    rows = rd.read_arrow("samples", OCCURRENCE_COLUMNS, filters)
    return set(zip(*(rows[c].to_pylist() for c in OCCURRENCE_COLUMNS), strict=True))


def overlap_warnings(runs: list[str]) -> list[str]:
    """A warning for each pair of runs whose uniform samples share occurrences: the same tokens
    at the same place (document id, window, position) of a file of the same name relative to
    its corpus root, i.e. the same documents in both corpora (a copy of the same files, whose
    other modification times kept the corpus fingerprints apart). The merge counts them twice,
    as one run over both copies would; runs over disjoint corpora share none. Bottom-k samples
    of the same key function: an occurrence of both corpora that is in the merged sample is in
    both runs' samples, so a copy large enough to matter to the sample is seen."""
    seen = [sampled_occurrences(run) for run in runs]
    warnings = []
    for j in range(1, len(runs)):
        for i in range(j):
            shared = len(seen[i] & seen[j])
            if shared:
                warnings.append(
                    f"{runs[j]} and {runs[i]} share {shared:,} of their sampled occurrences (the "
                    "same tokens at the same place of files of the same name): their corpora "
                    "hold the same documents (copies of the same files, with other modification "
                    "times?), which the merge counts twice; merge runs over disjoint corpora, or "
                    "run --dedup over the union"
                )
    return warnings


def load_run_tokenizer(manifest: Manifest, tokenizer: str | None) -> Any:
    """The tokenizer that names the token ids: the first run's model (or ``tokenizer``).

    A hub model is loaded at the commit the run resolved; a local directory as it is now. Its
    fingerprint must equal the runs' tokenizer fingerprint, or the token names would be wrong.
    """
    if manifest.model is None:
        raise RunError("the first run's manifest names no model")
    source = tokenizer or manifest.model.id
    revision = None
    if tokenizer is None and not os.path.isdir(source):
        revision = manifest.model.revision or manifest.config.get("revision")
        if str(revision or "").startswith(LOCAL_REVISION):  # a directory's hash, not a commit
            where = "" if os.path.isabs(source) else ", relative to where that run started"
            raise ModelError(
                f"the runs' model is the local directory {source!r}{where}, not found here "
                "(the merge needs its tokenizer to name the token ids); give the tokenizer's "
                "directory with --tokenizer (its fingerprint is checked against the runs')"
            )
    trust = bool(manifest.config.get("trust_remote_code", False))
    tok = load_tokenizer(source, revision, trust)
    expected = manifest.tokenizer.fingerprint if manifest.tokenizer else None
    if expected and tokenizer_fingerprint(tok) != expected:
        raise ModelError(
            f"the tokenizer at {source!r} is not the one the runs used (fingerprint "
            f"{tokenizer_fingerprint(tok)} != {expected}); give the original with --tokenizer"
        )
    return tok


def summed_counts(manifests: list[Manifest]) -> Counts:
    """The runs' counts added up (as the shards' counts of one run over their union), their
    skipped items (the manifest's ``skipped``) with them."""
    return Counts.total(
        (m.counts or Counts()).model_copy(update={"skipped": dict(m.skipped)}, deep=True)
        for m in manifests
    )


def check_arguments(runs: list[str], out: str, overwrite: bool) -> None:
    """Refuse what cannot be merged before reading anything large."""
    if len(runs) < 2:
        raise RunError("give at least two runs to merge")
    keys = [location(r) for r in runs]
    if len(set(keys)) != len(keys):
        raise RunError("the same run is given twice; merging it would count its tokens twice")
    if location(out) in keys:
        raise OutputError(f"--out {out} is one of the runs to merge; write the merge elsewhere")
    check_output(out)
    if RunDir(out).holds_run() and not overwrite and unfinished_merge(out) is None:
        raise OutputError(f"{out} already holds a run; give --overwrite to replace it")


def unfinished_merge(out: str) -> Manifest | None:
    """The manifest at ``out`` when it is a merge that did not finish (a store that failed
    during its final write: :func:`~embgeom_ray.storage.resumable`), which the same merge
    command writes again; else None."""
    with contextlib.suppress(RunDirError):
        manifest = RunDir(out).manifest()
        if manifest.kind == "merge" and not manifest.complete:
            return manifest
    return None


def merge_fingerprint(manifests: list[Manifest]) -> str:
    """A merge's fingerprint: of its runs' fingerprints, in any order."""
    return hashlib.sha256(json.dumps(sorted(m.fingerprint or "" for m in manifests)).encode()).hexdigest()


def merged_manifest(
    runs: list[str], manifests: list[Manifest], config: JobConfig, started_at: str
) -> Manifest:
    """What the runs share (from the first run) and the merge's own corpus and runs."""
    first = manifests[0]
    leaves = [fp for m in manifests for fp in m.corpus.leaves()]
    sources = [m.corpus.source for m in manifests]
    manifest = Manifest(
        status="running",
        kind="merge",
        started_at=started_at,
        fingerprint=merge_fingerprint(manifests),
        config=config.model_dump() | {"corpus": sources},
        corpus=CorpusInfo(
            source=sources,
            fingerprint=hashlib.sha256(json.dumps(sorted(leaves)).encode()).hexdigest(),
            merged_fingerprints=sorted(leaves),
            files=sum(m.corpus.files for m in manifests),
            bytes=sum(m.corpus.bytes for m in manifests),
            shards=sum(m.corpus.shards for m in manifests),
        ),
        layers=first.layers,
        versions=versions(),
        merged_runs=[
            {
                "path": path_key(run),  # absolute: the merge may be read from elsewhere
                "fingerprint": m.fingerprint,
                "corpus": m.corpus.source,
                "corpus_fingerprint": m.corpus.fingerprint,
                "tokens": m.counts.tokens if m.counts else None,
                "finished_at": m.finished_at,
            }
            for run, m in zip(runs, manifests, strict=True)
        ],
    )
    return manifest.set(**{k: getattr(first, k) for k in SHARED_KEYS if k in first.model_fields_set})


def merge_runs(
    runs: list[str],
    out: str,
    *,
    tokenizer: str | None = None,
    echo=print,
    **options: Any,
) -> dict[str, Any]:
    """Merge complete ``runs`` into ``out``; returns the manifest written there.

    ``options`` are ``jobs.merge``'s (:data:`~embgeom_ray.config.MERGE_OPTIONS`: ``min_count``,
    ``reducers``, ``reducer_memory``, ``address``, ``overwrite``, ``plan``, ``plan_json``); the
    others are the first run's. The merge sizes itself as a run's reduce does
    (:func:`~embgeom_ray.sizing.size_reduce`, from the types the runs hold): in this process
    while that is small, else partition by partition on reducer actors
    (:func:`merge_partitioned`), writing the partitioned artefact: the same tables to float64
    rounding. With ``plan`` (or ``plan_json``) it only says so, and returns the plan's numbers
    (:func:`merge_decisions`; nothing is merged or written but the ``plan_json`` file).

    Every file read of the runs is checked against the digest its run recorded
    (:mod:`embgeom_ray.integrity`): a run with a corrupt file is refused, one line naming the
    file (:class:`~embgeom_ray.errors.IntegrityError`, exit status 2 from ``jobs.merge``), and
    ``out`` is not marked complete.
    """
    try:
        return _merge_runs(runs, out, tokenizer=tokenizer, echo=echo, **options)
    except Exception as exc:
        corrupt = integrity_error(exc)
        if corrupt is None or corrupt is exc:
            raise
        raise corrupt from None  # raised on a reducer or a task: its own one-line message


def _merge_runs(
    runs: list[str],
    out: str,
    *,
    tokenizer: str | None = None,
    echo=print,
    **options: Any,
) -> dict[str, Any]:
    unknown = sorted(set(options) - set(MERGE_OPTIONS))
    if unknown:
        raise TypeError(f"merge_runs() got options jobs.merge does not take: {unknown}")
    t0 = time.perf_counter()
    started_at = now()
    runs, out = [r.rstrip("/") for r in runs], out.rstrip("/")
    check_arguments(runs, out, bool(options.get("overwrite")))
    if options.get("plan_json"):  # as an analysis's: not in a submitted job's temporary copy
        check_output(options["plan_json"], "--plan-json file")
    manifests = []
    for run in runs:
        check_input(run, "run")
        with user_errors(run, "run"):
            manifests.append(load_manifest(run))
    check_mergeable(runs, manifests)
    unfinished = None if options.get("overwrite") else unfinished_merge(out)
    if unfinished is not None and unfinished.fingerprint != merge_fingerprint(manifests):
        raise OutputError(
            f"{out} holds an unfinished merge of other runs; give --overwrite to replace it"
        )
    dedup = check_dedup(runs, manifests)
    config = run_config(manifests[0], out, options)
    tok = load_run_tokenizer(manifests[0], tokenizer)
    layers = manifests[0].layers or []
    urls, probe = check_statistics(runs, layers)
    if dedup is None:  # --dedup runs sharing a document are refused above, by its text's key
        for warning in overlap_warnings(runs):
            echo(f"warning: {warning}")
    shape = merge_shape(probe, layers, config, len(tok), [m.sample for m in manifests], runs)
    reduce, seen = size_merge(urls, shape, config, echo)
    if config.plan or config.plan_json:
        return show_merge_plan(shape, reduce, runs, config, echo)
    if reduce.partitioned:  # on the nodes that see the runs and the merge, where local
        reduce = where_seen(reduce, runs, out, shape, len(seen), config, echo)
    t_load = time.perf_counter()
    if reduce.partitioned:
        merged: RunStatistics = merge_partitioned(urls, layers, reduce, seen)
    else:
        merged = StatisticsHere(merge_statistics(runs))
    try:
        with resumable(out, REDOES):  # a store failing while the merge is written: one line
            if options.get("overwrite"):  # the run it replaces, whole: none of it beside ours
                RunDir(out).clear()
            sample = merge_samples(runs)
            t_merge = time.perf_counter()
            run = RunDir(out)
            manifest = merged_manifest(runs, manifests, config, started_at)
            manifest.set(sizing={"reduce": asdict(reduce)})
            run.write_manifest(manifest)
            totals = summed_counts(manifests)
            if dedup is not None:
                run.write_doc_hashes(dedup[0])
                manifest.set(dedup=dedup[1])
            manifest.set(
                layers=merged.layers,
                counts=counts_of(totals, merged),
                skipped=totals.skipped,
                timings_s={"load": round(t_load - t0, 3), "merge": round(t_merge - t_load, 3)},
            )
            finish_run(run, manifest, merged, sample, tok, config, t_start=t0, echo=echo)
    finally:
        merged.close()
    echo(f"merged {len(runs)} runs into {out}")
    return manifest.to_json()
