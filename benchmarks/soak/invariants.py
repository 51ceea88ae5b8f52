"""The soak's verdicts: each invariant judged at the end of a run, and the evidence a failed
one names (the batches, their database rows, their log lines)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.soak.faults import OUTAGES
from testkit.service.soak_checks import (
    TERMINAL,
    BatchRecord,
    HttpLog,
    Tracker,
    http_invariant,
    neighbour_invariant,
    rss_invariant,
    task_time,
    webhook_invariant,
)
from testkit.service.soak_stack import Clock, Receiver, Stack

if TYPE_CHECKING:
    from benchmarks.soak.faults import Faults
    from benchmarks.soak.options import Options
    from benchmarks.soak.run import _Hostile


def judge(
    opts: Options, records: list[BatchRecord], tracker: Tracker, receiver: Receiver,
    http: HttpLog, faults: Faults, stack: Stack, clock: Clock, hostile: _Hostile | None,
    grace: float, drained: bool, webhooks_in: bool, traffic_end: float, drain_end: float,
    end: float,
) -> dict[str, Any]:  # fmt: skip
    """Each invariant's verdict on what the run watched, the hostile tenant's too."""
    inv: dict[str, Any] = {}
    inv["lines"] = {
        "ok": not tracker.line_violations,
        "batches_checked": sum(1 for r in records if r.checked),
        "lines_accepted": sum(len(r.custom_ids) for r in records if r.validated),
        # Cancelled or expired while validating: no line was accepted, none is owed.
        "ended_before_validation": sorted(
            r.id for r in records if r.status in ("cancelled", "expired") and not r.validated
        ),
        "violations": tracker.line_violations[:50],
        "violation_count": len(tracker.line_violations),
    }
    inv["expiry"] = {
        "ok": not tracker.overdue,
        "grace_s": grace,
        "short_window_batches": sum(1 for r in records if r.window != "24h"),
        "violations": tracker.overdue[:50],
        "violation_count": len(tracker.overdue),
    }
    unsettled = [
        {"batch": r.id, "tenant": r.tenant, "kind": r.kind, "status": r.status,
         "checked": r.checked, "request_counts": r.counts, "window": r.window}
        for r in tracker.unsettled()
    ]  # fmt: skip
    inv["drained"] = {
        "ok": drained and not unsettled,
        "drain_s": round(drain_end - traffic_end, 1),
        "violations": unsettled[:50],
        "violation_count": len(unsettled),
    }
    inv["webhooks"] = webhook_invariant(
        records, receiver.snapshot(), receiver.malformed, clock.at_wall
    )
    inv["webhooks"]["waited_s"] = round(end - drain_end, 1)
    inv["webhooks"]["all_in_before_timeout"] = webhooks_in
    inv["rss"] = rss_invariant(
        stack.incarnations, opts.warmup_s, opts.rss_window_s, opts.rss_tolerance_mib,
        opts.rss_tolerance_pct, opts.rss_report_only,
    )  # fmt: skip
    inv["http"] = http_invariant(http.snapshot(), faults.windows(), OUTAGES, opts.outage_grace_s)
    if hostile is not None:
        inv["hostile"] = hostile.invariant
        inv.update(hostile.abuse)
        inv["neighbours"] = neighbour_invariant(
            records, http.snapshot(), hostile.phases.windows(), clock.at_wall,
            opts.neighbour_tolerance, opts.neighbour_min_samples, faults.windows(),
        )  # fmt: skip
        # What the control worker (2 threads: validate, finalize, cancel, estimates, webhooks
        # for every tenant) spent its time on, phase by phase.
        inv["neighbours"]["control_busy"] = task_time(
            stack.log("control"), hostile.phases.windows(), clock.at_wall, threads=2
        )
    return inv


def _violating(
    tracker: Tracker, receiver: Receiver, clock: Clock, hostile: _Hostile | None = None
) -> list[str]:
    """The batches named by a failed invariant so far (the first 10)."""
    hooks = webhook_invariant(tracker.records(), receiver.snapshot(), [], clock.at_wall)
    ids = [v["batch"] for v in tracker.line_violations]
    ids += [v["batch"] for v in tracker.overdue]
    ids += [r.id for r in tracker.unsettled()]
    ids += [v["batch"] for v in hooks["violations"] if "batch" in v]
    if hostile is not None:
        ids += [r.id for r in hostile.tracker.records() if r.status not in TERMINAL]
        ids += [v["batch"] for v in hostile.tracker.bound_violations]
    return list(dict.fromkeys(ids))[:10]


def _db_rows(database_url: str, batch_ids: list[str]) -> dict[str, Any]:
    """Each batch's row, its shards and its webhook deliveries, straight from Postgres."""
    if not batch_ids:
        return {}
    from sqlalchemy import create_engine, text

    queries = {
        "batch": "SELECT id, status, priority, completion_window, created_at, expires_at, "
        "in_progress_at, finalizing_at, completed_at, failed_at, expired_at, cancelling_at, "
        "cancelled_at, request_total, request_completed, request_failed, errors FROM batches "
        "WHERE id = :b",
        "shards": 'SELECT * FROM shards WHERE batch_id = :b ORDER BY "index"',
        "webhook_deliveries": "SELECT * FROM webhook_deliveries WHERE batch_id = :b",
    }
    engine = create_engine(database_url)
    out: dict[str, Any] = {}
    try:
        with engine.connect() as conn:
            for b in batch_ids:
                out[b] = {
                    name: [
                        {k: v if isinstance(v, int | float | str | None) else str(v)
                         for k, v in row._mapping.items()}
                        for row in conn.execute(text(sql), {"b": b})
                    ]
                    for name, sql in queries.items()
                }  # fmt: skip
    except Exception as error:
        out["error"] = f"{type(error).__name__}: {error}"
    finally:
        engine.dispose()
    return out


def _code(r: BatchRecord) -> str | None:
    try:
        return r.errors["data"][0]["code"]
    except (TypeError, KeyError, IndexError):
        return None


def _excerpts(work: Path, inv: dict[str, Any]) -> dict[str, list[str]]:
    ids: list[str] = []
    for name in ("lines", "expiry", "drained", "webhooks", "hostile"):
        ids += [v["batch"] for v in inv.get(name, {}).get("violations", []) if "batch" in v]
    return {b: _log_excerpt(work, b) for b in dict.fromkeys(ids[:10])}


def _log_excerpt(work: Path, ident: str, lines: int = 12) -> list[str]:
    found: list[str] = []
    for log in sorted(work.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if ident in line:
                found.append(f"{log.stem}: {line[:400]}")
    return found[:lines] + (found[-lines:] if len(found) > 2 * lines else found[lines:])
