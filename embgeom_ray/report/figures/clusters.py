"""The sampled metrics across layers: local intrinsic dimension and silhouettes (Cai et al.
2021; Mickus et al. 2024), IsoScore against silhouette, each layer's K-means silhouette curve
over k, and how each layer's K-means k is written in the figures (:func:`kmeans_labels`)."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.ticker import NullFormatter

from ...core.kmeans_selection import ROBUST_SUPPORT
from ...core.sampled_metrics import isoscore_silhouette_correlation
from ...run_view import RunView
from .common import COLORS, MARKERS, fmt, int_layers, line, new_figure, save, styled, title

#: appended to a k whose best k is the largest k of the K-means scan
AT_CAP_MARK = "▲"

LID_COLUMNS = (
    "lid_euclidean", "lid_cosine", "lid_euclidean_median", "lid_cosine_median",
    "lid_euclidean_cai",
)  # fmt: skip
LID_LABELS = {
    "lid_euclidean": "LID, Euclidean distance (mean)",
    "lid_cosine": "LID, cosine distance (mean)",
    "lid_euclidean_median": "LID, Euclidean distance (median)",
    "lid_cosine_median": "LID, cosine distance (median)",
    "lid_euclidean_cai": "LID, Cai et al.'s convention (mean)",
}
SILHOUETTE_LABELS = {
    "kmeans_silhouette": "silhouette, K-means clusters",
    "silhouette_types": "silhouette, token types as labels",
}


def k_marks_note(run: RunView) -> str:
    """``; ▲: …`` and ``; k = 1: …`` for the captions, when the run has such layers."""
    text = ""
    labels = kmeans_labels(run)
    if any(AT_CAP_MARK in t for t in labels.values()):
        text += (
            f"; {AT_CAP_MARK}: the best k is the largest k fitted (--kmeans-k-max), the "
            "silhouette still rising there, so there is no interior optimum and k is the "
            "range scanned"
        )
    if any(t.startswith("k=1") for t in labels.values()):
        text += (
            "; k=1: no clustering preferred (the best silhouette over k ≥ 2 was below "
            "--kmeans-min-silhouette)"
        )
    return text


def kmeans_labels(run: RunView, short: bool = False) -> dict[int, str]:
    """The k written at each layer's K-means point in the figures, by layer.

    ``k=7``; ``k=60▲`` when the best k is the largest k of the scan (``kmeans_k_at_cap``:
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


def _lid_panel(ax, lid: dict[str, np.ndarray], layers: np.ndarray) -> None:
    """LID curves: mean solid, median dashed, Cai et al.'s convention dotted."""
    for c, v in lid.items():
        base = c.removesuffix("_median").removesuffix("_cai")
        style = "--" if c.endswith("_median") else (":" if c.endswith("_cai") else "-")
        line(
            ax,
            layers,
            v,
            color=COLORS[base],
            style=style,
            marker=MARKERS[style],
            label=LID_LABELS[c],
        )
    ax.set_ylabel("local intrinsic dimension (MLE over the sample)")
    ax.set_title("Local intrinsic dimension (Levina & Bickel; Cai et al. 2021)")
    int_layers(ax, layers)
    ax.set_ylim(bottom=0)
    ax.legend(framealpha=0.9)


def _mark_kmeans_points(
    ax, run: RunView, layers: np.ndarray, k: np.ndarray, sil: np.ndarray
) -> None:
    """Each K-means silhouette point's k beside it; hollow points where k = 1 was chosen."""
    k_text = kmeans_labels(run)
    rejected = k == 1
    if rejected.any():  # the silhouette of a rejected best k > 1: hollow
        ax.scatter(
            layers[rejected],
            sil[rejected],
            s=42,
            facecolors="white",
            edgecolors=COLORS["kmeans_silhouette"],
            linewidths=1.4,
            zorder=3,
            label="k = 1: silhouette of the rejected best k > 1",
        )
    for x, kv, sv in zip(layers, k, sil, strict=True):
        if np.isfinite(kv) and np.isfinite(sv):
            # k = 1's label stacked under its point, no wider than a layer's step: written on
            # one line beside it, two neighbouring layers' labels ran into each other
            ax.annotate(
                stacked(k_text[int(x)]) if kv == 1 else k_text[int(x)],
                (x, sv),
                textcoords="offset points",
                xytext=(0, -7) if kv == 1 else (0, 6),
                ha="center",
                va="top" if kv == 1 else "bottom",
                fontsize=7,
                linespacing=1.0,
            )


def stacked(label: str) -> str:
    """``k=1 (best 41 rejected)`` on three lines: ``k=1``, ``(best 41``, ``rejected)``."""
    return label.replace(" (", "\n(").replace(" rejected", "\nrejected")


def _silhouette_panel(ax, run: RunView, sil: dict[str, np.ndarray], layers: np.ndarray) -> None:
    """Silhouettes by K-means clusters and by token types, each K-means point's k."""
    for c, v in sil.items():
        line(ax, layers, v, color=COLORS[c], label=SILHOUETTE_LABELS[c])
    k = run.layer_col("kmeans_k")
    if k is not None and "kmeans_silhouette" in sil:
        _mark_kmeans_points(ax, run, layers, k, sil["kmeans_silhouette"])
    ax.axhline(0, color="#999999", lw=0.8)
    ax.set_ylabel("mean silhouette (−1 … 1)")
    ax.set_title("Cluster structure of the sample (Cai et al. 2021; Mickus et al. 2024)")
    int_layers(ax, layers)
    ax.legend(framealpha=0.9)


def _intrinsic_dim_caption(run: RunView, lid: dict, sil: dict) -> str:
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
        k = run.layer_col("kmeans_k")
        if k is not None and "kmeans_silhouette" in sil:
            caption += (
                "; the k of each point is written above it (under it where k = 1)"
                + k_marks_note(run)
            )
            if (k == 1).any():
                caption += (
                    ". A hollow point is the silhouette of the best k > 1 of a layer where it "
                    "was rejected (k = 1), not a result of a clustering"
                )
        caption += "."
    return caption.strip()


def plot_intrinsic_dimension(run: RunView) -> tuple[str | None, str]:
    """LID across layers (Cai et al. 2021) and, when present, K-means/type silhouettes."""
    col = run.layer_col
    lid = {c: col(c) for c in LID_COLUMNS if col(c) is not None}
    sil = {c: col(c) for c in ("kmeans_silhouette", "silhouette_types") if col(c) is not None}
    if not lid and not sil:
        return None, "Not drawn: the run has no sampled LID or silhouette columns (no sample)."
    layers = run.layers["layer"].to_numpy()
    panels = [p for p in (lid, sil) if p]
    with styled():
        fig = new_figure(5.8 * len(panels), 4.2)
        axes = list(np.atleast_1d(fig.subplots(1, len(panels))))
        if lid:
            _lid_panel(axes.pop(0), lid, layers)
        if sil:
            _silhouette_panel(axes.pop(0), run, sil, layers)
        title(fig, "Intrinsic dimension and cluster structure across layers", run.tag)
        path = save(fig, run.out, "intrinsic_dim")
    return path, _intrinsic_dim_caption(run, lid, sil)


def plot_isoscore_silhouette(run: RunView) -> tuple[str | None, str]:
    """IsoScore against silhouette, one point per layer (Mickus et al. 2024); each r is
    :func:`~embgeom_ray.core.sampled_metrics.isoscore_silhouette_correlation`, the function
    behind the manifest's ``sample.isoscore_silhouette_corr``."""
    col = run.layer_col
    iso = col("isoscore")
    sils = {c: col(c) for c in ("kmeans_silhouette", "silhouette_types") if col(c) is not None}
    if iso is None or not sils:
        return None, "Not drawn: the run has no silhouette columns (no sample) or no IsoScore."
    layers = run.layers["layer"].to_numpy()
    rejected = {la for la, t in kmeans_labels(run, short=True).items() if t == "k=1"}
    rs: dict[str, float] = {}
    markers = {"kmeans_silhouette": "o", "silhouette_types": "s"}
    names = {"kmeans_silhouette": "K-means clusters", "silhouette_types": "token types"}
    with styled():
        fig = new_figure(6.8, 4.8)
        ax = fig.add_subplot()
        sc = None
        for c, s in sils.items():
            # the manifest's sample.isoscore_silhouette_corr (for kmeans_silhouette): one formula
            rs[c] = isoscore_silhouette_correlation(run.layers, "isoscore", c)
            sc = ax.scatter(
                s,
                iso,
                c=layers,
                cmap="viridis",
                marker=markers[c],
                s=46,
                edgecolors="black",
                linewidths=0.5,
                label=f"{names[c]}  (r = {fmt(rs[c])})",
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
        title(fig, "Isotropy against cluster structure (Mickus et al. 2024)", run.tag)
        path = save(fig, run.out, "isoscore_silhouette")
    rtxt = "; ".join(f"r = {fmt(r)} with {names[c]}" for c, r in rs.items())
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


def plot_kmeans_curve(run: RunView) -> tuple[str | None, str]:
    """Each layer's silhouette against k over the K-means scan (``kmeans.parquet``), the best k
    marked and the threshold below which k = 1 is chosen."""
    km = run.kmeans
    if km is None:
        return None, "Not drawn: the run has no kmeans.parquet (no sample, or an earlier version)."
    threshold = float(run.config.get("kmeans_min_silhouette", 0.1))
    layers = sorted(int(x) for x in km["layer"].unique())
    cmap = plt_colormap(len(layers))
    support = _k_support(run)
    with styled():
        fig = new_figure(7.2, 4.4)
        ax = fig.subplots()
        for i, layer in enumerate(layers):
            rows = km[km["layer"] == layer].sort_values("k")
            color = cmap(i)
            ax.plot(rows["k"], rows["silhouette"], marker=".", ms=3, lw=1.2, color=color,
                    label=f"layer {layer}{support.get(layer, '')}")  # fmt: skip
            best = rows[rows["best"]]
            if len(best):
                chosen = bool(best["chosen"].iloc[0])
                ax.scatter(best["k"], best["silhouette"], s=46, zorder=3, color=color,
                           edgecolors="black", marker="o" if chosen else "X")  # fmt: skip
        ax.axhline(threshold, color="#888888", ls="--", lw=1)
        ax.text(ax.get_xlim()[1], threshold, f" k = 1 below {fmt(threshold)}", va="bottom",
                ha="right", fontsize=8, color="#555555")  # fmt: skip
        ax.set_xscale("log")
        ticks = [k for k in (2, 3, 5, 10, 15, 20, 30, 40, 60) if k <= int(km["k"].max())]
        ax.set_xticks(ticks, [str(k) for k in ticks])
        # the log axis's minor ticks unlabelled (matplotlib writes 4×10⁰ and 6×10⁰ there,
        # crowding the k above)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("k (K-means clusters)")
        ax.set_ylabel("silhouette of the k's fit")
        ax.legend(fontsize=8, ncols=2)
        title(fig, "K-means silhouette over the scan of k, per layer", run.tag)
        path = save(fig, run.out, "kmeans_curve")
    ks = sorted(int(k) for k in km["k"].unique())
    return path, (
        "Silhouette (Rousseeuw 1987) of the K-means fit of every k the job scans "
        f"(k = {ks[0]}..{min(15, ks[-1])}, then a 10% grid to {ks[-1]}), per layer; the best k "
        "of each layer is marked (○ the reported k; ✕ rejected, k = 1 chosen, when its "
        f"silhouette is below the dashed threshold {fmt(threshold)}; Cai et al. 2021). A curve "
        "still rising at the right end has no interior optimum: more clusters keep separating "
        "groups of occurrences of one token, not distinct regions of the space."
        + (
            " Beside each layer: its reported k and that decision's support, the share of "
            "bootstrap resamples of the sample (each point's silhouettes held fixed) that take "
            f"the same k; below {ROBUST_SUPPORT:g} the sample does not settle the decision, and "
            "jobs.compare "
            "treats a change of it as not comparable."
            if support
            else ""
        )
    )


def _k_support(run: RunView) -> dict[int, str]:
    """``: k = 4, support 0.93`` per layer, from ``kmeans_k`` and ``kmeans_k_support`` (empty
    for a run without the support)."""
    lay = run.layers
    if "kmeans_k_support" not in lay.columns or "kmeans_k" not in lay.columns:
        return {}
    out = {}
    for _, r in lay.iterrows():
        k = pd.to_numeric(r["kmeans_k"], errors="coerce")
        sup = pd.to_numeric(r["kmeans_k_support"], errors="coerce")
        if np.isfinite(k) and np.isfinite(sup):
            out[int(r["layer"])] = f": k = {int(k)}, support {sup:.2f}"
    return out


def plt_colormap(n: int):
    """A categorical colormap of ``n`` colours (viridis samples for many layers)."""
    from matplotlib import colormaps

    return colormaps["tab10"] if n <= 10 else colormaps["viridis"].resampled(n)
