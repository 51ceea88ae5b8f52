"""The live-traffic guard's scrape of ``metrics_url``, which may be another host than the
upstream: the upstream's key goes only to a metrics URL of the base URL's origin (scheme, host,
port), or the key of ``metrics_key_env`` wherever it is; checked on the header choice alone and
against two loopback servers of different origins (127.0.0.1 and 127.0.0.2)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from core.llms.specs import upstream_spec
from worker.upstream.guard import same_origin, scrape_headers


def test_origins() -> None:
    assert same_origin("http://gpu-1:8000/v1", "http://gpu-1:8000/metrics")
    assert same_origin("https://GPU-1/v1", "https://gpu-1:443/metrics")
    assert same_origin("http://h/v1", "http://h:80/metrics")
    assert not same_origin("http://gpu-1:8000/v1", "http://gpu-1:9090/metrics")
    assert not same_origin("http://gpu-1:8000/v1", "https://gpu-1:8000/metrics")
    assert not same_origin("http://127.0.0.1:8000/v1", "http://127.0.0.2:8000/metrics")
    assert not same_origin("http://h:8000/v1", "http://h:8000@evil:8000/metrics")
    assert not same_origin("http://h:bad/v1", "http://h:bad/metrics")


def test_the_key_goes_only_to_a_metrics_url_of_the_upstreams_origin() -> None:
    headers = {"Authorization": "Bearer upstream-key", "X-Api-Key": "k", "User-Agent": "batchd"}

    def scrape(query: str, env: dict[str, str] | None = None) -> dict[str, str]:
        spec = upstream_spec(f"upstream:http://127.0.0.1:8000/v1?ttft_p99_ms=500{query}", "m")
        return scrape_headers(spec, headers, env or {})

    assert scrape("") == headers  # /metrics beside the base URL
    assert scrape("&metrics_url=http://127.0.0.1:8000/metrics") == headers
    for other in ("http://127.0.0.2:8000/metrics", "http://127.0.0.1:9090/metrics",
                  "https://127.0.0.1:8000/metrics", "http://prometheus.example/api"):  # fmt: skip
        assert scrape(f"&metrics_url={other}") == {"User-Agent": "batchd"}, other
    # a key of its own for the metrics endpoint, wherever it is
    own = "&metrics_url=http://127.0.0.2:8000/metrics&metrics_key_env=METRICS_KEY"
    assert scrape(own, {"METRICS_KEY": "metrics-key"}) == {
        "User-Agent": "batchd",
        "Authorization": "Bearer metrics-key",
    }
    assert scrape(own, {}) == {"User-Agent": "batchd"}  # the variable unset: no key at all
    assert scrape("&metrics_key_env=METRICS_KEY", {"METRICS_KEY": "mk"})["Authorization"] == (
        "Bearer mk"
    )


VLLM_METRICS = """\
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1"} 1.0
vllm:time_to_first_token_seconds_bucket{le="+Inf"} 1.0
vllm:time_to_first_token_seconds_count 1.0
vllm:time_to_first_token_seconds_sum 0.05
"""


class Recorder(BaseHTTPRequestHandler):
    """An upstream on loopback: chat answers (after ``delay``) and ``/metrics``; it records
    the Authorization header of each request by path."""

    def _record(self) -> None:
        server: Any = self.server
        with server.lock:
            server.auth.append((self.path, self.headers.get("authorization")))

    def do_GET(self) -> None:
        self._record()
        self._answer(VLLM_METRICS.encode(), "text/plain")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        self._record()
        server: Any = self.server
        time.sleep(server.delay)
        answer = {"choices": [{"message": {"content": "ok"}}], "usage": {"completion_tokens": 1}}
        self._answer(json.dumps(answer).encode(), "application/json")

    def _answer(self, data: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def _recorder(host: str) -> Any:
    server: Any = ThreadingHTTPServer((host, 0), Recorder)
    server.lock, server.auth, server.delay = threading.Lock(), [], 2.0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def two_origins() -> Iterator[tuple[Any, Any]]:
    upstream, elsewhere = _recorder("127.0.0.1"), _recorder("127.0.0.2")
    yield upstream, elsewhere
    upstream.shutdown()
    elsewhere.shutdown()


def _guarded_run(upstream: Any, options: str) -> None:
    """One bulk request through a guarded dispatcher, out long enough for a guard reading."""
    from worker.upstream.dispatcher import Dispatcher

    base = f"http://127.0.0.1:{upstream.server_address[1]}/v1"
    spec = upstream_spec(f"upstream:{base}?key_env=UPSTREAM_KEY&ttft_p99_ms=500{options}", "m")
    dispatcher = Dispatcher("m", spec, shared=False).start()
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        assert dispatcher.submit("/chat/completions", body, group="g").result(30).status == 200
    finally:
        dispatcher.shutdown()


def test_the_guard_sends_the_key_to_its_own_origin_only(
    two_origins: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    upstream, elsewhere = two_origins
    monkeypatch.setenv("UPSTREAM_KEY", "upstream-key")
    monkeypatch.setenv("METRICS_KEY", "metrics-key")
    other = f"http://127.0.0.2:{elsewhere.server_address[1]}/metrics"

    _guarded_run(upstream, f"&metrics_url={other}")
    assert ("/v1/chat/completions", "Bearer upstream-key") in upstream.auth
    assert elsewhere.auth and all(auth is None for _, auth in elsewhere.auth), elsewhere.auth

    elsewhere.auth.clear()
    _guarded_run(upstream, f"&metrics_url={other}&metrics_key_env=METRICS_KEY")
    assert elsewhere.auth and all(a == "Bearer metrics-key" for _, a in elsewhere.auth)

    upstream.auth.clear()
    _guarded_run(upstream, "")  # /metrics beside the base URL: one origin, one key
    scrapes = [auth for path, auth in upstream.auth if path == "/metrics"]
    assert scrapes and all(auth == "Bearer upstream-key" for auth in scrapes)
