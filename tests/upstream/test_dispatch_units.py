"""The dispatcher's parts, each on its own: the concurrency controller on known throughput
curves, shares of one limit, the shared limit between two members on Postgres, the live
traffic guard's readings, and the dispatcher's order and back-off against a small loopback
server whose answers the test scripts."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from core.llms.specs import upstream_spec
from worker.upstream.concurrency import ConcurrencyController, Window
from worker.upstream.dispatcher import Dispatcher, _retry_after
from worker.upstream.guard import LiveGuard, histogram_quantile, read_metrics
from worker.upstream.shared_limit import Counters, SharedLimit, Windows, share_of

# -- the controller


def _window(limit: int, knee: int, per_request_tps: float = 10.0) -> Window:
    """What a server whose batch fills at ``knee`` requests does in 5 s at ``limit``."""
    running = min(limit, knee)
    throughput = running * per_request_tps
    latency = 10.0 * max(1.0, limit / knee)  # past the knee, requests queue
    completed = max(1, int(limit * 5 / latency))
    return Window(5.0, completed, int(throughput * 5), completed * latency, busy=limit)


@pytest.mark.parametrize("knee", [6, 24, 100])
def test_the_controller_finds_the_knee_and_holds_near_it(knee: int) -> None:
    controller = ConcurrencyController(initial=8, maximum=256)
    seen = []
    for _ in range(40):
        seen.append(controller.observe(_window(controller.limit, knee)))
    settled = sorted(seen[-10:])
    assert knee <= settled[5] <= 1.5 * knee, seen  # held just above the knee
    assert settled[0] >= 0.66 * knee and settled[-1] <= 2 * knee, seen  # probes, taken back


def test_the_controller_halves_on_overload_and_respects_its_cap() -> None:
    controller = ConcurrencyController(initial=8, maximum=12)
    assert controller.observe(_window(8, 100)) == 12  # doubling stops at the operator's cap
    assert controller.overloaded() == 6
    assert controller.backoffs == 1
    for _ in range(30):
        controller.observe(_window(controller.limit, 100))
    assert controller.limit <= 12


def test_an_idle_window_says_nothing_about_the_limit() -> None:
    controller = ConcurrencyController(initial=8)
    idle = Window(5.0, 3, 300, 3.0, busy=2.0)  # only two requests in flight on average
    assert controller.observe(idle) == 8


def test_a_window_across_an_idle_gap_is_not_judged() -> None:
    controller = ConcurrencyController(initial=8)
    windows = Windows(controller)
    total, now = Counters(), 0.0

    def run(seconds: float, in_flight: int, tps_each: float, demand: int) -> int:
        nonlocal total, now
        for _ in range(int(seconds)):  # one report a second, as the dispatcher sends
            now += 1.0
            done = in_flight // 2
            total = total.plus(Counters(done, int(in_flight * tps_each), done * 2.0, in_flight))
            limit = windows.feed(total, now, demand)
        return limit

    run(1, 0, 0, 8)
    assert run(3, 8, 10.0, demand=50) == 16  # a full window at 8: slow start doubles
    assert run(30, 0, 0, demand=0) == 8  # out of work while 16 was tried: back to 8
    # Work resumes: the in-flight count ramps up and the first window is let go by, not
    # compared with what was measured before the gap.
    assert run(2, 3, 10.0, demand=50) == 8
    assert run(3, 8, 10.0, demand=50) == 16  # the next full window is judged again


def test_a_limit_found_before_is_where_a_fresh_controller_starts() -> None:
    controller = ConcurrencyController(initial=32, maximum=256)
    assert controller.resume(100) == 100
    assert controller.observe(_window(100, 100)) == 200  # slow start still looks above it
    assert controller.observe(_window(200, 100)) == 100  # nothing gained: back
    assert controller.resume(8) == 100  # once it has judged a window, its own finding wins
    assert ConcurrencyController(maximum=64).resume(1000) == 64  # the operator's cap holds


def test_shares_follow_demand() -> None:
    assert share_of(32, 10, 10) == 32  # alone: all of it
    assert share_of(32, 0, 10, members=2) == 16  # idle: an even part, ready for work
    assert share_of(32, 30, 40) == 24
    assert share_of(32, 10, 40) == 8
    assert share_of(4, 1, 1000) == 1  # never starved while it has work


def test_retry_after_is_read_in_seconds_or_as_a_date() -> None:
    assert _retry_after("2") == 2.0
    assert _retry_after(None) == 1.0
    assert _retry_after("3600") == 60.0  # capped
    assert 0.0 <= _retry_after("Thu, 01 Jan 2026 00:00:00 GMT") <= 0.0 + 1e-9
    assert _retry_after("soon") == 1.0


@pytest.mark.services
def test_two_members_share_one_limit(
    service_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two dispatch workers of one upstream: one leads, each gets a share in proportion to
    its demand, the leader's windows sum both members' progress, the follower sends by the
    leader's limit, and when the leader leaves the other takes over. The leader's windows run
    on a clock the test moves, so how long each sync takes on a busy machine is not measured."""
    monkeypatch.setattr("worker.upstream.shared_limit.MIN_WINDOW_S", 0.0)
    name = f"up-{time.monotonic_ns()}"
    clock = [0.0]
    a = SharedLimit(name, "a", ConcurrencyController(initial=16), clock=lambda: clock[0])
    b = SharedLimit(name, "b", ConcurrencyController(initial=16), clock=lambda: clock[0])
    assert a.sync(30, Counters()) == 16  # alone
    share_b = b.sync(10, Counters())
    share_a = a.sync(30, Counters())
    assert (a.leader, b.leader) == (True, False)
    assert (share_a, share_b) == (12, 4)
    # One window per second; the window at 32 (the third: the second settles) doubles the
    # output of the window at 16, so slow start keeps 32 and tries 64.
    for step, output in enumerate((800, 1600, 3200), start=1):
        clock[0] += 1.0
        progress = Counters(completed=8 * step, output_tokens=output, latency_s=8.0 * step,
                            busy_s=100.0 * step)  # fmt: skip
        b.sync(10, progress)
        a.sync(30, progress)
    assert a.controller.best is not None
    assert a.controller.best.completed == 16  # 8 from each member in the window
    assert a.limit == 64  # the leader moved the limit (slow start) ...
    b.sync(10, Counters(completed=24))
    assert b.limit == a.limit  # ... and the follower uses it
    assert b.controller.best is None  # the follower's own controller never ran
    found = a.limit
    a.leave()
    b.sync(10, Counters(completed=24))
    assert b.leader
    assert b.controller.limit == found  # the new leader starts from what the last one found


# -- the live traffic guard

VLLM_METRICS = """
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} %d
vllm:time_to_first_token_seconds_bucket{le="0.5",model_name="m"} %d
vllm:time_to_first_token_seconds_bucket{le="2.5",model_name="m"} %d
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} %d
vllm:time_to_first_token_seconds_count{model_name="m"} %d
vllm:time_to_first_token_seconds_sum{model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} %d
"""


def test_the_guard_reads_vllms_metrics() -> None:
    buckets, waiting = read_metrics(VLLM_METRICS % (90, 99, 100, 100, 100, 3))
    assert waiting == 3
    assert histogram_quantile(0.99, list(buckets.items())) == 0.5
    assert histogram_quantile(0.5, list(buckets.items())) == 0.1


def test_the_guard_cuts_bulk_when_the_objective_is_threatened() -> None:
    guard = LiveGuard(upstream_spec("upstream:http://127.0.0.1:1/v1?ttft_p99_ms=500", "m"))
    assert guard.cap == 1  # bulk starts with one request in flight and earns more
    for _ in range(3 * 3):  # three calm readings in a row for each step up
        guard.decide(0.1, 0)
    assert guard.cap == 4
    assert guard.decide(0.40, 0) == 2  # past 70% of the objective: halved at once
    assert guard.decide(0.1, 2) == 1  # requests queue in the server
    assert guard.decide(0.1, 2) == 0  # still: bulk pauses, the live traffic has it alone
    assert guard.decide(0.1, 0) == guard.decide(0.1, 0) == 0  # calm, not yet for long
    assert guard.decide(0.1, 0) == 1  # three calm readings: bulk resumes
    guard.decide(0.1, 0)
    guard.decide(0.3, 0)  # neither calm nor threatened: the count of calm readings restarts
    guard.decide(0.1, 0)
    assert guard.decide(0.1, 0) == 1
    for _ in range(300):
        guard.decide(0.1, 0)
    assert guard.cap == 256  # never above the upstream's cap


def test_the_guard_grows_the_cap_only_while_it_holds_bulk_back() -> None:
    guard = LiveGuard(upstream_spec("upstream:http://127.0.0.1:1/v1?ttft_p99_ms=500", "m"))
    for _ in range(9):
        guard.decide(0.1, 0)
    cap = guard.cap
    for _ in range(10):  # fewer in flight than allowed: a larger cap would be untested room
        assert guard.decide(0.1, 0, in_flight=cap - 1) == cap
    for _ in range(3):
        guard.decide(0.1, 0, in_flight=cap)
    assert guard.cap > cap
    assert guard.decide(0.45, 0, in_flight=0) < cap + 1  # a threat cuts it whatever is out


def test_the_probe_times_the_first_token_not_the_role_chunk() -> None:
    from worker.upstream.guard import _carries_a_token

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return "data: " + json.dumps({"choices": [choice]})

    # What vLLM, SGLang and transformers send the moment they accept a request.
    assert not _carries_a_token(chunk({"role": "assistant", "content": ""}))
    assert not _carries_a_token(chunk({"role": "assistant"}))
    assert not _carries_a_token("data: [DONE]") and not _carries_a_token(": keep-alive")
    assert _carries_a_token(chunk({"content": "OK"}))
    assert _carries_a_token(chunk({"reasoning_content": "Hm"}))
    assert _carries_a_token(chunk({}, finish="length"))  # a first token that decodes to ""


# -- the dispatcher against a scripted loopback server


class Script(BaseHTTPRequestHandler):
    """Answers each POST with the next scripted reply (status, headers), else 200; records
    what it was sent and when."""

    def do_POST(self) -> None:
        server: Any = self.server
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        with server.lock:
            server.seen.append((time.monotonic(), self.path, body))
            status, headers = server.replies.pop(0) if server.replies else (200, {})
            delay = server.delay  # read with the record: a test changes it once it sees this
        time.sleep(delay)
        answer = {"error": {"message": "busy"}} if status != 200 else {
            "choices": [{"message": {"content": body["messages"][0]["content"]}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3},
        }  # fmt: skip
        data = json.dumps(answer).encode()
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def scripted() -> Iterator[Any]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Script)
    server.lock, server.seen, server.replies, server.delay = threading.Lock(), [], [], 0.02
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def _dispatcher(server: Any, options: str = "max_concurrency=1") -> Dispatcher:
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    return Dispatcher("m", upstream_spec(f"upstream:{url}?{options}", "m"), shared=False).start()


def _wait_until(condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _chat(text: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


def test_the_guard_sends_no_probe_while_there_is_no_bulk_work(scripted: Any) -> None:
    dispatcher = _dispatcher(scripted, "max_concurrency=4&ttft_p99_ms=500")
    try:
        time.sleep(2.5)  # two and a half guard intervals with nothing to send
        assert scripted.seen == []
        scripted.delay = 1.5  # one bulk request out for longer than an interval
        assert dispatcher.submit("/chat/completions", _chat("x"), group="g").result(10).status
        probes = [body for _, _, body in scripted.seen if body.get("stream")]
        assert probes, scripted.seen  # with bulk work out, the guard watches
    finally:
        dispatcher.shutdown()


def test_lines_that_share_a_prefix_go_out_together(scripted: Any) -> None:
    dispatcher = _dispatcher(scripted)
    try:
        scripted.delay = 2.0  # the first request holds the one slot while the rest queue
        futures = [dispatcher.submit("/chat/completions", _chat("first"), group="g")]
        _wait_until(lambda: scripted.seen)
        scripted.delay = 0.0
        for i in range(8):
            prefix = "A" if i % 2 == 0 else "B"
            futures.append(dispatcher.submit("/chat/completions", _chat(f"{prefix}{i}"),
                                             group="g", prefix=prefix))  # fmt: skip
        assert all(f.result(30).status == 200 for f in futures)
    finally:
        dispatcher.shutdown()
    sent = [body["messages"][0]["content"][0] for _, _, body in scripted.seen[1:]]
    assert sent == ["A"] * 4 + ["B"] * 4  # not file order: A0 B1 A2 B3 …


def test_an_urgent_batch_overtakes_queued_bulk(scripted: Any) -> None:
    dispatcher = _dispatcher(scripted)
    try:
        scripted.delay = 2.0  # bulk-0 holds the one slot while the rest queue
        futures = [dispatcher.submit("/chat/completions", _chat("bulk-0"), group="bulk",
                                     tenant="a", priority=1)]  # fmt: skip
        _wait_until(lambda: scripted.seen)
        scripted.delay = 0.0
        futures += [dispatcher.submit("/chat/completions", _chat(f"bulk-{i}"), group="bulk",
                                      tenant="a", priority=1) for i in range(1, 4)]  # fmt: skip
        futures += [dispatcher.submit("/chat/completions", _chat(f"high-{i}"), group="high",
                                      tenant="b", priority=-1) for i in range(3)]  # fmt: skip
        assert all(f.result(30).status == 200 for f in futures)
    finally:
        dispatcher.shutdown()
    order = [body["messages"][0]["content"] for _, _, body in scripted.seen]
    assert order[1:4] == ["high-0", "high-1", "high-2"], order


def test_a_429_pauses_for_retry_after_and_the_request_runs_again(scripted: Any) -> None:
    scripted.replies = [(429, {"Retry-After": "1"})]
    dispatcher = _dispatcher(scripted, "max_concurrency=4")
    try:
        reply = dispatcher.submit("/chat/completions", _chat("again"), group="g").result(30)
        snapshot = dispatcher.snapshot()
    finally:
        dispatcher.shutdown()
    assert reply.status == 200
    (first, _, _), (second, _, _) = scripted.seen
    assert second - first >= 0.95
    assert snapshot["backoffs"] == {"429": 1}


def test_a_burst_of_refusals_halves_what_may_be_in_flight_once(scripted: Any) -> None:
    """Eight requests out when the server starts refusing: eight 503s are one piece of news,
    so the sender halves once (from 8 to 4), not down to one."""
    scripted.replies = [(503, {"Retry-After": "1"})] * 8
    dispatcher = _dispatcher(scripted, "max_concurrency=8")
    try:
        futures = [dispatcher.submit("/chat/completions", _chat(f"b{i}"), group="g")
                   for i in range(8)]  # fmt: skip
        _wait_until(lambda: dispatcher.snapshot()["backoffs"].get("503") == 8)
        allowed = dispatcher.allowed()
        assert all(f.result(30).status == 200 for f in futures)
    finally:
        dispatcher.shutdown()
    assert allowed == 4


def test_a_refused_request_is_answered_not_retried(scripted: Any) -> None:
    scripted.replies = [(400, {})]
    dispatcher = _dispatcher(scripted)
    try:
        reply = dispatcher.submit("/chat/completions", _chat("bad"), group="g").result(30)
    finally:
        dispatcher.shutdown()
    assert reply.status == 400
    assert reply.body == {"error": {"message": "busy"}}
    assert len(scripted.seen) == 1


def test_an_aborted_group_gets_aborted_replies(scripted: Any) -> None:
    dispatcher = _dispatcher(scripted)
    try:
        scripted.delay = 1.0
        futures = [dispatcher.submit("/chat/completions", _chat(f"x{i}"), group="g")
                   for i in range(4)]  # fmt: skip
        _wait_until(lambda: scripted.seen)
        dispatcher.abort_group("g")
        replies = [f.result(5) for f in futures]
    finally:
        dispatcher.shutdown()
    assert all(r.aborted for r in replies)
    assert len(scripted.seen) == 1  # the three queued ones were never sent


class Holding:
    """A loopback server that takes requests and never answers: it counts the connections a
    client holds open (one closes when the client hangs up)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.lock = threading.Lock()
        self.open = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._hold, args=(conn,), daemon=True).start()

    def _hold(self, conn: socket.socket) -> None:
        with self.lock:
            self.open += 1
        try:
            while conn.recv(65536):
                pass
        finally:
            conn.close()
            with self.lock:
                self.open -= 1


def test_an_abort_said_twice_still_closes_the_connections() -> None:
    """Both shards of a batch abort it, each twice: a second cancel that lands while httpx
    closes the connection of the first must not leave it open (the server would go on
    generating what nobody reads). The second abort here comes one loop turn after the first,
    where it used to interrupt that cleanup."""
    server = Holding()
    spec = upstream_spec(f"upstream:{server.url}?max_concurrency=4", "m")
    dispatcher = Dispatcher("m", spec, shared=False).start()
    try:
        futures = [dispatcher.submit("/chat/completions", _chat(f"x{i}"), group="g")
                   for i in range(4)]  # fmt: skip
        _wait_until(lambda: server.open == 4)
        loop = dispatcher._loop
        assert loop is not None

        def twice() -> None:
            dispatcher.abort_group("g")
            loop.call_soon(dispatcher.abort_group, "g")

        loop.call_soon_threadsafe(twice)
        assert all(f.result(5).aborted for f in futures)
        _wait_until(lambda: server.open == 0, timeout=5)
    finally:
        dispatcher.shutdown()
        server.sock.close()


def test_an_upstream_models_prompts_are_counted_for_quotas(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """With ``tokenizer=`` the named local model's tokenizer counts the prompt; without, its
    size does; the ids are never kept for the shard (the server tokenizes its own)."""
    from core.batchfile.reader import RawLine, parse_request
    from core.settings import get_settings
    from worker.infra import runtime
    from worker.validation.token_count import TokenCounter

    monkeypatch.setenv("BATCHD_HOME", str(tmp_path))
    monkeypatch.setenv("BATCHD_MODELS", json.dumps({
        "counted": "upstream:http://127.0.0.1:9/v1?tokenizer=demo:llama-tiny",
        "sized": "upstream:http://127.0.0.1:9/v1?max_model_len=4096",
    }))  # fmt: skip
    get_settings.cache_clear()
    monkeypatch.setattr(runtime, "_tokenizers", {})
    monkeypatch.setattr(runtime, "_context", {})
    try:
        counter = TokenCounter(["counted", "sized"])
        for i, model in enumerate(("counted", "sized")):
            line = json.dumps({"custom_id": model, "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": model, "max_tokens": 10,
                                        "messages": [{"role": "user", "content": "word " * 40}]}})  # fmt: skip
            raw = RawLine(i + 1, 0, len(line) + 1, line.encode())
            req = parse_request(raw, endpoint="/v1/chat/completions", served_models=None)
            assert counter(req) == counter.last_prompt + 10
            assert counter.last_ids is None
            if model == "sized":
                assert counter.last_prompt == 50  # 200 bytes at 4 bytes a token
        assert runtime.tokenizer("sized") is None
        assert runtime.tokenizer("counted") is not None
        assert runtime.context_length("sized") == 4096
    finally:
        get_settings.cache_clear()


def test_the_engine_stats_of_a_process_answer_its_dispatchers_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``worker.infra.runtime`` stands below the upstream room and does not import it at module
    level: ``engine_stats`` tells a dispatcher among the loaded hosts by its ``snapshot``, as
    the metrics exporter does, and answers it without touching the engine's host classes."""
    from worker.infra import runtime

    spec = upstream_spec("upstream:http://127.0.0.1:9/v1?max_concurrency=3", "m")
    dispatcher = Dispatcher("m", spec, shared=False)
    monkeypatch.setattr(runtime, "_hosts", {"m": dispatcher})
    stats = runtime.engine_stats_snapshot()
    assert stats == {"m": runtime._json_safe(dispatcher.snapshot())}
    assert stats["m"]["kind"] == "upstream" and stats["m"]["pending"] == 0


def test_usage_is_read_in_the_servers_terms() -> None:
    from worker.upstream.handler import reply_usage

    vllm = {"usage": {"prompt_tokens": 40, "completion_tokens": 7,
                      "prompt_tokens_details": {"cached_tokens": 32}}}  # fmt: skip
    usage = reply_usage(vllm)
    assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (40, 32, 7)
    responses = reply_usage({"usage": {"input_tokens": 9, "output_tokens": 3}})
    assert (responses.prompt_tokens, responses.completion_tokens) == (9, 3)
    assert reply_usage({"data": []}).completion_tokens == 0  # embeddings without usage
