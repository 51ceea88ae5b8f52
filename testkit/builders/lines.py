"""Request lines of a batch input file."""

from __future__ import annotations

import json
from typing import Any

MODEL = "batchd-demo"
CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"


def request_line(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def chat_line(
    custom_id: str, text: str, max_tokens: int = 8, *, model: str = MODEL, **body: Any
) -> dict[str, Any]:
    """A greedy chat request of one user message."""
    return request_line(
        custom_id,
        CHAT_URL,
        {
            "model": model,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "temperature": 0,
            **body,
        },
    )


def completion_line(
    custom_id: str, prompt: Any, max_tokens: int = 8, *, model: str = MODEL, **body: Any
) -> dict[str, Any]:
    """A greedy completions request."""
    return request_line(
        custom_id,
        COMPLETIONS_URL,
        {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **body},
    )


def interleaved_templates(
    count: int, templates: int, *, seed: int, max_tokens_cycle: int
) -> list[dict[str, Any]]:
    """``count`` greedy chat lines whose system prompts are ``templates`` long few-shot blocks
    (120 words each) taken in turn, as an evaluation file interleaves its tasks; line ``i``
    asks for ``1 + i % max_tokens_cycle`` tokens."""
    import random

    words = "the batch model token prompt cache block worker queue shard answer question".split()
    rng = random.Random(seed)
    blocks = [
        f"task {t}: " + " ".join(rng.choice(words) for _ in range(120)) for t in range(templates)
    ]
    return [
        chat_line(
            f"q{i}",
            f"question {i}",
            1 + i % max_tokens_cycle,
            messages=[
                {"role": "system", "content": blocks[i % templates]},
                {"role": "user", "content": f"question {i}"},
            ],
        )
        for i in range(count)
    ]


def jsonl(lines: list[Any]) -> bytes:
    """A JSONL file: dicts as JSON, strings as they are (a broken line on purpose)."""
    return b"".join((x if isinstance(x, str) else json.dumps(x)).encode() + b"\n" for x in lines)


def create_batch(client: Any, data: bytes, endpoint: str = CHAT_URL, name: str = "in.jsonl") -> str:
    """Upload ``data`` through ``client`` (an HTTP client on the service's root) and create a
    24h batch of it; each answer must be 200. Returns the batch id."""
    uploaded = client.post("/v1/files", data={"purpose": "batch"}, files={"file": (name, data)})
    assert uploaded.status_code == 200, uploaded.text
    created = client.post(
        "/v1/batches",
        json={
            "input_file_id": uploaded.json()["id"],
            "endpoint": endpoint,
            "completion_window": "24h",
        },
    )
    assert created.status_code == 200, created.text
    return created.json()["id"]
