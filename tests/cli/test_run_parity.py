"""``batchd run`` and the service agree: the same batch file, run through the whole service (API,
control and model workers on Postgres and Redis) and through the offline runner with the same
model directory and engine options, gives the same results line for line — message content and
text, finish reasons, token counts, and the same error lines. Only ids, timestamps and prefix
cache hits (which depend on what else shared the engine) may differ."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from cli.run import RunOptions, run_batch_file
from tests.e2e.conftest import MODEL, stack  # noqa: F401  (the e2e service fixture)

pytestmark = [pytest.mark.services, pytest.mark.slow]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TERMINAL = {"completed", "failed", "expired", "cancelled"}


def line(custom_id: str, url: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": MODEL, **body}}


def chat(custom_id: str, text: str, **body: Any) -> dict[str, Any]:
    return line(custom_id, CHAT, messages=[{"role": "user", "content": text}], **body)


def chat_rows() -> list[dict[str, Any]]:
    conversation = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "name a river"},
        {"role": "assistant", "content": "the nile"},
        {"role": "user", "content": "another one"},
    ]
    return [
        chat("greedy-0", "hello there", max_tokens=8, temperature=0),
        chat("sampled-0", "tell me a story", max_tokens=12, temperature=0.9, seed=7),
        line("conversation", CHAT, messages=conversation, max_tokens=6, temperature=0),
        chat("sampled-n", "pick a colour", max_tokens=6, temperature=1.2, top_p=0.9, seed=11, n=2),
        chat("too-long", "hi " * 3000, max_tokens=4),  # longer than the model's context
        chat("greedy-stop", "count with me", max_tokens=16, temperature=0, stop=["e"]),
        chat("sampled-topk", "a word please", max_tokens=10, temperature=0.7, top_k=5, seed=3),
        chat("greedy-long", "write a long answer", max_tokens=40, temperature=0, ignore_eos=True),
        chat("penalties", "repeat after me", max_tokens=10, temperature=0.8, seed=5,
             presence_penalty=0.5, frequency_penalty=0.5),
    ]  # fmt: skip


def completion_rows() -> list[dict[str, Any]]:
    return [
        line("c-greedy", COMPLETIONS, prompt="the quick brown fox", max_tokens=8, temperature=0),
        line("c-sampled", COMPLETIONS, prompt="once upon a time", max_tokens=10,
             temperature=1.0, seed=42),
        line("c-default-max", COMPLETIONS, prompt="the river", temperature=0),  # 16 by default
        line("c-tokens", COMPLETIONS, prompt=[5, 6, 7, 8], max_tokens=5, temperature=0),
        line("c-too-long", COMPLETIONS, prompt="hi " * 3000, max_tokens=4),
        # Error cases where the two paths once drifted: a token outside the vocabulary, a
        # max_tokens of the whole context, an empty token prompt after validation's checks.
        line("c-bad-token", COMPLETIONS, prompt=[5, 10**9], max_tokens=4),
        line("c-max-context", COMPLETIONS, prompt="hi", max_tokens=10**6),
    ]  # fmt: skip


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def deterministic(record: dict[str, Any]) -> dict[str, Any]:
    """What must agree: everything but ids, timestamps and prefix-cache hits."""
    response = record["response"]
    body = dict(response["body"])
    out: dict[str, Any] = {"custom_id": record["custom_id"], "status_code": response["status_code"]}
    if "error" in body:
        out["error"] = body["error"]
        return out
    usage = body.get("usage") or {}
    out["usage"] = {k: usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    out["object"] = body.get("object")
    out["model"] = body.get("model")
    out["choices"] = [
        {
            "index": c["index"],
            "finish_reason": c["finish_reason"],
            "content": c["message"]["content"] if "message" in c else c["text"],
            "role": c.get("message", {}).get("role"),
        }
        for c in body["choices"]
    ]
    return out


def through_service(stack, rows: list[dict[str, Any]], endpoint: str, path: Path):  # noqa: F811
    client = stack.client
    uploaded = client.files.create(file=write_jsonl(path, rows).open("rb"), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h"
    )
    deadline = time.monotonic() + 240
    while batch.status not in TERMINAL:
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    out = read_jsonl(client.files.content(batch.output_file_id).text)
    err = read_jsonl(client.files.content(batch.error_file_id).text) if batch.error_file_id else []
    return out, err


def through_batchd_run(stack, rows: list[dict[str, Any]], endpoint: str, root: Path):  # noqa: F811
    """``batchd run``'s entry point with the stack's model directory and engine options."""
    from core.llms.demo import build

    root.mkdir()
    engine_options = json.loads(stack.env["BATCHD_ENGINE_OPTIONS"])
    options = RunOptions(
        input=write_jsonl(root / "in.jsonl", rows),
        output=root / "out.jsonl",
        errors=root / "err.jsonl",
        model=str(build(json.loads(stack.env["BATCHD_MODELS"])[MODEL].removeprefix("demo:"))),
        endpoint=endpoint,
        model_name=MODEL,
        engine_config=engine_options,
    )
    summary = run_batch_file(options)
    assert summary.total == len(rows)
    return read_jsonl(options.output.read_text()), read_jsonl(options.errors.read_text())


@pytest.mark.parametrize(
    ("endpoint", "rows"),
    [(CHAT, chat_rows()), (COMPLETIONS, completion_rows())],
    ids=["chat", "completions"],
)
def test_batchd_run_equals_the_service(stack, tmp_path: Path, endpoint, rows) -> None:  # noqa: F811
    service_out, service_err = through_service(stack, rows, endpoint, tmp_path / "service.jsonl")
    run_out, run_err = through_batchd_run(stack, rows, endpoint, tmp_path / "run")

    # Both write results in input order, successes and failures to their own files.
    assert [r["custom_id"] for r in service_out] == [r["custom_id"] for r in run_out]
    assert [r["custom_id"] for r in service_err] == [r["custom_id"] for r in run_err]
    assert len(service_out) + len(service_err) == len(rows)
    assert {r["custom_id"] for r in service_err} == {
        r["custom_id"]
        for r in rows
        if r["custom_id"].endswith(("too-long", "bad-token", "max-context"))
    }
    for service_line, run_line in zip(service_out + service_err, run_out + run_err, strict=True):
        assert deterministic(run_line) == deterministic(service_line), service_line["custom_id"]
    # Something worth comparing was generated: text in every choice, and the two seeded
    # choices of one request differ from each other.
    for record in service_out:
        assert record["response"]["body"]["usage"]["completion_tokens"] > 0, record
    if endpoint == CHAT:
        (sampled_n,) = [r for r in service_out if r["custom_id"] == "sampled-n"]
        first, second = (c["message"]["content"] for c in sampled_n["response"]["body"]["choices"])
        assert first != second


def test_one_glue_for_both_paths() -> None:
    """The worker and `batchd run` call the same functions for a request's engine input and
    its result line; neither keeps a copy of its own."""
    import inspect

    import cli.run.runner
    import worker.shards.handlers

    for module in (worker.shards.handlers, cli.run.runner):
        source = inspect.getsource(module)
        assert "prepare_request(" in source and "finished_record(" in source
        assert "aborted_record(" in source and "is_aborted(" in source
        for copy in ("check_prompt(", "generation_result(", "response_body(", "prompt_token_ids("):
            assert copy not in source, (module.__name__, copy)
