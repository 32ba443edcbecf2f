"""Whether a process sees a run's local output directory as the job's own process wrote it:
the check that says who writes the checkpoint groups of a run on a local path
(:func:`~embgeom_ray.sizing.checkpoints.decide_writers`).

A local ``--out`` may be on a shared filesystem (NFS, Lustre, GPFS: what clusters mount on
every node), or on the driver's own disk, which the other nodes do not see; its path says
nothing of which. So the job checks: before the extraction the driver writes a *marker*, a
file named and filled with a random nonce, in the run's ``groups/`` directory
(:func:`write_marker`), and each extractor reads it back from its own node when it starts
(:func:`unseen`). An extractor that reads the nonce sees the directory the driver writes and
reads, and can write its own checkpoint groups there; one that finds no file, or another
nonce (another disk mounted at the same path: a stale copy, a node-local ``/tmp``), cannot.
A new name for every check means no node answers from a cached lookup of an earlier one.

The marker is removed when the extraction ends; a marker left by a job that was killed is a
dot-file of ``groups/``, cleaned with the half-written groups when the run resumes.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from typing import Any

#: the marker's file name before its nonce
MARKER_PREFIX = ".out-check-"


def write_marker(directory: str) -> dict[str, str]:
    """Write a new marker in the local ``directory`` (made if missing); returns what an
    extractor is handed to check it: the marker's absolute path and its nonce."""
    nonce = secrets.token_hex(16)
    path = os.path.join(os.path.abspath(directory), MARKER_PREFIX + nonce)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(nonce)
        f.flush()
        os.fsync(f.fileno())
    return {"path": path, "nonce": nonce}


def unseen(marker: dict[str, Any]) -> str | None:
    """Why this process does not see the directory of ``marker`` (:func:`write_marker`'s),
    in a few words; None when it reads the marker's nonce there."""
    try:
        with open(marker["path"]) as f:
            found = f.read().strip()
    except FileNotFoundError:
        return f"no {os.path.basename(marker['path'])} in {os.path.dirname(marker['path'])}"
    except OSError as exc:
        return f"cannot read {marker['path']}: {exc.strerror or exc}"
    if found != marker["nonce"]:
        return f"{marker['path']} differs from the job's: another disk at that path"
    return None


def unseen_any(markers: Sequence[dict[str, Any]]) -> str | None:
    """Why this process does not see the first of ``markers`` it does not see
    (:func:`unseen`); None when it sees them all."""
    return next((why for m in markers if (why := unseen(m)) is not None), None)


def file_marker(path: str) -> dict[str, str]:
    """A marker of an existing small file (a run's ``manifest.json``): its path and its text,
    which a process that sees the file as this one does reads back (:func:`unseen`)."""
    path = os.path.abspath(path)
    with open(path) as f:
        return {"path": path, "nonce": f.read().strip()}


def remove_marker(marker: dict[str, Any]) -> None:
    """Remove the marker (gone already: nothing to do)."""
    try:
        os.unlink(marker["path"])
    except FileNotFoundError:
        pass
