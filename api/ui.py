"""The dashboard: ``/ui``, a server-rendered page behind the same API keys as the API.

A browser cannot send a bearer header when it opens a page, so ``/ui`` asks for the key once
(``POST /ui/login``) and starts a session. Invariants: the cookie holds a random session token,
never the key; the database keeps only SHA-256s and an expiry, and every request checks the key
again (a revoked key ends its sessions at once); cookies are HttpOnly, SameSite=Strict, scoped
to ``/ui`` and Secure unless the API is local only (:mod:`api.local`); every POST form carries
a CSRF token (sign-in: a random token matching its own cookie; sign-out: one derived from the
session token); sign-in attempts are rate-limited per client address. Scripts may send
``Authorization: Bearer`` to ``/ui`` and ``/ui/data`` instead. The page is plain HTML with a
small script (``static/ui.js``, uPlot vendored) polling ``/ui/data``: no build step. Its data:
:mod:`api.services.dashboard`.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import secrets
import string
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Form, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from api.deps import (
    Caller,
    SessionDep,
    SettingsDep,
    anonymous_admin,
    identify_digest,
    identify_key,
    identify_throttled,
    rate_buckets,
)
from api.errors import APIError
from api.limits import auth_enabled, retry_after_header
from api.local import local_only
from api.services.dashboard import DashboardPoller, dashboard_data, end_session, start_session
from core.database.auth import ui_session_key
from core.settings import Settings

SESSION_COOKIE = "batchd_ui_session"
CSRF_COOKIE = "batchd_ui_csrf"
#: The cookie that held the key itself before sessions: cleared wherever it still is.
LEGACY_COOKIE = "batchd_ui_key"
LOGIN_BUCKET = "ui-login:"
HERE = Path(__file__).resolve().parent
TEMPLATE = string.Template((HERE / "templates" / "ui.html").read_text())
LOGIN_TEMPLATE = string.Template((HERE / "templates" / "ui_login.html").read_text())

router = APIRouter(prefix="/ui", include_in_schema=False)


# -- who is watching


def _bearer(request: Request) -> str | None:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return None


def ui_caller(request: Request, settings: SettingsDep, session: SessionDep) -> Caller | None:
    """The caller (by bearer key, or by the session cookie), or None when no valid key or
    live session came with the request (the page asks for a key)."""
    if not auth_enabled(settings):
        return anonymous_admin(settings, request)
    presented = _bearer(request)
    if presented is not None:
        try:
            return identify_throttled(request, settings, session, presented)
        except APIError as refused:
            if refused.status_code == 429:
                raise  # throttled: not a page that asks for another key
            return None
    token = request.cookies.get(SESSION_COOKIE)
    found = ui_session_key(session, token) if token else None
    return None if found is None else identify_digest(settings, session, found[0])


def _secure(settings: Settings, request: Request) -> bool:
    """Cookies are Secure unless only this machine reaches the API (plain http there)."""
    return not local_only(settings, request)


def _set_cookie(
    response: Response, settings: Settings, request: Request, name: str, value: str, **extra: Any
) -> None:
    response.set_cookie(
        name,
        value,
        httponly=True,
        samesite="strict",
        path="/ui",
        secure=_secure(settings, request),
        **extra,
    )


def _logout_token(session_token: str) -> str:
    """The sign-out form's CSRF token: only a holder of the session token can make it."""
    return hmac.new(session_token.encode(), b"batchd-ui-logout", hashlib.sha256).hexdigest()


def _csrf_cookie(request: Request) -> str | None:
    value = request.cookies.get(CSRF_COOKIE, "")
    return value if 32 <= len(value) <= 128 and value.isascii() else None


UiCaller = Annotated[Caller | None, Depends(ui_caller)]


def _poller(request: Request) -> DashboardPoller:
    state = request.app.state
    poller = getattr(state, "ui_poller", None)
    if poller is None:
        poller = state.ui_poller = DashboardPoller(state.settings)
    return poller


# -- pages


def _login_page(
    request: Request,
    settings: Settings,
    message: str = "",
    status_code: int = 200,
    headers: dict[str, str] | None = None,
) -> HTMLResponse:
    """The sign-in form, with its CSRF token (the one its cookie already holds, so that two
    tabs can both sign in, else a new one)."""
    csrf = _csrf_cookie(request) or secrets.token_urlsafe(32)
    body = LOGIN_TEMPLATE.substitute(message=html.escape(message), csrf=html.escape(csrf))
    response = HTMLResponse(
        body, status_code=status_code, headers={"cache-control": "no-store", **(headers or {})}
    )
    _set_cookie(response, settings, request, CSRF_COOKIE, csrf)
    if LEGACY_COOKIE in request.cookies:
        response.delete_cookie(LEGACY_COOKIE, path="/ui")
    return response


def _fmt_rate(rate: float | None) -> str:
    return "–" if rate is None else f"{rate:.1f}/s"


AT_RISK = " (at risk)"


def _fmt_eta(eta: float | None) -> str:
    if eta is None:
        return "–"
    eta = int(eta)
    return f"{eta // 3600}h{eta // 60 % 60:02d}m" if eta >= 3600 else f"{eta // 60}m{eta % 60:02d}s"


def _fmt_tokens(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1_000_000 else f"{n / 1e3:.1f}k" if n >= 1000 else str(n)


def _fmt_cache(b: dict[str, Any]) -> str:
    """Prompt tokens served from the prefix cache, of all, and what the plan predicted."""
    return (
        f"{_fmt_tokens(b['cached_tokens'])} of {_fmt_tokens(b['prompt_tokens'])} "
        f"(predicted {_fmt_tokens(b['shareable_tokens'])})"
    )


def _fmt_done(b: dict[str, Any]) -> str:
    """Requests done of all; with a token budget, the tokens spent of it."""
    done = f"{b['completed'] + b['failed']} / {b['total']}"
    if b.get("max_total_tokens") is None:
        return done
    return (
        f"{done} · {_fmt_tokens(b['spent_tokens'])} of {_fmt_tokens(b['max_total_tokens'])} tokens"
    )


def _batch_rows(batches: list[dict[str, Any]], admin: bool) -> str:
    rows = []
    for b in batches:
        e = {k: html.escape(str(v)) for k, v in b.items()}
        pct = round(100 * b["progress"], 1)
        model = html.escape(b["model"] or "–")
        tenant = f"<td class='tenant'>{e['tenant']}</td>" if admin else ""
        rows.append(
            f"<tr id='batch-{e['id']}' data-batch='{e['id']}'>"
            f"<td class='id'>{e['id']}</td>{tenant}<td class='model-name'>{model}</td>"
            f"<td class='status status-{e['status']}'>{e['status']}"
            f"{' (paused)' if b.get('paused') else ''}</td>"
            f"<td><div class='bar'><div class='fill' style='width:{pct}%'></div></div>"
            f"<span class='pct'>{pct}%</span></td>"
            f"<td class='done'>{_fmt_done(b)}</td>"
            f"<td class='rate'>{_fmt_rate(b['throughput'])}</td>"
            f"<td class='cache'>{_fmt_cache(b)}</td>"
            f"<td class='eta'>{_fmt_eta(b['eta_s'])}{AT_RISK if b['at_risk'] else ''}</td></tr>"
        )
    if not rows:
        cols = 9 if admin else 8
        rows.append(f"<tr class='empty'><td colspan='{cols}'>No batches yet.</td></tr>")
    return "\n".join(rows)


@router.get("", response_class=HTMLResponse)
def dashboard(
    request: Request, caller: UiCaller, session: SessionDep, settings: SettingsDep
) -> Response:
    if caller is None:
        return _login_page(request, settings)
    poller = _poller(request)
    poller.watch()
    data = dashboard_data(session, caller, poller)
    who = "all tenants (admin)" if caller.admin else f"tenant {caller.tenant}"
    body = TEMPLATE.substitute(
        who=html.escape(who),
        admin="true" if caller.admin else "false",
        tenant_header="<th>tenant</th>" if caller.admin else "",
        rows=_batch_rows(data["batches"], caller.admin),
        interval_ms=int(1000 * poller.interval),
        csrf=_logout_token(token) if (token := request.cookies.get(SESSION_COOKIE)) else "",
    )
    return HTMLResponse(body, headers={"cache-control": "no-store"})


@router.get("/data")
def data(request: Request, caller: UiCaller, session: SessionDep) -> Response:
    if caller is None:
        return JSONResponse({"error": "not signed in"}, status_code=401)
    poller = _poller(request)
    poller.watch()
    return JSONResponse(
        dashboard_data(session, caller, poller), headers={"cache-control": "no-store"}
    )


@router.post("/login")
def login(
    request: Request,
    settings: SettingsDep,
    session: SessionDep,
    key: Annotated[str, Form()],
    csrf: Annotated[str, Form()] = "",
) -> Response:
    if not auth_enabled(settings):
        anonymous_admin(settings, request)  # no sign-in needed, from this machine only
        return RedirectResponse("/ui", status_code=303)
    per_minute = settings.ui_login_attempts_per_minute
    if per_minute > 0:
        client = request.client.host if request.client else "unknown"
        wait = rate_buckets(request, settings).take(LOGIN_BUCKET + client, per_minute)
        if wait > 0:
            retry = retry_after_header(wait)
            return _login_page(
                request,
                settings,
                f"Too many sign-in attempts; retry in {retry} s.",
                status_code=429,
                headers={"Retry-After": retry},
            )
    expected = _csrf_cookie(request)
    if expected is None or not hmac.compare_digest(csrf.encode(), expected.encode()):
        return _login_page(
            request, settings, "The sign-in form had expired; please sign in again.", 403
        )
    key = key.strip()
    try:
        identify_key(settings, session, key)
    except APIError:
        return _login_page(request, settings, "That key is not valid.", status_code=401)
    ttl = settings.ui_session_ttl_s
    token = start_session(session, key, request.cookies.get(SESSION_COOKIE), ttl)
    response = RedirectResponse("/ui", status_code=303)
    _set_cookie(response, settings, request, SESSION_COOKIE, token, max_age=int(ttl))
    response.delete_cookie(LEGACY_COOKIE, path="/ui")
    return response


@router.post("/logout")
def logout(
    request: Request,
    settings: SettingsDep,
    session: SessionDep,
    csrf: Annotated[str, Form()] = "",
) -> Response:
    token = request.cookies.get(SESSION_COOKIE)
    if token:
        if not hmac.compare_digest(csrf.encode(), _logout_token(token).encode()):
            raise APIError(
                403, "The sign-out form had expired; reload the page.", code="csrf_token_invalid"
            )
        end_session(session, token)
    response = RedirectResponse("/ui", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/ui")
    response.delete_cookie(LEGACY_COOKIE, path="/ui")
    return response


def install(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/ui/static", StaticFiles(directory=HERE / "static"), name="ui-static")
