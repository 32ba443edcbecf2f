"""Cosine and isotropy metrics with the outlier dimensions zeroed ("clipping", Luo 2020;
Luo et al. 2021), each beside its unclipped counterpart of the same estimator."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...run_view import RunView
from .common import COLORS, MARKERS, annotate_top, int_layers, line, new_figure, save, styled, title


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


def _clip_dims_text(run: RunView) -> str:
    """``dims 3, 17`` (the run's ``--clip-dims``, shortened) or ``--clip-dims``."""
    clip_set = ""
    if "clip_dims_exact" in run.layers.columns:
        vals = run.layers["clip_dims_exact"].dropna().astype(str)
        clip_set = vals.iloc[0] if len(vals) else ""
    if len(clip_set) > 30:
        clip_set = clip_set[:28] + "…"
    return f"dims {clip_set}" if clip_set else "--clip-dims"


def clipping_panels(run: RunView) -> list[ClipPanel]:
    """What :func:`plot_clipping` draws: one panel per estimator, pairs of the same estimator.

    Sampled cosines (unclipped solid, flagged dims zeroed dashed); exact cosines with
    ``--clip-dims`` (unclipped solid, zeroed dotted); exact IsoScore (flagged dims dashed,
    ``--clip-dims`` dotted). A pair without an unclipped column of the same estimator is left
    out of the figure: nothing is drawn beside a counterpart from another estimator.
    """
    col = run.layer_col
    clip_txt = _clip_dims_text(run)
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


def _clipping_panel(ax, run: RunView, panel: ClipPanel, layers: np.ndarray) -> None:
    """One estimator's pairs: unclipped solid, flagged dims dashed, ``--clip-dims`` dotted."""
    for c, label, style in panel.lines:
        m = c.split("_clipped")[0].removesuffix("_sampled")
        line(
            ax,
            layers,
            run.layer_col(c),
            color=COLORS[m],
            style=style,
            marker=MARKERS[style],
            label=label,
        )
    int_layers(ax, layers)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2, fontsize=7, frameon=False)
    if panel.title.startswith("IsoScore"):
        ax.set_ylim(0, 1.02)
        ax.set_ylabel("IsoScore")
    else:
        ax.axhline(0, color="#999999", lw=0.8)
        ax.set_ylabel("mean cosine similarity")
    ax.set_title(panel.title.replace(": ", ":\n", 1), fontsize=9, pad=14)


def _clipping_caption(run: RunView, panels: list[ClipPanel], flagged_counts: bool) -> str:
    ests = {p.title.split(":")[0]: p for p in panels}
    caption = (
        "Like with like: each panel compares a metric with and without the outlier dimensions "
        "zeroed (“clipping”) using ONE estimator, named in its title and legend; solid is "
        "unclipped. Luo (2020) and Luo et al. (2021) found that clipping a handful of rogue "
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
        dotted = any(s == ":" for _, _, s in ests["IsoScore"].lines)
        caption += (
            " IsoScore: exact from the covariance, unclipped (solid), flagged dims zeroed "
            "(dashed)" + (", --clip-dims zeroed (dotted)" if dotted else "") + "."
        )
    left = [p.clipped for p in clipping_pairs(run.layers.columns) if p.base is None]
    if left:
        caption += (
            f" Not drawn: {', '.join(left)} (no unclipped column of the same estimator in "
            "this run)."
        )
    if flagged_counts:
        caption += " Numbers above the left panel: how many dims are flagged in each layer."
    return caption


def plot_clipping(run: RunView) -> tuple[str | None, str]:
    """Cosine and isotropy metrics with the outlier dimensions zeroed (Luo 2020; Luo et al. 2021).

    Like with like (:func:`clipping_panels`): the sampled clipped cosines beside the sampled
    unclipped ones (``*_sampled``), the exact ``--clip-dims`` cosines beside the exact ones,
    IsoScore exact beside exact; each panel's title names its estimator.
    """
    panels = clipping_panels(run)
    if not panels:
        if any(p.base is None for p in clipping_pairs(run.layers.columns)):
            return None, (
                "Not drawn: the run's clipped metrics have no unclipped counterpart of the same "
                "estimator (sampled clipped cosines without *_sampled columns)."
            )
        return None, "Not drawn: layers.parquet has no clipped (outlier dims zeroed) metrics."
    layers = run.layers["layer"].to_numpy()
    n = run.layer_col("n_outlier_dims")
    with styled():
        fig = new_figure(5.8 * len(panels), 4.6)
        axes = list(np.atleast_1d(fig.subplots(1, len(panels))))
        for ax, panel in zip(axes, panels, strict=True):
            _clipping_panel(ax, run, panel, layers)
        if n is not None:
            annotate_top(axes[0], layers, n)
        title(fig, "Zeroing the outlier dimensions (Luo 2020; Luo et al. 2021)", run.tag)
        path = save(fig, run.out, "clipping")
    return path, _clipping_caption(run, panels, n is not None)
