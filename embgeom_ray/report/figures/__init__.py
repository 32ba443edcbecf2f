"""The report's figures, one module per family (:data:`embgeom_ray.report.plots.PLOTS` lists
them in report order); :mod:`.common` holds what they share (style, canvas, saving, layer axes).

Every ``plot_*`` function takes a :class:`~embgeom_ray.run_view.RunView` and returns
``(path, caption)``: the PNG it wrote, or ``None`` when the run lacks that figure's inputs (an
optional table or column), with a caption that says what the figure shows or why it is absent.
"""
