"""OpenTelemetry traces, for real: with ``OTEL_EXPORTER_OTLP_ENDPOINT`` pointing at a loopback
OTLP/HTTP receiver, the API and a control worker export their spans; a batch's create call,
the validation task it enqueued and their SQL statements are one trace, and the API's span
carries the call's ``x-request-id``. Without the variable no exporter or instrumentation loads."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from cli.perf.service import free_port, wait_for
from core.observability.tracing import REQUEST_ID_ATTRIBUTE
from testkit.builders.lines import chat_line, create_batch
from testkit.service.stack import API_KEY, Procs, api_command, celery_command, stack_env


class _Receiver(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        body = self.rfile.read(int(self.headers["content-length"]))
        request = ExportTraceServiceRequest.FromString(body)
        server: Any = self.server
        for resource_spans in request.resource_spans:
            service = next(
                a.value.string_value
                for a in resource_spans.resource.attributes
                if a.key == "service.name"
            )
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    attributes = {a.key: a.value.string_value for a in span.attributes}
                    with server.lock:
                        server.spans.append((service, span.name, span.trace_id, attributes))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[Any]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    server.lock, server.spans = threading.Lock(), []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


@pytest.mark.services
@pytest.mark.slow
def test_a_call_and_the_task_it_causes_are_one_trace(
    pg_url: str, private_broker: str, tmp_path: Any, procs: Procs, receiver: Any
) -> None:
    import httpx

    port = free_port()
    env = stack_env(
        pg_url,
        private_broker,
        tmp_path,
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{receiver.server_address[1]}",
        OTEL_BSP_SCHEDULE_DELAY="200",
    )
    procs.start("api", api_command(port), env)
    procs.start("control", celery_command("control", "control", tmp_path), env)
    procs.wait_log("control", "ready.", 60)
    client = httpx.Client(
        base_url=f"http://127.0.0.1:{port}",
        headers={"Authorization": f"Bearer {API_KEY}", "x-request-id": "trace-me-1"},
    )
    data = json.dumps(chat_line("only", "hello")).encode() + b"\n"
    batch_id = create_batch(client, data)

    def spans() -> list[tuple[str, str, bytes, dict[str, str]]]:
        with receiver.lock:
            return list(receiver.spans)

    def traced() -> bool:
        return any(s[0] == "batchd-control" and s[1].startswith("run/") for s in spans())

    wait_for(traced, 60, "the control worker's task span", procs.logs)
    seen = spans()
    create = [s for s in seen if s[0] == "batchd-api" and s[3].get(REQUEST_ID_ATTRIBUTE)
              == "trace-me-1" and "batches" in s[1]]  # fmt: skip
    assert create, [s[:2] for s in seen]
    trace_id = create[0][2]
    same_trace = {(s[0], s[1]) for s in seen if s[2] == trace_id}
    assert any(svc == "batchd-control" and name.startswith("run/") for svc, name in same_trace)
    assert any(svc == "batchd-api" and name.startswith("apply_async/") for svc, name in same_trace)
    assert any(svc == "batchd-api" and name.split()[0] in ("INSERT", "SELECT")
               for svc, name in same_trace), same_trace  # fmt: skip
    assert client.get(f"/v1/batches/{batch_id}").status_code == 200


def test_without_an_endpoint_no_exporter_or_instrumentation_loads() -> None:
    # (FastAPI imports OpenTelemetry's API when it is installed: a no-op tracer.)
    code = (
        "import sys; from core.observability import tracing; "
        "assert not tracing.setup('api'); "
        "from api.app import create_app; create_app(); "
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', "
        "'opentelemetry.exporter', 'opentelemetry.instrumentation'))))"
    )
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True, timeout=120)  # fmt: skip
    assert out.stdout.strip() == "[]", out.stdout
