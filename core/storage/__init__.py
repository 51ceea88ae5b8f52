"""Opening a storage backend from a URL (its own module: the backends import the base module,
so the base module cannot import them back)."""

from __future__ import annotations

from core.storage.base import Storage


def open_storage(url: str, *, s3_endpoint_url: str | None = None) -> Storage:
    """``/some/dir`` or ``file:///some/dir`` → local; ``s3://bucket/prefix`` → S3."""
    if url.startswith("s3://"):
        from core.storage.s3 import S3Storage

        return S3Storage.from_url(url, endpoint_url=s3_endpoint_url)
    from core.storage.local import LocalStorage

    return LocalStorage(url.removeprefix("file://"))
