"""One set of file functions for local folders and ``s3://bucket/key`` URIs.

Runs, checkpoints and prefix caches are written by long jobs that may die at any moment, and read by
other jobs that must never see half of something.  Every write here therefore lands whole or not at
all: locally through a temp file in the same directory that is fsynced and then moved into place (``os.replace``), on S3
through a single PUT or a completed multipart upload (an interrupted multipart upload is aborted and
never becomes an object).

Every failure a user can cause (bad credentials, a missing bucket, an unreachable server, a missing
file) surfaces as :class:`StorageError` with a one-line message that names the URI and the endpoint, so
a failed run says what to fix instead of dumping a botocore traceback.  The secret key never appears.

**Outages are ridden out.** Every operation, local or S3 — reads, writes, each part of a multipart
upload, listings, ranged reads, downloads — retries transient failures (connection refused, timeouts,
5xx answers, SlowDown and the other throttling codes botocore's standard retry mode knows; locally the
errors of a network file system that comes back: ``ESTALE``, ``ETIMEDOUT``, ``EIO`` …) with capped
exponential backoff and full jitter, as the AWS SDKs' retry modes do, until a deadline
(:func:`configure_retries`; the run config's ``storage.retry_deadline_s``, 300 s by default) after the
first failure. While it waits it logs one line about every 30 s ("S3 unreachable: retrying until …");
past the deadline it raises :class:`StorageUnavailable` (the front doors' exit 75). Anything else — a
4xx such as bad credentials, a missing bucket or object — fails at once. Writes also pass the write
checks registered with :func:`add_write_check` before every attempt (the run root's lease,
:mod:`sapd.lease`, refuses writes once another run holds it).

S3 settings come from the environment (``SAPD_S3_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``) unless :func:`configure_s3`
sets them explicitly.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import IO, Any, TypeVar
from urllib.parse import unquote, urlparse

import boto3
import botocore.exceptions as bce
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

__all__ = [
    "StorageError",
    "StorageNotFound",
    "StorageUnavailable",
    "CorruptObject",
    "PreconditionFailed",
    "S3Settings",
    "Versioned",
    "TRANSFER_CONFIG",
    "configure_s3",
    "configure_retries",
    "retry_deadline",
    "retry_deadline_s",
    "add_write_check",
    "is_s3",
    "join",
    "read_bytes",
    "write_bytes",
    "read_text",
    "write_text",
    "read_json",
    "write_json",
    "exists",
    "list_files",
    "delete",
    "delete_prefix",
    "write_file_from",
    "download_to",
    "read_range",
    "open_write",
    "AtomicWriter",
    "read_versioned",
    "write_conditional",
    "delete_conditional",
    "digest",
    "file_digest",
    "check_digest",
    "transfer_stats",
    "reset_transfer_stats",
]

MiB = 1024 * 1024

# Checkpoints are large; 16 MiB parts keep the part count low (S3 allows 10 000) while still
# parallelising.  Replace this (or pass ``transfer_config=``) to force multipart with a few MB in tests.
TRANSFER_CONFIG = TransferConfig(
    multipart_threshold=16 * MiB,
    multipart_chunksize=16 * MiB,
    max_concurrency=8,
    use_threads=True,
    preferred_transfer_client="classic",
)

# MaxKeys for one ListObjectsV2 page.  1000 is the S3 maximum; tests lower it to exercise pagination.
_LIST_PAGE_SIZE = 1000
# DeleteObjects accepts at most 1000 keys per request.
_DELETE_BATCH = 1000

# Suffix of in-flight local temp files, so listings can hide the leftovers of a crashed writer.
_TMP_SUFFIX = ".sapd-tmp"
TMP_SUFFIX = _TMP_SUFFIX  # public: a reader that cleans up after a killed writer looks for it

# Bytes moved to and from S3 by this process (every read and write path below counts), for the
# measurements that compare traffic (one download per pod, sharded optimizer state).
_stats = {"s3_read_bytes": 0, "s3_written_bytes": 0, "s3_get_requests": 0}
_stats_lock = threading.Lock()


def _count(key: str, n: int, requests: int = 0) -> None:
    with _stats_lock:
        _stats[key] += n
        _stats["s3_get_requests"] += requests


def transfer_stats() -> dict[str, int]:
    """This process's S3 traffic since start (or :func:`reset_transfer_stats`): bytes read (GET bodies,
    ranged GETs and downloads), bytes written (PUTs and multipart parts), and GET requests."""
    with _stats_lock:
        return dict(_stats)


def reset_transfer_stats() -> None:
    with _stats_lock:
        for key in _stats:
            _stats[key] = 0


def _file_mode() -> int:
    """The mode ``open()`` would give a new file (0o666 less the umask). ``tempfile.mkstemp`` creates its
    file 0o600, which the atomic rename would otherwise publish: converted data and shards unreadable to
    the group and to other users. Linux reports the umask in /proc; elsewhere it is read by setting it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


class StorageError(RuntimeError):
    """A storage operation failed for a reason the user can act on (message is one line)."""


class StorageNotFound(StorageError):
    """The object or file does not exist; separate so callers can treat "absent" as a normal case."""


class StorageUnavailable(StorageError):
    """The server could not be reached or answered with a server-side error: transient, worth retrying."""


class CorruptObject(StorageError):
    """A stored file is not what was committed (its size or digest differs from the one recorded when it
    was committed): damaged, truncated or replaced. Refused, never used; the message names the object."""


class PreconditionFailed(StorageError):
    """A conditional write or delete found the object changed (or present, or absent) since it was read."""


# --------------------------------------------------------------------------------------------------
# Riding out outages: capped exponential backoff with full jitter up to a deadline (the AWS SDKs'
# retry modes: delay = uniform(0, min(cap, base * 2**attempt))), one log line every 30 s while waiting

RETRY_DEADLINE_S = 300.0  # the default of the run config's storage.retry_deadline_s
_BACKOFF_BASE_S = 1.0
_BACKOFF_CAP_S = 20.0  # botocore's standard mode caps its backoff at 20 s too
OUTAGE_LOG_EVERY_S = 30.0
_WRITE_ACTIONS = ("writing", "deleting")

T = TypeVar("T")


def _log_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class _RetrySettings:
    deadline_s: float = RETRY_DEADLINE_S
    log: Callable[[str], None] = _log_stderr


_retry = _RetrySettings()
_outage = {"last_line": -float("inf")}  # one line per process every OUTAGE_LOG_EVERY_S, whichever thread waits
_outage_lock = threading.Lock()
_write_checks: list[Callable[[str], None]] = []


def configure_retries(deadline_s: float | None = None, log: Callable[[str], None] | None = None) -> tuple[float, Any]:
    """Set how long every storage operation retries transient failures (seconds after its first failure;
    0: not at all) and where its "retrying until …" lines go (default: stderr). Returns the previous
    ``(deadline_s, log)``, so a caller can restore them."""
    previous = (_retry.deadline_s, _retry.log)
    if deadline_s is not None:
        if not deadline_s >= 0:
            raise ValueError(f"storage retry deadline must be ≥ 0 seconds, not {deadline_s!r}")
        _retry.deadline_s = float(deadline_s)
    if log is not None:
        _retry.log = log
    return previous


def retry_deadline_s() -> float:
    """How long storage operations retry transient failures (:func:`configure_retries`)."""
    return _retry.deadline_s


@contextlib.contextmanager
def retry_deadline(seconds: float) -> Iterator[None]:
    """Storage operations inside the block retry for at most ``seconds`` (e.g. ``sapd check``, which
    diagnoses rather than waits)."""
    previous, _ = configure_retries(seconds)
    try:
        yield
    finally:
        configure_retries(previous)


def add_write_check(check: Callable[[str], None]) -> Callable[[], None]:
    """Call ``check(uri)`` before every attempt of every write or delete (it raises to refuse the write;
    a :class:`StorageUnavailable` from it is retried like the write's own). → a function that removes it."""
    _write_checks.append(check)

    def remove() -> None:
        if check in _write_checks:
            _write_checks.remove(check)

    return remove


def _outage_line_due(now: float) -> bool:
    with _outage_lock:
        if now - _outage["last_line"] >= OUTAGE_LOG_EVERY_S:
            _outage["last_line"] = now
            return True
        return False


def _utc(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch))


def _retrying(uri: str, action: str, attempt: Callable[[], T], *, retry: bool = True) -> T:
    """``attempt()`` (which raises :class:`StorageError` s), again after each :class:`StorageUnavailable`
    until the deadline; writes pass the write checks first, at every attempt."""
    started: float | None = None
    tries = 0
    told = False
    while True:
        try:
            if action in _WRITE_ACTIONS:
                for check in list(_write_checks):
                    check(uri)
            result = attempt()
        except StorageUnavailable as exc:
            now = time.monotonic()
            started = now if started is None else started
            deadline = _retry.deadline_s if retry else 0.0
            left = started + deadline - now
            if left <= 0:
                if tries == 0:
                    raise
                raise StorageUnavailable(f"{exc} (still failing after {now - started:.0f} s of retries; "
                                         f"storage.retry_deadline_s is {deadline:g})") from exc
            if _outage_line_due(now):
                what = "S3" if is_s3(uri) else "storage"
                _retry.log(f"{what} unreachable: retrying until {_utc(time.time() + left)} "
                           f"({left:.0f} s left of storage.retry_deadline_s): {exc}")
                told = True
            time.sleep(min(random.uniform(0.0, min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2**tries)), left))
            tries += 1
            continue
        if told and started is not None:
            _retry.log(f"{'S3' if is_s3(uri) else 'storage'} reachable again after {time.monotonic() - started:.0f} s "
                       f"({tries} retries): {action} {uri} went through")
        return result


# --------------------------------------------------------------------------------------------------
# URIs


def is_s3(uri: str) -> bool:
    return uri[:5].lower() == "s3://"


def _is_file_uri(uri: str) -> bool:
    return uri[:7].lower() == "file://"


_SCHEME_RE = re.compile(r"^(s3://|file://)?(.*)$", re.IGNORECASE | re.DOTALL)


def join(base: str, *parts: str) -> str:
    """Join path pieces with exactly one ``/`` between them.

    Unlike ``os.path.join``, an absolute-looking part never discards the base: a key such as
    ``"/x"`` coming from data must not silently redirect a write to the filesystem root.
    """
    pieces = [re.sub(r"/+", "/", p).strip("/") for p in parts]
    pieces = [p for p in pieces if p]
    if not pieces:
        return base
    match = _SCHEME_RE.match(base)
    assert match is not None  # the pattern matches every string
    scheme, rest = match.group(1) or "", match.group(2)
    stripped = rest.rstrip("/")
    if stripped:
        head = scheme + stripped + "/"
    elif rest.startswith("/") or scheme.lower() == "file://":
        head = scheme + "/"  # filesystem root, "/" or "file:///"
    elif scheme:
        raise StorageError(f"cannot join onto {base!r}: it names no bucket")
    else:
        head = ""  # relative join onto "" behaves like joining onto the current directory
    return head + "/".join(pieces)


def _split_s3(uri: str) -> tuple[str, str]:
    rest = uri[5:]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise StorageError(f"S3 URI {uri!r} names no bucket (expected s3://bucket/key)")
    return bucket, key


def _s3_object(uri: str) -> tuple[str, str]:
    bucket, key = _split_s3(uri)
    if not key or key.endswith("/"):
        raise StorageError(f"S3 URI {uri!r} names a folder, not an object (expected s3://bucket/key)")
    return bucket, key


def _s3_folder(uri: str) -> tuple[str, str]:
    # Folder semantics: "s3://b/run1" must not match "s3://b/run10/...".
    bucket, key = _split_s3(uri)
    key = key.strip("/")
    return bucket, (key + "/") if key else ""


def _local_path(uri: str) -> Path:
    if _is_file_uri(uri):
        parsed = urlparse(uri)
        if parsed.netloc not in ("", "localhost"):
            raise StorageError(f"file URI {uri!r} names a remote host; only local files are supported")
        return Path(unquote(parsed.path))
    return Path(uri)


# --------------------------------------------------------------------------------------------------
# S3 client and configuration


@dataclass(frozen=True)
class S3Settings:
    """Explicit S3 settings; ``None`` fields fall back to the environment."""

    endpoint_url: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    region: str | None = None


_explicit = S3Settings()
_clients: dict[tuple[str | None, str | None, str | None, str], Any] = {}
_clients_lock = threading.Lock()


def configure_s3(
    endpoint_url: str | None = None,
    access_key_id: str | None = None,
    secret_access_key: str | None = None,
    region: str | None = None,
) -> S3Settings:
    """Set S3 settings explicitly and drop cached clients; returns the previous settings.

    Returning the previous settings lets a caller (tests, a CLI sub-command) restore them exactly
    with ``configure_s3(**dataclasses.asdict(previous))``.
    """
    global _explicit
    with _clients_lock:
        previous = _explicit
        _explicit = S3Settings(endpoint_url, access_key_id, secret_access_key, region)
        _clients.clear()
    return previous


def _resolved() -> tuple[str | None, str | None, str | None, str]:
    # Read at every call so that a changed environment gets its own client instead of a stale one.
    endpoint = (
        _explicit.endpoint_url
        or os.environ.get("SAPD_S3_ENDPOINT_URL")
        or os.environ.get("AWS_ENDPOINT_URL")
        or None
    )
    key_id = _explicit.access_key_id or os.environ.get("AWS_ACCESS_KEY_ID") or None
    secret = _explicit.secret_access_key or os.environ.get("AWS_SECRET_ACCESS_KEY") or None
    region = _explicit.region or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return endpoint, key_id, secret, region


def s3_endpoint() -> str:
    """The S3 endpoint requests go to (for messages): the configured one, or AWS's default."""
    return _resolved()[0] or "AWS default"


def _client() -> Any:
    settings = _resolved()
    with _clients_lock:
        client = _clients.get(settings)
        if client is None:
            endpoint, key_id, secret, region = settings
            # A private session per client: boto3's default session is not thread-safe to create
            # clients from, and we do not want ~/.aws profiles to override explicit settings.
            session = boto3.session.Session(
                aws_access_key_id=key_id, aws_secret_access_key=secret, region_name=region
            )
            client = session.client(
                "s3",
                endpoint_url=endpoint,
                config=Config(
                    s3={"addressing_style": "path"},
                    retries={"max_attempts": 3, "mode": "standard"},
                    connect_timeout=5,
                    read_timeout=60,
                    max_pool_connections=32,
                ),
            )
            _clients[settings] = client
    return client


def _endpoint(client: Any) -> str:
    return str(client.meta.endpoint_url)


def _key_id(client: Any) -> str:
    # botocore has no public accessor for the signing credentials; only the id is ever shown.
    try:
        creds = client._request_signer._credentials
    except AttributeError:
        return "<unknown>"
    return getattr(creds, "access_key", None) or "<none>"


# --------------------------------------------------------------------------------------------------
# Error translation


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _root_cause(exc: BaseException) -> BaseException:
    """Find the botocore error behind wrappers (s3transfer, boto3's S3UploadFailedError)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (bce.ClientError, bce.BotoCoreError)):
            return current
        last = getattr(current, "last_exception", None)  # s3transfer RetriesExceededError
        current = last if isinstance(last, BaseException) else (current.__cause__ or current.__context__)
    return exc


_CREDENTIAL_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "InvalidToken",
    "ExpiredToken",
    "TokenRefreshRequired",
    "AuthorizationHeaderMalformed",
    "403",
}
_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}
# what botocore's standard retry mode retries (botocore/retries/standard.py), and throttling by status
_TRANSIENT_CODES = {
    "RequestTimeout", "RequestTimeoutException", "PriorRequestNotComplete", "InternalError", "ServiceUnavailable",
    "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottledException", "TooManyRequestsException",
    "ProvisionedThroughputExceededException", "TransactionInProgressException", "RequestLimitExceeded",
    "BandwidthLimitExceeded", "LimitExceededException", "RequestThrottled", "SlowDown", "EC2ThrottledException",
    "ConditionalRequestConflict",  # S3: a conditional write raced another one in flight; retry
}


def _error_code(exc: BaseException) -> str:
    cause = _root_cause(exc)
    if isinstance(cause, bce.ClientError):
        return str(cause.response.get("Error", {}).get("Code", ""))
    return ""


def _transient_cause(cause: BaseException) -> bool:
    """A failure on the way (no answer, a broken or mangled answer), not one the server decided on."""
    if isinstance(cause, (bce.ConnectionError, bce.HTTPClientError, bce.IncompleteReadError)):
        return True
    if type(cause).__name__ == "FlexibleChecksumError":  # a body that arrived damaged
        return True
    # s3transfer's own retries of a download end with the socket's or urllib3's error
    return isinstance(cause, (ConnectionError, TimeoutError)) or type(cause).__module__.startswith("urllib3")


def _translate(exc: BaseException, client: Any, uri: str, action: str) -> StorageError:
    endpoint = _endpoint(client)
    cause = _root_cause(exc)
    if isinstance(cause, bce.ClientError):
        error = cause.response.get("Error", {})
        code = str(error.get("Code", ""))
        message = _one_line(error.get("Message") or code)
        if code in _CREDENTIAL_CODES:
            return StorageError(
                f"S3 credentials rejected by {endpoint} for {uri} (access key id {_key_id(client)}): "
                f"{code}: {message}"
            )
        if code == "NoSuchBucket":
            bucket = _split_s3(uri)[0]
            return StorageError(f"bucket '{bucket}' does not exist at {endpoint} (while {action} {uri})")
        if code in _NOT_FOUND_CODES:
            return StorageNotFound(f"no such object {uri} at {endpoint}")
        if code in ("PreconditionFailed", "412"):
            return PreconditionFailed(f"{uri} at {endpoint} changed since it was read ({code}: {message})")
        status = int(cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        kind = StorageUnavailable if status >= 500 or status == 429 or code in _TRANSIENT_CODES else StorageError
        return kind(f"S3 error while {action} {uri} at {endpoint}: {code}: {message}")
    if _transient_cause(cause):
        return StorageUnavailable(f"S3 server {endpoint} unreachable while {action} {uri}: {_one_line(cause)}")
    if isinstance(cause, (bce.NoCredentialsError, bce.PartialCredentialsError)):
        return StorageError(
            f"no S3 credentials for {uri} at {endpoint}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "or call sapd.storage.configure_s3()"
        )
    if isinstance(cause, bce.ParamValidationError):
        return StorageError(f"invalid S3 request while {action} {uri} at {endpoint}: {_one_line(cause)}")
    return StorageError(
        f"S3 {action} {uri} at {endpoint} failed: {type(cause).__name__}: {_one_line(cause)}"
    )


def _s3_call(uri: str, action: str, fn: Callable[[Any], Any], *, retry: bool = True) -> Any:
    """``fn(client)``, every failure a :class:`StorageError` naming the URI, transient ones retried."""

    def attempt() -> Any:
        client = _client()
        try:
            return fn(client)
        except StorageError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a StorageError naming the URI
            raise _translate(exc, client, uri, action) from exc

    return _retrying(uri, action, attempt, retry=retry)


def _missing_object(client: Any, bucket: str, uri: str) -> StorageError:
    """HEAD answers a bare 404 for a missing bucket too; ask the bucket so the message is right."""
    try:
        client.head_bucket(Bucket=bucket)
    except Exception as exc:  # noqa: BLE001
        cause = _root_cause(exc)
        if isinstance(cause, bce.ClientError) and str(cause.response.get("Error", {}).get("Code")) in (
            "404",
            "NoSuchBucket",
            "NotFound",
        ):
            return StorageError(f"bucket '{bucket}' does not exist at {_endpoint(client)} (looking up {uri})")
        return _translate(exc, client, uri, "looking up")
    return StorageNotFound(f"no such object {uri} at {_endpoint(client)}")


def _is_not_found(exc: BaseException) -> bool:
    cause = _root_cause(exc)
    return isinstance(cause, bce.ClientError) and str(cause.response.get("Error", {}).get("Code")) in (
        _NOT_FOUND_CODES
    )


# --------------------------------------------------------------------------------------------------
# Local atomic writes


# what a network file system (NFS, a FUSE mount of object storage) answers while its server is away; a
# local disk that fails with EIO is retried too, and fails with 75 at the deadline
_TRANSIENT_ERRNOS = {errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.ESTALE, errno.EIO, errno.ECONNREFUSED,
                     errno.ECONNRESET, errno.ECONNABORTED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN,
                     errno.EHOSTDOWN, errno.ENOLINK}


def _local_error(exc: OSError, path: Path, action: str) -> StorageError:
    if isinstance(exc, FileNotFoundError):
        return StorageNotFound(f"no such file {path} (while {action})")
    if exc.errno in _TRANSIENT_ERRNOS or isinstance(exc, TimeoutError):
        return StorageUnavailable(f"local storage unavailable while {action} {path}: {exc.strerror or exc}")
    return StorageError(f"local {action} {path} failed: {exc.strerror or exc}")


def _local_call(uri: str, path: Path, action: str, fn: Callable[[], T], *, retry: bool = True) -> T:
    """``fn()`` on a local path, its OSErrors as :class:`StorageError` s, transient ones retried."""

    def attempt() -> T:
        try:
            return fn()
        except OSError as exc:
            raise _local_error(exc, path, action) from exc

    return _retrying(uri, action, attempt, retry=retry)


def _atomic_local_write(path: Path, fill: Callable[[IO[bytes]], object]) -> None:
    """Write through a temp file in the target's directory so a crash leaves the old file intact.

    Same directory because ``os.replace`` is only atomic within one filesystem; fsync before the
    rename so that a power loss cannot publish a file whose data blocks never reached the disk.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=_TMP_SUFFIX, dir=path.parent)
    except OSError as exc:
        raise _local_error(exc, path, "writing") from exc
    tmp = Path(tmp_name)
    try:
        os.fchmod(fd, _file_mode())
        with os.fdopen(fd, "wb") as handle:
            fill(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            tmp.unlink()
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise _local_error(exc, path, "writing") from exc
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not every filesystem allows opening a directory, so best effort.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------
# Bytes / text / JSON


def read_bytes(uri: str) -> bytes:
    if is_s3(uri):
        bucket, key = _s3_object(uri)
        data = _s3_call(
            uri, "reading", lambda c: c.get_object(Bucket=bucket, Key=key)["Body"].read()
        )
        _count("s3_read_bytes", len(data), 1)
        return data
    path = _local_path(uri)
    return _local_call(uri, path, "reading", path.read_bytes)


def write_bytes(uri: str, data: bytes, *, transfer_config: TransferConfig | None = None) -> None:
    """Write ``data`` whole or not at all; large payloads go through a managed (multipart) upload."""
    if is_s3(uri):
        config = transfer_config or TRANSFER_CONFIG
        if len(data) >= config.multipart_threshold:
            _s3_upload(bytes(data), uri, config)
        else:
            bucket, key = _s3_object(uri)
            _s3_call(uri, "writing", lambda c: c.put_object(Bucket=bucket, Key=key, Body=data))
        _count("s3_written_bytes", len(data))
        return
    payload = bytes(data)
    path = _local_path(uri)
    _retrying(uri, "writing", lambda: _atomic_local_write(path, lambda handle: handle.write(payload)))


def read_text(uri: str, encoding: str = "utf-8") -> str:
    data = read_bytes(uri)
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise StorageError(f"{uri} is not valid {encoding} text: {exc}") from exc


def write_text(uri: str, text: str, encoding: str = "utf-8") -> None:
    write_bytes(uri, text.encode(encoding))


def read_json(uri: str) -> Any:
    text = read_text(uri)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise StorageError(f"{uri} is not valid JSON: {exc}") from exc


def write_json(uri: str, obj: Any) -> None:
    """Stable formatting (sorted keys, indent 2, trailing newline) so reruns give identical bytes."""
    write_text(uri, json.dumps(obj, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------------------------------
# Digests: what a commit records of each file, and the check of what is read against it


def digest(data: bytes | memoryview) -> dict[str, Any]:
    """The size and SHA-256 a commit records of a file's bytes."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def file_digest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """:func:`digest` of a local file, read in 4 MiB pieces."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(4 * MiB):
            h.update(chunk)
            n += len(chunk)
    return {"bytes": n, "sha256": h.hexdigest()}


def check_digest(what: str, found: dict[str, Any], expected: dict[str, Any] | None, committed_in: str) -> None:
    """:class:`CorruptObject` naming ``what`` unless ``found`` (a :func:`digest`) is the ``expected`` one that
    ``committed_in`` recorded (None: it recorded none for this file, which is refused as well)."""
    if expected is None:
        raise CorruptObject(f"{what}: not one of the files {committed_in} records; refusing to use it")
    if found["bytes"] != expected["bytes"] or found["sha256"] != expected["sha256"]:
        raise CorruptObject(f"{what}: {found['bytes']} bytes with SHA-256 {found['sha256'][:16]}…, but {committed_in} "
                            f"recorded {expected['bytes']} bytes with {expected['sha256'][:16]}…: damaged, truncated "
                            "or replaced since it was committed; refusing to use it")


# --------------------------------------------------------------------------------------------------
# Conditional writes (what a lease needs: create if absent, replace if unchanged since read)

_LOCK_SUFFIX = ".sapd-lock"


@dataclass(frozen=True)
class Versioned:
    """An object's bytes with what names this version of it and how old it is."""

    data: bytes
    etag: str  # what a conditional write or delete names: S3's ETag; locally the file's inode, mtime and size
    age_s: float  # seconds since it was written, by the store's clock: on S3 the answer's Date less Last-Modified


def read_versioned(uri: str, *, retry: bool = True) -> Versioned | None:
    """The object at ``uri`` with its version and age, or None when there is none. The age comes from one
    clock — the S3 server's (its ``Date`` header against the object's ``Last-Modified``), or this machine's
    against the file's mtime — so hosts whose clocks differ agree on it."""
    if is_s3(uri):
        bucket, key = _s3_object(uri)

        def get(client: Any) -> Versioned | None:
            try:
                answer = client.get_object(Bucket=bucket, Key=key)
            except Exception as exc:  # noqa: BLE001
                if _is_not_found(exc):
                    return None
                raise
            data = answer["Body"].read()
            modified = answer["LastModified"].timestamp()
            date = (answer.get("ResponseMetadata", {}).get("HTTPHeaders") or {}).get("date")
            now = parsedate_to_datetime(date).timestamp() if date else time.time()
            return Versioned(data, str(answer.get("ETag", "")), max(0.0, now - modified))

        return _s3_call(uri, "reading", get, retry=retry)
    path = _local_path(uri)

    def read_local() -> Versioned | None:
        try:
            with path.open("rb") as handle:
                st = os.fstat(handle.fileno())
                data = handle.read()
        except FileNotFoundError:
            return None
        return Versioned(data, _local_etag(st), max(0.0, time.time() - st.st_mtime))

    return _local_call(uri, path, "reading", read_local, retry=retry)


def _local_etag(st: os.stat_result) -> str:
    return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"


@contextlib.contextmanager
def _local_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` beside ``path`` for a read-compare-write; where the file system has no
    ``flock`` (some NFS set-ups) it goes on without one (the lease's read-back still sees a lost race)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}{_LOCK_SUFFIX}"), "a+b") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
        try:
            yield
        finally:
            try:
                fcntl.flock(lock, fcntl.LOCK_UN)
            except OSError:
                pass


def write_conditional(uri: str, data: bytes, *, if_match: str | None = None, if_absent: bool = False,
                      retry: bool = True) -> str:
    """Write ``data`` only if the object is still the version ``if_match`` names, or (``if_absent``) only if
    there is none: S3's conditional PUT (``If-Match`` / ``If-None-Match: *``); locally a compare and an
    atomic rename under an ``flock``. → the new version; :class:`PreconditionFailed` when the condition
    does not hold. (A retried PUT whose first attempt went through also ends in PreconditionFailed: a
    caller reads the object back to tell.)"""
    if (if_match is None) == (not if_absent):
        raise ValueError("write_conditional: give exactly one of if_match and if_absent")
    if is_s3(uri):
        bucket, key = _s3_object(uri)
        cond = {"IfMatch": if_match} if if_match is not None else {"IfNoneMatch": "*"}
        answer = _s3_call(uri, "writing", lambda c: c.put_object(Bucket=bucket, Key=key, Body=data, **cond),
                          retry=retry)
        _count("s3_written_bytes", len(data))
        return str(answer.get("ETag", ""))
    path = _local_path(uri)
    payload = bytes(data)

    def write_local() -> str:
        with _local_lock(path):
            try:
                current: str | None = _local_etag(path.stat())
            except FileNotFoundError:
                current = None
            if (if_absent and current is not None) or (if_match is not None and current != if_match):
                raise PreconditionFailed(f"{path} changed since it was read")
            _atomic_local_write(path, lambda handle: handle.write(payload))
            return _local_etag(path.stat())

    return _local_call(uri, path, "writing", write_local, retry=retry)


def delete_conditional(uri: str, if_match: str, *, retry: bool = True) -> None:
    """Delete the object only if it is still the version ``if_match`` names (gone already: nothing to do);
    :class:`PreconditionFailed` when it changed."""
    if is_s3(uri):
        bucket, key = _s3_object(uri)

        def delete_s3(client: Any) -> None:
            try:
                client.delete_object(Bucket=bucket, Key=key, IfMatch=if_match)
            except Exception as exc:  # noqa: BLE001
                if _is_not_found(exc):
                    return
                if _error_code(exc) in ("PreconditionFailed", "412"):  # some servers answer 412 for "no object"
                    try:
                        client.head_object(Bucket=bucket, Key=key)
                    except Exception as missing:  # noqa: BLE001
                        if _is_not_found(missing):
                            return
                raise

        _s3_call(uri, "deleting", delete_s3, retry=retry)
        return
    path = _local_path(uri)

    def delete_local() -> None:
        with _local_lock(path):
            try:
                current = _local_etag(path.stat())
            except FileNotFoundError:
                return
            if current != if_match:
                raise PreconditionFailed(f"{path} changed since it was read")
            path.unlink(missing_ok=True)

    _local_call(uri, path, "deleting", delete_local, retry=retry)


# --------------------------------------------------------------------------------------------------
# Existence, listing, deletion


def exists(uri: str) -> bool:
    """True for an existing file/object; "folders" do not count (S3 has none to ask about)."""
    if is_s3(uri):
        bucket, key = _s3_object(uri)

        def attempt() -> bool:
            client = _client()
            try:
                client.head_object(Bucket=bucket, Key=key)
                return True
            except Exception as exc:  # noqa: BLE001
                if not _is_not_found(exc):
                    raise _translate(exc, client, uri, "checking") from exc
            missing = _missing_object(client, bucket, uri)
            if isinstance(missing, StorageNotFound):
                return False
            raise missing

        return _retrying(uri, "checking", attempt)
    path = _local_path(uri)
    return _local_call(uri, path, "checking", path.is_file)


def _iter_s3_keys(client: Any, bucket: str, prefix: str, *, include_markers: bool = False) -> Iterator[str]:
    token: str | None = None
    while True:
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": _LIST_PAGE_SIZE}
        if token:
            kwargs["ContinuationToken"] = token
        page = client.list_objects_v2(**kwargs)
        for item in page.get("Contents", []):
            key = item["Key"]
            # Zero-byte "folder" markers made by some tools are not files, but must go on delete.
            if include_markers or not key.endswith("/"):
                yield key
        next_token = page.get("NextContinuationToken")
        if not page.get("IsTruncated") or not next_token:
            return
        if next_token == token:  # a buggy server must not make us loop forever
            raise StorageError(f"S3 listing of s3://{bucket}/{prefix} at {_endpoint(client)} does not advance")
        token = next_token


def list_files(prefix_uri: str) -> list[str]:
    """Every file below a folder, recursively, as full URIs in sorted order.

    Hides the temp files of local writers that are in flight or crashed, and the lock files of
    conditional writes, since those are not files anyone wrote on purpose.
    """
    if is_s3(prefix_uri):
        bucket, prefix = _s3_folder(prefix_uri)
        keys = _s3_call(prefix_uri, "listing", lambda c: list(_iter_s3_keys(c, bucket, prefix)))
        return sorted(f"s3://{bucket}/{key}" for key in keys)
    root = _local_path(prefix_uri)

    def _raise(exc: OSError) -> None:
        raise exc

    def walk() -> list[str]:
        if not root.is_dir():
            return []
        found: list[str] = []
        for dirpath, _dirnames, filenames in os.walk(root, onerror=_raise):
            rel_dir = os.path.relpath(dirpath, root)
            for name in filenames:
                if name.startswith(".") and name.endswith((_TMP_SUFFIX, _LOCK_SUFFIX)):
                    continue
                rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                found.append(join(prefix_uri, rel.replace(os.sep, "/")))
        return sorted(found)

    return _local_call(prefix_uri, root, "listing", walk)


def delete(uri: str) -> None:
    """Remove one file/object; a missing one is not an error (S3 DELETE is idempotent too)."""
    if is_s3(uri):
        bucket, key = _s3_object(uri)
        _s3_call(uri, "deleting", lambda c: c.delete_object(Bucket=bucket, Key=key))
        return
    path = _local_path(uri)
    _local_call(uri, path, "deleting", lambda: path.unlink(missing_ok=True))


def delete_prefix(prefix_uri: str) -> None:
    """Remove everything below a folder; refuses a whole bucket or a filesystem root."""
    if is_s3(prefix_uri):
        bucket, prefix = _s3_folder(prefix_uri)
        if not prefix:
            raise StorageError(f"refusing to delete every object in bucket '{bucket}' ({prefix_uri})")

        def _delete_all(client: Any) -> None:
            batch: list[dict[str, str]] = []

            def _flush() -> None:
                response = client.delete_objects(
                    Bucket=bucket, Delete={"Objects": batch, "Quiet": True}
                )
                errors = response.get("Errors") or []
                if errors:
                    first = errors[0]
                    raise StorageError(
                        f"could not delete {len(errors)} object(s) below {prefix_uri} at "
                        f"{_endpoint(client)}, e.g. {first.get('Key')}: {first.get('Code')}: "
                        f"{_one_line(first.get('Message', ''))}"
                    )
                batch.clear()

            for key in _iter_s3_keys(client, bucket, prefix, include_markers=True):
                batch.append({"Key": key})
                if len(batch) >= _DELETE_BATCH:
                    _flush()
            if batch:
                _flush()

        _s3_call(prefix_uri, "deleting", _delete_all)
        return
    root = _local_path(prefix_uri)
    resolved = root.resolve()
    if resolved == Path(resolved.anchor):
        raise StorageError(f"refusing to delete everything below the filesystem root ({prefix_uri})")

    def remove() -> None:
        if root.is_symlink():
            root.unlink()  # rmtree refuses links; the link is what lives below the parent
        elif root.is_dir():
            shutil.rmtree(root)

    _local_call(prefix_uri, root, "deleting", remove)


# --------------------------------------------------------------------------------------------------
# Large files


def _s3_upload(source: str | bytes, uri: str, config: TransferConfig) -> None:
    """Managed upload (a local file, or bytes); on failure s3transfer aborts the multipart upload so no
    part becomes visible, and a transient failure starts the upload again, whole.

    The abort is best effort: if the server is gone it cannot be told, but an uncompleted multipart
    upload is never readable as an object, so readers still see either the old object or nothing.
    """
    from s3transfer.manager import TransferManager  # boto3 dependency; imported late, used rarely

    bucket, key = _s3_object(uri)

    def _run(client: Any) -> None:
        with TransferManager(client, config) as manager:
            body = source if isinstance(source, str) else io.BytesIO(source)  # a fresh stream per attempt
            manager.upload(body, bucket, key).result()

    _s3_call(uri, "writing", _run)


def write_file_from(
    local_path: str | os.PathLike[str], uri: str, *, transfer_config: TransferConfig | None = None
) -> None:
    """Copy a (possibly huge) local file to ``uri`` atomically, streaming rather than loading it."""
    source = Path(local_path)
    if not source.is_file():
        raise StorageNotFound(f"no such local file {source} to copy to {uri}")
    if is_s3(uri):
        _s3_upload(str(source), uri, transfer_config or TRANSFER_CONFIG)
        _count("s3_written_bytes", source.stat().st_size)
        return
    target = _local_path(uri)

    def _copy(handle: IO[bytes]) -> None:
        with source.open("rb") as src:
            shutil.copyfileobj(src, handle, length=4 * MiB)

    try:
        _retrying(uri, "writing", lambda: _atomic_local_write(target, _copy))
    except StorageNotFound as exc:
        raise StorageNotFound(f"no such local file {source} to copy to {uri}") from exc


def download_to(
    uri: str, local_path: str | os.PathLike[str], *, transfer_config: TransferConfig | None = None
) -> None:
    """Fetch ``uri`` into ``local_path`` atomically: an interrupted download leaves no partial file."""
    target = Path(local_path)
    if not is_s3(uri):
        source = _local_path(uri)

        def _copy_local(handle: IO[bytes]) -> None:
            try:
                src = source.open("rb")
            except OSError as exc:
                raise _local_error(exc, source, "reading") from exc
            with src:
                shutil.copyfileobj(src, handle, length=4 * MiB)

        _retrying(uri, "reading", lambda: _atomic_local_write(target, _copy_local))
        return

    from s3transfer.manager import TransferManager

    bucket, key = _s3_object(uri)
    config = transfer_config or TRANSFER_CONFIG

    def _fetch(handle: IO[bytes]) -> None:
        client = _client()
        try:
            with TransferManager(client, config) as manager:
                manager.download(bucket, key, handle).result()
        except Exception as exc:  # noqa: BLE001
            if _is_not_found(exc):
                raise _missing_object(client, bucket, uri) from exc
            raise _translate(exc, client, uri, "downloading") from exc

    _retrying(uri, "downloading", lambda: _atomic_local_write(target, _fetch))
    _count("s3_read_bytes", target.stat().st_size, 1)


# --------------------------------------------------------------------------------------------------
# Ranges and streams


def read_range(uri: str, start: int, length: int) -> bytes:
    """``length`` bytes of a file/object from offset ``start`` (one ranged GET on S3): what a reader
    needs of a large file without fetching the rest. Fewer bytes than asked is an error (a truncated
    or replaced file)."""
    if start < 0 or length < 0:
        raise ValueError(f"read_range({uri!r}, {start}, {length}): negative offset or length")
    if length == 0:
        return b""
    if is_s3(uri):
        bucket, key = _s3_object(uri)
        rng = f"bytes={start}-{start + length - 1}"
        data = _s3_call(uri, "reading",
                        lambda c: c.get_object(Bucket=bucket, Key=key, Range=rng)["Body"].read())
        _count("s3_read_bytes", len(data), 1)
    else:
        path = _local_path(uri)

        def read_local() -> bytes:
            with path.open("rb") as handle:
                handle.seek(start)
                return handle.read(length)

        data = _local_call(uri, path, "reading", read_local)
    if len(data) != length:
        raise CorruptObject(f"{uri}: asked for {length} bytes at offset {start}, got {len(data)} "
                            "(the file is shorter than its index says: truncated or replaced)")
    return data


class AtomicWriter:
    """A write-only stream onto ``uri`` that appears whole or not at all: locally a temp file beside the
    target, fsynced and renamed into place; on S3 one PUT when small, else a multipart upload of
    ``part_bytes`` parts sent as the data comes (only one part is ever buffered), completed at the end.
    :meth:`close` (or leaving the ``with`` block normally) publishes it; an exception in the block, or
    :meth:`abort`, leaves nothing (the multipart upload is aborted, the temp file removed). Every piece
    (a part, a write at its offset of the temp file, the completion) is retried on its own through an
    outage, so a long stream does not start over. What passes through is hashed (:meth:`digest`): the
    whole stream, and each stretch between two :meth:`tell` calls on its own — a writer that asks for its
    position at the start and end of every record (torch's DCP does) gets one SHA-256 per record, against
    which a ranged read of that record can be checked."""

    def __init__(self, uri: str, part_bytes: int = 16 * MiB) -> None:
        if part_bytes < 5 * MiB:
            raise ValueError("part_bytes must be at least 5 MiB (the S3 minimum part size)")
        self.uri = uri
        self._part_bytes = part_bytes
        self._pos = 0
        self._done = False
        self._whole, self._piece, self._cut_at = hashlib.sha256(), hashlib.sha256(), 0
        self._segments: list[list[Any]] = []
        self._s3 = is_s3(uri)
        if self._s3:
            self._bucket, self._key = _s3_object(uri)
            self._buf = bytearray()
            self._upload_id: str | None = None
            self._parts: list[dict[str, Any]] = []
        else:
            self._path = _local_path(uri)

            def create() -> tuple[int, str]:
                self._path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=f".{self._path.name}.", suffix=_TMP_SUFFIX, dir=self._path.parent)
                os.fchmod(fd, _file_mode())
                return fd, tmp

            self._fd, tmp = _local_call(uri, self._path, "writing", create)
            self._tmp = Path(tmp)

    # -- the file-like surface torch.save and pickle use
    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return self._done

    def tell(self) -> int:
        self._cut()
        return self._pos

    def _cut(self) -> None:
        if self._pos > self._cut_at:
            self._segments.append([self._cut_at, self._piece.hexdigest()])
            self._piece, self._cut_at = hashlib.sha256(), self._pos

    def digest(self) -> dict[str, Any]:
        """:func:`digest` of everything written, with ``segments``: ``[offset, sha256]`` of each stretch
        between two :meth:`tell` calls (and the last one before now)."""
        self._cut()
        return {"bytes": self._pos, "sha256": self._whole.hexdigest(), "segments": list(self._segments)}

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        raise io.UnsupportedOperation("AtomicWriter has no file descriptor")

    def write(self, data: Any) -> int:
        if self._done:
            raise ValueError(f"write to {self.uri} after it was closed")
        view = memoryview(data).cast("B")
        n = view.nbytes
        self._whole.update(view)
        self._piece.update(view)
        if self._s3:
            self._buf += view
            while len(self._buf) >= self._part_bytes:
                chunk = bytes(self._buf[:self._part_bytes])
                del self._buf[:self._part_bytes]
                self._send_part(chunk)
        else:
            offset = self._pos

            def put() -> None:  # at its offset, so a retry after a failed write rewrites exactly these bytes
                done = 0
                while done < n:
                    done += os.pwrite(self._fd, view[done:], offset + done)

            try:
                _local_call(self.uri, self._path, "writing", put)
            except BaseException:
                self.abort()
                raise
        self._pos += n
        return n

    def _send_part(self, chunk: bytes) -> None:
        uri, bucket, key = self.uri, self._bucket, self._key
        try:
            if self._upload_id is None:
                self._upload_id = _s3_call(uri, "writing", lambda c: c.create_multipart_upload(
                    Bucket=bucket, Key=key)["UploadId"])
            number = len(self._parts) + 1
            etag = _s3_call(uri, "writing", lambda c: c.upload_part(
                Bucket=bucket, Key=key, UploadId=self._upload_id, PartNumber=number, Body=chunk)["ETag"])
        except BaseException:
            self.abort()
            raise
        self._parts.append({"PartNumber": number, "ETag": etag})
        _count("s3_written_bytes", len(chunk))

    def close(self) -> None:
        """Publish what was written (idempotent)."""
        if self._done:
            return
        if not self._s3:
            def publish() -> None:
                os.fsync(self._fd)
                os.replace(self._tmp, self._path)

            try:
                _local_call(self.uri, self._path, "writing", publish)
            except BaseException:
                self.abort()
                raise
            self._done = True
            os.close(self._fd)
            _fsync_dir(self._path.parent)
            return
        uri, bucket, key = self.uri, self._bucket, self._key
        if self._upload_id is None:
            body = bytes(self._buf)
            _s3_call(uri, "writing", lambda c: c.put_object(Bucket=bucket, Key=key, Body=body))
            _count("s3_written_bytes", len(body))
        else:
            if self._buf:  # the last part may be smaller than the minimum
                self._send_part(bytes(self._buf))
            parts, size, tries = list(self._parts), self._pos, [0]

            def complete(client: Any) -> None:
                tries[0] += 1
                try:
                    client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=self._upload_id,
                                                     MultipartUpload={"Parts": parts})
                except Exception as exc:  # noqa: BLE001
                    # a retry after a completion whose answer was lost finds no upload: the object is there
                    if tries[0] > 1 and _error_code(exc) == "NoSuchUpload" and \
                            client.head_object(Bucket=bucket, Key=key).get("ContentLength") == size:
                        return
                    raise

            try:
                _s3_call(uri, "writing", complete)
            except BaseException:
                self.abort()
                raise
        self._buf = bytearray()
        self._done = True

    def abort(self) -> None:
        """Drop everything written so far; nothing appears at ``uri`` (idempotent)."""
        if self._done:
            return
        self._done = True
        if not self._s3:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._tmp.unlink(missing_ok=True)
            return
        self._buf = bytearray()
        if self._upload_id is not None:
            upload_id, bucket, key = self._upload_id, self._bucket, self._key
            try:  # best effort: an uncompleted multipart upload never becomes an object anyway
                _client().abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
            except Exception:  # noqa: BLE001
                pass

    def __enter__(self) -> AtomicWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def open_write(uri: str, *, part_bytes: int = 16 * MiB) -> AtomicWriter:
    """A stream that writes ``uri`` as it goes and publishes it whole on ``close`` (see
    :class:`AtomicWriter`): for files larger than memory that are produced piece by piece, without a
    local staging copy."""
    return AtomicWriter(uri, part_bytes)
