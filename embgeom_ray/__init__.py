"""embgeom_ray: exact corpus-scale geometry of transformer contextual embeddings, on Ray.

The Python API (:mod:`embgeom_ray.api`, ``docs/python.md``): :func:`analyze`, :func:`plan`,
:func:`open_run`, :func:`merge`, :func:`plan_merge`, :func:`compare`, :func:`write_report`, :func:`store_runs`, and the :class:`Run` and
:class:`Comparison` they return. The command line is ``embgeom`` (:mod:`embgeom_ray.cli`).
Importing the package imports none of them (Ray's workers import its modules): each is loaded
on first use. The errors a user can cause are :class:`UserError` and its subclasses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import ConfigError, CorpusError, ModelError, StorageError, UserError
from .version import __version__

__all__ = [
    "Comparison", "ConfigError", "CorpusError", "LayerSample", "ModelError", "Run",
    "RunDirError", "StorageError", "UserError", "__version__", "analyze", "compare", "merge",
    "open_run", "plan", "plan_merge", "store_runs", "write_report",
]  # fmt: skip
#: the Python API's names, imported from :mod:`embgeom_ray.api` when first used
API = frozenset(__all__) - {"__version__", "ConfigError", "CorpusError", "ModelError",
                            "StorageError", "UserError"}  # fmt: skip

if TYPE_CHECKING:
    from .api import (
        Comparison,
        LayerSample,
        Run,
        RunDirError,
        analyze,
        compare,
        merge,
        open_run,
        plan,
        plan_merge,
        store_runs,
        write_report,
    )


def __getattr__(name: str) -> Any:
    if name in API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'embgeom_ray' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *API])
