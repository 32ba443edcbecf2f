"""PCA views of the uniform token sample per selected layer, coloured by K-means cluster and by
token frequency (Cai et al. 2021), in 2-D and 3-D."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib as mpl
import numpy as np
import pandas as pd
from matplotlib.colors import Normalize
from matplotlib.lines import Line2D

from ...run_view import RunView
from .clusters import AT_CAP_MARK, kmeans_labels
from .common import new_figure, pick_layers, save, styled, title

MAX_PCA_POINTS = 5_000  # per layer of the PCA views
MAX_PCA_LAYERS = 4
#: the title of a PCA cluster panel of a layer where K-means chose k = 1
NO_CLUSTERS = "no clusters (k = 1)"


def top_components(xc: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The top ``k`` left singular vectors (n, k) and singular values (k,) of the centred
    points ``xc`` (n, d), largest first: their projections on the top k principal axes are
    ``u * sv``. ARPACK's Lanczos iteration (``scipy.sparse.linalg.svds``, a fixed start vector):
    O(n · d) per iteration, so any d, without importing scikit-learn into the process that
    draws; the full SVD when min(n, d) ≤ k or ARPACK does not converge. Signs as scikit-learn's
    ``svd_flip``: each vector's largest |entry| positive, so a figure does not mirror between
    runs.

    On one BLAS thread: each Lanczos step is two matrix-vector products of n · d, too small to
    share, and the ~180 steps' hand-offs between BLAS's threads took 4–10× the CPU time of one
    thread (0.15–0.43 s against 0.03–0.06 s a layer at n = 4,096, d = 384, in the job's own
    process, which draws these views beside the other figures' tasks; docs/benchmarks.md)."""
    from scipy.sparse.linalg import ArpackNoConvergence, svds
    from threadpoolctl import threadpool_limits

    u = sv = None
    if min(xc.shape) > k:
        v0 = np.random.default_rng(0).standard_normal(min(xc.shape))
        try:
            with threadpool_limits(limits=1, user_api="blas"):
                u, sv, _ = svds(xc, k=k, v0=v0)
        except ArpackNoConvergence:
            pass
    if u is None or sv is None:
        u, sv, _ = np.linalg.svd(xc, full_matrices=False)
    order = np.argsort(sv)[::-1][:k]
    u, sv = u[:, order], sv[order]
    u = u * np.sign(u[np.abs(u).argmax(axis=0), np.arange(u.shape[1])])
    return u, sv


def _project(run: RunView, layer: int, df: pd.DataFrame, x: np.ndarray) -> dict[str, Any] | None:
    """The top three components of ``x`` (at most :data:`MAX_PCA_POINTS` rows), with each
    point's log10 type count and K-means cluster where the run has them."""
    if len(x) > MAX_PCA_POINTS:
        idx = np.sort(np.random.default_rng(layer).choice(len(x), MAX_PCA_POINTS, replace=False))
        df, x = df.iloc[idx].reset_index(drop=True), x[idx]
    if len(x) < 4 or x.shape[1] < 3:
        return None
    xc = x - x.mean(axis=0)
    u, sv = top_components(xc, 3)
    total = float((xc**2).sum())
    counts = run.type_counts(layer)
    freq = None
    if counts is not None and "token_id" in df.columns:
        freq = np.log10(df["token_id"].map(counts).to_numpy(dtype=np.float64))
    cluster = None
    if "cluster" in df.columns and df["cluster"].notna().any():
        cluster = pd.to_numeric(df["cluster"], errors="coerce").to_numpy()
    return {
        "proj": u * sv,
        "ratio": sv**2 / total if total > 0 else np.zeros(3),
        "freq": freq,
        "cluster": cluster,
        "n": len(x),
    }


def layer_pca(run: RunView, layer: int) -> dict[str, Any] | None:
    """The PCA of ``layer``'s uniform sample (its finite points), computed once per run view."""
    if layer not in run.pca:
        res = None
        got = run.samples(layer)
        if got is not None:
            df, x = got
            keep = np.isfinite(x).all(axis=1)
            res = _project(run, layer, df[keep].reset_index(drop=True), x[keep])
        run.pca[layer] = res
    return run.pca[layer]


def pca_cluster_titles(run: RunView, layers: Sequence[int]) -> dict[int, str]:
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


def _pca_layers(run: RunView) -> list[int]:
    return [
        layer for layer in pick_layers(run.sample_layers(), MAX_PCA_LAYERS) if layer_pca(run, layer)
    ]


class _Colours:
    """What the panels of one PCA figure share: the frequency scale, the cluster colours, the
    cluster ids drawn, the layers drawn without clusters, the last frequency scatter."""

    def __init__(self, run: RunView, layers: list[int]):
        freqs = [layer_pca(run, layer)["freq"] for layer in layers]
        fmax = max(
            [float(np.nanmax(f)) for f in freqs if f is not None and np.isfinite(f).any()] + [1.0]
        )
        self.fnorm = Normalize(0.0, fmax)
        max_id = max(
            [
                int(np.nanmax(c))
                for c in (layer_pca(run, la)["cluster"] for la in layers)
                if c is not None
            ]
            + [0]
        )
        self.ccmap = mpl.colormaps["tab10" if max_id < 10 else "tab20"]
        self.titles = pca_cluster_titles(run, layers)
        self.cluster_ids: set[int] = set()
        self.no_clusters: list[int] = []
        self.sc = None


def _pca_panel(ax, view: str, layer: int, p: dict[str, Any], coords: list, c: _Colours) -> None:
    """One panel: ``layer``'s points coloured as ``view`` says (cluster, freq or none)."""
    if view == "cluster" and c.titles[layer] == NO_CLUSTERS:
        ax.scatter(*coords, s=4, alpha=0.5, color="#9a9a9a", linewidths=0, rasterized=True)
        ax.set_title(f"layer {layer}: {NO_CLUSTERS}")
        c.no_clusters.append(layer)
    elif view == "cluster" and p["cluster"] is not None:
        lab = p["cluster"]
        for u in np.unique(lab[np.isfinite(lab)]).astype(int):
            c.cluster_ids.add(int(u))
            m = lab == u
            ax.scatter(
                *(co[m] for co in coords),
                s=4,
                alpha=0.7,
                color=c.ccmap(u % c.ccmap.N),
                linewidths=0,
                rasterized=True,
            )
        ax.set_title(f"layer {layer}: {c.titles[layer]}")
    elif view == "freq" and p["freq"] is not None:
        c.sc = ax.scatter(
            *coords,
            s=4,
            alpha=0.7,
            c=p["freq"],
            cmap="viridis",
            norm=c.fnorm,
            linewidths=0,
            rasterized=True,
        )
        ax.set_title(f"layer {layer}: token frequency")
    else:
        ax.scatter(*coords, s=4, alpha=0.6, color="#4c72b0", linewidths=0, rasterized=True)
        ax.set_title(f"layer {layer}" + (": no data for this view" if view != "none" else ""))


def _label_axes(ax, ratio: np.ndarray, dims3: bool) -> None:
    ax.set_xlabel(f"PC1 ({ratio[0]:.0%})")
    ax.set_ylabel(f"PC2 ({ratio[1]:.0%})")
    if dims3:
        ax.set_zlabel(f"PC3 ({ratio[2]:.0%})", labelpad=-2)
        ax.view_init(elev=22, azim=-55)
        ax.tick_params(labelsize=6, pad=0)


def _pca_caption(
    run: RunView, layers: list[int], has: dict[str, bool], c: _Colours, dims3: bool
) -> str:
    n = max(layer_pca(run, layer)["n"] for layer in layers)
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
        if c.no_clusters:
            caption += (
                f" Layer{'s' if len(c.no_clusters) > 1 else ''} "
                f"{', '.join(map(str, c.no_clusters))}: {NO_CLUSTERS}, K-means preferred no "
                "clustering (the best silhouette over k ≥ 2 was below "
                "--kmeans-min-silhouette), so the cluster panel is grey, one group."
            )
        if any(AT_CAP_MARK in t for t in c.titles.values()):
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
    return caption


def _pca_plot(run: RunView, dims3: bool) -> tuple[str | None, str]:
    layers = _pca_layers(run)
    if not layers:
        return None, "Not drawn: the run has no uniform sample (samples.parquet with vectors)."
    has = {
        v: any(layer_pca(run, layer)[v] is not None for layer in layers)
        for v in ("cluster", "freq")
    }
    views = [v for v in ("cluster", "freq") if has[v]] or ["none"]
    colours = _Colours(run, layers)
    freq_axes: list = []
    with styled():
        ncols, nrows = len(layers), len(views)
        side = 3.7 if dims3 else 3.3
        fig = new_figure(side * ncols + 1.4, (side + 0.3) * nrows + 0.9)
        kw = {"projection": "3d"} if dims3 else {}
        for col, layer in enumerate(layers):
            p = layer_pca(run, layer)
            coords = [p["proj"][:, i] for i in range(3 if dims3 else 2)]
            for row, view in enumerate(views):
                ax = fig.add_subplot(nrows, ncols, row * ncols + col + 1, **kw)
                if view == "freq":
                    freq_axes.append(ax)
                _pca_panel(ax, view, layer, p, coords, colours)
                _label_axes(ax, p["ratio"], dims3)
        if colours.cluster_ids and len(colours.cluster_ids) <= 20:
            ids = sorted(colours.cluster_ids)
            cmap, ncol = colours.ccmap, colours.ccmap.N
            handles = [Line2D([], [], ls="", marker="o", color=cmap(u % ncol), ms=5) for u in ids]
            fig.legend(
                handles, [str(u) for u in ids], title="K-means cluster", loc="outside right upper"
            )
        if colours.sc is not None:
            fig.colorbar(colours.sc, ax=freq_axes, label="log10 count of the type", shrink=0.8)
        what = "3-D" if dims3 else "2-D"
        title(fig, f"{what} PCA of the uniform token sample (Cai et al. 2021)", run.tag)
        path = save(fig, run.out, "pca_3d" if dims3 else "pca_2d")
    return path, _pca_caption(run, layers, has, colours, dims3)


def plot_pca_2d(run: RunView) -> tuple[str | None, str]:
    """2-D PCA of the uniform sample per selected layer, by cluster and by token frequency."""
    return _pca_plot(run, dims3=False)


def plot_pca_3d(run: RunView) -> tuple[str | None, str]:
    """3-D PCA of the uniform sample per selected layer, by cluster and by token frequency."""
    return _pca_plot(run, dims3=True)
