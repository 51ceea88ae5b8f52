"""Prompt token ids that validation computed for a shard, stored for the shard's run to reuse.

``batches/{batch}/prepared/{index:05d}.ids``: a header naming the tokenizer
(:func:`tokenizer_fingerprint`), then per request its input line, the number of ids and the ids
(uint32, little-endian). A line it does not hold, or every line when another tokenizer made it,
is tokenized by the shard as before. Reasoning: ``docs/worker.md``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import sys
import weakref
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from core.storage.base import ObjectNotFound, Storage

logger = logging.getLogger(__name__)

_ITEM = "I"  # uint32
_MAGIC = b"BDID\x01\x00\x00\x00"  # format 1; the tokenizer's 16-byte digest follows
_HEADER = len(_MAGIC) + 16
L = TypeVar("L")
_fingerprints: weakref.WeakKeyDictionary[Any, bytes] = weakref.WeakKeyDictionary()


def tokenizer_fingerprint(tok: Any) -> bytes:
    """16 bytes that change when the ids ``tok`` gives a request could: its vocabulary and
    added tokens, its special tokens, its chat template (computed once per tokenizer)."""
    try:
        return _fingerprints[tok]
    except (KeyError, TypeError):
        pass
    digest = hashlib.blake2b(digest_size=16)
    digest.update(type(tok).__name__.encode())
    for part in (
        sorted(tok.get_vocab().items()),
        getattr(tok, "chat_template", None),
        getattr(tok, "special_tokens_map", None),
        [getattr(tok, name, None) for name in ("add_bos_token", "add_eos_token")],
    ):
        digest.update(json.dumps(part, sort_keys=True, default=str).encode())
    value = digest.digest()
    with contextlib.suppress(TypeError):  # not weakly referable: computed again next time
        _fingerprints[tok] = value
    return value


def prepared_key(batch_id: str, shard_index: int) -> str:
    return f"batches/{batch_id}/prepared/{shard_index:05d}.ids"


def _le(values: array) -> bytes:
    if sys.byteorder != "little":
        values = array(_ITEM, values)
        values.byteswap()
    return values.tobytes()


def write_prepared(
    storage: Storage,
    batch_id: str,
    shard_index: int,
    items: Iterable[tuple[int, Sequence[int]]],
    fingerprint: bytes,
) -> None:
    """Store ``(line, ids)`` for the requests of one shard, made by the tokenizer whose
    :func:`tokenizer_fingerprint` is ``fingerprint`` (written whole, atomically)."""
    flat = array(_ITEM)
    for line, ids in items:
        flat.append(line)
        flat.append(len(ids))
        flat.extend(ids)
    with storage.writer(prepared_key(batch_id, shard_index)) as out:
        out.write(_MAGIC + fingerprint + _le(flat))


def read_prepared(
    storage: Storage, batch_id: str, shard_index: int, fingerprint: bytes
) -> dict[int, list[int]]:
    """The stored ids of the shard's requests by input line; empty when none were stored or
    another tokenizer than ``fingerprint``'s made them."""
    try:
        with storage.reader(prepared_key(batch_id, shard_index)) as stream:
            data = stream.read()
    except ObjectNotFound:
        return {}
    if data[: len(_MAGIC)] != _MAGIC or data[len(_MAGIC) : _HEADER] != fingerprint:
        logger.info(
            "batch %s shard %s: its prompt ids were made by another tokenizer; tokenizing again",
            batch_id,
            shard_index,
        )
        return {}
    data = data[_HEADER:]
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


# -- the order a shard runs its lines in (core.batches.plan)

_ORDER_MAGIC = b"BDOR\x01\x00\x00\x00"


def order_key(batch_id: str, shard_index: int) -> str:
    return f"batches/{batch_id}/prepared/{shard_index:05d}.order"


def write_order(storage: Storage, batch_id: str, shard_index: int, lines: list[int]) -> None:
    """Store the input lines of one shard in the order its run submits them (written whole,
    atomically); a shard without one runs in file order."""
    with storage.writer(order_key(batch_id, shard_index)) as out:
        out.write(_ORDER_MAGIC + _le(array(_ITEM, lines)))


def read_order(storage: Storage, batch_id: str, shard_index: int) -> list[int]:
    """The stored run order of the shard's lines; empty (file order) when none was stored or
    it cannot be read."""
    try:
        with storage.reader(order_key(batch_id, shard_index)) as stream:
            data = stream.read()
    except ObjectNotFound:
        return []
    if data[: len(_ORDER_MAGIC)] != _ORDER_MAGIC:
        logger.warning("batch %s shard %s: its run order is unreadable", batch_id, shard_index)
        return []
    flat = array(_ITEM)
    body = data[len(_ORDER_MAGIC) :]
    flat.frombytes(body[: len(body) - len(body) % flat.itemsize])
    if sys.byteorder != "little":
        flat.byteswap()
    return flat.tolist()


def in_run_order(lines: Iterable[L], order: list[int], line_of: Callable[[L], int]) -> Iterator[L]:
    """A shard's ``lines`` (read in file order) in its stored run ``order``; the lines the order
    does not name follow in file order. Without an order they stream as read; with one the
    shard's lines are held until the first is given (a shard is at most
    ``shard_max_requests`` lines)."""
    if not order:
        yield from lines
        return
    held = {line_of(item): item for item in lines}
    for line in order:
        item = held.pop(line, None)
        if item is not None:
            yield item
    yield from held.values()


# -- the lines of a shard cut along prefix groups (it draws them from its window's range)

_LINES_MAGIC = b"BDLS\x01\x00\x00\x00"


def lines_key(batch_id: str, shard_index: int) -> str:
    return f"batches/{batch_id}/prepared/{shard_index:05d}.lines"


def write_lines(storage: Storage, batch_id: str, shard_index: int, lines: list[int]) -> None:
    """Store the input lines a shard holds, in the order its run submits them (written whole,
    atomically, before the shard's row): for a shard that shares its range with others, the
    one account of which lines are its own."""
    with storage.writer(lines_key(batch_id, shard_index)) as out:
        out.write(_LINES_MAGIC + _le(array(_ITEM, lines)))


class ShardLinesLost(RuntimeError):
    """The lines of a shard that shares its range cannot be told from the other shards'."""


def read_lines(storage: Storage, batch_id: str, shard_index: int) -> list[int] | None:
    """The lines of a shard cut along prefix groups, in run order; None for a shard that holds
    its whole range (none was stored). Raises :class:`ShardLinesLost` for one unreadable."""
    try:
        with storage.reader(lines_key(batch_id, shard_index)) as stream:
            data = stream.read()
    except ObjectNotFound:
        return None
    body = data[len(_LINES_MAGIC) :]
    if data[: len(_LINES_MAGIC)] != _LINES_MAGIC or len(body) % 4:
        raise ShardLinesLost(f"batch {batch_id} shard {shard_index}: its line list is unreadable")
    flat = array(_ITEM)
    flat.frombytes(body)
    if sys.byteorder != "little":
        flat.byteswap()
    return flat.tolist()
