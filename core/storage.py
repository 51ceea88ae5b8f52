"""Object storage for uploaded files, shard checkpoints and results.

Keys are relative POSIX paths (``files/file-abc``, ``batches/batch_x/shards/0003/00001.jsonl``).
Writes are atomic: a reader never sees a half-written object, and a writer that fails leaves
nothing behind. Backends: a local directory (default) and S3-compatible stores.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import BinaryIO


class StorageError(Exception):
    pass


class ObjectNotFound(StorageError, KeyError):
    pass


class Storage(abc.ABC):
    @abc.abstractmethod
    def writer(self, key: str) -> AbstractContextManager[BinaryIO]:
        """A binary stream; the object appears at ``key`` only when the block exits cleanly."""

    @abc.abstractmethod
    def reader(self, key: str) -> AbstractContextManager[BinaryIO]:
        """A binary stream over the object (seekable for local files; S3 streams forward)."""

    @abc.abstractmethod
    def read_range(self, key: str, start: int, end: int) -> Iterator[bytes]:
        """Stream bytes ``[start, end)`` of the object in chunks."""

    @abc.abstractmethod
    def size(self, key: str) -> int: ...

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete ``key``; deleting a missing key is not an error."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> None: ...

    @abc.abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix``, sorted."""

    def iter_chunks(self, key: str, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        with self.reader(key) as stream:
            while chunk := stream.read(chunk_size):
                yield chunk


def open_storage(url: str, *, s3_endpoint_url: str | None = None) -> Storage:
    """``/some/dir`` or ``file:///some/dir`` → local; ``s3://bucket/prefix`` → S3."""
    if url.startswith("s3://"):
        from core.storage_s3 import S3Storage

        return S3Storage.from_url(url, endpoint_url=s3_endpoint_url)
    from core.storage_local import LocalStorage

    return LocalStorage(url.removeprefix("file://"))
