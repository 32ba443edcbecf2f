"""The package's version, in a leaf module: what a run records (``manifest.json``'s
``versions``), the report prints and ``embgeom --version`` says, importable by every layer
without the package's ``__init__`` (which reaches up to the Python API)."""

__version__ = "0.1.0"
