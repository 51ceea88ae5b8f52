"""Shard planning: contiguous, token-sized line/byte ranges."""

from __future__ import annotations

import io
import json

import pytest

from core.batches.sharding import ShardPlanner, ShardSpec
from core.batchfile.reader import iter_lines, parse_request, validate_file
from core.batchfile.request import CHAT_URL, BatchRequest
from core.llms.generation import estimate_tokens


def plan(
    items: list[tuple[int, int, int, int]], max_tokens: int, max_requests: int
) -> list[ShardSpec]:
    p = ShardPlanner(max_tokens, max_requests)
    for it in items:
        p.add(*it)
    return p.finish()


def evenly(n: int, tokens: int = 10, length: int = 10) -> list[tuple[int, int, int, int]]:
    """n requests on lines 1..n, each ``length`` bytes."""
    return [(i + 1, i * length, length, tokens) for i in range(n)]


def test_empty() -> None:
    assert ShardPlanner(10, 10).finish() == []


def test_single_shard() -> None:
    assert plan(evenly(3), 100, 100) == [ShardSpec(0, 1, 4, 0, 30, 3, 30)]


def test_split_by_requests() -> None:
    specs = plan(evenly(5), 1000, 2)
    assert [(s.index, s.start_line, s.end_line, s.num_requests) for s in specs] == [
        (0, 1, 3, 2),
        (1, 3, 5, 2),
        (2, 5, 6, 1),
    ]
    assert [(s.start_offset, s.end_offset) for s in specs] == [(0, 20), (20, 40), (40, 50)]


def test_split_by_tokens_boundaries() -> None:
    # Exactly at the limit stays in; one token more starts a new shard.
    assert [s.num_requests for s in plan(evenly(4, tokens=5), 10, 100)] == [2, 2]
    items = [(1, 0, 10, 5), (2, 10, 10, 6), (3, 20, 10, 4), (4, 30, 10, 1)]
    specs = plan(items, 10, 100)
    assert [(s.start_line, s.end_line, s.est_tokens) for s in specs] == [
        (1, 2, 5),
        (2, 4, 10),
        (4, 5, 1),
    ]


def test_oversized_request_gets_its_own_shard() -> None:
    items = [(1, 0, 10, 3), (2, 10, 10, 500), (3, 20, 10, 3)]
    specs = plan(items, 100, 100)
    assert [(s.start_line, s.end_line, s.num_requests, s.est_tokens) for s in specs] == [
        (1, 2, 1, 3),
        (2, 3, 1, 500),
        (3, 4, 1, 3),
    ]
    first = plan([(1, 0, 10, 500), (2, 10, 10, 1)], 100, 100)
    assert [s.num_requests for s in first] == [1, 1]


def test_gaps_between_requests_belong_to_the_earlier_shard() -> None:
    # Lines 1, 4 and 9 are requests; 2-3 and 5-8 are blank; the file starts with a BOM.
    items = [(1, 3, 20, 5), (4, 30, 20, 5), (9, 70, 20, 5)]
    specs = plan(items, 5, 100)
    assert [(s.start_line, s.end_line, s.start_offset, s.end_offset) for s in specs] == [
        (1, 4, 3, 30),
        (4, 9, 30, 70),
        (9, 10, 70, 90),
    ]
    for a, b in zip(specs, specs[1:], strict=False):
        assert (a.end_line, a.end_offset) == (b.start_line, b.start_offset)


def test_add_returns_closed_shard_and_rejects_misuse() -> None:
    p = ShardPlanner(10, 1)
    assert p.add(1, 0, 5, 1) is None
    closed = p.add(2, 5, 5, 1)
    assert closed == ShardSpec(0, 1, 2, 0, 5, 1, 1) and p.shards == [closed]
    with pytest.raises(ValueError):
        p.add(2, 10, 5, 1)  # line not increasing
    with pytest.raises(ValueError):
        p.add(3, 7, 5, 1)  # overlaps the previous request
    specs = p.finish()
    assert p.finish() == specs and len(specs) == 2
    with pytest.raises(RuntimeError):
        p.add(9, 100, 5, 1)
    with pytest.raises(ValueError):
        ShardPlanner(0, 1)


def _chat(custom_id: str, content: str, **body: object) -> bytes:
    b = {"model": "m", "messages": [{"role": "user", "content": content}], **body}
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": CHAT_URL, "body": b}
    ).encode()


def _weight(req: BatchRequest) -> int:
    """A request's planned tokens, its prompt counted at 4 characters a token."""
    prompt_len = sum(len(m["content"]) for m in req.messages or ()) // 4 + 1
    return estimate_tokens(req, prompt_len, context=4096)


def test_planned_ranges_reread_every_request_once() -> None:
    """End to end with the validator: every request lands in exactly one shard, in order."""
    lines = []
    for i in range(40):
        lines.append(_chat(f"r{i}", "word " * (i % 7 * 20), max_tokens=16))
        if i % 5 == 0:
            lines.append(b"")  # interior blank lines
    data = b"\xef\xbb\xbf" + b"\r\n".join(lines) + b"\r\n\r\n"
    planner = ShardPlanner(max_tokens_per_shard=150, max_requests_per_shard=6)
    report = validate_file(
        io.BytesIO(data),
        endpoint=CHAT_URL,
        served_models=["m"],
        max_requests=100,
        max_line_bytes=10_000,
        on_request=lambda r: planner.add(r.line, r.offset, r.length, _weight(r)),
    )
    assert report.ok
    specs = planner.finish()
    assert len(specs) > 5
    ids: list[str] = []
    for s in specs:
        assert 1 <= s.num_requests <= 6
        assert s.est_tokens <= 150 or s.num_requests == 1
        got = [
            parse_request(r, endpoint=CHAT_URL, served_models=None)
            for r in iter_lines(
                io.BytesIO(data[s.start_offset : s.end_offset]),
                max_line_bytes=10_000,
                first_line=s.start_line,
                base_offset=s.start_offset,
            )
        ]
        assert len(got) == s.num_requests
        assert all(s.start_line <= r.line < s.end_line for r in got)
        assert sum(_weight(r) for r in got) == s.est_tokens
        ids += [r.custom_id for r in got]
    assert ids == [f"r{i}" for i in range(40)]
    assert specs[0].start_offset == 3
