"""The dashboard's HTTP side on a real API server (the browser test drives it end to end):
sign-in sessions (the cookie holds a session token, never the key; a revoked key or an expired
session ends it), the cookie's attributes, CSRF tokens on the sign-in and sign-out forms, the
sign-in rate limit, tenant isolation of ``/ui/data``, the admin view and the vendored assets.

Each simulated browser connects from a loopback address of its own (``127.x.y.z``): sign-in
attempts are counted per client address, in the Redis every test server of the session
shares."""

from __future__ import annotations

import hashlib
import re
import secrets

import httpx
import pytest

pytestmark = pytest.mark.services

ADMIN = "sk-test-admin-static"
CSRF = re.compile(r'name="csrf" value="([^"]*)"')


def _browser(server) -> httpx.Client:
    source = f"127.{secrets.randbelow(250) + 1}.{secrets.randbelow(250) + 1}.{secrets.randbelow(250) + 1}"
    transport = httpx.HTTPTransport(local_address=source)
    return httpx.Client(base_url=server.url, timeout=30, transport=transport)


def _csrf(page: httpx.Response) -> str:
    match = CSRF.search(page.text)
    assert match, page.text
    return match.group(1)


def _sign_in(browser: httpx.Client, key: str) -> httpx.Response:
    """Open the sign-in page, then post the key with the page's CSRF token."""
    page = browser.get("/ui")
    assert page.status_code == 200 and 'name="key"' in page.text
    return browser.post("/ui/login", data={"key": key, "csrf": _csrf(page)})


def _session_rows(pg_url: str) -> dict[str, tuple[str, object]]:
    from core.database.sessions import session_scope
    from core.database.tables import UiSession

    with session_scope(pg_url) as session:
        return {r.id: (r.key_hash, r.expires_at) for r in session.query(UiSession).all()}


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


def test_sign_in_isolation_and_admin(start_server, make_key, pg_url) -> None:
    from core.database.auth import hash_key

    server = start_server(BATCHD_ADMIN_API_KEYS=ADMIN)
    mine, theirs = make_key(), make_key()
    batch_id = _batch(server, mine)
    with _browser(server) as browser:
        assert browser.get("/ui/data").status_code == 401
        refused = _sign_in(browser, "sk-bd-wrong")
        assert refused.status_code == 401 and "not valid" in refused.text
        signed_in = _sign_in(browser, mine)
        assert signed_in.status_code == 303
        cookie = signed_in.headers["set-cookie"]
        attributes = cookie.lower()
        assert "httponly" in attributes and "samesite=strict" in attributes
        assert "path=/ui" in attributes and "max-age=" in attributes
        assert "secure" not in attributes  # served on loopback only
        # The cookie holds a session token; the key is neither in it nor in the database.
        token = browser.cookies["batchd_ui_session"]
        assert mine not in cookie and token != mine
        sessions = _session_rows(pg_url)
        assert sessions[hashlib.sha256(token.encode()).hexdigest()][0] == hash_key(mine)
        assert not any(mine in (sid, key_hash) for sid, (key_hash, _) in sessions.items())

        page = browser.get("/ui")
        assert batch_id in page.text and "uPlot.iife.min.js" in page.text
        data = browser.get("/ui/data").json()
        assert [b["id"] for b in data["batches"]] == [batch_id]
        assert data["admin"] is False
        # The cookie opens the dashboard only: the API itself still wants a bearer key.
        assert browser.get("/v1/batches").status_code == 401

        # Signing out needs the page's token; a forged form changes nothing.
        forged = browser.post("/ui/logout", data={"csrf": "forged"})
        assert forged.status_code == 403
        assert browser.get("/ui/data").status_code == 200
        signed_out = browser.post("/ui/logout", data={"csrf": _csrf(page)})
        assert signed_out.status_code == 303
        assert browser.get("/ui/data").status_code == 401
        assert hashlib.sha256(token.encode()).hexdigest() not in _session_rows(pg_url)

    def ids(key: str) -> list[str]:
        r = httpx.get(f"{server.url}/ui/data", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return [b["id"] for b in r.json()["batches"]]

    assert batch_id not in ids(theirs)
    assert batch_id in ids(ADMIN)
    with _browser(server) as admin:
        assert _sign_in(admin, ADMIN).status_code == 303
        assert admin.get("/ui/data").json()["admin"] is True
    assets = [
        "/ui/static/ui.js",
        "/ui/static/ui.css",
        "/ui/static/vendor/uplot/uPlot.iife.min.js",
        "/ui/static/vendor/uplot/uPlot.min.css",
    ]
    for asset in assets:
        assert httpx.get(server.url + asset).status_code == 200, asset


def test_sign_in_needs_the_forms_csrf_token(server, api_key) -> None:
    with _browser(server) as browser:
        # No token, or a token without its cookie (another site's form): refused.
        assert browser.post("/ui/login", data={"key": api_key}).status_code == 403
        page = browser.get("/ui")
        assert "samesite=strict" in page.headers["set-cookie"].lower()
        token = _csrf(page)
        wrong = browser.post("/ui/login", data={"key": api_key, "csrf": token[::-1]})
        assert wrong.status_code == 403 and "expired" in wrong.text
        assert "batchd_ui_session" not in browser.cookies
    with _browser(server) as other:  # the right token, but not this browser's cookie
        assert other.post("/ui/login", data={"key": api_key, "csrf": token}).status_code == 403
        assert other.get("/ui/data").status_code == 401
    with _browser(server) as browser:
        assert _sign_in(browser, api_key).status_code == 303
        assert browser.get("/ui/data").status_code == 200


def test_revoked_key_or_expired_session_ends_the_sign_in(server, make_key, pg_url) -> None:
    from core.database.auth import revoke_key
    from core.database.lifecycle import now
    from core.database.sessions import session_scope
    from core.database.tables import ApiKey, UiSession

    revoked, expiring = make_key(name="to revoke"), make_key(name="to expire")
    with _browser(server) as first, _browser(server) as second:
        assert _sign_in(first, revoked).status_code == 303
        assert _sign_in(second, expiring).status_code == 303
        assert first.get("/ui/data").status_code == second.get("/ui/data").status_code == 200
        with session_scope(pg_url) as session:
            key_id = session.query(ApiKey).filter_by(name="to revoke").one().id
            revoke_key(session, key_id)
            token = second.cookies["batchd_ui_session"]
            row = session.get(UiSession, hashlib.sha256(token.encode()).hexdigest())
            row.expires_at = now()
        assert first.get("/ui/data").status_code == 401
        assert second.get("/ui/data").status_code == 401
        assert 'name="key"' in second.get("/ui").text


def test_cookies_are_secure_unless_bound_to_loopback(start_server, api_key) -> None:
    """The server listens on 127.0.0.1 here, but is told (BATCHD_API_HOST) it is bound to every
    address, as behind a TLS proxy: its cookies are Secure."""
    server = start_server(BATCHD_API_HOST="0.0.0.0")
    with _browser(server) as browser:
        page = browser.get("/ui")
        assert "; secure" in page.headers["set-cookie"].lower()
        # (httpx, like a browser, keeps Secure cookies off plain http: sent by hand here)
        token = _csrf(page)
        signed_in = browser.post(
            "/ui/login",
            data={"key": api_key, "csrf": token},
            headers={"cookie": f"batchd_ui_csrf={token}"},
        )
        assert signed_in.status_code == 303, signed_in.text
        cookie = signed_in.headers["set-cookie"].lower()
        assert "; secure" in cookie and "httponly" in cookie and "samesite=strict" in cookie


def test_sign_in_attempts_are_rate_limited_per_client(start_server, api_key) -> None:
    server = start_server(BATCHD_UI_LOGIN_ATTEMPTS_PER_MINUTE="3")
    with _browser(server) as browser:
        page = browser.get("/ui")
        form = {"key": "sk-bd-guess", "csrf": _csrf(page)}
        assert [browser.post("/ui/login", data=form).status_code for _ in range(3)] == [401] * 3
        limited = browser.post("/ui/login", data={**form, "key": api_key})
        assert limited.status_code == 429 and "Too many sign-in attempts" in limited.text
        assert int(limited.headers["retry-after"]) >= 1
        assert "batchd_ui_session" not in browser.cookies
    with _browser(server) as elsewhere:  # another client address has attempts of its own
        assert _sign_in(elsewhere, api_key).status_code == 303
