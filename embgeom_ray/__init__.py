"""embgeom_ray: exact corpus-scale geometry of transformer contextual embeddings, on Ray."""

__version__ = "0.1.0"
