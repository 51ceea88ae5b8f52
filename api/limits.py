"""Backpressure at the door: token buckets per API key (and per sign-in address), and limits.

The buckets live in Redis when the broker is Redis, so every API process draws from the same
ones; otherwise in this process. If Redis stops answering, in-process buckets take over for a
while: rate limiting must never be the reason the API is down.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from typing import Protocol

from core.settings import Settings

log = logging.getLogger("batchd.api")

REDIS_KEY_PREFIX = "batchd:ratelimit:"
#: After a Redis error, use in-process buckets for this long before trying Redis again.
REDIS_RETRY_AFTER_S = 5.0
#: In-process buckets kept at most (least recently used dropped first): bounded memory.
MAX_LOCAL_BUCKETS = 10_000


def auth_enabled(settings: Settings) -> bool:
    """Auth is on unless ``BATCHD_AUTH=off`` says otherwise (see :mod:`api.local`)."""
    return settings.auth.strip().lower() not in {"off", "false", "0", "no", "disabled"}


def rate_limit_per_minute(settings: Settings) -> int:
    return int(settings.rate_limit_per_minute)


def max_unfinished_batches(settings: Settings) -> int:
    return int(settings.max_unfinished_batches_per_tenant)


class Buckets(Protocol):
    def take(self, bucket: str, per_minute: int) -> float:
        """Take one token; 0 when granted, else the seconds until one is available."""


class LocalBuckets:
    """Token buckets in this process: capacity ``per_minute``, refilled at ``per_minute/60``/s."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, bucket: str, per_minute: int) -> float:
        rate = per_minute / 60.0
        now = time.monotonic()
        with self._lock:
            tokens, updated = self._state.pop(bucket, (float(per_minute), now))
            tokens = min(float(per_minute), tokens + (now - updated) * rate)
            wait = 0.0
            if tokens >= 1.0:
                tokens -= 1.0
            else:
                wait = (1.0 - tokens) / rate
            self._state[bucket] = (tokens, now)
            while len(self._state) > MAX_LOCAL_BUCKETS:
                self._state.popitem(last=False)
        return wait


# One atomic step of the bucket, timed by the Redis server's clock so API hosts need not agree.
_TAKE_SCRIPT = """
local capacity = tonumber(ARGV[1])
local per_ms = capacity / 60000
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1]) or capacity
local ts = tonumber(state[2]) or now
tokens = math.min(capacity, tokens + math.max(0, now - ts) * per_ms)
local wait = 0
if tokens >= 1 then
  tokens = tokens - 1
else
  wait = math.ceil((1 - tokens) / per_ms)
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], 61000)
return wait
"""


class RedisBuckets:
    """Token buckets shared by every API process through one Redis."""

    def __init__(self, url: str) -> None:
        import redis

        self._client = redis.Redis.from_url(
            url, socket_connect_timeout=0.5, socket_timeout=0.5, health_check_interval=30
        )
        self._script = self._client.register_script(_TAKE_SCRIPT)
        self._fallback = LocalBuckets()
        self._down_until = 0.0

    def take(self, bucket: str, per_minute: int) -> float:
        if time.monotonic() >= self._down_until:
            try:
                wait_ms = self._script(keys=[REDIS_KEY_PREFIX + bucket], args=[per_minute])
                return int(wait_ms) / 1000.0
            except Exception as error:  # any Redis failure: keep serving from local buckets
                log.warning("rate limiter: Redis unavailable (%s); using in-process buckets", error)
                self._down_until = time.monotonic() + REDIS_RETRY_AFTER_S
        return self._fallback.take(bucket, per_minute)


def open_buckets(broker_url: str) -> Buckets:
    if broker_url.startswith(("redis://", "rediss://")):
        return RedisBuckets(broker_url)
    return LocalBuckets()


def retry_after_header(wait_s: float) -> str:
    return str(max(1, math.ceil(wait_s)))
