"""Positional profile of the flagged dimensions (Luo, Kulmizev & Mao 2021): each flagged
dimension's mean at each position within the window, for selected layers."""

from __future__ import annotations

import math
import re

import matplotlib as mpl
import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

from ...run_view import RunView
from .common import hide_unused, new_figure, pick_layers, save, styled, title

MAX_POSITION_LAYERS = 8
MAX_PROFILE_DIMS = 8
#: the x label: position 0 is a special token where the tokenizer adds one first ([CLS], BOS),
#: not counted without --keep-special (the label said "0 = first position" over curves that
#: start at 1)
POSITION_LABEL = (
    "position within the window (positions restart in each window)\n"
    "special tokens included: 0 is [CLS] or BOS where the tokenizer adds one, not counted"
)
MIN_POSITION_COUNT = 10  # positions seen fewer times are not drawn (noise at the window's end)


def _dims_to_draw(pos: pd.DataFrame, dim_cols: list[str]) -> list[str]:
    """At most :data:`MAX_PROFILE_DIMS` of ``dim_cols``: those that vary most with position
    (range over positions, largest over layers), in dimension order."""
    if len(dim_cols) <= MAX_PROFILE_DIMS:
        return dim_cols
    spread = pos.groupby("layer")[dim_cols].agg(lambda v: v.max() - v.min()).max()
    spread = spread.sort_values(ascending=False)
    return sorted(spread.index[:MAX_PROFILE_DIMS], key=lambda c: int(c[4:]))


def _draw(run: RunView, pos: pd.DataFrame, shown_dims: list[str]) -> str:
    """One panel per selected layer; returns the PNG's path."""
    layers = pick_layers(pos["layer"].unique(), MAX_POSITION_LAYERS)
    ncols = min(len(layers), 4)
    nrows = math.ceil(len(layers) / ncols)
    cmap = mpl.colormaps["tab10"]
    with styled():
        fig = new_figure(3.6 * ncols + 1.2, 2.9 * nrows + 1.1)
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
        hide_unused(axes, len(layers))
        handles = [Line2D([], [], color=cmap(i % 10), lw=1.5) for i in range(len(shown_dims))]
        if shown_dims:
            fig.legend(
                handles,
                [f"dim {c[4:]}" for c in shown_dims],
                loc="outside right upper",
                title="flagged dims",
            )
        fig.supxlabel(POSITION_LABEL)
        fig.supylabel("mean value of the dimension" if shown_dims else "mean_norm at the position")
        title(fig, "Positional profile of flagged dimensions (Luo et al. 2021)", run.tag)
        return save(fig, run.out, "positional_profile")


def _caption(dim_cols: list[str], shown_dims: list[str], dropped: int) -> str:
    if shown_dims:
        caption = (
            "For selected layers, the mean value of each flagged (outlier) dimension over all "
            "tokens at a given position within the window. Luo, Kulmizev & Mao (2021) found "
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
    return caption


def plot_positional_profile(run: RunView) -> tuple[str | None, str]:
    """Per-position mean of the flagged dimensions (Luo, Kulmizev & Mao 2021)."""
    pos = run.positions
    if pos is None or not {"layer", "position"} <= set(pos.columns):
        return None, "Not drawn: the run has no positions.parquet."
    dim_cols = sorted(
        (c for c in pos.columns if re.fullmatch(r"dim_\d+", str(c))), key=lambda c: int(c[4:])
    )
    if not dim_cols and "mean_norm" not in pos.columns:
        return None, "Not drawn: positions.parquet has no dim_<d> or mean_norm columns."
    dropped = 0
    if "count" in pos.columns:
        dropped = int((pos["count"] < MIN_POSITION_COUNT).sum())
        pos = pos[pos["count"] >= MIN_POSITION_COUNT]
    if not len(pos):
        return None, f"Not drawn: no position was seen {MIN_POSITION_COUNT} times or more."
    shown_dims = _dims_to_draw(pos, dim_cols)
    return _draw(run, pos, shown_dims), _caption(dim_cols, shown_dims, dropped)
