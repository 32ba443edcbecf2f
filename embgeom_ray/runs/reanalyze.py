"""Scheduled re-analysis: keep every model of a watch list analysed over one corpus.

``python -m jobs.reanalyze --watchlist models.yaml --corpus C --store STORE`` is meant for cron
or a KubeRay schedule. For each model of the watch list it

1. resolves exactly what would be measured: a hub model's revision ("latest" = the default
   branch, or a branch or tag) to its commit hash through the hub API, a local directory to
   the content hash of its files (:func:`~embgeom_ray.inputs.fingerprints.directory_fingerprint`;
   cached while the files are unchanged, so an invocation with nothing new reads no weights);
2. computes the **run key**, the sha256 of (model fingerprint — ``id@commit`` for hub models,
   the content hash for local directories —, tokenizer fingerprint, corpus fingerprint,
   result options), see :func:`run_key`;
3. runs the analysis into ``STORE/runs/<model-slug>-<key[:12]>/`` only if no *complete* run
   with that key is there: a manifest with ``"status": "complete"`` whose own model,
   tokenizer, corpus and options give the same key (:func:`manifest_key`).

Changing a model's weights, a new hub commit, another corpus or another result option gives a
new key and so one new run; anything else (worker counts, batch sizes) does not. A second
invocation with nothing new runs nothing and says "up to date".

``STORE/runs.parquet`` (:data:`INDEX_COLUMNS`) has one row per run: its key, model, resolved
revision, corpus and options, status (``running``, ``submitted``, ``complete``, ``failed``),
times, error and headline metrics of ``layers.parquet``. It is rewritten atomically after
every change of a row. A failed run stays ``failed`` in the index and is retried at the next
invocation (a partly done run resumes from its shard checkpoints). The store may be a local
directory or an fsspec URL (``s3://``, ``gs://``). One invocation at a time per store: a local
store, or one on S3 or GCS, is locked while an invocation runs, and a second one ends at once
with exit status 75, running nothing (:mod:`~embgeom_ray.runs.store_lock`,
:mod:`~embgeom_ray.runs.object_lock`); on another object store (``abfs://``, …) none is, a
warning says so, and the scheduler must see to it (the KubeRay CronJob's
``concurrencyPolicy: Forbid``).

A model that cannot be resolved (offline, unknown id, missing directory, bad options) is
reported in one line and skipped; the others go on, and the exit status says something failed.

With ``submit=ADDRESS`` each needed run is submitted as its own Ray job
(:class:`ray.job_submission.JobSubmissionClient`) running ``python -m jobs.analyze`` with
every option on its command line, under the stable submission id ``embgeom-<key[:24]>``
(:func:`submission_id`): a job already pending, running or succeeded under that id is
recognised and followed, never submitted twice; after a failed or stopped one, retries use
``embgeom-<key[:24]>-1``, ``-2``, … . The store must then be reachable from the cluster
(object storage or a shared filesystem), and local model directories must exist both here
(to compute their key) and on the cluster's nodes.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
import yaml
from pydantic import ValidationError

from ..config import RESULT_OPTIONS, JobConfig, format_validation_error, load_yaml
from ..errors import ConfigError, IntegrityError, ModelError, OutputError, UserError
from ..inputs.corpus import CorpusSpec, auto_shard_cap, plan_shards, token_work
from ..inputs.model_loading import resolve_identity
from ..integrity import SEAL_KEY, seal
from ..io_utils import exists, is_local, join, local_path, read_bytes
from ..run_dir import HEADER_KEY, Manifest, RunDir, RunDirError, now, write_table
from ..sigterm import received as sigterm_received
from ..storage import check_output, user_errors
from .store_lock import store_lock

#: the index of runs in the store
INDEX = "runs.parquet"
#: the folder of the store that holds the run directories
RUNS_DIR = "runs"
#: the watch-list revision that means "the default branch's current commit"
LATEST = "latest"
#: keys of a watch-list entry
ENTRY_KEYS = ("model", "revision", "options")
#: options that come from the watch list, the corpus flag and the store, never from options
RESERVED_OPTIONS = ("model", "revision", "out", "corpus", "overwrite")

#: runs.parquet columns, in order, with their pandas dtypes
INDEX_COLUMNS: dict[str, str] = {
    "key": "string",  # run key (sha256 hex), see run_key
    "model": "string",  # as in the watch list
    "requested_revision": "string",  # as in the watch list ("latest", a branch, tag, commit)
    "revision": "string",  # resolved: commit hash, or "sha256:…" content hash of a directory
    "model_fingerprint": "string",
    "tokenizer_fingerprint": "string",
    "corpus": "string",
    "corpus_fingerprint": "string",
    "options_digest": "string",  # JobConfig.options_digest(): sha256 of the result options
    "options": "string",  # the result options, JSON
    "out": "string",  # the run directory
    "status": "string",  # running | submitted | complete | failed
    "error": "string",  # why the last attempt failed
    "attempts": "Int64",  # attempts started by reanalyze (0 for an adopted run)
    "submission_id": "string",  # Ray job submission id (with --submit)
    "started_at": "string",
    "finished_at": "string",
    "duration_s": "float64",
    "run_fingerprint": "string",  # the run's manifest["fingerprint"]
    "n_layers": "Int64",
    "n_tokens": "Int64",
    "anisotropy_last": "float64",  # last layer's anisotropy
    "isoscore_last": "float64",  # last layer's IsoScore
    "s_intra_last": "float64",  # last layer's S_intra
    "within_ratio_mean": "float64",  # mean over layers of within_ratio
}

#: the headline columns of runs.parquet and the ``layers.parquet`` column each is read from
#: (:func:`headline_metrics`): the last layer measured's, or the mean over the layers
LAST_LAYER_HEADLINES = {"anisotropy_last": "anisotropy", "isoscore_last": "isoscore",
                        "s_intra_last": "s_intra"}  # fmt: skip
MEAN_HEADLINES = {"within_ratio_mean": "within_ratio"}

_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


# --------------------------------------------------------------------------------------------
# the watch list


@dataclass(frozen=True)
class WatchEntry:
    """One model of the watch list (``position`` is 1-based, for messages)."""

    model: str
    revision: str = LATEST
    options: dict[str, Any] = field(default_factory=dict)
    position: int = 0

    @property
    def label(self) -> str:
        return self.model if self.revision == LATEST else f"{self.model}@{self.revision}"


def load_watchlist(path: str) -> list[WatchEntry]:
    """The entries of a watch-list YAML file (``models:`` list); :class:`ConfigError` if bad."""
    if not exists(path):
        raise ConfigError(f"watch list {path} does not exist")
    try:
        data = yaml.safe_load(read_bytes(path).decode("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"watch list {path} is not valid YAML: {exc}") from None
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, list) or not models:
        raise ConfigError(
            f"watch list {path} must be a mapping with a non-empty list 'models:', each item "
            "{model: ID_OR_DIR, revision: latest|BRANCH|TAG|COMMIT, options: {...}}"
        )
    entries = []
    for i, item in enumerate(models, start=1):
        where = f"watch list {path}, model {i}"
        if isinstance(item, str):
            item = {"model": item}
        if not isinstance(item, dict):
            raise ConfigError(f"{where}: expected a mapping with 'model', got {item!r}")
        unknown = sorted(set(item) - set(ENTRY_KEYS))
        if unknown:
            raise ConfigError(f"{where}: unknown keys {unknown} (allowed: {list(ENTRY_KEYS)})")
        model = item.get("model")
        if not isinstance(model, str) or not model.strip():
            raise ConfigError(f"{where}: 'model' must be a hub id or a directory")
        revision = item.get("revision", LATEST)
        if revision is None:
            revision = LATEST
        if not isinstance(revision, str) or not revision.strip():
            raise ConfigError(f"{where}: 'revision' must be 'latest', a branch, tag or commit")
        options = item.get("options") or {}
        if not isinstance(options, dict):
            raise ConfigError(f"{where}: 'options' must be a mapping of option: value")
        options = {str(k).replace("-", "_"): v for k, v in options.items()}
        reserved = sorted(set(options) & set(RESERVED_OPTIONS))
        if reserved:
            raise ConfigError(
                f"{where}: options {reserved} cannot be set per model (model and revision are "
                "the entry's own keys, the corpus and the output come from the command line)"
            )
        entries.append(WatchEntry(beside(model.strip(), path), revision.strip(), options, i))
    return entries


def beside(model: str, watchlist: str) -> str:
    """``model`` as the watch list ``watchlist`` names it: a relative directory that is not
    one in the working directory but is one beside the watch list is that one, as an absolute
    path (cron runs a command in the user's home, not where the watch list and its models
    are); anything else as written (a hub id, an absolute path, a directory here)."""
    if os.path.isabs(os.path.expanduser(model)) or is_local_model(model) or not is_local(watchlist):
        return model
    there = os.path.join(os.path.dirname(os.path.abspath(local_path(watchlist))), model)
    return os.path.normpath(there) if is_local_model(there) else model


# --------------------------------------------------------------------------------------------
# resolving a model and its run key


def is_local_model(model: str) -> bool:
    return os.path.isdir(model)


def _looks_like_path(model: str) -> bool:
    """A path rather than a hub id (``org/name``): absolute, relative, ``~``, or deeper."""
    return model.startswith(("/", ".", "~")) or model.count("/") > 1 or "\\" in model


def resolve_hub_revision(model: str, revision: str) -> str:
    """The commit hash of a hub model's ``revision`` ("latest" = default branch).

    A full 40-hex commit hash is exact already and needs no network. Anything else asks the
    hub API (``HF_TOKEN`` is used for private or gated models). Raises :class:`ModelError`
    with the reason: offline mode, unknown model, unknown revision, no network.
    """
    if _COMMIT_RE.match(revision):
        return revision
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"cannot resolve revision {revision!r} of hub model {model!r}"
    try:
        info = HfApi().model_info(model, revision=None if revision == LATEST else revision)
    except OfflineModeIsEnabled:
        raise ModelError(
            f"{what}: offline mode is on (HF_HUB_OFFLINE=1), and resolving a hub revision needs "
            "the network (an exact 40-hex commit hash in the local cache, or a local "
            "directory, needs none)"
        ) from None
    except GatedRepoError:
        raise ModelError(f"{what}: the model is gated; accept its terms and set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise ModelError(f"{what}: the model has no such branch, tag or commit") from None
    except RepositoryNotFoundError:
        raise ModelError(
            f"{what}: no such model on the hub (or it is private: set HF_TOKEN), and no "
            f"directory of that name in the working directory ({os.getcwd()}) or beside the "
            "watch list"
        ) from None
    except Exception as exc:  # network errors of any kind
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ModelError(f"{what}: {type(exc).__name__}: {first}".rstrip(": ")) from None
    sha = getattr(info, "sha", None)
    if not sha:
        raise ModelError(f"{what}: the hub returned no commit hash")
    return str(sha)


def run_key(
    model_fingerprint: str,
    tokenizer_fingerprint: str,
    corpus_fingerprint: str,
    options: dict[str, Any],
) -> str:
    """sha256 hex of what a run measures: model, tokenizer, corpus and result options.

    ``model_fingerprint`` is ``id@commit`` for hub models and the ``sha256:`` content hash of
    a local directory (so moving a directory does not change it, editing its weights does);
    ``options`` are :meth:`JobConfig.result_options` (the options that change the numbers).
    """
    payload = {
        "model": model_fingerprint,
        "tokenizer": tokenizer_fingerprint,
        "corpus": corpus_fingerprint,
        "options": {k: options.get(k) for k in RESULT_OPTIONS},
    }
    return _sha256(json.dumps(payload, sort_keys=True))


def manifest_key(manifest: Manifest) -> str | None:
    """The run key of a run from its own ``manifest.json`` (None if it lacks its identity).
    Result options the manifest does not name (added in a later version) count as their
    defaults, so upgrading does not make every watched run look new."""
    model_fp = manifest.model.model_fingerprint if manifest.model else None
    tok_fp = manifest.tokenizer.fingerprint if manifest.tokenizer else None
    corpus_fp = manifest.corpus.fingerprint
    if not all(isinstance(x, str) for x in (model_fp, tok_fp, corpus_fp)):
        return None
    # a result option added after the run was made ran as its default (e.g. --dedup off)
    fields = JobConfig.model_fields
    options = {k: manifest.config.get(k, fields[k].get_default(call_default_factory=True))
               for k in RESULT_OPTIONS}  # fmt: skip
    return run_key(model_fp, tok_fp, corpus_fp, options)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def model_slug(model: str) -> str:
    """A short file-name-safe name of a model: ``org--name`` for hub ids, the folder name
    (with its parent's when it is generic, e.g. ``pkg-model``) for local directories."""
    if is_local_model(model) or _looks_like_path(model):
        parts = [p for p in Path(os.path.abspath(os.path.expanduser(model))).parts if p != "/"]
        name = parts[-1] if parts else "model"
        if name.lower() in {"model", "models", "weights", "checkpoint", "hf"} and len(parts) > 1:
            name = f"{parts[-2]}-{name}"
    else:
        name = model.replace("/", "--")
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")
    return slug[:48] or "model"


def submission_id(key: str, attempt: int = 0) -> str:
    """The Ray job submission id of attempt ``attempt`` (0 first) of the run with ``key``."""
    base = f"embgeom-{key[:24]}"
    return base if attempt == 0 else f"{base}-{attempt}"


@dataclass(frozen=True)
class PlannedRun:
    """A watch-list entry resolved: its exact configuration, identity and run key."""

    entry: WatchEntry
    config: JobConfig  # out = the run directory; revision = the commit (hub models)
    key: str
    revision: str  # commit hash, or "sha256:…" content hash
    model_fingerprint: str
    tokenizer_fingerprint: str
    corpus_fingerprint: str

    @property
    def out(self) -> str:
        return self.config.out

    @property
    def name(self) -> str:
        return f"{self.entry.label} ({_short_rev(self.revision)})"

    def index_row(self, **values: Any) -> dict[str, Any]:
        return {
            "key": self.key,
            "model": self.entry.model,
            "requested_revision": self.entry.revision,
            "revision": self.revision,
            "model_fingerprint": self.model_fingerprint,
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "corpus": self.config.corpus,
            "corpus_fingerprint": self.corpus_fingerprint,
            "options_digest": self.config.options_digest(),
            "options": json.dumps(self.config.result_options(), sort_keys=True),
            "out": self.out,
        } | values


def why_new(run: PlannedRun, rows: list[dict[str, Any]]) -> str:
    """Why ``run`` is not up to date, against the model's complete run that finished last in
    the index (``rows``): what of its key differs (revision or weights, tokenizer, corpus path
    or fingerprint, result options with their old and new values), or that the model has no
    complete run yet, or that its complete run lacks its report. A corpus whose fingerprint changed has files of other sizes or
    modification times: an appended line, and a mere ``touch``, both give one."""
    mine = complete_manifest(run.out, run.key)
    if mine is not None and mine.lacks_report(run.config.no_report):
        return "its report is missing (the run was stopped while it was drawn)"
    done = [r for r in rows if r.get("model") == run.entry.model and r.get("status") == "complete"]
    if not done:
        return "no complete run of this model yet"
    last = max(done, key=lambda r: str(r.get("finished_at") or ""))
    changes = []
    if last.get("model_fingerprint") != run.model_fingerprint:
        changes.append(f"revision {_short_rev(str(last.get('revision')))} -> "
                       f"{_short_rev(run.revision)}")  # fmt: skip
    if last.get("tokenizer_fingerprint") != run.tokenizer_fingerprint:
        changes.append("tokenizer")
    if last.get("corpus") != run.config.corpus:
        changes.append(f"corpus {last.get('corpus')} -> {run.config.corpus}")
    elif last.get("corpus_fingerprint") != run.corpus_fingerprint:
        changes.append("the corpus's files changed (size or modification time)")
    try:
        old = json.loads(last.get("options") or "{}")
    except ValueError:
        old = {}
    new = run.config.result_options()
    changes += [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in RESULT_OPTIONS
                if k in old and old.get(k) != new.get(k)]  # fmt: skip
    return "since the last complete run: " + ("; ".join(changes) or "its key")


def _short_rev(revision: str) -> str:
    return revision[:19] if revision.startswith("sha256:") else revision[:12]


class _CorpusFingerprints:
    """Corpus fingerprints, planned once per (source, text column, split, shard size or the
    default's cap for the model's work a token)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[Any, ...], str] = {}

    def __call__(self, config: JobConfig, work: int = 0) -> str:
        size = config.shard_bytes if config.shard_bytes is not None else ("auto", auto_shard_cap(work))
        k = (config.corpus, config.text_column, config.split, size)
        if k not in self._cache:
            spec = CorpusSpec(config.corpus, config.text_column, config.split)
            self._cache[k] = plan_shards(spec, config.shard_bytes, work).fingerprint
        return self._cache[k]


def entry_config(
    entry: WatchEntry, base: dict[str, Any], corpus: str, out: str, revision: str | None
) -> JobConfig:
    """The job options of one entry: ``base`` (``--config``), then the entry's options."""
    data = dict(base) | dict(entry.options)
    data |= {"model": entry.model, "revision": revision, "corpus": corpus, "out": out}
    try:
        return JobConfig(**data)
    except ValidationError as exc:
        unknown = [k for k in entry.options if k not in JobConfig.model_fields]
        source = (f"the options of model {entry.position} of the watch list" if unknown
                  else "the config file")  # fmt: skip
        raise ConfigError(format_validation_error(exc, source)) from None


def plan_entry(
    entry: WatchEntry,
    base: dict[str, Any],
    corpus: str,
    store: str,
    corpus_fingerprint: Callable[[JobConfig, int], str],
) -> PlannedRun:
    """Resolve one entry: options, exact revision, tokenizer, corpus, run key and directory."""
    draft = entry_config(entry, base, corpus, store, None)  # options checked before any I/O
    if is_local_model(entry.model):
        if entry.revision != LATEST:
            raise ConfigError(
                f"{entry.model} is a local directory: a revision ({entry.revision!r}) applies "
                "to hub models only (a directory is identified by the hash of its files)"
            )
        revision = None
    elif _looks_like_path(entry.model):
        raise ModelError(
            f"local model directory {entry.model} does not exist (a relative one is looked "
            f"for in the working directory, {os.getcwd()}, then beside the watch list)"
        )
    else:
        revision = resolve_hub_revision(entry.model, entry.revision)
    identity, _ = resolve_identity(entry.model, revision, draft.trust_remote_code)
    # an absolute directory, so that a job submitted elsewhere (another cwd) finds it
    model = os.path.abspath(entry.model) if revision is None else entry.model
    config = draft.model_copy(update={"revision": revision, "model": model})
    corpus_fp = corpus_fingerprint(config, token_work(identity.num_layers, identity.hidden_size))
    key = run_key(
        identity.model_fingerprint,
        identity.tokenizer_fingerprint,
        corpus_fp,
        config.result_options(),
    )
    out = join(store, RUNS_DIR, f"{model_slug(entry.model)}-{key[:12]}")
    return PlannedRun(
        entry=entry,
        config=config.model_copy(update={"out": out}),
        key=key,
        revision=str(identity.revision),
        model_fingerprint=identity.model_fingerprint,
        tokenizer_fingerprint=identity.tokenizer_fingerprint,
        corpus_fingerprint=corpus_fp,
    )


# --------------------------------------------------------------------------------------------
# the store: run directories and the index


def read_manifest(out: str) -> Manifest | None:
    """A run directory's manifest, or None if it has none (or an unreadable one)."""
    run = RunDir(out)
    if not run.has_manifest():
        return None
    try:
        return run.manifest()
    except RunDirError:
        return None


def complete_manifest(out: str, key: str) -> Manifest | None:
    """The manifest of ``out`` if it is a complete run with run key ``key``, else None."""
    manifest = read_manifest(out)
    if manifest is None or not manifest.complete:
        return None
    if manifest_key(manifest) != key or not RunDir(out).has("layers"):
        return None
    return manifest


def headline_metrics(out: str, manifest: Manifest | None = None) -> dict[str, Any]:
    """Index columns from a complete run: layers, tokens, the last measured layer's metrics
    (:data:`LAST_LAYER_HEADLINES`) and the means over layers (:data:`MEAN_HEADLINES`), read
    from its ``layers.parquet``."""
    layers = RunDir(out).read_table("layers").sort_values("layer")
    last = layers.iloc[-1] if len(layers) else {}

    def col(name: str, row: Any = last) -> float:
        try:
            return float(row[name])
        except (KeyError, TypeError, ValueError):
            return float("nan")

    tokens = manifest.counts.tokens if manifest and manifest.counts else None
    if tokens is None and "n_tokens" in layers.columns and len(layers):
        tokens = int(last["n_tokens"])
    def mean(name: str) -> float:
        if name not in layers.columns:
            return float("nan")
        return float(pd.to_numeric(layers[name], errors="coerce").mean())

    return {
        "n_layers": len(layers),
        "n_tokens": None if tokens is None else int(tokens),
        **{head: col(name) for head, name in LAST_LAYER_HEADLINES.items()},
        **{head: mean(name) for head, name in MEAN_HEADLINES.items()},
    }


def complete_row(run: PlannedRun, manifest: Manifest, **values: Any) -> dict[str, Any]:
    """The index row of a complete run, with its times and headline metrics."""
    return run.index_row(
        status="complete",
        error=None,
        started_at=manifest.started_at,
        finished_at=manifest.finished_at,
        duration_s=manifest.timings_s.get("total"),
        run_fingerprint=manifest.fingerprint,
        **values,
    ) | headline_metrics(run.out, manifest)


def rows_digest(df: pd.DataFrame) -> str:
    """The digest of an index's rows (:func:`~embgeom_ray.integrity.seal` of them as JSON,
    missing values as null): kept in ``runs.parquet``'s metadata (its header, under
    ``"digest"``), so that a flipped bit anywhere in the file that still parses (a digit of a
    metric, a column's name in the footer) is found when it is read back."""
    records = [{k: _plain(v) for k, v in rec.items()} for rec in df.to_dict("records")]
    return seal({"rows": records})[SEAL_KEY]


def _plain(v: Any) -> Any:
    """``v`` as a plain Python value (None for a missing one; numpy's scalars as Python's),
    so that the rows' digest does not depend on the dtypes pandas reads them back as."""
    v = _none_if_na(v)
    return v.item() if hasattr(v, "item") and not isinstance(v, (str, bytes)) else v


class RunIndex:
    """``STORE/runs.parquet``: one row per run key, rewritten atomically on every change, with
    the digest of its rows (:func:`rows_digest`), checked when it is read (an index of an
    earlier version has none)."""

    def __init__(self, store: str, *, read_only: bool = False):
        self.store = store
        self.url = join(store, INDEX)
        self.read_only = read_only
        self.rows: dict[str, dict[str, Any]] = {}
        if exists(self.url):
            try:
                table = pq.read_table(io.BytesIO(read_bytes(self.url)))
                df = table.to_pandas()
                header = json.loads((table.schema.metadata or {}).get(HEADER_KEY, b"{}"))
            except Exception as exc:
                raise OutputError(
                    f"the index {self.url} cannot be read ({type(exc).__name__}: {exc}); move "
                    "it away to rebuild it from the run directories"
                ) from None
            recorded = header.get(SEAL_KEY) if isinstance(header, dict) else None
            if recorded is not None and rows_digest(df) != recorded:
                raise IntegrityError(
                    self.url, "its rows do not match the digest recorded when it was written; "
                    "move it away to rebuild it from the run directories"
                )
            if "key" not in df.columns:
                raise OutputError(f"the index {self.url} has no 'key' column: not a run index")
            for rec in df.to_dict("records"):
                self.rows[str(rec["key"])] = {k: _none_if_na(v) for k, v in rec.items()}

    def get(self, key: str) -> dict[str, Any] | None:
        return self.rows.get(key)

    def upsert(self, row: dict[str, Any]) -> None:
        """Replace (or add) the row of ``row["key"]``, keeping columns not given, and save."""
        key = row["key"]
        self.rows[key] = (self.rows.get(key) or {}) | row
        if not self.read_only:
            frame = self.frame()
            header = {SEAL_KEY: rows_digest(frame)}
            write_table(self.store, INDEX.removesuffix(".parquet"), frame, header)

    def frame(self) -> pd.DataFrame:
        df = pd.DataFrame(list(self.rows.values()))
        for name, dtype in INDEX_COLUMNS.items():
            if name not in df.columns:
                df[name] = None
            df[name] = df[name].astype(dtype) if len(df) else pd.Series([], dtype=dtype)
        extra = [c for c in df.columns if c not in INDEX_COLUMNS]
        return df[[*INDEX_COLUMNS, *extra]].reset_index(drop=True)


def _none_if_na(v: Any) -> Any:
    try:
        return None if pd.isna(v) else v
    except (TypeError, ValueError):
        return v


def read_index(store: str) -> pd.DataFrame:
    """``STORE/runs.parquet`` as a DataFrame (empty, with the columns, if there is none)."""
    return RunIndex(store, read_only=True).frame()


# --------------------------------------------------------------------------------------------
# running: in-process, or as Ray jobs


@dataclass
class Outcome:
    """What happened to one watch-list entry."""

    entry: WatchEntry
    status: str  # up to date | analysed | would run | submitted | failed
    message: str = ""
    key: str | None = None
    out: str | None = None
    submission_id: str | None = None

    @property
    def failed(self) -> bool:
        return self.status == "failed"


@dataclass
class ReanalyzeResult:
    outcomes: list[Outcome]

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.failed]

    @property
    def ok(self) -> bool:
        return not self.failed


def analyze_argv(config: JobConfig) -> list[str]:
    """``python -m embgeom_ray analyze`` with every set option of ``config`` as a flag (the
    package's own command: found in a submitted checkout and in an installed package alike)."""
    argv = ["python", "-m", "embgeom_ray", "analyze"]
    for name, value in config.model_dump().items():
        if value is None or value is False:
            continue  # None: the job's default; every boolean option defaults to False
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            argv.append(f"{flag}={','.join(str(v) for v in value)}")
        else:
            argv.append(f"{flag}={value}")
    return argv


#: what a runtime environment's working_dir must not upload (gitignore patterns, as Ray reads
#: them: a leading ``/`` anchors a pattern at the checkout's top, so ``/runs`` leaves out the
#: runs' outputs and keeps the package ``embgeom_ray/runs/``)
WORKING_DIR_EXCLUDES = [
    "/.venv", "/.git", "/runs", "/build", ".hypothesis", ".pytest_cache", ".ruff_cache",
    "*.egg-info", "/bench/results", "__pycache__",
]  # fmt: skip


def default_runtime_env() -> dict[str, Any]:
    """The code the submitted jobs run, offline flags passed on: this checkout as
    ``working_dir`` (if it has ``jobs/``), else the installed package as a ``py_modules``
    entry (the same version as here; its dependencies must be on the nodes' image)."""
    env_vars = {"TOKENIZERS_PARALLELISM": "false"}
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(name):
            env_vars[name] = os.environ[name]
    runtime_env: dict[str, Any] = {"env_vars": env_vars}
    repo = Path(__file__).resolve().parents[2]
    if (repo / "jobs" / "analyze.py").is_file():
        runtime_env |= {"working_dir": str(repo), "excludes": list(WORKING_DIR_EXCLUDES)}
    else:
        runtime_env |= {"py_modules": [str(Path(__file__).resolve().parents[1])]}
    return runtime_env


_ACTIVE = {"PENDING", "RUNNING"}


def _job_status(client: Any, sid: str) -> tuple[str | None, str]:
    """(status, message) of the Ray job ``sid``, or (None, "") if the cluster has no such job."""
    try:
        info = client.get_job_info(sid)
    except RuntimeError as exc:
        if "404" in str(exc) or "does not exist" in str(exc):
            return None, ""
        raise
    return str(getattr(info.status, "value", info.status)), str(info.message or "")


def submit_run(client: Any, run: PlannedRun, runtime_env: dict[str, Any]) -> tuple[str, bool]:
    """Submit ``run`` as a Ray job under its stable id; returns (submission id, new?).

    ``new`` is False when a job with the id is already pending, running or succeeded (a
    duplicate, recognised, not run twice). Failed or stopped attempts move to the next id.
    """
    import shlex

    for attempt in range(1000):
        sid = submission_id(run.key, attempt)
        status, _ = _job_status(client, sid)
        if status in _ACTIVE:
            return sid, False
        if status is not None:  # FAILED, STOPPED, or SUCCEEDED without a complete run
            continue
        try:
            client.submit_job(
                entrypoint=shlex.join(analyze_argv(run.config)),
                submission_id=sid,
                runtime_env=runtime_env,
                metadata={"embgeom_key": run.key, "model": run.entry.model[:200]},
            )
        except RuntimeError as exc:
            if "already exists" in str(exc):  # submitted by someone else just now
                return sid, False
            raise
        return sid, True
    raise RuntimeError(f"1000 failed attempts of run {run.key}; giving up")


def _fail_row(run: PlannedRun, error: str, **values: Any) -> dict[str, Any]:
    return run.index_row(status="failed", error=error, finished_at=now(), **values)


class Reanalyzer:
    """One invocation of reanalyze (see the module docstring)."""

    def __init__(
        self,
        watchlist: str,
        store: str,
        *,
        corpus: str | None = None,
        config_path: str | None = None,
        dry_run: bool = False,
        submit: str | None = None,
        runtime_env: dict[str, Any] | None = None,
        wait: bool = True,
        poll_s: float = 5.0,
        client: Any = None,
        echo: Callable[[str], None] = print,
        warn: Callable[[str], None] | None = None,
    ):
        self.entries = load_watchlist(watchlist)
        self.base = load_yaml(config_path) if config_path else {}
        for name in ("model", "revision", "out", "overwrite"):
            if name in self.base:
                raise ConfigError(
                    f"--config {config_path} sets {name!r}: the watch list names the models and "
                    "--store decides where runs go; remove it"
                )
        base_corpus = self.base.pop("corpus", None)
        corpus = corpus or base_corpus
        if not corpus:
            raise ConfigError("--corpus is required (or 'corpus' in the --config file)")
        corpus = str(corpus)
        if "://" not in corpus and os.path.exists(corpus):
            corpus = os.path.abspath(corpus)  # a job submitted elsewhere (another cwd) finds it
        self.corpus = corpus
        if is_local(store):
            store = os.path.abspath(local_path(store))
        self.store = store.rstrip("/")
        self.dry_run = dry_run
        self.submit = submit
        self.runtime_env = default_runtime_env() if runtime_env is None else runtime_env
        self.wait = wait
        self.poll_s = poll_s
        self.client = client
        self.echo = echo
        self.warn = warn or (lambda s: print(s, file=sys.stderr, flush=True))
        self.index = RunIndex(self.store, read_only=dry_run)
        self.fingerprints = _CorpusFingerprints()
        # the corpus with the shared options is checked once, before any model
        self.fingerprints(entry_config(WatchEntry("-"), self.base, self.corpus, self.store, None))

    # -- one entry
    def _plan(self, entry: WatchEntry) -> PlannedRun | Outcome:
        try:
            return plan_entry(entry, self.base, self.corpus, self.store, self.fingerprints)
        except UserError as exc:
            self.warn(f"error: model {entry.position} ({entry.label}): {exc}")
            return Outcome(entry, "failed", str(exc))
        except Exception as exc:
            self.warn(f"error: model {entry.position} ({entry.label}): {type(exc).__name__}: {exc}")
            self.warn(traceback.format_exc())
            return Outcome(entry, "failed", f"{type(exc).__name__}: {exc}")

    def _up_to_date(self, run: PlannedRun) -> Outcome | None:
        """An Outcome if a complete run with the key exists (adopted into the index), else None."""
        row = self.index.get(run.key) or {}
        manifest = complete_manifest(run.out, run.key)
        if manifest is None:
            other = row.get("out")
            if row.get("status") == "complete" and other and other != run.out:
                # the same key under another directory name (e.g. a model directory that was
                # moved or renamed: its content hash, so its key, did not change)
                if complete_manifest(other, run.key) is not None:
                    self.echo(f"up to date: {run.name} -> {other}")
                    return Outcome(run.entry, "up to date", key=run.key, out=other)
            return None
        if manifest.lacks_report(run.config.no_report):
            return None  # stopped while its report was drawn: the analysis draws it
        if row.get("status") != "complete" or row.get("out") != run.out:
            # a complete run the index does not know (yet): adopt it
            self.index.upsert(complete_row(run, manifest, attempts=row.get("attempts", 0)))
        self.echo(f"up to date: {run.name} -> {run.out}")
        return Outcome(run.entry, "up to date", key=run.key, out=run.out)

    def _run_in_process(self, run: PlannedRun) -> Outcome:
        from .pipeline import analyze

        attempts = int((self.index.get(run.key) or {}).get("attempts") or 0) + 1
        why = why_new(run, list(self.index.rows.values()))
        self.echo(f"analysing {run.name} -> {run.out} (attempt {attempts}; {why})")
        t0 = time.perf_counter()
        self.index.upsert(
            run.index_row(
                status="running",
                error=None,
                attempts=attempts,
                started_at=now(),
                finished_at=None,
                duration_s=None,
                submission_id=None,
            )
        )
        try:
            manifest = Manifest.model_validate(analyze(run.config, echo=self.echo))
        except BaseException as exc:
            if sigterm_received() or not isinstance(exc, Exception):
                # Ctrl-C, SIGTERM (SystemExit(15); SystemExit(1) out of ray.wait, or an error
                # of the cleanup it interrupted: embgeom_ray.sigterm): the index says so, not
                # "running" for a run nobody runs, and the command ends (130, 143) instead of
                # going on to the next model
                self._interrupted(run, exc, attempts, round(time.perf_counter() - t0, 3))
                raise
            if isinstance(exc, UserError):
                error = str(exc)
            else:
                error = f"{type(exc).__name__}: {exc}"
                self.warn(traceback.format_exc())
        else:
            if manifest.complete and manifest_key(manifest) == run.key:
                self.index.upsert(complete_row(run, manifest, attempts=attempts))
                return Outcome(run.entry, "analysed", key=run.key, out=run.out)
            error = (
                "the run finished but does not match its key (the model directory or the "
                "corpus changed while it ran); it is run again next time"
            )
        duration = round(time.perf_counter() - t0, 3)
        self.index.upsert(_fail_row(run, error, attempts=attempts, duration_s=duration))
        self.warn(f"error: {run.name}: the analysis failed: {error}")
        return Outcome(run.entry, "failed", error, key=run.key, out=run.out)

    def _interrupted(
        self, run: PlannedRun, exc: BaseException, attempts: int, duration: float
    ) -> None:
        """Mark ``run`` failed, interrupted by ``exc`` (Ctrl-C, SIGTERM), in the index."""
        if sigterm_received() or (isinstance(exc, SystemExit) and exc.code == 15):
            why = "SIGTERM"
        elif isinstance(exc, KeyboardInterrupt):
            why = "Ctrl-C"
        else:
            why = f"SystemExit({exc.code})" if isinstance(exc, SystemExit) else type(exc).__name__
        error = f"interrupted ({why}); the next invocation resumes it"
        with contextlib.suppress(Exception):  # the interruption is what the user sees
            self.index.upsert(_fail_row(run, error, attempts=attempts, duration_s=duration))

    def _submit(self, run: PlannedRun) -> Outcome:
        row = self.index.get(run.key) or {}
        try:
            sid, new = submit_run(self.client, run, self.runtime_env)
        except Exception as exc:
            error = f"cannot submit to {self.submit}: {type(exc).__name__}: {exc}"
            self.warn(f"error: {run.name}: {error}")
            return Outcome(run.entry, "failed", error, key=run.key, out=run.out)
        values: dict[str, Any] = {"status": "submitted", "error": None, "submission_id": sid}
        if new:
            attempts = int(row.get("attempts") or 0) + 1
            values |= {"attempts": attempts, "started_at": now(), "finished_at": None}
        self.index.upsert(run.index_row(**values))
        what = "submitted" if new else "already submitted (following it)"
        self.echo(f"{what}: {run.name} as Ray job {sid} -> {run.out}")
        return Outcome(run.entry, "submitted", key=run.key, out=run.out, submission_id=sid)

    def _follow(self, outcomes: list[Outcome], runs: dict[str, PlannedRun]) -> None:
        """Wait for the submitted jobs and record how each ended."""
        pending = {o.submission_id: o for o in outcomes if o.status == "submitted"}
        while pending:
            for sid, outcome in list(pending.items()):
                status, message = _job_status(self.client, sid)
                if status in _ACTIVE:
                    continue
                del pending[sid]
                run = runs[outcome.key]
                manifest = complete_manifest(run.out, run.key)
                if manifest is not None:
                    self.index.upsert(complete_row(run, manifest, submission_id=sid))
                    outcome.status = "analysed"
                    self.echo(f"analysed: {run.name} (Ray job {sid}) -> {run.out}")
                    continue
                if status is None:
                    error = f"Ray job {sid} is no longer known to the cluster at {self.submit}"
                else:
                    error = f"Ray job {sid} ended {status}" + (f": {message}" if message else "")
                    if status == "SUCCEEDED":
                        error += f", but {run.out} holds no complete run with its key"
                self.index.upsert(_fail_row(run, error, submission_id=sid))
                outcome.status, outcome.message = "failed", error
                self.warn(f"error: {run.name}: {error}")
            if pending:
                time.sleep(self.poll_s)

    # -- everything
    def run(self) -> ReanalyzeResult:
        if self.submit and self.client is None and not self.dry_run:
            from ray.job_submission import JobSubmissionClient

            try:
                self.client = JobSubmissionClient(self.submit)
            except Exception as exc:
                first = (str(exc).strip().splitlines() or [""])[0]
                raise ConfigError(
                    f"--submit {self.submit}: cannot reach the Ray job server there "
                    f"({type(exc).__name__}: {first})"
                ) from None
        outcomes: list[Outcome] = []
        seen: dict[str, Outcome] = {}
        runs: dict[str, PlannedRun] = {}
        for entry in self.entries:
            planned = self._plan(entry)
            if isinstance(planned, Outcome):
                outcomes.append(planned)
                continue
            if planned.key in seen:
                first = seen[planned.key]
                self.echo(f"same run as model {first.entry.position}: {planned.name}")
                outcomes.append(Outcome(entry, first.status, first.message, planned.key, first.out))
                continue
            runs[planned.key] = planned
            outcome = self._up_to_date(planned)
            if outcome is None:
                if self.dry_run:
                    why = why_new(planned, list(self.index.rows.values()))
                    self.echo(f"would analyse: {planned.name} -> {planned.out} ({why})")
                    outcome = Outcome(entry, "would run", key=planned.key, out=planned.out)
                elif self.submit:
                    outcome = self._submit(planned)
                else:
                    outcome = self._run_in_process(planned)
            seen[planned.key] = outcome
            outcomes.append(outcome)
        if self.submit and self.wait and not self.dry_run:
            self._follow(outcomes, runs)
        result = ReanalyzeResult(outcomes)
        self.echo(summary_line(result, self.store))
        return result


def summary_line(result: ReanalyzeResult, store: str) -> str:
    n = len(result.outcomes)
    if all(o.status == "up to date" for o in result.outcomes):
        return f"up to date: all {n} models have a complete run in {store}; nothing to run"
    parts = [
        f"{result.count(s)} {s}"
        for s in ("up to date", "analysed", "would run", "submitted", "failed")
        if result.count(s)
    ]
    return f"{n} models: " + ", ".join(parts) + f" (index: {join(store, INDEX)})"


def reanalyze(watchlist: str, store: str, **kwargs: Any) -> ReanalyzeResult:
    """Run one invocation (see :class:`Reanalyzer` for the keyword arguments). An object
    store's endpoint and bucket are checked first, before its index is read or any model
    planned: its index is written after the runs, so a missing bucket was found hours late.
    Then the store is locked (:func:`~embgeom_ray.runs.store_lock.store_lock`): a second
    invocation on it meanwhile ends at once with :class:`StoreBusyError`, running nothing."""
    with user_errors(store, "store"):
        check_output(store, "store")
    if kwargs.get("dry_run"):  # writes nothing: no lock needed
        return Reanalyzer(watchlist, store, **kwargs).run()
    if is_local(store):
        store = os.path.abspath(local_path(store))
    with store_lock(store):  # one invocation at a time: StoreBusyError for a second one
        return Reanalyzer(watchlist, store, **kwargs).run()
