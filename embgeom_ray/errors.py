"""Errors a user can cause and fix.

Every such error derives from :class:`UserError`. The command-line entry points catch it, print
its message (one line or a short paragraph, no traceback) and exit with status 2. Anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


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


def as_user_error(exc: BaseException) -> UserError | None:
    """``exc`` as the user error it is: itself, or an object store's fault
    (:func:`embgeom_ray.storage.storage_error`); None for anything else (a bug)."""
    cause = getattr(exc, "cause", None)  # raised in a Ray task or actor: its own message
    if isinstance(cause, UserError):
        return cause
    if isinstance(exc, UserError):
        return exc
    from .storage import storage_error

    return storage_error(exc)


def exit_status(run: Callable[[], object]) -> int:
    """A command's exit status: 0 when ``run()`` returns; a user error's status (2) after its
    message as one line on stderr; anything else keeps its traceback."""
    try:
        run()
    except Exception as exc:
        error = as_user_error(exc)
        if error is None:
            raise
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    return 0
