"""One analysis run, start to finish: plan, extract on Ray, checkpoint, reduce, write.

``analyze(config)`` is what ``python -m jobs.analyze`` runs. The order of events is what makes
a run trustworthy:

1. everything a user can get wrong is checked before any work (model, tokenizer, layers,
   max_length, corpus, output directory), and the job sizes itself from the model's shape, the
   corpus and Ray's view of the cluster (:mod:`~embgeom_ray.sizing`: the extractors, the
   reduce, every process's memory; printed once, recorded in the manifest's ``sizing``;
   ``--plan`` stops here), refusing what cannot fit;
2. the output directory gets ``run.json`` (fingerprint + plan) and a manifest saying
   ``running``; finished shards of an earlier identical run are reused; with ``--dedup`` the
   driver reads the corpus once more and attaches to each shard the ids of its documents
   that repeat an earlier one (:mod:`~embgeom_ray.inputs.dedup`; derived from the corpus
   alone, so a resumed run leaves out the same ones);
3. shards run on extractor actors, each of which folds many shards into one running
   statistics object; the driver checkpoints each actor's flush (every
   ``--checkpoint-interval`` seconds, and when the queue is drained) as one group of shards;
4. the reduce checks that the checkpoint groups cover every shard exactly once and merges
   them in group-id order (deterministic for a given grouping), in the job's own process or
   on reducer actors as the sizing decides for the types the groups hold;
5. the tables, the sampled metrics, the statistics artefact and the sample are written
   atomically, and only then the manifest says ``complete`` (:mod:`.finish`, shared with
   the merge of runs); the checkpoint groups are then removed unless ``--keep-checkpoints``.
   Rerunning the command on a complete run does nothing.

The run directory's files and manifest are :class:`~embgeom_ray.run_dir.RunDir`'s.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from tqdm.auto import tqdm

from .. import progress
from ..config import SCHEDULING_OPTIONS, JobConfig
from ..core.options import sample_entries
from ..core.rogue import OutlierRules, flagged_dims
from ..core.sample_layers import SampleLayers, sample_layers
from ..core.statistics import EmbeddingStatistics
from ..counts import Counts, skipped_warning, unk_warning
from ..distributed.process_memory import sampler
from ..distributed.warm_workers import AFTER_S as WARM_AFTER_S
from ..distributed.warm_workers import modules_for, warm_task_workers
from ..errors import ConfigError, CorpusError, IntegrityError, OutputError
from ..inputs.corpus import (
    CorpusSpec,
    Shard,
    ShardPlan,
    column_notices,
    has_magic,
    ignored_notices,
    plain_text_bytes,
    plan_shards,
    shard_rule,
    token_work,
)
from ..inputs.dedup import HASH, NORMALISATION, DedupPlan, plan_dedup
from ..inputs.model_loading import (
    ModelIdentity,
    load_config,
    max_window_length,
    resolve_identity,
    resolve_layers,
    weight_bytes,
)
from ..integrity import Digest, digests_from_json, digests_json, integrity_error
from ..io_utils import atomic_write_bytes, join, path_key, within
from ..report.figure_groups import FIGURE_GROUPS
from ..run_dir import (
    DOC_HASHES,
    GROUPS,
    MANIFEST,
    PARTS_INDEX,
    RUN_ENTRIES,
    RUN_JSON,
    STATISTICS,
    STATISTICS_PARTS,
    CorpusInfo,
    DedupInfo,
    Manifest,
    ModelInfo,
    Outputs,
    RunDir,
    ShardsInfo,
    TokenizerInfo,
    now,
    versions,
)
from ..sizing import (
    Cluster,
    CorpusShape,
    Reduce,
    Shape,
    Sizing,
    check_device,
    describe_plan,
    run_shape,
    size_job,
    size_reduce,
)
from ..sizing.checkpoints import (
    EXTRACTORS,
    FLOOR_S,
    Pacer,
    decide_writers,
    needs_check,
    writers_for,
)
from ..storage import check_output, resumable, user_errors
from .checkpoints import CheckpointGroup, CheckpointStore, GroupFiles, write_group
from .finish import RunStatistics, StatisticsHere, counts_of, finish_run
from .run_samples import run_samples

if TYPE_CHECKING:  # ray is imported only when there is work to do
    from ..distributed.actor_pool import FoldReport, GroupResult, PoolPlan
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
        try:  # checked against the digest that run recorded, as every read of a run
            table = RunDir(config.clip_dims_from).read_table("dims", ["layer", "dim", "outlier"])
        except IntegrityError:
            raise
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
    return progress.bar(total=total, desc="shards", unit="shard", postfix={"tokens": tokens_done})


def _extract(
    spec: RunSpec,
    sizing: Sizing,
    todo: list[Shard],
    store: CheckpointStore,
    on_ready: Any,
    pacer: Pacer,
    on_requested: Any = None,
) -> PoolPlan:
    """Run ``todo`` on Ray (joined by :func:`size_run`) on the pool ``sizing`` decided, grown
    and shrunk as nodes join and leave (one line on stderr each time); every flushed group is
    checkpointed on arrival, its bytes and the seconds its write took told to ``pacer``, which
    sets the checkpoint interval (a line when it changes by a quarter or more);
    ``on_ready(pool)`` once the first extractor is ready, ``on_requested(pool)`` once the first
    extractors are asked for."""
    from ..distributed.actor_pool import run_shards

    config = spec.config
    bar = _progress(len(todo), 0)
    t0 = time.perf_counter()
    tokens = 0

    def show(shards: int, new_tokens: int) -> None:
        nonlocal tokens
        tokens += new_tokens
        rate = tokens / max(time.perf_counter() - t0, 1e-9)
        bar.set_postfix(tokens=tokens, tok_per_s=f"{rate:,.0f}", refresh=False)
        bar.update(shards)

    said = [pacer.last]

    def on_group(group: GroupResult) -> None:
        fill = group.age_s if group.budget else None
        if group.written is not None:  # the extractor wrote the files: commit them
            files = GroupFiles.from_json(group.written)
            store.commit_group(files, group.counts)
            pacer.wrote(
                files.nbytes, group.write_s, group.last, budget_fill_s=fill, age_s=group.age_s
            )
        else:
            t0 = time.perf_counter()
            saved = store.save_group(group.shard_ids, group.pieces(), group.sample, group.counts)
            nbytes = sum(d.size for d in saved.digests.values())
            write_s = time.perf_counter() - t0
            pacer.wrote(nbytes, write_s, group.last, budget_fill_s=fill, age_s=group.age_s)
        if pacer.given is None:
            now = pacer.interval(max(1, pacer.extractors))
            if said[0] is None or abs(now - said[0]) >= 0.25 * said[0]:
                said[0] = now
                on_resized(f"checkpoints: every {pacer.reason()}")
        news = pacer.budget_news()  # the statistics budget, not the interval, sets the flushes
        if news is not None:
            on_resized(news)

    def on_folded(report: FoldReport) -> None:
        show(1, report.counts.tokens)
        pacer.folded(report.seconds)
        news = pacer.shard_news()  # the shards, not the interval, set the flushes
        if news is not None:
            on_resized(news)

    on_resized = progress.notice  # the pool grew or shrank, the interval moved: above the bar

    def on_unseen(node: str, why: str) -> None:  # an extractor does not see the local run
        pacer.fall_back(decide_writers(config.out, [(node, why)])[1])
        on_resized(f"checkpoints: {pacer.writers_line()} from now on")

    # where the extractors are to write their own flushes on a local path, each checks first
    # that its node sees the run as this process writes it (embgeom_ray/shared_out.py)
    marker = (
        store.write_marker() if pacer.writers == EXTRACTORS and needs_check(config.out) else None
    )
    try:
        return run_shards(
            config.extraction,
            config.scheduling,
            spec.layers,
            spec.metadata,
            todo,
            on_group,
            spec.clip_dims,
            on_folded=on_folded,
            on_requeued=lambda rs: show(-len(rs), -sum(r.counts.tokens for r in rs)),
            on_ready=on_ready,
            on_requested=on_requested,
            pool=sizing.pool,
            on_resized=on_resized,
            interval=pacer.interval,
            checkpoint_writer=functools.partial(write_group, store.absolute_out())
            if pacer.writers == EXTRACTORS
            else None,
            out_marker=marker,
            on_unseen=on_unseen,
            ceiling=pacer.ceiling if pacer.given is None else None,
        )
    finally:
        bar.close()
        if marker is not None:
            store.remove_marker(marker)
        if pacer.writers == EXTRACTORS and needs_check(config.out):  # every extractor saw it
            pacer.writers_why = decide_writers(config.out)[1]


def warm_workers_wanted(config: JobConfig, layers: int) -> int:
    """How many task workers to warm while the extractors run
    (:mod:`~embgeom_ray.distributed.warm_workers`): on the private local Ray only, unless
    ``--no-warm-workers``, one per CPU of the machine (the most of the stage's one-CPU tasks
    that run at once), and no more than the sampled stage (two tasks per layer) and the
    report's figure groups drawn as tasks will use; 0 elsewhere. Where the extractors hold
    every CPU too: the warm-ups import at idle priority, on the CPU time the extractors
    leave."""
    from ..distributed.cluster import started_private_local

    if config.no_warm_workers or not started_private_local():
        return 0
    import ray

    tasks = (2 * layers if config.sample_size > 0 else 0) + (
        0 if config.no_report else len(FIGURE_GROUPS) - 1
    )
    return max(0, min(tasks, int(ray.cluster_resources().get("CPU", 0))))


def warm_for_run(config: JobConfig, layers: int) -> None:
    """Warm :func:`warm_workers_wanted` task workers :data:`WARM_AFTER_S` s from now, each
    importing what this run's tasks will (:func:`~embgeom_ray.distributed.warm_workers.modules_for`:
    no matplotlib nor figure modules for a run with ``--no-report``)."""
    warm_task_workers(
        warm_workers_wanted(config, layers), after_s=WARM_AFTER_S,
        modules=modules_for(config.sample_size > 0, not config.no_report),
    )  # fmt: skip


def reduce_groups(
    store: CheckpointStore,
    groups: list[CheckpointGroup],
    merged: EmbeddingStatistics,
    with_sample: bool,
) -> tuple[EmbeddingStatistics, SampleLayers | None, Counts]:
    """Merge the checkpoint ``groups`` into ``merged`` in their (deterministic) order; their
    samples are merged a layer at a time when the run finishes (:func:`group_samples`)."""
    totals = Counts()
    for group in groups:
        stats, _ = store.load_group(group, with_sample=False)
        merged.merge(stats)
        totals.add(group.counts)
    return merged, group_samples(store, groups) if with_sample else None, totals


def group_samples(store: CheckpointStore, groups: list[CheckpointGroup]) -> SampleLayers | None:
    """The checkpoint ``groups``' samples, merged in group order a layer at a time
    (:func:`~embgeom_ray.core.sample_layers.sample_layers`): the job's process never holds the
    whole merged sample."""
    return sample_layers([store.sample_url(group) for group in groups])


def start_reducers_early(reduce: Reduce, store: CheckpointStore, interval: float) -> list[Any]:
    """The reducers that fit beside the extractors (``reduce.early``, :mod:`~embgeom_ray.sizing`),
    started while the extraction runs so that their processes and imports are ready when the
    reduce begins (they get their plan then, from the types seen: :func:`reduce_partitioned`).
    The rest start at the reduce."""
    from ..distributed.reducers import start_reducers

    if not reduce.partitioned or not reduce.early:
        return []
    checkpoint = (store.reducer_dir(), interval)
    return start_reducers(
        reduce.early, memory=reduce.memory, checkpoint=checkpoint, nodes=reduce.early_nodes
    )


def reducer_checkpoint_seconds(config: JobConfig, pacer: Pacer | None) -> float:
    """How often reducers checkpoint their partitions while reading groups: the option, else
    the extractors' interval last chosen (else its floor)."""
    if config.checkpoint_interval is not None:
        return config.checkpoint_interval
    return (pacer.last if pacer is not None else None) or FLOOR_S


def reduce_partitioned(
    store: CheckpointStore,
    groups: list[CheckpointGroup],
    spec: RunSpec,
    reduce: Reduce,
    seen: Any,
    started: Sequence[Any] = (),
    pacer: Pacer | None = None,
) -> tuple[PartitionedStatistics, SampleLayers | None, Counts]:
    """The checkpoint ``groups`` merged by ``reduce.count`` reducer actors, each holding a
    partition of the statistics (:mod:`~embgeom_ray.distributed.reducers`; ``seen``: the
    token ids the groups hold; ``started``: reducers already started,
    :func:`start_reducers_early`); the counts summed here, the samples merged a layer at a
    time when the run finishes (:func:`group_samples`)."""
    from ..distributed.reducers import PartitionedStatistics, PartitionPlan

    config = spec.config
    urls = [url for g in groups for url in store.group_urls(g)]
    saved = store.reducer_plan()
    plan = None if saved is None else PartitionPlan.from_json(saved)
    if plan is None or plan.reducers != reduce.count or list(plan.layers) != spec.layers:
        # ranges of equal numbers of the ids seen; kept for the run, so that the reducers'
        # checkpoints stay usable when a resumed run adds groups
        plan = PartitionPlan.balanced(reduce.count, seen, spec.layers)
        store.save_reducer_plan(plan.to_json())
    merged = PartitionedStatistics(
        plan,
        urls,
        memory=reduce.memory,
        checkpoint_dir=store.reducer_dir(),
        checkpoint_seconds=reducer_checkpoint_seconds(config, pacer),
        started=started,
        nodes=reduce.nodes,
        pinned=reduce.pinned,
    )
    totals = Counts()
    for group in groups:
        totals.add(group.counts)
    sample = group_samples(store, groups) if spec.config.sample_size > 0 else None
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
    #: what the memory of the run's processes depends on (:mod:`~embgeom_ray.sizing`)
    shape: Shape
    #: hidden states the model has (blocks + 1): the layers it could measure
    total_layers: int

    @property
    def corpus_shape(self) -> CorpusShape:
        """The corpus as the sizing sees it: its bytes and shards."""
        return CorpusShape(
            self.config.corpus,
            len(self.plan.files),
            self.plan.total_bytes,
            len(self.plan.shards),
            tuple(plain_text_bytes(s) for s in self.plan.shards),
            self.plan.shard_bytes,
            "--shard-bytes"
            if self.config.shard_bytes is not None
            else shard_rule(token_work(self.identity.num_layers, self.identity.hidden_size)),
        )

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


def prepare(config: JobConfig) -> RunSpec:
    """Check everything a user can get wrong (model, tokenizer, max_length, layers, clip dims,
    corpus, an object store's output location) before any work, and plan the shards. A
    ``--plan-json`` file is checked as the output is (:func:`~embgeom_ray.storage.check_output`):
    a relative path in a submitted job's working directory would be written where Ray removes
    it, after the plan said where it was."""
    check_output(config.out)
    if config.plan_json:
        check_output(config.plan_json, "--plan-json file")
    identity, tokenizer = resolve_identity(config.model, config.revision, config.trust_remote_code)
    model_config = load_config(config.model, config.revision, config.trust_remote_code)
    limit = max_window_length(model_config, tokenizer)
    if limit is not None and config.max_length > limit:
        raise ConfigError(
            f"--max-length {config.max_length} exceeds what {config.model!r} accepts ({limit} positions)"
        )
    layers = resolve_layers(config.layers, identity.num_layers)
    clip_dims = resolve_clip_dims(config, identity.hidden_size)
    sample = sum(sample_entries(config.sample_size, config.sample_type_size))
    # the corpus before the weights: building the model's empty copy imports its modeling code
    # (seconds), so a mistyped corpus is refused without waiting for it
    plan = plan_shards(
        CorpusSpec(config.corpus, config.text_column, config.split), config.shard_bytes,
        token_work(identity.num_layers, identity.hidden_size),
    )  # fmt: skip
    check_apart(config.corpus, plan.files, config.out)
    shape = run_shape(
        model_config, layers=len(layers), positions=config.max_length, vocab=len(tokenizer),
        clip=len(clip_dims or []), sample_entries=sample, dtype=config.dtype, name=config.model,
        store=config.out, sample_points=config.sample_size, sampled=config.sampled,
        weight_bytes=weight_bytes(
            config.model, config.revision, config.dtype, config.trust_remote_code
        ),
    )  # fmt: skip
    identity_json = identity.to_json() | {
        "corpus": config.corpus,
        "corpus_fingerprint": plan.fingerprint,
        "options": config.result_options(),
        "layers": layers,
        "clip_dims": clip_dims,
    }
    fingerprint = run_fingerprint(identity_json, plan.fingerprint, config, layers)
    return RunSpec(
        config, identity, tokenizer, layers, clip_dims, plan, identity_json, fingerprint, shape,
        identity.num_layers + 1,
    )  # fmt: skip


#: files a run writes under its ``--out``, as a glob corpus would see them (:func:`check_apart`)
RUN_FILE_EXAMPLES = (
    RUN_JSON, MANIFEST, "layers.parquet", "groups/f0-b0000-n1.json",
    "groups/f0-b0000-n1.safetensors", "statistics.safetensors", "statistics/index.json",
    "report.html", "plots/layers.png", "doc_hashes.npy",
)  # fmt: skip


def check_apart(corpus: str, files: list[str], out: str) -> None:
    """Refuse an ``--out`` where the run would mix with its corpus: where a rerun of the same
    command (to resume, or on a schedule) would read the run's own files as corpus (``--out``
    in a corpus directory, which is read recursively, or where a glob corpus matches the
    files a run writes), or where a file of the corpus lies under an entry a run writes
    (:data:`~embgeom_ray.run_dir.RUN_ENTRIES`, which ``--overwrite`` removes). A corpus in
    ``--out`` otherwise (a file of its own, a directory beside the run's) is left alone."""
    if corpus.startswith("hf:"):
        return
    if has_magic(corpus):
        matches = _glob_matcher(path_key(corpus))
        seen = next((n for n in RUN_FILE_EXAMPLES if matches(path_key(join(out, n)))), None)
        if seen is not None:
            raise ConfigError(
                f"--out {out}: the corpus {corpus} would match the run's own files there (its "
                f"{seen}) when it runs again: write the run elsewhere"
            )
    elif within(out, corpus) and _is_directory(corpus):
        raise ConfigError(
            f"--out {out} is inside the corpus directory {corpus}, whose files are read "
            "recursively: the run's own tables would be read as corpus when it runs again; "
            "write it outside the corpus"
        )
    root = path_key(out).rstrip("/") + "/"
    for file in files:
        place = path_key(file)
        entry = place[len(root) :].split("/", 1)[0] if place.startswith(root) else None
        if entry in RUN_ENTRIES:
            raise ConfigError(
                f"--out {out} holds the corpus file {file} as {entry}, a name the run writes "
                "there (--overwrite would remove it): write the run elsewhere"
            )


def _glob_matcher(pattern: str):
    """Whether a path matches the glob ``pattern`` as fsspec lists it (``*`` within a path
    component, ``**`` across them)."""
    try:
        from fsspec.utils import glob_translate
    except ImportError:  # an fsspec before glob_translate: fnmatch's ``*`` crosses "/" too
        from fnmatch import fnmatchcase

        return lambda path: fnmatchcase(path, pattern)
    return re.compile(glob_translate(pattern)).match


def _is_directory(url: str) -> bool:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    return bool(fs.isdir(path))


def size_run(spec: RunSpec, echo=print) -> Sizing:
    """Every decision of the run before any work (:func:`~embgeom_ray.sizing.size_job`: the
    extractors, the reduce, each process's memory), from its shape, its corpus and Ray's view
    of the cluster (joined here), printed once. Refuses what cannot fit."""
    from ..distributed.cluster import (
        connect,
        read_autoscaler_groups,
        read_cluster,
        started_private_local,
    )

    config = spec.config
    connect(config.address)
    cluster, private = read_cluster(), started_private_local()
    check_device(config.device, cluster, private_local=private)
    special = len(spec.tokenizer.all_special_ids) if config.keep_special else 0
    # what may join later: nothing on the private local Ray; None where no autoscaler says
    groups = () if private else read_autoscaler_groups()
    sizing = size_job(spec.shape, spec.corpus_shape, cluster, config.scheduling, special=special,
                      groups=groups)  # fmt: skip
    notices = (*column_notices(spec.plan, config.text_column),
               *ignored_notices(spec.plan, config.corpus))  # fmt: skip
    for line in (*notices, *sizing.lines()):
        echo(line)
    return sizing


def show_plan(spec: RunSpec, echo=print) -> dict[str, Any]:
    """``--plan``: what the run would do, where, with how much memory; nothing is run or
    written. Returns the decisions (the manifest's ``sizing`` a run would record)."""
    sizing = size_run(spec, echo=lambda _line: None)
    for line in describe_plan(
        sizing, spec.corpus_shape, checkpoint_interval=spec.config.checkpoint_interval,
        total_layers=spec.total_layers, checkpoint_writers=writers_for(spec.config.out),
        checkpoint_check=needs_check(spec.config.out),
    ):  # fmt: skip
        echo(line)
    config = spec.config
    for line in (*column_notices(spec.plan, config.text_column),
                 *ignored_notices(spec.plan, config.corpus)):  # fmt: skip
        echo(line)
    decisions = sizing.to_json()
    if config.plan_json:  # the same decisions, for a platform's tooling
        write_plan_json(config.plan_json, decisions, echo)
    return decisions


def write_plan_json(url: str, decisions: dict[str, Any], echo=print) -> None:
    """``--plan-json``: the plan's ``decisions`` as JSON to ``url`` (local or fsspec URL),
    written whole or not at all; a :class:`ConfigError` where it cannot be."""
    try:
        atomic_write_bytes(url, (json.dumps(decisions, indent=2) + "\n").encode())
    except OSError as error:
        raise ConfigError(f"--plan-json {url}: cannot be written ({error})") from None
    echo(f"plan: its decisions as JSON in {url}")


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


def already_complete(run: RunDir, fingerprint: str) -> Manifest | None:
    """The manifest of a complete run of this fingerprint whose checkpoints were removed, or
    of such a run whose re-tabulation was stopped (:func:`interrupted_retable`): its
    statistics artefact is all a re-tabulation needs, so it is re-tabulated again, never
    extracted again (its checkpoint groups are gone)."""
    if run.has(GROUPS) or not run.has_statistics() or not run.has_manifest():
        return None
    manifest = run.manifest()
    if manifest.fingerprint != fingerprint:
        return None
    return manifest if manifest.complete or interrupted_retable(run, manifest) else None


def interrupted_retable(run: RunDir, manifest: Manifest) -> bool:
    """Whether ``manifest`` (``running``) is a re-tabulation's (:func:`_retable`) that did not
    finish, with its statistics artefact intact: it names the artefact among its outputs
    (only a re-tabulation's ``running`` manifest does; an extraction's has none until it is
    complete) and every byte of the artefact matches the digest recorded there
    (:meth:`RunDir.statistics_intact`), and so does ``samples.parquet``'s where one is
    recorded: a stop between the new sample table's move into place and the complete
    manifest leaves one that differs, which the re-tabulation could not read (such a run is
    extracted again, as before). The caller has checked the fingerprint (model, corpus,
    extraction options): the artefact is this run's."""
    outputs = manifest.outputs
    named = outputs is not None and any(
        name in (STATISTICS, STATISTICS_PARTS + "/") for name in outputs.artefacts
    )
    if manifest.complete or not named or not run.statistics_intact():
        return False
    sample = run.digest("samples.parquet")
    return sample is None or Digest.of_file(run.path("samples")) == sample


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
    """A rerun of a complete run: nothing to do, or its tables again for changed options (a
    re-tabulation that was stopped: again, whatever the options)."""
    if not done.complete:
        echo(
            f"{run.url} holds this run, stopped while its tables were rebuilt; they are rebuilt "
            "again from its statistics and sample (nothing is extracted)"
        )
        return retable(run, done, spec, t_start, echo)
    changed = changed_table_options(done, spec.config)
    if not changed and done.lacks_report(spec.config.no_report):
        from ..report.html import write_run_report

        echo(
            f"{run.url} holds this complete run without its report (the run was stopped while "
            "it was drawn): drawing it"
        )
        write_run_report(run, done, echo)
        return done.to_json()
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
    options (``--min-count``, outlier rules, K-means, LID, …): no extraction. Where the sizing
    puts the reduce on reducer actors (:func:`~embgeom_ray.sizing.size_reduce`, the types the
    artefact holds) they read it partition by partition (never whole in this process). The
    artefact is kept as it is, never written again (:func:`kept_artefacts`)."""
    from ..distributed.cluster import connect, read_cluster
    from ..distributed.reducers import (
        PartitionedStatistics,
        PartitionPlan,
        place_where_seen,
        seen_type_ids,
    )
    from ..io_utils import local_path
    from ..shared_out import write_marker

    config = spec.config
    connect(config.address)
    url = run.statistics_ref()
    seen = seen_type_ids([url])
    cluster = read_cluster()

    def resize(nodes: Cluster) -> Reduce:
        return size_reduce(spec.shape, len(seen), nodes, config.scheduling)

    reduce = place_where_seen(
        resize(cluster), cluster, resize, run.url, lambda: write_marker(local_path(run.url)),
        echo,
    )
    echo(f"sizing: {len(seen):,} types: {reduce.describe()}")
    if reduce.partitioned:  # the artefact read partition by partition, never whole here
        plan = PartitionPlan.balanced(reduce.count, seen, spec.layers)
        merged: RunStatistics = PartitionedStatistics(
            plan, [url], memory=reduce.memory, nodes=reduce.nodes, pinned=reduce.pinned
        )
    else:
        merged = StatisticsHere(run.load_statistics())
    try:
        return _retable(run, done, spec, merged, t_start, echo, reduce)
    finally:
        merged.close()


def _retable(
    run: RunDir,
    done: Manifest,
    spec: RunSpec,
    merged: RunStatistics,
    t_start: float,
    echo,
    reduce: Reduce,
) -> dict[str, Any]:
    config = spec.config
    sample = run_samples(run)
    artefacts, digests = kept_artefacts(run, done)
    # the running manifest names the statistics artefact, kept as it is, with its digest: a
    # re-tabulation stopped from here on is re-tabulated again (already_complete), and the
    # artefact is checked against it; the tables are being rewritten, so it names none
    manifest = Manifest.model_validate(done.to_json()).set(
        status="running",
        started_at=now(),
        config=config.model_dump(),
        outlier_rules=OutlierRules.of(config.tables).describe(),
        timings_s={"plan": round(time.perf_counter() - t_start, 3)},
        sizing=(done.sizing or {}) | {"reduce": asdict(reduce)},
        outputs=Outputs(artefacts=artefacts, digests=digests_json(digests)),
    )
    run.write_manifest(manifest)
    run.written.update(digests)  # what the complete manifest records of what it did not write
    finish_run(
        run, manifest, merged, sample, spec.tokenizer, config, t_start=t_start, echo=echo,
        artefacts=[name for name in artefacts if name != DOC_HASHES],
    )  # fmt: skip
    return manifest.to_json()


def kept_artefacts(run: RunDir, done: Manifest) -> tuple[list[str], dict[str, Digest]]:
    """What a re-tabulation keeps of the run as it is: the statistics artefact (and a
    ``--dedup`` run's ``doc_hashes.npy``) and the digests recorded for them and for
    ``samples.parquet`` (its sample, read while it is rewritten); a run of an earlier version
    records none for the artefact, which is then hashed here (its index, if partitioned)."""
    recorded = digests_from_json(done.outputs.digests) if done.outputs else {}
    partitioned = not run.statistics_url().endswith(STATISTICS)
    name = STATISTICS_PARTS + "/" if partitioned else STATISTICS
    key = join(STATISTICS_PARTS, PARTS_INDEX) if partitioned else STATISTICS
    digests = {k: d for k, d in recorded.items() if k in (key, DOC_HASHES, "samples.parquet")}
    if key not in digests:
        digests[key] = Digest.of_file(run.path(key))
    artefacts = [name, *([DOC_HASHES] if done.dedup is not None else [])]
    return artefacts, digests


def analyze(config: JobConfig, *, echo=print) -> dict[str, Any]:
    """Run the whole analysis for ``config``; returns the manifest written to ``config.out``
    (with ``--plan``, the decisions a run would make, and nothing is run or written)."""
    t_start = time.perf_counter()
    started_at = now()
    sampler()  # the driver's peak private memory, for the manifest
    spec = prepare(config)
    if config.plan or config.plan_json:
        return show_plan(spec, echo)
    t_plan = time.perf_counter()
    run, store = RunDir(config.out), CheckpointStore(config.out)
    done_before = None if config.overwrite else already_complete(run, spec.fingerprint)
    if done_before is not None:
        return reuse_complete(run, done_before, spec, t_start, echo)
    with resumable(config.out):  # the store failing from the first write on: one line
        started = _start_run(spec, run, store, started_at, echo)
        manifest = _extract_reduce_finish(spec, run, store, started, t_start, t_plan, echo)
    return manifest.to_json()


def _extract_reduce_finish(
    spec: RunSpec,
    run: RunDir,
    store: CheckpointStore,
    started: _Started,
    t_start: float,
    t_plan: float,
    echo,
) -> Manifest:
    """Extract, reduce and write the run (a corrupt checkpoint group found on the way is
    redone: :func:`redo_corrupt_group`); the manifest written."""
    config = spec.config
    for redo in range(MAX_CORRUPT_GROUPS + 1):
        try:
            reduced = _extract_and_reduce(spec, started, store, echo)
            merged, manifest = reduced.merged, started.manifest
            try:
                t_reduce = time.perf_counter()
                _record_run(
                    run, spec, started, reduced, echo,
                    plan_s=t_plan - t_start, reduce_s=t_reduce - reduced.t_extract1,
                )  # fmt: skip
                # the checkpoint groups removed once the run is complete, before its report
                # lists the directory's files
                finish_run(
                    run, manifest, merged, reduced.sample, spec.tokenizer, config,
                    t_start=t_start, echo=echo,
                    before_report=None if config.keep_checkpoints else store.remove_groups,
                )  # fmt: skip
            finally:
                merged.close()
            return manifest
        except Exception as exc:
            started = redo_corrupt_group(store, started, exc, redo, echo)
    raise AssertionError("unreachable: the last redo raises")


#: corrupt checkpoint groups a run redoes before it gives up (each one is reported)
MAX_CORRUPT_GROUPS = 3


def redo_corrupt_group(
    store: CheckpointStore, started: _Started, exc: Exception, redo: int, echo
) -> _Started:
    """After ``exc``: when it says a checkpoint group's file is corrupt (its bytes do not
    match the digest its JSON records), discard that group (and the reducer checkpoints that
    read it: :meth:`~.checkpoints.CheckpointStore.discard_group`), say so in one line, and
    return the run's state with the group's shards to extract again; nothing of the group is
    merged. Any other error, or more than :data:`MAX_CORRUPT_GROUPS` corrupt groups, is
    raised."""
    corrupt = integrity_error(exc)
    group = None if corrupt is None else store.group_of(corrupt.url)
    if group is None:
        raise exc
    if redo >= MAX_CORRUPT_GROUPS:
        raise OutputError(
            f"{corrupt}; {redo + 1} checkpoint groups in {store.out} were corrupt: check the "
            "storage, then rerun the same command to resume"
        ) from None
    store.discard_group(group)
    echo(
        f"checkpoint group {group.group_id} is corrupt ({corrupt.url.rsplit('/', 1)[-1]}: "
        f"{corrupt.detail}); its {len(group.shard_ids)} shard(s) are redone"
    )
    redone = set(group.shard_ids)
    computed = redone | {s.shard_id for s in started.todo}
    return started._replace(
        done=started.done - redone,
        todo=[s for s in started.plan.shards if s.shard_id in computed],
        pending=[s for s in started.plan.shards if s.shard_id in redone],
    )


class _Started(NamedTuple):
    """What :func:`_start_run` decided and wrote before the extraction."""

    sizing: Sizing
    plan: ShardPlan  # the run's shards (with --dedup, each with its documents to leave out)
    resumed: bool
    dedup: DedupPlan | None
    manifest: Manifest  # as written, ``running``
    done: set[int]  # shards of the plan already checkpointed
    todo: list[Shard]  # the others, extracted by this run
    pending: list[Shard]  # those still to extract (todo, then a corrupt group's shards)
    pacer: Pacer  # the checkpoint interval (sizing/checkpoints.py)
    ray_start_s: float
    dedup_s: float


def _start_run(
    spec: RunSpec, run: RunDir, store: CheckpointStore, started_at: str, echo
) -> _Started:
    """Size the run on Ray (joined or started here, on its own clock: ~5 s for a private local
    Ray), start or resume its checkpoints, plan the dedup and write the ``running`` manifest:
    everything is sized before anything is written. Returns the shards left to extract."""
    config = spec.config
    t_ray0 = time.perf_counter()
    sizing = size_run(spec, echo)
    t_ray1 = time.perf_counter()
    with user_errors(config.out, "output directory"):
        plan, resumed = store.start(
            spec.fingerprint, spec.identity_json, spec.plan, config.overwrite
        )
    t_dedup0 = time.perf_counter()
    plan, dedup = dedup_shards(config, plan, echo)
    t_dedup = time.perf_counter() - t_dedup0
    manifest = start_manifest(spec, started_at).set(sizing=sizing.to_json())
    run.write_manifest(manifest)

    done = store.done_shards() & {s.shard_id for s in plan.shards}
    todo = [s for s in plan.shards if s.shard_id not in done]
    for line in store.corrupt:
        echo(line)
    if resumed:
        echo(f"resuming {config.out}: {len(done)} of {len(plan.shards)} shards already done")
    writers, why = decide_writers(config.out)
    if needs_check(config.out):  # each extractor checks that its node sees the run
        why = f"where every extractor's node sees {config.out}: checked as each starts"
    pacer = Pacer(config.checkpoint_interval, writers=writers, writers_why=why)
    pacer.shard_bytes = plan.shard_bytes
    if sizing.pool.host_statistics is not None and sizing.pool.statistics is not None:
        pacer.budget_name = "host tier (--host-statistics-memory)"
    echo(f"sizing: checkpoints: every {pacer.reason()}; {pacer.writers_line()}")
    return _Started(
        sizing, plan, resumed, dedup, manifest, done, todo, todo, pacer, t_ray1 - t_ray0,
        t_dedup,
    )  # fmt: skip


class _Reduced(NamedTuple):
    """What :func:`_extract_and_reduce` produced."""

    pool: PoolPlan | None  # the extractors' pool (None: nothing left to extract)
    groups: list[CheckpointGroup]
    reduce: Reduce
    merged: RunStatistics  # the caller closes it
    sample: SampleLayers | None
    totals: Counts
    t_extract0: float
    t_extract1: float


def _extract_and_reduce(
    spec: RunSpec, started: _Started, store: CheckpointStore, echo
) -> _Reduced:
    """Extract the shards left (reducers that fit beside the extractors and task workers
    started once the first extractor is ready), then reduce every checkpoint group of the
    plan where :func:`reduce_decision` says (recorded in the manifest's ``sizing``); reducers
    started early are stopped when the extraction fails or the reduce does not use them."""
    config, sizing, manifest = spec.config, started.sizing, started.manifest
    early: list[Any] = []

    def on_ready(pool: PoolPlan) -> None:  # the first extractor has loaded its model
        early.extend(start_reducers_early(
            sizing.reduce, store, reducer_checkpoint_seconds(config, started.pacer)
        ))  # fmt: skip

    def on_requested(pool: PoolPlan) -> None:  # the first extractors are asked for
        warm_for_run(config, len(spec.layers))

    t_extract0 = time.perf_counter()
    try:
        pool = (
            _extract(
                spec, sizing, started.pending, store, on_ready, started.pacer, on_requested
            )
            if started.pending
            else None
        )
        t_extract1 = time.perf_counter()
        groups = store.groups_covering(s.shard_id for s in started.plan.shards)
        reduce, seen = reduce_decision(store, groups, spec, echo)
        if reduce.partitioned and reduce.pinned:  # early ones were placed before the check
            stop_early(early)
        elif reduce.partitioned and early:  # the reducers started early stay where they are
            kept = min(len(early), reduce.count)
            reduce.nodes[:kept] = sizing.reduce.early_nodes[:kept]
        manifest.set(sizing=sizing.to_json() | {"reduce": asdict(reduce)})
        if reduce.partitioned:
            merged, sample, totals = reduce_partitioned(
                store, groups, spec, reduce, seen, early, started.pacer
            )
        elif early:  # reducers started for a reduce the job's own process does
            stop_early(early)
    except BaseException:
        stop_early(early)
        raise
    if not reduce.partitioned:
        whole, sample, totals = reduce_groups(
            store, groups, spec.empty_statistics(), config.sample_size > 0
        )
        merged = StatisticsHere(whole)
    return _Reduced(pool, groups, reduce, merged, sample, totals, t_extract0, t_extract1)


def _record_run(
    run: RunDir,
    spec: RunSpec,
    started: _Started,
    reduced: _Reduced,
    echo,
    *,
    plan_s: float,
    reduce_s: float,
) -> None:
    """Check that tokens were counted (and, with --dedup, that the extractors left out what
    the plan did, writing its document hashes), print the unknown-token and skipped-items
    warnings, and set the manifest's counts, shards, workers, timings and throughput."""
    config, manifest, totals, dedup = spec.config, started.manifest, reduced.totals, started.dedup
    try:
        check_not_empty(reduced.merged, totals, config.corpus)
    except CorpusError:
        # nothing was measured: no run to resume, and the corpus corrected (another
        # fingerprint) starts afresh instead of being refused as another run
        run.clear()
        raise
    for warning in (unk_warning(totals, spec.tokenizer.unk_token), skipped_warning(totals)):
        if warning:
            echo(warning)
    if dedup is not None:
        manifest.set(dedup=dedup_info(dedup, totals, config.corpus))
        run.write_doc_hashes(dedup.hashes)
    extract_s = reduced.t_extract1 - reduced.t_extract0
    manifest.set(
        counts=counts_of(totals, reduced.merged),
        skipped=totals.skipped,
        shards=ShardsInfo(
            total=len(started.plan.shards),
            reused_from_checkpoints=len(started.done),
            computed=len(started.todo),
            checkpoint_groups=len(reduced.groups),
        ),
        workers=None if reduced.pool is None else reduced.pool.__dict__,
        timings_s={
            "plan": round(plan_s, 3),
            **({"dedup": round(started.dedup_s, 3)} if dedup is not None else {}),
            "ray_start": round(started.ray_start_s, 3),
            "extract_wall": round(extract_s, 3),
            "extract_forward_sum": round(totals.forward_seconds, 3),
            "extract_fold_sum": round(totals.fold_seconds, 3),
            "reduce": round(reduce_s, 3),
        },
        throughput={"tokens_per_s_extract_wall": throughput(totals, started.resumed, extract_s)},
    )
    manifest.set(sizing=(manifest.sizing or {}) | {"checkpoints": started.pacer.to_json(extract_s)})


def reduce_decision(
    store: CheckpointStore, groups: list[CheckpointGroup], spec: RunSpec, echo
) -> tuple[Reduce, Any]:
    """Where the checkpoint ``groups`` are reduced, now that the types they hold are known
    (:func:`~embgeom_ray.sizing.size_reduce`, on the cluster as Ray sees it now, on the nodes
    that see a local run: :func:`~embgeom_ray.distributed.reducers.place_where_seen`), and
    those types' ids (read from the groups' files alone)."""
    from ..distributed.cluster import read_cluster
    from ..distributed.reducers import place_where_seen, seen_type_ids

    seen = seen_type_ids([url for g in groups for url in store.group_urls(g)])
    cluster = read_cluster()

    def resize(nodes: Cluster) -> Reduce:
        return size_reduce(spec.shape, len(seen), nodes, spec.config.scheduling)

    reduce = resize(cluster)
    reduce = place_where_seen(reduce, cluster, resize, spec.config.out, store.write_marker, echo)
    echo(f"sizing: {len(seen):,} types seen: {reduce.describe()}")
    return reduce, seen


def stop_early(reducers: list[Any]) -> None:
    """End reducers started for a reduce that will not use them."""
    if reducers:
        from ..distributed.reducers import stop_reducers

        stop_reducers(reducers)
        reducers.clear()


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


def dedup_info(dedup: DedupPlan, totals: Counts, corpus: str) -> DedupInfo:
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


def throughput(totals: Counts, resumed: bool, extract_s: float) -> float | None:
    """Tokens per second of the extraction stage's wall time (None for a resumed run, whose
    tokens were partly counted before)."""
    if resumed or not totals.tokens or extract_s <= 0:
        return None
    return round(totals.tokens / extract_s, 1)


def check_not_empty(merged: RunStatistics, totals: Counts, corpus: str) -> None:
    """A :class:`CorpusError` when no token was counted, with what was read and skipped."""
    if merged.token_count() == 0:
        skipped = ", ".join(f"{v} {k}" for k, v in sorted(totals.skipped.items())) or "none"
        raise CorpusError(
            f"the corpus {corpus} produced no tokens to measure "
            f"({totals.documents} documents read; skipped: {skipped})"
        )
