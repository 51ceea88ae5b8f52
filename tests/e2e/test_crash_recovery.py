"""Crashes: a model worker SIGKILLed at seeded random moments of a multi-shard job, and the
API SIGKILLed in the middle of an upload. Real subprocesses on Postgres, a private Redis and
a local storage directory."""

from __future__ import annotations

import json
import random
import socket
import time
from collections import Counter
from pathlib import Path

import pytest

from cli.perf.service import free_port, wait_for
from testkit.builders.lines import MODEL
from testkit.builders.worker import (
    batch_row,
    chat_line,
    enqueued_batch,
    read_file_lines,
    shard_rows,
    use_service_env,
)
from testkit.engine_gate import AFTER_ENV as GATE_AFTER
from testkit.engine_gate import MODEL_WORKER_GATE
from testkit.service.stack import API_KEY, Procs, api_command, celery_command, stack_env

pytestmark = [pytest.mark.services, pytest.mark.slow]

SEED = 20261129


MAX_TOKENS = 64
# Each killed worker finishes at most this many requests, then its engine holds them in flight
# until the kill (testkit.engine_gate): three of them finish at most 48 of the 96, so the
# job outlasts the kills by construction, however fast the machine.
FINISHED_PER_KILLED_WORKER = 16


def test_sigkilled_model_worker_loses_nothing_and_repeats_nothing(
    pg_url, private_broker, tmp_path, procs: Procs, monkeypatch
):
    env = stack_env(
        pg_url,
        private_broker,
        tmp_path,
        BATCHD_CHECKPOINT_EVERY="2",
        BATCHD_CHECKPOINT_INTERVAL_S="0.5",
        BATCHD_SHARD_MAX_REQUESTS="6",
        BATCHD_WORKER_SHARD_CONCURRENCY="2",
        BATCHD_ENGINE_OPTIONS=json.dumps({"max_num_seqs": 2}),
        BATCHD_HEARTBEAT_INTERVAL_S="0.5",
        BATCHD_SHARD_STALE_AFTER_S="3",
        BATCHD_RECLAIM_SWEEP_INTERVAL_S="1",
        BATCHD_MAX_SHARD_ATTEMPTS="20",
        BATCHD_RELEASE_SWEEP_INTERVAL_S="1",
        # Shards a killed worker had reserved but not started are sent again after this.
        BATCHD_RELEASE_RESEND_AFTER_S="6",
        BATCHD_EXPIRY_SWEEP_INTERVAL_S="5",
    )
    use_service_env(env, monkeypatch)
    procs.start("control", celery_command("control", "control", tmp_path), env)
    procs.start("beat", celery_command("beat", "beat", tmp_path), env)

    def start_model(k: int) -> None:
        command = [*celery_command("model", f"model-{k}", tmp_path), *MODEL_WORKER_GATE]
        capped = {GATE_AFTER: str(FINISHED_PER_KILLED_WORKER)} if k < 3 else {}
        procs.start(f"model-{k}", command, {**env, **capped})

    start_model(0)
    texts = {f"k{i:02d}": f"tell me about the mountain number {i}" for i in range(96)}
    batch_id = enqueued_batch(
        [chat_line(c, t, MAX_TOKENS, ignore_eos=True) for c, t in texts.items()], private_broker
    )

    rng = random.Random(SEED)
    kills = []
    for k in range(3):
        name = f"model-{k}"
        procs.wait_log(name, f"model {MODEL} ready", 120)
        before = batch_row(batch_id).request_completed
        # Let this worker commit something first, so every kill interrupts work under way.
        wait_for(
            lambda before=before: batch_row(batch_id).request_completed > before,
            90,
            f"progress by {name}",
            procs.logs,
        )
        delay = rng.uniform(0.0, 2.5)
        time.sleep(delay)
        batch = batch_row(batch_id)
        assert batch.status == "in_progress", f"the job ended before kill {k}"
        procs.kill(name)
        kills.append((round(delay, 2), batch.request_completed))
        start_model(k + 1)

    wait_for(
        lambda: batch_row(batch_id).status in ("completed", "failed", "expired", "cancelled"),
        400,
        "the batch to finish",
        procs.logs,
    )
    batch = batch_row(batch_id)
    assert batch.status == "completed", procs.logs()
    out = read_file_lines(batch.output_file_id)
    err = read_file_lines(batch.error_file_id)
    counts = Counter(r["custom_id"] for r in out + err)
    assert counts == Counter(list(texts)), f"not exactly one line per request: {counts}"
    assert not err, err[:3]
    assert [r["custom_id"] for r in out] == list(texts)  # input order
    assert (batch.request_completed, batch.request_failed) == (len(texts), 0)

    # Same text as an uninterrupted greedy run.
    from core.llms.demo import build
    from engine import LLM, SamplingParams

    llm = LLM(str(build("llama-tiny")), max_num_seqs=8, dtype="float32")  # as the stack
    want = llm.chat(
        [[{"role": "user", "content": t}] for t in texts.values()],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    for record, expected in zip(out, want, strict=True):
        assert record["response"]["body"]["choices"][0]["message"]["content"] == (
            expected.outputs[0].text
        ), record["custom_id"]

    # Killed attempts were resumed from their checkpoints, not started over.
    logs = "".join(procs.log(f"model-{k}") for k in range(4))
    assert "resumes:" in logs, procs.logs()
    attempts = sorted(s.attempts for s in shard_rows(batch_id))
    print(f"kills (delay s, results committed): {kills}; attempts per shard: {attempts}")
    assert max(attempts) >= 2


def _multipart_head(boundary: str, filename: str) -> bytes:
    return (
        f"--{boundary}\r\n"
        'Content-Disposition: form-data; name="purpose"\r\n\r\n'
        "batch\r\n"
        f"--{boundary}\r\n"
        f'Content-Disposition: form-data; name="file"; filename="{filename}"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()


def test_api_killed_mid_upload_leaves_nothing_listed_or_usable(
    pg_url, private_broker, tmp_path, procs: Procs
):
    import httpx

    from core.storage.base import TEMP_PREFIX
    from core.storage.local import LocalStorage

    env = stack_env(pg_url, private_broker, tmp_path)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def api_up() -> bool:
        try:
            return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    procs.start("api", api_command(port), env)
    wait_for(api_up, 60, "the API", procs.logs)
    before = httpx.get(f"{base}/v1/files", headers=headers).json()["data"]

    line = json.dumps(chat_line("x", "y" * 900, 4, ignore_eos=True)).encode() + b"\n"
    boundary = "batchd-crash-boundary"
    head = _multipart_head(boundary, "big.jsonl")
    total = len(head) + 8 * 1024 * 1024  # declared: 8 MiB of lines, never all sent
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        (
            f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: Bearer {API_KEY}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
            f"Content-Length: {total}\r\n\r\n"
        ).encode()
        + head
    )
    storage_root = Path(env["BATCHD_STORAGE_URL"])
    sent = 0
    deadline = time.monotonic() + 30
    partial: list[Path] = []
    while time.monotonic() < deadline:  # slowly, until the server is visibly mid-write
        sock.sendall(line * 64)
        sent += len(line) * 64
        time.sleep(0.02)
        partial = [p for p in storage_root.rglob("*") if p.is_file()]
        if sent > 1024 * 1024 and partial and partial[0].stat().st_size > 256 * 1024:
            break
    assert partial, "the upload never reached storage"
    assert all(p.name.startswith(TEMP_PREFIX) for p in partial), partial
    procs.kill("api")
    sock.close()

    procs.start("api", api_command(port), env)
    wait_for(api_up, 60, "the restarted API", procs.logs)
    files = httpx.get(f"{base}/v1/files", headers=headers).json()["data"]
    assert files == before, "a half-written upload is listed"
    # Whatever the dead server left behind is a temporary file: never an object.
    leftovers = [p for p in storage_root.rglob("*") if p.is_file()]
    assert all(p.name.startswith(TEMP_PREFIX) for p in leftovers), leftovers
    assert LocalStorage(storage_root).list("") == []
    # And the service still takes a whole upload afterwards.
    ok = httpx.post(
        f"{base}/v1/files",
        headers=headers,
        data={"purpose": "batch"},
        files={"file": ("small.jsonl", line * 3)},
    )
    assert ok.status_code == 200, ok.text
    listed = httpx.get(f"{base}/v1/files", headers=headers).json()["data"]
    assert [f["id"] for f in listed] == [ok.json()["id"]] + [f["id"] for f in before]
