"""``GET /metrics``: the API's Prometheus metrics.

HTTP requests by route template, method and status, and their latency
(prometheus-fastapi-instrumentator, ``batchd_http_*``); refusals by reason
(``batchd_rejections_total``); upload bytes; and the service gauges read from the database at
each scrape (``core.metrics.ServiceCollector``: batches by status, shards by model and status,
each model's pending work). The route is unauthenticated, as exporters are: keep it on the
internal network that Prometheus scrapes from.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_fastapi_instrumentator import Instrumentator
from prometheus_fastapi_instrumentator import metrics as http_metrics

from core import metrics
from core.settings import Settings

NAMESPACE = "batchd"


def _count_rejections(info: Any) -> None:
    response = getattr(info, "response", None)
    status = getattr(response, "status_code", None)
    reason = metrics.REJECTION_REASONS.get(status)
    if reason is not None:
        metrics.REJECTIONS.labels(reason=reason).inc()


def install(app: FastAPI, settings: Settings) -> None:
    if not settings.metrics_enabled:
        return
    instrumentator = Instrumentator(
        should_group_status_codes=False,  # 401, 404, 413 and 429 apart, not "4xx"
        should_ignore_untemplated=False,
        should_group_untemplated=True,  # unknown paths share one "none" handler label
        excluded_handlers=["/metrics"],
    )
    instrumentator.add(
        http_metrics.requests(metric_namespace=NAMESPACE),
        http_metrics.latency(metric_namespace=NAMESPACE),
        _count_rejections,
    )
    instrumentator.instrument(app)
    service = CollectorRegistry(auto_describe=True)
    service.register(metrics.ServiceCollector(settings.database_url, list(settings.models)))

    @app.get("/metrics", include_in_schema=False)
    def prometheus_metrics() -> Response:
        # Process-wide metrics, then this app's database gauges (distinct names).
        body = generate_latest(REGISTRY) + generate_latest(service)
        return Response(body, media_type=CONTENT_TYPE_LATEST)
