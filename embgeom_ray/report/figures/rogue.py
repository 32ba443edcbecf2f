"""Rogue dimensions by layer (Luo 2020; Luo et al. 2021): the layer × dimension heat maps
of the argmax/argmin shares (or of each dimension's |z| and variance ratio), its correlation
with position, and the cells flagged as outliers."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.colors import Normalize, PowerNorm

from ...core.rogue import mean_zscores, variance_ratios
from ...run_view import RunView
from .common import new_figure, save, styled, title

#: (column, colour-bar label, panel title) of each kind of heat map
SHARE_PANELS = {
    "argmax_share": ("share of tokens whose largest coordinate is this dim", "argmax share"),
    "argmin_share": ("share of tokens whose smallest coordinate is this dim", "argmin share"),
}
Z_PANELS = {
    "abs_mean_z": (
        "|z| of the dim's mean",
        "|mean_d − mean over dims| / std over dims of the per-dim means",
    ),
    "var_ratio": ("variance / mean variance", "variance of the dim / mean variance over dims"),
}
POSITION_PANEL = {
    "position_corr": (
        "Pearson r with position",
        "correlation of the dimension with the token's position",
    )
}


def _dim_matrix(dims: pd.DataFrame, column: str, layers: list[int], d: int) -> np.ndarray:
    mat = np.full((len(layers), d), np.nan)
    li = {layer: i for i, layer in enumerate(layers)}
    rows = dims["layer"].map(li).to_numpy()
    mat[rows, dims["dim"].to_numpy(dtype=np.int64)] = pd.to_numeric(dims[column], errors="coerce")
    return mat


def _per_layer(dims: pd.DataFrame, column: str, fn) -> np.ndarray:
    """``fn`` of each layer's ``column`` (its dimensions' values), in the rows' order."""
    out = np.full(len(dims), np.nan)
    for rows in dims.groupby("layer").indices.values():
        out[rows] = fn(pd.to_numeric(dims[column].iloc[rows]).to_numpy(dtype=np.float64))
    return out


def _dim_scores(dims: pd.DataFrame) -> dict[str, np.ndarray]:
    """Per (layer, dim): |z| of the dim's mean among the layer's per-dim means, and var / mean var.

    ``mean_zscore`` / ``variance_ratio`` of dims.parquet, or, for a table of the moments alone,
    the same functions of ``mean`` and ``std`` the job computes them with
    (:func:`~embgeom_ray.core.rogue.mean_zscores`, :func:`~embgeom_ray.core.rogue.variance_ratios`).
    """
    if "mean_zscore" in dims.columns:
        z = np.abs(pd.to_numeric(dims["mean_zscore"], errors="coerce").to_numpy(dtype=np.float64))
    else:
        z = np.abs(_per_layer(dims, "mean", mean_zscores))
    if "variance_ratio" in dims.columns:
        r = pd.to_numeric(dims["variance_ratio"], errors="coerce").to_numpy(dtype=np.float64)
    else:
        r = _per_layer(dims.assign(var=dims["std"] ** 2), "var", variance_ratios)
    return {
        "abs_mean_z": np.where(np.isfinite(z), z, np.nan),
        "var_ratio": np.where(np.isfinite(r), r, np.nan),
    }


def _outlier_summary(run: RunView, dims: pd.DataFrame, outlier: np.ndarray) -> str:
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


def _panels(dims: pd.DataFrame, layers: list[int], d: int) -> tuple[str, pd.DataFrame, dict] | None:
    """(mode, dims with the scores drawn, {column: (matrix, colour-bar label, title)}): the
    argmax/argmin shares (``"tails"``), else the |z| and variance ratio (``"z"``), and the
    position correlation when the run has it; None when dims.parquet has neither."""
    tails = [c for c in SHARE_PANELS if c in dims.columns]
    if tails:
        mode, specs = "tails", {c: SHARE_PANELS[c] for c in tails}
    elif {"mean", "std"} <= set(dims.columns):
        mode, specs, dims = "z", Z_PANELS, dims.assign(**_dim_scores(dims))
    else:
        return None
    if "position_corr" in dims.columns and dims["position_corr"].notna().any():
        specs = specs | POSITION_PANEL
    panels = {c: (_dim_matrix(dims, c, layers, d), *spec) for c, spec in specs.items()}
    return mode, dims, panels


def _heat_map(
    fig, ax, c: str, mat: np.ndarray, label: str, text: str, layers: list[int], outlier
) -> list[int]:
    """One layer × dimension panel with its top dimensions marked above; returns them."""
    d = mat.shape[1]
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
    ax.set_title(text, loc="left")
    top = _top_dims(mat)
    sec = ax.secondary_xaxis("top")
    sec.set_xticks(top)
    sec.set_xticklabels([str(t) for t in top], fontsize=7, color="#1f4e99")
    sec.tick_params(length=3, color="#1f4e99")
    if outlier is not None and outlier.any():
        yy, xx = np.nonzero(outlier)
        ax.scatter(
            xx, yy, marker="o", s=14, facecolors="none", edgecolors="#00b3ff", linewidths=0.9
        )
    fig.colorbar(
        im,
        ax=ax,
        label=label.split(" of ")[0] if c.endswith("_share") else label,
        pad=0.01,
        fraction=0.03,
    )
    return top


def _rogue_caption(mode: str, d: int, has_pos: bool) -> str:
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
            f"layer's mean per-dimension variance. Rogue dimensions (Luo 2020; Luo et al. "
            f"2021) appear as dark vertical stripes (|z| > 3 or a ratio ≥ 5 are the usual "
            f"flags). The colour scale is a square root, so the largest values stand out. "
            f"Numbers above each panel: the dimensions with the largest values. (This run's "
            f"dims.parquet has no argmax/argmin shares, Luo's 'tails'.)"
        )
    if has_pos:
        caption += (
            " Last panel: Pearson r between each dimension and the token's position in its "
            "window, exact over all tokens (Luo et al. 2021: outlier dimensions track "
            "position)."
        )
    return caption


def plot_rogue_dims(run: RunView) -> tuple[str | None, str]:
    """Layer × dimension heat map of argmax/argmin share (Luo 2020).

    Without the shares, the |z| of each dimension's mean and its variance ratio instead.
    """
    dims = run.dims
    if dims is None or not {"layer", "dim"} <= set(dims.columns):
        return None, "Not drawn: the run has no dims.parquet."
    layers = sorted(int(x) for x in dims["layer"].unique())
    d = int(dims["dim"].max()) + 1
    found = _panels(dims, layers, d)
    if found is None:
        return None, "Not drawn: dims.parquet has neither argmax/argmin shares nor mean/std."
    mode, dims, panels = found
    outlier = None
    if "outlier" in dims.columns:
        flags = dims.assign(outlier=dims["outlier"].astype(float))
        outlier = _dim_matrix(flags, "outlier", layers, d) > 0.5
    top_all: list[int] = []
    with styled():
        fig = new_figure(12.0, 1.0 + len(panels) * max(2.4, 0.22 * len(layers) + 1.2))
        axes = np.atleast_1d(fig.subplots(len(panels), 1, squeeze=False)).ravel()
        for ax, (c, (mat, label, text)) in zip(axes, panels.items(), strict=True):
            top = _heat_map(fig, ax, c, mat, label, text, layers, outlier)
            top_all += [t for t in top if t not in top_all]
        title(fig, "Rogue dimensions by layer (Luo 2020; Luo et al. 2021)", run.tag)
        path = save(fig, run.out, "rogue_dims")
    caption = _rogue_caption(mode, d, "position_corr" in panels)
    if outlier is not None:
        caption += " " + _outlier_summary(run, dims, outlier)
    caption += f" Top dimensions: {', '.join(map(str, top_all[:8]))}."
    return path, caption
