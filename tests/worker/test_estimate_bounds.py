"""Estimates nobody waits for cost nothing: a scan stops once its caller has gone, and one
tenant holds at most ``max_estimates_per_tenant`` estimates at a time."""

from __future__ import annotations

import time

import pytest

from tests.helpers.worker import chat_line, jsonl

pytestmark = pytest.mark.services


def test_a_scan_stops_when_its_caller_has_gone(worker_env) -> None:
    from worker.common import storage
    from worker.tasks import CallerGone, scan_input

    with storage().writer("files/estimate-me") as out:
        out.write(jsonl([chat_line(f"r{i}", "count the stars") for i in range(600)]))
    with pytest.raises(CallerGone, match="line 256"):
        scan_input("files/estimate-me", "/v1/chat/completions", deadline=time.time() - 1)
    assert scan_input("files/estimate-me", "/v1/chat/completions").report.num_requests == 600


def test_one_tenant_holds_a_bounded_number_of_estimates() -> None:
    from api.errors import APIError
    from api.services.estimates import _estimate_slot

    with _estimate_slot("t", 2), _estimate_slot("t", 2):
        with pytest.raises(APIError) as refused, _estimate_slot("t", 2):
            pass
        assert refused.value.status_code == 429
        with _estimate_slot("other", 2):  # another tenant is not held back
            pass
    with _estimate_slot("t", 2):  # released when answered
        pass
