"""The thin Ray layer: cluster connection, the extractor actor pool, distributed K-means and the
sampled-metrics stage as Ray tasks. It orchestrates; the geometry is computed by ``core``."""
