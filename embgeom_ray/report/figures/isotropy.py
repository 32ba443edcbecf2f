"""Per-layer curves of anisotropy, cosine similarity and isotropy (Ethayarajh 2019; Cai et al.
2021; Rudman et al. 2022; Mu & Viswanath 2018), cluster-adjusted variants beside the exact."""

from __future__ import annotations

import numpy as np

from ...run_view import RunView
from .clusters import k_marks_note, kmeans_labels
from .common import (
    COLORS,
    annotate_top,
    extreme,
    fmt,
    int_layers,
    legend_below,
    line,
    new_figure,
    save,
    styled,
    title,
)

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
        if line(ax, layers, col(name), color=COLORS[colour], style=style, marker=marker,
                label=label) and name not in _ALWAYS:  # fmt: skip
            drawn.append(name)
    return drawn


def _cosine_panel(ax, run: RunView, layers: np.ndarray) -> list[str]:
    """The left panel: the cosine lines, each layer's K-means k above; the extras drawn."""
    extras = _lines(ax, layers, run.layer_col, COSINE_LINES)
    k = run.layer_col("kmeans_k")
    if k is not None:
        annotate_top(ax, layers, k, kmeans_labels(run, short=True))
    ax.set_ylabel("mean cosine similarity")
    ax.set_title(
        "Cosine similarity (Ethayarajh 2019; Cai et al. 2021)", pad=14 if k is not None else 6
    )
    int_layers(ax, layers)
    ax.axhline(0, color="#999999", lw=0.8)
    legend_below(ax)
    return extras


def _isotropy_panel(ax, run: RunView, layers: np.ndarray) -> list[str]:
    """The right panel: IsoScore and its variants, partition isotropy; the extras drawn."""
    extras = _lines(ax, layers, run.layer_col, ISOTROPY_LINES)
    partition = any(e.startswith("partition") for e in extras)
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("isotropy  (0 = one direction, 1 = isotropic)")
    ax.set_title("Isotropy (Rudman et al. 2022" + ("; Mu & Viswanath 2018)" if partition else ")"))
    int_layers(ax, layers)
    legend_below(ax)
    return extras


def _cosine_isotropy_caption(run: RunView, extras: list[str], layers: np.ndarray) -> str:
    caption = (
        "Left: mean cosine similarity over all pairs of two distinct occurrences (anisotropy), "
        "over pairs of different types (S_inter) and between occurrences of the same type, "
        "averaged over types (S_intra, Ethayarajh's self-similarity); all exact over every "
        "counted token. "
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
    if run.layer_col("kmeans_k") is not None:
        caption += " k above the left panel is the number of K-means clusters chosen per layer"
        caption += k_marks_note(run) + "."
    if any(e.startswith("partition") for e in extras):
        caption += (
            " Partition isotropy I(W) = min_c Z(c) / max_c Z(c) over the principal directions "
            "(Mu & Viswanath 2018), raw and of centred vectors."
        )
    if "s_inter_type_uniform" in extras or "isoscore_sample" in extras:
        caption += (
            " Dotted: sampled variants (one random occurrence per type; the sample's IsoScore)."
        )
    a = run.layer_col("anisotropy")
    if a is not None:
        v, at = extreme(a, layers, np.nanargmax)
        caption += f" Anisotropy is highest at layer {at} ({fmt(v, 3)})."
    return caption


def plot_cosine_isotropy(run: RunView) -> tuple[str | None, str]:
    """Anisotropy, S_inter, S_intra and IsoScore across layers; cluster-adjusted ones dashed."""
    col = run.layer_col
    if all(col(c) is None for c in ("anisotropy", "s_inter", "s_intra", "isoscore")):
        return None, "Not drawn: layers.parquet has no cosine or isotropy metrics."
    layers = run.layers["layer"].to_numpy()
    with styled():
        fig = new_figure(11.5, 5.4)
        ax1, ax2 = fig.subplots(1, 2)
        extras = _cosine_panel(ax1, run, layers) + _isotropy_panel(ax2, run, layers)
        title(fig, "Anisotropy and isotropy across layers", run.tag)
        path = save(fig, run.out, "cosine_isotropy")
    return path, _cosine_isotropy_caption(run, extras, layers)
