"""Estimates nobody waits for cost nothing: a scan stops once its caller has gone, and one
tenant holds at most ``max_estimates_per_tenant`` estimates at a time."""

from __future__ import annotations

import time

import pytest

from testkit.builders.worker import chat_line, jsonl

pytestmark = pytest.mark.services


def test_a_scan_stops_when_its_caller_has_gone(worker_env) -> None:
    from worker.infra.task_io import storage
    from worker.validation.scan import CallerGone, scan_input

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


def test_estimates_never_take_every_control_thread(worker_env) -> None:
    """While a worker runs ``estimate_scans_per_worker`` scans (one by default, of its two
    control threads), the next estimate is answered busy at once, not scanned: a flood of
    estimates leaves a thread for validations, finalizes and cancels."""
    from kombu import Connection

    from core.broker import request_reply
    from core.settings import get_settings
    from worker.infra.task_io import storage
    from worker.validation import estimate

    with storage().writer("files/estimate-busy") as out:
        out.write(jsonl([chat_line("r0", "count the stars")]))
    reply_to = request_reply.REPLY_PREFIX + f"busy-{time.monotonic_ns()}"
    with Connection(get_settings().broker_url) as conn:
        replies = conn.SimpleQueue(reply_to, serializer="json")
        try:
            slots = estimate._scan_slots()
            assert slots.acquire(blocking=False)  # a scan is running
            try:
                args = ("files/estimate-busy", "/v1/chat/completions", reply_to, time.time() + 30)
                estimate.estimate_task(*args)
                assert replies.get(timeout=10).payload == {"ok": False, "busy": True}
            finally:
                slots.release()
            estimate.estimate_task(*args)  # a slot is free: scanned
            answer = replies.get(timeout=10).payload
            assert answer["ok"] and answer["valid_requests"] == 1
        finally:
            replies.queue.delete()
            replies.close()
