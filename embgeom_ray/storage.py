"""Object storage (``s3://``, ``gs://``, …) as the job meets it: its faults are user errors.

An endpoint that answers nothing, credentials the store refuses, a bucket that does not exist,
a location the job may not write: each ends the job with one line naming the URL and the
endpoint, exit status 2 (:class:`~embgeom_ray.errors.StorageError`), not a library's
traceback, and within a bounded time: before the job reads a corpus or writes a run on an
object store it opens a TCP connection to the store's endpoint (:func:`probe`,
:data:`PROBE_TIMEOUT_S`), as it does to a Ray head, instead of leaving an unreachable
endpoint to the client library's retries and timeouts (minutes for a host that drops
packets). A bucket is never created by the job: writing a run into one that does not exist is
refused (:func:`check_output`). A protocol whose filesystem package is not installed (s3fs for
``s3://``, gcsfs for ``gs://``) is one line naming the package and the extra of embgeom-ray
that installs it (:func:`require_filesystem`, :data:`EXTRAS`).

The client libraries' exceptions are recognised by name (:func:`storage_error`: botocore's,
and the ``OSError`` subclasses s3fs and gcsfs translate them into), so nothing here imports
them.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from .errors import ConfigError, StorageError, UserError
from .io_utils import local_path

#: seconds a TCP connection to an object store's endpoint may take before it counts as
#: unreachable
PROBE_TIMEOUT_S = 10.0

#: endpoints of the stores whose client does not name one
DEFAULT_ENDPOINTS = {
    "gs": "https://storage.googleapis.com",
    "gcs": "https://storage.googleapis.com",
}

#: the extra of embgeom-ray (``pip install 'embgeom-ray[s3]'``) that installs each filesystem
#: package of fsspec's
EXTRAS = {"s3fs": "s3", "gcsfs": "gcs"}

#: botocore exceptions (and aiohttp's and fsspec's that s3fs lets through) that mean the
#: endpoint cannot be reached, or dropped or stalled the connection, after the retries
_UNREACHABLE = {"EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError",
                "ReadTimeoutError", "ProxyConnectionError", "ClientConnectorError",
                "ServerDisconnectedError", "ClientOSError", "ClientPayloadError",
                "SocketTimeoutError", "FSTimeoutError"}  # fmt: skip
#: botocore exceptions that mean there are no usable credentials
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}
#: S3 error codes (ClientError) that mean the store refused these credentials or this access
_REFUSED = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
            "InvalidToken", "Forbidden", "403"}  # fmt: skip


def is_remote(url: str) -> bool:
    """Whether ``url`` names an object store or another non-local filesystem (``scheme://``,
    not ``file://``)."""
    scheme = urlsplit(url).scheme
    return bool(scheme) and scheme not in ("file", "local") and "://" in url


def missing_filesystem(package: str, url: str | None = None, what: str = "") -> StorageError:
    """The :class:`StorageError` for a filesystem ``package`` that is not installed (needed for
    ``url``, the ``what``): the package, and the extra of embgeom-ray that installs it."""
    extra = EXTRAS.get(package)
    how = f"pip install 'embgeom-ray[{extra}]' (or pip install {package})" if extra else f"pip install {package}"
    if url is None:
        return StorageError(f"this needs the {package} package: {how}")
    scheme = urlsplit(url).scheme
    where = f" the {what}" if what else ""
    return StorageError(f"{scheme}:// URLs such as{where} {url} need the {package} package: {how}")


def require_filesystem(url: str, what: str) -> None:
    """Raise :class:`StorageError` when ``url`` (the ``what``) names a protocol fsspec does not
    know, or one whose filesystem package is not installed (:func:`missing_filesystem`)."""
    if not is_remote(url):
        return
    import fsspec
    from fsspec.registry import known_implementations

    scheme = urlsplit(url).scheme
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError:
        package = known_implementations.get(scheme, {}).get("class", scheme).split(".")[0]
        raise missing_filesystem(package, url, what) from None
    except ValueError:
        raise StorageError(f"unknown protocol {scheme}:// for the {what} {url}") from None


def require_filesystems(corpus: str, out: str) -> None:
    """:func:`require_filesystem` for a job's corpus and output directory: called before the
    job imports its libraries, so that a missing s3fs is one line at once."""
    require_filesystem(corpus, "corpus")
    require_filesystem(out, "output directory")


def _missing_package(exc: BaseException) -> str | None:
    """The package named by fsspec's ImportError for a filesystem not installed ("Install s3fs
    to access S3", "Please install gcsfs to access Google Storage"); None for anything else."""
    if not isinstance(exc, ImportError):
        return None
    match = re.search(r"install (\S+) to access", str(exc), re.IGNORECASE)
    return match.group(1) if match else None


def endpoint_of(url: str) -> str | None:
    """The endpoint the client library sends ``url``'s requests to (``s3://``: the one boto
    resolves from ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, the config or the region;
    ``gs://``: Google's, or the emulator's of ``STORAGE_EMULATOR_HOST``, which gcsfs sends
    them to), or None where it cannot tell. Nothing is sent."""
    scheme = urlsplit(url).scheme
    if scheme in DEFAULT_ENDPOINTS:
        emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
        if scheme in ("gs", "gcs") and emulator not in ("", "default"):  # as gcsfs reads it
            return emulator if "://" in emulator else f"http://{emulator}"
        return DEFAULT_ENDPOINTS[scheme]
    if scheme not in ("s3", "s3a"):
        return None
    try:
        import fsspec

        fs, _ = fsspec.core.url_to_fs(url)
        fs.connect()  # builds the client: resolves the endpoint, sends nothing
        return str(fs.s3.meta.endpoint_url)
    except Exception:
        return None


def probe(url: str, what: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Raise :class:`StorageError` unless the endpoint of ``url`` (``what``: ``"corpus"``,
    ``"output directory"``, …) accepts a TCP connection within ``timeout`` seconds."""
    if not is_remote(url):
        return
    endpoint = endpoint_of(url)
    if endpoint is None:
        return
    parts = urlsplit(endpoint)
    host = parts.hostname
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if not host:
        return
    reason = unreachable(host, port, timeout, refused="nothing listens there")
    if reason is None:
        return
    raise StorageError(
        f"cannot reach the object store at {endpoint} for the {what} {url}: {reason}; check "
        "the endpoint (AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the region) and the network"
    )


def unreachable(host: str, port: int, timeout: float, refused: str) -> str | None:
    """Why a TCP connection to ``host:port`` fails within ``timeout`` seconds (``refused``:
    what a refused connection means there), or None when something accepts it."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except socket.gaierror as exc:
        return f"host {host!r} cannot be resolved ({exc.strerror})"
    except ConnectionRefusedError:
        return f"connection refused: {refused}"
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def _code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str((response.get("Error") or {}).get("Code") or "") or None
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def storage_error(exc: BaseException, url: str | None = None, what: str = "") -> StorageError | None:
    """The :class:`StorageError` an object store's fault means (``url``: what the job was
    reading or writing, ``what`` it is), or None when ``exc`` is not one."""
    cause = getattr(exc, "cause", None)  # raised in a Ray task or actor: the error itself
    if isinstance(cause, BaseException):
        exc = cause
    if isinstance(exc, UserError):
        return None
    package = _missing_package(exc)
    if package is not None:
        return missing_filesystem(package, url, what)
    names = _names(exc)
    where = f" for the {what} {url}" if url else ""
    endpoint = (endpoint_of(url) if url else None) or getattr(exc, "kwargs", {}).get("endpoint_url")
    at = f" at {endpoint}" if endpoint else ""
    if names & _UNREACHABLE:
        return StorageError(f"cannot reach the object store{at}{where}: {_first_line(exc)}")
    if names & _NO_CREDENTIALS:
        return StorageError(
            f"no credentials for the object store{at}{where}: {_first_line(exc)}; set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a profile, or a role)"
        )
    code = _code(exc)
    text = _first_line(exc)
    if (code in _REFUSED) or (isinstance(exc, PermissionError) and url and is_remote(url)):
        return StorageError(
            f"the object store{at} refused access{where}: {text}; check the credentials and "
            "their permissions"
        )
    if code == "NoSuchBucket" or "bucket does not exist" in text.lower():
        return StorageError(f"no such bucket{where} (object store{at}): {text}")
    return None



def as_user_error(exc: BaseException) -> UserError | None:
    """``exc`` as the user error it is: itself, or an object store's fault
    (:func:`storage_error`); None for anything else (a bug)."""
    cause = getattr(exc, "cause", None)  # raised in a Ray task or actor: its own message
    if isinstance(cause, UserError):
        return cause
    if isinstance(exc, UserError):
        return exc
    return storage_error(exc)

@contextlib.contextmanager
def user_errors(url: str, what: str) -> Iterator[None]:
    """Within: an object store's fault while reading or writing ``url`` (the ``what``) is raised
    as one :class:`StorageError`."""
    try:
        yield
    except Exception as exc:
        error = storage_error(exc, url, what)
        if error is None:
            raise
        raise error from None


#: what :func:`resumable` says a rerun does, for an analysis and for a merge
RESUMES = "its completed checkpoint groups are kept: rerun the same command to resume once the store answers"
REDOES = "it is not marked complete: rerun the same command to write it once the store answers"


@contextlib.contextmanager
def resumable(url: str, rerun: str = RESUMES) -> Iterator[None]:
    """Within: the run at ``url`` (its ``--out``) is being written. An object store that stays
    unreachable, stalled or dropping connections past the retries
    (:data:`~embgeom_ray.io_utils.STORE_DEFAULTS`) ends the job with one
    :class:`StorageError` naming the run and the endpoint, and saying what a rerun does
    (``rerun``): an analysis resumes, since a checkpoint group counts as done only once its
    JSON is written (last), so the groups written before are kept and none is counted twice
    (:data:`RESUMES`); a merge, which has no checkpoints, is written again (:data:`REDOES`).
    Either way the manifest says ``complete`` only once every table and artefact is written
    (:meth:`~embgeom_ray.run_dir.RunDir.finalise`)."""
    try:
        yield
    except Exception as exc:
        error = storage_error(exc, url, "run")
        if error is None:
            raise
        if _names(getattr(exc, "cause", None) or exc) & _UNREACHABLE:
            error = StorageError(f"{error} (after retries); {rerun}")
        raise error from None


def check_bucket(url: str, what: str) -> None:
    """Raise :class:`StorageError` when ``url`` is on an object store whose bucket does not
    exist (or cannot be read with these credentials)."""
    parts = urlsplit(url)
    if parts.scheme not in ("s3", "s3a", "gs", "gcs") or not parts.netloc:
        return
    import fsspec

    with user_errors(url, what):
        fs, _ = fsspec.core.url_to_fs(url)
        try:
            if hasattr(fs, "call_s3"):  # s3fs: HEAD the bucket (404: none; 403: refused)
                fs.call_s3("head_bucket", Bucket=parts.netloc)
                exists = True
            else:
                exists = fs.exists(parts.netloc)
        except FileNotFoundError:
            exists = False
    if not exists:
        raise StorageError(
            f"no such bucket {parts.netloc!r} for the {what} {url} (object store at "
            f"{endpoint_of(url) or 'its default endpoint'})"
            + ("; create it first: the job does not create buckets" if what.startswith("output") else "")
        )


def check_input(url: str, what: str) -> None:
    """Before the job reads ``url`` on an object store: its endpoint answers (:func:`probe`)
    and its bucket exists."""
    if is_remote(url):
        require_filesystem(url, what)
        probe(url, what)
        check_bucket(url, what)


#: where Ray unpacks a job's ``--working-dir`` (``ray job submit``): removed with the job's
#: package, so nothing written under it lasts
RAY_WORKING_DIR_PART = "/runtime_resources/working_dir_files/"


def check_reachable(url: str, what: str) -> None:
    """On an object store, ``url``'s (the ``what``'s) filesystem is installed, its endpoint
    answers (:func:`probe`) and its bucket exists (:func:`check_bucket`); nothing for a local
    path."""
    if is_remote(url):
        require_filesystem(url, what)
        probe(url, what)
        check_bucket(url, what)


def check_output(url: str, what: str = "output directory") -> None:
    """Before a run (or a re-analysis store, ``what="store"``) is written to ``url``: on an
    object store, it is reachable (:func:`check_reachable`; the job never creates a bucket); a
    relative local path is refused where this process runs in the working directory Ray
    unpacked for a submitted job (it would land in that temporary copy of the code, not where
    the user looks)."""
    if not is_remote(url) and not os.path.isabs(local_path(url)):
        cwd = os.getcwd()
        if RAY_WORKING_DIR_PART in cwd:
            raise ConfigError(
                f"{url} is a relative path, and this job runs in the copy of its working "
                f"directory Ray made for it ({cwd}), which Ray removes: give an absolute path "
                "(on storage every node sees) or an object store's URL"
            )
    check_reachable(url, what)


#: environment variables of the object stores' clients that the job's own process hands to its
#: extractors when they write their own checkpoint groups (:func:`storage_access`)
STORAGE_VARIABLE_PREFIXES = ("AWS_", "FSSPEC_")
STORAGE_VARIABLES = ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT")


def storage_access() -> dict[str, Any]:
    """What this process uses to reach object storage, for an extractor that writes its own
    checkpoint groups to the run: the clients' environment variables set here (endpoint,
    region, keys; ``FSSPEC_*`` configuration) and fsspec's configuration (``fsspec.config.conf``:
    timeouts and retries a user or test set in code). Handed to the actors as an argument, as
    the hub token is (:mod:`~embgeom_ray.inputs.hub_credentials`), never in Ray's runtime
    environment, which Ray shows in its dashboard; and never recorded."""
    import copy
    import os

    import fsspec.config

    env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(STORAGE_VARIABLE_PREFIXES) or k in STORAGE_VARIABLES
    }
    return {"env": env, "fsspec": copy.deepcopy(dict(fsspec.config.conf))}


def use_storage_access(access: dict[str, Any]) -> None:
    """Set ``access`` (:func:`storage_access` of the job's process) in this process where it
    has none of its own: a variable or an fsspec setting of the node wins. The job's defaults
    (:data:`~embgeom_ray.io_utils.STORE_DEFAULTS`, applied in every process that imports
    :mod:`~embgeom_ray.io_utils`, perhaps before this runs) are not the node's own: the job's
    process's settings replace them (its own defaults, or what a user or a test set there)."""
    import copy
    import os

    import fsspec.config

    from .io_utils import store_defaults_only

    for name, value in (access.get("env") or {}).items():
        if not os.environ.get(name):
            os.environ[name] = value
    for protocol, options in (access.get("fsspec") or {}).items():
        if protocol not in fsspec.config.conf or store_defaults_only(protocol):
            fsspec.config.conf[protocol] = copy.deepcopy(options)
