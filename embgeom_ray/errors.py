"""Errors a user can cause and fix.

Every such error derives from :class:`UserError`. The command-line entry points catch it, print
its message (one line or a short paragraph, no traceback) and exit with status 2
(:func:`embgeom_ray.cli.exit_status`; an object store's fault counts as one too:
:func:`embgeom_ray.storage.as_user_error`). Anything else is a bug and keeps its traceback.
This module imports nothing: every layer may raise these.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input or environment, reported as one clear message."""

    exit_code: int = 2


class CorpusError(UserError):
    """The corpus cannot be found, read or understood (paths, columns, formats, emptiness)."""


class ModelError(UserError):
    """The model or tokenizer cannot be found or loaded."""


class ConfigError(UserError):
    """Invalid options: unknown layers, bad values, conflicting flags."""


class OutputError(UserError):
    """The output directory cannot be written, or holds a run that does not match this one."""


class StatisticsMismatchError(UserError):
    """Two statistics artefacts cannot be merged (different model, tokenizer, layers or dim)."""


class IntegrityError(UserError):
    """A file's bytes do not match the digest recorded when it was written
    (:mod:`embgeom_ray.integrity`): it was corrupted on disk, in an object store or on its way."""

    def __init__(self, url: str, detail: str) -> None:
        super().__init__(url, detail)
        self.url, self.detail = url, detail

    def __str__(self) -> str:
        return f"{self.url} is corrupt: {self.detail}"


class StorageError(UserError):
    """An object store cannot be reached, refuses the credentials, has no such bucket, or
    refuses access (:mod:`embgeom_ray.storage`)."""
