"""Object storage: the interface every backend implements, and its key rules.

Keys are relative POSIX paths, checked by :func:`validate_key` so that none reaches outside the
store's root. Writes are atomic: a reader never sees a half-written object, and a failed write
leaves nothing. A prefix names a "directory": ``list("batches/b1")`` returns the keys under
``batches/b1/``, never ``batches/b10/...``; ``""`` is the whole store."""

from __future__ import annotations

import abc
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import BinaryIO


class StorageError(Exception):
    pass


class ObjectNotFound(StorageError, KeyError):
    pass


#: Name prefix of the temporary files that local writes use; reserved, never a key segment.
TEMP_PREFIX = ".tmp-"
#: S3's limit on a key's length (UTF-8 bytes); applied to every backend alike.
MAX_KEY_BYTES = 1024


def validate_key(key: str) -> str:
    """Return ``key`` if it is a safe relative POSIX path, else raise ``ValueError``."""
    if not isinstance(key, str):
        raise ValueError(f"storage key must be a str, not {type(key).__name__}")
    if not key:
        raise ValueError("storage key must not be empty")
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise ValueError(f"storage key is longer than {MAX_KEY_BYTES} bytes: {key[:64]!r}...")
    if key.startswith("/"):
        raise ValueError(f"storage key must be relative, not absolute: {key!r}")
    if "\\" in key:
        raise ValueError(f"storage key must not contain a backslash: {key!r}")
    if any(ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F for ch in key):
        raise ValueError(f"storage key must not contain NUL or control characters: {key!r}")
    for segment in key.split("/"):
        if segment in ("", ".", ".."):
            raise ValueError(f"storage key must not contain empty, '.' or '..' segments: {key!r}")
        if segment.startswith(TEMP_PREFIX):
            raise ValueError(f"storage key segments must not start with {TEMP_PREFIX!r}: {key!r}")
    return key


def normalize_prefix(prefix: str) -> str:
    """``prefix`` validated as a key, without its one optional trailing slash; ``""`` is the root."""
    if prefix == "":
        return ""
    if isinstance(prefix, str) and prefix.endswith("/"):
        prefix = prefix[:-1]
    return validate_key(prefix)


def check_range(start: int, end: int, chunk_size: int) -> None:
    """Refuse a byte range ``[start, end)`` or a chunk size that ``read_range`` cannot serve."""
    if start < 0 or end < start:
        raise ValueError(f"invalid range [{start}, {end})")
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")


class Storage(abc.ABC):
    @abc.abstractmethod
    def writer(self, key: str) -> AbstractContextManager[BinaryIO]:
        """A binary stream; the object appears at ``key`` only when the block exits cleanly."""

    @contextmanager
    def reader(self, key: str) -> Iterator[BinaryIO]:
        """A binary stream over the object (seekable for local files; S3 streams forward),
        closed when the block exits."""
        stream = self._open(key)
        try:
            yield stream
        finally:
            stream.close()

    @abc.abstractmethod
    def _open(self, key: str) -> BinaryIO:
        """The object's bytes from its start; ``ObjectNotFound`` if it does not exist."""

    @abc.abstractmethod
    def read_range(
        self, key: str, start: int, end: int, *, chunk_size: int = 1 << 20
    ) -> Iterator[bytes]:
        """Stream bytes ``[start, end)`` of the object in chunks of at most ``chunk_size``.

        ``end`` past the object's size is clamped to it; ``start`` past it yields nothing.
        ``ObjectNotFound`` is raised by the call itself, before the first chunk is asked for.
        """

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """The object's size in bytes; ``ObjectNotFound`` if it does not exist."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete ``key``; deleting a missing key is not an error."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Delete every key under ``prefix`` (a directory-like prefix; see the module doc)."""

    @abc.abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (directory-like; ``""`` for all), sorted; never temp files."""

    def iter_chunks(self, key: str, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        with self.reader(key) as stream:
            while chunk := stream.read(chunk_size):
                yield chunk
