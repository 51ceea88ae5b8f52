"""The dashboard's HTTP side on a real API server (the browser test drives it end to end):
the sign-in cookie, tenant isolation of ``/ui/data``, the admin view and the vendored assets."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.services

ADMIN = "sk-test-admin"


def _batch(server, key: str) -> str:
    body = (
        b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
        b'"body": {"model": "m", "messages": []}}\n'
    )
    with server.http(api_key=key) as http:
        f = http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("a.jsonl", body)})
        assert f.status_code == 200, f.text
        b = http.post(
            "/v1/batches",
            json={
                "input_file_id": f.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        assert b.status_code == 200, b.text
        return b.json()["id"]


def test_sign_in_isolation_and_admin(start_server, make_key) -> None:
    server = start_server(BATCHD_ADMIN_API_KEYS=ADMIN)
    mine, theirs = make_key(), make_key()
    batch_id = _batch(server, mine)
    with httpx.Client(base_url=server.url, timeout=30) as browser:
        page = browser.get("/ui")
        assert page.status_code == 200 and 'name="key"' in page.text
        assert browser.get("/ui/data").status_code == 401
        refused = browser.post("/ui/login", data={"key": "sk-bd-wrong"})
        assert refused.status_code == 401 and "not valid" in refused.text
        signed_in = browser.post("/ui/login", data={"key": mine})
        assert signed_in.status_code == 303
        cookie = signed_in.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/ui" in cookie
        page = browser.get("/ui")
        assert batch_id in page.text and "uPlot.iife.min.js" in page.text
        data = browser.get("/ui/data").json()
        assert [b["id"] for b in data["batches"]] == [batch_id]
        assert data["admin"] is False
        # The cookie opens the dashboard only: the API itself still wants a bearer key.
        assert browser.get("/v1/batches").status_code == 401
        browser.post("/ui/logout")
        assert browser.get("/ui/data").status_code == 401

    def ids(key: str) -> list[str]:
        r = httpx.get(f"{server.url}/ui/data", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return [b["id"] for b in r.json()["batches"]]

    assert batch_id not in ids(theirs)
    assert batch_id in ids(ADMIN)
    assets = [
        "/ui/static/ui.js",
        "/ui/static/ui.css",
        "/ui/static/vendor/uplot/uPlot.iife.min.js",
        "/ui/static/vendor/uplot/uPlot.min.css",
    ]
    for asset in assets:
        assert httpx.get(server.url + asset).status_code == 200, asset
