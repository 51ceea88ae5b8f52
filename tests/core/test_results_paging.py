"""The pure parts of results paging and retries: which chunk slices a page reads, which result
lines a retry takes, and how a batch's lines read with its retries'."""

from __future__ import annotations

import pytest

from core.batches.retry import merge_with_retries, retry_kind
from core.batchfile.results import batch_error_line, output_line, request_error_line
from core.database.results_log import Slice, plan_page

CHUNKS = [(0, 3, "a"), (3, 2, "b"), (5, 4, "c")]  # seqs 0-2, 3-4, 5-8


def _lines(chunks, start, limit):
    """The seqs a plan reads, from its slices."""
    firsts = {key: first for first, _, key in chunks}
    slices, more = plan_page(chunks, start, limit)
    return [firsts[s.key] + s.skip + i for s in slices for i in range(s.take)], more


@pytest.mark.parametrize(
    ("start", "limit", "want", "more"),
    [
        (0, 100, list(range(9)), False),
        (0, 3, [0, 1, 2], True),  # a page ending on a chunk's end still sees the next chunk
        (1, 3, [1, 2, 3], True),
        (4, 2, [4, 5], True),
        (7, 5, [7, 8], False),
        (9, 5, [], False),
        (0, 9, list(range(9)), False),
    ],
)
def test_plan_page_reads_each_line_once_in_seq_order(start, limit, want, more):
    assert _lines(CHUNKS, start, limit) == (want, more)


def test_pages_chained_by_their_last_line_cover_the_log_exactly_once():
    for limit in range(1, 11):
        seen, start = [], 0
        while True:
            page, more = _lines(CHUNKS, start, limit)
            seen += page
            if not more:
                break
            start = page[-1] + 1
        assert seen == list(range(9)), limit


def test_plan_page_slices():
    assert plan_page(CHUNKS, 2, 4) == ([Slice("a", 2, 1), Slice("b", 0, 2), Slice("c", 0, 1)], True)
    assert plan_page([], 0, 10) == ([], False)


def test_retry_kind():
    assert retry_kind(batch_error_line("x", "batch_expired")) == "expired"
    assert retry_kind(batch_error_line("x", "batch_cancelled")) == "cancelled"
    assert retry_kind(batch_error_line("x", "other", "m")) is None
    server = request_error_line("x", status_code=500, message="m", code="server_error")
    assert retry_kind(server) == "failed"
    assert retry_kind(request_error_line("x", status_code=429, message="m", code="r")) == "failed"
    own = request_error_line("x", status_code=400, message="m", code="context_length_exceeded")
    assert retry_kind(own) is None  # the request's own fault: it would fail again
    assert retry_kind(output_line("x", {"ok": True})) is None
    assert retry_kind({"custom_id": "x"}) is None


def test_merge_with_retries_keeps_input_order_and_takes_the_latest():
    parent = [
        {"custom_id": "a", "v": 0},
        {"custom_id": "c", "v": 0},
        {"custom_id": "b", "v": 0},
    ]
    first = [{"custom_id": "b", "v": 1}, {"custom_id": "c", "v": 1}]
    second = [{"custom_id": "b", "v": 2}]
    merged = merge_with_retries(["a", "b", "c"], [parent, first, second])
    assert merged == [
        {"custom_id": "a", "v": 0},
        {"custom_id": "b", "v": 2},
        {"custom_id": "c", "v": 1},
    ]
    # A line whose custom_id the input does not name still comes out, after the rest.
    assert merge_with_retries(["a"], [[{"custom_id": "z"}, {"custom_id": "a"}]]) == [
        {"custom_id": "a"},
        {"custom_id": "z"},
    ]
