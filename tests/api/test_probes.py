"""The probes a cluster expects: ``/livez`` answers without touching anything (a database
outage must not restart the API), ``/readyz`` names what is unreachable."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.api.conftest import Server

pytestmark = pytest.mark.services


def test_ready_when_database_broker_and_storage_answer(server: Server) -> None:
    with server.http(api_key=None) as http:
        ready = http.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json() == {
            "status": "ok",
            "checks": {"database": "ok", "broker": "ok", "storage": "ok"},
        }
        assert http.get("/livez").json() == {"status": "ok"}


def test_alive_but_not_ready_without_the_database(
    start_server: Callable[..., Server], closed_port: int
) -> None:
    server = start_server(
        BATCHD_DATABASE_URL=f"postgresql+psycopg://postgres@127.0.0.1:{closed_port}/none"
    )
    with server.http(api_key=None) as http:
        assert http.get("/livez").status_code == 200
        ready = http.get("/readyz")
        assert ready.status_code == 503
        checks = ready.json()["checks"]
        assert checks["database"] != "ok" and checks["broker"] == checks["storage"] == "ok"
        assert http.get("/healthz").status_code == 503


def test_not_ready_without_the_broker_or_storage(
    start_server: Callable[..., Server], closed_port: int, tmp_path
) -> None:
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the storage directory should be")
    server = start_server(
        BATCHD_BROKER_URL=f"redis://127.0.0.1:{closed_port}/0",
        BATCHD_STORAGE_URL=str(blocked),
    )
    with server.http(api_key=None) as http:
        assert http.get("/livez").status_code == 200
        ready = http.get("/readyz")
        assert ready.status_code == 503
        checks = ready.json()["checks"]
        assert checks["database"] == "ok"
        assert checks["broker"] != "ok" and checks["storage"] != "ok", checks
