"""The comparison of runs: one panel per per-layer metric, one line per run
(:func:`embgeom_ray.report.html.write_comparison_report`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib as mpl
import numpy as np

from ...core import metric_registry as registry
from ...run_view import RunView, by_depth
from .common import hide_unused, new_figure, save, styled

#: metrics overlaid in the comparison, when present in any run (in this order): those the
#: registry marks ``plotted`` (:mod:`~embgeom_ray.core.metric_registry`)
COMPARE_METRICS = registry.plotted()


def sampled(metric: str) -> bool:
    """Whether ``metric`` is estimated on the run's sample (else exact over every token)."""
    return registry.kind_of(metric) == "sampled"


def _legend(fig, axes: np.ndarray, n: int) -> None:
    """One legend for the figure: every run that any of the first ``n`` panels draws."""
    handles, labs = axes[0].get_legend_handles_labels()
    for ax in axes[1:n]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labs:
                handles.append(h)
                labs.append(lab)
    fig.legend(handles, labs, loc="outside lower center", ncols=min(len(labs), 4))


def plot_comparison(
    runs: Sequence[RunView],
    labels: Sequence[str],
    out_dir: str,
    metrics: list[str],
    headers: Mapping[str, str],
) -> str:
    """``out_dir/plots/compare_metrics.png``: each of ``metrics`` by layer, or by relative
    depth layer / blocks (:meth:`RunView.depth`, the ``depth`` of ``comparison.parquet``) when
    the runs' models have different numbers of blocks and ``jobs.compare`` matches their layers
    by depth (:func:`~embgeom_ray.run_view.by_depth`); one line per run; panel titles from
    ``headers`` (a metric's column header); returns the path."""
    relative = by_depth(runs)
    ncols = min(4, len(metrics))
    nrows = math.ceil(len(metrics) / ncols)
    cmap = mpl.colormaps["tab10"]
    styles = ["-", "--", ":", "-."]  # runs that coincide stay visible
    markers = ["o", "s", "^", "D"]
    with styled():
        fig = new_figure(3.4 * ncols + 0.4, 2.7 * nrows + 1.3)
        axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
        for ax, metric in zip(axes, metrics, strict=False):
            for i, (run, label) in enumerate(zip(runs, labels, strict=True)):
                v = run.layer_col(metric)
                if v is None:
                    continue
                x = run.layers["layer"].to_numpy(dtype=np.float64)
                if relative:
                    x = np.array([run.depth(int(layer)) for layer in x], dtype=np.float64)
                ax.plot(
                    x,
                    v,
                    marker=markers[i % 4],
                    ms=3.5,
                    lw=1.5,
                    color=cmap(i % 10),
                    linestyle=styles[i % 4],
                    alpha=0.9,
                    label=label,
                )
                se = run.layer_col(f"{metric}_se")
                if se is not None and sampled(metric):  # ± 2 standard errors: ~95% of the estimate
                    ax.fill_between(x, v - 2 * se, v + 2 * se, color=cmap(i % 10), alpha=0.15, lw=0)
            header = headers.get(metric, metric)
            mark = " · sampled" if sampled(metric) and "sampled" not in header else ""
            ax.set_title(f"{header}  ({metric}){mark}", fontsize=9)
            ax.set_ylabel(header, fontsize=8)
            ax.set_xlabel("layer / blocks" if relative else "layer", fontsize=8)
        hide_unused(axes, len(metrics))
        _legend(fig, axes, len(metrics))
        xdesc = (
            "x: relative depth, layer / blocks (the runs' models have different numbers of blocks)"
            if relative
            else "x: layer (hidden_states index; 0 = embedding output)"
        )
        fig.suptitle(f"Per-layer metrics of {len(runs)} runs\n{xdesc}", fontsize=11)
        return save(fig, out_dir, "compare_metrics")
