"""An upstream model end to end: the whole service (API, control worker, a dispatch worker,
beat) driving a real OpenAI-compatible server that batchd did not write
(``transformers serve --continuous-batching`` on SmolLM2-135M-Instruct), through a loopback TCP
proxy that can cut it off and an HTTP proxy that answers 429 or 503 on demand.

What each test holds: a batch's output lines carry the server's own answers (greedy text equal
to asking it directly); a line the server refuses is an error line with its status and
message; 429s and 503s with ``Retry-After``, the server cut off or stalled mid-batch fail no line; a
dispatch worker SIGKILLed mid-shard loses and doubles no line; a cancel closes the batch's
requests in flight at the server.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from cli.perf.service import free_port, wait_for
from core.launch import QUIET, beat_command, control_worker_command, dispatch_worker_command
from testkit.builders.lines import chat_line, completion_line, jsonl
from testkit.metrics.metrics_lint import sample_problems
from testkit.metrics.scrape import parse, value
from testkit.proxies.fault_proxy import FaultProxy
from testkit.proxies.tcp_proxy import TcpProxy
from testkit.service.stack import API_KEY, Procs, api_command, stack_env
from testkit.upstream_server import UpstreamServer

pytestmark = [pytest.mark.services, pytest.mark.slow]

MODEL = "fleet"
SALT_IN_PROMPT_CACHE_KEY = "cache_salt_field=prompt_cache_key"


@dataclass
class Fleet:
    base_url: str  # batchd's
    root: Path
    env: dict[str, str]
    procs: Procs
    server: UpstreamServer
    proxy: TcpProxy
    faults: FaultProxy
    http: httpx.Client

    def dispatch_command(self, name: str) -> list[str]:
        return dispatch_worker_command([MODEL], 2, f"{name}@e2e", extra=QUIET)

    def submit(self, lines: list[Any], endpoint: str = "/v1/chat/completions") -> str:
        uploaded = self.http.post(
            "/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", jsonl(lines))}
        )
        assert uploaded.status_code == 200, uploaded.text
        created = self.http.post(
            "/v1/batches",
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": endpoint,
                "completion_window": "24h",
            },
        )
        assert created.status_code == 200, created.text
        return created.json()["id"]

    def batch(self, batch_id: str) -> dict[str, Any]:
        return self.http.get(f"/v1/batches/{batch_id}").json()

    def wait(self, batch_id: str, statuses: tuple[str, ...], timeout: float = 300) -> dict:
        wait_for(
            lambda: self.batch(batch_id)["status"] in statuses,
            timeout,
            f"batch {batch_id} {'/'.join(statuses)}",
            self.procs.logs,
        )
        return self.batch(batch_id)

    def lines(self, file_id: str | None) -> list[dict[str, Any]]:
        if not file_id:
            return []
        text = self.http.get(f"/v1/files/{file_id}/content").text
        return [json.loads(line) for line in text.splitlines() if line]

    def ask(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The server's own answer, asked directly."""
        answer = httpx.post(
            self.server.base_url + path, json=dict(body, model=self.server.model), timeout=120
        )
        assert answer.status_code == 200, answer.text
        return answer.json()


@pytest.fixture(scope="module")
def fleet(pg_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    import redis

    root = tmp_path_factory.mktemp("upstream")
    base, _, index = redis_url.rpartition("/")
    broker = f"{base}/{int(index) % 15 + 1}"  # the session's e2e broker index
    redis.Redis.from_url(broker).flushdb()
    procs = Procs(root)
    with UpstreamServer(root) as server:
        faults = FaultProxy(f"http://127.0.0.1:{server.port}").start()
        proxy = TcpProxy("127.0.0.1", faults.port).start()
        upstream = f"http://127.0.0.1:{proxy.port}/v1"
        port = free_port()
        env = stack_env(
            pg_url,
            broker,
            root,
            # transformers serve refuses vLLM's cache_salt: the tenant's salt goes in
            # prompt_cache_key (worker.upstream.cache_salt)
            BATCHD_MODELS=json.dumps(
                {MODEL: f"upstream:{upstream}?model={server.model}&{SALT_IN_PROMPT_CACHE_KEY}"}
            ),
            BATCHD_CHECKPOINT_EVERY="2",
            BATCHD_CHECKPOINT_INTERVAL_S="0.5",
            BATCHD_SHARD_MAX_REQUESTS="8",
            BATCHD_WORKER_SHARD_CONCURRENCY="2",
            BATCHD_EXPIRY_SWEEP_INTERVAL_S="1",
            BATCHD_SHARD_STALE_AFTER_S="6",
            BATCHD_HEARTBEAT_INTERVAL_S="1",
            BATCHD_RECLAIM_INTERVAL_S="2",
            BATCHD_WORKER_METRICS_PORT=str(free_port()),
        )
        fleet = Fleet(
            f"http://127.0.0.1:{port}",
            root,
            env,
            procs,
            server,
            proxy,
            faults,
            httpx.Client(
                base_url=f"http://127.0.0.1:{port}",
                headers={"Authorization": f"Bearer {API_KEY}"},
                timeout=30,
            ),
        )
        try:
            procs.start("api", api_command(port), env)
            procs.start("control", control_worker_command("control@e2e", extra=QUIET), env)
            procs.start("dispatch", fleet.dispatch_command("dispatch"), env)
            procs.start("beat", beat_command(root / "beat-schedule"), env)

            def ready() -> bool:
                procs.check_alive()
                try:
                    up = fleet.http.get("/healthz").status_code == 200
                except httpx.HTTPError:
                    return False
                return up and "ready." in procs.log("control") and "ready." in procs.log("dispatch")

            wait_for(ready, 120, "the API and the workers", procs.logs)
            yield fleet
        finally:
            fleet.http.close()
            procs.stop_all()
            proxy.close()
            faults.close()


def test_the_dispatch_worker_starts_without_torch(fleet: Fleet) -> None:
    """A dispatch worker holds no model and never imports torch (it starts in seconds and
    many fit on one small node)."""
    pid = fleet.procs.procs["dispatch"].pid
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "libtorch" not in maps
    models = fleet.http.get("/v1/models").json()["data"]
    fleet_model = next(m for m in models if m["id"] == MODEL)
    assert fleet_model["owned_by"] == "batchd-upstream"
    assert "/v1/embeddings" in fleet_model["endpoints"]


def test_the_dispatch_worker_exports_its_upstream_figures(fleet: Fleet) -> None:
    fleet.submit([chat_line("m0", "Hi.", 4, model=MODEL)])
    url = f"http://127.0.0.1:{fleet.env['BATCHD_WORKER_METRICS_PORT']}/metrics"

    def tokens() -> float:
        samples = parse(httpx.get(url).text)
        return value(samples, "batchd_upstream_generation_tokens_total", model=MODEL)

    wait_for(lambda: tokens() > 0, 120, "the upstream's figures", fleet.procs.logs)
    samples = parse(httpx.get(url).text)
    assert not sample_problems(samples)
    names = {name for name, _ in samples}
    assert {"batchd_upstream_limit", "batchd_upstream_allowed",
            "batchd_upstream_num_requests_running", "batchd_upstream_responses_total"} <= names  # fmt: skip


def test_a_batch_carries_the_servers_own_answers(fleet: Fleet) -> None:
    lines = [chat_line(f"c{i}", f"Name a color, number {i}.", 8, model=MODEL) for i in range(6)]
    lines.append(chat_line("shared", "Say hello.", 8, model=MODEL))
    batch_id = fleet.submit(lines)
    done = fleet.wait(batch_id, ("completed", "failed"))
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 7, "completed": 7, "failed": 0}
    out = fleet.lines(done["output_file_id"])
    assert [line["custom_id"] for line in out] == [line["custom_id"] for line in lines]
    for line, sent in zip(out, lines, strict=True):
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200
        direct = fleet.ask("/chat/completions", sent["body"])
        assert (
            body["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
        )
    # Results while running (the results route) and estimates serve it as any model.
    page = fleet.http.get(f"/v1/batches/{batch_id}/results").json()
    assert sorted(r["custom_id"] for r in page["data"]) == sorted(x["custom_id"] for x in lines)
    estimate = fleet.http.post("/v1/batches/estimate", json={
        "input_file_id": done["input_file_id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h"})  # fmt: skip
    assert estimate.status_code == 200, estimate.text
    assert (estimate.json()["model"], estimate.json()["valid_requests"]) == (MODEL, 7)
    usage = done["usage"]
    assert usage["output_tokens"] == sum(
        line["response"]["body"]["usage"]["completion_tokens"] for line in out
    )
    assert usage["input_tokens"] > 0


def test_a_refused_line_is_an_error_line_with_the_servers_answer(fleet: Fleet) -> None:
    """``min_p`` is forwarded as written; this server refuses it (422), and that line alone
    fails, naming the server's status and message, without a retry loop."""
    lines = [
        completion_line("ok", "Once upon a time", 6, model=MODEL),
        completion_line("refused", "Once upon a time", 6, model=MODEL, min_p=0.1),
    ]
    batch_id = fleet.submit(lines, endpoint="/v1/completions")
    done = fleet.wait(batch_id, ("completed", "failed"))
    assert done["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    (error,) = fleet.lines(done["error_file_id"])
    assert error["custom_id"] == "refused"
    assert error["response"]["status_code"] == 422
    assert "min_p" in error["response"]["body"]["error"]["message"]
    assert "422" in error["response"]["body"]["error"]["message"]


def test_a_cut_upstream_fails_no_line(fleet: Fleet) -> None:
    """The server unreachable mid-batch: the shard waits with back-off and resumes; every line
    succeeds once it is back."""
    lines = [chat_line(f"cut{i}", f"Count to {i}.", 12, model=MODEL) for i in range(10)]
    fleet.proxy.cut()
    try:
        batch_id = fleet.submit(lines)
        wait_for(
            lambda: "unreachable" in fleet.procs.log("dispatch"),
            120,
            "the dispatcher to meet the cut",
            fleet.procs.logs,
        )
        time.sleep(2)
        assert fleet.batch(batch_id)["request_counts"]["failed"] == 0
    finally:
        fleet.proxy.resume()
    done = fleet.wait(batch_id, ("completed", "failed"))
    assert done["request_counts"] == {"total": 10, "completed": 10, "failed": 0}


def test_a_stalled_upstream_fails_no_line(fleet: Fleet) -> None:
    """The server's route lost silently (connections held, nothing answered): when it comes
    back the held requests are sent again and every line succeeds."""
    lines = [chat_line(f"st{i}", f"Spell {i}.", 6, model=MODEL) for i in range(6)]
    fleet.proxy.stall()
    try:
        batch_id = fleet.submit(lines)
        wait_for(lambda: fleet.batch(batch_id)["status"] == "in_progress", 60, "the batch",
                 fleet.procs.logs)  # fmt: skip
        time.sleep(3)
        assert fleet.batch(batch_id)["request_counts"]["completed"] == 0
    finally:
        fleet.proxy.resume()
    done = fleet.wait(batch_id, ("completed", "failed"))
    assert done["request_counts"] == {"total": 6, "completed": 6, "failed": 0}


def test_a_killed_dispatch_worker_loses_and_doubles_no_line(fleet: Fleet) -> None:
    n = 24
    lines = [chat_line(f"k{i}", f"Write a word about {i}.", 24, model=MODEL) for i in range(n)]
    batch_id = fleet.submit(lines)
    wait_for(
        lambda: fleet.batch(batch_id)["request_counts"]["completed"] >= 2,
        180,
        "the first results",
        fleet.procs.logs,
    )
    os.killpg(fleet.procs.procs["dispatch"].pid, signal.SIGKILL)
    fleet.procs.procs["dispatch"].wait()
    fleet.procs.start("dispatch", fleet.dispatch_command("dispatch2"), fleet.env)
    done = fleet.wait(batch_id, ("completed", "failed"), timeout=400)
    assert done["status"] == "completed", done
    out = fleet.lines(done["output_file_id"])
    assert sorted(line["custom_id"] for line in out) == sorted(f"k{i}" for i in range(n))
    assert fleet.lines(done["error_file_id"]) == []


@pytest.mark.parametrize("status", [429, 503])
def test_a_busy_server_is_waited_for_not_failed(fleet: Fleet, status: int) -> None:
    """The server answers 429 or 503 with ``Retry-After``: the dispatcher backs off and sends
    those requests again; every line succeeds."""
    fleet.faults.refuse(3, status, retry_after=1)
    refused = fleet.faults.refused
    lines = [chat_line(f"b{status}-{i}", f"Say {i}.", 4, model=MODEL) for i in range(5)]
    done = fleet.wait(fleet.submit(lines), ("completed", "failed"))
    assert done["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    assert fleet.faults.refused - refused == 3
    assert f"upstream overloaded ({status})" in fleet.procs.log("dispatch")


def test_cancel_closes_the_requests_in_flight(fleet: Fleet) -> None:
    """vLLM and SGLang abort a request when its connection closes: a cancel must close the
    batch's requests in flight, within about a second (the 2 s promise, polled)."""
    lines = [chat_line(f"x{i}", "Tell a story.", 16, model=MODEL) for i in range(12)]
    fleet.faults.hold()  # the answers wait in the proxy: in flight however fast the server is
    try:
        batch_id = fleet.submit(lines)
        # One at least: the dispatcher's in-flight limit adapts, and may start at 1 after the
        # overloads of the tests before (held answers give it no success to grow on).
        wait_for(lambda: fleet.faults.in_flight >= 1, 120, "requests in flight", fleet.procs.logs)
        closed = fleet.faults.closed_by_client
        assert fleet.http.post(f"/v1/batches/{batch_id}/cancel").status_code == 200
        cancelled = time.monotonic()
        wait_for(lambda: fleet.faults.in_flight == 0, 10, "the requests to close", fleet.procs.logs)
        assert time.monotonic() - cancelled < 2.5
        assert fleet.faults.closed_by_client > closed
    finally:
        fleet.faults.release()
    done = fleet.wait(batch_id, ("cancelled",))
    assert done["request_counts"]["total"] == 12
