"""A token budget's pieces in a shard's run: what a prepared request may spend at most (the
worst case a line must fit in before it starts), and the line of a request the budget left
unstarted, which a retry takes as ``budget_exhausted`` and not as an ordinary 429."""

from __future__ import annotations

from core.batches.retry import RETRY_KINDS, retry_kind
from core.llms.generation import error_record
from engine import SamplingParams
from worker.shards.run import BUDGET_EXHAUSTED, worst_case_tokens


def test_the_worst_case_is_the_prompt_plus_the_output_bound():
    assert worst_case_tokens([1, 2, 3, 4], SamplingParams(max_tokens=16)) == 20
    # An embedding request's several inputs, and no output.
    assert worst_case_tokens([[1, 2], [3, 4, 5]], 384) == 5
    # What is not counted before it is sent (an upstream's body) reserves nothing: only the
    # tokens already spent decide whether it starts.
    assert worst_case_tokens({"messages": []}, None) == 0
    assert worst_case_tokens([], SamplingParams(max_tokens=8)) == 8


def test_a_budget_exhausted_line_is_its_own_retry_kind():
    line = error_record(
        "q1",
        BUDGET_EXHAUSTED,
        "not run: max_total_tokens=100 spent",
        status_code=429,
        type="insufficient_quota",
    )
    assert line["response"]["status_code"] == 429
    assert line["response"]["body"]["error"]["code"] == "budget_exhausted"
    assert retry_kind(line) == "budget_exhausted" and "budget_exhausted" in RETRY_KINDS
    throttled = error_record("q2", "rate_limit_exceeded", "slow down", status_code=429)
    assert retry_kind(throttled) == "failed"
