"""Waiting estimates hold none of the threads other calls run on: with more estimates waiting
for a control worker than the server has pool threads (40), another call still answers at
once. (No control worker runs here, so every estimate waits out ``estimate_timeout_s``.)"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import httpx
import pytest

from tests.api.conftest import Server

pytestmark = pytest.mark.services

TENANTS = 22  # two estimates each (max_estimates_per_tenant): 44 waiting, over the pool's 40


def test_waiting_estimates_leave_the_pool_to_other_calls(
    start_server: Callable[..., Server], make_key: Callable[..., str]
) -> None:
    server = start_server(BATCHD_ESTIMATE_TIMEOUT_S="60")
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "llama-tiny", "messages": [{"role": "user", "content": "hi"}]}}  # fmt: skip
    asks = []
    for _ in range(TENANTS):
        key = make_key()
        with server.http(key) as http:
            uploaded = http.post("/v1/files", data={"purpose": "batch"},
                                 files={"file": ("in.jsonl", json.dumps(line).encode())})  # fmt: skip
            assert uploaded.status_code == 200, uploaded.text
        body = {"input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions",
                "completion_window": "24h"}  # fmt: skip
        asks += [(key, body), (key, body)]

    async def run() -> tuple[float, int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            waiting = [
                asyncio.create_task(http.post("/v1/batches/estimate", json=body,
                                              headers={"authorization": f"Bearer {key}"}))
                for key, body in asks
            ]  # fmt: skip
            await asyncio.sleep(3)  # every estimate sent and waiting for a scan
            started = time.monotonic()
            models = await http.get("/v1/models", headers={"authorization": f"Bearer {asks[0][0]}"})
            took = time.monotonic() - started
            unanswered = sum(not task.done() for task in waiting)
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
            assert models.status_code == 200, models.text
            return took, unanswered

    took, unanswered = asyncio.run(run())
    # The models call answered while every estimate was still waiting (each waits 60 s).
    assert unanswered == len(asks), (took, unanswered)
