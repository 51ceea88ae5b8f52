"""``GET /metrics``: the API's Prometheus metrics (HTTP, refusals, uploads, service gauges).

Invariants: the database gauges (``core.observability.metrics.ServiceCollector``) are read at most
once per ``metrics_cache_s`` whatever the scrape rate; several API processes share counters through
prometheus-client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, one empty directory per
deployment), so any process answers with their sum; with ``BATCHD_METRICS_TOKEN`` set a scrape
must send it as a bearer token (401 otherwise), without it the route is open; the HTTP
metrics' labels take a bounded set of values (handlers are route templates or "none", methods
the standard ones or "other"), whatever clients send.
"""

from __future__ import annotations

import hmac
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    generate_latest,
    multiprocess,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_fastapi_instrumentator import Instrumentator
from prometheus_fastapi_instrumentator import metrics as http_metrics

from api.errors import APIError
from core.observability import metrics
from core.settings import Settings

NAMESPACE = "batchd"
#: The methods the HTTP metrics name; any other is counted as "other". A client may send any
#: token as a method, and each distinct label value is a new time series held for good.
STANDARD_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})


def method_label(method: str) -> str:
    """The ``method`` label of a request sent with ``method``: bounded to
    :data:`STANDARD_METHODS` and "other"."""
    return method if method in STANDARD_METHODS else "other"


def _bound_method(info: Any) -> None:
    # Runs before the metrics that read it (instrumentations run in the order added).
    info.method = method_label(info.method)


def _count_rejections(info: Any) -> None:
    response = getattr(info, "response", None)
    status = getattr(response, "status_code", None)
    reason = metrics.REJECTION_REASONS.get(status) if isinstance(status, int) else None
    if reason is not None:
        metrics.REJECTIONS.labels(reason=reason).inc()


class CachedCollector:
    """``collector``'s metrics, collected again only when the last collection is
    ``max_age_s`` old or older; concurrent scrapes of a stale reading collect once."""

    def __init__(self, collector: Collector, max_age_s: float) -> None:
        self.collector = collector
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._families: list[Metric] | None = None
        self._collected_at = 0.0

    def describe(self) -> Iterable[Metric]:
        return ()  # registering must not read the database

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            current = time.monotonic()
            if self._families is None or current - self._collected_at >= self.max_age_s:
                self._families = list(self.collector.collect())
                self._collected_at = current
            return list(self._families)


def _check_token(request: Request, token: str) -> None:
    scheme, _, presented = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        presented.strip().encode("utf-8", "surrogateescape"), token.encode("utf-8")
    ):
        raise APIError(
            401,
            "The metrics need a bearer token (BATCHD_METRICS_TOKEN): "
            "send Authorization: Bearer <token>.",
            code="invalid_metrics_token",
            headers={"WWW-Authenticate": "Bearer"},
        )


def counted_registry() -> CollectorRegistry:
    """What the API counts: this process's registry, or in multiprocess mode
    (``PROMETHEUS_MULTIPROC_DIR``) the sum of every API process's files."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return REGISTRY
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return registry


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
        _bound_method,
        http_metrics.requests(metric_namespace=NAMESPACE),
        http_metrics.latency(metric_namespace=NAMESPACE),
        _count_rejections,
    )
    instrumentator.instrument(app)
    service = CollectorRegistry(auto_describe=True)
    gauges = metrics.ServiceCollector(settings.database_url, list(settings.models))
    service.register(CachedCollector(gauges, settings.metrics_cache_s))
    token = settings.metrics_token.strip()
    counted = counted_registry()

    @app.get("/metrics", include_in_schema=False)
    def prometheus_metrics(request: Request) -> Response:
        if token:
            _check_token(request, token)
        # What the API processes counted, then this app's database gauges (distinct names).
        body = generate_latest(counted) + generate_latest(service)
        return Response(body, media_type=CONTENT_TYPE_LATEST)
