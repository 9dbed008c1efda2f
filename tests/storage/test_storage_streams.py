"""sapd.storage's streams and ranges (what sharded checkpoints write and read through), on a plain path, a
file:// URI and a real S3 server (SeaweedFS): a streamed file appears whole or not at all, a ranged read
returns exactly its bytes, and the S3 traffic counters count what crossed the wire."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sapd import storage
from sapd.storage import StorageError

MiB = 1024 * 1024


@pytest.fixture(params=["local", "file-uri", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "root")
    if request.param == "file-uri":
        return "file://" + str(tmp_path / "root")
    return request.getfixturevalue("s3_storage")


def _payload(n: int) -> bytes:
    return bytes((i * 7 + i // 251) % 256 for i in range(n))


def test_streamed_file_appears_whole_on_close(root):
    uri = storage.join(root, "deep", "shard.bin")
    data = _payload(11 * MiB + 123)  # over two 5 MiB parts on S3, the last one short
    with storage.open_write(uri, part_bytes=5 * MiB) as out:
        for i in range(0, len(data), 300_001):  # odd-sized writes straddle the part boundaries
            out.write(data[i:i + 300_001])
            assert out.tell() == min(i + 300_001, len(data))
        assert not storage.exists(uri)  # nothing published before close
    assert storage.read_bytes(uri) == data
    assert storage.list_files(storage.join(root, "deep")) == [uri]  # no temp file left beside it


def test_stream_that_fails_leaves_nothing(root, request):
    uri = storage.join(root, "broken.bin")
    with pytest.raises(RuntimeError, match="boom"):
        with storage.open_write(uri, part_bytes=5 * MiB) as out:
            out.write(_payload(6 * MiB))  # on S3 a part is already uploaded
            raise RuntimeError("boom")
    assert not storage.exists(uri)
    assert storage.list_files(root) == []
    if storage.is_s3(uri):  # the multipart upload was aborted, not left to linger
        bucket = uri[5:].split("/")[0]
        s3_server = request.getfixturevalue("s3_server")
        assert not s3_server.server.client().list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_small_stream_and_close_is_idempotent(root):
    uri = storage.join(root, "small.bin")
    out = storage.open_write(uri)
    out.write(b"abc")
    out.write(memoryview(b"defg"))
    out.close()
    out.close()
    assert storage.read_bytes(uri) == b"abcdefg"
    with pytest.raises(ValueError, match="after it was closed"):
        out.write(b"x")


def test_read_range(root):
    uri = storage.join(root, "r.bin")
    data = _payload(3 * MiB)
    storage.write_bytes(uri, data)
    assert storage.read_range(uri, 0, 10) == data[:10]
    assert storage.read_range(uri, MiB + 5, 2 * MiB - 5) == data[MiB + 5:]
    assert storage.read_range(uri, 7, 0) == b""
    with pytest.raises(StorageError, match="asked for 20 bytes at offset .* got 10"):
        storage.read_range(uri, len(data) - 10, 20)


def test_s3_traffic_is_counted(s3_storage, tmp_path):
    storage.reset_transfer_stats()
    data = _payload(6 * MiB)
    uri = storage.join(s3_storage, "counted.bin")
    with storage.open_write(uri, part_bytes=5 * MiB) as out:
        out.write(data)
    storage.write_bytes(storage.join(s3_storage, "small.json"), b"{}")
    assert storage.transfer_stats()["s3_written_bytes"] == len(data) + 2
    storage.read_range(uri, 100, 1000)
    storage.read_bytes(storage.join(s3_storage, "small.json"))
    storage.download_to(uri, tmp_path / "copy.bin")
    stats = storage.transfer_stats()
    assert stats["s3_read_bytes"] == 1000 + 2 + len(data) and stats["s3_get_requests"] == 3
    local = str(tmp_path / "local.bin")
    storage.write_bytes(local, data)
    storage.read_bytes(local)  # local traffic is not S3 traffic
    assert storage.transfer_stats()["s3_read_bytes"] == stats["s3_read_bytes"]
    storage.reset_transfer_stats()
    assert storage.transfer_stats() == {"s3_read_bytes": 0, "s3_written_bytes": 0, "s3_get_requests": 0}
    os.remove(local)
