"""The report's figures as the processes that draw them share them out: a module of its own,
with no imports, so that the job's own process can count the figure tasks it will start (the
warm workers it asks for, :func:`~embgeom_ray.runs.pipeline.warm_workers_wanted`) without
importing matplotlib and the figure modules (~0.3–0.5 s of its start), which a run with
``--no-report`` never needs, and a run with a report needs only when it draws it."""

from __future__ import annotations

#: figures drawn by one process when several draw a report
#: (:func:`~embgeom_ray.report.plots.make_all_plots`'s ``elsewhere``): the two PCA views share
#: the sample's PCA (cached on the :class:`~embgeom_ray.run_view.RunView`); the first group is
#: drawn by the calling process. Measured on the demo run (MiniLM, 7 layers): ~2.8 s for the
#: PCA pair, ~0.6 / 0.5 / 0.9 s for the other three groups.
FIGURE_GROUPS: list[list[str]] = [
    ["pca_2d", "pca_3d"],
    ["norm_variance", "variance_split"],
    ["cosine_isotropy", "intrinsic_dim", "isoscore_silhouette", "kmeans_curve"],
    ["rogue_dims", "clipping", "positional_profile"],
]
