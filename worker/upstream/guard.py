"""Live traffic first: on an upstream shared with interactive users, bulk work is what waits.

For a spec with ``ttft_p99_ms``, :class:`LiveGuard` reads the live traffic's time to first
token every ``INTERVAL_S`` (the server's Prometheus metrics, or a streamed probe) and keeps a
cap on bulk requests in flight: halved under pressure down to none, grown by a quarter after
``CALM_READINGS`` calm readings while the cap is what holds bulk work back. Without bulk work
it neither probes nor moves the cap. The upstream's key goes to its metrics endpoint only when
that has the base URL's origin (:func:`scrape_headers`). Details: ``docs/upstream.md``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from core.llms.specs import UpstreamSpec

logger = logging.getLogger(__name__)

INTERVAL_S = 1.0
PRESSURE = 0.7
RELIEF = 0.5
START_CAP = 1
CALM_READINGS = 3  # readings in a row under RELIEF before the cap grows
MIN_SAMPLES = 10  # histogram samples in an interval before its p99 counts
TTFT_HISTOGRAMS = ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds")
WAITING_GAUGES = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")


#: Request headers that carry a credential: never sent to a metrics endpoint of another origin.
CREDENTIAL_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "x-api-key", "api-key", "cookie"}
)
DEFAULT_PORTS = {"http": 80, "https": 443}


def same_origin(a: str, b: str) -> bool:
    """Whether two URLs have one origin: scheme, host and port (a default port spelled out or
    not); a URL whose port does not parse has none."""

    def origin(url: str) -> tuple[str, str, int | None] | None:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        try:
            port = parts.port or DEFAULT_PORTS.get(scheme)
        except ValueError:
            return None
        return scheme, (parts.hostname or "").lower(), port

    first = origin(a)
    return first is not None and first == origin(b)


def scrape_headers(
    spec: UpstreamSpec, headers: Mapping[str, str], environ: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """The headers of a metrics scrape. ``metrics_url`` may name another host than the
    upstream: its key (``headers``' credentials) goes there only when the metrics URL has the
    base URL's origin. With ``metrics_key_env`` the scrape carries that variable's key as a
    bearer token instead, wherever the endpoint is."""
    if not spec.metrics_key_env and same_origin(spec.scrape_url(), spec.base_url):
        return dict(headers)
    out = {k: v for k, v in headers.items() if k.lower() not in CREDENTIAL_HEADERS}
    key = environ.get(spec.metrics_key_env) if spec.metrics_key_env else None
    if key:
        out["Authorization"] = f"Bearer {key}"
    return out


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of a cumulative histogram ``[(upper bound, count)]`` (the upper
    bound of the bucket it falls in, as a conservative reading); None without samples."""
    if not buckets:
        return None
    buckets = sorted(buckets)
    total = buckets[-1][1]
    if total <= 0:
        return None
    for bound, count in buckets:
        if count >= q * total:
            return bound if math.isfinite(bound) else buckets[-2][0] if len(buckets) > 1 else None
    return None


def read_metrics(text: str) -> tuple[dict[float, float], float | None]:
    """The TTFT histogram's cumulative buckets (summed over label sets) and the requests
    waiting, from a Prometheus exposition; empty/None for what the server does not export."""
    buckets: dict[float, float] = {}
    waiting: float | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name.endswith("_bucket")
                and sample.name[: -len("_bucket")] in TTFT_HISTOGRAMS
            ):
                bound = float(sample.labels.get("le", "inf"))
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
            elif sample.name in WAITING_GAUGES:
                waiting = (waiting or 0.0) + sample.value
    return buckets, waiting


class LiveGuard:
    def __init__(self, spec: UpstreamSpec) -> None:
        self.spec = spec
        self.objective_s = (spec.ttft_p99_ms or 0.0) / 1000.0
        self.cap = min(START_CAP, spec.max_concurrency)
        self.ttft_p99_s: float | None = None
        self.source = "none"  # "metrics" or "probe" once it has read one
        self.cuts = 0
        self._calm = 0  # readings in a row under RELIEF
        self._last_buckets: dict[float, float] | None = None

    def decide(
        self, ttft_p99_s: float | None, waiting: float | None, in_flight: int | None = None
    ) -> int:
        """Move the cap after one interval's reading, with ``in_flight`` bulk requests out
        (None: as many as the cap allows); return it."""
        self.ttft_p99_s = ttft_p99_s
        queued = bool(waiting and waiting > 0)
        binding = in_flight is None or in_flight >= self.cap
        if (ttft_p99_s is not None and ttft_p99_s > PRESSURE * self.objective_s) or queued:
            if self.cap > 0:
                self.cuts += 1
            self.cap //= 2  # from 1 to 0: bulk work pauses
            self._calm = 0
        elif ttft_p99_s is not None and ttft_p99_s < RELIEF * self.objective_s and binding:
            self._calm += 1
            if self._calm >= CALM_READINGS:
                self._calm = 0
                self.cap = min(self.spec.max_concurrency, self.cap + max(1, self.cap // 4))
        else:
            self._calm = 0
        return self.cap

    async def run(
        self,
        client: httpx.AsyncClient,
        headers: dict[str, str],
        load: Callable[[], tuple[int, int]],
    ) -> None:
        """Watch while ``load()`` (bulk requests pending, in flight) says there is bulk work;
        ``headers`` are the upstream's own (its key included)."""
        metrics_headers = scrape_headers(self.spec, headers)
        while True:
            started = time.monotonic()
            if not sum(load()):
                self._last_buckets = None  # an idle stretch is not one interval
                await asyncio.sleep(INTERVAL_S)
                continue
            try:
                reading = await self._scrape(client, metrics_headers)
                if reading is None:
                    reading = await self._probe(client, headers)
                if reading is not None:
                    before = self.cap
                    self.decide(*reading, in_flight=load()[1])
                    if self.cap != before:
                        logger.info(
                            "upstream %s: live traffic TTFT p99 %s, bulk cap %s -> %s",
                            self.spec.base_url,
                            f"{reading[0] * 1000:.0f} ms" if reading[0] is not None else "?",
                            before,
                            self.cap,
                        )
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.warning("live traffic guard of %s failed", self.spec.base_url, exc_info=True)
            await asyncio.sleep(max(0.0, INTERVAL_S - (time.monotonic() - started)))

    async def _scrape(
        self, client: httpx.AsyncClient, headers: dict[str, str]
    ) -> tuple[float | None, float | None] | None:
        if self.source == "probe":
            return None
        try:
            response = await client.get(self.spec.scrape_url(), headers=headers, timeout=5.0)
        except httpx.HTTPError:
            response = None
        if response is None or response.status_code != 200:
            self.source = "probe"
            return None
        buckets, waiting = read_metrics(response.text)
        if not buckets:
            self.source = "probe"
            return None
        self.source = "metrics"
        last, self._last_buckets = self._last_buckets, buckets
        if last is None:
            return None, waiting
        delta = [(bound, count - last.get(bound, 0.0)) for bound, count in buckets.items()]
        total = max((count for _, count in delta), default=0.0)
        p99 = histogram_quantile(0.99, delta) if total >= MIN_SAMPLES else None
        return p99, waiting

    async def _probe(
        self, client: httpx.AsyncClient, headers: dict[str, str]
    ) -> tuple[float | None, None] | None:
        body: dict[str, Any] = {
            "model": self.spec.model,
            "messages": [{"role": "user", "content": "Say OK."}],
            "max_tokens": 1,
            "temperature": 0,
            "stream": True,
        }
        started = time.monotonic()
        ttft: float | None = None
        try:
            async with client.stream(
                "POST",
                self.spec.base_url + "/chat/completions",
                json=body,
                headers=headers,
                timeout=max(5.0, 4 * self.objective_s),
            ) as response:
                if response.status_code != 200:
                    return None
                async for line in response.aiter_lines():
                    if _carries_a_token(line):
                        ttft = time.monotonic() - started
                        break
        except httpx.TimeoutException:
            ttft = time.monotonic() - started
        except httpx.HTTPError:
            return None
        return None if ttft is None else (ttft, None)


def _carries_a_token(line: str) -> bool:
    """Whether a streamed chat chunk's line carries the first generated token. Servers send a
    chunk with the role and empty content as soon as they accept the request (vLLM, SGLang,
    transformers): timing that one would measure the queue of the HTTP server, not of the
    model."""
    data = line.removeprefix("data:").strip()
    if not line.startswith("data:") or data in ("", "[DONE]"):
        return False
    try:
        chunk = json.loads(data)
    except ValueError:
        return True  # not JSON: take it as the answer
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls")):
            return True
        if choice.get("finish_reason"):
            return True
    return False
