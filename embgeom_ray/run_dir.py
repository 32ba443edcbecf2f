"""A run's output directory: its typed manifest, its files, atomic writes, finalising.

Layout of a run directory ``OUT`` (``docs/design.md``, "Output contract")::

    manifest.json              status, identity, counts, timings (:class:`Manifest`)
    type_stats.parquet, layers.parquet, dims.parquet, positions.parquet
    samples.parquet            the sample, one row per (layer, sample, occurrence), with the
                               sample's header in its metadata: the mergeable sample too
                               (:class:`ActivationSample`, :meth:`RunDir.load_sample`)
    statistics.safetensors     the mergeable statistics (:class:`EmbeddingStatistics`), or
    statistics/                the same cut into partitions by reducer actors (``--reducers``):
                               index.json and one file per part (:meth:`RunDir.load_statistics`)
    doc_hashes.npy             the kept documents' 16-byte keys (``--dedup`` runs only)
    report.html, plots/        the report
    run.json, groups/          the run's fingerprint and shard plan, the checkpoint groups

Every file is written atomically. ``manifest.json`` says ``"status": "running"`` from the start
of a run and ``"complete"`` only after every table and artefact is in place
(:meth:`RunDir.finalise`), so a reader can trust a complete manifest and nothing else. The
complete manifest records the digest of every table and artefact (``outputs.digests``;
``statistics/index.json`` those of the parts it names), and every read of them through
:class:`RunDir` (tables, the sample, the statistics whole or a part, ``doc_hashes.npy``) is
checked against it (:mod:`embgeom_ray.integrity`); the manifest holds its own digest
(``"digest"``, :func:`~embgeom_ray.integrity.seal`), checked whenever it is read. Runs
written before digests have none and are read unchecked.
:class:`RunDir` is the one place that knows these names: the pipeline, the merge, the report,
the comparison and the scheduled re-analysis all read and write runs through it.

Every run directory has a format version, :data:`FORMAT_VERSION` (``MAJOR.MINOR``): in
``manifest.json`` (``format_version``) and in every table's Parquet metadata
(:data:`FORMAT_KEY`). A reader reads every earlier format (runs of earlier versions have no
``format_version``: they are format 0) and every minor version of its own major, and refuses a
newer major in one line (:func:`check_format`). A change that an earlier reader would misread
(a column whose meaning changes, a file moved) raises the major; a new column or key raises
the minor.

Runs written before ``samples.parquet`` held the sample's header also hold the sample as
``sample.safetensors`` (the same vectors in the sketch file format); :meth:`RunDir.load_sample`
reads either, and finalising such a run again (a re-tabling) leaves only the table.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, Literal

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .core.metric_registry import summary_columns
from .counts import Counts
from .errors import UserError
from .integrity import (
    Digest,
    FileRef,
    as_ref,
    digests_from_json,
    digests_json,
    open_verified,
    read_verified,
    seal,
    unseal,
)
from .io_utils import atomic_write_bytes, atomic_write_json, exists, join, read_bytes, remove
from .shared_out import MARKER_PREFIX
from .storage import require_filesystem
from .version import __version__

MANIFEST = "manifest.json"
STATISTICS = "statistics.safetensors"
#: the sample of runs written before ``samples.parquet`` held its header (read, not written)
SAMPLE = "sample.safetensors"
#: the Parquet metadata key of the sample's header in ``samples.parquet`` (the sketch files' own)
HEADER_KEY = b"embgeom_ray"
REPORT = "report.html"
#: ``(distinct documents, 16)`` uint8: the kept documents' keys of a ``--dedup`` run
DOC_HASHES = "doc_hashes.npy"
RUN_JSON = "run.json"
GROUPS = "groups"
#: the reducer actors' checkpoints (``--reducers``) and their partition plan
REDUCERS = "reducers"
PLOTS = "plots"
#: the partitioned statistics artefact (a directory) and its index
STATISTICS_PARTS = "statistics"
PARTS_INDEX = "index.json"
PARTS_FORMAT = "embgeom-partitioned-statistics/1"
#: the exact tables of the output contract, and the sample's table
TABLES = ("type_stats", "layers", "dims", "positions", "samples", "kmeans")
#: the format of what a run directory holds (module docstring): ``MAJOR.MINOR``
FORMAT_VERSION = "1.0"
#: every entry a run, a merge or a report writes in a run directory (docs/outputs.md, "A run
#: directory"): what :meth:`RunDir.clear` removes, and nothing else
RUN_ENTRIES = frozenset(
    {MANIFEST, STATISTICS, SAMPLE, REPORT, DOC_HASHES, RUN_JSON, GROUPS, REDUCERS, PLOTS,
     STATISTICS_PARTS, *(f"{table}.parquet" for table in TABLES)}
)  # fmt: skip
#: the temporary files of atomic writes (:mod:`~embgeom_ray.io_utils`), of the write probe,
#: and the markers of the check that every node sees the directory (:mod:`~.shared_out`: a
#: merge killed while it checked leaves one in its ``--out``)
TEMPORARY_PREFIXES = (".tmp-", ".write-probe", MARKER_PREFIX)
#: the Parquet metadata key of a table's format version
FORMAT_KEY = b"embgeom_ray.format_version"


class RunDirError(UserError):
    """A directory that is not a (complete, readable) run directory."""


def check_format(version: str | None, where: str) -> None:
    """Raise :class:`RunDirError` when ``version`` (a file's format version; None: written
    before versions were recorded) has a newer major than :data:`FORMAT_VERSION`."""
    if version is None:
        return
    ours = int(FORMAT_VERSION.split(".")[0])
    try:
        major = int(str(version).split(".")[0])
    except ValueError:
        raise RunDirError(f"{where} has an unreadable format version {version!r}") from None
    if major > ours:
        raise RunDirError(
            f"{where} was written in output format {version} by a newer embgeom_ray; this "
            f"version ({__version__}) reads format {ours}.x and earlier: upgrade embgeom-ray"
        )


def _with_format(table: pa.Table) -> pa.Table:
    """``table`` with :data:`FORMAT_VERSION` in its schema's metadata."""
    return table.replace_schema_metadata(
        (table.schema.metadata or {}) | {FORMAT_KEY: FORMAT_VERSION.encode()}
    )


def _check_table_format(metadata: Mapping[bytes, bytes] | None, where: str) -> None:
    version = (metadata or {}).get(FORMAT_KEY)
    check_format(version.decode() if version is not None else None, where)


class _Part(BaseModel):
    """A part of the manifest: typed known keys, unknown keys kept (newer writers)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class ModelInfo(_Part):
    id: str
    revision: str | None = None
    model_fingerprint: str | None = None
    model_type: str | None = None
    num_layers: int | None = None
    hidden_size: int | None = None


class TokenizerInfo(_Part):
    class_: str | None = Field(None, alias="class")
    fingerprint: str | None = None
    special_ids: list[int] = Field(default_factory=list)
    special_tokens_counted: bool = False


class CorpusInfo(_Part):
    #: the corpus as given; a merged run lists its runs' corpora
    source: str | list[Any] | None = None
    fingerprint: str | None = None
    files: int = 0
    bytes: int = 0
    shards: int = 0
    #: the leaf corpora's fingerprints of a merged run
    merged_fingerprints: list[str] | None = None

    def leaves(self) -> list[str]:
        """Fingerprints of the corpora the run covers (several for a merged run)."""
        return list(self.merged_fingerprints or [self.fingerprint or ""])


class DedupInfo(_Part):
    """What ``--dedup`` counted: documents read, duplicates dropped, distinct documents kept
    (``documents_read = duplicates_dropped + distinct_kept``; ``counts.documents`` is the
    kept ones), and how texts were compared (:mod:`embgeom_ray.inputs.dedup`). The kept
    documents' keys are the run's ``doc_hashes.npy``."""

    documents_read: int = 0
    duplicates_dropped: int = 0
    distinct_kept: int = 0
    normalisation: str | None = None
    hash: str | None = None

    def describe(self) -> str:
        """``"3 of 10 documents (7 distinct kept)"``."""
        return (
            f"{self.duplicates_dropped:,} of {self.documents_read:,} documents "
            f"({self.distinct_kept:,} distinct kept)"
        )


class ShardsInfo(_Part):
    total: int
    reused_from_checkpoints: int = 0
    computed: int = 0
    checkpoint_groups: int = 0


class Outputs(_Part):
    artefacts: list[str] = Field(default_factory=list)
    tables: list[str] = Field(default_factory=list)
    manifest: str = MANIFEST
    report: str | None = None
    #: file name -> the digest of its bytes (:mod:`embgeom_ray.integrity`); a partitioned
    #: artefact's under ``statistics/index.json``, which holds its parts'
    digests: dict[str, Any] | None = None


class Manifest(_Part):
    """``manifest.json``: what a run measured, how, and how it went.

    Keys written by earlier versions load; keys this version does not know are kept as they
    are. Dumped with only the keys that were set (:meth:`to_json`), so the document keeps the
    shape readers of earlier versions rely on.
    """

    model_config = ConfigDict(extra="allow", populate_by_name=True, validate_assignment=True)

    status: Literal["running", "complete"] = "running"
    #: the run directory's format (:data:`FORMAT_VERSION`), set whenever the manifest is
    #: written; absent in runs of earlier versions
    format_version: str | None = None
    #: ``"merge"`` for a run made by ``jobs.merge``; absent for an analysis
    kind: Literal["merge"] | None = None
    started_at: str | None = None
    finished_at: str | None = None
    fingerprint: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    model: ModelInfo | None = None
    tokenizer: TokenizerInfo | None = None
    corpus: CorpusInfo = Field(default_factory=CorpusInfo)
    layers: list[int] = Field(default_factory=list)
    clip_dims: list[int] | None = None
    #: the rule that flags rogue dimensions, in words
    outlier_rules: str | None = None
    versions: dict[str, str] = Field(default_factory=dict)
    counts: Counts | None = None
    skipped: dict[str, int] = Field(default_factory=dict)
    #: duplicate documents dropped (``--dedup`` runs only; absent otherwise)
    dedup: DedupInfo | None = None
    shards: ShardsInfo | None = None
    workers: dict[str, Any] | None = None
    #: the reducer actors of a partitioned reduce: count, token ranges, layers, restarts
    reducers: dict[str, Any] | None = None
    #: peak resident memory (bytes) of the driver, the extractors and each reducer
    memory: dict[str, Any] | None = None
    #: every sizing decision with its reason (:mod:`embgeom_ray.sizing`): at the start, and
    #: ``reduce`` once the types seen are known
    sizing: dict[str, Any] | None = None
    timings_s: dict[str, float] = Field(default_factory=dict)
    throughput: dict[str, float | None] = Field(default_factory=dict)
    sample: dict[str, Any] | None = None
    outputs: Outputs | None = None
    report_error: str | None = None
    merged_runs: list[dict[str, Any]] | None = None

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    def lacks_report(self, no_report: bool) -> bool:
        """Whether this complete run lacks the report a job with ``no_report`` asks for and
        none was tried and failed: the run was stopped (SIGTERM, Ctrl-C) after its manifest was
        written complete, while its report was drawn (``outputs.report`` is recorded once it
        is written)."""
        if no_report or self.outputs is None:
            return False
        return self.outputs.report is None and self.report_error is None

    def set(self, **values: Any) -> Manifest:
        """Set fields (validated, and marked as set so they are written)."""
        for key, value in values.items():
            setattr(self, key, value)
        return self


#: tables written with one Parquet row group per run of equal values of these columns, so a
#: reader filtering on them (``filters=[("layer", "=", 3)]``, as the report's PCA views do)
#: decodes only the matching groups, not every layer's vectors.
ROW_GROUP_KEYS: dict[str, tuple[str, ...]] = {"samples": ("layer", "sample")}


def row_runs(df: pd.DataFrame | pa.Table, keys: tuple[str, ...]) -> list[tuple[int, int]]:
    """(start, length) of the runs of consecutive rows with equal values in ``keys``."""
    if not len(df):
        return [(0, 0)]
    change = np.zeros(len(df), dtype=bool)
    change[0] = True
    for key in keys:
        col = np.asarray(df[key].to_numpy())
        change[1:] |= col[1:] != col[:-1]
    starts = np.flatnonzero(change)
    ends = np.append(starts[1:], len(df))
    return [(int(a), int(b - a)) for a, b in zip(starts, ends, strict=True)]


@contextlib.contextmanager
def _staged(url: str, digests: dict[str, Digest] | None = None) -> Iterator[str]:
    """A local path to write ``url``'s file into: a temporary name beside it, renamed into
    place (local), or a temporary file uploaded (object stores:
    :func:`~embgeom_ray.io_utils.put_file`) when the block ends without an error; removed
    either way. ``digests`` gets the file's digest under its name."""
    from .io_utils import is_local, local_path, put_file

    local = is_local(url)
    directory = os.path.dirname(os.path.abspath(local_path(url))) if local else None
    if directory:
        os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".parquet", dir=directory)
    os.close(fd)
    try:
        yield tmp
        if digests is not None:
            digests[url.rsplit("/", 1)[-1]] = Digest.of_file(tmp)
        if local:
            os.chmod(tmp, 0o666 & ~_UMASK)
            os.replace(tmp, local_path(url))
        else:
            put_file(tmp, url)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_UMASK = os.umask(0)
os.umask(_UMASK)


def sample_layer_table(
    one: Any,
    id_to_token: Callable[[Sequence[int]], Sequence[str]] | None,
    labels: np.ndarray | None,
) -> pa.Table:
    """One layer's rows of ``samples.parquet`` from its one-layer sample ``one``
    (:meth:`ActivationSample.to_table <embgeom_ray.core.samples.ActivationSample.to_table>`)
    with the uniform rows' K-means ``cluster`` (``labels`` in canonical order; None: none),
    as Arrow (with pandas' metadata, as every layer's)."""
    df = one.to_table(id_to_token)
    df["cluster"] = pd.array([None] * len(df), dtype="Int64")
    if labels is not None:
        uniform = (df["sample"] == "uniform").to_numpy()
        df.loc[uniform, "cluster"] = np.asarray(labels, dtype=np.int64)
    return pa.Table.from_pandas(df, preserve_index=False)


def sample_table_pieces(
    sample: Any,
    id_to_token: Callable[[Sequence[int]], Sequence[str]] | None,
    clusters: Mapping[int, np.ndarray],
) -> Iterator[tuple[dict[str, Any], pa.Table]]:
    """Each layer of ``sample`` (a :class:`~embgeom_ray.core.sample_layers.SampleLayers`) in
    turn: its one-layer sample's header and :func:`sample_layer_table` (built here)."""
    for layer in sample.layers:
        one = sample.layer(layer)
        header = one.header()
        table = sample_layer_table(one, id_to_token, clusters.get(layer))
        del one
        yield header, table


def write_table(
    out: str,
    name: str,
    df: pd.DataFrame,
    header: dict[str, Any] | None = None,
    digests: dict[str, Digest] | None = None,
) -> str:
    """Write ``df`` as ``OUT/name.parquet`` atomically; returns the file name (``digests``
    gets its digest under that name).

    Tables named in :data:`ROW_GROUP_KEYS` get one row group per run of their keys. A
    ``header`` (JSON) is kept in the file's metadata under :data:`HEADER_KEY`, the format
    version under :data:`FORMAT_KEY`.
    """
    table = _with_format(pa.Table.from_pandas(df, preserve_index=False))
    if header is not None:
        meta = (table.schema.metadata or {}) | {HEADER_KEY: json.dumps(header).encode()}
        table = table.replace_schema_metadata(meta)
    buf = io.BytesIO()
    keys = ROW_GROUP_KEYS.get(name, ())
    if keys and all(k in df.columns for k in keys):
        with pq.ParquetWriter(buf, table.schema, compression="zstd") as writer:
            for start, length in row_runs(df, keys):
                writer.write_table(table.slice(start, length))
    else:
        pq.write_table(table, buf, compression="zstd")
    data = buf.getbuffer()
    atomic_write_bytes(join(out, f"{name}.parquet"), data)
    if digests is not None:
        digests[f"{name}.parquet"] = Digest.of(data)
    return f"{name}.parquet"


def versions() -> dict[str, str]:
    import numpy
    import ray
    import torch
    import transformers

    return {
        "embgeom_ray": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ray": ray.__version__,
        "numpy": numpy.__version__,
        "pyarrow": pa.__version__,
    }


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")  # not datetime.UTC: Python 3.10


class RunDir:
    """A run's output directory (local path or fsspec URL): the one object that knows its files.

    Reading: :meth:`manifest` (typed; :class:`RunDirError` naming what is wrong),
    :meth:`complete_manifest` (refuses an unfinished run), :meth:`read_table`. Writing:
    :meth:`write_manifest`, :meth:`write_table`, :meth:`save_artefacts` — each atomic — and
    :meth:`finalise`, which marks the run complete once every output is in place.
    """

    def __init__(self, url: str, digests: Mapping[str, Digest] | None = None) -> None:
        self.url = str(url).rstrip("/") or "/"
        require_filesystem(self.url, "run directory")  # an unknown protocol: one line
        #: the digests of the files written through this object (recorded by :meth:`finalise`)
        self.written: dict[str, Digest] = {}
        #: the digests of the files when they are recorded elsewhere than in a manifest (a
        #: comparison's, in its ``comparison.json``)
        self._given = None if digests is None else dict(digests)
        #: the digests of a complete manifest's outputs, read once (:meth:`digest`)
        self._digests: dict[str, Digest] | None = self._given

    def __repr__(self) -> str:
        return f"RunDir({self.url!r})"

    def path(self, name: str) -> str:
        """The URL of a file of the run; a bare table name gets ``.parquet``."""
        return join(self.url, name if "." in name or name in (GROUPS, PLOTS, STATISTICS_PARTS) else f"{name}.parquet")

    def has(self, name: str) -> bool:
        return exists(self.path(name))

    # ------------------------------------------------------------------ manifest
    def has_manifest(self) -> bool:
        return exists(self.path(MANIFEST))

    def holds_run(self) -> bool:
        """Whether a run was started here: its manifest, its ``run.json`` or its checkpoints."""
        return any(exists(self.path(name)) for name in (MANIFEST, RUN_JSON, GROUPS))

    def manifest(self) -> Manifest:
        """The typed manifest; :class:`RunDirError` if there is none or it is unreadable."""
        url = self.path(MANIFEST)
        if not exists(self.url):
            raise RunDirError(f"{self.url} does not exist")
        if not exists(url):
            raise RunDirError(
                f"{self.url} is not a run directory of jobs.analyze: it has no {MANIFEST} "
                "(give the --out directory of a run)"
            )
        try:
            data = json.loads(read_bytes(url))
        except (ValueError, UnicodeDecodeError) as exc:
            raise RunDirError(f"{url} is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise RunDirError(f"{url} is not a run manifest (not a JSON object)")
        data = unseal(data, url)
        check_format(data.get("format_version"), f"run {self.url}")
        try:
            return Manifest.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            raise RunDirError(
                f"{url} is not a manifest this version can read: {where}: {first['msg']} "
                f"(got {first.get('input')!r})"
            ) from None

    def complete_manifest(self, purpose: str) -> Manifest:
        """The manifest of a complete run, or :class:`RunDirError` saying it is unfinished."""
        manifest = self.manifest()
        if not manifest.complete:
            raise RunDirError(
                f"run {self.url} is not complete (status {manifest.status!r}): finish it "
                f"(run the command that started it again, to resume) before {purpose}"
            )
        return manifest

    def write_manifest(self, manifest: Manifest) -> None:
        """Write ``manifest`` atomically, in this version's format (:data:`FORMAT_VERSION`),
        with its digest (:func:`~embgeom_ray.integrity.seal`: checked by :meth:`manifest`)."""
        manifest.set(format_version=FORMAT_VERSION)
        atomic_write_json(self.path(MANIFEST), seal(manifest.to_json()))
        self._digests = self._given

    def digest(self, name: str) -> Digest | None:
        """The digest the manifest records for the file ``name`` (``outputs.digests``:
        ``"layers.parquet"``, ``"statistics/index.json"``, …); None where it records none (a
        run of an earlier version, or not finished)."""
        if self._digests is None:
            self._digests = {}
            with contextlib.suppress(RunDirError):
                outputs = self.manifest().outputs if self.has_manifest() else None
                if outputs is not None:
                    self._digests = digests_from_json(outputs.digests)
        return self._digests.get(name)

    def ref(self, name: str) -> FileRef:
        """The file ``name`` of the run with its recorded digest (:meth:`digest`)."""
        url = self.path(name)
        return FileRef(url, self.digest(url[len(self.url.rstrip("/")) + 1 :]))

    # ------------------------------------------------------------------ tables and artefacts
    def write_table(self, name: str, df: pd.DataFrame, header: dict[str, Any] | None = None) -> str:
        return write_table(self.url, name, df, header, self.written)

    def read_table(
        self, name: str, columns: Sequence[str] | None = None, filters: Any = None
    ) -> pd.DataFrame:
        """A table of the run (:meth:`read_arrow`) as a DataFrame."""
        return self.read_arrow(name, columns, filters).to_pandas()

    def read_arrow(
        self, name: str, columns: Sequence[str] | None = None, filters: Any = None
    ) -> pa.Table:
        """A table of the run, only ``columns`` (all when empty or None) and, with ``filters``
        (pyarrow's, e.g. ``[("layer", "=", 3)]``), only the rows that match: a table written
        with row groups by those columns (:data:`ROW_GROUP_KEYS`) is read only where they
        match. :class:`RunDirError` if it is missing or unreadable."""
        url = self.path(name)
        if not exists(url):
            raise RunDirError(f"run {self.url} has no {url.rsplit('/', 1)[-1]}")
        try:
            with open_verified(self.ref(name)) as f:
                table = pq.read_table(
                    f, columns=list(columns) if columns else None, filters=filters
                )
        except UserError:
            raise
        except Exception as exc:
            known = self.columns(name) if columns else []
            missing = [c for c in columns or [] if c not in known]
            if known and missing:  # the file is fine: the columns asked for are not in it
                raise RunDirError(
                    f"{url.rsplit('/', 1)[-1]} has no column(s) {missing}; its columns are "
                    f"{known}"
                ) from None
            raise RunDirError(f"{url} cannot be read: {type(exc).__name__}: {exc}") from None
        _check_table_format(table.schema.metadata, url)
        return table

    def columns(self, name: str) -> list[str]:
        """The column names of a table of the run (its schema only); ``[]`` without the table."""
        if not self.has(name):
            return []
        try:
            with open_verified(self.ref(name)) as f:
                return list(pq.ParquetFile(f).schema_arrow.names)
        except UserError:
            raise
        except Exception as exc:
            raise RunDirError(f"{self.path(name)} cannot be read: {type(exc).__name__}: {exc}") from None

    def sample_layers(self) -> list[int]:
        """The layers ``samples.parquet`` holds vectors of (``[]`` without a sample)."""
        if "layer" not in self.columns("samples"):
            return []
        layers = self.read_arrow("samples", ["layer"]).column("layer").to_numpy()
        return sorted(int(x) for x in np.unique(layers))

    def sample_vectors(
        self,
        layer: int,
        sample: str = "uniform",
        columns: Sequence[str] | None = ("layer", "token_id", "cluster"),
    ) -> tuple[pd.DataFrame, np.ndarray] | None:
        """One layer's rows of ``samples.parquet`` (``sample`` ``"uniform"`` or
        ``"type_uniform"``): their ``columns`` (None: every column but the vectors), and their
        ``(n, d)`` vectors as float64 (stored float32, exact). Only that layer's row groups are
        read. ``None`` when the run has no such rows."""
        names = self.columns("samples")
        if "vector" not in names or "layer" not in names:
            return None
        filters = [("layer", "=", int(layer))]
        if "sample" in names:
            filters.append(("sample", "=", sample))
        wanted = [c for c in names if c != "vector"] if columns is None else list(columns)
        cols = [c for c in (*wanted, "vector") if c in names]
        table = self.read_arrow("samples", cols, filters)
        n = table.num_rows
        if n == 0:
            return None
        vec = table.column("vector").combine_chunks()
        flat = vec.flatten().to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
        if flat.size == 0 or flat.size % n:
            return None
        return table.drop(["vector"]).to_pandas(), flat.reshape(n, flat.size // n)

    def write_tables(
        self, tables: dict[str, pd.DataFrame], headers: dict[str, dict[str, Any]] | None = None
    ) -> list[str]:
        """Every table of ``tables``, each with its header of ``headers`` (if any)."""
        return [self.write_table(name, df, (headers or {}).get(name)) for name, df in tables.items()]

    @contextlib.contextmanager
    def table_writer(self, name: str) -> Iterator[Callable[[pd.DataFrame], None]]:
        """A table written a part at a time: the block calls the function given with each
        part's rows (a DataFrame of the same columns each time), each written as it comes
        (row groups of that part) and let go of; the table is moved into place when the block
        ends without an error (a staged file, as :meth:`write_samples`), never half-written
        under its name. ``type_stats`` is written this way a layer at a time."""
        writer: list[pq.ParquetWriter] = []
        with _staged(self.path(name), self.written) as path:
            def write(df: pd.DataFrame) -> None:
                table = _with_format(pa.Table.from_pandas(df, preserve_index=False))
                if not writer:
                    writer.append(pq.ParquetWriter(path, table.schema, compression="zstd"))
                writer[0].write_table(table.replace_schema_metadata(writer[0].schema.metadata))

            try:
                yield write
            finally:
                if writer:
                    writer[0].close()
            if not writer:
                raise ValueError(f"table {name} was given no rows")

    # ------------------------------------------------------------------ the sample
    def write_samples(
        self,
        sample: Any,
        id_to_token: Callable[[Sequence[int]], Sequence[str]] | None,
        clusters: Mapping[int, np.ndarray],
        pieces: Iterable[tuple[dict[str, Any], pa.Table]] | None = None,
    ) -> str:
        """``samples.parquet`` written a layer at a time from ``sample`` (a
        :class:`~embgeom_ray.core.sample_layers.SampleLayers`): each layer's rows
        (:func:`sample_layer_table`, with the uniform rows' K-means ``cluster`` from
        ``clusters``: layer -> labels in the canonical order; a layer left out has none), as
        that layer's row groups (at least one per sample, :data:`ROW_GROUP_KEYS`), then
        dropped: the rows, their order and the header are those of the whole table, and this
        process holds one layer of them at a time. ``pieces``: those rows already built, in
        order, each with its one-layer sample's header (as :func:`sample_table_pieces` gives
        them; e.g. by Ray tasks, :func:`embgeom_ray.distributed.sample_tasks.table_pieces_on_ray`,
        so that this process holds one piece at a time). Written to a temporary file and moved
        into place (uploaded, on an object store), so the table is never half-written under
        its name."""
        if pieces is None:
            pieces = sample_table_pieces(sample, id_to_token, clusters)
        writer: pq.ParquetWriter | None = None
        with _staged(self.path("samples"), self.written) as path:
            try:
                for one_header, table in pieces:
                    if writer is None:
                        header = one_header | {"layers": list(sample.layers)}
                        meta = (table.schema.metadata or {}) | {
                            HEADER_KEY: json.dumps(header).encode(),
                            FORMAT_KEY: FORMAT_VERSION.encode(),
                        }
                        writer = pq.ParquetWriter(path, table.schema.with_metadata(meta), compression="zstd")
                    table = table.replace_schema_metadata(writer.schema.metadata)
                    for start, length in row_runs(table, ROW_GROUP_KEYS["samples"]):
                        writer.write_table(table.slice(start, length))
                    del table
            finally:
                if writer is not None:
                    writer.close()
        return "samples.parquet"

    def table_header(self, name: str) -> dict[str, Any] | None:
        """The header a table keeps in its metadata (:func:`write_table`); None without one."""
        if not self.has(name):
            return None
        try:
            with open_verified(self.ref(name)) as f:
                meta = pq.read_schema(f).metadata or {}
        except UserError:
            raise
        except Exception as exc:
            raise RunDirError(f"{self.path(name)} cannot be read: {type(exc).__name__}: {exc}") from None
        _check_table_format(meta, self.path(name))
        return None if HEADER_KEY not in meta else json.loads(meta[HEADER_KEY])

    def table_rows(self, name: str) -> int:
        """The rows table ``name`` holds (its footer's count: no row read)."""
        try:
            with open_verified(self.ref(name)) as f:
                return int(pq.read_metadata(f).num_rows)
        except UserError:
            raise
        except Exception as exc:
            raise RunDirError(f"{self.path(name)} cannot be read: {type(exc).__name__}: {exc}") from None

    def has_sample(self) -> bool:
        """Whether the run holds its sample: ``samples.parquet`` with its header, or (runs of
        earlier versions) ``sample.safetensors``."""
        return self.table_header("samples") is not None or self.has(SAMPLE)

    def load_sample(self) -> Any:
        """The run's :class:`~embgeom_ray.core.samples.ActivationSample`, read from
        ``samples.parquet`` (:meth:`ActivationSample.from_table
        <embgeom_ray.core.samples.ActivationSample.from_table>`) or, for a run of an earlier
        version, ``sample.safetensors``; None for a run without a sample (``--sample-size 0``).
        """
        from .core.samples import ActivationSample
        from .errors import StatisticsMismatchError

        header = self.table_header("samples")
        if header is None:
            return ActivationSample.load(self.path(SAMPLE)) if self.has(SAMPLE) else None
        try:
            return ActivationSample.from_table(self.read_arrow("samples"), header)
        except StatisticsMismatchError as exc:
            raise StatisticsMismatchError(f"{self.path('samples')}: {exc}") from None

    def write_doc_hashes(self, hashes: np.ndarray) -> str:
        """``doc_hashes.npy``: the ``(n, 16)`` uint8 keys of a ``--dedup`` run's kept documents."""
        buf = io.BytesIO()
        np.save(buf, np.ascontiguousarray(hashes, dtype=np.uint8).reshape(-1, 16))
        atomic_write_bytes(self.path(DOC_HASHES), buf.getvalue())
        self.written[DOC_HASHES] = Digest.of(buf.getbuffer())
        return DOC_HASHES

    def read_doc_hashes(self) -> np.ndarray:
        """The run's ``doc_hashes.npy``; :class:`RunDirError` if it is missing or not keys."""
        url = self.path(DOC_HASHES)
        if not exists(url):
            raise RunDirError(f"run {self.url} has no {DOC_HASHES} (a run with --dedup writes it)")
        try:
            hashes = np.load(io.BytesIO(read_verified(self.ref(DOC_HASHES))), allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise RunDirError(f"{url} cannot be read: {exc}") from None
        if hashes.dtype != np.uint8 or hashes.ndim != 2 or hashes.shape[1] != 16:
            raise RunDirError(f"{url} holds {hashes.dtype} {hashes.shape}, not (n, 16) uint8 keys")
        return hashes

    def save_artefacts(self, statistics: Any) -> list[str]:
        """``statistics.safetensors`` (or ``statistics/`` when ``statistics`` is partitioned:
        it says so with ``partitioned = True``); its name. (The sample is a table:
        :meth:`finalise`.)"""
        partitioned = getattr(statistics, "partitioned", False)
        name = STATISTICS_PARTS + "/" if partitioned else STATISTICS
        remove(self.path(STATISTICS_PARTS))  # stale parts (any R) or the other form
        if partitioned:
            remove(self.path(STATISTICS))
        digest = statistics.save(self.path(name.rstrip("/")))
        if digest is not None:  # a partitioned artefact's: its index's
            self.written[join(STATISTICS_PARTS, PARTS_INDEX) if partitioned else STATISTICS] = digest
        return [name]

    def has_statistics(self) -> bool:
        """Whether the run holds its statistics artefact, whole or partitioned."""
        return self.has(STATISTICS) or self.has(join(STATISTICS_PARTS, PARTS_INDEX))

    def load_statistics(self) -> Any:
        """The run's :class:`~embgeom_ray.core.statistics.EmbeddingStatistics`, whole: read
        from ``statistics.safetensors``, or the parts listed in ``statistics/index.json``
        combined (:meth:`~embgeom_ray.core.statistics.EmbeddingStatistics.combine`)."""
        from .core.statistics import EmbeddingStatistics

        ref = self.statistics_ref()
        index = _parts_index(ref)
        if index is None:
            return EmbeddingStatistics.load(ref)
        return EmbeddingStatistics.combine(
            [EmbeddingStatistics.load(_part_ref(ref.url, index, name)) for name in index["files"]]
        )

    def statistics_intact(self) -> bool:
        """Whether the run's statistics artefact is present and every byte of it matches the
        digest the manifest records (``outputs.digests``; of a partitioned artefact, its
        index's, then each part's as the index records it): read once, a block at a time.
        False where no digest is recorded (nothing to check it against) or a file is missing
        or differs. What lets an interrupted re-tabulation start again from the artefact
        (:func:`~embgeom_ray.runs.pipeline.already_complete`)."""
        try:
            ref = self.statistics_ref()
        except RunDirError:
            return False
        if ref.digest is None:
            return False
        try:
            if not ref.url.endswith(STATISTICS):  # the index checked, then each part
                index = _parts_index(ref)
                if index is None:
                    return False
                parts = [_part_ref(ref.url, index, name) for name in index["files"]]
                return all(
                    part.digest is not None and Digest.of_file(part.url) == part.digest
                    for part in parts
                )
            return Digest.of_file(ref.url) == ref.digest
        except (UserError, OSError, ValueError):
            return False

    def statistics_ref(self) -> FileRef:
        """:meth:`statistics_url` with the digest the manifest records for it (for the
        ``statistics/`` directory, its ``index.json``'s)."""
        url = self.statistics_url()
        name = STATISTICS if url.endswith(STATISTICS) else join(STATISTICS_PARTS, PARTS_INDEX)
        return FileRef(url, self.digest(name))

    def statistics_url(self) -> str:
        """Where the run's statistics artefact is: ``statistics.safetensors``, or the
        ``statistics/`` directory of parts (read with :func:`load_statistics_part`)."""
        if self.has(STATISTICS):
            return self.path(STATISTICS)
        if self.has(join(STATISTICS_PARTS, PARTS_INDEX)):
            return self.path(STATISTICS_PARTS)
        raise RunDirError(f"run {self.url} has no {STATISTICS} nor {STATISTICS_PARTS}/")

    def finalise(
        self,
        manifest: Manifest,
        tables: dict[str, pd.DataFrame],
        statistics: Any,
        sample: Any,
        *,
        id_to_token: Callable[[Sequence[int]], Sequence[str]] | None = None,
        clusters: Mapping[int, np.ndarray] | None = None,
        written_before: Sequence[str] = (),
        sample_pieces: Iterable[tuple[dict[str, Any], pa.Table]] | None = None,
        artefacts: Sequence[str] | None = None,
    ) -> Manifest:
        """Write the artefacts and tables, then the manifest as ``complete`` (in that order).

        ``sample``: None, an :class:`~embgeom_ray.core.samples.ActivationSample` whose rows
        ``tables["samples"]`` holds (its :meth:`to_table` rows, with the sampled stage's
        columns), or, without ``tables["samples"]``, a sample given a layer at a time
        (:class:`~embgeom_ray.core.sample_layers.SampleLayers`) that :meth:`write_samples`
        writes a layer at a time (``id_to_token``, ``clusters``, ``sample_pieces``: its
        ``pieces``, as there). Either way the
        sample's header goes into the file's metadata; a ``sample.safetensors`` of an earlier
        version is then removed. ``written_before``: tables the caller wrote already (a part at
        a time, :meth:`table_writer`), listed first among the outputs. ``artefacts``: the
        statistics artefact written before (:meth:`save_artefacts`' names; ``statistics`` is
        then not read), as a run does before its sampled stage, so that its reducers are
        stopped before it.
        """
        headers = {}
        if sample is not None and "samples" in tables:
            rows = len(sample.layers) * (sample.num_uniform + sample.num_types)
            if len(tables["samples"]) != rows:
                raise ValueError(f"the samples table does not hold the sample's {rows} rows")
            headers["samples"] = sample.header()
        artefacts = self.save_artefacts(statistics) if artefacts is None else list(artefacts)
        if manifest.dedup is not None:  # written by the caller before (pipeline, merge)
            artefacts.append(DOC_HASHES)
        written = [*written_before, *self.write_tables(tables, headers)]
        if sample is not None and "samples" not in tables:
            written.append(self.write_samples(sample, id_to_token, clusters or {}, sample_pieces))
        order = {f"{name}.parquet": i for i, name in enumerate(TABLES)}
        written.sort(key=lambda f: order.get(f, len(order)))  # the contract's order
        remove(self.path(SAMPLE))  # the form an earlier version wrote beside the table
        kept = [*artefacts, *written]
        if STATISTICS_PARTS + "/" in kept:
            kept.append(join(STATISTICS_PARTS, PARTS_INDEX))
        digests = {name: d for name, d in self.written.items() if name in kept}
        manifest.set(
            status="complete",
            finished_at=now(),
            outputs=Outputs(
                artefacts=artefacts, tables=written, manifest=MANIFEST,
                digests=digests_json(dict(sorted(digests.items()))),
            ),
        )  # fmt: skip
        self.write_manifest(manifest)
        return manifest

    def clear(self) -> list[str]:
        """Remove what a run left here (``--overwrite``): the entries of
        :data:`RUN_ENTRIES` and temporary files, and nothing else, so that files of the
        user's own in the directory (a corpus, notes, another tool's output) are kept. Returns
        the names removed."""
        import fsspec

        fs, root = fsspec.core.url_to_fs(self.url)
        if not fs.exists(root):
            return []
        removed = []
        # listed afresh (a cached listing may name what is gone); an object store may list the
        # directory's own marker object (``dir/``), whose name is the directory's: never that
        for entry in fs.ls(root, detail=False, refresh=True):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if entry.rstrip("/") == root.rstrip("/"):
                continue
            if name in RUN_ENTRIES or name.startswith(TEMPORARY_PREFIXES):
                with contextlib.suppress(FileNotFoundError):
                    fs.rm(entry, recursive=True)
                removed.append(name)
        return sorted(removed)

    def files(self) -> list[tuple[str, int]]:
        """Every file under the run (relative name, bytes), checkpoints included, sorted."""
        import fsspec

        fs, root = fsspec.core.url_to_fs(self.url)
        if not fs.exists(root):
            return []
        out = []
        for path, info in fs.find(root, detail=True).items():
            rel = path[len(root.rstrip("/")) + 1 :]
            if not rel.rsplit("/", 1)[-1].startswith("."):
                out.append((rel, int(info.get("size") or 0)))
        return sorted(out)


def format_summary(layers: pd.DataFrame) -> str:
    """The per-layer summary printed at the end of a run: the columns the registry marks
    ``summary`` (:func:`~embgeom_ray.core.metric_registry.summary_columns`)."""
    cols = [c for c in summary_columns() if c in layers.columns]
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.precision", 4):
        return layers[cols].to_string(index=False)


def _parts_index(source: str | FileRef) -> dict[str, Any] | None:
    """The index of the partitioned artefact at ``source`` (checked against its digest: a
    :class:`~embgeom_ray.integrity.FileRef` of the directory carries its index's); None when
    ``source`` is not one."""
    ref = as_ref(source)
    index_url = join(ref.url, PARTS_INDEX)
    if not exists(index_url):
        return None
    try:
        index = json.loads(read_verified(FileRef(index_url, ref.digest)))
    except ValueError as exc:
        raise RunDirError(f"{index_url} is not valid JSON: {exc}") from None
    if not isinstance(index, dict) or index.get("format") != PARTS_FORMAT:
        raise RunDirError(f"{index_url} is not an index of format {PARTS_FORMAT}")
    return index


def _part_ref(directory: str, index: Mapping[str, Any], name: str) -> FileRef:
    """The part ``name`` of a partitioned artefact with the digest its index records."""
    return FileRef(join(directory, name), digests_from_json(index.get("digests")).get(name))


def load_statistics_part(
    url: str | FileRef,
    layers: Sequence[int] | None = None,
    token_range: tuple[int, int | None] = (0, None),
    *,
    layer_state: bool = True,
) -> Any:
    """The part of the statistics artefact at ``url`` that holds ``layers``, the rows of the
    token ids in ``token_range`` and (if ``layer_state``) the per-layer fields, as
    :meth:`EmbeddingStatistics.load_part <embgeom_ray.core.statistics.EmbeddingStatistics.load_part>`.

    ``url`` is a statistics file (a run's ``statistics.safetensors``, a checkpoint group's
    piece) or a partitioned artefact's directory, cut into any partitions: then only the
    files whose token range or layers meet the part are read, each only for what they share
    with it, and the pieces are combined. Memory: the part, plus one file's share of it.
    Every byte read is checked against the digests recorded (a
    :class:`~embgeom_ray.integrity.FileRef`'s, and the index's of its parts).
    """
    from .core.statistics import EmbeddingStatistics, StatisticsPart

    index = _parts_index(url)
    if index is None:
        return EmbeddingStatistics.load_part(url, layers, token_range, layer_state=layer_state)
    url = as_ref(url).url
    lo, hi = token_range
    pieces, first = [], None
    for name in index["files"]:
        path = _part_ref(url, index, name)
        header = EmbeddingStatistics.read_header(path)
        held = [int(x) for x in header["layers"]]
        part = StatisticsPart.from_json(header["partition"] or {"of_layers": held, "token_range": [0, None], "layer_state": True})  # fmt: skip
        here = [x for x in held if layers is None or x in layers]
        if not here:
            continue
        first = first or (path, here)
        own_lo, own_hi = part.token_range
        a = max(lo, own_lo)
        b = own_hi if hi is None else (hi if own_hi is None else min(hi, own_hi))
        rows = b is None or a < b
        state = layer_state and part.layer_state
        if rows or state:
            pieces.append(
                EmbeddingStatistics.load_part(
                    path, here, (a, b) if rows else (lo, lo), layer_state=state
                )
            )
    if not pieces:
        if first is None:
            raise RunDirError(f"{url} holds none of the layers {list(layers or [])}")
        return EmbeddingStatistics.load_part(first[0], first[1], (lo, lo), layer_state=False)
    return pieces[0] if len(pieces) == 1 else EmbeddingStatistics.combine(pieces)


def statistics_type_ids(url: str | FileRef) -> np.ndarray:
    """The increasing token ids the statistics artefact at ``url`` (file or partitioned
    directory) holds rows for, read without its other arrays."""
    from .core.statistics import EmbeddingStatistics

    index = _parts_index(url)
    if index is None:
        return EmbeddingStatistics.read_type_ids(url)
    directory = as_ref(url).url
    ids = [EmbeddingStatistics.read_type_ids(_part_ref(directory, index, n)) for n in index["files"]]
    return np.unique(np.concatenate(ids)) if ids else np.zeros(0, np.int64)
