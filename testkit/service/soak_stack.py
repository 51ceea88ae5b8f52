"""The service that ``benchmarks.soak`` runs and breaks, behind proxies it can cut.

The service that ``benchmarks.soak`` runs and breaks: a fresh Postgres database, Redis, a
loopback TCP proxy in front of each (every service process connects through them, so a cut
closes their connections and refuses new ones), the processes as ``python -m worker`` and
uvicorn start them (API, control worker, beat, model workers), restarted as a supervisor
would after each planned kill and after any unplanned exit; API keys made by ``batchd keys
create``; and a loopback webhook receiver. Nothing here imports ``benchmarks``."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from cli.perf.service import Procs, api_up, free_port, memory_kb, wait_for
from core import launch
from core.launch import QUIET
from testkit.proxies.tcp_proxy import TcpProxy
from testkit.service.stack import REPO, api_command

CHAT_MODEL = "batchd-demo"
EMBED_MODEL = "minilm"
UPSTREAM_MODEL = "fleet"  # served by a real transformers serve behind a loopback proxy


def _host_port(url: str, default_port: int) -> tuple[str, int]:
    """The host and port of a database or broker URL."""
    from sqlalchemy.engine import make_url

    u = make_url(url)
    return u.host or "127.0.0.1", int(u.port or default_port)


def _with_host_port(url: str, host: str, port: int) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).set(host=host, port=port).render_as_string(hide_password=False)


# ---------------------------------------------------------------------------------------------
# Postgres and Redis


class RedisDb:
    """One database number of a Redis server, which must be empty when the soak starts (so
    nobody else is using it); emptied again when the soak ends."""

    def __init__(self, url: str):
        import redis

        self.url = url
        self._client = redis.Redis.from_url(url)
        keys = self._client.dbsize()
        if keys:
            raise SystemExit(
                f"{url} holds {keys} keys: someone may be using it. Pass --redis-url with an "
                "empty database number (the soak empties it again when it ends)."
            )

    def empty(self) -> None:
        self._client.flushdb()
        self._client.close()


# ---------------------------------------------------------------------------------------------
# API keys


@dataclass
class Key:
    tenant: str
    key: str
    key_id: str
    webhook_secret: str
    max_priority: str | None  # None: priority is not an entitlement of keys (yet)


def create_key(tenant: str, env: dict[str, str]) -> Key:
    """A key made by ``batchd keys create`` (the operator's path), entitled to ``high``
    priority where keys carry that entitlement: ``--max-priority high`` when the command has
    the option, else the ``api_keys.max_priority`` column set directly when it exists."""
    cli = [sys.executable, "-m", "cli", "keys", "create"]
    helptext = subprocess.run(
        [*cli, "--help"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    ).stdout
    has_option = "--max-priority" in helptext
    extra = ["--max-priority", "high"] if has_option else []
    done = subprocess.run(
        [*cli, "--tenant", tenant, "--name", "soak", *extra],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"batchd keys create failed ({done.returncode}):\n{done.stderr}")
    out = done.stdout
    key = re.search(r"API key:\s+(\S+)", out)
    secret = re.search(r"Webhook secret:\s+(\S+)", out)
    key_id = re.search(r"Created key (\S+)", out)
    if not (key and secret and key_id):
        raise RuntimeError(f"unexpected output of batchd keys create:\n{out}")
    max_priority = "high" if has_option else _grant_high_directly(key_id.group(1), env)
    return Key(tenant, key.group(1), key_id.group(1), secret.group(1), max_priority)


def _grant_high_directly(key_id: str, env: dict[str, str]) -> str | None:
    from sqlalchemy import create_engine, text

    from core.database.tables import ApiKey

    if "max_priority" not in ApiKey.__table__.columns:
        return None
    engine = create_engine(env["BATCHD_DATABASE_URL"])
    try:
        with engine.begin() as conn:
            conn.execute(
                text("UPDATE api_keys SET max_priority = 'high' WHERE id = :id"), {"id": key_id}
            )
    finally:
        engine.dispose()
    return "high"


# ---------------------------------------------------------------------------------------------
# The processes


@dataclass
class Incarnation:
    """One run of a named process: its pid, when it started and ended (seconds since the
    soak began) and its RSS samples ``(t, KiB)``."""

    name: str
    pid: int
    started: float
    ended: float | None = None
    exit: str | None = None  # how it ended: "killed by the soak", "exited 1", ...
    rss: list[tuple[float, int]] = field(default_factory=list)


@dataclass
class UnplannedExit:
    name: str
    t: float
    returncode: int
    log_tail: str


class Stack(Procs):
    """The service's processes, run from the repository, on the proxied database and broker.
    Every process name maps to its command; :meth:`restart` and the supervisor thread start a
    process again with the same command."""

    def __init__(
        self, root: Path, env: dict[str, str], port: int, model_workers: int, clock: Clock
    ):
        super().__init__(root, cwd=REPO)
        self.env = env
        self.port = port
        self.clock = clock
        specs = json.loads(env["BATCHD_MODELS"])
        self.models = [m for m, spec in specs.items() if not spec.startswith("upstream:")]
        self.upstream = [m for m, spec in specs.items() if spec.startswith("upstream:")]
        worker = launch.worker_module_command
        self.commands: dict[str, list[str]] = {
            "api": api_command(port),
            "control": worker("control", extra=QUIET),
            "beat": worker("beat", extra=["--loglevel", "INFO"]),
        }
        for i in range(1, model_workers + 1):
            self.commands[f"model-{i}"] = worker("model", self.models, extra=QUIET)
        if self.upstream:
            self.commands["dispatch-1"] = worker("dispatch", extra=QUIET)
        self.incarnations: list[Incarnation] = []
        self.unplanned: list[UnplannedExit] = []
        self._lock = threading.RLock()
        self._busy: set[str] = set()  # being killed or restarted by the soak
        # Per process, how often each readiness line was in its log before its latest start.
        self._pending_ready: dict[str, dict[str, int]] = {}
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def current(self, name: str) -> Incarnation | None:
        with self._lock:
            for inc in reversed(self.incarnations):
                if inc.name == name:
                    return inc
        return None

    def _launch(self, name: str) -> None:
        marks = self._ready_marks(name)
        counts = {text: self.log(name).count(text) for text in marks}
        proc = self.start(name, self.commands[name], self.env)
        with self._lock:
            self.incarnations.append(Incarnation(name, proc.pid, self.clock()))
        self._pending_ready[name] = counts

    def _ready_marks(self, name: str) -> list[str]:
        if name == "control":
            return ["ready."]
        if name == "beat":
            return ["beat: Starting"]
        if name.startswith("model-"):
            return ["ready.", *(f"model {m} ready" for m in self.models)]
        if name.startswith("dispatch-"):
            return ["ready.", *(f"model {m} ready" for m in self.upstream)]
        return []

    def _is_ready(self, name: str) -> bool:
        proc = self.procs[name]
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited ({proc.returncode}) while starting:{self.logs()}")
        if name == "api":
            return api_up(self.port)
        before = self._pending_ready.get(name, {})
        log = self.log(name)
        return all(log.count(text) > before.get(text, 0) for text in self._ready_marks(name))

    def wait_ready(self, names: list[str], timeout: float) -> None:
        wait_for(
            lambda: all(self._is_ready(n) for n in names),
            timeout,
            f"{', '.join(names)} to be ready",
            self.logs,
        )

    def start_all(self, timeout: float) -> None:
        for name in self.commands:
            self._launch(name)
        self.wait_ready(list(self.commands), timeout)
        self._supervisor = threading.Thread(target=self._supervise, name="soak-supervisor")
        self._supervisor.daemon = True
        self._supervisor.start()

    def restart(
        self, name: str, sig: int, *, delay_s: float, ready_timeout: float, grace_s: float = 15
    ) -> float:
        """Stop ``name`` with ``sig`` (SIGKILL escalation after ``grace_s``), wait ``delay_s``
        (a supervisor's restart delay), start it again and wait until it is ready; the
        seconds from the signal to ready."""
        with self._lock:
            self._busy.add(name)
        try:
            began = time.monotonic()
            self.end(name, sig, grace_s)
            self._ended(name, f"stopped by the soak ({signal.Signals(sig).name})")
            time.sleep(delay_s)
            self._launch(name)
            self.wait_ready([name], ready_timeout)
            return time.monotonic() - began
        finally:
            with self._lock:
                self._busy.discard(name)

    def _ended(self, name: str, how: str) -> None:
        inc = self.current(name)
        if inc is not None and inc.ended is None:
            inc.ended = self.clock()
            inc.exit = how

    def _supervise(self) -> None:
        """Restart any process that exits on its own (after 2 s), recording the exit."""
        while not self._stop.wait(1.0):
            for name, proc in list(self.procs.items()):
                with self._lock:
                    if name in self._busy or proc.poll() is None:
                        continue
                    self._busy.add(name)
                try:
                    tail = "\n".join(self.log(name).splitlines()[-40:])
                    self.unplanned.append(UnplannedExit(name, self.clock(), proc.returncode, tail))
                    self._ended(name, f"exited {proc.returncode}")
                    if self._stop.wait(2.0):
                        return
                    self._launch(name)
                    # Not ready in time, or dead again: the next round sees it.
                    with contextlib.suppress(TimeoutError, RuntimeError):
                        self.wait_ready([name], 300)
                finally:
                    with self._lock:
                        self._busy.discard(name)

    def sample_rss(self) -> None:
        now = self.clock()
        with self._lock:
            live = [i for i in self.incarnations if i.ended is None]
        for inc in live:
            got = memory_kb(inc.pid)
            if got is not None:
                inc.rss.append((now, got[0]))

    def stop(self, grace_s: float = 20.0) -> dict[str, int | None]:
        """Stop the supervisor and SIGTERM every process; their exit codes (None: killed
        after ``grace_s``)."""
        self._stop.set()
        if self._supervisor is not None:
            self._supervisor.join(10)
        codes = self.stop_all(grace_s)
        for name in codes:
            self._ended(name, "stopped at the end")
        return codes


class Clock:
    """Seconds since the soak began (monotonic)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.wall0 = time.time()

    def __call__(self) -> float:
        return time.monotonic() - self.t0

    def at_wall(self, unix: float) -> float:
        return unix - self.wall0


def service_env(
    work: Path, database_url: str, broker_url: str, models: dict[str, str], threads: int,
    overrides: dict[str, str],
) -> dict[str, str]:  # fmt: skip
    """The service's settings for the soak: fast sweeps and recovery, so faults are
    recovered from in seconds, webhooks to the loopback receiver, no per-key rate limit."""
    (work / "home").mkdir(parents=True, exist_ok=True)
    soak = {
        "OMP_NUM_THREADS": str(threads),
        "BATCHD_RATE_LIMIT_PER_MINUTE": "0",
        "BATCHD_WORKER_SHARD_CONCURRENCY": "4",
        "BATCHD_SHARD_MAX_REQUESTS": "8",
        "BATCHD_CHECKPOINT_EVERY": "4",
        "BATCHD_CHECKPOINT_INTERVAL_S": "1",
        "BATCHD_HEARTBEAT_INTERVAL_S": "2",
        "BATCHD_SHARD_STALE_AFTER_S": "15",
        "BATCHD_RECLAIM_SWEEP_INTERVAL_S": "3",
        "BATCHD_RELEASE_SWEEP_INTERVAL_S": "2",
        "BATCHD_RELEASE_RESEND_AFTER_S": "20",
        "BATCHD_EXPIRY_SWEEP_INTERVAL_S": "5",
        "BATCHD_STUCK_BATCH_AFTER_S": "30",
        "BATCHD_WEBHOOK_ALLOWED_HOSTS": "127.0.0.1",
        "BATCHD_WEBHOOK_BACKOFF_S": "1",
        "BATCHD_WEBHOOK_BACKOFF_MAX_S": "8",
        "BATCHD_WEBHOOK_MAX_ATTEMPTS": "12",
        "BATCHD_WEBHOOK_TIMEOUT_S": "5",
    }
    return launch.service_env(work, database_url, broker_url, models, **{**soak, **overrides})


def proxied(url: str, default_port: int) -> tuple[TcpProxy, str]:
    """A started proxy to ``url``'s server and ``url`` pointed at the proxy."""
    host, port = _host_port(url, default_port)
    proxy = TcpProxy(host, port).start()
    return proxy, _with_host_port(url, "127.0.0.1", proxy.port)


# ---------------------------------------------------------------------------------------------
# Webhook receiver


@dataclass
class Delivery:
    t: float
    path: str
    event_id: str
    event_type: str
    batch_id: str
    signature_ok: bool
    answered: int


class Receiver:
    """A loopback HTTP server that records every webhook POST and answers 2xx, except a
    seeded ``flaky`` share of events whose first attempt gets a 500 (so retries run too).
    ``secrets`` maps the path to the webhook secret its deliveries are signed with."""

    def __init__(self, clock: Callable[[], float], flaky: float, seed: int):
        self.clock = clock
        self.flaky = flaky
        self.seed = seed
        self.secrets: dict[str, str] = {}
        self.deliveries: list[Delivery] = []
        self.malformed: list[str] = []
        self._failed_once: set[str] = set()
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                code = receiver._record(self.path, dict(self.headers), body)
                self.send_response(code)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def snapshot(self) -> list[Delivery]:
        with self.lock:
            return list(self.deliveries)

    def _fails_first(self, event_id: str) -> bool:
        digest = hashlib.sha256(f"{self.seed}:{event_id}".encode()).digest()
        return int.from_bytes(digest[:4], "big") / 2**32 < self.flaky

    def _record(self, path: str, headers: dict[str, str], body: bytes) -> int:
        lower = {k.lower(): v for k, v in headers.items()}
        try:
            event = json.loads(body)
            event_id = str(event["id"])
            event_type = str(event["type"])
            batch_id = str(event["data"]["id"])
        except (ValueError, KeyError, TypeError):
            with self.lock:
                self.malformed.append(body[:200].decode(errors="replace"))
            return 400
        secret = self.secrets.get(path)
        ok = secret is not None and verify_signature(secret, lower, body)
        with self.lock:
            code = 200
            if event_id not in self._failed_once and self._fails_first(event_id):
                self._failed_once.add(event_id)
                code = 500
            self.deliveries.append(
                Delivery(self.clock(), path, event_id, event_type, batch_id, ok, code)
            )
        return code

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def verify_signature(secret: str, headers: dict[str, str], body: bytes) -> bool:
    """Standard Webhooks verification, as a receiver writes it."""
    try:
        key = base64.b64decode(secret.removeprefix("whsec_"))
        signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
        expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
        versions = [s.split(",", 1) for s in headers["webhook-signature"].split()]
    except (KeyError, ValueError):
        return False
    return any(
        len(v) == 2 and v[0] == "v1" and hmac.compare_digest(v[1], expected) for v in versions
    )


__all__ = [
    "CHAT_MODEL",
    "EMBED_MODEL",
    "Clock",
    "Key",
    "Receiver",
    "RedisDb",
    "Stack",
    "create_key",
    "free_port",
    "proxied",
    "service_env",
]
