"""The object stores under ``reanalyze``'s lock (:mod:`.object_lock`): one small adapter each.

The lock's protocol is the same on every store; what differs is how a store writes an object
only where absent, rewrites or removes it only where unchanged, and names the version read:

=========================  ======================================  ===========================
                           S3 (s3fs)                               GCS (gcsfs)
=========================  ======================================  ===========================
version token              the object's ETag                       its generation
create where absent        ``PutObject`` ``If-None-Match: *``      upload ``ifGenerationMatch=0``
rewrite where unchanged    ``PutObject`` ``If-Match: ETag``        upload ``ifGenerationMatch=G``
remove where unchanged     ``DeleteObject`` ``If-Match: ETag``     delete ``ifGenerationMatch=G``
condition not met          412 (botocore's ``ClientError``)        412
last written               ``LastModified``                        ``updated``
=========================  ======================================  ===========================

Each store applies the condition atomically, so of two writers on one version only one
succeeds. gcsfs writes with a generation condition only to create (``mode="create"``, and not
in every version of the ``gcs`` extra's range): the GCS adapter sends its requests through
gcsfs's own client (:meth:`GCSFileSystem.call`, which passes keyword arguments on as query
parameters, with gcsfs's credentials, endpoint and retries), the upload a multipart one as
gcsfs's ``simple_upload`` sends it.
"""

from __future__ import annotations

import abc
import contextlib
import json
from datetime import datetime
from typing import Any
from urllib.parse import quote


class ObjectStore(abc.ABC):
    """The lock object's requests on one store (its fsspec filesystem ``fs``); the subclasses
    give the conditional ones. ``condition`` names a create's condition for a warning."""

    condition = ""

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    @abc.abstractmethod
    def create(self, path: str, body: bytes) -> str:
        """Write ``body`` where no object is; its version token. :class:`FileExistsError`
        where one is."""

    @abc.abstractmethod
    def rewrite(self, path: str, body: bytes, token: str) -> str:
        """Write ``body`` where the object's version is still ``token``; the new token. An
        error :meth:`lost` holds true for where it is not."""

    @abc.abstractmethod
    def delete(self, path: str, token: str) -> None:
        """Remove the object where its version is still ``token`` (one request, atomic)."""

    @abc.abstractmethod
    def stat(self, path: str) -> tuple[str | None, datetime | None]:
        """(version token, last written) of the object, read afresh."""

    @abc.abstractmethod
    def lost(self, exc: BaseException) -> bool:
        """Whether ``exc`` says the object is no longer the version a request named (the
        store's 412), or is gone."""

    @abc.abstractmethod
    def refused(self, exc: BaseException) -> bool:
        """Whether ``exc`` says the store refused a request's condition rather than answered
        it (a server without conditional deletes that does not ignore the condition)."""

    def cat(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def rm(self, path: str) -> None:
        """Remove the object, with no condition."""
        self.fs.rm_file(path)


class S3Objects(ObjectStore):
    """S3 through s3fs: conditional writes since 2024 (MinIO and moto too); conditional
    deletes on AWS's general purpose buckets since September 2025 (moto 5 too). s3fs passes
    ``IfMatch`` on to ``PutObject``; its ``rm_file`` passes no condition, so the delete goes
    through its client (``call_s3``)."""

    condition = "If-None-Match"

    def create(self, path: str, body: bytes) -> str:
        return self.fs.pipe_file(path, body, mode="create")["ETag"]

    def rewrite(self, path: str, body: bytes, token: str) -> str:
        return self.fs.pipe_file(path, body, IfMatch=token)["ETag"]

    def delete(self, path: str, token: str) -> None:
        bucket, key, _ = self.fs.split_path(path)
        try:
            self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=token)
        finally:
            self.fs.invalidate_cache(path)

    def stat(self, path: str) -> tuple[str | None, datetime | None]:
        self.fs.invalidate_cache(path)
        info = self.fs.info(path)
        return info.get("ETag"), info.get("LastModified")

    def lost(self, exc: BaseException) -> bool:
        """S3 answered 412 Precondition Failed to ``If-Match`` (s3fs raises an
        :class:`OSError` from botocore's ``ClientError``, which holds it), or no object."""
        if isinstance(exc, FileNotFoundError):
            return True
        response = _response(exc)
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return response.get("Error", {}).get("Code") == "PreconditionFailed" or status == 412

    def refused(self, exc: BaseException) -> bool:
        """501 Not Implemented or 400 (``NotImplemented``, ``InvalidArgument``,
        ``InvalidRequest``)."""
        response = _response(exc)
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = response.get("Error", {}).get("Code")
        return (status in (400, 501)
                or code in ("NotImplemented", "InvalidArgument", "InvalidRequest"))  # fmt: skip


def _response(exc: BaseException) -> dict[str, Any]:
    """The S3 answer behind ``exc`` (s3fs raises an :class:`OSError` from botocore's
    ``ClientError``, which holds it); {} where there is none."""
    return getattr(exc.__cause__, "response", None) or getattr(exc, "response", None) or {}


class GCSObjects(ObjectStore):
    """GCS's JSON API through gcsfs: every request on the condition ``ifGenerationMatch``
    (0: no live object), which GCS applies atomically; gcsfs raises :class:`FileExistsError`
    for its 412 and :class:`FileNotFoundError` for a 404."""

    condition = "ifGenerationMatch=0"
    #: the multipart upload's boundary (gcsfs's own)
    BOUNDARY = "==0=="

    def _upload(self, path: str, body: bytes, generation: str) -> str:
        """One multipart upload on the condition ``ifGenerationMatch=generation``; the
        generation written."""
        bucket, key, _ = self.fs.split_path(path)
        part = f"--{self.BOUNDARY}\nContent-Type: {{}}\n\n"
        data = (part.format("application/json; charset=UTF-8") + json.dumps({"name": key})
                + "\n" + part.format("application/json")).encode() + body  # fmt: skip
        data += f"\n--{self.BOUNDARY}--".encode()
        try:
            out = self.fs.call(
                "POST", f"{self.fs._location}/upload/storage/v1/b/{quote(bucket, safe='')}/o",
                uploadType="multipart", ifGenerationMatch=generation, data=data, json_out=True,
                headers={"Content-Type": f'multipart/related; boundary="{self.BOUNDARY}"'},
            )  # fmt: skip
        except Exception as exc:
            if _precondition_failed(exc) and not isinstance(exc, FileExistsError):
                raise FileExistsError(path) from exc  # an older gcsfs: HttpError 412
            raise
        finally:
            self.fs.invalidate_cache(path)
        return str(out["generation"])

    def create(self, path: str, body: bytes) -> str:
        return self._upload(path, body, "0")

    def rewrite(self, path: str, body: bytes, token: str) -> str:
        return self._upload(path, body, token)

    def delete(self, path: str, token: str) -> None:
        bucket, key, _ = self.fs.split_path(path)
        try:
            self.fs.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=token)
        finally:
            self.fs.invalidate_cache(path)

    def stat(self, path: str) -> tuple[str | None, datetime | None]:
        self.fs.invalidate_cache(path)
        info = self.fs.info(path)
        generation = info.get("generation")
        modified = info.get("mtime")
        if not isinstance(modified, datetime) and info.get("updated"):
            with contextlib.suppress(ValueError):  # RFC 3339, "Z" (Python 3.10 reads no Z)
                modified = datetime.fromisoformat(str(info["updated"]).replace("Z", "+00:00"))
        return (None if generation is None else str(generation),
                modified if isinstance(modified, datetime) else None)  # fmt: skip

    def lost(self, exc: BaseException) -> bool:
        return isinstance(exc, FileNotFoundError) or _precondition_failed(exc)

    def refused(self, exc: BaseException) -> bool:
        """400 or 501: gcsfs raises a :class:`ValueError` for a 400 whose message says
        "invalid", else its ``HttpError`` with the status as ``code``."""
        return isinstance(exc, ValueError) or getattr(exc, "code", None) in (400, 501)


def _precondition_failed(exc: BaseException) -> bool:
    """GCS's 412 as gcsfs raises it: :class:`FileExistsError` (gcsfs 2026.10), an older one
    (2024.2) its ``HttpError`` with the status as ``code``."""
    return isinstance(exc, FileExistsError) or str(getattr(exc, "code", "")) == "412"


#: the adapter of each URL scheme whose stores the lock serves
ADAPTERS: dict[str, type[ObjectStore]] = {
    "s3": S3Objects, "s3a": S3Objects, "gs": GCSObjects, "gcs": GCSObjects,
}  # fmt: skip
