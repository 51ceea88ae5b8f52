"""The files the hostile tenant uploads: lines nested deep, amplifying files, estimate files."""

from __future__ import annotations

import json
from typing import Any

from cli.perf.workload import request_line
from testkit.service.soak_stack import CHAT_MODEL

CHAT = "/v1/chat/completions"


def _good(cid: str) -> dict[str, Any]:
    return request_line(
        cid,
        {
            "model": CHAT_MODEL,
            "messages": [{"role": "user", "content": f"say {cid}"}],
            "max_tokens": 6,
            "temperature": 0,
        },
    )


def nested_lines(depth: int) -> list[str]:
    """Lines nested ``depth`` levels deep: an array, an object, and a request line whose body
    (and one whose message content) is nested; none can be read as a request."""
    array = "[" * depth + "]" * depth
    obj = '{"a":' * depth + "1" + "}" * depth
    return [
        array,
        obj,
        json.dumps({"custom_id": "deep-body", "method": "POST", "url": CHAT})[:-1]
        + f', "body": {obj}}}',
        json.dumps({"custom_id": "deep-content", "method": "POST", "url": CHAT})[:-1]
        + f', "body": {{"model": "{CHAT_MODEL}", "messages": {array}}}}}',
    ]


def nested_file(seq: int, depth: int, head: int) -> tuple[bytes, int]:
    """Good lines around nested ones; the nested ones in the head on odd ``seq``, after it
    (past ``head`` good lines) on even. The bytes and the number of lines."""
    good = [json.dumps(_good(f"h{seq}-{i:03d}")) for i in range(head + 4)]
    bad = nested_lines(depth) * 3
    lines = [good[0], *bad, *good[1:]] if seq % 2 else [*good[: head + 1], *bad, *good[head + 1 :]]
    return "".join(x + "\n" for x in lines).encode(), len(lines)


def amplifying_file(seq: int, mib: float, head: int) -> tuple[bytes, int]:
    """``head`` good lines, then ``mib`` MiB of ``a`` lines: a small upload with a million
    lines to answer for. The bytes and the number of lines."""
    good = "".join(json.dumps(_good(f"a{seq}-{i:03d}")) + "\n" for i in range(head)).encode()
    tiny = int(mib * 1024 * 1024) // 2
    return good + b"a\n" * tiny, head + tiny


def estimate_file(lines: int) -> bytes:
    return "".join(json.dumps(_good(f"e-{i:06d}")) + "\n" for i in range(lines)).encode()
