"""The soak's report as text."""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import Any


def print_report(report: dict[str, Any], out: Any = sys.stdout) -> None:
    def p(text: str = "") -> None:
        print(text, file=out)

    t = report["traffic"]
    p()
    p(f"soak: {'ALL INVARIANTS HELD' if report['ok'] else 'INVARIANT FAILURES'}  "
      f"({report['timing']})")  # fmt: skip
    p(f"traffic: {t['batches']} batches {t['by_kind']}, {t['lines_submitted']} lines, "
      f"{t['lines_accepted']} accepted, {t['output_lines']} output lines "
      f"({t['output_lines_per_s']}/s)")  # fmt: skip
    p(f"  ended: {t['by_status']}; error lines: {t['error_lines_by_code']}")
    p(f"  priorities {t['priorities']} (refused {t['priority_refused']}); cancels "
      f"{t['cancels_by_answer']}; failed at create {t['failed_at_create']}; create "
      f"failures {t['create_failed_by_answer']}, upload failures {t['upload_failed']}")  # fmt: skip
    if "hostile" in report:
        _print_hostile(report["hostile"], p)
    p("faults:")
    for e in report["faults"]:
        p(f"  {e['start']:7.1f}s {e['kind']:<12} {e['detail']}")
    for error in report["fault_errors"]:
        p(f"  FAULT INJECTION FAILED: {error}")
    for u in report["unplanned_exits"]:
        p(f"  unplanned exit: {u['name']} at {u['t']:.0f}s, code {u['returncode']}")
    p("invariants:")
    for name, inv in report["invariants"].items():
        mark = "ok  " if inv["ok"] else "FAIL"
        p(f"  [{mark}] {name}: {_summary(name, inv)}")
        for v in inv.get("violations", [])[:10]:
            p(f"         {json.dumps(v, default=str)[:600]}")
    p("rss (MiB; growth after warm-up):")
    for proc in report["invariants"]["rss"]["processes"]:
        judged = (
            f"growth {proc['growth_mib']:+.1f} (allowed {proc['allowed_mib']}; second half "
            f"{proc['second_half_growth_mib']:+.1f}), slope "
            f"{proc['slope_mib_per_h']:+.1f}/h over {proc['span_s']} s"
            if proc["judged"] else "not judged (too short)"
        )  # fmt: skip
        curve = " ".join(f"{mib:.0f}" for _, mib in proc["curve_mib"])
        p(f"  {proc['name']:<8} pid {proc['pid']:<7} {proc.get('last_mib', '-')} now, "
          f"{judged}; curve: {curve}")  # fmt: skip
    for batch, lines in report.get("log_excerpts", {}).items():
        p(f"log lines naming {batch}:")
        for line in lines:
            p(f"  {line}")
        for table, rows in report.get("db_rows", {}).get(batch, {}).items():
            for row in rows[:8]:
                p(f"  {table}: {json.dumps(row, default=str)[:500]}")
    p(f"work dir: {report['work_dir']}{' (kept)' if report['work_dir_kept'] else ' (removed)'}")


def _print_hostile(h: dict[str, Any], p: Any) -> None:
    on = [f"{ph['start']:.0f}-{ph['end']:.0f}s" for ph in h["phases"] if ph["hostile"]]
    p(f"hostile tenant (active {', '.join(on)}): batches {h['batches']}, creates "
      f"{h['create_answers']}, cancels {h['cancel_answers']}, upload failures "
      f"{h['upload_failed']}")  # fmt: skip
    largest = max(h["files"].values(), key=lambda c: c["output_lines"] + c["error_lines"],
                  default=None)  # fmt: skip
    if largest:
        p(f"  largest result: {largest['output_lines']} output + {largest['error_lines']} error "
          f"lines for a file of {largest['file_lines']} lines (max_requests_per_batch "
          f"{h['max_requests_per_batch']})")  # fmt: skip
    p(f"  estimates: {h['estimate_floods']} floods, answers {h['estimate_answers']}, patient "
      f"answer latency {h['estimate_latency_s']}")  # fmt: skip
    ended = Counter(u["ended"].split(" (")[0] for u in h["slow_uploads"])
    held = [u["held_s"] for u in h["slow_uploads"]]
    p(f"  slow uploads: {len(held)}, ended {dict(ended)}, held up to "
      f"{max(held, default=0):.0f} s")  # fmt: skip
    pg = h["postgres"]
    p(f"  postgres idle in transaction: with slow uploads open {pg['with_slow_uploads_open']}, "
      f"without {pg['without']}")  # fmt: skip
    for error in h["errors"]:
        p(f"  HOSTILE TENANT ERROR: {error}")


def _phase_p50s(inv: dict[str, Any]) -> str:
    """Each phase's completed batches and median turnaround: ``quiet 12@8.1s``."""
    return ", ".join(
        f"{'hostile' if ph['hostile'] else 'quiet'} {ph['completed']}@"
        f"{ph['turnaround_s']['p50'] if ph['turnaround_s'] else '-'}s"
        for ph in inv["phases"]
    )


def _summary(name: str, inv: dict[str, Any]) -> str:
    if name == "lines":
        return (f"{inv['batches_checked']} batches checked, {inv['lines_accepted']} accepted "
                f"lines, {inv['violation_count']} batches with lost/doubled/unknown lines")  # fmt: skip
    if name == "expiry":
        return (f"{inv['short_window_batches']} short-window batches, grace {inv['grace_s']} s, "
                f"{inv['violation_count']} seen unfinished past their window")  # fmt: skip
    if name == "drained":
        return f"{inv['violation_count']} batches unfinished after {inv['drain_s']} s of drain"
    if name == "webhooks":
        return (f"{inv['events_delivered']}/{inv['events_expected']} events delivered, "
                f"{inv['attempts_received']} attempts ({inv['retried_after_500']} answered 500 "
                f"on purpose), latency {inv['delivery_latency_s']}")  # fmt: skip
    if name == "rss":
        return (f"{inv['judged']} process runs judged after {inv['warmup_s']:.0f} s warm-up"
                f"{' (report only)' if inv['report_only'] else ''}; not flat: "
                f"{inv['not_flat'] or 'none'}")  # fmt: skip
    if name == "hostile":
        return (f"{inv.get('batches')} hostile batches {inv.get('by_kind_status')}, "
                f"{inv.get('unended')} unended after the drain; answers "
                f"{inv.get('answers_by_status')}; {inv.get('webhook_attempts_trickled')} webhook "
                f"attempts trickled, held {inv.get('webhook_held_s')} (webhook_timeout_s "
                f"{inv.get('webhook_timeout_s')})")  # fmt: skip
    if name == "large_bodies":
        start, limit = inv["answer_s"] or {}, inv["after_limit_s"] or {}
        return (f"{inv['attempts']} large bodies {inv['by_outcome']}; answered p50 "
                f"{start.get('p50')} max {start.get('max')} s after the start (401s, 413s on "
                f"a Content-Length), p50 {limit.get('p50')} max {limit.get('max')} s after "
                f"the limit (413s counted as the body streamed), allowed {inv['within_s']} s; "
                f"at most {max(inv['bytes_sent_max_mib'].values(), default=0)} MiB sent before "
                f"the answer")  # fmt: skip
    if name == "upload_bounds":
        return (f"{inv['answers']} answers, {inv['unanswered']} unanswered, {inv['busy']} 429 "
                f"(sent again), {inv['violation_count']} not as expected: "
                f"{inv['by_kind']}")  # fmt: skip
    if name == "api_memory":
        runs = "; ".join(
            f"pid {p['pid']} {p['baseline_mib']} -> {p['peak_mib']} MiB ({p['growth_mib']:+.1f})"
            for p in inv["processes"] if p["judged"]
        )  # fmt: skip
        return (f"API RSS while the large bodies were sent, baseline -> peak: {runs or 'none'} "
                f"(bound +{inv['bound_mib']:g} MiB); high-water mark "
                f"{inv['high_water_mib']} MiB")  # fmt: skip
    if name == "neighbours":
        q, h, latency = inv["quiet"], inv["hostile"], inv["api_latency_s"]
        return (f"normal batches' turnaround, hostile/quiet: p50 x{inv['ratio']['p50']}, p90 "
                f"x{inv['ratio']['p90']} (quiet {q.get('batches')} batches p50 {q.get('p50')} "
                f"p90 {q.get('p90')} s; hostile {h.get('batches')} batches p50 {h.get('p50')} "
                f"p90 {h.get('p90')} s); tolerance x{inv['tolerance']}"
                f"{'' if inv['judged'] else ' (too few batches: not judged)'}; by phase "
                f"{_phase_p50s(inv)}; upload p50 x{latency['POST /v1/files']['ratio_p50']}, "
                f"create p50 x{latency['POST /v1/batches']['ratio_p50']}; control worker busy "
                f"by phase {[c['busy_share'] for c in inv.get('control_busy', [])]}")  # fmt: skip
    if name == "http":
        return (f"{inv['answers']} answers {inv['by_status']}; {inv['violation_count']} 5xx "
                f"outside the rules; unanswered by fault window: {inv['unanswered']}")  # fmt: skip
    return ""
