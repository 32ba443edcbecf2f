"""What the figures share: the style, an Agg canvas, atomic PNG writes, layer axes, lines.

Rendering uses matplotlib's object API on an Agg canvas: pyplot and the process-wide backend
are never touched, so this is safe to call from a Ray driver, a notebook or threads. PNGs are
written atomically (:func:`embgeom_ray.io_utils.atomic_write_bytes`), so the output directory
may be an fsspec URL as well as a local path. Within :func:`kept`, figures are kept as
matplotlib figures instead (the Python API's ``Run.figures()``) and nothing is written.
"""

from __future__ import annotations

import io
import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import matplotlib as mpl
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure as MplFigure

from ...io_utils import atomic_write_bytes, join

PLOTS_DIR = "plots"
DPI = 110

STYLE = {
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
COLORS = {
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
#: held while a figure is drawn under :data:`STYLE` (:func:`styled`)
_STYLE_LOCK = threading.RLock()
#: the figures :func:`save` keeps instead of writing them, by name (None: write them)
_KEPT: ContextVar[dict[str, MplFigure] | None] = ContextVar("kept_figures", default=None)


@contextmanager
def kept() -> Iterator[dict[str, MplFigure]]:
    """Within: :func:`save` writes nothing and keeps each figure in the mapping yielded (name ->
    matplotlib figure), in the order drawn."""
    token = _KEPT.set({})
    try:
        yield _KEPT.get()  # type: ignore[misc]
    finally:
        _KEPT.reset(token)


def keeping() -> bool:
    """Whether figures are being kept rather than written (:func:`kept`)."""
    return _KEPT.get() is not None

#: the marker of each line style of the per-layer curves (solid, dashed, dotted)
MARKERS = {"-": "o", "--": "s", ":": "^"}


@contextmanager
def styled() -> Iterator[None]:
    """Draw one figure under :data:`STYLE`, one thread of the process at a time.

    matplotlib's rcParams are one per process and ``rc_context`` restores them on exit: with
    two threads drawing at once, the first to finish restores the defaults while the other is
    still creating artists, and that figure comes out with default font sizes (seen with the
    report's figure groups drawn in threads). Figures drawn in other processes (Ray tasks)
    still draw in parallel.
    """
    with _STYLE_LOCK, mpl.rc_context(STYLE):
        yield


def new_figure(width: float, height: float) -> MplFigure:
    """A figure of ``width`` × ``height`` inches on its own Agg canvas, constrained layout."""
    fig = MplFigure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig: MplFigure, run_out: str, name: str) -> str:
    """Write ``fig`` as ``run_out/plots/name.png`` atomically; returns the path (within
    :func:`kept`: keeps ``fig`` instead, and returns the path it would have had)."""
    figures = _KEPT.get()
    if figures is not None:
        figures[name] = fig
        return join(run_out, PLOTS_DIR, f"{name}.png")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    path = join(run_out, PLOTS_DIR, f"{name}.png")
    atomic_write_bytes(path, buf.getvalue())
    return path


def title(fig: MplFigure, what: str, tag: str) -> None:
    fig.suptitle(f"{what}\n{tag}", fontsize=11)


def pick_layers(layers: Sequence[int], k: int) -> list[int]:
    """At most ``k`` layers, evenly spread, always the first and the last."""
    layers = sorted(int(x) for x in layers)
    if len(layers) <= k:
        return layers
    idx = np.unique(np.round(np.linspace(0, len(layers) - 1, k)).astype(int))
    return [layers[i] for i in idx]


def grid(n: int) -> tuple[int, int]:
    """(columns, rows) of a grid of ``n`` panels."""
    ncols = n if n <= 4 else (4 if n <= 16 else 6)
    return ncols, math.ceil(n / ncols)


def fmt(v: float, digits: int = 2) -> str:
    """``v`` with ``digits`` decimals and a true minus sign; ``n/a`` when not finite."""
    return "n/a" if v is None or not np.isfinite(v) else f"{v:.{digits}f}".replace("-", "−")


def int_layers(ax, layers: np.ndarray) -> None:
    """An x axis of layer indices."""
    if len(layers) <= 16:
        ax.set_xticks(layers)
    else:
        ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("layer (hidden_states index; 0 = embedding output)")


def extreme(values: np.ndarray, layers: np.ndarray, fn=np.nanargmin) -> tuple[float, int]:
    """The value ``fn`` picks (the smallest by default) and its layer."""
    i = int(fn(values))
    return float(values[i]), int(layers[i])


def line(ax, layers, values, *, color, style="-", label, marker="o") -> bool:
    """One per-layer curve; False (nothing drawn) when ``values`` is None."""
    if values is None:
        return False
    ax.plot(
        layers, values, linestyle=style, marker=marker, ms=3.5, lw=1.6, color=color, label=label
    )
    return True


def legend_below(ax, ncols: int = 2) -> None:
    """The axes' legend under its x label, outside the data: up to eight curves over every
    layer leave no corner free inside (MiniLM's S_intra ran under a legend placed "best")."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=ncols, frameon=False)


def annotate_top(
    ax, layers: np.ndarray, values: np.ndarray, labels: dict[int, str] | None = None
) -> None:
    """Write each layer's finite value (or its label) above the axes, at the layer's x."""
    for x, v in zip(layers, values, strict=True):
        if np.isfinite(v):
            ax.annotate(
                labels[int(x)] if labels is not None else f"{int(v)}",
                (x, 1.0),
                xycoords=("data", "axes fraction"),
                ha="center",
                va="bottom",
                fontsize=7,
                color="#555555",
            )


def hide_unused(axes: np.ndarray, used: int) -> None:
    """Hide the panels of a grid beyond the first ``used``."""
    for ax in axes[used:]:
        ax.set_visible(False)
