"""The soak-and-chaos benchmark (``python -m benchmarks.soak``), short: 150 s of mixed traffic
from four tenants through the whole service while a model worker and the control worker are
SIGKILLed, Redis and Postgres are cut off and the API restarts. Every invariant but RSS
flatness must hold (three minutes are mostly warm-up, so RSS is reported, not judged). And
the checks themselves, on made-up records: they do catch a lost, doubled or unknown line, a
stray 5xx, a missing or re-identified webhook event, a growing RSS."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from benchmarks.soak import FAULTS, Options, fault_plan
from benchmarks.soak_hostile import (
    BODY_PLANS,
    MIB,
    ApiMemory,
    BodyAttempt,
    HostileTracker,
    MemorySample,
    Phases,
    SlowUpload,
    Trickle,
    TrickleReceiver,
    UploadAnswer,
    amplifying_file,
    api_memory_invariant,
    hostile_invariant,
    large_body_invariant,
    nested_file,
    nested_lines,
    send_large_body,
    slow_upload,
    upload_abuse_invariant,
)
from testkit.service.soak_checks import (
    Answer,
    BatchRecord,
    HttpLog,
    Tracker,
    Window,
    http_invariant,
    neighbour_invariant,
    rss_invariant,
    task_time,
    webhook_invariant,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.services
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_short_soak_holds_its_invariants(private_broker: str, tmp_path: Path) -> None:
    from tests.conftest import PG_ADMIN_URL

    report_path = tmp_path / "soak.json"
    log_path = tmp_path / "soak.out"
    cmd = [
        sys.executable, "-m", "benchmarks.soak", "--duration", "150", "--rss-report-only",
        "--json", str(report_path), "--work-dir", str(tmp_path / "work"),
        "--pg-admin-url", PG_ADMIN_URL, "--redis-url", private_broker,
        "--drain-timeout", "240", "--webhook-timeout", "180",
    ]  # fmt: skip
    with log_path.open("w") as log:
        done = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=840)
    output = log_path.read_text(errors="replace")
    assert report_path.exists(), output[-20000:]
    report = json.loads(report_path.read_text())
    print(output[-6000:])

    invariants = report["invariants"]
    failing = {name: inv for name, inv in invariants.items() if name != "rss" and not inv["ok"]}
    assert not failing, (
        json.dumps(failing, indent=1)[:15000]
        + json.dumps(report.get("log_excerpts"), indent=1)[:8000]
        + output[-4000:]
    )
    assert done.returncode == 0, output[-6000:]

    # The run did what it says: every fault, injected and recovered from.
    assert sorted(e["kind"] for e in report["faults"]) == sorted(FAULTS), report["faults"]
    assert not report["fault_errors"], report["fault_errors"]
    traffic = report["traffic"]
    assert traffic["batches"] >= 20, traffic
    assert set(traffic["by_kind"]) >= {"chat", "structured", "embeddings", "upstream"}, traffic
    assert traffic["by_status"].get("completed", 0) >= 10, traffic
    assert invariants["lines"]["lines_accepted"] > 200, invariants["lines"]
    assert invariants["webhooks"]["events_expected"] >= 10, invariants["webhooks"]
    # Keys from `batchd keys create --max-priority high`: every priority asked for, granted.
    assert {k["max_priority"] for k in report["keys"].values()} == {"high"}, report["keys"]
    assert traffic["priority_refused"] == 0, traffic
    assert {p.split("->")[0] for p in traffic["priorities"]} == {"low", "normal", "high"}
    assert all(a == b for a, b in (p.split("->") for p in traffic["priorities"])), traffic
    # RSS: every long-lived process was sampled, the restarted ones once per run.
    sampled = {p["name"] for p in invariants["rss"]["processes"] if p["samples"]}
    assert sampled >= {"api", "control", "beat", "model-1", "model-2", "dispatch-1"}, sampled


# ---------------------------------------------------------------------------------------------
# The checks, on records made up here.


def _record(batch_id: str, ids: list[str], **kw: Any) -> BatchRecord:
    base: dict[str, Any] = {
        "id": batch_id, "tenant": "t", "kind": "chat", "endpoint": "/v1/chat/completions",
        "custom_ids": ids, "window": "24h", "priority_requested": "normal",
        "priority": "normal", "webhook": True, "created_t": 0.0, "expires_at": None,
    }  # fmt: skip
    base.update(kw)
    return BatchRecord(**base)


class _Files:
    """Answers ``GET /v1/files/{id}/content`` from a dict of file id -> lines."""

    def __init__(self, files: dict[str, list[dict[str, Any]]]):
        self.files = files

    def call(self, tenant: str, method: str, url: str, route: str, **kw: Any) -> Any:
        file_id = url.split("/")[3]
        text = "".join(json.dumps(x) + "\n" for x in self.files[file_id])
        return SimpleNamespace(status_code=200, text=text)


def _out(cid: str) -> dict[str, Any]:
    return {"custom_id": cid, "response": {"status_code": 200, "body": {}}, "error": None}


def _err(cid: str, code: str) -> dict[str, Any]:
    return {"custom_id": cid, "response": None, "error": {"code": code, "message": "m"}}


def test_line_check_finds_lost_doubled_and_unknown_lines() -> None:
    files = {
        "good-out": [_out("a"), _out("b")],
        "good-err": [_err("c", "batch_expired")],
        "bad-out": [_out("a"), _out("a"), _out("zzz")],
        "bad-err": [],
    }
    tracker = Tracker(_Files(files), lambda: 0.0, poll_s=1, expiry_grace_s=10)  # type: ignore[arg-type]
    good = _record("good", ["a", "b", "c"], status="expired", validated=True,
                   output_file_id="good-out", error_file_id="good-err")  # fmt: skip
    bad = _record("bad", ["a", "b", "c"], status="completed", validated=True,
                  output_file_id="bad-out", error_file_id=None,
                  counts={"total": 3, "completed": 2, "failed": 0})  # fmt: skip
    never_validated = _record("cancelled-early", ["a"], status="cancelled")
    for r in (good, bad, never_validated):
        tracker._check_lines(r)
    assert good.checked and good.error_codes == {"batch_expired": 1}
    (violation,) = tracker.line_violations
    assert violation["batch"] == "bad"
    assert violation["lost"]["custom_ids"] == ["b", "c"]
    assert violation["doubled"]["custom_ids"] == ["a"]
    assert violation["unexpected"]["custom_ids"] == ["zzz"]
    assert violation["counts"]["output_lines"] == 3


def test_overdue_batches_are_reported_once() -> None:
    tracker = Tracker(_Files({}), lambda: 5.0, poll_s=1, expiry_grace_s=30)  # type: ignore[arg-type]
    late = _record("late", ["a"], status="in_progress", expires_at=1000, seen_wall=1031.0)
    within = _record("within", ["a"], status="in_progress", expires_at=1000, seen_wall=1029.0)
    ended = _record("ended", ["a"], status="expired", expires_at=1000, seen_wall=1100.0)
    for r in (late, within, ended):
        tracker.add(r)
    tracker._check_overdue()
    tracker._check_overdue()
    assert [v["batch"] for v in tracker.overdue] == ["late"]


def test_http_rule_allows_503_only_during_outages() -> None:
    faults = [Window("pg-cut", 100, 106), Window("api-restart", 200, 205)]
    answers = [
        Answer(101, 102, "GET /v1/batches", 503),  # in the cut
        Answer(115, 118, "GET /v1/batches", 503),  # within the grace after it
        Answer(150, 151, "GET /v1/batches", 503),  # nowhere near one
        Answer(160, 161, "POST /v1/batches", 500),  # never allowed
        Answer(201, 202, "GET /v1/batches", None),  # the API restarting
    ]
    inv = http_invariant(answers, faults, ("pg-cut", "redis-cut"), grace_s=15)
    assert not inv["ok"]
    assert [(v["t"], v["status"]) for v in inv["violations"]] == [(151, 503), (161, 500)]
    assert inv["unanswered"] == {"api-restart": 1}


def test_webhook_rule_wants_one_signed_event_per_ended_batch() -> None:
    def d(batch: str, event: str, code: int = 200, kind: str = "batch.completed", sig=True):
        return SimpleNamespace(t=10.0, path="/hook/t", event_id=event, event_type=kind,
                               batch_id=batch, signature_ok=sig, answered=code)  # fmt: skip

    records = [
        _record("ok", ["a"], status="completed", ended_at=5),
        _record("retried", ["a"], status="completed"),
        _record("missing", ["a"], status="completed"),
        _record("two-ids", ["a"], status="completed"),
        _record("bad-sig", ["a"], status="cancelled"),
        _record("no-hook", ["a"], status="completed", webhook=False),
        _record("running", ["a"], status="in_progress"),
    ]
    deliveries = [
        d("ok", "evt_1"),
        d("retried", "evt_2", 500), d("retried", "evt_2"),
        d("missing", "evt_3", 500),
        d("two-ids", "evt_4"), d("two-ids", "evt_5"),
        d("bad-sig", "evt_6", kind="batch.cancelled", sig=False),
    ]  # fmt: skip
    inv = webhook_invariant(records, deliveries, [], at_wall=lambda unix: unix - 0.0)
    assert inv["events_expected"] == 5 and inv["events_delivered"] == 4
    problems = {v["batch"]: v for v in inv["violations"]}
    assert set(problems) == {"missing", "two-ids", "bad-sig"}
    assert "missing" in problems["missing"]
    assert problems["two-ids"]["event_ids"] == ["evt_4", "evt_5"]
    assert problems["bad-sig"]["bad_signature"] == 1
    assert inv["delivery_latency_s"]["max"] == 5.0


def test_rss_rule_judges_growth_after_warm_up() -> None:
    def run(name: str, growth_kb_per_s: float, seconds: int = 400) -> Any:
        rss = [(float(t), int(500_000 + growth_kb_per_s * t)) for t in range(0, seconds, 5)]
        return SimpleNamespace(name=name, pid=1, started=0.0, ended=None, exit=None, rss=rss)

    flat, leaking, short = run("flat", 0.0), run("leak", 500.0), run("short", 500.0, 100)
    inv = rss_invariant([flat, leaking, short], warmup_s=100, window_s=30, tolerance_mib=48,
                        tolerance_pct=10, report_only=False)  # fmt: skip
    assert not inv["ok"] and inv["not_flat"] == ["leak (pid 1)"]
    by_name = {p["name"]: p for p in inv["processes"]}
    assert by_name["flat"]["flat"] and by_name["flat"]["growth_mib"] == 0
    assert not by_name["short"]["judged"]
    assert by_name["leak"]["slope_mib_per_h"] == pytest.approx(500 * 3600 / 1024, rel=0.01)
    leak = by_name["leak"]
    assert leak["second_half_growth_mib"] == pytest.approx(leak["growth_mib"] / 2, rel=0.1)
    report_only = rss_invariant([leaking], 100, 30, 48, 10, report_only=True)
    assert report_only["ok"] and report_only["not_flat"]


def test_fault_plan_spreads_rounds_over_the_run() -> None:
    plan = fault_plan(Options(duration=1800).resolve())
    assert [kind for _, kind in plan] == list(FAULTS) * 3
    times = [t for t, _ in plan]
    assert times == sorted(times) and times[0] >= 60 and times[-1] < 1800
    assert fault_plan(Options(duration=150, faults=()).resolve()) == []


# ---------------------------------------------------------------------------------------------
# The hostile tenant's pieces, on made-up records and loopback sockets.


def test_phases_alternate_quiet_and_hostile() -> None:
    phases = Phases(t0=10.0, duration=400.0, count=4)
    assert [(p.start, p.end, p.hostile) for p in phases.phases] == [
        (10, 110, False), (110, 210, True), (210, 310, False), (310, 410, True),
    ]  # fmt: skip
    assert not phases.hostile_at(9.9) and phases.hostile_at(110) and not phases.hostile_at(410)


def test_neighbour_rule_compares_turnaround_between_phases() -> None:
    phases = Phases(t0=0.0, duration=400.0, count=4).windows()

    def batch(i: int, created: float, took: float, status: str = "completed") -> BatchRecord:
        return _record(f"b{i}", ["a"], status=status, created_t=created,
                       ended_at=int(created + took))  # fmt: skip

    quiet = [batch(i, 10 + i, 10) for i in range(4)] + [batch(5, 220, 12)]
    slow = [batch(10 + i, 120 + i, 25) for i in range(4)] + [batch(20, 330, 30)]
    ignored = [batch(30, 130, 500, "expired"), batch(31, 450, 1)]  # not completed; after
    answers = [Answer(20, 20.5, "POST /v1/files", 200), Answer(130, 131.5, "POST /v1/files", 200)]
    inv = neighbour_invariant([*quiet, *slow, *ignored], answers, phases, lambda u: u, 2.0,
                              faults=[Window("pg-cut", 150, 156)])  # fmt: skip
    assert inv["judged"] and not inv["ok"]
    assert inv["quiet"]["batches"] == 5 and inv["hostile"]["batches"] == 5
    assert inv["ratio"]["p50"] == round(25.5 / 10.5, 2)  # ends in whole seconds: mid-second
    assert [p["completed"] for p in inv["phases"]] == [4, 4, 1, 1]
    assert inv["phases"][1]["faults"] == ["pg-cut"]
    assert inv["api_latency_s"]["POST /v1/files"]["ratio_p50"] == 3.0
    assert neighbour_invariant([*quiet, *slow], [], phases, lambda u: u, 3.0)["ok"]
    few = neighbour_invariant(quiet[:2] + slow[:2], [], phases, lambda u: u, 2.0)
    assert few["ok"] and not few["judged"]


def test_hostile_files_are_what_they_say() -> None:
    for depth_line in nested_lines(2000):
        with pytest.raises(RecursionError):
            json.loads(depth_line)
    data, lines = nested_file(2, 2000, head=8)
    assert data.count(b"\n") == lines and json.loads(data.splitlines()[8])["custom_id"]
    data, lines = amplifying_file(1, 0.5, head=8)
    assert data.count(b"\n") == lines == 8 + 256 * 1024
    assert data.endswith(b"a\na\n")


def test_hostile_tracker_bounds_a_cancelled_batchs_files() -> None:
    cancelled = [_err(None, "batch_cancelled")] * 5  # type: ignore[arg-type]
    files = {"fine": cancelled[:4], "amplified": cancelled}
    tracker = HostileTracker(_Files(files), lambda: 0.0, poll_s=1, max_requests=3)  # type: ignore[arg-type]
    ok = _record("ok", [], kind="amplify", status="cancelled", error_file_id="fine")
    bad = _record("bad", [], kind="amplify", status="cancelled", error_file_id="amplified")
    small = _record("small", [], kind="nested", status="cancelled", error_file_id="fine")
    tracker.add_batch(ok, 1_000_000)
    tracker.add_batch(bad, 1_000_000)
    tracker.add_batch(small, 2)
    for r in (ok, bad, small):
        tracker._check_lines(r)
    assert ok.checked and ok.error_codes == {"batch_cancelled": 4}
    assert [(v["batch"], v["bound"]) for v in tracker.bound_violations] == [
        ("bad", 4), ("small", 3),
    ]  # fmt: skip


def test_hostile_rule_wants_every_batch_ended_and_webhooks_cut() -> None:
    tracker = HostileTracker(_Files({}), lambda: 0.0, poll_s=1, max_requests=10)  # type: ignore[arg-type]
    tracker.add_batch(_record("ended", [], kind="nested", status="failed"), 3)
    tracker.add_batch(_record("stuck", [], kind="amplify", status="cancelling"), 3)
    http = HttpLog()
    http.add(Answer(1, 2, "POST /v1/batches/estimate", 429))
    http.add(Answer(1, 2, "POST /v1/batches/estimate", 500, "boom"))
    trickles = [
        Trickle(1, 5.2, 5, "sender closed", "ended"),
        Trickle(2, 30.0, 30, "sender closed", "ended"),
        Trickle(3, 0.0, 0, "answered at once", "ended"),
    ]
    inv = hostile_invariant(tracker, http, trickles, webhook_timeout_s=5)
    assert not inv["ok"] and inv["unended"] == 1
    kinds = [next(iter(set(v) - {"batch"})) for v in inv["violations"]]
    assert kinds == ["unended", "http", "webhook_held_open"]
    assert inv["webhook_attempts_trickled"] == 2 and inv["webhook_held_s"]["max"] == 30.0


def test_trickle_receiver_never_finishes_while_trickling() -> None:
    started = time.monotonic()
    trickling = [True]
    receiver = TrickleReceiver(lambda: time.monotonic() - started, lambda: trickling[0])
    try:
        event = json.dumps({"data": {"id": "batch_1"}}).encode()
        request = (
            b"POST /hook/hostile HTTP/1.1\r\ncontent-length: %d\r\n\r\n" % len(event)
        ) + event
        with socket.create_connection(("127.0.0.1", receiver.port)) as conn:
            conn.sendall(request)
            conn.settimeout(3)
            got = b""
            while time.monotonic() - started < 1.5:
                got += conn.recv(16)
        assert got.startswith(b"H") and b"\r\n\r\n" not in got and len(got) <= 3
        trickling[0] = False
        assert httpx.post(receiver.url(), content=event, timeout=5).status_code == 200
        deadline = time.monotonic() + 5
        while len(receiver.snapshot()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        first, second = sorted(receiver.snapshot(), key=lambda t: t.t)
        assert first.ended == "sender closed" and first.batch_id == "batch_1"
        assert second.ended == "answered at once"
    finally:
        receiver.close()


def test_slow_upload_records_how_it_ended() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def answer_408() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)
                time.sleep(0.3)
                conn.sendall(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n\r\n")

        threading.Thread(target=answer_408, daemon=True).start()
        record = SlowUpload(phase=1, opened_t=0.0)
        slow_upload(port, "key", lambda: False, 0.1, record, time.monotonic)
    assert record.ended == "server answered: HTTP/1.1 408 Request Timeout"
    assert 0 < record.bytes_sent < 10

    given_up = SlowUpload(phase=1, opened_t=0.0)
    with socket.create_server(("127.0.0.1", 0)) as server:
        calls = iter([False, False, True])
        slow_upload(server.getsockname()[1], "key", lambda: next(calls), 0.05, given_up,
                    time.monotonic)  # fmt: skip
    assert given_up.ended == "client gave up" and given_up.bytes_sent == 2


def test_task_time_adds_up_a_workers_tasks_by_phase() -> None:
    log = "\n".join([
        "[2026-12-03 15:00:05,500: INFO/MainProcess] Task batchd.validate_batch[a-1] "
        "succeeded in 2.5s: None",
        "[2026-12-03 15:00:06,000: INFO/MainProcess] Task batchd.estimate_batch[b-2] "
        "succeeded in 10.0s: None",
        "[2026-12-03 15:00:15,000: INFO/MainProcess] Task batchd.cancel_batch[c-3] "
        "succeeded in 4.0s: None",
        "[2026-12-03 15:00:15,000: INFO/MainProcess] batch x cancelled: 0 ok, 3 error lines",
    ])  # fmt: skip
    start = datetime(2026, 12, 3, 15, 0, 0).timestamp()
    phases = Phases(t0=0.0, duration=20.0, count=2).windows()
    quiet, hostile = task_time(log, phases, lambda unix: unix - start, threads=2)
    assert quiet["seconds_by_task"] == {"estimate_batch": 10.0, "validate_batch": 2.5}
    assert quiet["busy_share"] == 0.62 and hostile["seconds_by_task"] == {"cancel_batch": 4.0}


def _refuser(read_bytes: int, answer: bytes | None) -> tuple[socket.socket, threading.Thread]:
    """A loopback server that reads a request's head and ``read_bytes`` more, then answers
    ``answer`` (or nothing) and closes with the rest of the body unread."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            got = b""
            while b"\r\n\r\n" not in got:
                got += conn.recv(65536)
            body = len(got.partition(b"\r\n\r\n")[2])
            while body < read_bytes:
                body += len(conn.recv(65536))
            if answer is not None:
                conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread


def test_large_body_sender_stops_at_the_answer() -> None:
    chunked_keyed = next(p for p in BODY_PLANS if p.keyed and p.framing == "chunked")
    no_key = next(p for p in BODY_PLANS if not p.keyed and p.framing == "declared")
    refusal = b"HTTP/1.1 413 Request Entity Too Large\r\nconnection: close\r\n\r\n"
    server, thread = _refuser(MIB, refusal)
    with server:
        record = BodyAttempt(chunked_keyed.name, True, 0.0, limit=MIB)
        send_large_body(server.getsockname()[1], chunked_keyed, "key", 256 * MIB, record,
                        time.monotonic)  # fmt: skip
        thread.join(5)
    assert record.status == 413 and record.ended == "answered"
    assert MIB < record.bytes_sent < 128 * MIB  # what the sockets held, not the body
    assert record.limit_s is not None and record.answer_s is not None
    assert record.limit_s <= record.answer_s < 10

    server, thread = _refuser(0, None)  # closed without a word
    with server:
        closed = BodyAttempt(no_key.name, False, 0.0, limit=0)
        send_large_body(server.getsockname()[1], no_key, None, 256 * MIB, closed,
                        time.monotonic)  # fmt: skip
        thread.join(5)
    assert closed.status is None and closed.ended in ("closed", "reset")

    with socket.create_server(("127.0.0.1", 0)) as gone:
        port = gone.getsockname()[1]
    unconnected = BodyAttempt(no_key.name, False, 0.0, limit=0)
    send_large_body(port, no_key, None, MIB, unconnected, time.monotonic)
    assert unconnected.ended.startswith("could not connect")


def test_large_body_rule_wants_quick_refusals() -> None:
    def a(plan: str, status: int | None, answer_s: float, *, keyed: bool = False,
          limit: int = 0, limit_s: float | None = None, ended: str = "answered",
          sent: int = 3 * MIB, began: float = 10.0) -> BodyAttempt:  # fmt: skip
        return BodyAttempt(plan, keyed, began, limit, status, ended, sent, answer_s, limit_s)

    attempts = [
        a("no key", 401, 0.02),
        a("no key", None, 0.05, ended="reset"),  # closed on it: refused
        a("key, chunked", 413, 1.9, keyed=True, limit=MIB, limit_s=0.5),  # 1.4 s after it
        a("key, declared", 503, 4.0, keyed=True, began=101.0),  # its key looked up in a cut
        a("no key", None, 1.0, ended="could not connect (ConnectionRefusedError)"),
        a("no key", None, 0.0, ended=""),  # still in flight: not judged
        a("no key", 200, 0.1),  # accepted
        a("no key", 500, 0.1),
        a("key, declared", 503, 0.1, keyed=True),  # outside a cut
        a("no key", 401, 2.5),  # read the body first
        a("key, chunked", 413, 4.0, keyed=True, limit=MIB, limit_s=1.0),
        a("no key", None, 30.0, ended="timed out"),
        a("no key", 401, 0.1, sent=80 * MIB),
    ]
    inv = large_body_invariant(attempts, [Window("pg-cut", 100, 106)], grace_s=15)
    assert not inv["ok"] and inv["attempts"] == 12 and inv["could_not_connect"] == 1
    problems = [(v["status"], set(v) - {"t", "plan", "ended", "status"}) for v in inv["violations"]]
    assert problems == [
        (200, {"wrong_status"}), (500, {"wrong_status"}), (503, {"wrong_status"}),
        (401, {"answered_after_s"}),
        (413, {"answered_after_s"}), (None, {"unanswered_after_s"}), (401, {"bytes_sent"}),
    ]  # fmt: skip
    assert inv["after_limit_s"]["max"] == 3.0 and inv["answer_s"]["max"] == 2.5
    assert inv["by_plan"]["no key"]["401"] == 3 and inv["by_plan"]["no key"]["reset"] == 1
    assert inv["bytes_sent_max_mib"]["no key"] == 80.0
    assert large_body_invariant(attempts[:5], [Window("redis-cut", 100, 106)], 15)["ok"]


def test_upload_rule_wants_each_step_answered_as_it_must() -> None:
    answers = [
        UploadAnswer(1, 2, "create", 200),
        UploadAnswer(2, 3, "part past bytes", 400, "upload_bytes_exceeded"),
        UploadAnswer(3, 4, "part after complete", 400, "upload_not_pending"),
        UploadAnswer(4, 5, "part past the parts bound", 400, "too_many_parts"),
        UploadAnswer(101, 102, "cancel", 503, "database_unavailable"),  # in the cut
        UploadAnswer(110, 111, "part within bytes", None),  # the API restarting
        UploadAnswer(111, 112, "part within bytes", 429, "too_many_concurrent_uploads"),
        UploadAnswer(200, 201, "part past bytes", 200),  # taken past the declared bytes
        UploadAnswer(201, 202, "part after cancel", 500),
        UploadAnswer(202, 203, "complete", 503),  # no cut
    ]
    inv = upload_abuse_invariant(answers, [Window("pg-cut", 100, 106)], grace_s=15)
    assert not inv["ok"] and inv["unanswered"] == 1 and inv["busy"] == 1 and inv["answers"] == 10
    assert [(v["kind"], v["status"]) for v in inv["violations"]] == [
        ("part past bytes", 200), ("part after cancel", 500), ("complete", 503),
    ]  # fmt: skip
    assert inv["by_kind"]["part past bytes"] == {"400 upload_bytes_exceeded": 1, "200": 1}
    assert upload_abuse_invariant(answers[:7], [Window("pg-cut", 100, 106)], 15)["ok"]


def test_api_memory_rule_bounds_the_peak_while_bodies_are_sent() -> None:
    def m(t: float, pid: int, rss_mib: float, hwm_mib: float, active: bool) -> MemorySample:
        return MemorySample(t, pid, int(rss_mib * 1024), int(hwm_mib * 1024), active)

    samples = [
        m(1, 7, 90, 120, False),  # started higher (imports): not the senders' doing
        m(2, 7, 100, 120, False),
        m(3, 7, 110, 120, True),
        m(4, 7, 105, 300, True),  # a peak of 300 MiB between two samples
        m(5, 7, 100, 300, False),
        m(6, 8, 80, 80, False),  # the API restarted: judged from its own baseline
        m(7, 8, 85, 85, True),
        m(8, 9, 70, 70, False),  # never sampled with the senders at work
    ]
    inv = api_memory_invariant(samples, bound_mib=256)
    assert inv["ok"] and inv["judged"] == 2
    seven, eight, nine = inv["processes"]
    assert (seven["baseline_mib"], seven["peak_mib"], seven["growth_mib"]) == (100, 300, 200)
    assert (eight["baseline_mib"], eight["peak_mib"]) == (80, 85) and not nine["judged"]
    assert inv["peak_mib"] == 300 and inv["high_water_mib"] == 300
    tight = api_memory_invariant(samples, bound_mib=100)
    assert not tight["ok"] and [v["pid"] for v in tight["violations"]] == [7]
    quiet = api_memory_invariant([m(1, 7, 100, 120, False), m(2, 7, 100, 125, True)], 4)
    assert quiet["processes"][0]["peak_mib"] == 125 and not quiet["ok"]


def test_api_memory_samples_a_live_process() -> None:
    import os

    memory = ApiMemory(os.getpid, time.monotonic, lambda: True)
    memory.sample()
    gone = ApiMemory(lambda: None, time.monotonic, lambda: True)
    gone.sample()
    (sample,) = memory.snapshot()
    assert sample.pid == os.getpid() and 0 < sample.rss_kib <= sample.hwm_kib and sample.active
    assert gone.snapshot() == []
