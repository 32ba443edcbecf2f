"""The figures of a run: matplotlib PNGs in ``OUT/plots/``, listed in report order.

:data:`PLOTS` names each figure, its report section and the function that draws it (one module
per family under :mod:`embgeom_ray.report.figures`). Every function takes a
:class:`~embgeom_ray.run_view.RunView` (the run directory, read lazily through
:class:`~embgeom_ray.run_dir.RunDir`) and returns ``(path, caption)``: the PNG it wrote, or
``None`` when the run lacks that figure's inputs (an optional table or column), with a caption
that says what the figure shows or why it is absent. A missing optional section never raises.
:func:`make_all_plots` draws them all and returns :class:`Figure` records for the report
(:mod:`embgeom_ray.report.html`).

Figures (the papers they follow are named in each caption):

====================  =============================================================  ============
name                  shows                                                          needs
====================  =============================================================  ============
norm_variance         per layer, ||μ_t|| against V_t for every type (Yamagiwa 2024)  type_stats
variance_split        V_W and V_B stacked across layers, within_ratio                layers
cosine_isotropy       anisotropy, S_inter, S_intra, IsoScore (+ cluster-adjusted)    layers
intrinsic_dim         LID and silhouettes across layers (Cai et al. 2021)            sampled cols
isoscore_silhouette   IsoScore against silhouette, one point per layer (Mickus 2024) sampled cols
kmeans_curve          silhouette against k over the K-means scan, per layer (Cai)    kmeans
rogue_dims            layer × dim heat map of argmax/argmin share (Luo 2020)         dims
clipping              clipped vs unclipped, same estimator (Luo; Luo et al. 2021)    clipped cols
positional_profile    per-position mean of flagged dims (Luo et al. 2021)            positions
pca_2d, pca_3d        PCA of the uniform sample per selected layer (Cai et al.)      samples
====================  =============================================================  ============

Families: :mod:`~.figures.norms` (norm_variance, variance_split), :mod:`~.figures.isotropy`
(cosine_isotropy), :mod:`~.figures.clusters` (intrinsic_dim, isoscore_silhouette, kmeans_curve),
:mod:`~.figures.pca`, :mod:`~.figures.rogue` (rogue_dims), :mod:`~.figures.clipping`,
:mod:`~.figures.positions` (positional_profile); :mod:`~.figures.compare` draws the
comparison of runs; :mod:`~.figures.common` holds what they share.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from ..io_utils import join
from ..run_view import RunView
from .figure_groups import FIGURE_GROUPS
from .figures.clipping import plot_clipping
from .figures.clusters import (
    plot_intrinsic_dimension,
    plot_isoscore_silhouette,
    plot_kmeans_curve,
)
from .figures.common import PLOTS_DIR, keeping
from .figures.isotropy import plot_cosine_isotropy
from .figures.norms import plot_norm_variance, plot_variance_split
from .figures.pca import plot_pca_2d, plot_pca_3d
from .figures.positions import plot_positional_profile
from .figures.rogue import plot_rogue_dims

log = logging.getLogger(__name__)

#: Report sections, in order: (key, heading).
SECTIONS: list[tuple[str, str]] = [
    ("norms", "Norms and variances of token types"),
    ("isotropy", "Anisotropy, cosine similarity and isotropy"),
    ("clusters", "Clusters, manifolds and intrinsic dimension"),
    ("rogue", "Rogue dimensions and positional artefacts"),
]


@dataclass(frozen=True)
class Figure:
    """One figure of a report: ``path`` is the PNG (``None`` only for absent figures)."""

    name: str
    path: str | None
    caption: str
    section: str


#: (name, section, function), in report order.
PLOTS: list[tuple[str, str, Callable[[RunView], tuple[str | None, str]]]] = [
    ("norm_variance", "norms", plot_norm_variance),
    ("variance_split", "norms", plot_variance_split),
    ("cosine_isotropy", "isotropy", plot_cosine_isotropy),
    ("intrinsic_dim", "clusters", plot_intrinsic_dimension),
    ("isoscore_silhouette", "clusters", plot_isoscore_silhouette),
    ("kmeans_curve", "clusters", plot_kmeans_curve),
    ("pca_2d", "clusters", plot_pca_2d),
    ("pca_3d", "clusters", plot_pca_3d),
    ("rogue_dims", "rogue", plot_rogue_dims),
    ("clipping", "rogue", plot_clipping),
    ("positional_profile", "rogue", plot_positional_profile),
]


#: draws some of a run's figures somewhere else (e.g. a Ray task): called with their names, it
#: starts them and returns a function that waits for their :class:`Figure` records
Elsewhere = Callable[[Sequence[str]], Callable[[], "list[Figure]"]]


def draw_figures(
    out_dir: str | RunView, names: Sequence[str], *, strict: bool = False
) -> list[Figure]:
    """Draw the figures ``names`` (of :data:`PLOTS`) of the run in ``out_dir`` in this process;
    every one's :class:`Figure`, ``path=None`` for those not drawn (with the caption saying
    why; a PNG of an earlier report is then removed). A figure that fails with an unexpected
    error is logged and reported absent; ``strict=True`` re-raises instead (tests)."""
    run = out_dir if isinstance(out_dir, RunView) else RunView(out_dir)
    known = {name: (section, fn) for name, section, fn in PLOTS}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ConfigError(f"unknown figures {unknown}; known: {list(known)}")
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
        if path is None and not keeping():
            stale = join(run.out, PLOTS_DIR, f"{name}.png")
            if os.path.exists(stale):  # a figure of an earlier report of this run
                os.unlink(stale)
        figures.append(Figure(name=name, path=path, caption=caption, section=section))
    return figures


def make_all_plots(
    out_dir: str | RunView,
    *,
    include_absent: bool = False,
    strict: bool = False,
    elsewhere: Elsewhere | None = None,
    draw_here: bool = True,
) -> list[Figure]:
    """Draw every figure of the run in ``out_dir`` into ``out_dir/plots/``.

    Returns the figures written, in report order. With ``include_absent`` the figures that were
    not drawn are returned too, with ``path=None`` and a caption saying why. A figure that
    fails with an unexpected error is logged and reported absent, so a plotting problem never
    costs a run its report; ``strict=True`` re-raises instead (tests). Raises
    :class:`~embgeom_ray.run_dir.RunDirError` if ``out_dir`` is not a run directory.

    With ``elsewhere``, every group of :data:`FIGURE_GROUPS` but the first is handed to it
    (e.g. Ray tasks on this node: :func:`embgeom_ray.distributed.node_tasks.on_this_node`)
    while this process draws the first (with ``draw_here=False``, that one too: the PCA views
    read a layer of the sample, which the job's own process does not hold for a large
    sample); the figures are the same (each is a function of the run's files).
    """
    run = out_dir if isinstance(out_dir, RunView) else RunView(out_dir)
    if elsewhere is None:
        figures = draw_figures(run, [name for name, _, _ in PLOTS], strict=strict)
    else:
        waits = [elsewhere(group) for group in FIGURE_GROUPS[0 if not draw_here else 1 :]]
        figures = draw_figures(run, FIGURE_GROUPS[0], strict=strict) if draw_here else []
        for wait in waits:
            figures += wait()
        order = {name: i for i, (name, _, _) in enumerate(PLOTS)}
        figures.sort(key=lambda f: order[f.name])
    return [f for f in figures if f.path is not None or include_absent]
