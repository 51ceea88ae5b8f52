"""An upload's parts joined on S3 (moto's server on 127.0.0.1): each part is its own object,
the join streams them into one multipart object in ``part_ids`` order, and a wrong MD5 leaves
no object behind."""

from __future__ import annotations

import hashlib

import pytest

from api.errors import APIError
from api.services.uploads import join_parts
from core.storage.s3 import MIN_PART_SIZE
from tests.core.test_storage import _s3, s3_endpoint  # noqa: F401 - the fixture

pytestmark = pytest.mark.services


def test_parts_join_in_order_on_s3(s3_endpoint: str) -> None:  # noqa: F811
    storage = _s3(s3_endpoint)
    parts = [bytes([i]) * (MIN_PART_SIZE + 1000 * i) for i in range(3)]  # each over one S3 part
    for i, data in enumerate(parts):
        with storage.writer(f"uploads/u/p{i}") as out:
            out.write(data)
    order = [2, 0, 1]
    joined = b"".join(parts[i] for i in order)
    join_parts(
        storage, "files/f", [f"uploads/u/p{i}" for i in order], hashlib.md5(joined).hexdigest()
    )
    with storage.reader("files/f") as stream:
        assert stream.read() == joined

    with pytest.raises(APIError) as caught:
        join_parts(storage, "files/g", [f"uploads/u/p{i}" for i in order], "0" * 32)
    assert caught.value.param == "md5"
    assert not storage.exists("files/g")
