"""One behavioural suite for every storage backend: a local directory, and S3 against a real
S3-compatible server (moto's standalone server, over HTTP on 127.0.0.1)."""

from __future__ import annotations

import io
import os
import secrets
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.storage import open_storage
from core.storage.base import ObjectNotFound, Storage, StorageError, validate_key
from core.storage.local import LocalStorage
from core.storage.s3 import MIN_PART_SIZE, S3Storage

MiB = 1 << 20


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on a free local port, with dummy AWS credentials in the environment."""
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_SESSION_TOKEN", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_REGION", "us-east-1")
        mp.setenv("AWS_CONFIG_FILE", os.devnull)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(name, raising=False)
        port = _free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.stop()


def _bucket() -> str:
    return f"batchd-test-{secrets.token_hex(4)}"


def _s3(endpoint: str, bucket: str | None = None, prefix: str = "root/sub") -> S3Storage:
    return S3Storage(bucket or _bucket(), prefix, endpoint_url=endpoint, part_size=MIN_PART_SIZE)


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return LocalStorage(tmp_path / "store")
    return _s3(request.getfixturevalue("s3_endpoint"))


def _put(storage: Storage, key: str, data: bytes) -> None:
    with storage.writer(key) as out:
        out.write(data)


def _get(storage: Storage, key: str) -> bytes:
    with storage.reader(key) as stream:
        return stream.read()


def _pending_uploads(storage: S3Storage) -> list[dict]:
    return storage.client.list_multipart_uploads(Bucket=storage.bucket).get("Uploads", [])


# -- behaviour shared by every backend -------------------------------------------------------


def test_round_trip(storage: Storage) -> None:
    data = b"line one\nline two\n" * 100
    _put(storage, "files/file-abc", data)
    assert storage.exists("files/file-abc")
    assert storage.size("files/file-abc") == len(data)
    assert _get(storage, "files/file-abc") == data
    assert b"".join(storage.iter_chunks("files/file-abc", chunk_size=7)) == data
    _put(storage, "files/file-abc", b"replaced")
    assert _get(storage, "files/file-abc") == b"replaced"


def test_empty_object(storage: Storage) -> None:
    _put(storage, "empty", b"")
    assert storage.exists("empty")
    assert storage.size("empty") == 0
    assert _get(storage, "empty") == b""
    assert list(storage.read_range("empty", 0, 10)) == []


def test_reader_reads_lines_and_text(storage: Storage) -> None:
    with storage.writer("a.jsonl") as out:
        text = io.TextIOWrapper(out, encoding="utf-8", newline="\n")
        text.write('{"x": "é"}\n{"y": 2}\n')
        text.flush()
        text.detach()
    with storage.reader("a.jsonl") as stream:
        assert list(stream) == ['{"x": "é"}\n'.encode(), b'{"y": 2}\n']
    with storage.reader("a.jsonl") as stream:
        assert io.TextIOWrapper(stream, encoding="utf-8").readline() == '{"x": "é"}\n'


def test_failed_write_leaves_nothing(storage: Storage) -> None:
    _put(storage, "keep/old", b"old")
    with pytest.raises(RuntimeError, match="boom"), storage.writer("keep/old") as out:
        out.write(b"new, half written")
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"), storage.writer("keep/fresh") as out:
        out.write(b"x" * 1000)
        raise RuntimeError("boom")
    assert _get(storage, "keep/old") == b"old"
    assert not storage.exists("keep/fresh")
    assert storage.list("") == ["keep/old"]


def test_object_appears_only_on_clean_exit(storage: Storage) -> None:
    with storage.writer("late") as out:
        out.write(b"data")
        assert not storage.exists("late")
        assert storage.list("") == []
    assert storage.exists("late")


def test_large_streamed_write_round_trips(storage: Storage) -> None:
    piece = bytes(range(256)) * 256  # 64 KiB
    pieces = 12 * MiB // len(piece) + 3  # a little over 12 MiB: parts 5, 5, 2+ MiB
    with storage.writer("big/blob") as out:
        for i in range(pieces):
            out.write(piece[i % 256 :] + piece[: i % 256])
    assert storage.size("big/blob") == pieces * len(piece)
    digest_in = b"".join(piece[i % 256 :] + piece[: i % 256] for i in range(pieces))
    assert b"".join(storage.iter_chunks("big/blob")) == digest_in
    assert (
        b"".join(storage.read_range("big/blob", 5 * MiB - 10, 5 * MiB + 10))
        == (digest_in[5 * MiB - 10 : 5 * MiB + 10])
    )


def test_read_range(storage: Storage) -> None:
    data = bytes(range(256)) * 40  # 10240 bytes
    _put(storage, "r", data)
    assert b"".join(storage.read_range("r", 0, len(data))) == data
    assert b"".join(storage.read_range("r", 100, 200)) == data[100:200]
    chunks = list(storage.read_range("r", 10, 5000, chunk_size=1000))
    assert b"".join(chunks) == data[10:5000]
    assert max(len(c) for c in chunks) <= 1000
    assert b"".join(storage.read_range("r", 10000, 99999)) == data[10000:]  # end clamped
    assert list(storage.read_range("r", 5, 5)) == []
    assert list(storage.read_range("r", 20000, 30000)) == []  # start past the end
    with pytest.raises(ValueError):
        storage.read_range("r", 10, 5)
    with pytest.raises(ValueError):
        storage.read_range("r", -1, 5)


def test_list_and_delete(storage: Storage) -> None:
    keys = ["b/1", "b/2/x", "b/2/y", "b10/z", "c", "a/deep/er/key.jsonl"]
    for key in keys:
        _put(storage, key, key.encode())
    assert storage.list("") == sorted(keys)
    assert storage.list("b") == ["b/1", "b/2/x", "b/2/y"]  # not b10/: prefixes are directories
    assert storage.list("b/") == ["b/1", "b/2/x", "b/2/y"]
    assert storage.list("b/2") == ["b/2/x", "b/2/y"]
    assert storage.list("c") == []  # an object, not a directory
    assert storage.list("nothing/here") == []

    storage.delete("b/1")
    storage.delete("b/1")  # deleting a missing key is fine
    storage.delete("never/was")
    assert not storage.exists("b/1")
    assert storage.list("b") == ["b/2/x", "b/2/y"]

    storage.delete_prefix("b")
    assert storage.list("") == ["a/deep/er/key.jsonl", "b10/z", "c"]
    storage.delete_prefix("missing/prefix")
    storage.delete_prefix("")
    assert storage.list("") == []
    _put(storage, "b/again", b"1")  # directories removed underneath still work
    assert _get(storage, "b/again") == b"1"


def test_missing_objects_raise_object_not_found(storage: Storage) -> None:
    _put(storage, "dir/obj", b"x")
    for key in ("nope", "dir/nope", "dir/obj/under", "dir"):
        assert not storage.exists(key)
        with pytest.raises(ObjectNotFound):
            storage.size(key)
        with pytest.raises(ObjectNotFound), storage.reader(key):
            pass
        with pytest.raises(ObjectNotFound):
            storage.read_range(key, 0, 10)  # raised by the call, not the first next()
        with pytest.raises(ObjectNotFound):
            storage.read_range(key, 0, 0)
        with pytest.raises(ObjectNotFound):
            list(storage.iter_chunks(key))
    assert issubclass(ObjectNotFound, KeyError)


BAD_KEYS = [
    "",
    "/etc/passwd",
    "../escape",
    "a/../../escape",
    "a/..",
    "./a",
    "a/./b",
    "a//b",
    "a/",
    "a\\b",
    "..\\escape",
    "a\x00b",
    "a\nb",
    "a\x7fb",
    "a\x85b",
    ".tmp-abc",
    "dir/.tmp-abc",
    "x" * 1025,
]


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_bad_keys_are_rejected(storage: Storage, key: str) -> None:
    with pytest.raises(ValueError):
        validate_key(key)
    with pytest.raises(ValueError), storage.writer(key):
        pass
    for call in (storage.exists, storage.size, storage.delete):
        with pytest.raises(ValueError):
            call(key)
    with pytest.raises(ValueError), storage.reader(key):
        pass
    with pytest.raises(ValueError):
        storage.read_range(key, 0, 1)


@pytest.mark.parametrize("prefix", ["/abs", "../up", "a/../b", "a//", "a\\b", "a\x00"], ids=repr)
def test_bad_prefixes_are_rejected(storage: Storage, prefix: str) -> None:
    with pytest.raises(ValueError):
        storage.list(prefix)
    with pytest.raises(ValueError):
        storage.delete_prefix(prefix)


def test_good_keys_are_accepted() -> None:
    for key in ["a", "files/file-abc", "batches/b_x/shards/0003/00001.jsonl", ".hidden", "ü/ñ"]:
        assert validate_key(key) == key


def test_concurrent_writes_to_different_keys(storage: Storage) -> None:
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(5):
                key = f"shared/{n}/{i}"
                _put(storage, key, f"{n}:{i}".encode() * 100)
                assert _get(storage, key) == f"{n}:{i}".encode() * 100
                if i % 2:
                    storage.delete(key)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert storage.list("shared") == sorted(f"shared/{n}/{i}" for n in range(6) for i in (0, 2, 4))


# -- local directory specifics --------------------------------------------------------------


def test_local_write_is_atomic_and_temp_files_are_hidden(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    with storage.writer("d/obj") as out:
        out.write(b"partial")
        out.flush()
        names = os.listdir(tmp_path / "d")
        assert len(names) == 1 and names[0].startswith(".tmp-")
        assert storage.list("") == [] and storage.list("d") == []
        assert not storage.exists("d/obj")
    assert os.listdir(tmp_path / "d") == ["obj"]
    with pytest.raises(RuntimeError), storage.writer("d/failed") as out:
        out.write(b"x")
        raise RuntimeError
    assert os.listdir(tmp_path / "d") == ["obj"]
    # A stream closed inside the block (e.g. by a wrapper) still commits.
    with storage.writer("d/closed") as out:
        out.write(b"closed early")
        out.close()
    assert _get(storage, "d/closed") == b"closed early"


def test_local_keys_stay_under_root(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "root")
    assert storage.path("a/b") == tmp_path / "root" / "a" / "b"
    (tmp_path / "outside").write_bytes(b"secret")
    with pytest.raises(ValueError):
        storage.reader("../outside").__enter__()
    assert (tmp_path / "outside").read_bytes() == b"secret"


def test_local_reader_is_seekable(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    _put(storage, "s", b"0123456789")
    with storage.reader("s") as stream:
        stream.seek(5)
        assert stream.read() == b"56789"


def test_local_delete_prunes_empty_directories(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    _put(storage, "a/b/c", b"1")
    _put(storage, "a/keep", b"2")
    storage.delete("a/b/c")
    assert not (tmp_path / "a" / "b").exists()
    assert (tmp_path / "a" / "keep").exists()
    storage.delete_prefix("a")
    assert os.listdir(tmp_path) == []


def test_local_write_over_a_directory_fails(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    _put(storage, "dir/x", b"1")
    with pytest.raises(StorageError), storage.writer("dir"):
        pass
    with pytest.raises(StorageError), storage.writer("dir/x/y"):
        pass


# -- S3 specifics ----------------------------------------------------------------------------


def test_s3_failed_multipart_write_leaves_no_object_and_no_upload(s3_endpoint: str) -> None:
    storage = _s3(s3_endpoint)
    with pytest.raises(RuntimeError, match="midway"), storage.writer("big") as out:
        out.write(b"a" * (3 * MiB))
        out.write(b"b" * (3 * MiB))  # crosses one part: the multipart upload has begun
        assert len(_pending_uploads(storage)) == 1
        out.write(b"c" * MiB)
        raise RuntimeError("midway")
    assert not storage.exists("big")
    assert storage.list("") == []
    assert _pending_uploads(storage) == []


def _fail_calls(storage: S3Storage, operation: str, times: int, after: int = 0) -> list[str]:
    """Make the store's ``operation`` fail ``times`` times (after ``after`` calls succeed) as a
    dropped connection would; returns the log of the calls seen."""
    from botocore.exceptions import EndpointConnectionError

    seen: list[str] = []

    def fail(**_: object) -> None:
        seen.append(operation)
        if after < len(seen) <= after + times:
            raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1")

    storage.client.meta.events.register(f"before-call.s3.{operation}", fail)
    return seen


@pytest.mark.parametrize(
    ("operation", "after"),
    [("UploadPart", 1), ("CompleteMultipartUpload", 0), ("UploadPart", 0)],
)
def test_s3_store_failure_mid_upload_leaves_no_pending_upload(
    s3_endpoint: str, operation: str, after: int
) -> None:
    """The store fails under the writer (a part, or the completion): the upload is aborted."""
    from botocore.exceptions import EndpointConnectionError

    storage = _s3(s3_endpoint)
    _fail_calls(storage, operation, times=1, after=after)
    with pytest.raises(EndpointConnectionError), storage.writer("big") as out:
        for _ in range(3):
            out.write(b"p" * (3 * MiB))
    assert _pending_uploads(storage) == []
    assert not storage.exists("big")


def test_s3_abort_is_retried_when_it_fails_too(s3_endpoint: str) -> None:
    storage = _s3(s3_endpoint)
    aborts = _fail_calls(storage, "AbortMultipartUpload", times=1)
    with pytest.raises(RuntimeError, match="killed"), storage.writer("big") as out:
        out.write(b"a" * (6 * MiB))
        raise RuntimeError("killed")  # the caller's error is the one raised, not the abort's
    assert len(aborts) == 2
    assert _pending_uploads(storage) == []
    # An abort that keeps failing leaves the caller's error intact and says so in the log.
    storage = _s3(s3_endpoint)
    _fail_calls(storage, "AbortMultipartUpload", times=99)
    with pytest.raises(RuntimeError, match="killed"), storage.writer("big") as out:
        out.write(b"a" * (6 * MiB))
        raise RuntimeError("killed")
    assert len(_pending_uploads(storage)) == 1  # left for the bucket's lifecycle rule


def test_s3_created_bucket_aborts_incomplete_uploads_after_a_day(s3_endpoint: str) -> None:
    from core.storage.s3 import LIFECYCLE_RULE

    storage = _s3(s3_endpoint)
    rules = storage.client.get_bucket_lifecycle_configuration(Bucket=storage.bucket)["Rules"]
    assert [r["AbortIncompleteMultipartUpload"] for r in rules] == [{"DaysAfterInitiation": 1}]
    assert rules[0]["Status"] == "Enabled" and rules[0]["ID"] == LIFECYCLE_RULE["ID"]
    # A bucket that exists already (someone else's settings) is left as it is.
    bucket = _bucket()
    storage.client.create_bucket(Bucket=bucket)
    existing = _s3(s3_endpoint, bucket)
    with pytest.raises(Exception, match="NoSuchLifecycleConfiguration"):
        existing.client.get_bucket_lifecycle_configuration(Bucket=bucket)


def test_s3_store_without_lifecycle_support_still_works(
    s3_endpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    import boto3
    from botocore.exceptions import ClientError

    client = boto3.session.Session().client("s3", endpoint_url=s3_endpoint)

    def unsupported(**_: object) -> None:
        raise ClientError(
            {"Error": {"Code": "NotImplemented", "Message": "not supported"}},
            "PutBucketLifecycleConfiguration",
        )

    client.meta.events.register("before-call.s3.PutBucketLifecycleConfiguration", unsupported)
    storage = S3Storage(_bucket(), client=client)
    assert "could not set the rule that aborts incomplete multipart uploads" in caplog.text
    _put(storage, "x", b"1")
    assert _get(storage, "x") == b"1"


def test_s3_writer_streams_parts_and_bounds_its_buffer(s3_endpoint: str) -> None:
    storage = _s3(s3_endpoint)
    with storage.writer("streamed") as out:
        for _ in range(3):
            out.write(b"z" * (4 * MiB))
            assert len(out._buf) < MIN_PART_SIZE  # never more than one part in memory
        assert out.tell() == 12 * MiB
        uploads = _pending_uploads(storage)
        assert len(uploads) == 1 and uploads[0]["Key"] == "root/sub/streamed"
        parts = storage.client.list_parts(
            Bucket=storage.bucket, Key=uploads[0]["Key"], UploadId=uploads[0]["UploadId"]
        )["Parts"]
        assert [p["Size"] for p in parts] == [MIN_PART_SIZE, MIN_PART_SIZE]
        assert not storage.exists("streamed")
    assert _pending_uploads(storage) == []
    assert storage.size("streamed") == 12 * MiB
    # One write much larger than a part is split, not buffered whole.
    with storage.writer("one-shot") as out:
        out.write(memoryview(b"q" * (11 * MiB + 3)))
        assert len(out._buf) == MiB + 3
    assert storage.size("one-shot") == 11 * MiB + 3


def test_s3_small_objects_use_a_single_put(s3_endpoint: str) -> None:
    storage = _s3(s3_endpoint)
    with storage.writer("small") as out:
        out.write(b"x" * 1000)
        assert out._upload_id is None
    assert _get(storage, "small") == b"x" * 1000


def test_s3_prefix_isolates_stores_in_one_bucket(s3_endpoint: str) -> None:
    bucket = _bucket()
    one = _s3(s3_endpoint, bucket, "one")
    two = _s3(s3_endpoint, bucket, "two/deeper")
    whole = _s3(s3_endpoint, bucket, "")
    _put(one, "k", b"1")
    _put(two, "k", b"2")
    assert one.list("") == ["k"] and two.list("") == ["k"]
    assert whole.list("") == ["one/k", "two/deeper/k"]
    assert _get(whole, "two/deeper/k") == b"2"
    one.delete_prefix("")
    assert whole.list("") == ["two/deeper/k"]


def test_s3_delete_prefix_pages_through_many_keys(s3_endpoint: str) -> None:
    storage = _s3(s3_endpoint)
    storage.page_size = 7  # several list pages and DeleteObjects batches
    calls: list[str] = []
    storage.client.meta.events.register(
        "before-call.s3.*", lambda model, **_: calls.append(model.name)
    )
    for i in range(30):
        _put(storage, f"many/{i:05d}", b"")
    _put(storage, "other", b"kept")
    calls.clear()
    assert storage.list("many") == [f"many/{i:05d}" for i in range(30)]
    assert calls == ["ListObjectsV2"] * 5
    calls.clear()
    storage.delete_prefix("many")
    assert calls.count("DeleteObjects") == 5
    assert storage.list("") == ["other"]


def test_s3_bucket_creation(s3_endpoint: str) -> None:
    bucket = _bucket()
    absent = S3Storage(bucket, endpoint_url=s3_endpoint, create_bucket=False)
    with pytest.raises(StorageError) as info:
        _put(absent, "x", b"")
    assert not isinstance(info.value, ObjectNotFound)
    storage = S3Storage(bucket, endpoint_url=s3_endpoint)  # creates it
    S3Storage(bucket, endpoint_url=s3_endpoint)  # exists already: fine
    _put(storage, "x", b"1")
    assert storage.list("") == ["x"]


def test_s3_from_url(s3_endpoint: str) -> None:
    bucket = _bucket()
    storage = S3Storage.from_url(f"s3://{bucket}/some/prefix/", endpoint_url=s3_endpoint)
    assert (storage.bucket, storage.prefix) == (bucket, "some/prefix")
    assert S3Storage.from_url(f"s3://{bucket}", endpoint_url=s3_endpoint).prefix == ""
    for bad in ("s3://", "s3:///prefix", "http://bucket/x"):
        with pytest.raises(ValueError):
            S3Storage.from_url(bad, endpoint_url=s3_endpoint)
    with pytest.raises(ValueError):
        S3Storage.from_url(f"s3://{bucket}/a/../b", endpoint_url=s3_endpoint)


# -- open_storage ------------------------------------------------------------------------------


def test_open_storage_dispatches_on_url(tmp_path: Path, s3_endpoint: str) -> None:
    plain = open_storage(str(tmp_path / "plain"))
    assert isinstance(plain, LocalStorage) and plain.root == tmp_path / "plain"
    as_url = open_storage(f"file://{tmp_path / 'url'}")
    assert isinstance(as_url, LocalStorage) and as_url.root == tmp_path / "url"
    _put(as_url, "k", b"v")
    assert (tmp_path / "url" / "k").read_bytes() == b"v"

    bucket = _bucket()
    s3 = open_storage(f"s3://{bucket}/pre/fix", s3_endpoint_url=s3_endpoint)
    assert isinstance(s3, S3Storage)
    assert (s3.bucket, s3.prefix) == (bucket, "pre/fix")
    _put(s3, "k", b"v")
    assert s3.client.get_object(Bucket=bucket, Key="pre/fix/k")["Body"].read() == b"v"


class _FlakyBody:
    """A GetObject body whose connection drops after ``good`` bytes."""

    def __init__(self, body, good: int) -> None:
        self._body, self._left = body, good

    def read(self, n: int = -1) -> bytes:
        from botocore.exceptions import ResponseStreamingError

        if self._left <= 0:
            raise ResponseStreamingError(error="connection reset by peer")
        data = self._body.read(min(n, self._left))
        self._left -= len(data)
        return data

    def close(self) -> None:
        self._body.close()


def _drop_connections(storage: S3Storage, monkeypatch: pytest.MonkeyPatch, good: int) -> list:
    """Every GetObject body drops after ``good`` bytes; returns the recorded requests."""
    real = storage.client.get_object
    requests: list[dict] = []

    def get_object(**kwargs):
        requests.append(kwargs)
        response = real(**kwargs)
        response["Body"] = _FlakyBody(response["Body"], good)
        return response

    monkeypatch.setattr(storage.client, "get_object", get_object)
    return requests


def test_s3_reads_resume_after_a_dropped_connection(
    s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = _s3(s3_endpoint)
    data = os.urandom(300_000)
    _put(storage, "obj", data)
    requests = _drop_connections(storage, monkeypatch, good=100_000)
    assert _get(storage, "obj") == data
    # The third body drops after its last byte: the resume at 300000 finds nothing missing.
    assert [r.get("Range") for r in requests] == [
        None,
        "bytes=100000-",
        "bytes=200000-",
        "bytes=300000-",
    ]
    assert all(r.get("IfMatch") for r in requests[1:])
    requests.clear()
    assert (
        b"".join(storage.read_range("obj", 1000, 250_000, chunk_size=30_000))
        == (data[1000:250_000])
    )
    assert [r["Range"] for r in requests] == [
        "bytes=1000-249999",
        "bytes=101000-249999",
        "bytes=201000-249999",
    ]


def test_s3_read_of_a_replaced_object_fails_instead_of_splicing(
    s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = _s3(s3_endpoint)
    _put(storage, "obj", b"a" * 1000)
    _drop_connections(storage, monkeypatch, good=400)
    with storage.reader("obj") as stream:
        assert stream.read(400) == b"a" * 400
        monkeypatch.undo()
        _put(storage, "obj", b"b" * 1000)
        _drop_connections(storage, monkeypatch, good=400)
        with pytest.raises(StorageError):
            stream.read()


def test_s3_read_gives_up_after_repeated_failures(
    s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = _s3(s3_endpoint)
    _put(storage, "obj", b"x" * 1000)
    requests = _drop_connections(storage, monkeypatch, good=0)
    with pytest.raises(StorageError, match="kept failing"):
        _get(storage, "obj")
    assert len(requests) == 4
