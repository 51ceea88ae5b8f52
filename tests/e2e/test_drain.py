"""SIGTERM drains a worker without loss: two real model workers (or dispatch workers) on
Postgres, a private Redis and a local storage directory; the busy one gets SIGTERM in the
middle of its shards, held there on purpose (an engine gate, or answers held in a proxy), never
by timing. It exits 0 within its drain; its shards are handed back and resumed by the other
worker from their checkpoints at once (a reclaim by staleness is ruled out: shards go stale
only after 600 s); every line ends exactly once."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cli.perf.service import wait_for
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
from testkit.service.stack import Procs, celery_command, stack_env

pytestmark = [pytest.mark.services, pytest.mark.slow]

DRAIN_S = 4.0
# A drained worker exits within its drain and HAND_BACK_S (worker.infra.drain); the process's
# own exit (Python's teardown of the engine) takes a few seconds of that.
EXIT_MARGIN_S = 15.0
NEVER_STALE = {
    # Nothing but the hand-back can give the shards to the other worker.
    "BATCHD_SHARD_STALE_AFTER_S": "600",
    "BATCHD_RELEASE_RESEND_AFTER_S": "6000",
    "BATCHD_RECLAIM_SWEEP_INTERVAL_S": "1",
    "BATCHD_RELEASE_SWEEP_INTERVAL_S": "1",
}


def _batch_ended(batch_id: str) -> bool:
    return batch_row(batch_id).status in ("completed", "failed", "expired", "cancelled")


def _watch(
    proc: Any, sent: float, timeout: float, events: dict[str, Callable[[], bool]]
) -> tuple[int | None, dict[str, float]]:
    """Poll until ``proc`` has exited and every event has happened (or ``timeout`` passed):
    its exit code (None: killed at the timeout) and the seconds from ``sent`` (the SIGTERM) to
    its exit (``exit``) and to each event seen."""
    seen: dict[str, float] = {}
    deadline = sent + timeout
    while time.monotonic() < deadline:
        if "exit" not in seen and proc.poll() is not None:
            seen["exit"] = time.monotonic() - sent
        for name, happened in events.items():
            if name not in seen and happened():
                seen[name] = time.monotonic() - sent
        if len(seen) == len(events) + 1:
            break
        time.sleep(0.1)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None, seen
    return proc.returncode, seen


def _exactly_once(batch_id: str, ids: list[str]) -> list[dict[str, Any]]:
    batch = batch_row(batch_id)
    assert batch.status == "completed", batch.status
    out = read_file_lines(batch.output_file_id)
    err = read_file_lines(batch.error_file_id)
    counts = Counter(r["custom_id"] for r in out + err)
    assert counts == Counter(ids), f"not exactly one line per request: {counts}"
    assert not err, err[:3]
    assert [r["custom_id"] for r in out] == ids  # input order
    assert (batch.request_completed, batch.request_failed) == (len(ids), 0)
    return out


MAX_TOKENS = 24
N_LINES = 32
SHARD_LINES = 8
# The drained worker's engine holds for good once it has finished this many requests, the
# requests then in flight staying in flight (testkit.engine_gate): it is mid-shard when
# the SIGTERM comes, however fast the machine.
FINISHED_BEFORE_HOLD = 5


def test_sigterm_drains_a_model_worker_and_its_shards_resume_at_once_elsewhere(
    pg_url, private_broker, tmp_path: Path, procs: Procs, monkeypatch
):
    env = stack_env(
        pg_url,
        private_broker,
        tmp_path,
        BATCHD_CHECKPOINT_EVERY="2",
        BATCHD_CHECKPOINT_INTERVAL_S="0.5",
        BATCHD_SHARD_MAX_REQUESTS=str(SHARD_LINES),
        BATCHD_WORKER_SHARD_CONCURRENCY="2",
        BATCHD_ENGINE_OPTIONS=json.dumps({"max_num_seqs": 2}),
        BATCHD_WORKER_DRAIN_S=str(DRAIN_S),
        **NEVER_STALE,
    )
    use_service_env(env, monkeypatch)
    procs.start("control", celery_command("control", "control", tmp_path), env)
    procs.start("beat", celery_command("beat", "beat", tmp_path), env)
    held = {GATE_AFTER: str(FINISHED_BEFORE_HOLD)}
    procs.start(
        "model-a", [*celery_command("model", "model-a", tmp_path), *MODEL_WORKER_GATE], env | held
    )
    procs.wait_log("model-a", f"model {MODEL} ready", 120)
    texts = {f"d{i:02d}": f"tell me about the river number {i}" for i in range(N_LINES)}
    ids = list(texts)
    batch_id = enqueued_batch(
        [chat_line(c, t, MAX_TOKENS, ignore_eos=True) for c, t in texts.items()], private_broker
    )
    # Worker A runs two shards, commits what it finished, and holds the rest in flight.
    procs.wait_log("model-a", f"engine gate after {FINISHED_BEFORE_HOLD} holding", 180)
    wait_for(
        lambda: batch_row(batch_id).request_completed >= FINISHED_BEFORE_HOLD,
        60,
        "worker A's results committed",
        procs.logs,
    )
    held_shards = {s.id for s in shard_rows(batch_id) if s.worker and "model-a@" in s.worker}
    assert len(held_shards) == 2, [(s.id, s.status, s.worker) for s in shard_rows(batch_id)]
    # Worker B takes the shards still queued, and whatever A hands back.
    procs.start("model-b", celery_command("model", "model-b", tmp_path), env)
    procs.wait_log("model-b", f"model {MODEL} ready", 120)

    def resumed() -> bool:  # every shard A held claimed again (by B)
        return all(s.attempts >= 2 for s in shard_rows(batch_id) if s.id in held_shards)

    proc = procs.procs["model-a"]
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    code, at = _watch(
        proc, sent, 300, {"resumed": resumed, "completed": lambda: _batch_ended(batch_id)}
    )
    log_a = procs.log("model-a")
    assert code == 0, f"worker A exited {code} ({at}):{procs.logs()}"
    assert at["exit"] < DRAIN_S + EXIT_MARGIN_S, at
    assert "draining:" in log_a, log_a[-3000:]
    assert log_a.count("handed back (this worker drains)") == 2, log_a[-3000:]
    assert "completed" in at, f"the batch did not finish ({at}):{procs.logs()}"
    out = _exactly_once(batch_id, ids)

    # B resumed A's shards from their checkpoints: one hand-back each, no failed attempt.
    rows = {s.id: s for s in shard_rows(batch_id)}
    for shard_id in held_shards:
        row = rows[shard_id]
        assert (row.attempts, row.handbacks) == (2, 1), (row.attempts, row.handbacks)
        assert row.worker is not None and "model-b@" in row.worker  # A claimed nothing more
    assert "resumes:" in procs.log("model-b")
    assert "went silent" not in procs.log("control")  # no reclaim by staleness

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
    print(
        f"model worker drain ({DRAIN_S:g}s): SIGTERM -> resumed elsewhere {at['resumed']:.1f}s, "
        f"-> exit {at['exit']:.1f}s (code {code}), -> batch completed {at['completed']:.1f}s; "
        f"{len(ids)} lines exactly once; "
        f"attempts {sorted(s.attempts for s in rows.values())}"
    )


UPSTREAM = "fleet"
UPSTREAM_LINES = 24
UPSTREAM_DRAIN_S = 20.0


def test_sigterm_drains_a_dispatch_worker_and_its_shard_resumes_at_once_elsewhere(
    pg_url, private_broker, tmp_path: Path, procs: Procs, monkeypatch
):
    """The same for an upstream model (``transformers serve``, a real OpenAI-compatible
    server): the answers wait in a proxy, so the dispatch worker is mid-shard at the SIGTERM;
    once it drains they are let through, and what it had in flight finishes and is
    checkpointed (or is aborted when the drain is due) before it hands the shard back."""
    import httpx

    from core.launch import QUIET, dispatch_worker_command
    from testkit.proxies.fault_proxy import FaultProxy
    from testkit.upstream_server import UpstreamServer

    with UpstreamServer(tmp_path) as server:
        faults = FaultProxy(f"http://127.0.0.1:{server.port}").start()
        try:
            # Two requests in flight at most: the shard's lines cannot all be sent at once.
            spec = (
                f"upstream:{faults.url}/v1?model={server.model}&max_concurrency=2"
                "&cache_salt_field=prompt_cache_key"  # transformers serve refuses cache_salt
            )
            env = stack_env(
                pg_url,
                private_broker,
                tmp_path,
                BATCHD_MODELS=json.dumps({UPSTREAM: spec}),
                BATCHD_CHECKPOINT_EVERY="2",
                BATCHD_CHECKPOINT_INTERVAL_S="0.5",
                BATCHD_SHARD_MAX_REQUESTS=str(UPSTREAM_LINES),
                BATCHD_WORKER_SHARD_CONCURRENCY="2",
                BATCHD_WORKER_DRAIN_S=str(UPSTREAM_DRAIN_S),
                **NEVER_STALE,
            )
            use_service_env(env, monkeypatch)
            procs.start("control", celery_command("control", "control", tmp_path), env)
            procs.start("beat", celery_command("beat", "beat", tmp_path), env)
            for name in ("dispatch-a", "dispatch-b"):
                command = dispatch_worker_command([UPSTREAM], 2, f"{name}@e2e", extra=QUIET)
                procs.start(name, command, env)
                procs.wait_log(name, "ready.", 120)
            ids = [f"u{i:02d}" for i in range(UPSTREAM_LINES)]
            lines = [chat_line(c, f"Write a word about {c}.", 8, model=UPSTREAM) for c in ids]
            faults.hold()  # every answer waits in the proxy: the shard stays mid-way
            batch_id = enqueued_batch(lines, private_broker)
            wait_for(lambda: faults.in_flight >= 2, 120, "requests in flight", procs.logs)
            (shard,) = shard_rows(batch_id)
            busy = "dispatch-a" if "dispatch-a@" in (shard.worker or "") else "dispatch-b"
            other = "dispatch-b" if busy == "dispatch-a" else "dispatch-a"

            proc = procs.procs[busy]
            sent = time.monotonic()
            os.killpg(proc.pid, signal.SIGTERM)
            procs.wait_log(busy, " drains: ", 30)
            faults.release()  # what it has in flight may finish now
            code, at = _watch(
                proc,
                sent,
                400,
                {
                    "resumed": lambda: shard_rows(batch_id)[0].attempts >= 2,
                    "completed": lambda: _batch_ended(batch_id),
                },
            )
            assert code == 0, f"{busy} exited {code} ({at}):{procs.logs()}"
            assert at["exit"] < UPSTREAM_DRAIN_S + EXIT_MARGIN_S, at
            assert "handed back (this worker drains)" in procs.log(busy), procs.log(busy)
            assert "completed" in at, f"the batch did not finish ({at}):{procs.logs()}"
            out = _exactly_once(batch_id, ids)
            # What the drained worker committed is what the other one resumed from.
            handed = procs.log(busy).partition("handed back (this worker drains): ")[2]
            done_before = int(handed.split(" ")[0])
            resumed_from = procs.log(other).partition(" resumes: ")[2].split(" ")[0]
            assert int(resumed_from or 0) == done_before, (resumed_from, done_before)
            (row,) = shard_rows(batch_id)
            assert (row.attempts, row.handbacks) == (2, 1), (row.attempts, row.handbacks)
            assert row.worker is not None and f"{other}@" in row.worker
            assert "went silent" not in procs.log("control")
            # The server's own answers, as when asked directly.
            for record, line in zip(out, lines, strict=True):
                direct = httpx.post(
                    f"{server.base_url}/chat/completions",
                    json=dict(line["body"], model=server.model),
                    timeout=120,
                ).json()
                assert (
                    record["response"]["body"]["choices"][0]["message"]["content"]
                    == (direct["choices"][0]["message"]["content"])
                ), record["custom_id"]
            print(
                f"dispatch worker drain ({UPSTREAM_DRAIN_S:g}s): SIGTERM -> resumed elsewhere "
                f"{at['resumed']:.1f}s, -> exit {at['exit']:.1f}s (code {code}), -> batch "
                f"completed {at['completed']:.1f}s; {len(ids)} lines exactly once, "
                f"{done_before} of them committed by the drained worker"
            )
        finally:
            faults.release()
            procs.stop_all(grace_s=10)
            faults.close()
