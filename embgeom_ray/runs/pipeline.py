"""One analysis run, start to finish: plan, extract on Ray, checkpoint, reduce, write.

``analyze(config)`` is what ``python -m jobs.analyze`` runs. The order of events is what makes
a run trustworthy:

1. everything a user can get wrong is checked before any work (model, tokenizer, layers,
   max_length, corpus, output directory);
2. the output directory gets ``run.json`` (fingerprint + plan) and a manifest saying
   ``running``; finished shards of an earlier identical run are reused;
3. shards run on extractor actors, each of which folds many shards into one running
   statistics object; the driver checkpoints each actor's flush (every
   ``--checkpoint-interval`` seconds, and when the queue is drained) as one group of shards;
4. the reduce checks that the checkpoint groups cover every shard exactly once and merges
   them in group-id order (deterministic for a given grouping);
5. the statistics artefact and the tables are written atomically, and only then the manifest
   says ``complete``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from ..core import metrics
from .checkpoints import CheckpointGroup, CheckpointStore
from ..config import JobConfig
from ..inputs.corpus import CorpusSpec, Shard, plan_shards
from ..errors import ConfigError, CorpusError
from ..inputs.extractor import ShardCounts
from ..io_utils import join
from ..inputs.model_loading import load_config, max_window_length, resolve_identity, resolve_layers
from ..report.html import write_run_report
from ..core.tables import build_tables
from ..distributed.sampled_stage import add_sampled_metrics
from ..run_dir import (
    MANIFEST,
    SAMPLE,
    STATISTICS,
    format_summary,
    now,
    versions,
    write_manifest,
    write_table,
)
from ..core.rogue import (
    OutlierRules,
    clipping_row,
    exact_clipped_cosines,
    flagged_dims,
    positions_table,
    rogue_dims_table,
    sampled_clipped_cosines,
)
from ..core.samples import ActivationSample
from ..core.statistics import EmbeddingStatistics

if TYPE_CHECKING:  # ray is imported only when there is extraction to do
    from ..distributed.actor_pool import GroupResult, PoolPlan


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
    """Run ``todo`` on Ray; every flushed group is checkpointed on arrival."""
    from ..distributed.actor_pool import run_shards
    from ..distributed.cluster import connect

    connect(config.address)
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
        store.save_group(group.shard_ids, group.stats, group.sample, group.counts)

    try:
        return run_shards(
            config,
            layers,
            metadata,
            todo,
            on_group,
            clip_dims,
            on_folded=lambda r: show(1, r.counts.tokens),
            on_requeued=lambda rs: show(-len(rs), -sum(r.counts.tokens for r in rs)),
        )
    finally:
        bar.close()


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


def analyze(config: JobConfig, *, echo=print) -> dict[str, Any]:
    """Run the whole analysis for ``config``; returns the manifest written to ``config.out``."""
    t_start = time.perf_counter()
    started_at = now()
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
    spec = CorpusSpec(config.corpus, config.text_column, config.split)
    plan = plan_shards(spec, config.shard_bytes)
    t_plan = time.perf_counter()

    identity_json = identity.to_json() | {
        "corpus": config.corpus,
        "corpus_fingerprint": plan.fingerprint,
        "options": config.result_options(),
        "layers": layers,
        "clip_dims": clip_dims,
    }
    fingerprint = run_fingerprint(identity_json, plan.fingerprint, config, layers)
    store = CheckpointStore(config.out)
    plan, resumed = store.start(fingerprint, identity_json, plan, config.overwrite)
    manifest: dict[str, Any] = {
        "status": "running",
        "started_at": started_at,
        "fingerprint": fingerprint,
        "config": config.model_dump(),
        "model": {
            "id": identity.model,
            "revision": identity.revision,
            "model_fingerprint": identity.model_fingerprint,
            "model_type": identity.model_type,
            "num_layers": identity.num_layers,
            "hidden_size": identity.hidden_size,
        },
        "tokenizer": {
            "class": type(tokenizer).__name__,
            "fingerprint": identity.tokenizer_fingerprint,
            "special_ids": sorted(tokenizer.all_special_ids),
            "special_tokens_counted": config.keep_special,
        },
        "corpus": {
            "source": config.corpus,
            "fingerprint": plan.fingerprint,
            "files": len(plan.files),
            "bytes": plan.total_bytes,
            "shards": len(plan.shards),
        },
        "layers": layers,
        "clip_dims": clip_dims,
        "outlier_rules": OutlierRules(
            config.outlier_mean_z, config.outlier_variance_ratio, config.outlier_tail_share
        ).describe(),
        "versions": versions(),
    }
    write_manifest(config.out, manifest)

    done = store.done_shards() & {s.shard_id for s in plan.shards}
    todo = [s for s in plan.shards if s.shard_id not in done]
    if resumed:
        echo(f"resuming {config.out}: {len(done)} of {len(plan.shards)} shards already done")
    metadata = {
        "model_fingerprint": identity.model_fingerprint,
        "tokenizer_fingerprint": identity.tokenizer_fingerprint,
        "keep_special": str(config.keep_special),
        "model": identity.model,
        "revision": str(identity.revision),
    }

    t_extract0 = time.perf_counter()
    pool = None
    if todo:
        pool = _extract(config, layers, metadata, todo, clip_dims, store)
    t_extract1 = time.perf_counter()

    groups = store.groups_covering(s.shard_id for s in plan.shards)
    empty = EmbeddingStatistics(
        layers,
        identity.hidden_size,
        max_positions=config.max_length,
        metadata=metadata,
        clip_dims=clip_dims,
    )
    merged, sample, totals = reduce_groups(store, groups, empty, config.sample_size > 0)
    t_reduce = time.perf_counter()
    if merged.token_count() == 0:
        skipped = ", ".join(f"{v} {k}" for k, v in sorted(totals.skipped.items())) or "none"
        raise CorpusError(
            f"the corpus {config.corpus} produced no tokens to measure "
            f"({totals.documents} documents read; skipped: {skipped})"
        )

    tables = build_tables(merged, tokenizer, config)
    sampled_note = None
    if sample is not None:
        sampled_note = add_sampled_metrics(tables, sample, tokenizer, config)
    t_tables = time.perf_counter()
    merged.save(join(config.out, STATISTICS))
    artefacts = [STATISTICS]
    if sample is not None:
        sample.save(join(config.out, SAMPLE))
        artefacts.append(SAMPLE)
    written = [write_table(config.out, name, df) for name, df in tables.items()]
    t_write = time.perf_counter()

    extract_s = t_extract1 - t_extract0
    computed_tokens = totals.tokens if not resumed else None
    manifest.update(
        {
            "status": "complete",
            "finished_at": now(),
            "counts": {
                "documents": totals.documents,
                "windows": totals.windows,
                "tokens": totals.tokens,
                "padded_tokens": totals.padded_tokens,
                "batches": totals.batches,
                "oom_batch_splits": totals.oom_splits,
                "nonfinite_tokens_per_layer": {
                    str(layer): merged.layer(layer).nonfinite for layer in layers
                },
            },
            "skipped": totals.skipped,
            "shards": {
                "total": len(plan.shards),
                "reused_from_checkpoints": len(done),
                "computed": len(todo),
                "checkpoint_groups": len(groups),
            },
            "workers": None if pool is None else pool.__dict__,
            "timings_s": {
                "plan": round(t_plan - t_start, 3),
                "extract_wall": round(extract_s, 3),
                "extract_forward_sum": round(totals.forward_seconds, 3),
                "extract_fold_sum": round(totals.fold_seconds, 3),
                "reduce": round(t_reduce - t_extract1, 3),
                "metrics": round(t_tables - t_reduce, 3),
                "write": round(t_write - t_tables, 3),
                "total": round(time.perf_counter() - t_start, 3),
            },
            "throughput": {
                "tokens_per_s_extract_wall": (
                    round(computed_tokens / extract_s, 1)
                    if computed_tokens and extract_s > 0
                    else None
                ),
            },
            "sample": sampled_note,
            "outputs": {"artefacts": artefacts, "tables": written, "manifest": MANIFEST},
        }
    )
    write_manifest(config.out, manifest)
    echo(format_summary(tables["layers"]))
    echo(f"outputs in {config.out}: {', '.join([*written, *artefacts, MANIFEST])}")
    write_run_report(config.out, manifest, echo)
    return manifest
