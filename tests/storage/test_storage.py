"""sapd.storage against local folders and a real S3 server (SeaweedFS, see conftest.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import botocore.exceptions as bce
import pytest
from boto3.s3.transfer import TransferConfig

from sapd import storage
from sapd.storage import CorruptObject, PreconditionFailed, StorageError, StorageNotFound, StorageUnavailable

MiB = 1024 * 1024
REPO_ROOT = Path(__file__).resolve().parents[2]

# s3transfer never goes below 5 MiB parts (the S3 minimum), so this is as small as multipart gets.
SMALL_PARTS = TransferConfig(
    multipart_threshold=5 * MiB,
    multipart_chunksize=5 * MiB,
    max_concurrency=2,
    preferred_transfer_client="classic",
)


@pytest.fixture(params=["local", "file-uri", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The same assertions run on a plain path, a file:// URI and an S3 prefix."""
    if request.param == "local":
        return str(tmp_path / "root")
    if request.param == "file-uri":
        return "file://" + str(tmp_path / "root")
    return request.getfixturevalue("s3_storage")


@pytest.fixture
def s3_config_guard() -> Iterator[None]:
    """Restore sapd.storage's S3 settings after a test that sets its own (without starting a server)."""
    previous = storage.configure_s3()
    storage.configure_s3(**dataclasses.asdict(previous))
    try:
        yield
    finally:
        storage.configure_s3(**dataclasses.asdict(previous))


def _hook(event: str, handler: Any) -> Any:
    """Register a botocore event handler on sapd.storage's current client; returns an unregister."""
    client = storage._client()
    client.meta.events.register(event, handler)
    return lambda: client.meta.events.unregister(event, handler)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------------------------------
# Pure functions


@pytest.mark.parametrize(
    ("base", "parts", "expected"),
    [
        ("s3://b/run", ("prefixes", "x"), "s3://b/run/prefixes/x"),
        ("s3://b/run/", ("/prefixes/", "/x"), "s3://b/run/prefixes/x"),
        ("s3://b", ("a//b", "c"), "s3://b/a/b/c"),
        ("s3://b/", ("k",), "s3://b/k"),
        ("/tmp/run", ("a", "b.json"), "/tmp/run/a/b.json"),
        ("/tmp/run/", ("/abs",), "/tmp/run/abs"),  # an absolute part never escapes the base
        ("/", ("etc",), "/etc"),
        ("file:///data/run", ("x",), "file:///data/run/x"),
        ("file:///", ("x",), "file:///x"),
        ("rel", ("x", "", "y"), "rel/x/y"),
        ("s3://b/run", (), "s3://b/run"),
    ],
)
def test_join(base: str, parts: tuple[str, ...], expected: str) -> None:
    assert storage.join(base, *parts) == expected


def test_is_s3() -> None:
    assert storage.is_s3("s3://bucket/key")
    assert storage.is_s3("S3://bucket")
    assert not storage.is_s3("/tmp/s3://x")
    assert not storage.is_s3("file:///tmp/x")
    assert not storage.is_s3("s3bucket/key")


def test_s3_uri_without_bucket_or_key_is_rejected() -> None:
    with pytest.raises(StorageError, match="names no bucket"):
        storage.read_bytes("s3:///key")
    with pytest.raises(StorageError, match="folder, not an object"):
        storage.write_bytes("s3://bucket/dir/", b"x")


# --------------------------------------------------------------------------------------------------
# Same behaviour on every backend


def test_bytes_roundtrip_and_overwrite(root: str) -> None:
    uri = storage.join(root, "deep", "er", "blob.bin")
    payload = bytes(range(256)) * 10
    storage.write_bytes(uri, payload)
    assert storage.read_bytes(uri) == payload
    storage.write_bytes(uri, b"second")
    assert storage.read_bytes(uri) == b"second"


def test_empty_object_roundtrip(root: str) -> None:
    uri = storage.join(root, "empty")
    storage.write_bytes(uri, b"")
    assert storage.exists(uri)
    assert storage.read_bytes(uri) == b""


def test_text_and_json_roundtrip(root: str) -> None:
    text_uri = storage.join(root, "notes.txt")
    storage.write_text(text_uri, "héllo ✓\n")
    assert storage.read_text(text_uri) == "héllo ✓\n"

    obj = {"b": [1, 2, {"z": None}], "a": "x", "n": 1.5}
    json_uri = storage.join(root, "cfg", "run.json")
    storage.write_json(json_uri, obj)
    assert storage.read_json(json_uri) == obj
    # Stable formatting is part of the contract: reruns must produce identical bytes.
    assert storage.read_bytes(json_uri) == (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    assert storage.read_text(json_uri).startswith('{\n  "a": "x",')


def test_invalid_json_is_a_storage_error(root: str) -> None:
    uri = storage.join(root, "bad.json")
    storage.write_text(uri, "{not json")
    with pytest.raises(StorageError, match="not valid JSON") as info:
        storage.read_json(uri)
    assert uri in str(info.value)


def test_exists_and_delete(root: str) -> None:
    uri = storage.join(root, "sub", "file.txt")
    assert not storage.exists(uri)
    storage.write_text(uri, "x")
    assert storage.exists(uri)
    assert not storage.exists(storage.join(root, "sub", "fil"))  # a key prefix is not an object
    storage.delete(uri)
    assert not storage.exists(uri)
    storage.delete(uri)  # deleting a missing file is not an error


def test_missing_key_raises_not_found(root: str, tmp_path: Path) -> None:
    uri = storage.join(root, "nope", "missing.bin")
    with pytest.raises(StorageNotFound) as info:
        storage.read_bytes(uri)
    assert "missing.bin" in str(info.value)
    assert "\n" not in str(info.value)
    with pytest.raises(StorageNotFound):
        storage.read_json(uri)

    target = tmp_path / "dl" / "target.bin"
    with pytest.raises(StorageNotFound):
        storage.download_to(uri, target)
    assert not target.exists()
    assert os.listdir(target.parent) == []  # no temp file left behind


def test_list_files_is_recursive_sorted_and_folder_scoped(root: str) -> None:
    names = ["b.txt", "a/z.txt", "a/b/c.txt", "a.txt", "0"]
    for name in reversed(names):
        storage.write_text(storage.join(root, "run1", name), name)
    storage.write_text(storage.join(root, "run10", "other.txt"), "sibling with a shared name prefix")
    storage.write_text(storage.join(root, "run1.txt"), "sibling file")

    listed = storage.list_files(storage.join(root, "run1"))
    expected = sorted(storage.join(root, "run1", n) for n in names)
    assert listed == expected
    assert listed == sorted(listed)
    assert storage.list_files(storage.join(root, "run1") + "/") == expected  # trailing slash is the same
    assert [storage.read_text(u) for u in listed] == [u.split("/run1/", 1)[1] for u in listed]
    assert storage.list_files(storage.join(root, "nothing-here")) == []


def test_delete_prefix_removes_everything_below_only(root: str) -> None:
    for name in ["x/1", "x/2", "x/deep/3", "x/deep/er/4"]:
        storage.write_text(storage.join(root, name), name)
    keep = storage.join(root, "x2", "keep")
    storage.write_text(keep, "keep")
    storage.delete_prefix(storage.join(root, "x"))
    assert storage.list_files(storage.join(root, "x")) == []
    assert not storage.exists(storage.join(root, "x", "deep", "3"))
    assert storage.list_files(root) == [keep]
    storage.delete_prefix(storage.join(root, "x"))  # already gone: no error


def test_large_file_roundtrip_via_transfer(root: str, tmp_path: Path) -> None:
    source = tmp_path / "ckpt.bin"
    source.write_bytes(os.urandom(11 * MiB + 123))
    uri = storage.join(root, "ckpt", "model.bin")
    storage.write_file_from(source, uri, transfer_config=SMALL_PARTS)
    target = tmp_path / "back" / "model.bin"
    storage.download_to(uri, target, transfer_config=SMALL_PARTS)
    assert _sha(target) == _sha(source)
    assert [p.name for p in target.parent.iterdir()] == ["model.bin"]  # no temp file left


def test_write_file_from_missing_source(root: str, tmp_path: Path) -> None:
    uri = storage.join(root, "never")
    with pytest.raises(StorageNotFound, match="no such local file"):
        storage.write_file_from(tmp_path / "absent.bin", uri)
    assert not storage.exists(uri)


# --------------------------------------------------------------------------------------------------
# Local atomicity


def test_local_write_failing_midway_leaves_old_file_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, retries: Any
) -> None:
    target = tmp_path / "state" / "ckpt.json"
    storage.write_json(str(target), {"step": 1})
    before = target.read_bytes()
    seen_partial: list[int] = []
    real_fsync = os.fsync

    def crashing_fsync(fd: int) -> None:
        # The new bytes are in the temp file by now, but the target must still hold the old ones.
        temps = [p for p in target.parent.iterdir() if p.name.endswith(".sapd-tmp")]
        assert len(temps) == 1
        seen_partial.append(temps[0].stat().st_size)
        assert target.read_bytes() == before
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(os, "fsync", crashing_fsync)
    with pytest.raises(StorageError, match="No space left") as info:
        storage.write_bytes(str(target), b"x" * 100_000)
    monkeypatch.setattr(os, "fsync", real_fsync)

    assert seen_partial == [100_000]
    assert str(target) in str(info.value)
    assert target.read_bytes() == before
    assert sorted(p.name for p in target.parent.iterdir()) == ["ckpt.json"]

    fresh = tmp_path / "state" / "new.bin"
    monkeypatch.setattr(os, "fsync", _raise_oserror)
    retries(1.0, log=lambda line: None)  # EIO is what a network file system answers while away: retried
    with pytest.raises(StorageUnavailable, match="still failing after"):
        storage.write_bytes(str(fresh), b"y" * 10)
    assert not fresh.exists()
    assert sorted(p.name for p in target.parent.iterdir()) == ["ckpt.json"]


def _raise_oserror(fd: int) -> None:
    raise OSError(5, "Input/output error (simulated)")


def test_local_write_interrupted_by_exception_in_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy that dies after part of a big file leaves neither a partial target nor a temp file."""
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(3 * MiB))
    target = tmp_path / "out" / "big.bin"
    real_copy = storage.shutil.copyfileobj

    def copy_half_then_fail(src: Any, dst: Any, length: int = 0) -> None:
        dst.write(src.read(MiB))
        raise KeyboardInterrupt  # even a non-Exception interruption must clean up

    monkeypatch.setattr(storage.shutil, "copyfileobj", copy_half_then_fail)
    with pytest.raises(KeyboardInterrupt):
        storage.write_file_from(source, str(target))
    monkeypatch.setattr(storage.shutil, "copyfileobj", real_copy)
    assert not target.exists()
    assert list(target.parent.iterdir()) == []


def test_local_write_killed_process_keeps_old_file(tmp_path: Path) -> None:
    """A real SIGKILL between writing and renaming: the old file survives, listings hide the debris."""
    target = tmp_path / "run" / "state.json"
    storage.write_json(str(target), {"step": 1})
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(REPO_ROOT)!r})
        from sapd import storage
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        os.replace = die
        storage.write_json({str(target)!r}, {{"step": 2, "pad": "x" * 100000}})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()
    assert json.loads(target.read_text()) == {"step": 1}
    leftovers = [p for p in target.parent.iterdir() if p.name != "state.json"]
    assert len(leftovers) == 1 and leftovers[0].stat().st_size > 100_000  # the crash left its temp file
    assert storage.list_files(str(tmp_path / "run")) == [str(target)]


def test_delete_prefix_refuses_roots(s3_config_guard: None) -> None:
    with pytest.raises(StorageError, match="refusing"):
        storage.delete_prefix("/")
    with pytest.raises(StorageError, match="refusing"):
        storage.delete_prefix("s3://some-bucket")
    with pytest.raises(StorageError, match="refusing"):
        storage.delete_prefix("s3://some-bucket/")


# --------------------------------------------------------------------------------------------------
# S3 specifics


def test_list_files_paginates(s3_storage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    uris = [storage.join(s3_storage, "p", f"{i:02d}.txt") for i in range(10)]
    for uri in uris:
        storage.write_text(uri, "x")
    pages: list[int] = []
    unhook = _hook("after-call.s3.ListObjectsV2", lambda parsed, **kw: pages.append(parsed.get("KeyCount", 0)))
    monkeypatch.setattr(storage, "_LIST_PAGE_SIZE", 3)
    try:
        assert storage.list_files(storage.join(s3_storage, "p")) == uris
    finally:
        unhook()
    assert pages == [3, 3, 3, 1]


@pytest.mark.slow
def test_more_than_1000_keys_list_and_delete(s3_storage: str) -> None:
    """Real pagination (S3 caps a page at 1000) and DeleteObjects batching (1000 per request)."""
    uris = [storage.join(s3_storage, "many", f"{i:05d}") for i in range(1003)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda u: storage.write_bytes(u, b"."), uris))
    assert storage.list_files(storage.join(s3_storage, "many")) == uris
    storage.delete_prefix(storage.join(s3_storage, "many"))
    assert storage.list_files(storage.join(s3_storage, "many")) == []


def test_multipart_upload_is_used_for_large_files(s3_storage: str, tmp_path: Path) -> None:
    parts: list[int] = []
    unhook = _hook("after-call.s3.UploadPart", lambda **kw: parts.append(1))
    try:
        storage.write_bytes(storage.join(s3_storage, "big"), os.urandom(12 * MiB), transfer_config=SMALL_PARTS)
        storage.write_bytes(storage.join(s3_storage, "small"), b"tiny", transfer_config=SMALL_PARTS)
    finally:
        unhook()
    assert len(parts) == 3  # 12 MiB in 5 MiB parts; the small write was a single PUT
    assert len(storage.read_bytes(storage.join(s3_storage, "big"))) == 12 * MiB


def test_failed_multipart_upload_is_aborted(s3_server: Any, s3_storage: str, tmp_path: Path, retries: Any) -> None:
    """A part that keeps failing past the retry deadline: the upload is aborted, nothing appears."""
    retries(1.0, log=lambda line: None)
    source = tmp_path / "ckpt.bin"
    source.write_bytes(os.urandom(16 * MiB))
    uri = storage.join(s3_storage, "ckpt.bin")
    bucket, key = uri[5:].split("/", 1)
    calls: list[int] = []

    def fail_second_part(**kwargs: Any) -> None:
        calls.append(1)
        if str(kwargs["params"]["query_string"].get("partNumber")) == "2":  # every attempt of part 2
            raise bce.EndpointConnectionError(endpoint_url=s3_server.endpoint_url)

    unhook = _hook("before-call.s3.UploadPart", fail_second_part)
    try:
        with pytest.raises(StorageError, match="unreachable") as info:
            storage.write_file_from(source, uri, transfer_config=SMALL_PARTS)
    finally:
        unhook()
    assert uri in str(info.value)
    assert not storage.exists(uri)
    pending = s3_server.server.client().list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads", [])
    assert pending == []  # the upload was aborted, not left to accumulate parts


def test_download_failure_keeps_existing_local_file(s3_storage: str, tmp_path: Path) -> None:
    target = tmp_path / "model.bin"
    target.write_bytes(b"previous good checkpoint")
    with pytest.raises(StorageNotFound):
        storage.download_to(storage.join(s3_storage, "absent.bin"), target)
    assert target.read_bytes() == b"previous good checkpoint"
    assert [p.name for p in tmp_path.iterdir()] == ["model.bin"]


@pytest.mark.parametrize("wrong", ["secret", "key-id"])
@pytest.mark.parametrize("op", ["write", "read", "exists", "list"])
def test_wrong_credentials(s3_server: Any, s3_storage: str, wrong: str, op: str) -> None:
    uri = storage.join(s3_storage, "file.txt")
    storage.write_text(uri, "x")
    bad_secret = "definitely-wrong-secret"
    key_id = s3_server.access_key if wrong == "secret" else "NO-SUCH-KEY-ID"
    storage.configure_s3(s3_server.endpoint_url, key_id, bad_secret if wrong == "secret" else s3_server.secret_key)
    calls = {
        "write": lambda: storage.write_text(uri, "y"),
        "read": lambda: storage.read_bytes(uri),
        "exists": lambda: storage.exists(uri),
        "list": lambda: storage.list_files(s3_storage),
    }
    with pytest.raises(StorageError) as info:
        calls[op]()
    message = str(info.value)
    assert not isinstance(info.value, StorageNotFound)
    assert "credentials rejected" in message
    assert s3_server.endpoint_url in message
    assert f"access key id {key_id}" in message
    assert s3_server.secret_key not in message and bad_secret not in message
    assert "\n" not in message


@pytest.mark.parametrize("op", ["write", "write_file", "read", "exists", "list", "download"])
def test_missing_bucket(s3_server: Any, s3_storage: str, tmp_path: Path, op: str) -> None:
    bucket = f"sapd-absent-{uuid.uuid4().hex[:8]}"
    uri = f"s3://{bucket}/run/file.bin"
    local = tmp_path / "f.bin"
    local.write_bytes(b"data")
    calls = {
        "write": lambda: storage.write_bytes(uri, b"x"),
        "write_file": lambda: storage.write_file_from(local, uri),
        "read": lambda: storage.read_bytes(uri),
        "exists": lambda: storage.exists(uri),
        "list": lambda: storage.list_files(f"s3://{bucket}/run"),
        "download": lambda: storage.download_to(uri, tmp_path / "out.bin"),
    }
    with pytest.raises(StorageError) as info:
        calls[op]()
    assert not isinstance(info.value, StorageNotFound)
    assert f"bucket '{bucket}' does not exist at {s3_server.endpoint_url}" in str(info.value)
    # The write did not create the bucket behind our back.
    names = [b["Name"] for b in s3_server.server.client().list_buckets().get("Buckets", [])]
    assert bucket not in names


def test_unreachable_server(s3_config_guard: None, retries: Any) -> None:
    """Nothing listens: every attempt is refused, retried with backoff until the deadline (one "retrying
    until" line meanwhile), then StorageUnavailable (exit 75) naming the endpoint and the object."""
    lines: list[str] = []
    retries(3.0, log=lines.append)
    from tests.conftest import free_port
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there (nor will: not an ephemeral port)
    storage.configure_s3(endpoint, "id", "secret")
    started = time.monotonic()
    with pytest.raises(StorageUnavailable, match="unreachable") as info:
        storage.write_bytes("s3://bucket/key", b"x")
    assert 3.0 <= time.monotonic() - started < 30
    assert endpoint in str(info.value) and "s3://bucket/key" in str(info.value)
    assert "still failing after 3 s of retries" in str(info.value) and "\n" not in str(info.value)
    assert len(lines) == 1 and lines[0].startswith("S3 unreachable: retrying until ") and " UTC (" in lines[0]
    with pytest.raises(StorageError, match="unreachable"):
        storage.exists("s3://bucket/key")


def test_configure_s3_falls_back_to_environment(
    s3_server: Any, s3_config_guard: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage.configure_s3()
    monkeypatch.setenv("SAPD_S3_ENDPOINT_URL", s3_server.endpoint_url)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # SAPD_ variable wins
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    uri = f"s3://{s3_server.bucket}/env-{uuid.uuid4().hex[:8]}/x"
    storage.write_text(uri, "via env")
    assert storage.read_text(uri) == "via env"
    assert storage._client() is storage._client()  # one cached client per configuration
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "changed")
    with pytest.raises(StorageError, match="credentials rejected"):
        storage.read_text(uri)  # a changed environment is a new configuration, not a stale client


# --------------------------------------------------------------------------------------------------
# The server dies in the middle of a multipart upload


@pytest.mark.integration
def test_server_killed_mid_multipart_upload_leaves_no_object(
    private_s3_server: Any, s3_config_guard: None, tmp_path: Path, retries: Any
) -> None:
    """The server dies for longer than the retry deadline: the upload fails, and nothing of it is readable."""
    retries(3.0, log=lambda line: None)
    server = private_s3_server
    bucket = "sapd-kill-test"
    server.client().create_bucket(Bucket=bucket)
    server.wait_writable(bucket)
    storage.configure_s3(server.endpoint_url, server.access_key, server.secret_key)

    source = tmp_path / "ckpt.bin"
    source.write_bytes(os.urandom(30 * MiB))
    uri = f"s3://{bucket}/ckpt/model.bin"
    config = TransferConfig(
        multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=1,
        preferred_transfer_client="classic",
    )
    # Only synchronisation, no fault injection: hold the 3rd part (of 6) until the server is dead,
    # so the kill lands mid-upload every time instead of racing a fast localhost transfer.
    parts: list[int] = []
    third_part_ready = threading.Event()
    server_killed = threading.Event()

    def hold_third_part(**kwargs: Any) -> None:
        parts.append(1)
        if len(parts) == 3:
            third_part_ready.set()
            server_killed.wait(30)

    unhook = _hook("before-call.s3.UploadPart", hold_third_part)
    outcome: dict[str, BaseException | None] = {}

    def upload() -> None:
        try:
            storage.write_file_from(source, uri, transfer_config=config)
            outcome["error"] = None
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            outcome["error"] = exc

    thread = threading.Thread(target=upload, daemon=True)
    thread.start()
    try:
        assert third_part_ready.wait(30), "upload never reached its third part"
        server.kill()
        killed_at = time.monotonic()
        server_killed.set()
        thread.join(60)
        took = time.monotonic() - killed_at
    finally:
        server_killed.set()
        unhook()
    assert not thread.is_alive(), "upload still hanging 60 s after the server died"
    error = outcome["error"]
    assert isinstance(error, StorageError), f"expected StorageError, got {error!r}"
    assert "unreachable" in str(error) and uri in str(error) and server.endpoint_url in str(error)
    assert took < 45
    assert len(parts) == 3  # parts 1-2 reached the server, 3 did not; nothing was completed

    # Same data dir, same ports: whatever the dead server persisted must not be a readable object.
    server.start()
    assert not storage.exists(uri)
    with pytest.raises(StorageNotFound):
        storage.read_bytes(uri)
    assert storage.list_files(f"s3://{bucket}/ckpt") == []
    # ...and the key is usable again.
    storage.write_file_from(source, uri, transfer_config=config)
    back = tmp_path / "back.bin"
    storage.download_to(uri, back)
    assert _sha(back) == _sha(source)


# --------------------------------------------------------------------------------------------------
# Riding out outages: transient failures retried with backoff up to the deadline, the others at once


def _client_error(code: str, status: int, operation: str) -> bce.ClientError:
    return bce.ClientError({"Error": {"Code": code, "Message": "injected"},
                            "ResponseMetadata": {"HTTPStatusCode": status}}, operation)


@pytest.mark.parametrize(("code", "status", "transient"), [
    ("SlowDown", 503, True), ("InternalError", 500, True), ("ServiceUnavailable", 503, True),
    ("RequestTimeout", 400, True), ("TooManyRequests", 429, True),
    ("AccessDenied", 403, False), ("InvalidArgument", 400, False),
])
def test_which_s3_answers_are_retried(s3_storage: str, retries: Any, code: str, status: int, transient: bool) -> None:
    """As botocore's standard retry mode: 5xx, throttling and request timeouts are transient; another 4xx
    fails at once (one attempt, the server's code in the message)."""
    lines: list[str] = []
    retries(30.0, log=lines.append)
    uri = storage.join(s3_storage, f"answer-{code}")
    calls: list[int] = []

    def first_attempt_fails(**kwargs: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise _client_error(code, status, "PutObject")

    unhook = _hook("before-call.s3.PutObject", first_attempt_fails)
    try:
        if transient:
            storage.write_text(uri, "landed")
        else:
            with pytest.raises(StorageError, match=code) as info:
                storage.write_text(uri, "landed")
            assert not isinstance(info.value, StorageUnavailable)
    finally:
        unhook()
    if transient:
        assert len(calls) == 2 and storage.read_text(uri) == "landed"
        assert len(lines) == 2 and code in lines[0] and lines[1].startswith("S3 reachable again after ")
    else:
        assert len(calls) == 1 and lines == [] and not storage.exists(uri)


def test_a_part_that_fails_once_is_sent_again_alone(s3_server: Any, s3_storage: str, retries: Any) -> None:
    """A streamed multipart upload retries the part that failed, not the upload: 3 parts, 4 UploadParts."""
    retries(30.0, log=lambda line: None)
    uri = storage.join(s3_storage, "streamed.bin")
    data = os.urandom(12 * MiB)
    sent: list[str] = []

    def part_2_fails_once(**kwargs: Any) -> None:
        number = str(kwargs["params"]["query_string"].get("partNumber"))
        sent.append(number)
        if number == "2" and sent.count("2") == 1:
            raise bce.ConnectionClosedError(endpoint_url=s3_server.endpoint_url)

    unhook = _hook("before-call.s3.UploadPart", part_2_fails_once)
    try:
        with storage.open_write(uri, part_bytes=5 * MiB) as out:
            out.write(data)
    finally:
        unhook()
    assert sent == ["1", "2", "2", "3"]
    assert storage.read_bytes(uri) == data


def test_a_transient_failure_of_a_managed_upload_starts_it_again(s3_server: Any, s3_storage: str, tmp_path: Path,
                                                                  retries: Any) -> None:
    retries(30.0, log=lambda line: None)
    source = tmp_path / "ckpt.bin"
    source.write_bytes(os.urandom(12 * MiB))
    uri = storage.join(s3_storage, "managed.bin")
    failed: list[int] = []

    def one_part_fails_once(**kwargs: Any) -> None:
        if not failed:
            failed.append(1)
            raise bce.EndpointConnectionError(endpoint_url=s3_server.endpoint_url)

    unhook = _hook("before-call.s3.UploadPart", one_part_fails_once)
    try:
        storage.write_file_from(source, uri, transfer_config=SMALL_PARTS)
    finally:
        unhook()
    back = tmp_path / "back.bin"
    storage.download_to(uri, back)
    assert failed == [1] and _sha(back) == _sha(source)


@pytest.mark.parametrize("where", ["replace", "pwrite", "read"])
def test_local_transient_errors_are_retried_and_others_are_not(tmp_path: Path, retries: Any,
                                                               monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """What a network file system answers while its server is away (ESTALE, EIO, ETIMEDOUT) is retried; a
    full disk (ENOSPC) is not."""
    import errno
    retries(30.0, log=lambda line: None)
    uri = str(tmp_path / "f.bin")
    storage.write_bytes(uri, b"old")
    faults: list[int] = []
    real = {"replace": os.replace, "pwrite": os.pwrite, "read": Path.read_bytes}[where]

    def flaky(*args: Any) -> Any:
        if faults:
            code = faults.pop(0)
            raise OSError(code, os.strerror(code))
        return real(*args)

    monkeypatch.setattr(*((Path, "read_bytes") if where == "read" else (os, where)), flaky)

    def act() -> None:
        if where == "read":
            assert storage.read_bytes(uri) == b"old"
        elif where == "pwrite":
            with storage.open_write(uri) as out:
                out.write(b"new")
        else:
            storage.write_bytes(uri, b"new")

    faults[:] = [errno.ESTALE, errno.EIO, errno.ETIMEDOUT]
    act()
    assert faults == []
    assert Path(uri).read_bytes() == (b"old" if where == "read" else b"new")
    faults[:] = [errno.ENOSPC]
    with pytest.raises(StorageError, match="No space left") as info:
        act()
    assert not isinstance(info.value, StorageUnavailable)
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]  # no temp file left behind


@pytest.mark.integration
def test_an_outage_is_ridden_out_by_streams_ranged_reads_listings_and_downloads(
    private_s3_server: Any, s3_config_guard: None, tmp_path: Path, retries: Any
) -> None:
    """The real server is stopped (SIGKILL, by PID) just before each kind of request and started again on
    the same data a few seconds later: every operation waits it out and ends as if nothing happened."""
    server = private_s3_server
    server.client().create_bucket(Bucket="sapd-outage")
    server.wait_writable("sapd-outage")
    storage.configure_s3(server.endpoint_url, server.access_key, server.secret_key)
    lines: list[str] = []
    retries(120.0, log=lines.append)

    restarts: list[threading.Thread] = []

    def outage() -> None:
        """Down now, up again (same data dir and ports) 2 s later, from another thread."""
        storage._outage["last_line"] = -float("inf")
        server.kill()

        def restart() -> None:
            time.sleep(2.0)
            server.start()

        restarts.append(threading.Thread(target=restart, daemon=True))
        restarts[-1].start()

    uri = "s3://sapd-outage/run/optimizer/__0_0.distcp"
    data = os.urandom(11 * MiB)
    killed: list[int] = []

    def down_before_part_2(**kwargs: Any) -> None:
        if str(kwargs["params"]["query_string"].get("partNumber")) == "2" and not killed:
            killed.append(1)
            outage()

    unhook = _hook("before-call.s3.UploadPart", down_before_part_2)
    try:
        with storage.open_write(uri, part_bytes=5 * MiB) as out:
            out.write(data)
    finally:
        unhook()
    assert killed == [1]

    def download() -> bool:
        storage.download_to(uri, tmp_path / "copy")
        return (tmp_path / "copy").read_bytes() == data

    for check in (lambda: storage.read_range(uri, 6 * MiB, 4096) == data[6 * MiB:6 * MiB + 4096],
                  lambda: storage.list_files("s3://sapd-outage/run") == [uri],
                  lambda: storage.exists(uri),
                  download):
        restarts[-1].join(90)  # the last restart is over …
        server.wait_writable("sapd-outage")  # … and the server takes writes again
        outage()
        assert check()
    restarts[-1].join(90)
    unreachable = [line for line in lines if line.startswith("S3 unreachable: retrying until ")]
    assert len(unreachable) == 5 and len([line for line in lines if "reachable again" in line]) == 5, lines
    assert server.client().list_multipart_uploads(Bucket="sapd-outage").get("Uploads", []) == []


# --------------------------------------------------------------------------------------------------
# Conditional writes (the lease's create-if-absent and replace-if-unchanged) and digests


def test_conditional_writes(root: str) -> None:
    uri = storage.join(root, "lease.json")
    assert storage.read_versioned(uri) is None
    first = storage.write_conditional(uri, b"one", if_absent=True)
    with pytest.raises(PreconditionFailed):
        storage.write_conditional(uri, b"two", if_absent=True)
    got = storage.read_versioned(uri)
    assert got is not None and got.data == b"one" and got.etag == first and 0 <= got.age_s < 30
    with pytest.raises(PreconditionFailed):
        storage.write_conditional(uri, b"three", if_match=first + "x")
    second = storage.write_conditional(uri, b"four", if_match=first)
    assert second != first and storage.read_bytes(uri) == b"four"
    with pytest.raises(PreconditionFailed):
        storage.delete_conditional(uri, first)
    storage.delete_conditional(uri, second)
    assert not storage.exists(uri)
    storage.delete_conditional(uri, second)  # gone already: nothing to do
    assert storage.list_files(root) == []  # the local lock file is not a file anyone wrote


def test_of_many_conditional_creates_at_once_exactly_one_lands(root: str) -> None:
    uri = storage.join(root, "race.json")
    barrier = threading.Barrier(6)

    def take(i: int) -> bool:
        barrier.wait()
        try:
            storage.write_conditional(uri, f"taker {i}".encode(), if_absent=True)
            return True
        except PreconditionFailed:
            return False

    with ThreadPoolExecutor(6) as pool:
        won = list(pool.map(take, range(6)))
    assert won.count(True) == 1
    assert storage.read_text(uri) == f"taker {won.index(True)}"


def test_check_digest_names_the_object(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"weights")
    good = storage.file_digest(f)
    assert good == storage.digest(b"weights")
    storage.check_digest("s3://b/run/model.safetensors", good, good, "s3://b/run/_COMMITTED")
    f.write_bytes(b"weightz")
    with pytest.raises(CorruptObject, match=r"^s3://b/run/model.safetensors: 7 bytes .* s3://b/run/_COMMITTED "
                                            r"recorded 7 bytes"):
        storage.check_digest("s3://b/run/model.safetensors", storage.file_digest(f), good, "s3://b/run/_COMMITTED")
    with pytest.raises(CorruptObject, match="not one of the files"):
        storage.check_digest("x", good, None, "m")


def test_a_stream_hashes_each_stretch_between_two_tells(root: str) -> None:
    """What DCP's writer does: tell() at the start and end of each record; the stream's digest has one
    SHA-256 per record, and the whole."""
    uri = storage.join(root, "records.bin")
    records = [b"a" * 10, b"", b"bc" * 7, os.urandom(1000)]
    with storage.open_write(uri) as out:
        for r in records:
            out.tell()
            out.write(r[:3])
            out.write(r[3:])
            out.tell()
    found = out.digest()
    data = b"".join(records)
    assert storage.read_bytes(uri) == data and (found["bytes"], found["sha256"]) == (len(data), _sha_bytes(data))
    offsets = [0, 10, 24]
    assert found["segments"] == [[o, _sha_bytes(r)] for o, r in zip(offsets, [records[0], records[2], records[3]])]


def _sha_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
