"""``GET /metrics`` on a real API server: HTTP requests, refusals by reason, upload bytes and
the database gauges move with what the test does."""

from __future__ import annotations

import pytest

from testkit.metrics.scrape import scrape, total, value

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


def test_an_odd_method_is_counted_as_other(server) -> None:
    """Clients may send methods beyond the standard ones (the HTTP parser passes WebDAV's and
    others on; another server or parser passes any token), and each distinct label value is a
    time series kept for good: methods outside the standard set are counted as "other"."""
    import httpx

    url = f"{server.url}/metrics"
    before = scrape(url)
    assert httpx.request("PROPFIND", f"{server.url}/healthz", timeout=10).status_code == 405
    assert httpx.request("GET", f"{server.url}/healthz", timeout=10).status_code == 200
    after = scrape(url)

    def moved(**labels: str) -> float:
        name = "batchd_http_requests_total"
        return value(after, name, handler="/healthz", **labels) - value(
            before, name, handler="/healthz", **labels
        )

    assert moved(method="other", status="405") == 1
    assert moved(method="GET", status="200") == 1
    methods = {dict(labels).get("method") for name, labels in after if "_http_" in name}
    assert methods <= {"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "other", None}


def test_metrics_can_be_switched_off(start_server) -> None:
    server = start_server(BATCHD_METRICS_ENABLED="false")
    with server.http(api_key=None) as http:
        assert http.get("/metrics").status_code in (401, 404)


def test_metrics_token(start_server) -> None:
    server = start_server(BATCHD_METRICS_TOKEN="scrape-secret-token")
    with server.http(api_key=None) as http:
        refused = http.get("/metrics")
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"] == "Bearer"
        assert refused.json()["error"]["code"] == "invalid_metrics_token"
        wrong = http.get("/metrics", headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401
        # An API key is no metrics token.
        api_key = http.get("/metrics", headers={"authorization": f"Bearer {server.api_key}"})
        assert api_key.status_code == 401
        ok = http.get("/metrics", headers={"authorization": "Bearer scrape-secret-token"})
        assert ok.status_code == 200 and "batchd_database_up 1.0" in ok.text


def _count_queries(url: str):
    """A list that grows by one for each statement run on ``url``'s engine (the real one the
    gauges use), and a function that stops counting."""
    from sqlalchemy import event

    from core.database.sessions import get_engine

    engine = get_engine(url)
    statements: list[str] = []

    def count(_conn, _cursor, statement, *_args) -> None:
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    return statements, lambda: event.remove(engine, "before_cursor_execute", count)


def test_database_gauges_are_read_once_per_interval(service_env, pg_url) -> None:
    import time

    from fastapi.testclient import TestClient

    from api.app import create_app
    from core.settings import Settings

    statements, stop = _count_queries(pg_url)
    try:
        with TestClient(create_app(Settings(metrics_cache_s=3600))) as client:
            assert statements == []  # creating the app reads nothing
            first = client.get("/metrics")
            assert first.status_code == 200 and "batchd_database_up 1.0" in first.text
            per_scrape = len(statements)
            assert per_scrape >= 3, statements  # batches, shards, pending work
            for _ in range(5):
                again = client.get("/metrics")
                assert "batchd_database_up 1.0" in again.text
            assert len(statements) == per_scrape, statements[per_scrape:]
        statements.clear()
        with TestClient(create_app(Settings(metrics_cache_s=3))) as client:
            client.get("/metrics")
            client.get("/metrics")
            assert len(statements) == per_scrape
            time.sleep(3.1)
            client.get("/metrics")
            assert len(statements) == 2 * per_scrape
    finally:
        stop()
