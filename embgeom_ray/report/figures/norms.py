"""Norms and variances of token types (Yamagiwa et al. 2024): the per-type scatter of ‖μ_t‖
against V_t, and the per-layer split of the variance into within- and between-type parts."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.colors import Normalize

from ...run_view import RunView
from .common import (
    COLORS,
    extreme,
    fmt,
    grid,
    hide_unused,
    int_layers,
    new_figure,
    save,
    styled,
    title,
)

MAX_SCATTER_POINTS = 30_000  # per panel of the norm/variance scatter (r uses every type)


def _norm_variance_panel(
    ax, d: pd.DataFrame, r: float, norm: Normalize, rng: np.random.Generator
) -> tuple[bool, object]:
    """One layer's scatter (types ``d``) with its Q̄ curve and ``r``, the layer's
    ``norm_variance_corr`` as the table holds it; returns (subsampled, the scatter)."""
    x, y, n = (d[c].to_numpy(dtype=np.float64) for c in ("mean_norm", "variance", "count"))
    idx = np.arange(len(x))
    subsampled = len(idx) > MAX_SCATTER_POINTS
    if subsampled:
        idx = rng.choice(idx, MAX_SCATTER_POINTS, replace=False)
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
    ax.text(
        0.97,
        0.95,
        f"r = {fmt(r)}",
        transform=ax.transAxes,
        ha="right",
        va="top",
        fontsize=9,
        bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": "#bbbbbb"},
    )
    return subsampled, sc


def _layer_values(run: RunView, column: str) -> dict[int, float]:
    """``layers.parquet``'s ``column`` by layer (NaN where absent or not a number)."""
    values = run.layer_col(column)
    layers = run.layers["layer"].to_numpy()
    if values is None:
        return {int(layer): float("nan") for layer in layers}
    return {int(layer): float(v) for layer, v in zip(layers, values, strict=True)}


def _norm_variance_caption(rs: dict[int, float], min_count: int, subsampled: bool) -> str:
    finite = {k: v for k, v in rs.items() if np.isfinite(v)}
    summary = ""
    if finite:
        lo = min(finite, key=finite.get)
        hi = max(finite, key=finite.get)
        summary = (
            f" Here r is most negative at layer {lo} ({fmt(finite[lo])}) and largest at layer "
            f"{hi} ({fmt(finite[hi])})."
        )
    return (
        f"Each point is one token type in one layer: the norm of its mean vector ‖μ_t‖ against "
        f"the variance V_t of its occurrences, coloured by log10 of its count. r is Pearson's "
        f"correlation over types seen at least {min_count} times (the table's "
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


def plot_norm_variance(run: RunView) -> tuple[str | None, str]:
    """Per layer, ||μ_t|| against V_t for every token type, coloured by log10 count.

    Yamagiwa et al. (2024): Q_t = ||μ_t||² + V_t, and LayerNorm keeps Q_t nearly constant, so
    frequent types with a long mean vector vary little; the Pearson r printed in each panel is
    the layer's ``norm_variance_corr`` (over types with n_t ≥ min_count), read from
    ``layers.parquet``, not computed again from the scattered types. The dashed curve is
    V = Q̄ − ||μ||², with Q̄ the count-weighted mean of Q_t in that layer.
    """
    ts = run.type_stats
    if ts is None or not {"mean_norm", "variance", "count"} <= set(ts.columns):
        return None, "Not drawn: the run has no type_stats.parquet."
    layers = sorted(int(x) for x in ts["layer"].unique())
    ncols, nrows = grid(len(layers))
    with styled():
        fig = new_figure(3.1 * ncols + 0.9, 2.6 * nrows + 0.8)
        axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
        norm = Normalize(0.0, max(float(np.log10(ts["count"].max())), 1.0))
        rng = np.random.default_rng(0)
        table_r = _layer_values(run, "norm_variance_corr")
        rs = {layer: table_r.get(layer, float("nan")) for layer in layers}
        subsampled = False
        sc = None
        for ax, layer in zip(axes, layers, strict=False):
            cut, sc = _norm_variance_panel(ax, ts[ts["layer"] == layer], rs[layer], norm, rng)
            subsampled |= cut
            ax.set_title(f"layer {layer}")
        hide_unused(axes, len(layers))
        fig.supxlabel("‖μ_t‖  (norm of the token type's mean vector)")
        fig.supylabel("V_t  (variance of the type's occurrences)")
        if sc is not None:
            fig.colorbar(
                sc, ax=axes[: len(layers)].tolist(), label="log10 count of the type", shrink=0.8
            )
        title(fig, "Norm of the mean vs variance per token type (Yamagiwa et al. 2024)", run.tag)
        path = save(fig, run.out, "norm_variance")
    return path, _norm_variance_caption(rs, run.min_count, subsampled)


def plot_variance_split(run: RunView) -> tuple[str | None, str]:
    """V_W and V_B across layers, stacked (V = V_W + V_B), with V_W/V on a twin axis."""
    within, between = run.layer_col("within_variance"), run.layer_col("between_variance")
    if within is None or between is None:
        return None, "Not drawn: layers.parquet has no within/between variance."
    layers = run.layers["layer"].to_numpy()
    # the table's within_ratio, V_W / V: not recomputed here (a second copy of the formula)
    ratio = np.array(list(_layer_values(run, "within_ratio").values()), dtype=np.float64)
    with styled():
        fig = new_figure(8.5, 4.4)
        ax = fig.add_subplot()
        ax.bar(layers, within, color=COLORS["within"], label="V_W within types", width=0.7)
        ax.bar(
            layers,
            between,
            bottom=within,
            color=COLORS["between"],
            label="V_B between types",
            width=0.7,
        )
        ax.set_ylabel("variance  (mean squared distance to the mean)")
        int_layers(ax, layers)
        ax2 = ax.twinx()
        ax2.plot(layers, ratio, "o-", color="black", lw=1.6, ms=4, label="within_ratio V_W / V")
        ax2.set_ylim(0, 1.05)
        ax2.set_ylabel("within_ratio  V_W / V")
        ax2.grid(False)
        ax2.spines["right"].set_visible(True)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, loc="upper left", framealpha=0.9)
        title(fig, "Variance within and between token types (Yamagiwa et al. 2024)", run.tag)
        path = save(fig, run.out, "variance_split")
    caption = (
        "Total variance V of each layer split into the count-weighted variance of occurrences "
        "around their type's mean (V_W, bottom) and the variance of the type means around the "
        "layer mean (V_B, top); V = V_W + V_B exactly. The line (right axis) is within_ratio = "
        "V_W / V, the share of the variance that context, not token identity, accounts for."
    )
    if np.isfinite(ratio).any():
        top, at = extreme(ratio, layers, np.nanargmax)
        caption += (
            f" Here it goes from {fmt(ratio[0])} at layer {layers[0]} to {fmt(ratio[-1])} at "
            f"layer {layers[-1]}, peaking at {fmt(top)} (layer {at})."
        )
    return path, caption
