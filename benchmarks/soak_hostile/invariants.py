"""The hostile tenant's verdicts: its batches, the large bodies, the upload steps, the API's
memory."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict
from typing import Any

from benchmarks.soak_hostile.bodies import MIB, BodyAttempt
from benchmarks.soak_hostile.trickle import Trickle
from benchmarks.soak_hostile.uploads import UPLOAD_EXPECT, UploadAnswer
from benchmarks.soak_hostile.watch import HostileTracker, MemorySample
from testkit.service.soak_checks import TERMINAL, HttpLog, Window


def hostile_invariant(
    tracker: HostileTracker, http: HttpLog, trickles: list[Trickle], webhook_timeout_s: float,
    slack_s: float = 5.0,
) -> dict[str, Any]:  # fmt: skip
    """Every hostile batch ended (by the end of the drain) and its files stayed within their
    bound; none of its API answers was a 5xx but 503; no trickled webhook attempt was held
    open by the service much past ``webhook_timeout_s``."""
    records = tracker.records()
    unended = [
        {"batch": r.id, "kind": r.kind, "status": r.status, "request_counts": r.counts}
        for r in records if r.status not in TERMINAL
    ]  # fmt: skip
    answers = http.snapshot()
    by_status = Counter(str(a.status) if a.status is not None else "no answer" for a in answers)
    errors = [
        {"t": round(a.t, 1), "route": a.route, "status": a.status, "detail": a.detail}
        for a in answers if a.status is not None and a.status >= 500 and a.status != 503
    ]  # fmt: skip
    trickled = [t for t in trickles if t.ended != "answered at once"]
    held_long = [
        asdict(t) for t in trickled
        if t.ended == "receiver gave up" or t.held_s > webhook_timeout_s + slack_s
    ]  # fmt: skip
    by_kind: dict[str, Counter] = {}
    for r in records:
        by_kind.setdefault(r.kind, Counter())[r.status] += 1
    violations: list[dict[str, Any]] = []
    violations += [{"unended": u, "batch": u["batch"]} for u in unended]
    violations += [{"bound": v, "batch": v["batch"]} for v in tracker.bound_violations]
    violations += [{"http": e} for e in errors]
    violations += [{"webhook_held_open": h} for h in held_long]
    held = sorted(t.held_s for t in trickled)
    largest = max(
        ({"batch": b, **c, "bound": tracker.bound(b)} for b, c in tracker.file_results.items()),
        key=lambda x: x["output_lines"] + x["error_lines"],
        default=None,
    )
    return {
        "ok": not violations,
        "batches": len(records),
        "by_kind_status": {k: dict(v) for k, v in by_kind.items()},
        "unended": len(unended),
        "largest_result": largest,
        "answers_by_status": dict(sorted(by_status.items())),
        "webhook_attempts_trickled": len(trickled),
        "webhook_attempts_answered_at_once": len(trickles) - len(trickled),
        "webhook_held_s": (
            {"p50": round(statistics.median(held), 1), "max": round(held[-1], 1)} if held else None
        ),  # fmt: skip
        "webhook_timeout_s": webhook_timeout_s,
        "violations": violations[:50],
        "violation_count": len(violations),
    }


def _during(began: float, t: float, outages: list[Window], grace_s: float) -> bool:
    return any(t >= w.start and began <= w.end + grace_s for w in outages)


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    values = sorted(values)
    return {"p50": round(statistics.median(values), 3),
            "p90": round(values[min(len(values) - 1, int(0.9 * len(values)))], 3),
            "max": round(values[-1], 3)}  # fmt: skip


def large_body_invariant(
    attempts: list[BodyAttempt], outages: list[Window], grace_s: float, within_s: float = 2.0,
    slack_bytes: int = 64 * MIB,
) -> dict[str, Any]:  # fmt: skip
    """Every large body refused: answered 401 or 413, or its connection closed by the server
    (a keyed one may get 503 while the database or broker is cut off, ``outages`` plus
    ``grace_s``: its key cannot be looked up), never unanswered; the refusal within
    ``within_s`` of when it was due (the request's start, unless the body is counted as it
    streams: then when the client had sent more than the route's limit); and the client never
    got more than ``slack_bytes`` (what the sockets' buffers hold) past that limit sent, so
    the server stopped reading. Attempts that could not connect (the API restarting) are
    counted, not judged."""
    violations: list[dict[str, Any]] = []
    by_plan: dict[str, Counter] = {}
    due_at_start: list[float] = []
    due_at_limit: list[float] = []
    sent_max: dict[str, int] = {}
    unconnected = 0
    for a in attempts:
        if not a.ended:  # still in flight when the run stopped
            continue
        outcome = str(a.status) if a.status is not None else a.ended.split(" (")[0]
        by_plan.setdefault(a.plan, Counter())[outcome] += 1
        if a.ended.startswith("could not connect"):
            unconnected += 1
            continue
        sent_max[a.plan] = max(sent_max.get(a.plan, 0), a.bytes_sent)
        waited = a.answer_s or 0.0
        if a.limit:  # counted as it streams: due once the client had sent past the limit
            waited = max(0.0, waited - a.limit_s) if a.limit_s is not None else 0.0
        excused = (
            a.status == 503 and a.keyed and _during(a.began, a.began + waited, outages, grace_s)
        )
        problem: dict[str, Any] = {}
        if a.ended == "timed out":
            problem["unanswered_after_s"] = round(a.answer_s or 0.0, 1)
        elif a.status is not None and a.status not in (401, 413) and not excused:
            problem["wrong_status"] = a.status
        if not excused and "unanswered_after_s" not in problem:
            (due_at_limit if a.limit else due_at_start).append(waited)
            if waited > within_s:
                problem["answered_after_s"] = round(waited, 2)
        if a.bytes_sent > a.limit + slack_bytes:
            problem["bytes_sent"] = a.bytes_sent
        if problem:
            violations.append({"t": a.began, "plan": a.plan, "ended": a.ended,
                               "status": a.status, **problem})  # fmt: skip
    return {
        "ok": not violations,
        "attempts": sum(sum(c.values()) for c in by_plan.values()),
        "by_outcome": dict(sum(by_plan.values(), Counter()).most_common()),
        "by_plan": {plan: dict(c) for plan, c in sorted(by_plan.items())},
        "could_not_connect": unconnected,
        "answer_s": _spread(due_at_start),  # 401s and 413s on a Content-Length
        "after_limit_s": _spread(due_at_limit),  # 413s counted as the body streamed
        "within_s": within_s,
        "bytes_sent_max_mib": {p: round(b / MIB, 2) for p, b in sorted(sent_max.items())},
        "violations": violations[:50],
        "violation_count": len(violations),
    }


def upload_abuse_invariant(
    answers: list[UploadAnswer], outages: list[Window], grace_s: float
) -> dict[str, Any]:
    """Every step of the upload abuser answered as :data:`UPLOAD_EXPECT` says: 400 for a part
    past the declared bytes or the parts bound, or after a complete or cancel, for a cancel
    after a complete, a complete after a cancel; 200 for the steps in between. A 429 (the
    tenant's concurrent uploads, its slow ones among them) refuses without taking anything
    and is counted as busy; a 503 is excused during ``outages`` (plus ``grace_s``); a step
    with no answer is counted."""
    by_kind: dict[str, Counter] = {}
    violations: list[dict[str, Any]] = []
    unanswered = busy = 0
    for a in answers:
        outcome = "no answer" if a.status is None else f"{a.status} {a.code or ''}".strip()
        by_kind.setdefault(a.kind, Counter())[outcome] += 1
        if a.status is None:
            unanswered += 1
            continue
        if a.status == 429:
            busy += 1
            continue
        if a.status == UPLOAD_EXPECT[a.kind]:
            continue
        if a.status == 503 and _during(a.began, a.t, outages, grace_s):
            continue
        violations.append({"t": a.t, "kind": a.kind, "expected": UPLOAD_EXPECT[a.kind],
                           "status": a.status, "code": a.code})  # fmt: skip
    return {
        "ok": not violations,
        "answers": len(answers),
        "by_kind": {k: dict(c) for k, c in by_kind.items()},
        "unanswered": unanswered,
        "busy": busy,
        "violations": violations[:50],
        "violation_count": len(violations),
    }


def api_memory_invariant(samples: list[MemorySample], bound_mib: float) -> dict[str, Any]:
    """For each API process (pid), its baseline (the RSS of its last sample before the
    large-body senders first went to work, or its first sample) and its peak while they
    work: each sample's RSS then, and its high-water mark where that rose since the sample
    before (a peak between two samples). The peak may be at most ``bound_mib`` over the
    baseline. Processes never sampled with the senders at work are reported, not judged."""
    by_pid: dict[int, list[MemorySample]] = {}
    for sample in sorted(samples, key=lambda x: x.t):
        by_pid.setdefault(sample.pid, []).append(sample)
    processes: list[dict[str, Any]] = []
    violations: list[dict[str, Any]] = []
    for pid, rows in by_pid.items():
        entry: dict[str, Any] = {
            "pid": pid,
            "samples": len(rows),
            "from_t": round(rows[0].t, 1),
            "to_t": round(rows[-1].t, 1),
            "high_water_mib": round(max(r.hwm_kib for r in rows) / 1024, 1),
        }
        first = next((i for i, r in enumerate(rows) if r.active), None)
        if first is None:
            processes.append({**entry, "judged": False})
            continue
        base = rows[first - 1] if first else rows[0]
        peak = 0
        previous_hwm = base.hwm_kib if first else 0
        for r in rows[first:]:
            if r.active:
                peak = max(peak, r.rss_kib, r.hwm_kib if r.hwm_kib > previous_hwm else 0)
            previous_hwm = r.hwm_kib
        growth = (peak - base.rss_kib) / 1024
        entry.update(
            judged=True,
            baseline_mib=round(base.rss_kib / 1024, 1),
            peak_mib=round(peak / 1024, 1),
            growth_mib=round(growth, 1),
            active_samples=sum(1 for r in rows if r.active),
        )
        processes.append(entry)
        if growth > bound_mib:
            violations.append({"pid": pid, "baseline_mib": entry["baseline_mib"],
                               "peak_mib": entry["peak_mib"], "bound_mib": bound_mib})  # fmt: skip
    judged = [p for p in processes if p["judged"]]
    return {
        "ok": not violations,
        "bound_mib": bound_mib,
        "judged": len(judged),
        "peak_mib": max((p["peak_mib"] for p in judged), default=None),
        "growth_mib": max((p["growth_mib"] for p in judged), default=None),
        "high_water_mib": max((p["high_water_mib"] for p in processes), default=None),
        "processes": processes,
        "violations": violations,
        "violation_count": len(violations),
    }
