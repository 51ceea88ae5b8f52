"""Batch webhooks: an event when a batch ends, signed per Standard Webhooks, delivered with
retries.

The terminal transition inserts the delivery row (an outbox); :func:`worker.events.notify` only
enqueues its task and :func:`sweep_unsent` sends any row left overdue, so every event is
delivered at least once under one event id. Attempts run on the process's own webhook threads,
never a control thread, each bounded by ``webhook_timeout_s``. Design and reasoning:
``docs/worker.md``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import random
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

import httpx
from sqlalchemy import select, update

from core.broker.queue import TASK_DELIVER_WEBHOOK, TASK_SWEEP_WEBHOOKS, WEBHOOK_QUEUE
from core.database.lifecycle import DeliveryStatus, now, webhook_event_id
from core.database.sessions import session_scope, updated
from core.database.tables import Batch, WebhookDelivery
from core.observability import metrics
from core.security.netcheck import (
    AllowList,
    DestinationRefused,
    Resolver,
    parse_address,
    resolve_checked,
    system_resolver,
)
from core.settings import get_settings
from worker.infra import app, send

logger = logging.getLogger(__name__)

SECRET_PREFIX = "whsec_"
USER_AGENT = "batchd-webhooks/1"
#: How much of a receiver's answer is read (into ``last_error`` on a failed attempt).
ANSWER_BYTES_KEPT = 200
#: A delivery task this early for its row's next attempt is a duplicate, and does nothing.
DUE_SLACK_S = 2.0
#: How long a claimed attempt may take beyond ``webhook_timeout_s`` (writing its outcome)
#: before the sweep takes it for lost.
ATTEMPT_GRACE_S = 5.0
#: A delivery task that finds every webhook thread busy comes back after about this long, at
#: most BUSY_RETRIES times; then the sweep sends the row again once it is overdue.
BUSY_RETRY_S = 2.0
BUSY_RETRIES = 5
#: Threads that resolve webhook hosts. A resolution cannot be interrupted: one that outlives its
#: attempt's timeout keeps its thread until the resolver gives up, and the next resolutions
#: wait for a free one, within their own attempts' timeouts.
RESOLVER_THREADS = 4
_resolvers = ThreadPoolExecutor(RESOLVER_THREADS, thread_name_prefix="batchd-webhook-resolve")


def backoff_s(attempts: int) -> float:
    """Seconds to wait after the ``attempts``-th failed attempt."""
    settings = get_settings()
    base, cap = settings.webhook_backoff_s, settings.webhook_backoff_max_s
    return min(cap, base * 2 ** max(attempts - 1, 0))


def event_id() -> str:
    return webhook_event_id()


def signing_key(secret: str) -> bytes:
    if secret.startswith(SECRET_PREFIX):
        return base64.b64decode(secret[len(SECRET_PREFIX) :])
    return secret.encode()


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header value for one attempt."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(signing_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def verify(secret: str, headers: dict[str, str], body: bytes) -> bool:
    """Check a delivery's signature (what a receiver does); for tests and clients."""
    lower = {k.lower(): v for k, v in headers.items()}
    expected = sign(secret, lower["webhook-id"], int(lower["webhook-timestamp"]), body)
    return any(
        hmac.compare_digest(expected, part) for part in lower.get("webhook-signature", "").split()
    )


def _unix(value: datetime) -> int:
    return int(value.timestamp())


def event_body(delivery: WebhookDelivery) -> bytes:
    event = {
        "id": delivery.id,
        "object": "event",
        "type": delivery.event_type,
        "created_at": _unix(delivery.created_at),
        "data": {"id": delivery.batch_id},
    }
    return json.dumps(event, separators=(",", ":")).encode()


_tls: ssl.SSLContext | None = None
_tls_lock = threading.Lock()


def tls_context() -> ssl.SSLContext:
    """The one TLS context of this process's webhook attempts (httpx's default: certifi's
    roots). A client made with its own loads every root certificate again: one per attempt
    grew a worker's memory by tens of MiB under a stream of attempts, the freed memory
    scattered over the threads' heaps."""
    global _tls
    with _tls_lock:
        if _tls is None:
            _tls = httpx.create_ssl_context()
        return _tls


def post_pinned(
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    timeout: float,
    allow: AllowList,
    resolver: Resolver = system_resolver,
) -> tuple[int, str]:
    """POST ``body`` to ``url`` at an address checked by :mod:`core.security.netcheck`: the host is
    resolved once, every address is checked, and the connection goes to the checked address
    (the ``Host`` header and TLS server name stay the URL's host, so virtual hosts and
    certificates work as usual). No redirect is followed and no proxy from the environment is
    used (either would send the request somewhere unchecked). Returns the status code and the
    start of the answer's body (only that much is read).

    ``timeout`` bounds the whole attempt, from resolving the host to the last byte read, not
    each step: a name server that answers slowly, or a receiver that trickles its answer a byte
    at a time, is cut off when it is spent (``httpx.TimeoutException``), so no attempt holds a
    webhook thread longer, and no attempt is still running when its row says it is overdue."""
    target = httpx.URL(url)
    port = target.port or (443 if target.scheme == "https" else 80)
    extensions = {}
    if target.scheme == "https" and parse_address(target.host) is None:
        extensions["sni_hostname"] = target.host
    sent = {**headers, "host": target.netloc.decode("ascii")}

    async def post() -> tuple[int, str]:
        # On threads of their own: asyncio.run waits for its default executor's threads, and
        # a resolution outliving the timeout must not hold the attempt.
        address = await asyncio.wrap_future(
            _resolvers.submit(resolve_checked, target.host, port, allow, resolver)
        )
        pinned = target.copy_with(host=str(address))
        async with (
            httpx.AsyncClient(
                trust_env=False, follow_redirects=False, timeout=timeout, verify=tls_context()
            ) as client,
            client.stream(
                "POST", pinned, content=body, headers=sent, extensions=extensions
            ) as response,
        ):
            start = b""
            async for piece in response.aiter_bytes():
                start += piece
                if len(start) >= ANSWER_BYTES_KEPT:
                    break
            return response.status_code, start[:ANSWER_BYTES_KEPT].decode("utf-8", "replace")

    async def bounded() -> tuple[int, str]:
        try:
            return await asyncio.wait_for(post(), timeout)
        except TimeoutError:
            raise httpx.TimeoutException(
                f"no complete answer within {timeout:g} s (webhook_timeout_s)"
            ) from None

    return asyncio.run(bounded())


def attempt(delivery_id: str, *, resolver: Resolver = system_resolver) -> float | None:
    """Make one delivery attempt. Returns None when there is nothing more to do (delivered,
    failed for good, or another attempt is under way), else the seconds to wait before the
    next attempt. A destination the address rule refuses (core.security.netcheck) fails the delivery
    for good, without a request."""
    settings = get_settings()
    with session_scope() as session:
        delivery = session.get(WebhookDelivery, delivery_id)
        if delivery is None or delivery.status != DeliveryStatus.PENDING:
            return None
        due = delivery.next_attempt_at
        if due is not None and (due - now()).total_seconds() > DUE_SLACK_S:
            return None  # a duplicate task ahead of the retry its attempt scheduled
        secret = session.scalar(select(Batch.webhook_secret).where(Batch.id == delivery.batch_id))
        seen = delivery.attempts
        body = event_body(delivery)
        url = delivery.url
        # Claim this attempt: one conditional UPDATE, so duplicate task deliveries never
        # POST twice for the same attempt number.
        claimed = updated(
            session,
            update(WebhookDelivery)
            .where(
                WebhookDelivery.id == delivery_id,
                WebhookDelivery.status == DeliveryStatus.PENDING,
                WebhookDelivery.attempts == seen,
            )
            .values(
                attempts=seen + 1,
                # Due again once this attempt should have ended (its timeout bounds it): while
                # it runs the sweep leaves the row alone; if it is lost (a killed worker, a
                # blip), the sweep sends the event again.
                next_attempt_at=now()
                + timedelta(seconds=settings.webhook_timeout_s + ATTEMPT_GRACE_S),
            )
            .execution_options(synchronize_session=False),
        )
    if claimed != 1:
        return None
    number = seen + 1
    timestamp = int(time.time())
    headers = {
        "content-type": "application/json",
        "user-agent": USER_AGENT,
        "webhook-id": delivery_id,
        "webhook-timestamp": str(timestamp),
    }
    if secret:
        headers["webhook-signature"] = sign(secret, delivery_id, timestamp, body)
    code: int | None = None
    error: str | None = None
    refused = False
    try:
        code, answer = post_pinned(
            url,
            body,
            headers,
            timeout=settings.webhook_timeout_s,
            allow=settings.webhook_allow_list(),
            resolver=resolver,
        )
        if not 200 <= code < 300:
            error = f"HTTP {code}: {answer}"
    except DestinationRefused as exc:
        refused = True  # the rule, not the receiver: another attempt would be refused too
        error = f"refused: {exc}"[:500]
    except (httpx.HTTPError, httpx.InvalidURL, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:500]
    ok = error is None
    final = ok or refused or number >= settings.webhook_max_attempts
    outcome = "delivered" if ok else "refused" if refused else "failed" if final else "retrying"
    metrics.WEBHOOK_DELIVERIES.labels(outcome=outcome).inc()
    values: dict[str, Any] = {"last_status_code": code, "last_error": error}
    if ok:
        values.update(status=DeliveryStatus.DELIVERED, delivered_at=now())
    elif final:
        values["status"] = DeliveryStatus.FAILED
    else:
        wait = backoff_s(number)
        values["next_attempt_at"] = now() + timedelta(seconds=wait)
    with session_scope() as session:
        session.execute(
            update(WebhookDelivery)
            .where(WebhookDelivery.id == delivery_id, WebhookDelivery.attempts == number)
            .values(**values)
            .execution_options(synchronize_session=False)
        )
    if ok:
        logger.info("webhook %s delivered on attempt %s", delivery_id, number)
        return None
    if final:
        logger.warning("webhook %s failed after %s attempts: %s", delivery_id, number, error)
        return None
    logger.info(
        "webhook %s attempt %s failed (%s); retry in %.1fs", delivery_id, number, error, wait
    )
    return wait


def sweep_unsent(older_than_s: float | None = None) -> int:
    """Enqueue the pending deliveries whose next attempt is overdue by ``older_than_s``
    (default ``settings.webhook_unsent_after_s``): never sent (the actor that committed the
    transition died before enqueueing, or the broker refused the task), or an attempt or retry
    lost on the way (its worker killed, its task lost in a broker blip, its database write
    refused); return how many were enqueued.

    A running attempt is never overdue (its claim moved the row's next attempt past its
    timeout). Each row sent is stamped due now, in the same statement that picks it: a task on
    its way is not sent again by the next sweeps, nor by one running beside this one, until it
    is overdue in turn."""
    if older_than_s is None:
        older_than_s = get_settings().webhook_unsent_after_s
    current = now()
    cutoff = current - timedelta(seconds=older_than_s)
    overdue = (
        WebhookDelivery.status == DeliveryStatus.PENDING,
        WebhookDelivery.next_attempt_at < cutoff,
    )
    with session_scope() as session:
        oldest = (
            select(WebhookDelivery.id)
            .where(*overdue)
            .order_by(WebhookDelivery.next_attempt_at)
            .limit(1000)
        )
        ids = list(
            session.scalars(
                update(WebhookDelivery)
                .where(WebhookDelivery.id.in_(oldest.scalar_subquery()), *overdue)
                .values(next_attempt_at=current)
                .returning(WebhookDelivery.id)
                .execution_options(synchronize_session=False)
            )
        )
    for delivery_id in ids:
        send(TASK_DELIVER_WEBHOOK, delivery_id, queue=WEBHOOK_QUEUE)
    if ids:
        logger.warning("re-enqueued %s webhook deliveries whose attempt is overdue", len(ids))
    return len(ids)


class DeliveryThreads:
    """The threads a worker process runs webhook attempts on, apart from its task pool: at most
    ``size`` attempts at a time, and at most ``per_tenant`` of them (half, at least one) for
    one tenant; :meth:`offer` never waits."""

    def __init__(self, size: int, per_tenant: int | None = None) -> None:
        self.size = max(1, int(size))
        self.per_tenant = max(1, per_tenant if per_tenant is not None else self.size // 2)
        self._lock = threading.Lock()
        self._busy = 0
        self._held: dict[str, int] = {}
        self._executor = ThreadPoolExecutor(self.size, thread_name_prefix="batchd-webhook")

    def offer(self, delivery_id: str, tenant: str = "") -> bool:
        """Start an attempt for ``delivery_id`` now if a thread is free and ``tenant`` holds
        fewer than its part of them; whether it started."""
        with self._lock:
            if self._busy >= self.size or self._held.get(tenant, 0) >= self.per_tenant:
                return False
            self._busy += 1
            self._held[tenant] = self._held.get(tenant, 0) + 1
        try:
            self._executor.submit(self._run, delivery_id, tenant)
        except BaseException:
            self._release(tenant)
            raise
        return True

    def _run(self, delivery_id: str, tenant: str) -> None:
        try:
            deliver(delivery_id)
        finally:
            self._release(tenant)

    def _release(self, tenant: str) -> None:
        with self._lock:
            self._busy -= 1
            left = self._held.pop(tenant) - 1
            if left:
                self._held[tenant] = left


def deliver(delivery_id: str) -> None:
    """One attempt, then the retry's task if one is due (an error is logged: the row is left
    pending, and the sweep sends it again once it is overdue)."""
    try:
        wait = attempt(delivery_id)
        if wait is not None:
            send(TASK_DELIVER_WEBHOOK, delivery_id, queue=WEBHOOK_QUEUE, countdown=wait)
    except Exception:
        logger.exception("webhook %s: the attempt failed (the sweep sends it again)", delivery_id)


_threads: DeliveryThreads | None = None
_threads_lock = threading.Lock()


def delivery_threads() -> DeliveryThreads:
    """This process's :class:`DeliveryThreads` (``settings.webhook_concurrency``)."""
    global _threads
    with _threads_lock:
        if _threads is None:
            _threads = DeliveryThreads(get_settings().webhook_concurrency)
        return _threads


@app.task(name=TASK_SWEEP_WEBHOOKS)
def sweep_webhooks_task(**_: Any) -> None:
    sweep_unsent()


@app.task(name=TASK_DELIVER_WEBHOOK, bind=True, max_retries=None)
def deliver_webhook(self: Any, delivery_id: str) -> None:
    """Hand the attempt to this process's webhook threads and return at once (see the module
    docstring); when they are all busy, come back a little later, or leave the row to the
    sweep."""
    if delivery_threads().offer(delivery_id, delivery_tenant(delivery_id)):
        return
    if self.request.retries < BUSY_RETRIES:
        raise self.retry(countdown=BUSY_RETRY_S * (0.5 + random.random()))
    logger.info(
        "webhook %s: no webhook thread free for its tenant; the sweep sends it later", delivery_id
    )


def delivery_tenant(delivery_id: str) -> str:
    """The tenant whose batch the delivery is for ("" when the row is gone: the attempt then
    finds nothing to do)."""
    with session_scope() as session:
        tenant = session.scalar(
            select(Batch.tenant)
            .join(WebhookDelivery, WebhookDelivery.batch_id == Batch.id)
            .where(WebhookDelivery.id == delivery_id)
        )
    return tenant or ""
