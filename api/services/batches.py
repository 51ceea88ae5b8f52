"""Batch rows: create (idempotency, entitlements, webhook, quota, enqueue), look up, list, cancel.

A create commits its row before it enqueues validation (the task re-reads the row); when the
broker refuses, the committed row moves to ``failed`` so no batch waits for a task never sent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.deps import Caller
from api.errors import APIError, invalid_request, not_found
from api.limits import max_unfinished_batches
from api.log_context import bind_batch
from api.schemas import BatchCreate
from api.services.files import get_file_row
from api.services.lookups import could_be_id, keyset_page
from core.batches.completion_windows import duration, window_seconds
from core.batches.ids import batch_id as new_batch_id
from core.batches.priority import PriorityName, priority_name
from core.broker.queue import (
    TASK_CANCEL,
    TASK_DELIVER_WEBHOOK,
    TASK_RELEASE_SWEEP,
    TASK_VALIDATE,
    WEBHOOK_QUEUE,
    enqueue,
)
from core.database.auth import generate_webhook_secret, priority_allowed
from core.database.lifecycle import (
    CANCELLABLE,
    PAUSABLE,
    PAUSED_EVENT,
    RESUMED_EVENT,
    TERMINAL,
    UNFINISHED,
    BatchStatus,
    ShardStatus,
    now,
    pause,
    record_event,
    resume,
    transition,
)
from core.database.tables import Batch, File, Shard
from core.security.netcheck import url_problem
from core.settings import Settings

log = logging.getLogger("batchd.api")

BROKER_UNAVAILABLE = "The task broker is unavailable; please retry shortly."


def get_batch_row(session: Session, tenant: str, batch_id: str) -> Batch:
    row = session.get(Batch, batch_id) if could_be_id(batch_id) else None
    if row is None or row.tenant != tenant:
        raise not_found("Batch", batch_id)
    return row


MESSAGE_BATCH_PREFIX = "msgbatch_"


def _pausable_row(session: Session, tenant: str, batch_id: str, verb: str) -> Batch:
    """The tenant's batch ``batch_id`` for a pause or a resume: 404 (an Anthropic Message
    Batch's id says why), 409 for a batch that has ended or is being cancelled."""
    if batch_id.startswith(MESSAGE_BATCH_PREFIX):
        raise APIError(
            404,
            f"No such Batch object: {batch_id} is a Message Batch; the Message Batches API "
            f"has no {verb} (only OpenAI-style batches can be paused and resumed).",
        )
    row = get_batch_row(session, tenant, batch_id)
    if row.status not in PAUSABLE:
        raise APIError(
            409,
            f"Cannot {verb} batch {batch_id}: its status is '{row.status}'"
            + (" (already finished)." if row.status in TERMINAL else ".")
            + " Only a validating or in-progress batch can be paused or resumed.",
            code="batch_not_pausable" if verb == "pause" else "batch_not_resumable",
            headers={"x-should-retry": "false"},
        )
    return row


def _send_event(batch_id: str, delivery_id: str | None) -> None:
    """Enqueue a pause or resume event's delivery (its row committed): the webhook sweep
    sends what the broker refuses now."""
    if delivery_id is None:
        return
    try:
        enqueue(TASK_DELIVER_WEBHOOK, delivery_id, queue=WEBHOOK_QUEUE)
    except Exception as error:
        log.warning("batch %s: webhook %s not enqueued (the sweep sends it): %s",
                    batch_id, delivery_id, error)  # fmt: skip


def _release_shards(batch_id: str) -> None:
    """Ask for a release of every model's next shards now (the release sweep does it on its
    own within a few seconds if the broker refuses)."""
    try:
        enqueue(TASK_RELEASE_SWEEP)
    except Exception as error:
        log.warning("batch %s: release not enqueued (the sweep releases): %s", batch_id, error)


def pause_batch(session: Session, tenant: str, batch_id: str) -> Batch:
    """Pause the batch: its shards not yet claimed go back from the release window (their
    slots go to other batches at once), a running shard stops taking lines and hands back the
    rest once its lines in flight end. Pausing a paused batch changes nothing."""
    row = _pausable_row(session, tenant, batch_id, "pause")
    if row.paused_at is not None:
        return row
    won, url = pause(session, batch_id)
    delivery_id = None
    if won:
        session.execute(
            update(Shard)
            .where(
                Shard.batch_id == batch_id,
                Shard.status == ShardStatus.PENDING,
                Shard.released_at.is_not(None),
            )
            .values(released_at=None)
            .execution_options(synchronize_session=False)
        )
        if url:
            delivery_id = record_event(session, batch_id, PAUSED_EVENT, url)
    session.commit()
    session.refresh(row)
    if not won:
        # Changed meanwhile: ended (409), or another pause came first (the same answer).
        return _pausable_row(session, tenant, batch_id, "pause")
    log.info("batch %s paused", batch_id)
    _send_event(batch_id, delivery_id)
    _release_shards(batch_id)
    return row


def resume_batch(session: Session, tenant: str, batch_id: str) -> Batch:
    """Resume a paused batch: its shards are released again, each resuming from its last
    checkpoint. Resuming a batch that is not paused changes nothing."""
    row = _pausable_row(session, tenant, batch_id, "resume")
    if row.paused_at is None:
        return row
    won, url = resume(session, batch_id, row.paused_at)
    delivery_id = record_event(session, batch_id, RESUMED_EVENT, url) if won and url else None
    session.commit()
    session.refresh(row)
    if not won:
        return _pausable_row(session, tenant, batch_id, "resume")
    log.info("batch %s resumed", batch_id)
    _send_event(batch_id, delivery_id)
    _release_shards(batch_id)
    return row


def checked_window_s(window: str, caller: Caller, settings: Settings) -> int:
    """The completion window in seconds: 400 outside the server's range, 403 below the API
    key's shortest window (an early deadline is an entitlement, like priority)."""
    seconds = window_seconds(window) or 0
    if seconds > settings.max_completion_window_s:
        raise invalid_request(
            f"Invalid value for 'completion_window': {window} is longer than the maximum of "
            f"{settings.max_completion_window_s} seconds "
            f"({duration(settings.max_completion_window_s)}).",
            param="completion_window",
        )
    if seconds < settings.min_completion_window_s:
        raise invalid_request(
            f"Invalid value for 'completion_window': {window} is shorter than the minimum of "
            f"{settings.min_completion_window_s} seconds "
            f"({duration(settings.min_completion_window_s)}).",
            param="completion_window",
        )
    shortest = caller.min_completion_window_s
    if shortest is not None and seconds < shortest and not caller.admin:
        raise APIError(
            403,
            f"This API key may create batches with a completion window of at least "
            f"{duration(shortest)} ({shortest} seconds); '{window}' is shorter. An "
            "administrator can create a key that may use it "
            f"(`batchd keys create --min-completion-window {window}`).",
            param="completion_window",
            code="completion_window_not_allowed",
            headers={"x-should-retry": "false"},
        )
    return seconds


def checked_priority(body: BatchCreate, caller: Caller) -> PriorityName:
    """A priority is an entitlement of the key: asking for more than the key's
    ``max_priority`` is a 403. Without one, a batch gets ``normal``, or the key's maximum
    where that is lower."""
    requested = body.priority
    if priority_allowed(requested, caller.max_priority):
        return requested
    if "priority" not in body.model_fields_set:
        return priority_name(caller.max_priority)
    raise APIError(
        403,
        f"This API key may create batches with priority up to '{caller.max_priority}'; "
        f"'{requested}' is above it. An administrator can create a key that may use it "
        f"(`batchd keys create --max-priority {requested}`).",
        param="priority",
        code="priority_not_allowed",
        headers={"x-should-retry": "false"},
    )


def batch_input_file(session: Session, tenant: str, file_id: str) -> File:
    """The tenant's file ``file_id``, uploaded for batches (404 or 400 otherwise)."""
    input_file = get_file_row(session, tenant, file_id, param="input_file_id")
    if input_file.purpose != "batch":
        raise invalid_request(
            f"The input file {input_file.id} has purpose '{input_file.purpose}'; "
            "a batch needs a file uploaded with purpose 'batch'.",
            param="input_file_id",
        )
    return input_file


def shows_secret(row: Batch, caller: Caller) -> bool:
    """A batch's webhook secret is shown to its creator only when it was generated for the
    batch; a key's own secret was shown when the key was created."""
    return row.webhook_secret is not None and row.webhook_secret != caller.webhook_secret


def existing_batch(session: Session, tenant: str, key: str) -> Batch | None:
    """The tenant's batch created under the idempotency ``key``, if any."""
    return session.scalars(
        select(Batch).where(Batch.tenant == tenant, Batch.idempotency_key == key)
    ).first()


def _replay(row: Batch, body: BatchCreate, priority: str) -> Batch:
    """The answer to a create that repeats an idempotency key: the first create's batch, as it
    is now; a different request under the same key (any parameter that shapes the batch) is a
    client bug and gets 409 naming the first difference."""
    bind_batch(row.id)
    expiry = body.output_expires_after
    asked = {
        "input_file_id": (body.input_file_id, row.input_file_id),
        "endpoint": (body.endpoint, row.endpoint),
        "completion_window": (body.completion_window, row.completion_window),
        "metadata": (body.metadata or None, row.metadata_ or None),
        "priority": (priority, row.priority),
        "output_expires_after": (
            expiry.seconds if expiry is not None else None,
            row.output_expires_after_s,
        ),
        "max_total_tokens": (body.max_total_tokens, row.max_total_tokens),
    }
    if body.webhook_url is not None:
        asked["webhook_url"] = (body.webhook_url, row.webhook_url)
    differs = next((name for name, (new, old) in asked.items() if new != old), None)
    if differs is not None:
        raise APIError(
            409,
            f"The idempotency key was already used for batch {row.id}, created from "
            f"{row.input_file_id} for {row.endpoint} with another {differs}; use a new key "
            "for a different batch.",
            param="idempotency_key",
            code="idempotency_key_reused",
            headers={"x-should-retry": "false"},
        )
    return row


def _webhook_url(body: BatchCreate, caller: Caller, settings: Settings) -> str | None:
    """The batch's webhook URL (its own, else the key's default), checked against the
    server's allow list."""
    webhook_url = body.webhook_url or caller.webhook_url
    if webhook_url is not None and (
        problem := url_problem(webhook_url, settings.webhook_allow_list())
    ):
        source = "" if body.webhook_url else " (the API key's default webhook URL)"
        raise invalid_request(
            f"Invalid value for 'webhook_url'{source}: {problem}.",
            param="webhook_url",
            code="webhook_url_not_allowed",
        )
    return webhook_url


def _check_unfinished_quota(session: Session, tenant: str, limit: int) -> None:
    """Refuse a new batch when the tenant already has ``limit`` unfinished ones. On Postgres a
    transaction lock per tenant (held until the create commits) makes concurrent creates
    count one after another, so the limit holds under races."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(
            text("SELECT pg_advisory_xact_lock(hashtext(:lock))"),
            {"lock": f"batchd.unfinished_batches:{tenant}"},
        )
    unfinished = session.scalar(
        select(func.count())
        .select_from(Batch)
        .where(Batch.tenant == tenant, Batch.status.in_(UNFINISHED))
    )
    if (unfinished or 0) >= limit:
        raise APIError(
            429,
            f"Too many unfinished batches: this tenant has {unfinished}, and the limit is "
            f"{limit} (max_unfinished_batches_per_tenant). Wait for some to finish or cancel "
            "some, then retry.",
            code="unfinished_batch_limit_exceeded",
            headers={"x-should-retry": "false"},
        )


def check_create(session: Session, settings: Settings, caller: Caller, body: BatchCreate) -> None:
    """Refuse, as its create would, a batch ``body`` that the caller may not make (priority,
    completion window, output expiry, webhook URL) or that the tenant's quota of unfinished
    batches leaves no room for; the input file is not looked at. For work to do before the
    create (a retry's copy of its lines) that a refusal should spare. Ends the transaction
    (the quota's lock is not held on)."""
    try:
        checked_priority(body, caller)
        checked_window_s(body.completion_window, caller, settings)
        if body.output_expires_after is not None:
            body.output_expires_after.checked_seconds("output_expires_after")
        _webhook_url(body, caller, settings)
        _check_unfinished_quota(session, caller.tenant, max_unfinished_batches(settings))
    finally:
        session.rollback()


def create_batch(
    session: Session,
    settings: Settings,
    caller: Caller,
    body: BatchCreate,
    key: str | None,
    *,
    replay: Callable[[Batch], Batch] | None = None,
    retry_request: dict[str, Any] | None = None,
) -> Batch:
    """Create the batch ``body`` asks for and enqueue its validation; with an idempotency
    ``key`` already used by the tenant, the batch that key created instead (``replay`` of it:
    by default the batch if ``body`` asks for the same, else 409). ``retry_request`` is kept
    on the row (a retry's request, see :mod:`api.services.retries`)."""
    priority = checked_priority(body, caller)
    seconds = checked_window_s(body.completion_window, caller, settings)
    answer = replay or (lambda row: _replay(row, body, priority))
    if key is not None and (existing := existing_batch(session, caller.tenant, key)) is not None:
        return answer(existing)
    output_expiry_s = None
    if body.output_expires_after is not None:
        output_expiry_s = body.output_expires_after.checked_seconds("output_expires_after")
    webhook_url = _webhook_url(body, caller, settings)
    input_file = batch_input_file(session, caller.tenant, body.input_file_id)
    _check_unfinished_quota(session, caller.tenant, max_unfinished_batches(settings))
    webhook_secret = None
    if webhook_url is not None:
        webhook_secret = caller.webhook_secret or generate_webhook_secret()
    created = now()
    row = Batch(
        id=new_batch_id(),
        tenant=caller.tenant,
        endpoint=body.endpoint,
        input_file_id=input_file.id,
        completion_window=body.completion_window,
        status=BatchStatus.VALIDATING,
        metadata_=body.metadata,
        priority=priority,
        idempotency_key=key,
        retry_request=retry_request,
        webhook_url=webhook_url,
        webhook_secret=webhook_secret,
        output_expires_after_s=output_expiry_s,
        max_total_tokens=body.max_total_tokens,
        created_at=created,
        expires_at=created + timedelta(seconds=seconds),
        request_total=0,
        request_completed=0,
        request_failed=0,
        input_tokens=0,
        cached_tokens=0,
        output_tokens=0,
    )
    bind_batch(row.id)
    session.add(row)
    try:
        session.commit()
    except IntegrityError:
        # A concurrent create with the same idempotency key committed first: answer with its
        # batch, exactly as if this request had come second.
        session.rollback()
        existing = existing_batch(session, caller.tenant, key) if key is not None else None
        if existing is None:
            raise
        return answer(existing)
    _enqueue_validation(session, row)
    log.info("batch %s created from %s for %s", row.id, input_file.id, row.endpoint)
    return row


def _enqueue_validation(session: Session, row: Batch) -> None:
    """Send the committed batch to validation; if the broker refuses, fail the batch (503) and
    release its idempotency key, so that the client's retry of the create (what a 503 asks
    for) makes a batch that runs instead of replaying the failed one."""
    try:
        enqueue(TASK_VALIDATE, row.id)
    except Exception as error:
        log.error("could not enqueue validation of %s: %r", row.id, error, exc_info=True)
        transition(
            session,
            row.id,
            BatchStatus.VALIDATING,
            BatchStatus.FAILED,
            # The 503 tells the client; the batch it never got is no one's to retry or be
            # told of again: its key goes back to the client, and no webhook event is sent.
            idempotency_key=None,
            webhook_url=None,
            errors=[
                {
                    "code": "broker_unavailable",
                    "message": BROKER_UNAVAILABLE,
                    "param": None,
                    "line": None,
                }
            ],
        )
        session.commit()
        raise APIError(
            503,
            f"{BROKER_UNAVAILABLE} Batch {row.id} was not started and has been marked failed.",
            code="broker_unavailable",
        ) from error


def list_batches(
    session: Session, tenant: str, after: str | None, limit: int
) -> tuple[list[Batch], bool]:
    """A page of the tenant's batches, newest first, and whether more follow."""
    cursor = None
    if after is not None:
        cursor = session.get(Batch, after) if could_be_id(after) else None
        if cursor is None or cursor.tenant != tenant:
            raise invalid_request(f"No such Batch object for 'after': {after}", param="after")
    query = select(Batch).where(Batch.tenant == tenant)
    return keyset_page(session, query, Batch, cursor, descending=True, limit=limit)


def cancel_batch(session: Session, tenant: str, batch_id: str) -> Batch:
    """Move the batch to ``cancelling`` and enqueue the cancel task (a second cancel is a
    no-op); 409 for a batch that has ended."""
    row = get_batch_row(session, tenant, batch_id)
    for _ in range(3):  # the status may move under us; re-read and decide again
        if row.status == BatchStatus.CANCELLING:
            return row
        if row.status not in CANCELLABLE:
            raise APIError(
                409,
                f"Cannot cancel batch {batch_id}: its status is '{row.status}'"
                + (" (already finished)." if row.status in TERMINAL else "."),
                code="batch_not_cancellable",
                headers={"x-should-retry": "false"},
            )
        won = transition(session, batch_id, CANCELLABLE, BatchStatus.CANCELLING)
        session.commit()
        session.refresh(row)
        if won:
            log.info("batch %s cancelling", batch_id)
            try:
                enqueue(TASK_CANCEL, batch_id)
            except Exception as error:
                log.error("could not enqueue cancellation of %s: %s", batch_id, error)
                raise APIError(
                    503,
                    f"{BROKER_UNAVAILABLE} Batch {batch_id} is marked cancelling; "
                    "in-flight work stops once the broker is reachable again.",
                    code="broker_unavailable",
                ) from error
            return row
    raise APIError(409, f"Batch {batch_id} changed status repeatedly; retry the cancel.")
