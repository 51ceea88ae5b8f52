"""``JsonReader`` reads what ``json.loads`` reads, whatever the size of the reads it is fed,
and holds only the value it is on."""

from __future__ import annotations

import io
import json
import random
from typing import Any

import pytest

from core.batchfile.streamed_json import JsonReader

READ_SIZES = (1, 2, 3, 5, 16, 4096)

DOCUMENTS = [
    "{}",
    "[]",
    " \t\n{ } \r\n",
    '{"requests": []}',
    '{"requests": [1, 2.5, -3e-2, 12345678901234567890, true, false, null]}',
    '{"a": {"b": [[], {}, [{"c": "d"}]]}, "requests": [{"x": "\\u00e9\\ud83d\\ude00"}]}',
    '{"requests": [{"custom_id": "a\\"b\\\\", "params": {"s": "line\\nbreak"}}], "z": 1}',
    '{"requests": "not an array", "requests": [1]}',
    '{"k": NaN, "l": Infinity, "m": -Infinity}',
    '"just a string"',
    "123456",
    "  -0.5e+10  ",
    '["é", "日本語", "\U0001f600"]',
    '{"deep": ' + "[" * 50 + "]" * 50 + "}",
]

INVALID = [
    "",
    "   ",
    "{",
    '{"a"}',
    '{"a": }',
    '{"a": 1,}',
    '{"a": 1 "b": 2}',
    "[1, 2,]",
    "[1 2]",
    '{"requests": [1, 2] ',
    '{"requests": [1, 2]} x',
    "{} {}",
    '{"a": "unterminated}',
    '{"a": tru}',
    '{"a": 1.}',
    '{"a": "\\u12"}',
    '{"a": "raw\ncontrol"}',
    "{'single': 1}",
    '{"a": 1}]',
    "[1, 2",
    "01",
]


def _walk(reader: JsonReader) -> Any:
    """The document, rebuilt from members and items wherever they apply."""
    first = reader.peek()
    if first == "{":
        return {name: _walk(reader) for name in reader.members()}
    if first == "[":
        return list(reader.items())
    return reader.value()


def _read_all(text: str, size: int) -> Any:
    reader = JsonReader(io.StringIO(text).read, read_chars=size)
    value = _walk(reader)
    reader.end()
    return value


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@pytest.mark.parametrize("size", READ_SIZES)
@pytest.mark.parametrize("text", DOCUMENTS)
def test_reads_what_json_loads_reads(text: str, size: int) -> None:
    assert _same(_read_all(text, size), json.loads(text))


@pytest.mark.parametrize("size", READ_SIZES)
@pytest.mark.parametrize("text", INVALID)
def test_refuses_what_json_loads_refuses(text: str, size: int) -> None:
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    with pytest.raises(json.JSONDecodeError):
        _read_all(text, size)


def _random_value(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.randint(-(10**20), 10**20)
    if kind == 2:
        return rng.uniform(-1e6, 1e6)
    if kind in (3, 4):
        return "".join(rng.choice('ab"\\\n\té日\U0001f600 ') for _ in range(rng.randrange(12)))
    if kind in (5, 6):
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {f"k{rng.randrange(9)}": _random_value(rng, depth + 1) for _ in range(rng.randrange(5))}


def test_random_documents_at_every_read_size() -> None:
    rng = random.Random(7)
    for _ in range(300):
        value = {"requests": [_random_value(rng, 1) for _ in range(rng.randrange(6))]}
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        for size in (1, 7, 64):
            assert _same(_read_all(text, size), json.loads(text))


def test_holds_one_item_at_a_time_and_stops_at_the_first_error() -> None:
    """A long array of small items keeps the buffer small; a document that is invalid near
    its start is refused without reading what follows."""
    item = '{"custom_id": "x", "params": {"text": "' + "y" * 1000 + '"}}'
    count = 2000
    text = '{"requests": [' + ", ".join([item] * count) + "]}"
    stream = io.StringIO(text)
    reader = JsonReader(stream.read, read_chars=4096)
    largest = 0
    seen = 0
    for name in reader.members():
        assert name == "requests"
        for value in reader.items():
            assert value["custom_id"] == "x"
            seen += 1
            largest = max(largest, len(reader._buf))
    reader.end()
    assert seen == count
    assert largest < 16 * 1024, largest

    broken = '{"requests": [{"custom_id": x}, ' + ", ".join([item] * count) + "]}"
    stream = io.StringIO(broken)
    reader = JsonReader(stream.read, read_chars=4096)
    with pytest.raises(json.JSONDecodeError):
        for _name in reader.members():
            for _value in reader.items():
                pass
    assert stream.tell() <= 3 * 4096


def test_one_long_value_costs_linear_reads() -> None:
    """A value far longer than a read is decoded again only as the buffer doubles."""
    text = '{"requests": ["' + "z" * 1_000_000 + '"]}'
    reads = 0
    stream = io.StringIO(text)

    def read(n: int) -> str:
        nonlocal reads
        reads += 1
        return stream.read(n)

    reader = JsonReader(read, read_chars=1024)
    for _name in reader.members():
        assert [len(v) for v in reader.items()] == [1_000_000]
    reader.end()
    assert reads < 40, reads
