"""``NaN``, ``Infinity`` or ``1e999`` in a Messages request (which Python's JSON parser reads as
floats) make that request an ``errored`` result naming the field, as any other invalid param
does; the create answers 200 and the other requests run (no worker runs here)."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from testkit.builders.lines import MODEL
from tests.api.conftest import Server

pytestmark = pytest.mark.services

HEADERS = {"anthropic-version": "2023-06-01", "content-type": "application/json"}


def _request(custom_id: str, extra: str = "") -> str:
    return (
        f'{{"custom_id": "{custom_id}", "params": {{"model": "{MODEL}", "max_tokens": 4, '
        f'"messages": [{{"role": "user", "content": "hi"}}]{extra}}}}}'
    )


def test_a_non_finite_number_errors_its_request_not_the_create(
    start_server: Callable[..., Server], make_key: Callable[..., str]
) -> None:
    server = start_server(BATCHD_MODELS=f'{{"{MODEL}": "demo:llama-tiny"}}')
    http = httpx.Client(base_url=server.url, headers={**HEADERS, "x-api-key": make_key()})
    bad = {
        "nan-top-k": ', "top_k": NaN',
        "inf-stop": ', "stop_sequences": ["end", Infinity]',
        "huge-top-k": ', "top_k": 1e999',
        "nan-temperature": ', "temperature": -Infinity',
    }
    body = "[" + ", ".join([_request("ok")] + [_request(k, v) for k, v in bad.items()]) + "]"
    created = http.post("/v1/messages/batches", content=f'{{"requests": {body}}}')
    assert created.status_code == 200, created.text
    counts = created.json()["request_counts"]
    assert (counts["processing"], counts["errored"]) == (1, 4)

    # every request errored: the batch ends at once and its results name each field
    body = "[" + ", ".join(_request(k, v) for k, v in bad.items()) + "]"
    ended = http.post("/v1/messages/batches", content=f'{{"requests": {body}}}')
    assert ended.status_code == 200, ended.text
    assert ended.json()["processing_status"] == "ended"
    results = http.get(f"/v1/messages/batches/{ended.json()['id']}/results")
    assert results.status_code == 200, results.text
    by_id = {r["custom_id"]: r["result"] for r in map(json.loads, results.text.splitlines())}
    fields = {
        "nan-top-k": "params.top_k: NaN",
        "inf-stop": "params.stop_sequences[1]: Infinity",
        "huge-top-k": "params.top_k: Infinity",
        "nan-temperature": "params.temperature: -Infinity",
    }
    for custom_id, start in fields.items():
        result = by_id[custom_id]
        assert result["type"] == "errored"
        assert result["error"]["error"]["type"] == "invalid_request_error"
        assert result["error"]["error"]["message"].startswith(start), result
