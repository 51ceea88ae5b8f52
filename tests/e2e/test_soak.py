"""The soak-and-chaos benchmark (``python -m benchmarks.soak``), short: 150 s of mixed traffic
from four tenants through the whole service while a model worker and the control worker are
SIGKILLed, Redis and Postgres are cut off and the API restarts. Every invariant but RSS
flatness must hold (three minutes are mostly warm-up, so RSS is reported, not judged). And
the checks themselves, on made-up records: they do catch a lost, doubled or unknown line, a
stray 5xx, a missing or re-identified webhook event, a growing RSS."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks.soak import FAULTS, Options, fault_plan
from benchmarks.soak_checks import (
    Answer,
    BatchRecord,
    Tracker,
    Window,
    http_invariant,
    rss_invariant,
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
