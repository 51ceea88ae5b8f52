"""`batchd up` on embedded defaults (SQLite, Celery's SQLAlchemy transport, a local storage
directory): the command a newcomer runs first must serve a batch end to end, start again a
child that dies, and stop cleanly on SIGTERM. On Postgres and Redis it runs several API
processes, whose /metrics add up. Its supervisor (cli/supervise.py) on its own,
with stand-in children."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cli.procfs import children_with_cmdlines
from engine.core.model_runner import resolve_dtype

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sleeper(code: str = "") -> list[str]:
    return [sys.executable, "-c", f"import signal, sys, time\n{code}\ntime.sleep(60)"]


def test_supervisor_restarts_a_child_that_exits_with_backoff_and_leaves_the_others() -> None:
    from cli.supervise import Supervisor

    lines: list[str] = []
    sup = Supervisor(
        {"steady": _sleeper(), "crashy": [sys.executable, "-c", "raise SystemExit(3)"]},
        echo=lines.append, min_backoff_s=0.1, max_backoff_s=0.4, stable_s=60, poll_s=0.02,
    ).start()  # fmt: skip
    steady_pid = sup.children["steady"].proc.pid
    try:
        deadline = time.monotonic() + 30
        while sup.children["crashy"].restarts < 4 and time.monotonic() < deadline:
            sup.poll()
            time.sleep(0.02)
    finally:
        assert sup.stop(grace_s=10)
    crashy = sup.children["crashy"]
    assert crashy.restarts >= 4 and set(crashy.codes) == {3}, lines
    assert [sup.backoff_s(n) for n in (1, 2, 3, 4, 5)] == [0.1, 0.2, 0.4, 0.4, 0.4]
    assert sup.children["steady"].proc.pid == steady_pid and sup.children["steady"].restarts == 0
    assert "batchd up: crashy exited unexpectedly (exit code 3)" in lines[0]
    assert any(line.startswith("batchd up: starting crashy again (restart 1)") for line in lines)


def test_supervisor_stops_on_sigterm_and_kills_what_ignores_it(tmp_path: Path) -> None:
    """SIGTERM to `batchd up` (its handler only sets a flag) ends run(); stop() then sends
    SIGTERM to each child, SIGKILL to one still there after the grace period."""
    import threading

    from cli.supervise import Supervisor

    ready = tmp_path / "ready"
    stubborn = _sleeper(
        f"signal.signal(signal.SIGTERM, signal.SIG_IGN); open({str(ready)!r}, 'w').close()"
    )
    sup = Supervisor({"polite": _sleeper(), "stubborn": stubborn}, echo=print, poll_s=0.02)
    sup.start()
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    sup.run()  # returns once the SIGTERM arrived
    assert sup.stopping
    started = time.monotonic()
    assert sup.stop(grace_s=1.0) is False  # the stubborn one had to be killed
    assert time.monotonic() - started < 10
    assert sup.children["polite"].proc.returncode == -signal.SIGTERM
    assert sup.children["stubborn"].proc.returncode == -signal.SIGKILL
    assert signal.getsignal(signal.SIGTERM) is not sup.request_stop  # handler given back


@pytest.mark.slow
def test_batchd_up_embedded_mode_serves_a_batch(tmp_path: Path) -> None:
    import httpx
    from openai import OpenAI

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BATCHD_", "OPENAI_"))}
    env.update(BATCHD_HOME=str(tmp_path / "home"), BATCHD_MODELS="batchd-demo=demo:llama-tiny")
    log = (tmp_path / "up.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "up", "--port", str(port)],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        key = None
        deadline = time.monotonic() + 120
        while key is None and time.monotonic() < deadline:
            assert proc.poll() is None, Path(log.name).read_text()
            match = re.search(
                r"development API key \(tenant 'default'\): (\S+)", Path(log.name).read_text()
            )
            key = match.group(1) if match else None
            time.sleep(0.5)
        assert key, Path(log.name).read_text()
        assert (tmp_path / "home" / "batchd.db").exists()  # SQLite, not a server

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=8)
        while True:  # the API may still be starting
            try:
                models = client.models.list()
                break
            except Exception:
                assert time.monotonic() < deadline, Path(log.name).read_text()
                time.sleep(0.5)
        assert [m.id for m in models.data] == ["batchd-demo"]

        # The worker dies (SIGKILL: no cleanup): `batchd up` starts it again, and the batch
        # below is served by the new one.
        children = children_with_cmdlines(proc.pid)
        (worker_pid,) = [p for p, cmd in children.items() if " worker " in cmd]
        assert [cmd for cmd in children.values() if " beat " in cmd]  # a child of its own
        os.kill(worker_pid, signal.SIGKILL)
        while "batchd up: starting worker again (restart 1)" not in Path(log.name).read_text():
            assert time.monotonic() < deadline + 30, Path(log.name).read_text()[-3000:]
            time.sleep(0.2)
        assert (
            "batchd up: worker exited unexpectedly (signal SIGKILL)" in Path(log.name).read_text()
        )

        # The quickstart's file, on the demo model (the real default model is tested in
        # tests/engine/test_smollm2.py; here speed matters more than words).
        chat = (ROOT / "examples" / "chat.jsonl").read_text()
        chat = chat.replace('"model": "smollm2-135m-instruct"', '"model": "batchd-demo"')
        upload = client.files.create(file=("chat.jsonl", chat.encode()), purpose="batch")
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 180
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, (batch, Path(log.name).read_text()[-3000:])
            time.sleep(0.5)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        assert batch.request_counts.completed == batch.request_counts.total == 8
        lines = client.files.content(batch.output_file_id).text.splitlines()
        assert [line.split('"custom_id":"')[1].split('"')[0] for line in lines] == [
            f"req-{i}" for i in range(8)
        ]

        # The startup lines say what is served in which dtype, how long loading took, and
        # where the worker's metrics exporter (on by default) listens. Embedded defaults run
        # one API process (SQLite, rate limits counted in the process).
        text = Path(log.name).read_text()
        assert "API processes: 1" in text
        assert len(_api_processes(proc.pid)) == 1
        dtype = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
        assert re.search(rf"model batchd-demo ready: {dtype} on cpu, loaded in [\d.]+ s", text)
        worker_metrics = re.search(r"(http://127\.0\.0\.1:\d+/metrics) \(worker\)", text)
        assert worker_metrics, text
        scraped = httpx.get(worker_metrics.group(1), timeout=10).text
        assert 'batchd_engine_generation_tokens_total{model="batchd-demo"}' in scraped

        os.killpg(proc.pid, signal.SIGTERM)  # as a terminal's Ctrl-C reaches the whole group
        assert proc.wait(timeout=30) == 0, Path(log.name).read_text()[-3000:]
        with pytest.raises(ProcessLookupError):  # nothing of it is left running
            os.killpg(proc.pid, 0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _descendants(pid: int) -> dict[int, str]:
    """Every process under ``pid``: {pid: command line}."""
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        try:
            children = children_with_cmdlines(todo.pop())
        except FileNotFoundError:  # gone meanwhile
            continue
        found.update(children)
        todo.extend(children)
    return found


def _api_processes(up_pid: int) -> list[int]:
    """The processes that serve the API under ``batchd up``: uvicorn itself, or the worker
    processes its manager spawned when there are several."""
    tree = _descendants(up_pid)
    (uvicorn,) = [p for p, cmd in tree.items() if " uvicorn api.app:app " in cmd]
    spawned = [p for p, cmd in _descendants(uvicorn).items() if "spawn_main" in cmd]
    return spawned or [uvicorn]


@pytest.mark.services
@pytest.mark.slow
def test_batchd_up_runs_api_processes_by_cpu_count_with_one_view_of_metrics(
    pg_url: str, redis_url: str, tmp_path: Path
) -> None:
    """On Postgres and Redis, `batchd up` runs min(4, CPUs) API processes on one port. Each
    scrape of /metrics, whichever process answers it, counts every process's requests."""
    import threading

    import httpx

    from testkit.metrics.scrape import parse, value

    expected = min(4, len(os.sched_getaffinity(0)))
    port = _free_port()
    key = "sk-up-smoke-static-key"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BATCHD_", "OPENAI_"))}
    env.update(
        BATCHD_HOME=str(tmp_path / "home"), BATCHD_DATABASE_URL=pg_url,
        BATCHD_BROKER_URL=redis_url, BATCHD_STORAGE_URL=str(tmp_path / "storage"),
        BATCHD_MODELS="batchd-demo=demo:llama-tiny", BATCHD_API_KEYS=key,
        BATCHD_RATE_LIMIT_PER_MINUTE="0",
    )  # fmt: skip
    log = (tmp_path / "up.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "up", "--no-workers", "--port", str(port)],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, Path(log.name).read_text()
            assert time.monotonic() < deadline, Path(log.name).read_text()
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        assert f"API processes: {expected}" in Path(log.name).read_text()
        while len(_api_processes(proc.pid)) < expected:  # the manager spawns them in turn
            assert time.monotonic() < deadline, _descendants(proc.pid)
            time.sleep(0.2)
        assert len(_api_processes(proc.pid)) == expected

        # Requests on connections of their own, several at a time: the processes share them.
        requests, errors = 48, []

        def send(n: int) -> None:
            for _ in range(n):
                r = httpx.get(
                    f"{base}/v1/batches", headers={"Authorization": f"Bearer {key}"}, timeout=30
                )
                if r.status_code != 200:
                    errors.append(r.text)

        threads = [threading.Thread(target=send, args=(requests // 8,)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[:3]
        counted = [
            value(
                parse(httpx.get(f"{base}/metrics", timeout=30).text),
                "batchd_http_requests_total",
                handler="/v1/batches",
                method="GET",
                status="200",
            )  # fmt: skip
            for _ in range(4 * expected)
        ]
        assert counted == [requests] * len(counted)
        assert any((tmp_path / "home" / "api-metrics").glob("*.db"))  # multiprocess mode

        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, Path(log.name).read_text()[-3000:]
        with pytest.raises(ProcessLookupError):  # no API process is left running
            os.killpg(proc.pid, 0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
