"""A cluster on one machine, and one of its nodes lost mid-job.

Three nodes, each a process group with a working directory of its own and no local disk shared
with another (:mod:`testkit.service.cluster`), on real Postgres, a private Redis and S3-compatible
storage (moto's server):

- node A: API-A, a control worker, a model worker (the tiny demo model);
- node B: API-B, a control worker, a model worker, beat;
- node C: a dispatch worker for an upstream model, a real ``transformers serve`` of
  SmolLM2-135M-Instruct (:mod:`testkit.upstream_server`).

Batches go in through both APIs, for the local model and for the upstream one. Node B's model
worker holds its engine once it has finished a couple of requests (an engine gate), so node B
is mid-job, by construction, when the whole node is SIGKILLed. A new node takes its place
(fresh processes in a new working directory, beat among them). Every batch completes with
each line exactly once and no error line, the results read through the surviving API.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from cli.perf.service import wait_for
from testkit.builders.lines import MODEL, chat_line, create_batch, jsonl
from testkit.builders.worker import shard_rows
from testkit.engine_gate import AFTER_ENV as GATE_AFTER
from testkit.engine_gate import MODEL_WORKER_GATE
from testkit.service.cluster import Node, node_env, provision_model
from testkit.service.stack import API_KEY, TERMINAL
from testkit.upstream_server import UpstreamServer, smollm2_dir
from tests.core.test_storage import s3_endpoint  # noqa: F401 - the fixture

pytestmark = [pytest.mark.services, pytest.mark.slow]

UPSTREAM = "fleet"
N_LOCAL = 24
N_UPSTREAM = 8
SHARD_LINES = 4
MAX_TOKENS = 16
# Node B's model worker holds its engine for good once it has finished this many requests
# (testkit.engine_gate), the other requests of its shards staying in flight: it is
# mid-shard when its node is lost, however fast the machine.
HELD_AFTER = 2

SETTINGS = {  # the cluster's ConfigMap: the same on every node
    "BATCHD_CHECKPOINT_EVERY": "2",
    "BATCHD_CHECKPOINT_INTERVAL_S": "0.5",
    "BATCHD_SHARD_MAX_REQUESTS": str(SHARD_LINES),
    "BATCHD_WORKER_SHARD_CONCURRENCY": "2",
    "BATCHD_ENGINE_OPTIONS": json.dumps({"max_num_seqs": 4}),
    # A lost node's shards go stale within seconds and are sent again (test_crash_recovery's).
    "BATCHD_HEARTBEAT_INTERVAL_S": "0.5",
    "BATCHD_SHARD_STALE_AFTER_S": "3",
    "BATCHD_RECLAIM_SWEEP_INTERVAL_S": "1",
    "BATCHD_RELEASE_SWEEP_INTERVAL_S": "1",
    "BATCHD_RELEASE_RESEND_AFTER_S": "6",
    # A validate or finalize lost with node B's control worker is sent again this soon.
    "BATCHD_STUCK_BATCH_AFTER_S": "20",
    # On two busy cores a live worker's heartbeat can come later than 3 s, and a shard taken
    # back from a live worker counts an attempt too: room for those, whatever they cost.
    "BATCHD_MAX_SHARD_ATTEMPTS": "20",
}
RECLAIMED = re.compile(r"shard (\d+) \(attempt \d+\) went silent")


def _lines(http: httpx.Client, file_id: str | None) -> list[dict[str, Any]]:
    if not file_id:
        return []
    answer = http.get(f"/v1/files/{file_id}/content")
    assert answer.status_code == 200, answer.text
    return [json.loads(line) for line in answer.text.splitlines() if line.strip()]


def _running_on(worker_prefix: str) -> list[tuple[int, str]]:
    """(shard id, batch id) of the shards running on workers named ``worker_prefix…``."""
    from sqlalchemy import select

    from core.database.lifecycle import ShardStatus
    from core.database.sessions import session_scope
    from core.database.tables import Shard

    with session_scope() as session:
        rows = session.execute(
            select(Shard.id, Shard.batch_id).where(
                Shard.status == ShardStatus.RUNNING, Shard.worker.like(f"{worker_prefix}%")
            )
        ).all()
    return [(row.id, row.batch_id) for row in rows]


def test_a_node_lost_mid_job_loses_nothing_and_a_new_node_takes_its_place(
    pg_url: str,
    private_broker: str,
    s3_endpoint: str,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from core.llms.demo import build
    from core.settings import get_settings

    began = time.monotonic()
    monkeypatch.setenv("BATCHD_DATABASE_URL", pg_url)  # this process reads the shards' rows
    get_settings.cache_clear()
    demo = build("llama-tiny")  # built once here; each node gets a copy in its own cache
    storage_url = f"s3://batchd-cluster-{secrets.token_hex(4)}/batchd"
    (tmp_path / "fleet").mkdir()
    server = UpstreamServer(tmp_path / "fleet")
    upstream = f"upstream:{server.base_url}?model={smollm2_dir()}&cache_salt_field=prompt_cache_key"
    models = json.dumps({MODEL: "demo:llama-tiny", UPSTREAM: upstream})
    nodes: list[Node] = []
    clients: list[httpx.Client] = []

    def node(name: str) -> Node:
        root = tmp_path / f"node-{name}"
        env = node_env(
            root, pg_url, private_broker, storage_url, s3_endpoint, BATCHD_MODELS=models,
            **SETTINGS,
        )  # fmt: skip
        provision_model(env, demo)
        made = Node(name, root, env)
        nodes.append(made)
        return made

    def client(n: Node) -> httpx.Client:
        http = httpx.Client(
            base_url=n.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
        )
        clients.append(http)
        return http

    def logs() -> str:
        return "".join(n.logs() for n in nodes) + f"\n--- fleet\n{server.log()}"

    with ExitStack() as cleanup:
        cleanup.callback(get_settings.cache_clear)
        cleanup.callback(lambda: [n.stop() for n in reversed(nodes)])
        cleanup.callback(lambda: [c.close() for c in clients])
        a = node("a").api().control().model(MODEL, 2)
        # Exactly one beat in the cluster: Celery's beat takes no lock of its own (and batchd
        # adds none), so the guarantee is that one process runs it, here node B's; the node
        # that replaces B starts its beat only after every process of B has exited.
        b = node("b").api().control()
        b.model(MODEL, 2, MODEL_WORKER_GATE, **{GATE_AFTER: str(HELD_AFTER)}).beat()
        cleanup.enter_context(server)  # the fleet starts meanwhile
        cleanup.callback(lambda: [n.stop() for n in reversed(nodes)])  # before the fleet stops
        c = node("c").dispatch(UPSTREAM, 2)
        for n in (a, b, c):
            n.wait_ready(240)
        started = time.monotonic() - began
        api_a, api_b = client(a), client(b)

        texts = [f"tell me about the mountain number {i}" for i in range(N_LOCAL)]
        inputs = {
            "local, via API-A": [
                chat_line(f"a{i:02d}", t, MAX_TOKENS, ignore_eos=True) for i, t in enumerate(texts)
            ],
            "local, via API-B": [
                chat_line(f"b{i:02d}", t, MAX_TOKENS, ignore_eos=True) for i, t in enumerate(texts)
            ],
            "upstream, via API-B": [
                chat_line(f"u{i}", f"Name a color, number {i}.", 8, model=UPSTREAM)
                for i in range(N_UPSTREAM)
            ],
        }
        batches = {
            label: create_batch(api_a if "API-A" in label else api_b, jsonl(lines))
            for label, lines in inputs.items()
        }

        # Node B is mid-job: its engine holds, a shard of a running batch on its worker.
        wait_for(
            lambda: f"engine gate after {HELD_AFTER} holding requests in flight" in b.log("model"),
            240,
            "node B's model worker to hold a shard",
            logs,
        )
        before = {label: api_a.get(f"/v1/batches/{bid}").json() for label, bid in batches.items()}
        killed = time.monotonic()
        b.kill()
        # The shards B held are those still running on it once it is gone: a shard whose
        # requests all finished in the step that closed the gate may end just before the
        # kill, but one with a request in B's engine cannot end.
        held = _running_on("model-b@")
        assert held, logs()
        for _shard, batch_id in held:
            label = next(k for k, v in batches.items() if v == batch_id)
            assert before[label]["status"] == "in_progress", before[label]

        # A new node in B's place: fresh processes, a new working directory, the beat.
        b2 = node("b2").api().control().model(MODEL, 2).beat()

        ended: dict[str, float | None] = {
            label: None for label, got in before.items() if got["status"] in TERMINAL
        }

        b2_ready: list[float] = []

        def all_ended() -> bool:
            if not b2_ready and b2.ready():
                b2_ready.append(time.monotonic() - killed)
            for label, batch_id in batches.items():
                if label not in ended:
                    got = api_a.get(f"/v1/batches/{batch_id}").json()
                    if got["status"] in TERMINAL:
                        ended[label] = time.monotonic() - killed
            return len(ended) == len(batches)

        wait_for(all_ended, 300, "every batch to end", logs)
        b2.wait_ready(240)
        if not b2_ready:
            b2_ready.append(time.monotonic() - killed)
        api_b2 = client(b2)

        # Every line exactly once, no error line, read through the surviving API.
        done = {label: api_a.get(f"/v1/batches/{bid}").json() for label, bid in batches.items()}
        outputs: dict[str, list[dict[str, Any]]] = {}
        for label, got in done.items():
            want = [line["custom_id"] for line in inputs[label]]
            assert got["status"] == "completed", (label, got)
            assert got["request_counts"] == {
                "total": len(want), "completed": len(want), "failed": 0
            }, (label, got)  # fmt: skip
            out = _lines(api_a, got["output_file_id"])
            err = _lines(api_a, got["error_file_id"])
            counts = Counter(r["custom_id"] for r in out + err)
            assert counts == Counter(want), f"{label}: not exactly one line per request: {counts}"
            assert not err, (label, err[:3])
            assert [r["custom_id"] for r in out] == want, label  # input order
            assert all(r["response"]["status_code"] == 200 for r in out), label
            outputs[label] = out
            # The new node serves the same bytes: the files live in the shared storage.
            file_id = got["output_file_id"]
            again = api_b2.get(f"/v1/files/{file_id}/content")
            assert again.content == api_a.get(f"/v1/files/{file_id}/content").content, label

        # Greedy text does not depend on the node, the attempt or the batch a request ran in.
        def text(record: dict[str, Any]) -> str:
            return record["response"]["body"]["choices"][0]["message"]["content"]

        assert [text(r) for r in outputs["local, via API-A"]] == [
            text(r) for r in outputs["local, via API-B"]
        ]
        # Nothing went to a node's local disk: no storage directory under any node.
        assert not [n.name for n in nodes if (n.root / "home" / "storage").exists()]

        # The held shards were taken back and run again elsewhere.
        attempts = {label: [s.attempts for s in shard_rows(bid)] for label, bid in batches.items()}
        by_id = {s.id: s for bid in batches.values() for s in shard_rows(bid)}
        for shard_id, _batch in held:
            assert by_id[shard_id].attempts >= 2, (shard_id, by_id[shard_id].attempts)
        reclaimed = sorted(
            {
                int(m)
                for n in nodes
                if "control" in n.procs
                for m in RECLAIMED.findall(n.log("control"))
            }
        )
        assert {shard_id for shard_id, _ in held} <= set(reclaimed), (held, reclaimed, logs())

        print(f"\ncluster up in {started:.1f} s; node B SIGKILLed holding shards {held}")
        print(f"  the new node ready (its model loaded) {b2_ready[0]:.1f} s after the kill")
        for label in batches:
            after = ended[label]
            when = "before the kill" if after is None else f"{after:.1f} s after the kill"
            print(f"  {label}: completed {when}; attempts per shard {attempts[label]}")
        print(f"  shards reclaimed (re-queued by a reclaim sweep): {len(reclaimed)} {reclaimed}")
        print(f"  test ran {time.monotonic() - began:.1f} s")
