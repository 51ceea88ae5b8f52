"""What ``benchmarks.soak`` watches and judges: API answers, batches and invariants.

What ``benchmarks.soak`` watches and judges: every API answer (:class:`HttpLog`), every
batch it submitted (:class:`Tracker`, which polls them, and when one ends downloads its output
and error files and compares their ``custom_id``s with the input), and the invariants
evaluated from those records, the webhook receiver's and the RSS samples."""

from __future__ import annotations

import json
import re
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
SAMPLE = 10  # ids, batches or lines quoted per violation


# ---------------------------------------------------------------------------------------------
# HTTP


@dataclass(frozen=True, slots=True)
class Answer:
    began: float
    t: float
    route: str
    status: int | None  # None: no answer (connection refused or reset, timeout)
    detail: str = ""


class HttpLog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.answers: list[Answer] = []

    def add(self, answer: Answer) -> None:
        with self._lock:
            self.answers.append(answer)

    def snapshot(self) -> list[Answer]:
        with self._lock:
            return list(self.answers)


class Api:
    """One httpx client per tenant on the service's API; every answer goes to ``log``."""

    def __init__(self, base_url: str, keys: dict[str, str], log: HttpLog, clock: Callable):
        self.log = log
        self.clock = clock
        self.clients = {
            tenant: httpx.Client(
                base_url=base_url,
                headers={"Authorization": f"Bearer {key}"},
                timeout=httpx.Timeout(60.0, connect=5.0),
            )
            for tenant, key in keys.items()
        }

    def call(
        self, tenant: str, method: str, url: str, route: str, **kw: Any
    ) -> httpx.Response | None:
        began = self.clock()
        try:
            r = self.clients[tenant].request(method, url, **kw)
        except httpx.HTTPError as error:
            self.log.add(Answer(began, self.clock(), route, None, type(error).__name__))
            return None
        detail = r.text[:300] if r.status_code >= 500 else ""
        self.log.add(Answer(began, self.clock(), route, r.status_code, detail))
        return r

    def retrying(
        self, tenant: str, method: str, url: str, route: str, *, for_s: float = 120.0,
        make_kw: Callable[[], dict[str, Any]] | None = None, **kw: Any,
    ) -> httpx.Response | None:  # fmt: skip
        """``call`` again while there is no answer or a 5xx, as a client would through an
        outage (backoff 0.5 s doubling to 4 s), for up to ``for_s``; the last answer."""
        deadline = time.monotonic() + for_s
        delay = 0.5
        while True:
            r = self.call(tenant, method, url, route, **(make_kw() if make_kw else kw))
            if r is not None and r.status_code < 500:
                return r
            if time.monotonic() + delay > deadline:
                return r
            time.sleep(delay)
            delay = min(delay * 2, 4.0)

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


# ---------------------------------------------------------------------------------------------
# Batches


@dataclass
class BatchRecord:
    id: str
    tenant: str
    kind: str  # chat | structured | embeddings | broken
    endpoint: str
    custom_ids: list[str]
    window: str
    priority_requested: str
    priority: str
    webhook: bool
    created_t: float
    expires_at: int | None
    cancel_requested_t: float | None = None
    status: str = "validating"
    seen_wall: float = 0.0  # time.time() of the listing that last showed it
    terminal_t: float | None = None  # when the monitor saw it ended
    ended_at: int | None = None  # the batch's own completed_at/failed_at/... (unix seconds)
    validated: bool = False  # reached in_progress (its lines were accepted)
    counts: dict[str, int] = field(default_factory=dict)
    errors: Any = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    checked: bool = False
    check_attempts: int = 0
    outputs: int = 0
    error_codes: Counter = field(default_factory=Counter)
    overdue: dict[str, Any] | None = None


class Tracker:
    """The batches the soak submitted. A monitor thread lists each tenant's batches every
    ``poll_s``; a batch that ended has its files read and compared with its input."""

    def __init__(self, api: Api, clock: Callable[[], float], poll_s: float, expiry_grace_s: float):
        self.api = api
        self.clock = clock
        self.poll_s = poll_s
        self.expiry_grace_s = expiry_grace_s
        self.batches: dict[str, BatchRecord] = {}
        self.line_violations: list[dict[str, Any]] = []
        self.overdue: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-monitor", daemon=True)

    def add(self, record: BatchRecord) -> None:
        with self._lock:
            self.batches[record.id] = record

    def records(self) -> list[BatchRecord]:
        with self._lock:
            return list(self.batches.values())

    def start(self) -> Tracker:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def settled(self) -> bool:
        """Every batch ended and its files were checked."""
        return all(r.status in TERMINAL and r.checked for r in self.records())

    def unsettled(self) -> list[BatchRecord]:
        return [r for r in self.records() if not (r.status in TERMINAL and r.checked)]

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                self.poll_once()
            except Exception as error:  # a harness bug must not stop the watching
                print(f"soak monitor: {type(error).__name__}: {error}", flush=True)
            self._stop.wait(max(0.1, self.poll_s - (time.monotonic() - began)))

    def poll_once(self) -> None:
        by_tenant: dict[str, set[str]] = {}
        for r in self.records():
            if r.status not in TERMINAL:
                by_tenant.setdefault(r.tenant, set()).add(r.id)
        for tenant, wanted in by_tenant.items():
            self._list(tenant, wanted)
        for r in self.records():
            if r.status in TERMINAL and not r.checked and r.check_attempts < 50:
                self._check_lines(r)
        self._check_overdue()

    def _list(self, tenant: str, wanted: set[str]) -> None:
        after: str | None = None
        while wanted:
            params: dict[str, Any] = {"limit": 100}
            if after:
                params["after"] = after
            seen_wall = time.time()
            r = self.api.call(tenant, "GET", "/v1/batches", "GET /v1/batches", params=params)
            if r is None or r.status_code != 200:
                return
            page = r.json()
            for item in page["data"]:
                record = self.batches.get(item["id"])
                if record is not None:
                    self._update(record, item, seen_wall)
                    wanted.discard(item["id"])
            if not page.get("has_more") or not page["data"]:
                return
            after = page["data"][-1]["id"]

    def _update(self, record: BatchRecord, item: dict[str, Any], seen_wall: float) -> None:
        record.seen_wall = seen_wall
        record.expires_at = item.get("expires_at") or record.expires_at
        record.counts = item.get("request_counts") or {}
        record.errors = item.get("errors")
        record.validated = record.validated or item.get("in_progress_at") is not None
        record.output_file_id = item.get("output_file_id")
        record.error_file_id = item.get("error_file_id")
        if record.status != item["status"]:
            record.status = item["status"]
            if record.status in TERMINAL:
                record.terminal_t = self.clock()
                record.ended_at = item.get(f"{record.status}_at")

    # -- every accepted line has exactly one output or error line -----------------------------

    def _download(self, record: BatchRecord, file_id: str | None) -> list[dict[str, Any]] | None:
        if file_id is None:
            return []
        r = self.api.call(
            record.tenant, "GET", f"/v1/files/{file_id}/content", "GET /v1/files/{id}/content"
        )
        if r is None or r.status_code != 200:
            return None
        return [json.loads(x) for x in r.text.splitlines() if x.strip()]

    def _check_lines(self, record: BatchRecord) -> None:
        record.check_attempts += 1
        out = self._download(record, record.output_file_id)
        err = self._download(record, record.error_file_id)
        if out is None or err is None:
            return  # try again next round
        record.checked = True
        record.outputs = len(out)
        for line in err:
            record.error_codes[_error_code(line)] += 1
        seen = Counter(str(x.get("custom_id")) for x in [*out, *err])
        expected = Counter(record.custom_ids)
        has_lines = bool(out or err)
        problems: dict[str, Any] = {}
        if record.validated or has_lines:
            lost = sorted(set(expected) - set(seen))
            doubled = sorted(c for c, n in seen.items() if n > 1)
            unexpected = sorted(set(seen) - set(expected))
            if lost:
                problems["lost"] = {"count": len(lost), "custom_ids": lost[:SAMPLE]}
            if doubled:
                problems["doubled"] = {"count": len(doubled), "custom_ids": doubled[:SAMPLE]}
            if unexpected:
                problems["unexpected"] = {
                    "count": len(unexpected),
                    "custom_ids": unexpected[:SAMPLE],
                }
            if record.status == "completed" and record.counts.get("completed") != len(out):
                problems["counts"] = {"request_counts": record.counts, "output_lines": len(out)}
        elif record.status == "completed":
            problems["lost"] = {"count": len(expected), "custom_ids": record.custom_ids[:SAMPLE]}
        if problems:
            self.line_violations.append(
                {
                    "batch": record.id,
                    "tenant": record.tenant,
                    "kind": record.kind,
                    "status": record.status,
                    "lines": len(record.custom_ids),
                    "output_lines": len(out),
                    "error_lines": len(err),
                    "request_counts": record.counts,
                    "errors": record.errors,
                    **problems,
                }
            )

    # -- no batch past its window still unfinished --------------------------------------------

    def _check_overdue(self) -> None:
        for r in self.records():
            if r.status in TERMINAL or r.overdue is not None or r.expires_at is None:
                continue
            late = r.seen_wall - (r.expires_at + self.expiry_grace_s)
            if late > 0:
                r.overdue = {
                    "batch": r.id,
                    "tenant": r.tenant,
                    "status": r.status,
                    "window": r.window,
                    "seconds_past_window": round(r.seen_wall - r.expires_at, 1),
                    "seen_at_t": round(self.clock(), 1),
                }
                self.overdue.append(r.overdue)


def _error_code(line: dict[str, Any]) -> str:
    error = line.get("error")
    if isinstance(error, dict) and error.get("code"):
        return str(error["code"])
    try:
        return str(line["response"]["body"]["error"]["code"])
    except (KeyError, TypeError):
        return "?"


# ---------------------------------------------------------------------------------------------
# Invariants


@dataclass(frozen=True, slots=True)
class Window:
    kind: str
    start: float
    end: float


def http_invariant(
    answers: list[Answer], faults: list[Window], outage_kinds: Iterable[str], grace_s: float
) -> dict[str, Any]:
    """No 5xx but 503, and a 503 only while the database or broker is cut off (a fault of
    ``outage_kinds``, or within ``grace_s`` after). Requests that got no answer are counted
    by the fault they overlapped (a restarting API refuses connections: no violation)."""
    by_status = Counter(str(a.status) if a.status is not None else "no answer" for a in answers)
    outages = [w for w in faults if w.kind in set(outage_kinds)]

    def overlaps(a: Answer, w: Window) -> bool:
        return a.t >= w.start and a.began <= w.end + grace_s

    def during_outage(a: Answer) -> bool:
        return any(overlaps(a, w) for w in outages)

    unanswered: Counter = Counter()
    for a in answers:
        if a.status is None:
            unanswered[next((w.kind for w in faults if overlaps(a, w)), "outside faults")] += 1

    bad = [
        {"t": round(a.t, 1), "route": a.route, "status": a.status, "detail": a.detail}
        for a in answers
        if a.status is not None and a.status >= 500 and (a.status != 503 or not during_outage(a))
    ]
    return {
        "ok": not bad,
        "answers": len(answers),
        "by_status": dict(sorted(by_status.items())),
        "violations": bad[:50],
        "violation_count": len(bad),
        "unanswered": dict(unanswered),
    }


def webhook_invariant(
    records: list[BatchRecord], deliveries: list[Any], malformed: list[str],
    at_wall: Callable[[float], float],
) -> dict[str, Any]:  # fmt: skip
    """Every batch with a webhook that ended has its event delivered (a 2xx answer) at least
    once, under one event id, of the type its status names, correctly signed."""
    by_batch: dict[str, list[Any]] = {}
    for d in deliveries:
        by_batch.setdefault(d.batch_id, []).append(d)
    expected = {r.id: r for r in records if r.webhook and r.status in TERMINAL}
    violations: list[dict[str, Any]] = []
    latencies: list[float] = []
    for batch_id, r in expected.items():
        got = by_batch.get(batch_id, [])
        ok = [d for d in got if 200 <= d.answered < 300]
        ids = sorted({d.event_id for d in got})
        types = sorted({d.event_type for d in got})
        problem: dict[str, Any] = {}
        if not ok:
            problem["missing"] = f"{len(got)} attempts received, none answered 2xx"
        if len(ids) > 1:
            problem["event_ids"] = ids
        if types and types != [f"batch.{r.status}"]:
            problem["types"] = types
        if any(not d.signature_ok for d in got):
            problem["bad_signature"] = sum(1 for d in got if not d.signature_ok)
        if problem:
            violations.append(
                {"batch": batch_id, "tenant": r.tenant, "status": r.status, "errors": r.errors,
                 **problem}
            )  # fmt: skip
        if ok and r.ended_at is not None:  # whole seconds: up to 1 s too long
            latencies.append(max(0.0, ok[0].t - at_wall(r.ended_at)))
    unknown = sorted(set(by_batch) - {r.id for r in records if r.webhook})
    if unknown:
        violations.append({"events_for_unknown_batches": unknown[:SAMPLE]})
    if malformed:
        violations.append({"malformed_bodies": malformed[:SAMPLE]})
    return {
        "ok": not violations,
        "events_expected": len(expected),
        "events_delivered": sum(
            1 for b in expected if any(200 <= d.answered < 300 for d in by_batch.get(b, []))
        ),
        "attempts_received": len(deliveries),
        "retried_after_500": sum(1 for d in deliveries if d.answered == 500),
        "delivery_latency_s": _quantiles(latencies),
        "violations": violations[:50],
        "violation_count": len(violations),
    }


def _quantiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    values = sorted(values)

    def q(p: float) -> float:
        return round(values[min(len(values) - 1, int(p * len(values)))], 2)

    return {"p50": q(0.5), "p90": q(0.9), "max": round(values[-1], 2)}


def rss_invariant(
    incarnations: list[Any], warmup_s: float, window_s: float, tolerance_mib: float,
    tolerance_pct: float, report_only: bool,
) -> dict[str, Any]:  # fmt: skip
    """Each process's RSS after its warm-up (``warmup_s`` from its start): the growth from the
    median of the first ``window_s`` after warm-up to the median of the last ``window_s``
    must stay within ``max(tolerance_mib, tolerance_pct % of the first)``. Judged only for
    runs that lasted at least warm-up plus two windows; every run's curve is reported."""
    processes: list[dict[str, Any]] = []
    failing: list[str] = []
    for inc in incarnations:
        samples = inc.rss
        entry: dict[str, Any] = {
            "name": inc.name,
            "pid": inc.pid,
            "started_t": round(inc.started, 1),
            "ended_t": None if inc.ended is None else round(inc.ended, 1),
            "exit": inc.exit,
            "samples": len(samples),
            "curve_mib": _curve(samples),
        }
        if samples:
            entry["peak_mib"] = _mib(max(kb for _, kb in samples))
            entry["last_mib"] = _mib(samples[-1][1])
        after = [(t, kb) for t, kb in samples if t >= inc.started + warmup_s]
        if after and after[-1][0] - after[0][0] >= 2 * window_s:
            first = statistics.median(kb for t, kb in after if t <= after[0][0] + window_s)
            last = statistics.median(kb for t, kb in after if t >= after[-1][0] - window_s)
            growth = (last - first) / 1024
            # The second half alone: a leak grows as much there as in the first; an allocator
            # still reaching its high-water mark mostly in the first.
            mid_t = (after[0][0] + after[-1][0]) / 2
            middle = [kb for t, kb in after if abs(t - mid_t) <= window_s / 2] or [last]
            late = (last - statistics.median(middle)) / 1024
            allowed = max(tolerance_mib, tolerance_pct / 100 * first / 1024)
            span_h = (after[-1][0] - after[0][0]) / 3600
            entry.update(
                judged=True,
                after_warmup_mib=round(first / 1024, 1),
                growth_mib=round(growth, 1),
                second_half_growth_mib=round(late, 1),
                allowed_mib=round(allowed, 1),
                slope_mib_per_h=round(_slope(after) / 1024, 1),
                span_s=round(span_h * 3600),
                flat=growth <= allowed,
            )
            if growth > allowed:
                failing.append(f"{inc.name} (pid {inc.pid})")
        else:
            entry["judged"] = False
        processes.append(entry)
    return {
        "ok": report_only or not failing,
        "report_only": report_only,
        "warmup_s": warmup_s,
        "window_s": window_s,
        "judged": sum(1 for p in processes if p["judged"]),
        "not_flat": failing,
        "processes": processes,
    }


def _mib(kb: float) -> float:
    return round(kb / 1024, 1)


def _curve(samples: list[tuple[float, int]], points: int = 16) -> list[list[float]]:
    """``[t, MiB]`` at about ``points`` evenly spaced samples (the first and last included)."""
    if not samples:
        return []
    step = max(1, (len(samples) - 1) // (points - 1))
    picked = samples[::step]
    if picked[-1] != samples[-1]:
        picked.append(samples[-1])
    return [[round(t), _mib(kb)] for t, kb in picked]


def _slope(samples: list[tuple[float, int]]) -> float:
    """Least-squares KiB per hour."""
    if len(samples) < 2:
        return 0.0
    ts = [t for t, _ in samples]
    ys = [kb for _, kb in samples]
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    den = sum((t - mt) ** 2 for t in ts)
    if den == 0:
        return 0.0
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / den * 3600


def neighbour_invariant(
    records: list[BatchRecord], answers: list[Answer], phases: list[dict[str, Any]],
    at_wall: Callable[[float], float], tolerance: float, min_samples: int = 3,
    faults: Iterable[Window] = (),
) -> dict[str, Any]:  # fmt: skip
    """The normal tenants' batches beside a hostile tenant: the turnaround (create to end) of
    each batch that completed, by the phase it was created in (``phases``: ``start``, ``end``,
    ``hostile``), compared between the hostile and the quiet phases of the same run. The
    hostile phases' median may be at most ``tolerance`` times the quiet phases'; judged when
    each side has ``min_samples`` batches. The p90 ratio, each phase's median, the medians by
    kind and the latency of the normal tenants' uploads and creates (``answers``) are
    reported beside it."""

    def phase_of(t: float) -> dict[str, Any] | None:
        return next((p for p in phases if p["start"] <= t < p["end"]), None)

    turnaround: dict[int, list[tuple[str, float]]] = {p["index"]: [] for p in phases}
    for r in records:
        if r.status != "completed":
            continue
        phase = phase_of(r.created_t)
        # The batch's own end is in whole seconds: take the middle of its second. (Batches
        # that end within a second of their create are common; clamping them all to 0 made
        # the medians' ratio noise.)
        end = at_wall(r.ended_at) + 0.5 if r.ended_at is not None else r.terminal_t
        if phase is None or end is None:
            continue
        turnaround[phase["index"]].append((r.kind, max(0.0, end - r.created_t)))

    def side(hostile: bool, kind: str | None = None) -> list[float]:
        return [
            s for p in phases if p["hostile"] == hostile
            for k, s in turnaround[p["index"]] if kind is None or k == kind
        ]  # fmt: skip

    quiet, noisy = side(False), side(True)
    q, h = _quantiles(quiet), _quantiles(noisy)
    judged = len(quiet) >= min_samples and len(noisy) >= min_samples
    ratio = {
        name: round(h[name] / q[name], 2) if q and h and q[name] > 0 else None
        for name in ("p50", "p90")
    }
    ok = not judged or (ratio["p50"] is not None and ratio["p50"] <= tolerance)
    kinds = sorted({k for rows in turnaround.values() for k, _ in rows})
    by_kind = {}
    for kind in kinds:
        kq, kh = side(False, kind), side(True, kind)
        by_kind[kind] = {
            "quiet_n": len(kq), "hostile_n": len(kh),
            "quiet_p50": statistics.median(kq) if kq else None,
            "hostile_p50": statistics.median(kh) if kh else None,
        }  # fmt: skip
    latency: dict[str, Any] = {}
    for route in ("POST /v1/files", "POST /v1/batches"):
        by_side: dict[bool, list[float]] = {False: [], True: []}
        for a in answers:
            phase = phase_of(a.began)
            if a.route == route and a.status == 200 and phase is not None:
                by_side[phase["hostile"]].append(a.t - a.began)
        lq, lh = _quantiles(by_side[False]), _quantiles(by_side[True])
        latency[route] = {
            "quiet": lq, "hostile": lh,
            "ratio_p50": round(lh["p50"] / lq["p50"], 2) if lq and lh and lq["p50"] else None,
        }  # fmt: skip
    windows = list(faults)
    return {
        "ok": ok,
        "judged": judged,
        "tolerance": tolerance,
        "min_samples": min_samples,
        "quiet": {"batches": len(quiet), **(q or {})},
        "hostile": {"batches": len(noisy), **(h or {})},
        "ratio": ratio,
        "phases": [
            {
                **p,
                "completed": len(turnaround[p["index"]]),
                "turnaround_s": _quantiles([s for _, s in turnaround[p["index"]]]),
                "faults": sorted(w.kind for w in windows if p["start"] <= w.start < p["end"]),
            }
            for p in phases
        ],
        "by_kind": by_kind,
        "api_latency_s": latency,
        "violations": []
        if ok
        else [{"ratio_p50": ratio["p50"], "tolerance": tolerance, "quiet": q, "hostile": h}],
    }


_TASK_DONE = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}): \w+/\w+\] Task ([\w.]+)\[[^\]]+\] "
    r"(?:succeeded|raised|failed|retry)\D*([\d.]+)s"
)


def task_time(log: str, phases: list[dict[str, Any]], to_t: Callable[[float], float],
              threads: int) -> list[dict[str, Any]]:  # fmt: skip
    """How busy a Celery worker was in each phase, from its log's ``Task X[id] succeeded in
    Ns`` lines (logged in local time; ``to_t`` maps unix seconds to the soak's clock): the
    seconds each task name took, by the phase it ended in, and the share of ``threads`` x the
    phase's length they fill."""
    busy: dict[int, Counter] = {p["index"]: Counter() for p in phases}
    for line in log.splitlines():
        m = _TASK_DONE.match(line)
        if not m:
            continue
        stamp = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
        t = to_t(stamp + int(m.group(2)) / 1000)
        phase = next((p for p in phases if p["start"] <= t < p["end"]), None)
        if phase is not None:
            busy[phase["index"]][m.group(3).rsplit(".", 1)[-1]] += float(m.group(4))
    return [
        {"index": p["index"], "hostile": p["hostile"],
         "busy_share": round(sum(busy[p["index"]].values()) / (threads * (p["end"] - p["start"])), 2),
         "seconds_by_task": {k: round(v, 1) for k, v in busy[p["index"]].most_common()}}
        for p in phases
    ]  # fmt: skip
