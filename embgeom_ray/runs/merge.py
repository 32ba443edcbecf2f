"""Merging complete runs over disjoint corpora into the run over their union.

Each run's ``statistics.safetensors`` holds mergeable sufficient statistics and its
``sample.safetensors`` a mergeable bottom-k sample, so the merge is exact: the output gets the
statistics, sample, tables and manifest that one analysis over all the corpora would have
written (counts equal, floats equal up to float64 rounding; the sample is the same occurrences).

The runs must be complete and measure the same thing: same model and tokenizer (content
fingerprints), same layers, max_length, dtype, special-token option, clip dims and sample
options. Two runs over the same corpus are refused, since every token would be counted twice;
corpora that merely overlap cannot be detected and are the caller's responsibility. A merged
run can itself be merged. ``python -m jobs.merge`` is the command-line entry point.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

from pydantic import ValidationError

from ..config import JobConfig
from ..core.samples import ActivationSample
from ..core.statistics import EmbeddingStatistics
from ..core.tables import build_tables
from ..distributed.sampled_stage import add_sampled_metrics
from ..errors import ModelError, OutputError, StatisticsMismatchError, UserError
from ..inputs.model_loading import load_tokenizer, tokenizer_fingerprint
from ..io_utils import exists, is_local, join, local_path, read_bytes
from ..report.html import write_run_report
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

#: options that change the statistics of a run; runs merge only if they agree on all of them
#: (model, tokenizer, layers and clip dims are checked by the statistics themselves too).
MERGE_OPTIONS = (
    "max_length", "dtype", "keep_special", "clip_dims", "sample_size", "sample_type_size",
    "sample_seed",
)  # fmt: skip

#: manifest keys that describe one run, not what the merged runs share.
PER_RUN_KEYS = {
    "status", "started_at", "finished_at", "fingerprint", "config", "corpus", "counts",
    "skipped", "shards", "workers", "timings_s", "throughput", "outputs", "versions",
    "merged_runs", "kind",
}  # fmt: skip


class RunError(UserError):
    """A run directory that cannot be merged (missing, incomplete, unreadable)."""


def load_manifest(run: str) -> dict[str, Any]:
    """The manifest of a complete run, or a :class:`RunError` saying what is wrong."""
    path = join(run, MANIFEST)
    if not exists(path):
        raise RunError(f"{run} is not a run directory of jobs.analyze: it has no {MANIFEST}")
    try:
        manifest = json.loads(read_bytes(path))
    except ValueError as exc:
        raise RunError(f"{path} is not valid JSON: {exc}") from None
    status = manifest.get("status")
    if status != "complete":
        raise RunError(
            f"run {run} is not complete (status {status!r}): finish it (rerun the same "
            "jobs.analyze command to resume) before merging"
        )
    return manifest


def leaf_corpora(manifest: dict[str, Any]) -> list[str]:
    """Fingerprints of the corpora a run covers (several for a merged run)."""
    corpus = manifest.get("corpus") or {}
    return list(corpus.get("merged_fingerprints") or [corpus.get("fingerprint")])


def check_mergeable(runs: list[str], manifests: list[dict[str, Any]]) -> None:
    """Refuse runs whose options differ or whose corpora repeat, naming the runs."""
    first, first_cfg = runs[0], manifests[0].get("config") or {}
    for run, manifest in zip(runs[1:], manifests[1:], strict=True):
        cfg = manifest.get("config") or {}
        diffs = [
            f"{key} {cfg.get(key)!r} != {first_cfg.get(key)!r}"
            for key in MERGE_OPTIONS
            if cfg.get(key) != first_cfg.get(key)
        ]
        if diffs:
            raise StatisticsMismatchError(
                f"cannot merge {run} into {first}: runs with different options: " + "; ".join(diffs)
            )
    seen: dict[str, str] = {}
    for run, manifest in zip(runs, manifests, strict=True):
        for fp in leaf_corpora(manifest):
            if fp in seen:
                raise StatisticsMismatchError(
                    f"{run} and {seen[fp]} cover the same corpus (fingerprint {fp}); merging "
                    "them would count every token twice"
                )
            seen[fp] = run


def _corpus_label(corpus: Any) -> str:
    if isinstance(corpus, list):
        return " + ".join(_corpus_label(c) for c in corpus)
    return str(corpus)


def run_config(manifest: dict[str, Any], out: str, min_count: int | None) -> JobConfig:
    """The first run's options (they decide how the tables are computed), writing to ``out``."""
    saved = manifest.get("config") or {}
    known = {k: v for k, v in saved.items() if k in JobConfig.model_fields}
    # the corpus does not enter the tables; a merged run keeps the list of its corpora there
    corpus = known.get("corpus")
    known |= {"out": out, "overwrite": False, "corpus": _corpus_label(corpus)}
    if min_count is not None:
        known["min_count"] = min_count
    try:
        return JobConfig(**known)
    except ValidationError as exc:
        raise RunError(f"the options of the first run cannot be read back: {exc}") from None


def load_statistics(run: str, manifest: dict[str, Any]) -> EmbeddingStatistics:
    name = STATISTICS
    path = join(run, name)
    if not exists(path):
        raise RunError(f"run {run} says it is complete but has no {name}")
    return EmbeddingStatistics.load(path)


def merge_statistics(runs: list[str], manifests: list[dict[str, Any]]) -> EmbeddingStatistics:
    """Load every run's statistics and merge them in the order given."""
    merged = load_statistics(runs[0], manifests[0])
    for run, manifest in zip(runs[1:], manifests[1:], strict=True):
        stats = load_statistics(run, manifest)
        try:
            merged.merge(stats)
        except StatisticsMismatchError as exc:
            raise StatisticsMismatchError(f"cannot merge {run} into {runs[0]}: {exc}") from None
    return merged


def merge_samples(runs: list[str]) -> ActivationSample | None:
    """Every run's ``sample.safetensors`` merged (bottom-k: the sample of the union), or None."""
    paths = [join(run, SAMPLE) for run in runs]
    present = [exists(p) for p in paths]
    if not any(present):
        return None
    if not all(present):
        missing = [run for run, ok in zip(runs, present, strict=True) if not ok]
        raise RunError(
            f"runs {missing} have no {SAMPLE} while the others do; they were run "
            "with different sampling options"
        )
    merged = ActivationSample.load(paths[0])
    for run, path in zip(runs[1:], paths[1:], strict=True):
        try:
            merged.merge(ActivationSample.load(path))
        except StatisticsMismatchError as exc:
            raise StatisticsMismatchError(f"cannot merge the sample of {run}: {exc}") from None
    return merged


def load_run_tokenizer(manifest: dict[str, Any], tokenizer: str | None) -> Any:
    """The tokenizer that names the token ids: the first run's model (or ``tokenizer``).

    A hub model is loaded at the commit the run resolved; a local directory as it is now. Its
    fingerprint must equal the runs' tokenizer fingerprint, or the token names would be wrong.
    """
    model = manifest["model"]
    config = manifest.get("config") or {}
    source = tokenizer or model["id"]
    revision = None
    if tokenizer is None and not os.path.isdir(source):
        revision = model.get("revision") or config.get("revision")
    tok = load_tokenizer(source, revision, bool(config.get("trust_remote_code", False)))
    expected = (manifest.get("tokenizer") or {}).get("fingerprint")
    if expected and tokenizer_fingerprint(tok) != expected:
        raise ModelError(
            f"the tokenizer at {source!r} is not the one the runs used (fingerprint "
            f"{tokenizer_fingerprint(tok)} != {expected}); give the original with --tokenizer"
        )
    return tok


def _sum_counts(manifests: list[dict[str, Any]], merged: EmbeddingStatistics) -> dict[str, Any]:
    """Every integer count of the runs' manifests, summed; non-finite tokens from the merge."""
    counts: dict[str, Any] = {}
    for m in manifests:
        for key, value in (m.get("counts") or {}).items():
            if isinstance(value, int) and not isinstance(value, bool):
                counts[key] = counts.get(key, 0) + value
    counts["nonfinite_tokens_per_layer"] = {
        str(layer): merged.layer(layer).nonfinite for layer in merged.layers
    }
    return counts


def _sum_skipped(manifests: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in manifests:
        for reason, n in (m.get("skipped") or {}).items():
            out[reason] = out.get(reason, 0) + int(n)
    return out


def _location(url: str) -> str:
    """A comparable form of a run location (absolute real path for local directories)."""
    return os.path.realpath(local_path(url)) if is_local(url) else url.rstrip("/")


def merge_runs(
    runs: list[str],
    out: str,
    *,
    min_count: int | None = None,
    tokenizer: str | None = None,
    overwrite: bool = False,
    echo=print,
) -> dict[str, Any]:
    """Merge complete ``runs`` into ``out``; returns the manifest written there."""
    t0 = time.perf_counter()
    started_at = now()
    runs = [r.rstrip("/") for r in runs]
    out = out.rstrip("/")
    if len(runs) < 2:
        raise RunError("give at least two runs to merge")
    if min_count is not None and min_count < 2:
        raise UserError(f"--min-count must be at least 2 (got {min_count})")
    keys = [_location(r) for r in runs]
    if len(set(keys)) != len(keys):
        raise RunError("the same run is given twice; merging it would count its tokens twice")
    if _location(out) in keys:
        raise OutputError(f"--out {out} is one of the runs to merge; write the merge elsewhere")
    if exists(join(out, MANIFEST)) and not overwrite:
        raise OutputError(f"{out} already holds a run ({MANIFEST}); give --overwrite to replace it")

    manifests = [load_manifest(run) for run in runs]
    check_mergeable(runs, manifests)
    first = manifests[0]
    config = run_config(first, out, min_count)
    tok = load_run_tokenizer(first, tokenizer)
    t_load = time.perf_counter()
    merged = merge_statistics(runs, manifests)
    sample = merge_samples(runs)
    t_merge = time.perf_counter()

    leaves = [fp for m in manifests for fp in leaf_corpora(m)]
    fingerprint = hashlib.sha256(
        json.dumps(sorted(m.get("fingerprint") or "" for m in manifests)).encode()
    ).hexdigest()
    sources = [(m.get("corpus") or {}).get("source") for m in manifests]
    # what the runs share (model, tokenizer, layers, clip dims, outlier rules, …) comes from the
    # first run; what belongs to one run is replaced by the merge's own.
    manifest: dict[str, Any] = {
        "status": "running",
        "kind": "merge",
        "started_at": started_at,
        "fingerprint": fingerprint,
    }
    manifest.update({k: v for k, v in first.items() if k not in PER_RUN_KEYS})
    manifest.update(
        {
            "config": config.model_dump() | {"corpus": sources},
            "corpus": {
                "source": sources,
                "fingerprint": hashlib.sha256(json.dumps(sorted(leaves)).encode()).hexdigest(),
                "merged_fingerprints": sorted(leaves),
                "files": sum(int((m.get("corpus") or {}).get("files") or 0) for m in manifests),
                "bytes": sum(int((m.get("corpus") or {}).get("bytes") or 0) for m in manifests),
                "shards": sum(int((m.get("corpus") or {}).get("shards") or 0) for m in manifests),
            },
            "layers": merged.layers,
            "versions": versions(),
            "merged_runs": [
                {
                    "path": run,
                    "fingerprint": m.get("fingerprint"),
                    "corpus": (m.get("corpus") or {}).get("source"),
                    "corpus_fingerprint": (m.get("corpus") or {}).get("fingerprint"),
                    "tokens": (m.get("counts") or {}).get("tokens"),
                    "finished_at": m.get("finished_at"),
                }
                for run, m in zip(runs, manifests, strict=True)
            ],
        }
    )
    write_manifest(out, manifest)

    tables = build_tables(merged, tok, config)
    sampled_note = None if sample is None else add_sampled_metrics(tables, sample, tok, config)
    merged.save(join(out, STATISTICS))
    artefacts = [STATISTICS]
    if sample is not None:
        sample.save(join(out, SAMPLE))
        artefacts.append(SAMPLE)
    written = [write_table(out, name, df) for name, df in tables.items()]
    t_write = time.perf_counter()
    manifest.update(
        {
            "status": "complete",
            "finished_at": now(),
            "counts": _sum_counts(manifests, merged),
            "skipped": _sum_skipped(manifests),
            "timings_s": {
                "load": round(t_load - t0, 3),
                "merge": round(t_merge - t_load, 3),
                "write": round(t_write - t_merge, 3),
                "total": round(time.perf_counter() - t0, 3),
            },
            "sample": sampled_note,
            "outputs": {"artefacts": artefacts, "tables": written, "manifest": MANIFEST},
        }
    )
    write_manifest(out, manifest)
    echo(format_summary(tables["layers"]))
    echo(f"merged {len(runs)} runs into {out}: {', '.join([*written, *artefacts, MANIFEST])}")
    write_run_report(out, manifest, echo)
    return manifest
