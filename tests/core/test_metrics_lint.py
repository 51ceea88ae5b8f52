"""The metric name and label lint (testkit/metrics/metrics_lint.py) over every metric batchd defines:
the service's counters and histograms, the API's HTTP metrics, the database gauges and the
engine collector, each collected for real."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from testkit.metrics.metrics_lint import problems, sample_problems
from testkit.metrics.scrape import parse


def _families(registry: CollectorRegistry) -> list[tuple[str, list[str]]]:
    out = []
    for family in registry.collect():
        if not family.name.startswith("batchd_"):
            continue
        labels: set[str] = set()
        for sample in family.samples:
            labels.update(k for k in sample.labels if k != "le")
        out.append((family.name, sorted(labels)))
    return out


def test_lint_catches_unbounded_labels() -> None:
    assert problems([("batchd_requests", ["request_id"])])
    assert problems([("BatchRequests", [])])
    bad = parse('batchd_x_total{tenant="batch_0123456789abcdef"} 1\n')
    assert sample_problems(bad)
    assert sample_problems(parse('batchd_x_total{reason="anything"} 1\n'))
    assert not sample_problems(parse('batchd_x_total{reason="rate_limited"} 1\n'))


def test_service_and_api_metrics_pass_the_lint() -> None:
    import core.observability.metrics as m
    from api.app import create_app
    from core.settings import Settings

    # Touch every labelled series once, with the values the code uses.
    m.REJECTIONS.labels(reason="token_limit_exceeded").inc(0)
    m.WEBHOOK_DELIVERIES.labels(outcome="delivered").inc(0)
    m.FINALIZE_DURATION.labels(outcome="completed").observe(0)
    m.SHARD_QUEUE_WAIT.labels(model="demo").observe(0)
    m.SHARDS_RECLAIMED.labels(model="demo").inc(0)
    m.ENGINE_LOADS.labels(model="demo").inc(0)
    for counter in (m.REQUESTS_COMPLETED, m.REQUESTS_FAILED, m.PROMPT_TOKENS):
        counter.labels(model="demo", tenant="acme").inc(0)
    create_app(Settings(database_url="sqlite://"))  # registers the HTTP metrics
    found = _families(REGISTRY)
    names = {name for name, _ in found}
    assert {"batchd_requests_completed", "batchd_http_requests", "batchd_rejections"} <= names
    assert problems(found) == []
    assert sample_problems(parse(generate_latest(REGISTRY).decode())) == []


@pytest.mark.services
def test_database_gauges_pass_the_lint(pg_url: str) -> None:
    from core.observability.metrics import ServiceCollector

    registry = CollectorRegistry()
    registry.register(ServiceCollector(pg_url, ["demo"]))
    found = _families(registry)
    assert {"batchd_pending_tokens", "batchd_batches", "batchd_database_up"} <= {
        n for n, _ in found
    }
    assert problems(found) == []
    samples = parse(generate_latest(registry).decode())
    assert samples[("batchd_database_up", frozenset())] == 1
    assert sample_problems(samples) == []


def test_engine_collector_passes_the_lint() -> None:
    from core.llms.demo import build
    from engine import Engine, EngineHost, SamplingParams
    from worker.infra.exporter import EngineCollector

    host = EngineHost(Engine(str(build("llama-tiny")), device="cpu", dtype="float32")).start()
    try:
        futures = [
            host.submit([5, 6, 7 + i], SamplingParams(max_tokens=3, ignore_eos=True))
            for i in range(3)
        ]
        for f in futures:
            f.result(60)
        registry = CollectorRegistry()
        registry.register(EngineCollector(lambda: {"demo": host}))
        found = _families(registry)
        assert problems(found) == []
        samples = parse(generate_latest(registry).decode())
        assert sample_problems(samples) == []
        key = ("batchd_engine_time_to_first_token_seconds_count", frozenset({("model", "demo")}))
        assert samples[key] == 3
        key = ("batchd_engine_generation_tokens_total", frozenset({("model", "demo")}))
        assert samples[key] == 9
    finally:
        host.shutdown()
