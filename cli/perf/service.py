"""The service ``batchd bench`` starts for itself, and the probes that read a running one.

An embedded service for ``batchd bench``: the API (uvicorn), a control worker with beat and
one model worker as subprocesses on the given database and Redis broker, a storage directory
of its own, one API key per tenant; and the probes that read a running service's engine
stats, per-request timings and process memory, and the helpers the e2e tests and the service
benchmarks share with it (named process groups, waiting, sampling threads)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.launch import api_command, control_worker_command, model_worker_command, service_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(
    predicate: Callable[[], bool],
    timeout: float,
    what: str,
    logs: Callable[[], str] | None = None,
) -> None:
    """Poll ``predicate`` until it holds; past ``timeout``, raise with ``logs()`` appended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}{logs() if logs else ''}")


def api_up(port: int) -> bool:
    """The API on ``port`` answers its health check."""
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class Procs:
    """Named subprocesses run in ``cwd``, each in its own process group (stopping one stops
    all it started) and logging to ``root/<name>.log`` (appended across restarts)."""

    def __init__(self, root: Path, cwd: Path | None = None):
        self.root = root
        self.cwd = cwd
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
        with open(self.root / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                cmd, cwd=self.cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self, chars: int = 3000) -> str:
        return "".join(
            f"\n--- {p.name}\n" + p.read_text(errors="replace")[-chars:]
            for p in sorted(self.root.glob("*.log"))
        )

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}):{self.logs()}")

    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.procs.items()}

    def wait_log(self, name: str, text: str, timeout: float, count: int = 1) -> None:
        """Wait until ``text`` is in ``name``'s log ``count`` times (a readiness line)."""

        def seen() -> bool:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{name} exited:{self.logs()}")
            return self.log(name).count(text) >= count

        wait_for(seen, timeout, f"{text!r} in {name}.log", self.logs)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to ``name``'s process group and wait (30 s at most) until it exits."""
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
        proc.wait(30)

    def end(self, name: str, sig: int = signal.SIGTERM, grace_s: float = 15.0) -> int | None:
        """Send ``sig`` to ``name``'s process group, SIGKILL it after ``grace_s``; its exit
        code, None when it had to be killed."""
        return self._end_all([name], sig, grace_s)[name]

    def stop_all(self, grace_s: float = 15.0) -> dict[str, int | None]:
        """SIGTERM every process group, SIGKILL what is left after ``grace_s``; the exit
        codes, None for those killed."""
        return self._end_all(list(self.procs), signal.SIGTERM, grace_s)

    def _end_all(self, names: list[str], sig: int, grace_s: float) -> dict[str, int | None]:
        procs = {name: self.procs[name] for name in names}
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, sig)
        deadline = time.monotonic() + grace_s
        codes: dict[str, int | None] = {}
        for name, proc in procs.items():
            try:
                codes[name] = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                codes[name] = None
        return codes


class EmbeddedService(Procs):
    """The service ``batchd bench`` starts for itself, its files and logs under ``root``."""

    def __init__(
        self,
        root: Path,
        database_url: str,
        broker_url: str,
        models: dict[str, str],
        engine_options: dict[str, Any],
        env_overrides: dict[str, str] | None = None,
        *,
        shard_concurrency: int = 8,
        port: int = 0,
    ):
        super().__init__(root, cwd=root)
        self.database_url = database_url
        self.broker_url = broker_url
        self.models = models
        self.engine_options = engine_options
        self.env_overrides = dict(env_overrides or {})
        self.shard_concurrency = shard_concurrency
        self.port = port
        self.worker_name = ""
        self.keys: dict[str, str] = {}

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def env(self) -> dict[str, str]:
        (self.root / "home").mkdir(parents=True, exist_ok=True)
        settings = {
            "BATCHD_ENGINE_OPTIONS": json.dumps(self.engine_options),
            "BATCHD_WORKER_SHARD_CONCURRENCY": str(self.shard_concurrency),
            **self.env_overrides,
        }
        # Over the service's environment, not through service_env's keywords: a setting named
        # like one of its parameters ("base") would be taken for it.
        return {
            **service_env(self.root, self.database_url, self.broker_url, self.models),
            **settings,
        }

    def launch(self, tenants: list[str], timeout: float = 300.0) -> EmbeddedService:
        """Migrate the database, create one key per tenant, start the processes and wait
        until the API answers and both workers are ready."""
        import migrations
        from cli.models import resolve_models

        migrations.upgrade(self.database_url)
        resolve_models(self.models)  # build demo models once, before two processes race
        self._create_keys(tenants)
        self.port = self.port or free_port()
        tag = secrets.token_hex(3)
        self.worker_name = f"bench-model-{tag}@{socket.gethostname()}"
        # INFO lines (readiness is read from them), no gossip or mingle between workers.
        quiet = ["--loglevel", "INFO", "--without-gossip", "--without-mingle"]
        beat = ["-B", "-s", str(self.root / "home" / "beat-schedule")]
        commands = {
            "api": api_command(self.port, log_level="warning"),
            "control": control_worker_command(f"bench-control-{tag}@%h", extra=[*beat, *quiet]),
            "model": model_worker_command(
                self.models, self.shard_concurrency, self.worker_name, extra=quiet
            ),
        }
        env = self.env()
        for name, cmd in commands.items():
            self.start(name, cmd, env)
        wait_for(self._ready, timeout, "the embedded service to start", self.logs)
        return self

    def _create_keys(self, tenants: list[str]) -> None:
        from core.batches.priority import Priority
        from core.database import auth
        from core.database.sessions import session_scope

        with session_scope(self.database_url) as session:
            for tenant in tenants:
                # Workloads name priorities per job: the bench's keys may use them all.
                _row, plaintext = auth.create_key(
                    session, tenant, "batchd bench", max_priority=Priority.HIGH.value
                )
                self.keys[tenant] = plaintext

    def _ready(self) -> bool:
        self.check_alive()
        if not api_up(self.port):
            return False
        models = self.log("model")
        return "ready." in self.log("control") and all(
            f"model {m} ready" in models for m in self.models
        )

    def stop(self) -> None:
        self.stop_all(grace_s=20.0)


class WorkerProbe:
    """Celery remote control of a running service's workers: ``engine_stats`` and
    ``request_timings`` (worker.infra.runtime, worker.shards.timings)."""

    def __init__(self, broker_url: str, destination: list[str] | None = None):
        from celery import Celery

        self.app = Celery("batchd-bench", broker=broker_url)
        self.destination = destination

    def _ask(self, command: str, timeout: float, **arguments: Any) -> dict[str, Any]:
        replies = self.app.control.broadcast(
            command, arguments=arguments, destination=self.destination, reply=True,
            timeout=timeout,
        )  # fmt: skip
        out: dict[str, Any] = {}
        for reply in replies or ():
            out.update({k: v for k, v in reply.items() if isinstance(v, dict)})
        return out

    def engine_stats(self, timeout: float = 1.0) -> dict[str, Any]:
        """{worker: {"pid", "time", "models": {model: stats}}} of the workers that answered."""
        return {w: a for w, a in self._ask("engine_stats", timeout).items() if "models" in a}

    def request_timings(self, batch_ids: list[str], timeout: float = 5.0) -> list[dict]:
        records: list[dict] = []
        for answer in self._ask("request_timings", timeout, batch_ids=batch_ids).values():
            records.extend(answer.get("records") or ())
        return records

    def close(self) -> None:
        self.app.close()


class Ticker:
    """Calls ``tick`` in a daemon thread every ``interval`` seconds (start to start) until
    :meth:`stop`: the samplers of engine stats and process memory."""

    def __init__(self, tick: Callable[[], None], interval: float, name: str = "batchd-sampler"):
        self._tick = tick
        self.interval = interval
        self._stop_event = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        while not self._stop_event.is_set():
            began = time.monotonic()
            self._tick()
            self._stop_event.wait(max(0.0, self.interval - (time.monotonic() - began)))

    def start(self) -> Ticker:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop_event.set()
        self._thread.join(timeout)


def memory_kb(pid: int) -> tuple[int, int] | None:
    """(VmRSS, VmHWM) of ``pid`` in KiB, or None (gone, or not on this machine)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0])
    if len(values) != 2:
        return None
    return values["VmRSS"], values["VmHWM"]
