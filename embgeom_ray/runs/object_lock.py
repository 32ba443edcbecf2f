"""``reanalyze``'s lock on S3 and GCS stores: ``STORE/reanalyze.lock.json``, written where absent.

Both stores write an object conditionally, atomically: S3 (since 2024; MinIO and moto too) a
``PutObject`` with ``If-None-Match: *``, GCS an upload with ``ifGenerationMatch=0``; each fails
(412 Precondition Failed) where the object exists, so of two invocations that write the lock
at once exactly one succeeds. The object is the holder file itself (host, pid, start time,
command line), as ``reanalyze.lock.json`` is beside a local store's flock (:mod:`.store_lock`),
and a second invocation ends with the same line and exit status 75. One protocol serves both
stores: what differs (the requests, and the object's version token, S3's ETag or GCS's
generation) is a small adapter each, in :mod:`.lock_objects`.

An object does not go away with its process, as a flock does. So the holder renews it every
:data:`RENEW_S` seconds (written again, on the condition of its own version: S3's ``If-Match``
its ETag, GCS's ``ifGenerationMatch`` its generation), and a lock is *stale*, to be taken
over, where:

* its holder's pid is among this process's pids (the same hostname, boot and PID namespace:
  :func:`~.lock_holder.same_pids`) and is gone (at once, as a flock would be), or
* it was last written more than :data:`STALE_S` ago (S3's ``LastModified``, GCS's ``updated``:
  the store's clock, against this host's: a skew of minutes is within the margin).

A stale lock is taken over on the condition of the version read, so of two invocations that
find it stale only one gets it. A holder lets go by removing the object on the condition of
its own version (a delete the store applies atomically, :func:`_remove`), so a lock another
invocation took over meanwhile stays. A renewal that fails otherwise (the store unreachable
or throttled for a while) is said once and tried again a minute later, so the lock is lost
only where :data:`STALE_S` pass without one. A holder whose renewal finds the lock taken (it
had not renewed it for :data:`STALE_S`) says so in one line and goes on, as it cannot undo its
work.

A store that ignores the condition (an S3-compatible server without conditional writes, a GCS
emulator that drops ``ifGenerationMatch``) would let two invocations hold it: the lock writes
its object a second time on the same condition, and where that succeeds it says in one line
that the store gives no lock, and goes on as on a store without one (the scheduler must not
overlap invocations).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit

import fsspec

from .. import progress
from ..io_utils import join
from ..storage import user_errors
from .lock_holder import HOLDER, busy, describe, same_pids, this_holder
from .lock_objects import ADAPTERS, ObjectStore

#: seconds between two renewals of a held lock
RENEW_S = 60.0
#: seconds after its last renewal from which a lock is stale (15 renewals missed)
STALE_S = 900.0
#: the URL schemes whose stores this lock serves (s3fs, gcsfs)
SCHEMES = tuple(ADAPTERS)


def supported(store: str) -> bool:
    """Whether ``store`` is on S3 (s3fs) or GCS (gcsfs), where :func:`object_lock` applies."""
    return urlsplit(store).scheme in SCHEMES


def renewal(last_modified: datetime | None) -> str:
    """When a held lock was last renewed and when it goes stale, for the message of an
    invocation that found it held: a holder killed on another node looks like one that runs,
    and its lock is taken over only once :data:`STALE_S` pass without a renewal ("" where
    the store gives no time)."""
    if last_modified is None:
        return ""
    age = max(0.0, (datetime.now(timezone.utc) - last_modified).total_seconds())
    return (f"; its lock last renewed {age:.0f} s ago, taken over once {STALE_S / 60:.0f} "
            "minutes pass without a renewal")  # fmt: skip


def _alive(pid: Any) -> bool:
    """Whether a process ``pid`` runs on this host (True where that cannot be told)."""
    if not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def is_stale(holder: dict[str, Any], last_modified: datetime | None) -> bool:
    """The stale rule (module docstring): a holder among this process's pids whose pid is
    gone, or a lock not renewed for :data:`STALE_S` seconds. A holder of the same hostname in
    another PID namespace (a container of ``--network host``, a machine cloned with its
    hostname) or of an older version's file (no namespace recorded) has only the second."""
    if same_pids(holder) and not _alive(holder.get("pid")):
        return True
    if last_modified is None:
        return False
    age = (datetime.now(timezone.utc) - last_modified).total_seconds()
    return age > STALE_S


class _Held:
    """The lock this process holds: its object, its version token (S3's ETag, GCS's
    generation) and the thread that renews it."""

    def __init__(self, store: ObjectStore, path: str, body: bytes, token: str) -> None:
        self.store, self.path, self.body, self.token = store, path, body, token
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._renew, name="store-lock", daemon=True)

    def _renew(self) -> None:
        """Every :data:`RENEW_S` seconds, write the lock again where it is still this
        process's. A renewal that fails for another reason (the store unreachable, throttled)
        is said once and tried again at the next one: the lock is lost only where
        :data:`STALE_S` pass without one, not at the first failure of a run of hours. A lock
        taken over (the store's 412) is said and no longer renewed."""
        failing = False
        while not self.stop.wait(RENEW_S):
            try:
                self.token = self.store.rewrite(self.path, self.body, self.token)
            except Exception as exc:
                if self.store.lost(exc):
                    with contextlib.suppress(Exception):  # this process's after all?
                        holder, token, _ = _read(self.store, self.path)
                        if holder == json.loads(self.body) and token:
                            self.token = token  # a renewal whose answer was lost
                            continue
                    progress.notice(
                        f"warning: the lock on the store {self.path} could not be renewed: "
                        f"it is no longer this invocation's ({type(exc).__name__}: {exc}): "
                        f"taken over by another after {STALE_S / 60:.0f} minutes without a "
                        "renewal, or removed"
                    )
                    return
                if not failing:
                    progress.notice(
                        f"warning: the lock on the store {self.path} could not be renewed "
                        f"({type(exc).__name__}: {exc}); tried again every {RENEW_S:.0f} s, "
                        f"another invocation may take it once {STALE_S / 60:.0f} minutes pass "
                        "without a renewal"
                    )
                failing = True
                continue
            if failing:
                progress.notice(f"the lock on the store {self.path} is renewed again")
            failing = False

    def release(self) -> None:
        """Stop renewing; remove the lock where it is still this process's (:func:`_remove`).
        A removal that fails (the store unreachable, no permission to delete) is said in one
        line: the lock then stays until it goes stale, and the next invocation is refused
        until then, which it would otherwise not be told why."""
        self.stop.set()
        self.thread.join()
        try:
            _remove(self.store, self.path, self.token)
        except Exception as exc:
            progress.notice(
                f"warning: the lock on the store {self.path} could not be removed "
                f"({type(exc).__name__}: {exc}); another invocation takes it over once "
                f"{STALE_S / 60:.0f} minutes pass without a renewal"
            )


def _remove(store: ObjectStore, path: str, token: str) -> bool:
    """Remove the lock object where its version is still ``token``; whether it was removed.

    One delete on the condition of that version (S3: ``If-Match`` its ETag; GCS:
    ``ifGenerationMatch``), which the store applies atomically: a lock another invocation took
    over (a new version) is left in place, answered 412. Reading the version and then removing
    the object (two requests) removed the other's lock where it was taken over between the
    two. The version is read first all the same, so that a store that ignores the condition on
    a delete (some S3-compatible servers parse it and drop it) still removes nothing that is
    visibly another's (the window of two requests, as before, there only). A store that
    refuses the condition instead (400 or 501, a server without conditional deletes) gets the
    plain delete of those two requests: the conditional one alone left the lock in place, and
    every other invocation waited :data:`STALE_S` for it."""
    if store.stat(path)[0] != token:
        return False
    try:
        store.delete(path, token)
    except Exception as exc:
        if store.lost(exc):  # taken over (412) or removed since
            return False
        if not store.refused(exc):
            raise
        store.rm(path)  # the version read above is still this process's
    return True


def _read(store: ObjectStore, path: str) -> tuple[dict[str, Any], str | None, datetime | None]:
    """(holder, version token, last written) of the lock object."""
    token, modified = store.stat(path)
    try:
        holder = json.loads(store.cat(path))
    except ValueError:
        holder = {}
    return (holder if isinstance(holder, dict) else {}), token, modified


def _acquire(store: str, path: str, objects: ObjectStore, body: bytes) -> _Held | None:
    """Write the lock where absent (or take a stale one over); None where the store ignores
    the condition. :class:`~.lock_holder.StoreBusyError` where another invocation holds it."""
    mine = json.loads(body)
    try:
        token = objects.create(path, body)
    except FileExistsError:
        holder, stale_token, modified = _read(objects, path)
        if holder == mine and stale_token:
            # this invocation's own write: its answer was lost and the client's retry (gcsfs,
            # botocore) found the object it had written (412); its lock_id is its alone
            return _Held(objects, path, body, stale_token)
        if not is_stale(holder, modified):
            raise busy(store, describe(holder) + renewal(modified)) from None
        try:  # only one of the invocations that found it stale gets it
            token = objects.rewrite(path, body, stale_token)
        except OSError:
            try:
                now, now_token, _ = _read(objects, path)
            except FileNotFoundError:  # let go since (its holder, or one that took it over)
                raise busy(store, "") from None
            if now_token == stale_token:
                raise
            if now != mine or not now_token:
                raise busy(store, describe(now)) from None
            token = now_token  # its own takeover, whose answer was lost (the retry's 412)
        progress.notice(f"the stale lock on the store {store}{describe(holder)} was taken over")
        return _Held(objects, path, body, token)
    try:
        objects.create(path, body)
    except FileExistsError:
        return _Held(objects, path, body, token)
    progress.notice(
        f"warning: the store {store} ignores conditional writes ({objects.condition}): no "
        "lock keeps two reanalyze invocations apart there; the scheduler must not overlap them"
    )
    with contextlib.suppress(OSError):
        objects.rm(path)
    return None


@contextlib.contextmanager
def object_lock(store: str) -> Iterator[None]:
    """Hold ``STORE/reanalyze.lock.json`` on S3 or GCS while the block runs (module docstring);
    :class:`~.lock_holder.StoreBusyError` at once where another invocation holds it."""
    # the holder, and an id of this acquisition: a body no other invocation writes (one
    # process's two are told apart too), by which a create's lost answer is recognised
    body = json.dumps({**this_holder(), "lock_id": secrets.token_hex(8)}).encode()
    with user_errors(store, "store"):
        fs, path = fsspec.core.url_to_fs(join(store, HOLDER))
        held = _acquire(store, path, ADAPTERS[urlsplit(store).scheme](fs), body)
    if held is None:
        yield
        return
    held.thread.start()
    try:
        yield
    finally:
        held.release()
