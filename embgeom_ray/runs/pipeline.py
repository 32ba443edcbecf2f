"""One analysis run, start to finish: plan, extract on Ray, checkpoint, reduce, write.

``analyze(config)`` is what ``python -m jobs.analyze`` runs. The order of events is what makes
a run trustworthy:

1. everything a user can get wrong is checked before any work (model, tokenizer, layers,
   max_length, corpus, output directory);
2. the output directory gets ``run.json`` (fingerprint + plan) and a manifest saying
   ``running``; finished shards of an earlier identical run are reused; with ``--dedup`` the
   driver reads the corpus once more and attaches to each shard the ids of its documents
   that repeat an earlier one (:mod:`~embgeom_ray.inputs.dedup`; derived from the corpus
   alone, so a resumed run leaves out the same ones);
3. shards run on extractor actors, each of which folds many shards into one running
   statistics object; the driver checkpoints each actor's flush (every
   ``--checkpoint-interval`` seconds, and when the queue is drained) as one group of shards;
4. the reduce checks that the checkpoint groups cover every shard exactly once and merges
   them in group-id order (deterministic for a given grouping);
5. the tables, the sampled metrics, the statistics artefact and the sample are written
   atomically, and only then the manifest says ``complete`` (:mod:`.finish`, shared with
   the merge of runs); the checkpoint groups are then removed unless ``--keep-checkpoints``.
   Rerunning the command on a complete run does nothing.

The run directory's files and manifest are :class:`~embgeom_ray.run_dir.RunDir`'s.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd
from tqdm.auto import tqdm

from ..config import JobConfig
from ..core.rogue import OutlierRules, flagged_dims
from ..core.samples import ActivationSample
from ..core.statistics import EmbeddingStatistics, state_bytes
from ..counts import Counts as ShardCounts
from ..counts import unk_warning
from ..distributed.process_memory import sampler
from ..distributed.warm_workers import warm_task_workers
from ..errors import ConfigError, CorpusError
from ..inputs.corpus import CorpusSpec, Shard, ShardPlan, plan_shards
from ..inputs.dedup import HASH, NORMALISATION, DedupPlan, plan_dedup
from ..inputs.model_loading import (
    ModelIdentity,
    load_config,
    max_window_length,
    resolve_identity,
    resolve_layers,
)
from ..io_utils import join
from ..report.plots import FIGURE_GROUPS
from ..run_dir import (
    GROUPS,
    CorpusInfo,
    DedupInfo,
    Manifest,
    ModelInfo,
    RunDir,
    ShardsInfo,
    TokenizerInfo,
    now,
    versions,
)
from .checkpoints import CheckpointGroup, CheckpointStore
from .finish import counts_of, finish_run

if TYPE_CHECKING:  # ray is imported only when there is extraction to do
    from ..distributed.actor_pool import GroupResult, PoolPlan
    from ..distributed.reducers import PartitionedStatistics


def run_fingerprint(
    identity: dict[str, Any], corpus_fingerprint: str, config: JobConfig, layers: list[int]
) -> str:
    payload = {
        "model_fingerprint": identity["model_fingerprint"],
        "tokenizer_fingerprint": identity["tokenizer_fingerprint"],
        "corpus_fingerprint": corpus_fingerprint,
        "options": config.result_options(),
        "layers": layers,
        "clip_dims": identity.get("clip_dims"),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def resolve_clip_dims(config: JobConfig, dim: int) -> list[int] | None:
    """``--clip-dims``, or every dimension flagged in an earlier run's ``dims.parquet``."""
    if config.clip_dims is not None and config.clip_dims_from is not None:
        raise ConfigError("give --clip-dims or --clip-dims-from, not both")
    dims = config.clip_dims
    if config.clip_dims_from is not None:
        path = join(config.clip_dims_from, "dims.parquet")
        try:
            table = pd.read_parquet(path, columns=["layer", "dim", "outlier"])
        except Exception as exc:
            raise ConfigError(
                f"--clip-dims-from {config.clip_dims_from}: cannot read its dims.parquet "
                f"with an 'outlier' column ({type(exc).__name__}: {exc})"
            ) from None
        dims = sorted({d for ds in flagged_dims(table).values() for d in ds})
    if dims is None:
        return None
    bad = [d for d in dims if not 0 <= d < dim]
    if bad:
        raise ConfigError(f"clip dimensions {bad} outside 0..{dim - 1} (hidden size {dim})")
    return sorted(set(dims))


def _progress(total: int, tokens_done: int) -> tqdm:
    return tqdm(
        total=total,
        desc="shards",
        unit="shard",
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=2.0,
        postfix={"tokens": tokens_done},
    )


def _extract(
    config: JobConfig,
    layers: list[int],
    metadata: dict[str, str],
    todo: list[Shard],
    clip_dims: list[int] | None,
    store: CheckpointStore,
) -> PoolPlan:
    """Run ``todo`` on Ray (joined or started by the caller); every flushed group is
    checkpointed on arrival."""
    from ..distributed.actor_pool import run_shards

    bar = _progress(len(todo), 0)
    t0 = time.perf_counter()
    tokens = 0

    def show(shards: int, new_tokens: int) -> None:
        nonlocal tokens
        tokens += new_tokens
        rate = tokens / max(time.perf_counter() - t0, 1e-9)
        bar.set_postfix(tokens=tokens, tok_per_s=f"{rate:,.0f}", refresh=False)
        bar.update(shards)

    def on_group(group: GroupResult) -> None:
        store.save_group(group.shard_ids, group.pieces(), group.sample, group.counts)

    try:
        return run_shards(
            config.extraction,
            config.scheduling,
            layers,
            metadata,
            todo,
            on_group,
            clip_dims,
            on_folded=lambda r: show(1, r.counts.tokens),
            on_requeued=lambda rs: show(-len(rs), -sum(r.counts.tokens for r in rs)),
            on_ready=lambda pool: warm_task_workers(warm_workers_wanted(config, len(layers), pool)),
        )
    finally:
        bar.close()


def warm_workers_wanted(config: JobConfig, layers: int, pool: PoolPlan) -> int:
    """How many task workers to warm while the extractors run
    (:mod:`~embgeom_ray.distributed.warm_workers`): on the private local Ray only, unless
    ``--no-warm-workers``, one per CPU the extractors leave free, and no more than the sampled
    stage (two tasks per layer) and the report's figure groups drawn as tasks will use; 0
    elsewhere. On a machine whose CPUs the extractors hold (a CPU-only run with the default
    pool) that is none: the imports would slow the forward by about what they save later
    (``docs/benchmarks.md``, warm workers)."""
    from ..distributed.cluster import started_private_local

    if config.no_warm_workers or not started_private_local():
        return 0
    import ray

    tasks = (2 * layers if config.sample_size > 0 else 0) + (
        0 if config.no_report else len(FIGURE_GROUPS) - 1
    )
    spare = int(ray.cluster_resources().get("CPU", 0)) - pool.num_workers * pool.num_cpus
    return max(0, min(tasks, spare))


def reduce_groups(
    store: CheckpointStore,
    groups: list[CheckpointGroup],
    merged: EmbeddingStatistics,
    with_sample: bool,
) -> tuple[EmbeddingStatistics, ActivationSample | None, ShardCounts]:
    """Merge the checkpoint ``groups`` into ``merged`` in their (deterministic) order."""
    totals = ShardCounts()
    sample: ActivationSample | None = None
    for group in groups:
        stats, group_sample = store.load_group(group, with_sample)
        merged.merge(stats)
        if group_sample is not None:
            sample = group_sample if sample is None else sample.merge(group_sample)
        totals.add(group.counts)
    return merged, sample, totals


def reducer_count(config: JobConfig, spec: RunSpec, types: int) -> int:
    """``--reducers``, or more when ``--reducer-memory`` needs more for ``types`` token types
    (:func:`~embgeom_ray.distributed.reducers.reducers_for`)."""
    from ..distributed.reducers import reducers_for

    if config.reducer_memory is None:
        return config.reducers
    clip = len(spec.clip_dims) if spec.clip_dims else 0
    need = reducers_for(
        config.reducer_memory, len(spec.layers), spec.identity.hidden_size, types, config.max_length, clip
    )
    return max(config.reducers, need)


def start_reducers_early(config: JobConfig, store: CheckpointStore) -> list[Any]:
    """The run's ``--reducers`` reducer actors, started before the extraction so that their
    processes and imports are ready when the reduce begins (they get their plan then, from
    the types seen: :func:`reduce_partitioned`). ``--reducer-memory`` may need more; those
    start at the reduce."""
    from ..distributed.cluster import connect
    from ..distributed.reducers import check_memory_offered, start_reducers

    connect(config.address)
    if config.reducer_memory:
        check_memory_offered(config.reducer_memory)
    checkpoint = (store.reducer_dir(), config.checkpoint_interval)
    return start_reducers(config.reducers, memory=config.reducer_memory, checkpoint=checkpoint)


def reduce_partitioned(
    store: CheckpointStore,
    groups: list[CheckpointGroup],
    spec: RunSpec,
    started: Sequence[Any] = (),
) -> tuple[PartitionedStatistics, ActivationSample | None, ShardCounts]:
    """The checkpoint ``groups`` merged by ``--reducers`` reducer actors, each holding a
    partition of the statistics (:mod:`~embgeom_ray.distributed.reducers`; ``started``:
    reducers already started, :func:`start_reducers_early`); the sample and the counts merged
    here, in group order."""
    from ..distributed.cluster import connect
    from ..distributed.reducers import PartitionedStatistics, PartitionPlan, seen_type_ids

    config = spec.config
    connect(config.address)
    urls = [url for g in groups for url in store.group_urls(g)]
    seen = seen_type_ids(urls)
    reducers = reducer_count(config, spec, len(seen))
    saved = store.reducer_plan()
    plan = None if saved is None else PartitionPlan.from_json(saved)
    if plan is None or plan.reducers != reducers or list(plan.layers) != spec.layers:
        # ranges of equal numbers of the ids seen; kept for the run, so that the reducers'
        # checkpoints stay usable when a resumed run adds groups
        plan = PartitionPlan.balanced(reducers, seen, spec.layers)
        store.save_reducer_plan(plan.to_json())
    merged = PartitionedStatistics(
        plan,
        urls,
        memory=config.reducer_memory,
        checkpoint_dir=store.reducer_dir(),
        checkpoint_seconds=config.checkpoint_interval,
        started=started,
    )
    totals = ShardCounts()
    sample: ActivationSample | None = None
    for group in groups:
        if spec.config.sample_size > 0:
            part = store.load_sample(group)
            sample = part if sample is None else sample.merge(part)
        totals.add(group.counts)
    return merged, sample, totals


@dataclass
class RunSpec:
    """Everything decided before any work: what is measured, over what, and its fingerprint."""

    config: JobConfig
    identity: ModelIdentity
    tokenizer: Any
    layers: list[int]
    clip_dims: list[int] | None
    plan: ShardPlan
    identity_json: dict[str, Any]
    fingerprint: str

    @property
    def metadata(self) -> dict[str, str]:
        """What every statistics object of the run carries (checked before any merge)."""
        return {
            "model_fingerprint": self.identity.model_fingerprint,
            "tokenizer_fingerprint": self.identity.tokenizer_fingerprint,
            "keep_special": str(self.config.keep_special),
            "model": self.identity.model,
            "revision": str(self.identity.revision),
        }

    def empty_statistics(self) -> EmbeddingStatistics:
        """The statistics the reduce starts from (the run's precision and identity)."""
        return EmbeddingStatistics(
            self.layers,
            self.identity.hidden_size,
            max_positions=self.config.max_length,
            metadata=self.metadata,
            clip_dims=self.clip_dims,
            comoment_precision=self.config.comoment_precision,
        )


def check_worker_memory(config: JobConfig, layers: int, dim: int) -> None:
    """``--worker-memory`` must leave room for token types beyond the fixed per-layer state
    (:func:`~embgeom_ray.core.statistics.state_bytes` with no types)."""
    budget = config.worker_memory
    if budget is None:
        return
    fixed = state_bytes(layers, dim, 0, config.max_length)
    if budget <= fixed:
        raise ConfigError(
            f"--worker-memory {budget:,} bytes is not more than the fixed per-layer state of "
            f"the statistics, {fixed:,} bytes for {layers} layers of d = {dim} and "
            f"{config.max_length} positions (8·L·(d² + 3d + P·(d+1) + 2)); give more, or "
            "measure fewer layers"
        )


def prepare(config: JobConfig) -> RunSpec:
    """Check everything a user can get wrong (model, tokenizer, max_length, layers, clip dims,
    corpus) before any work, and plan the shards."""
    identity, tokenizer = resolve_identity(config.model, config.revision, config.trust_remote_code)
    limit = max_window_length(
        load_config(config.model, config.revision, config.trust_remote_code), tokenizer
    )
    if limit is not None and config.max_length > limit:
        raise ConfigError(
            f"--max-length {config.max_length} exceeds what {config.model!r} accepts ({limit} positions)"
        )
    layers = resolve_layers(config.layers, identity.num_layers)
    clip_dims = resolve_clip_dims(config, identity.hidden_size)
    check_worker_memory(config, len(layers), identity.hidden_size)
    if config.reducer_memory is not None:  # room for one layer's state per reducer, at least
        from ..distributed.reducers import reducers_for

        reducers_for(config.reducer_memory, len(layers), identity.hidden_size, 0, config.max_length)
    plan = plan_shards(CorpusSpec(config.corpus, config.text_column, config.split), config.shard_bytes)
    identity_json = identity.to_json() | {
        "corpus": config.corpus,
        "corpus_fingerprint": plan.fingerprint,
        "options": config.result_options(),
        "layers": layers,
        "clip_dims": clip_dims,
    }
    fingerprint = run_fingerprint(identity_json, plan.fingerprint, config, layers)
    return RunSpec(config, identity, tokenizer, layers, clip_dims, plan, identity_json, fingerprint)


def start_manifest(spec: RunSpec, started_at: str) -> Manifest:
    """The manifest of a run that has started (status ``running``)."""
    config, identity = spec.config, spec.identity
    return Manifest(
        status="running",
        started_at=started_at,
        fingerprint=spec.fingerprint,
        config=config.model_dump(),
        model=ModelInfo(
            id=identity.model,
            revision=identity.revision,
            model_fingerprint=identity.model_fingerprint,
            model_type=identity.model_type,
            num_layers=identity.num_layers,
            hidden_size=identity.hidden_size,
        ),
        tokenizer=TokenizerInfo(
            class_=type(spec.tokenizer).__name__,
            fingerprint=identity.tokenizer_fingerprint,
            special_ids=sorted(spec.tokenizer.all_special_ids),
            special_tokens_counted=config.keep_special,
        ),
        corpus=CorpusInfo(
            source=config.corpus,
            fingerprint=spec.plan.fingerprint,
            files=len(spec.plan.files),
            bytes=spec.plan.total_bytes,
            shards=len(spec.plan.shards),
        ),
        layers=spec.layers,
        clip_dims=spec.clip_dims,
        outlier_rules=OutlierRules.of(config.tables).describe(),
        versions=versions(),
    )


#: options that only decide how a run is scheduled, never what its tables hold
SCHEDULING_OPTIONS = frozenset({
    "out", "overwrite", "num_workers", "cpus_per_worker", "batch_tokens", "docs_per_chunk",
    "device", "max_shard_retries", "checkpoint_interval", "keep_checkpoints", "address",
    "reducers", "reducer_memory", "worker_memory", "gpus_per_worker",
})  # fmt: skip


def already_complete(run: RunDir, fingerprint: str) -> Manifest | None:
    """The manifest of a complete run of this fingerprint whose checkpoints were removed."""
    if run.has(GROUPS) or not run.has_statistics() or not run.has_manifest():
        return None
    manifest = run.manifest()
    return manifest if manifest.complete and manifest.fingerprint == fingerprint else None


def changed_table_options(manifest: Manifest, config: JobConfig) -> list[str]:
    """Options of ``config`` that differ from the complete run's and change only its tables
    (the statistics and sample are the same: the fingerprint matched)."""
    current = config.model_dump()
    return sorted(
        k for k in current if k not in SCHEDULING_OPTIONS and manifest.config.get(k) != current[k]
    )


def reuse_complete(
    run: RunDir, done: Manifest, spec: RunSpec, t_start: float, echo
) -> dict[str, Any]:
    """A rerun of a complete run: nothing to do, or its tables again for changed options."""
    changed = changed_table_options(done, spec.config)
    if not changed:
        echo(f"{run.url} already holds this complete run; nothing to do (--overwrite redoes it)")
        return done.to_json()
    echo(
        f"{run.url} holds this complete run; its tables are rebuilt from its statistics and "
        f"sample for the changed options: {', '.join(changed)}"
    )
    return retable(run, done, spec, t_start, echo)


def retable(run: RunDir, done: Manifest, spec: RunSpec, t_start: float, echo) -> dict[str, Any]:
    """A complete run's tables again from its own artefacts, under ``spec.config``'s table
    options (``--min-count``, outlier rules, K-means, LID, …): no extraction. With
    ``--reducers R > 1`` the artefact is read partition by partition by reducer actors (never
    whole in this process) and written back partitioned."""
    config = spec.config
    if config.partitioned:  # the artefact read partition by partition, never whole here
        from ..distributed.cluster import connect
        from ..distributed.reducers import PartitionedStatistics, PartitionPlan, seen_type_ids

        connect(config.address)
        url = run.statistics_url()
        seen = seen_type_ids([url])
        plan = PartitionPlan.balanced(reducer_count(config, spec, len(seen)), seen, spec.layers)
        merged: EmbeddingStatistics | PartitionedStatistics = PartitionedStatistics(
            plan, [url], memory=config.reducer_memory
        )
    else:
        merged = run.load_statistics()
    try:
        return _retable(run, done, spec, merged, t_start, echo)
    finally:
        if config.partitioned:
            merged.close()


def _retable(
    run: RunDir,
    done: Manifest,
    spec: RunSpec,
    merged: EmbeddingStatistics | PartitionedStatistics,
    t_start: float,
    echo,
) -> dict[str, Any]:
    config = spec.config
    sample = run.load_sample()
    manifest = Manifest.model_validate(done.to_json()).set(
        status="running",
        started_at=now(),
        config=config.model_dump(),
        outlier_rules=OutlierRules.of(config.tables).describe(),
        timings_s={"plan": round(time.perf_counter() - t_start, 3)},
    )
    run.write_manifest(manifest)
    finish_run(run, manifest, merged, sample, spec.tokenizer, config, t_start=t_start, echo=echo)
    return manifest.to_json()


def analyze(config: JobConfig, *, echo=print) -> dict[str, Any]:
    """Run the whole analysis for ``config``; returns the manifest written to ``config.out``."""
    t_start = time.perf_counter()
    started_at = now()
    sampler()  # the driver's peak private memory, for the manifest
    spec = prepare(config)
    t_plan = time.perf_counter()
    run, store = RunDir(config.out), CheckpointStore(config.out)
    plan, resumed = store.start(spec.fingerprint, spec.identity_json, spec.plan, config.overwrite)
    done_before = already_complete(run, spec.fingerprint) if resumed else None
    if done_before is not None:
        return reuse_complete(run, done_before, spec, t_start, echo)
    t_dedup0 = time.perf_counter()
    plan, dedup = dedup_shards(config, plan, echo)
    t_dedup = time.perf_counter() - t_dedup0
    manifest = start_manifest(spec, started_at)
    run.write_manifest(manifest)

    done = store.done_shards() & {s.shard_id for s in plan.shards}
    todo = [s for s in plan.shards if s.shard_id not in done]
    if resumed:
        echo(f"resuming {config.out}: {len(done)} of {len(plan.shards)} shards already done")
    t_ray0 = time.perf_counter()
    if todo:  # Ray is joined or started here, on its own clock (~5 s for a private local Ray)
        from ..distributed.cluster import connect

        connect(config.address)
    t_extract0 = time.perf_counter()
    early = start_reducers_early(config, store) if config.partitioned and todo else []
    try:
        pool = _extract(config, spec.layers, spec.metadata, todo, spec.clip_dims, store) if todo else None
        t_extract1 = time.perf_counter()
        groups = store.groups_covering(s.shard_id for s in plan.shards)
        if config.partitioned:
            merged, sample, totals = reduce_partitioned(store, groups, spec, early)
    except BaseException:
        if early:  # reducers started for a reduce that will not happen
            from ..distributed.reducers import stop_reducers

            stop_reducers(early)
        raise
    if not config.partitioned:
        merged, sample, totals = reduce_groups(
            store, groups, spec.empty_statistics(), config.sample_size > 0
        )
    try:
        t_reduce = time.perf_counter()
        check_not_empty(merged, totals, config.corpus)
        warning = unk_warning(totals, spec.tokenizer.unk_token)
        if warning:
            echo(warning)
        if dedup is not None:
            manifest.set(dedup=dedup_info(dedup, totals, config.corpus))
            run.write_doc_hashes(dedup.hashes)
        manifest.set(
            counts=counts_of(totals, merged),
            skipped=totals.skipped,
            shards=ShardsInfo(
                total=len(plan.shards),
                reused_from_checkpoints=len(done),
                computed=len(todo),
                checkpoint_groups=len(groups),
            ),
            workers=None if pool is None else pool.__dict__,
            timings_s={
                "plan": round(t_plan - t_start, 3),
                **({"dedup": round(t_dedup, 3)} if dedup is not None else {}),
                "ray_start": round(t_extract0 - t_ray0, 3),
                "extract_wall": round(t_extract1 - t_extract0, 3),
                "extract_forward_sum": round(totals.forward_seconds, 3),
                "extract_fold_sum": round(totals.fold_seconds, 3),
                "reduce": round(t_reduce - t_extract1, 3),
            },
            throughput={
                "tokens_per_s_extract_wall": throughput(totals, resumed, t_extract1 - t_extract0)
            },
        )
        finish_run(run, manifest, merged, sample, spec.tokenizer, config, t_start=t_start, echo=echo)
    finally:
        if config.partitioned:
            merged.close()
    if not config.keep_checkpoints:
        store.remove_groups()
    return manifest.to_json()


def dedup_shards(
    config: JobConfig, plan: ShardPlan, echo=print
) -> tuple[ShardPlan, DedupPlan | None]:
    """With ``--dedup``: ``plan`` with each shard's duplicate documents to leave out, and the
    dedup plan (read from the corpus in the driver); otherwise ``plan`` unchanged."""
    if not config.dedup:
        return plan, None
    dedup = plan_dedup(plan, CorpusSpec(config.corpus, config.text_column, config.split))
    echo(
        f"--dedup: {dedup.duplicates_dropped:,} of {dedup.documents_read:,} documents repeat "
        f"an earlier one and are left out; {dedup.distinct_kept:,} distinct documents kept"
    )
    return dedup.apply(plan), dedup


def dedup_info(dedup: DedupPlan, totals: ShardCounts, corpus: str) -> DedupInfo:
    """The manifest's ``dedup``, once the extractors' counts confirm the plan's."""
    if (totals.documents, totals.duplicates) != (dedup.distinct_kept, dedup.duplicates_dropped):
        raise CorpusError(
            f"the corpus {corpus} changed during the run: the extractors read "
            f"{totals.documents} documents and left out {totals.duplicates} duplicates, the "
            f"plan kept {dedup.distinct_kept} and dropped {dedup.duplicates_dropped}; rerun "
            "with --overwrite"
        )
    return DedupInfo(
        documents_read=dedup.documents_read,
        duplicates_dropped=dedup.duplicates_dropped,
        distinct_kept=dedup.distinct_kept,
        normalisation=NORMALISATION,
        hash=HASH,
    )


def throughput(totals: ShardCounts, resumed: bool, extract_s: float) -> float | None:
    """Tokens per second of the extraction stage's wall time (None for a resumed run, whose
    tokens were partly counted before)."""
    if resumed or not totals.tokens or extract_s <= 0:
        return None
    return round(totals.tokens / extract_s, 1)


def check_not_empty(merged: EmbeddingStatistics | PartitionedStatistics, totals: ShardCounts, corpus: str) -> None:
    """A :class:`CorpusError` when no token was counted, with what was read and skipped."""
    if merged.token_count() == 0:
        skipped = ", ".join(f"{v} {k}" for k, v in sorted(totals.skipped.items())) or "none"
        raise CorpusError(
            f"the corpus {corpus} produced no tokens to measure "
            f"({totals.documents} documents read; skipped: {skipped})"
        )
