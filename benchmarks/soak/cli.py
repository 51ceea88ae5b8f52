"""The soak's command line: ``python -m benchmarks.soak``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.soak.faults import FAULTS
from benchmarks.soak.options import Options
from benchmarks.soak.report import print_report
from benchmarks.soak.run import run
from benchmarks.soak_hostile import HostileOptions


def parse_args(argv: Sequence[str] | None) -> tuple[Options, str | None]:
    from benchmarks import soak  # the package's docstring is the command's help

    doc = soak.__doc__ or ""
    d = Options()
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.soak", description=doc.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(doc.split("\n\n")[1:]),
    )  # fmt: skip
    ap.add_argument("--duration", type=float, default=d.duration, help="seconds of traffic")
    ap.add_argument("--tenants", type=int, default=d.tenants)
    ap.add_argument("--submit-every", type=float, default=d.submit_every,
                    help="mean seconds between one tenant's batches")  # fmt: skip
    ap.add_argument("--max-lines", type=int, default=d.max_lines)
    ap.add_argument("--model-workers", type=int, default=d.model_workers)
    ap.add_argument("--no-embeddings", action="store_true", help="serve the chat model only")
    ap.add_argument("--no-upstream", action="store_true",
                    help="no upstream model (transformers serve) among the traffic")  # fmt: skip
    ap.add_argument("--short-window-share", type=float, default=d.short_window_share)
    ap.add_argument("--cancel-share", type=float, default=d.cancel_share)
    ap.add_argument("--webhook-share", type=float, default=d.webhook_share)
    ap.add_argument("--webhook-flaky", type=float, default=d.webhook_flaky,
                    help="share of events whose first delivery the receiver answers 500")  # fmt: skip
    ap.add_argument("--faults", default=",".join(d.faults),
                    help=f"comma-separated, in order, of {', '.join(FAULTS)} ('' for none)")  # fmt: skip
    ap.add_argument("--fault-rounds", type=int, default=d.fault_rounds,
                    help="rounds of faults (default one per 10 minutes, at least 1)")  # fmt: skip
    ap.add_argument("--outage", type=float, default=d.outage_s, help="seconds of a cut")
    ap.add_argument("--outage-grace", type=float, default=d.outage_grace_s)
    ap.add_argument("--expiry-grace", type=float, default=d.expiry_grace_s)
    ap.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s)
    ap.add_argument("--webhook-timeout", type=float, default=d.webhook_timeout_s)
    ap.add_argument("--warmup", type=float, default=d.warmup_s)
    ap.add_argument("--rss-interval", type=float, default=d.rss_interval_s)
    ap.add_argument("--rss-window", type=float, default=d.rss_window_s)
    ap.add_argument("--rss-tolerance-mib", type=float, default=d.rss_tolerance_mib)
    ap.add_argument("--rss-tolerance-pct", type=float, default=d.rss_tolerance_pct)
    ap.add_argument("--rss-report-only", action="store_true",
                    help="report RSS growth without judging it (short runs)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=d.threads,
                    help="OMP_NUM_THREADS of each service process")  # fmt: skip
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--pg-admin-url", default=d.pg_admin_url,
                    help="a database on the server where the soak creates its own")  # fmt: skip
    ap.add_argument("--redis-url", default=d.redis_url,
                    help="an empty Redis database number for the soak (db 0 by default: the "
                    "test fixtures only ever pick 1-15)")  # fmt: skip
    ap.add_argument("--env", action="append", default=[], metavar="BATCHD_X=VALUE",
                    help="a service setting (repeatable)")  # fmt: skip
    ap.add_argument("--work-dir", default=None, help="logs and storage (default: a temp dir)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the work dir (it is always kept when an invariant fails)")  # fmt: skip
    ap.add_argument("--hostile", action="store_true",
                    help="one more tenant abusing the service in alternate phases (see above)")  # fmt: skip
    ap.add_argument("--hostile-phases", type=int, default=d.hostile_phases,
                    help="phases the run is cut in; the hostile tenant is active in the 2nd, "
                    "4th, ...")  # fmt: skip
    ap.add_argument("--neighbour-tolerance", type=float, default=d.neighbour_tolerance,
                    help="most the normal batches' median turnaround may grow in the hostile "
                    "phases, as a ratio to the quiet phases'")  # fmt: skip
    ap.add_argument("--hostile-every", type=float, default=d.hostile_opts.every_s,
                    help="seconds between the hostile tenant's batches")  # fmt: skip
    ap.add_argument("--hostile-slow-uploads", type=int, default=d.hostile_opts.slow_uploads,
                    help="slow uploads it holds open in each of its phases")  # fmt: skip
    ap.add_argument("--hostile-estimates", type=int, default=d.hostile_opts.estimates,
                    help="concurrent estimates in each of its floods")  # fmt: skip
    ap.add_argument("--hostile-body-senders", type=int, default=d.hostile_opts.body_senders,
                    help="concurrent senders of large bodies (no key, or over a limit)")  # fmt: skip
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                    help="the report as JSON: to PATH, or alone on stdout (text to stderr)")  # fmt: skip
    a = ap.parse_args(argv)
    faults = tuple(f for f in a.faults.split(",") if f.strip())
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        ap.error(f"unknown faults: {unknown}")
    opts = Options(
        duration=a.duration, tenants=a.tenants, submit_every=a.submit_every,
        max_lines=a.max_lines, model_workers=a.model_workers, embeddings=not a.no_embeddings,
        upstream=not a.no_upstream,
        short_window_share=a.short_window_share, cancel_share=a.cancel_share,
        webhook_share=a.webhook_share, webhook_flaky=a.webhook_flaky, faults=faults,
        fault_rounds=a.fault_rounds, outage_s=a.outage, outage_grace_s=a.outage_grace,
        expiry_grace_s=a.expiry_grace, drain_timeout_s=a.drain_timeout,
        webhook_timeout_s=a.webhook_timeout, warmup_s=a.warmup, rss_interval_s=a.rss_interval,
        rss_window_s=a.rss_window, rss_tolerance_mib=a.rss_tolerance_mib,
        rss_tolerance_pct=a.rss_tolerance_pct, rss_report_only=a.rss_report_only,
        threads=a.threads, seed=a.seed, pg_admin_url=a.pg_admin_url, redis_url=a.redis_url,
        env=dict(e.split("=", 1) for e in a.env), work_dir=a.work_dir, keep=a.keep,
        hostile=a.hostile, hostile_phases=a.hostile_phases,
        neighbour_tolerance=a.neighbour_tolerance,
        hostile_opts=HostileOptions(every_s=a.hostile_every, slow_uploads=a.hostile_slow_uploads,
                                    estimates=a.hostile_estimates,
                                    body_senders=a.hostile_body_senders),
    )  # fmt: skip
    return opts, a.json


def main(argv: Sequence[str] | None = None) -> int:
    opts, json_to = parse_args(argv)
    text_out = sys.stderr if json_to == "-" else sys.stdout
    if json_to == "-":
        sys.stdout = sys.stderr  # progress lines too; the JSON alone goes to the real stdout
    try:
        report = run(opts)
    except Exception as error:
        import traceback

        traceback.print_exc()
        print(f"soak: could not run: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    finally:
        sys.stdout = sys.__stdout__
    print_report(report, text_out)
    if json_to == "-":
        print(json.dumps(report, indent=2, default=str))
    elif json_to:
        Path(json_to).write_text(json.dumps(report, indent=2, default=str))
    return 0 if report["ok"] else 1
