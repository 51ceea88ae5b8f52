"""Prompt token ids that validation computed for a shard, stored for the shard's run to reuse.

The shard's run then does not render and tokenize its prompts a second time. Validation
counts every request's tokens with the model's own tokenizer (quota and shard sizes weigh
them); the ids it had are written, before the shard's row exists, to
``batches/{batch}/prepared/{index:05d}.ids``: per request, its input line, the number of ids
and the ids, unsigned 32-bit little-endian. The shard reads the object when it starts and
takes a line's ids from it; a line it does not hold (a line validation could not tokenize, a
shard planned before this object existed, an embeddings shard) is tokenized by the shard as
before. The object goes with the batch's other objects under ``batches/{batch}/``.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

from core.storage import ObjectNotFound, Storage

_ITEM = "I"  # uint32


def prepared_key(batch_id: str, shard_index: int) -> str:
    return f"batches/{batch_id}/prepared/{shard_index:05d}.ids"


def _le(values: array) -> bytes:
    if sys.byteorder != "little":
        values = array(_ITEM, values)
        values.byteswap()
    return values.tobytes()


def write_prepared(
    storage: Storage, batch_id: str, shard_index: int, items: Iterable[tuple[int, list[int]]]
) -> None:
    """Store ``(line, ids)`` for the requests of one shard (written whole, atomically)."""
    flat = array(_ITEM)
    for line, ids in items:
        flat.append(line)
        flat.append(len(ids))
        flat.extend(ids)
    with storage.writer(prepared_key(batch_id, shard_index)) as out:
        out.write(_le(flat))


def read_prepared(storage: Storage, batch_id: str, shard_index: int) -> dict[int, list[int]]:
    """The stored ids of the shard's requests by input line; empty when none were stored."""
    try:
        with storage.reader(prepared_key(batch_id, shard_index)) as stream:
            data = stream.read()
    except ObjectNotFound:
        return {}
    flat = array(_ITEM)
    flat.frombytes(data[: len(data) - len(data) % flat.itemsize])
    if sys.byteorder != "little":
        flat.byteswap()
    out: dict[int, list[int]] = {}
    i, n = 0, len(flat)
    while i + 2 <= n:
        line, count = flat[i], flat[i + 1]
        if i + 2 + count > n:
            break  # a torn object: the lines it lacks are tokenized by the shard
        out[line] = flat[i + 2 : i + 2 + count].tolist()
        i += 2 + count
    return out
