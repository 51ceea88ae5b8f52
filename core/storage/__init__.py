"""Object storage: :func:`open_storage` opens a backend from its URL.

The interface and key rules are in ``base``, the backends in ``local`` and ``s3``; a backend is
imported only when one is opened (the S3 one brings boto3)."""

from __future__ import annotations

from core.storage.base import Storage


def open_storage(url: str, *, s3_endpoint_url: str | None = None) -> Storage:
    """``/some/dir`` or ``file:///some/dir`` → local; ``s3://bucket/prefix`` → S3."""
    if url.startswith("s3://"):
        from core.storage.s3 import S3Storage

        return S3Storage.from_url(url, endpoint_url=s3_endpoint_url)
    from core.storage.local import LocalStorage

    return LocalStorage(url.removeprefix("file://"))
