"""``GET /metrics`` on a real API server: HTTP requests, refusals by reason, upload bytes and
the database gauges move with what the test does."""

from __future__ import annotations

import pytest

from tests.helpers.scrape import scrape, total, value

pytestmark = pytest.mark.services


def test_metrics_count_requests_rejections_and_uploads(server) -> None:
    url = f"{server.url}/metrics"
    before = scrape(url)
    body = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
    with server.http() as http:
        created = http.post(
            "/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", body)}
        )
        assert created.status_code == 200, created.text
        assert http.get("/v1/batches/batch_nope").status_code == 404
    with server.http(api_key=None) as anonymous:
        assert anonymous.get("/v1/files").status_code == 401
    after = scrape(url)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("batchd_upload_bytes_total") == len(body)
    assert moved("batchd_uploads_total") == 1
    assert moved("batchd_rejections_total", reason="unauthorized") == 1
    assert moved("batchd_rejections_total", reason="not_found") == 1
    assert (
        moved("batchd_http_requests_total", handler="/v1/files", method="POST", status="200") == 1
    )
    assert (
        moved(
            "batchd_http_requests_total",
            handler="/v1/batches/{batch_id}",
            method="GET",
            status="404",
        )
        == 1
    )
    assert total(after, "batchd_http_request_duration_seconds_count", handler="/v1/files") >= 2
    # the database gauges: the scrape read Postgres; the served model reports pending work
    assert value(after, "batchd_database_up") == 1
    models = {
        dict(labels).get("model") for name, labels in after if name == "batchd_pending_tokens"
    }
    assert models, "no pending-work gauge per model"


def test_metrics_can_be_switched_off(start_server) -> None:
    server = start_server(BATCHD_METRICS_ENABLED="false")
    with server.http(api_key=None) as http:
        assert http.get("/metrics").status_code in (401, 404)
