"""The dashboard: ``/ui``, a server-rendered page behind the same API keys as the API.

A tenant's key shows that tenant's batches; an admin key (``BATCHD_ADMIN_API_KEYS``) shows
every tenant's. A browser cannot send a bearer header when it opens a page, so ``/ui`` asks
for the key once (``POST /ui/login``) and starts a session: the browser's cookie holds a
random session token (never the key), the database only the token's SHA-256, the SHA-256 of
the key and an expiry (``ui_session_ttl_s``), and every request checks the key again, so a
revoked key ends its sessions at once. The cookie is HttpOnly, SameSite=Strict, scoped to
``/ui`` and Secure unless the API is reachable from this machine only (:mod:`api.local`; a
TLS proxy in front makes the request's scheme useless for that); the rest of the API never
reads it. Every POST form carries a CSRF token: the sign-in form a random token that must
match a cookie of its own (a page of another site can read neither), the sign-out form one
derived from the session token. Sign-in attempts are rate-limited per client address
(``ui_login_attempts_per_minute``) with the API's token buckets. Scripts may send
``Authorization: Bearer`` to ``/ui`` and ``/ui/data`` instead.

The page is plain HTML rendered here, with a small script (``static/ui.js``) that polls
``/ui/data`` every few seconds, moves the progress bars and draws the charts with uPlot
(vendored under ``static/vendor/uplot``, MIT): no build step. What it shows:

- batches: status, a progress bar, requests done, throughput (requests/s over the last
  minute) and an ETA at that rate, and a chart of throughput over time;
- per served model: workers answering, engine occupancy (running sequences / max_num_seqs),
  KV-cache usage and generated tokens/s over the last minutes.

The time series come from a :class:`Sampler` in the API process: while someone watches (a
request in the last minute), a thread records every ``ui_sample_interval_s`` the progress of
unfinished batches (Postgres) and the engine figures of every model worker (the workers'
``engine_stats`` control command over the broker), keeping the last ten minutes.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import html
import logging
import secrets
import string
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Form, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from sqlalchemy import or_, select

from api.deps import (
    Caller,
    SessionDep,
    SettingsDep,
    anonymous_admin,
    identify_digest,
    identify_key,
    rate_buckets,
)
from api.errors import APIError
from api.limits import auth_enabled, retry_after_header
from api.local import local_only
from core.auth import create_ui_session, end_ui_session, hash_key, ui_session_key
from core.db import session_scope
from core.lifecycle import TERMINAL, BatchStatus, now
from core.models import Batch
from core.queue import engine_stats
from core.settings import Settings

logger = logging.getLogger(__name__)

SESSION_COOKIE = "batchd_ui_session"
CSRF_COOKIE = "batchd_ui_csrf"
#: The cookie that held the key itself before sessions: cleared wherever it still is.
LEGACY_COOKIE = "batchd_ui_key"
LOGIN_BUCKET = "ui-login:"
HERE = Path(__file__).resolve().parent
TEMPLATE = string.Template((HERE / "templates" / "ui.html").read_text())
LOGIN_TEMPLATE = string.Template((HERE / "templates" / "ui_login.html").read_text())
HISTORY_S = 600.0  # how much of the past the charts show
WATCH_S = 60.0  # the sampler stops this long after the last dashboard request
RATE_WINDOW_S = 60.0  # throughput and ETA: over this much of the recent past
SMOOTH_S = 10.0  # the throughput chart: each point over this much of the past
MAX_BATCHES = 50

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
            return identify_key(settings, session, presented)
        except APIError:
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


# -- the sampler


class Sampler:
    """Samples batch progress and engine figures while the dashboard is watched."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.interval = settings.ui_sample_interval_s
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._watched = 0.0
        # (time, {batch id: requests done}, {model: figures summed over workers})
        self.samples: collections.deque[tuple[float, dict[str, int], dict[str, Any]]] = (
            collections.deque(maxlen=int(HISTORY_S / self.interval) + 2)
        )
        self.latest_models: dict[str, Any] = {}

    def watch(self) -> None:
        with self._lock:
            self._watched = time.monotonic()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="batchd-ui", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while time.monotonic() - self._watched < WATCH_S:
            started = time.monotonic()
            try:
                self.sample()
            except Exception:
                logger.exception("dashboard sample failed")
            time.sleep(max(0.05, self.interval - (time.monotonic() - started)))

    def sample(self) -> None:
        now = time.time()
        with session_scope(self.settings.database_url) as session:
            rows = session.execute(
                select(Batch.id, Batch.request_completed, Batch.request_failed).where(
                    Batch.status.not_in(TERMINAL)
                )
            ).all()
        done = {r.id: int(r.request_completed or 0) + int(r.request_failed or 0) for r in rows}
        models = self._engines()
        with self._lock:
            self.samples.append((now, done, models))
            self.latest_models = models

    def _engines(self) -> dict[str, Any]:
        """Per model: workers, running, max_num_seqs, KV blocks used/total, generated tokens
        (per worker, for rates), summed over the workers that answered."""
        try:
            replies = engine_stats(self.settings.broker_url, timeout=min(1.0, self.interval))
        except Exception as exc:
            logger.warning("engine figures unavailable: %r", exc)
            return {}
        models: dict[str, Any] = {}
        for reply in replies:
            for worker, answer in reply.items():
                for model, s in (answer or {}).get("models", {}).items():
                    if not isinstance(s, dict) or "num_running" not in s:
                        continue  # an embedding model or an error: no engine figures
                    m = models.setdefault(
                        model,
                        {"workers": 0, "running": 0, "max_num_seqs": 0, "kv_used": 0,
                         "kv_total": 0, "tokens": {}},
                    )  # fmt: skip
                    m["workers"] += 1
                    m["running"] += int(s.get("num_running") or 0)
                    m["max_num_seqs"] += int(s.get("max_num_seqs") or 0)
                    m["kv_used"] += int(s.get("kv_blocks_used") or 0)
                    m["kv_total"] += int(s.get("kv_blocks_total") or 0)
                    m["tokens"][worker] = int(s.get("total_output_tokens") or 0)
        return models

    def history(self) -> list[tuple[float, dict[str, int], dict[str, Any]]]:
        with self._lock:
            return list(self.samples)


def _sampler(request: Request) -> Sampler:
    state = request.app.state
    sampler = getattr(state, "ui_sampler", None)
    if sampler is None:
        sampler = state.ui_sampler = Sampler(state.settings)
    return sampler


# -- figures


def _rate(points: list[tuple[float, int]]) -> float | None:
    """Requests per second over the last RATE_WINDOW_S of ``(time, done)`` points."""
    if len(points) < 2:
        return None
    end_t, end_v = points[-1]
    start_t, start_v = next((p for p in points if end_t - p[0] <= RATE_WINDOW_S), points[0])
    if end_t - start_t <= 0:
        return None
    return max(0.0, (end_v - start_v) / (end_t - start_t))


def _iso(value: datetime | None) -> str | None:
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.isoformat()


def _visible_batches(session: Any, caller: Caller) -> list[Batch]:
    query = select(Batch)
    if not caller.admin:
        query = query.where(Batch.tenant == caller.tenant)
    unfinished = list(
        session.scalars(query.where(Batch.status.not_in(TERMINAL)).order_by(Batch.created_at))
    )
    recent = list(
        session.scalars(
            query.where(or_(Batch.status.in_(TERMINAL)))
            .order_by(Batch.created_at.desc())
            .limit(max(0, MAX_BATCHES - len(unfinished)))
        )
    )
    return (unfinished + recent)[:MAX_BATCHES]


def dashboard_data(session: Any, caller: Caller, sampler: Sampler) -> dict[str, Any]:
    history = sampler.history()
    batches = []
    visible = _visible_batches(session, caller)
    ids = {b.id for b in visible}
    for b in visible:
        total = int(b.request_total or 0)
        done = int(b.request_completed or 0) + int(b.request_failed or 0)
        points = [(t, d[b.id]) for t, d, _ in history if b.id in d]
        rate = _rate(points) if b.status not in TERMINAL else None
        eta = (total - done) / rate if rate and total > done else None
        running = b.status in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)
        if running and b.estimated_completion_at is not None:
            # The service's projection (core.eta_store), beside the deadline it is held to.
            eta = max(0.0, (b.estimated_completion_at - now()).total_seconds())
        batches.append(
            {
                "id": b.id,
                "tenant": b.tenant,
                "model": b.model,
                "status": b.status,
                "total": total,
                "completed": int(b.request_completed or 0),
                "failed": int(b.request_failed or 0),
                "progress": done / total if total else (1.0 if b.status == "completed" else 0.0),
                "throughput": rate,
                "eta_s": eta,
                "at_risk": bool(running and b.at_risk),
                "created_at": _iso(b.created_at),
            }
        )
    # Throughput of the caller's batches over time: requests finished per second over the
    # SMOOTH_S before each sample (checkpoints land in bursts), summed over visible batches.
    throughput: list[list[float]] = [[], []]
    start = 0
    for t1, d1, _ in history[1:]:
        while start < len(history) - 1 and t1 - history[start][0] > SMOOTH_S:
            start += 1
        t0, d0, _ = history[start]
        if t1 <= t0:
            continue
        moved = sum(max(0, n - d0.get(bid, n)) for bid, n in d1.items() if bid in ids)
        throughput[0].append(t1)
        throughput[1].append(moved / (t1 - t0))
    models: dict[str, Any] = {}
    for name, m in sampler.latest_models.items():
        models[name] = {
            "workers": m["workers"],
            "running": m["running"],
            "max_num_seqs": m["max_num_seqs"],
            "occupancy": m["running"] / m["max_num_seqs"] if m["max_num_seqs"] else 0.0,
            "kv_usage": m["kv_used"] / m["kv_total"] if m["kv_total"] else 0.0,
            "series": _model_series(name, history),
        }
    return {
        "time": time.time(),
        "admin": caller.admin,
        "tenant": caller.tenant,
        "batches": batches,
        "throughput": throughput,
        "models": models,
    }


def _model_series(model: str, history: list[Any]) -> list[list[float]]:
    """``[times, occupancy %, KV usage %, generated tokens/s]`` for uPlot."""
    out: list[list[float]] = [[], [], [], []]
    previous: dict[str, int] | None = None
    previous_t = 0.0
    for t, _, models in history:
        m = models.get(model)
        if m is None:
            previous = None
            continue
        rate = 0.0
        if previous is not None and t > previous_t:
            # Per worker, so a worker that joins or restarts never counts as a burst.
            rate = sum(max(0, n - previous.get(w, n)) for w, n in m["tokens"].items()) / (
                t - previous_t
            )
        out[0].append(t)
        out[1].append(100.0 * m["running"] / m["max_num_seqs"] if m["max_num_seqs"] else 0.0)
        out[2].append(100.0 * m["kv_used"] / m["kv_total"] if m["kv_total"] else 0.0)
        out[3].append(rate)
        previous, previous_t = m["tokens"], t
    return out


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
            f"<td class='status status-{e['status']}'>{e['status']}</td>"
            f"<td><div class='bar'><div class='fill' style='width:{pct}%'></div></div>"
            f"<span class='pct'>{pct}%</span></td>"
            f"<td class='done'>{b['completed'] + b['failed']} / {b['total']}</td>"
            f"<td class='rate'>{_fmt_rate(b['throughput'])}</td>"
            f"<td class='eta'>{_fmt_eta(b['eta_s'])}{AT_RISK if b['at_risk'] else ''}</td></tr>"
        )
    if not rows:
        cols = 8 if admin else 7
        rows.append(f"<tr class='empty'><td colspan='{cols}'>No batches yet.</td></tr>")
    return "\n".join(rows)


@router.get("", response_class=HTMLResponse)
def dashboard(
    request: Request, caller: UiCaller, session: SessionDep, settings: SettingsDep
) -> Response:
    if caller is None:
        return _login_page(request, settings)
    sampler = _sampler(request)
    sampler.watch()
    data = dashboard_data(session, caller, sampler)
    who = "all tenants (admin)" if caller.admin else f"tenant {caller.tenant}"
    body = TEMPLATE.substitute(
        who=html.escape(who),
        admin="true" if caller.admin else "false",
        tenant_header="<th>tenant</th>" if caller.admin else "",
        rows=_batch_rows(data["batches"], caller.admin),
        interval_ms=int(1000 * sampler.interval),
        csrf=_logout_token(token) if (token := request.cookies.get(SESSION_COOKIE)) else "",
    )
    return HTMLResponse(body, headers={"cache-control": "no-store"})


@router.get("/data")
def data(request: Request, caller: UiCaller, session: SessionDep) -> Response:
    if caller is None:
        return JSONResponse({"error": "not signed in"}, status_code=401)
    sampler = _sampler(request)
    sampler.watch()
    return JSONResponse(
        dashboard_data(session, caller, sampler), headers={"cache-control": "no-store"}
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
    previous = request.cookies.get(SESSION_COOKIE)
    if previous:
        end_ui_session(session, previous)
    ttl = settings.ui_session_ttl_s
    token = create_ui_session(session, hash_key(key), timedelta(seconds=ttl))
    session.commit()
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
        end_ui_session(session, token)
        session.commit()
    response = RedirectResponse("/ui", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/ui")
    response.delete_cookie(LEGACY_COOKIE, path="/ui")
    return response


def install(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/ui/static", StaticFiles(directory=HERE / "static"), name="ui-static")
