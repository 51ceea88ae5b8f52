"""The dashboard's data: a poller of batch progress and engine figures, and what a page shows.

The poller runs in the API process only while someone watches (a dashboard request in the last
``WATCH_S``): every ``ui_sample_interval_s`` it records the progress of unfinished batches and
the engine figures of every model worker (``engine_stats`` over the broker), keeping the last
``HISTORY_S``. A caller sees only its tenant's batches unless its key is an admin's.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from api.deps import Caller
from core.broker.queue import engine_stats
from core.database.auth import create_ui_session, end_ui_session, hash_key
from core.database.lifecycle import TERMINAL, BatchStatus, now
from core.database.sessions import session_scope
from core.database.tables import Batch
from core.settings import Settings

logger = logging.getLogger(__name__)

HISTORY_S = 600.0  # how much of the past the charts show
WATCH_S = 60.0  # the poller stops this long after the last dashboard request
RATE_WINDOW_S = 60.0  # throughput and ETA: over this much of the recent past
SMOOTH_S = 10.0  # the throughput chart: each point over this much of the past
MAX_BATCHES = 50


class DashboardPoller:
    """Polls batch progress and engine figures while the dashboard is watched."""

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
                    if isinstance(s, dict) and s.get("kind") == "upstream":
                        s = _upstream_figures(s, models.get(model))
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
                    if "upstream" in s:
                        m["upstream"] = s["upstream"]
        return models

    def history(self) -> list[tuple[float, dict[str, int], dict[str, Any]]]:
        with self._lock:
            return list(self.samples)


def _upstream_figures(s: dict[str, Any], so_far: dict[str, Any] | None) -> dict[str, Any]:
    """A dispatch worker's figures in the engines' terms (requests in flight of its share of
    the limit, tokens it got back), with the upstream's own: the shared limit, back-offs
    (summed over the workers that answered) and the live traffic guard's cap and TTFT."""
    earlier = (so_far or {}).get("upstream", {})
    return {
        "num_running": int(s.get("in_flight") or 0),
        "max_num_seqs": int(s.get("allowed") or 0),
        "total_output_tokens": int(s.get("output_tokens") or 0),
        "upstream": {
            "limit": int(s.get("limit") or 0),
            "backoffs": int(earlier.get("backoffs", 0)) + sum((s.get("backoffs") or {}).values()),
            "guard_cap": s.get("guard_cap"),
            "ttft_p99_s": s.get("ttft_p99_s"),
        },
    }


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


def _visible_batches(session: Session, caller: Caller) -> list[Batch]:
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


def dashboard_data(session: Session, caller: Caller, poller: DashboardPoller) -> dict[str, Any]:
    history = poller.history()
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
            # The service's projection (core.eta.store), beside the deadline it is held to.
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
                # the prefix plan's saving: prompt tokens, those served cached, predicted
                "prompt_tokens": int(b.input_tokens or 0),
                "cached_tokens": int(b.cached_tokens or 0),
                "shareable_tokens": int(b.prefix_shareable_tokens or 0),
                # paused (POST /v1/batches/{id}/pause), and the token budget beside its spending
                "paused": bool(running and b.paused_at is not None),
                "max_total_tokens": b.max_total_tokens,
                "spent_tokens": int(b.input_tokens or 0) + int(b.output_tokens or 0),
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
    for name, m in poller.latest_models.items():
        models[name] = {
            "workers": m["workers"],
            "running": m["running"],
            "max_num_seqs": m["max_num_seqs"],
            "occupancy": m["running"] / m["max_num_seqs"] if m["max_num_seqs"] else 0.0,
            "kv_usage": m["kv_used"] / m["kv_total"] if m["kv_total"] else 0.0,
            "series": _model_series(name, history),
            "upstream": m.get("upstream"),
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


def start_session(session: Session, key: str, previous: str | None, ttl_s: float) -> str:
    """A new dashboard session for the (already checked) ``key``, ending the ``previous``
    one; its token, for the cookie."""
    if previous:
        end_ui_session(session, previous)
    token = create_ui_session(session, hash_key(key), timedelta(seconds=ttl_s))
    session.commit()
    return token


def end_session(session: Session, token: str) -> None:
    end_ui_session(session, token)
    session.commit()
