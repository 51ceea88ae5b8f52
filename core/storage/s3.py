"""Storage in an S3-compatible bucket (AWS S3, MinIO, Ceph RGW, R2, ...).

Objects live at ``<prefix>/<key>``; credentials come from the standard AWS sources unless given
as client arguments. A write streams one part (``part_size``, at least 5 MiB) at a time as a
multipart upload (a single ``PutObject`` when smaller), completed only when the block exits
cleanly and aborted otherwise, so a failed write leaves no object and no pending upload. A
bucket batchd creates gets :data:`LIFECYCLE_RULE`, which aborts what a killed process left
(docs/operations.md)."""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any, BinaryIO
from urllib.parse import urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    IncompleteReadError,
    ReadTimeoutError,
    ResponseStreamingError,
)

from core.storage.base import (
    ObjectNotFound,
    Storage,
    StorageError,
    check_range,
    normalize_prefix,
    validate_key,
)

MiB = 1 << 20
MIN_PART_SIZE = 5 * MiB
DEFAULT_PART_SIZE = 8 * MiB
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_NO_BUCKET = {"NoSuchBucket"}
#: Errors that end a download body early; the read resumes from where it stopped.
_STREAM_ERRORS = (
    ResponseStreamingError,
    IncompleteReadError,
    ReadTimeoutError,
    ConnectionClosedError,
)
READ_RETRIES = 3
ABORT_ATTEMPTS = 3
ABORT_INCOMPLETE_UPLOADS_AFTER_DAYS = 1
#: The lifecycle rule set on a bucket batchd creates.
LIFECYCLE_RULE = {
    "ID": "batchd-abort-incomplete-multipart-uploads",
    "Status": "Enabled",
    "Filter": {"Prefix": ""},
    "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": ABORT_INCOMPLETE_UPLOADS_AFTER_DAYS},
}

logger = logging.getLogger(__name__)


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


class _MultipartWriter(io.BufferedIOBase):
    """The stream that ``S3Storage.writer`` yields; see the module docstring."""

    def __init__(self, client: Any, bucket: str, key: str, part_size: int) -> None:
        super().__init__()
        self._client = client
        self._bucket = bucket
        self._key = key
        self._part_size = part_size
        self._buf = bytearray()
        self._pos = 0
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def write(self, data: Any) -> int:
        if self.closed:
            raise ValueError("write to a closed S3 object stream")
        view = memoryview(data).cast("B")
        n = view.nbytes
        self._pos += n
        # Fill the buffer to one part, ship it, repeat: memory stays at one part per writer.
        while view.nbytes:
            room = self._part_size - len(self._buf)
            self._buf += view[:room]
            view = view[room:]
            if len(self._buf) >= self._part_size:
                self._upload_part()
        return n

    def _upload_part(self) -> None:
        if self._upload_id is None:
            created = self._client.create_multipart_upload(Bucket=self._bucket, Key=self._key)
            self._upload_id = created["UploadId"]
        number = len(self._parts) + 1
        response = self._client.upload_part(
            Bucket=self._bucket,
            Key=self._key,
            UploadId=self._upload_id,
            PartNumber=number,
            Body=bytes(self._buf),
        )
        self._parts.append({"PartNumber": number, "ETag": response["ETag"]})
        self._buf.clear()

    def _commit(self) -> None:
        if self._upload_id is None:
            self._client.put_object(Bucket=self._bucket, Key=self._key, Body=bytes(self._buf))
        else:
            if self._buf:  # the last part may be smaller than 5 MiB
                self._upload_part()
            self._client.complete_multipart_upload(
                Bucket=self._bucket,
                Key=self._key,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": self._parts},
            )
        self._buf = bytearray()

    def _abort(self) -> None:
        """Abort the multipart upload, if one was started: its parts would otherwise be kept
        (and billed) forever. Tried a few times, since the failure that brought us here (a
        dropped connection, a throttled store) may hit the abort too; S3 also asks to repeat
        an abort that raced a part upload until no part is left."""
        self._buf = bytearray()
        if self._upload_id is None:
            return
        upload_id, self._upload_id = self._upload_id, None
        for attempt in range(ABORT_ATTEMPTS):
            try:
                self._client.abort_multipart_upload(
                    Bucket=self._bucket, Key=self._key, UploadId=upload_id
                )
                left = self._client.list_parts(
                    Bucket=self._bucket, Key=self._key, UploadId=upload_id
                ).get("Parts")
            except ClientError as exc:
                if _code(exc) in {"NoSuchUpload", "404"}:
                    return  # aborted (now, or by an earlier try whose answer was lost)
                error: Exception = exc
            except BotoCoreError as exc:
                error = exc
            else:
                if not left:
                    return
                error = StorageError(f"{len(left)} parts remain")
            if attempt + 1 < ABORT_ATTEMPTS:
                time.sleep(0.2 * 2**attempt)
        logger.error(
            "could not abort multipart upload %s of %r in bucket %r (%s); the bucket's "
            "lifecycle rule removes it after %s day(s)",
            upload_id, self._key, self._bucket, error, ABORT_INCOMPLETE_UPLOADS_AFTER_DAYS,
        )  # fmt: skip


class _BodyRaw(io.RawIOBase):
    """A raw stream over a ``GetObject`` body, so ``io.BufferedReader`` can give it
    ``readline``, iteration and ``peek`` (and ``io.TextIOWrapper`` can decode it).

    If the connection drops mid-body, reading resumes with a ranged ``GetObject`` from the
    current offset, pinned to the first response's ETag (an object replaced meanwhile fails
    with ``StorageError`` instead of splicing two versions together)."""

    def __init__(self, storage: S3Storage, key: str, start: int = 0, end: int | None = None):
        super().__init__()
        self._storage = storage
        self._key = key
        self._pos = start
        self._end = end  # exclusive; None: to the end of the object
        response = storage._get(key, **self._range())
        self._etag: str | None = response.get("ETag")
        self._body = response["Body"]

    def _range(self) -> dict[str, str]:
        if self._pos == 0 and self._end is None:
            return {}
        last = "" if self._end is None else str(self._end - 1)
        return {"Range": f"bytes={self._pos}-{last}"}

    def readable(self) -> bool:
        return True

    def read_some(self, n: int) -> bytes:
        if self._end is not None:
            n = min(n, self._end - self._pos)
        if n <= 0:
            return b""
        for attempt in range(READ_RETRIES + 1):
            try:
                data = self._body.read(n)
                break
            except _STREAM_ERRORS as exc:
                if attempt == READ_RETRIES:
                    raise StorageError(f"S3 download of {self._key!r} kept failing: {exc}") from exc
                self._body.close()
                extra = {"IfMatch": self._etag} if self._etag else {}
                try:
                    self._body = self._storage._get(self._key, **self._range(), **extra)["Body"]
                except StorageError as retry_exc:
                    cause = retry_exc.__cause__
                    if isinstance(cause, ClientError) and _code(cause) == "InvalidRange":
                        return b""  # the drop came after the last byte: nothing is missing
                    raise
        self._pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.read_some(view.nbytes)
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._body.close()
        super().close()


class S3Storage(Storage):
    #: Keys per ListObjectsV2 page and per DeleteObjects call (S3 allows at most 1000).
    page_size = 1000

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        create_bucket: bool = True,
        part_size: int = DEFAULT_PART_SIZE,
        client: Any = None,
        **client_kwargs: Any,
    ) -> None:
        """``client_kwargs`` go to ``boto3.client("s3", ...)`` (``region_name``,
        ``aws_access_key_id``, ``config``, ...); ``client`` replaces the client altogether."""
        if not bucket:
            raise ValueError("S3 bucket name must not be empty")
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size must be at least {MIN_PART_SIZE} bytes (S3's minimum)")
        self.bucket = bucket
        self.prefix = normalize_prefix(prefix.strip("/"))
        self.part_size = part_size
        if client is None:
            if endpoint_url is not None and "config" not in client_kwargs:
                # Self-hosted stores (MinIO, moto, Ceph) rarely resolve virtual-host buckets.
                client_kwargs["config"] = Config(s3={"addressing_style": "path"})
            client = boto3.session.Session().client(
                "s3", endpoint_url=endpoint_url, **client_kwargs
            )
        self.client = client
        self._bucket_lock = threading.Lock()
        if create_bucket:
            self.ensure_bucket()

    @classmethod
    def from_url(cls, url: str, *, endpoint_url: str | None = None, **kwargs: Any) -> S3Storage:
        """``s3://bucket`` or ``s3://bucket/some/prefix``."""
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ValueError(f"not an s3://bucket[/prefix] URL: {url!r}")
        return cls(parts.netloc, parts.path.strip("/"), endpoint_url=endpoint_url, **kwargs)

    def __repr__(self) -> str:
        return f"S3Storage(bucket={self.bucket!r}, prefix={self.prefix!r})"

    def ensure_bucket(self) -> None:
        """Create the bucket unless it exists already."""
        with self._bucket_lock:
            try:
                self.client.head_bucket(Bucket=self.bucket)
                return
            except ClientError as exc:
                if _code(exc) not in _NOT_FOUND | _NO_BUCKET:
                    raise StorageError(f"cannot reach bucket {self.bucket!r}: {exc}") from exc
            kwargs: dict[str, Any] = {"Bucket": self.bucket}
            region = self.client.meta.region_name
            if region and region != "us-east-1":
                kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
            try:
                self.client.create_bucket(**kwargs)
            except ClientError as exc:
                if _code(exc) not in {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}:
                    raise StorageError(f"cannot create bucket {self.bucket!r}: {exc}") from exc
                return  # someone else's bucket settings are theirs to keep
            self._set_lifecycle()

    def _set_lifecycle(self) -> None:
        """Give a bucket batchd created the rule that aborts multipart uploads still
        incomplete a day after they started (a process killed mid-write cannot abort its
        own). A store without lifecycle support keeps working, with a warning: MinIO, for
        one, reaps stale uploads itself (``api stale_uploads_expiry``, 24 h by default)."""
        try:
            self.client.put_bucket_lifecycle_configuration(
                Bucket=self.bucket, LifecycleConfiguration={"Rules": [LIFECYCLE_RULE]}
            )
        except (ClientError, BotoCoreError) as exc:
            logger.warning(
                "bucket %r: could not set the rule that aborts incomplete multipart uploads "
                "(%s); set it by hand if the store does not reap them itself",
                self.bucket, exc,
            )  # fmt: skip

    # -- keys ------------------------------------------------------------------------------

    def object_key(self, key: str) -> str:
        """The S3 key that holds ``key``."""
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _list_prefix(self, prefix: str) -> str:
        prefix = normalize_prefix(prefix)
        full = "/".join(p for p in (self.prefix, prefix) if p)
        return f"{full}/" if full else ""

    def _error(self, exc: ClientError, key: str, action: str) -> StorageError:
        if _code(exc) in _NOT_FOUND:
            return ObjectNotFound(key)
        return StorageError(f"S3 {action} of {key!r} in bucket {self.bucket!r} failed: {exc}")

    # -- writing ---------------------------------------------------------------------------

    @contextmanager
    def writer(self, key: str) -> Iterator[BinaryIO]:
        stream = _MultipartWriter(self.client, self.bucket, self.object_key(key), self.part_size)
        try:
            yield stream  # type: ignore[misc]
            stream._commit()
        except BaseException as exc:
            # The original error matters more than one from the abort (which logs its own);
            # the bucket's lifecycle rule reaps an upload left behind.
            with suppress(Exception):
                stream._abort()
            if isinstance(exc, ClientError):
                raise self._error(exc, key, "upload") from exc
            raise
        finally:
            stream.close()

    # -- reading ---------------------------------------------------------------------------

    def _get(self, key: str, **kwargs: Any) -> dict[str, Any]:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.object_key(key), **kwargs)
        except ClientError as exc:
            raise self._error(exc, key, "download") from exc

    def _open(self, key: str) -> BinaryIO:
        return io.BufferedReader(_BodyRaw(self, key), buffer_size=MiB)

    def read_range(
        self, key: str, start: int, end: int, *, chunk_size: int = 1 << 20
    ) -> Iterator[bytes]:
        check_range(start, end, chunk_size)
        if start == end:
            if not self.exists(key):
                raise ObjectNotFound(key)
            return iter(())
        try:
            raw = _BodyRaw(self, key, start, end)
        except StorageError as exc:
            cause = exc.__cause__
            if isinstance(cause, ClientError) and _code(cause) == "InvalidRange":
                return iter(())  # start at or past the end: S3 says 416, we say "nothing"
            raise
        return self._iter_raw(raw, chunk_size)

    @staticmethod
    def _iter_raw(raw: _BodyRaw, chunk_size: int) -> Iterator[bytes]:
        with raw:
            while chunk := raw.read_some(chunk_size):
                yield chunk

    def _head(self, key: str) -> dict[str, Any]:
        try:
            return self.client.head_object(Bucket=self.bucket, Key=self.object_key(key))
        except ClientError as exc:
            raise self._error(exc, key, "head") from exc

    def size(self, key: str) -> int:
        return int(self._head(key)["ContentLength"])

    def exists(self, key: str) -> bool:
        try:
            self._head(key)
        except ObjectNotFound:
            return False
        return True

    def _iter_keys(self, full_prefix: str) -> Iterator[str]:
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            pages = paginator.paginate(
                Bucket=self.bucket,
                Prefix=full_prefix,
                PaginationConfig={"PageSize": self.page_size},
            )
            for page in pages:
                for item in page.get("Contents", ()):
                    yield item["Key"]
        except ClientError as exc:
            raise StorageError(f"S3 list of {full_prefix!r} failed: {exc}") from exc

    def list(self, prefix: str = "") -> list[str]:
        full_prefix = self._list_prefix(prefix)
        strip = len(self.prefix) + 1 if self.prefix else 0
        return sorted(k[strip:] for k in self._iter_keys(full_prefix))

    # -- deleting --------------------------------------------------------------------------

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.object_key(key))
        except ClientError as exc:
            if _code(exc) in _NOT_FOUND:
                return
            raise self._error(exc, key, "delete") from exc

    def delete_prefix(self, prefix: str) -> None:
        full_prefix = self._list_prefix(prefix)
        batch: list[dict[str, str]] = []
        for object_key in self._iter_keys(full_prefix):
            batch.append({"Key": object_key})
            if len(batch) >= self.page_size:
                self._delete_batch(batch)
                batch = []
        if batch:
            self._delete_batch(batch)

    def _delete_batch(self, batch: Sequence[dict[str, str]]) -> None:
        try:
            response = self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
            )
        except ClientError as exc:
            raise StorageError(f"S3 batch delete failed: {exc}") from exc
        errors = [e for e in response.get("Errors", ()) if e.get("Code") not in _NOT_FOUND]
        if errors:
            first = errors[0]
            raise StorageError(
                f"S3 batch delete failed for {len(errors)} keys, e.g. "
                f"{first.get('Key')!r}: {first.get('Code')} {first.get('Message')}"
            )


__all__ = ["S3Storage"]
