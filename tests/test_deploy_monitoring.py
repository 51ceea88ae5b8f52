"""The Grafana dashboard and the Prometheus alert rules in deploy/ name only metrics batchd
exports: every ``batchd_*`` series in their expressions is one the API, the database gauges
or the engine collector produce, under its exposition name (``_total`` for counters,
``_bucket``/``_sum``/``_count`` for histograms)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY, CollectorRegistry

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "batchd.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
METRIC = re.compile(r"\b(batchd_[a-z0-9_]+)\b")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _exposed(registry: CollectorRegistry) -> set[str]:
    names = set()
    for family in registry.collect():
        for suffix in SUFFIXES.get(family.type, ("",)):
            names.add(family.name + suffix)
    return names


def _expressions() -> dict[str, str]:
    dashboard = json.loads(DASHBOARD.read_text())
    found = {
        f"dashboard: {panel['title']}": target["expr"]
        for panel in dashboard["panels"]
        for target in panel["targets"]
    }
    rules = yaml.safe_load(ALERTS.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            found[f"alert: {rule['alert']}"] = rule["expr"]
    return found


@pytest.mark.services
def test_every_metric_the_dashboard_and_alerts_name_is_exported(pg_url: str) -> None:
    from api.app import create_app
    from core.observability.metrics import ServiceCollector
    from core.settings import Settings
    from worker.infra.exporter import EngineCollector

    create_app(Settings(database_url="sqlite://"))  # registers the API's HTTP metrics
    exported = _exposed(REGISTRY)
    for collector in (ServiceCollector(pg_url, ["demo"]), EngineCollector(lambda: {})):
        registry = CollectorRegistry()
        registry.register(collector)
        exported |= _exposed(registry)

    assert "batchd_requests_failed_total" in exported  # the check can tell a typo apart
    assert "batchd_requets_failed_total" not in exported
    expressions = _expressions()
    assert len(expressions) >= 20
    named = {(where, m) for where, expr in expressions.items() for m in METRIC.findall(expr)}
    unknown = sorted((where, m) for where, m in named if m not in exported)
    assert unknown == [], unknown
    # What operators asked to see: queue depth, at-risk batches, engine occupancy, KV use,
    # error rates, worker liveness.
    used = {m for _, m in named}
    for wanted in (
        "batchd_pending_tokens",
        "batchd_batches_at_risk",
        "batchd_engine_num_requests_running",
        "batchd_engine_kv_cache_usage_perc",
        "batchd_requests_failed_total",
        "batchd_engine_up",
    ):
        assert wanted in used, wanted
