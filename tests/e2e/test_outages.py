"""Outages in every phase of a job: Postgres and Redis cut off (every connection closed, new
ones refused) for a few seconds through TCP proxies that the API, the workers and beat connect
through. The API answers 503 while the database is away; no process dies or hangs; the job
completes, correctly.

* :func:`test_database_and_broker_outages_mid_job`: while shards run (Postgres, then Redis,
  which may also catch the last shard finishing and its finalize being sent);
* :func:`test_outages_while_control_steps_hold_their_messages`: Redis while a validate holds
  its unacknowledged message (the control worker once died there: kombu's reconnect raised
  ``AttributeError`` restoring it), then Postgres and Redis together while a finalize does,
  which then fails and has to publish its retry through the outage; beat keeps sending its
  sweeps after each.

A step is held at the right moment by ``outage_faults`` (loaded into the control worker)."""

from __future__ import annotations

import io
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from cli.perf.service import api_up, free_port, wait_for
from testkit.builders.lines import MODEL, chat_line, create_batch
from testkit.proxies.tcp_proxy import TcpProxy
from testkit.service.stack import API_KEY, Procs, api_command, celery_command, stack_env

pytestmark = [pytest.mark.services, pytest.mark.slow]

OUTAGE_S = 4.0
HERE = Path(__file__).resolve().parent


def test_database_and_broker_outages_mid_job(pg_url, private_broker, tmp_path, procs: Procs):
    import httpx

    from tests.conftest import PG_HOST, PG_PORT

    redis_port = int(private_broker.rsplit(":", 1)[1].split("/")[0])
    pg = TcpProxy(PG_HOST, PG_PORT).start()
    rd = TcpProxy("127.0.0.1", redis_port).start()
    try:
        env = stack_env(
            pg.url_for(pg_url, PG_PORT),
            rd.url_for(private_broker, redis_port),
            tmp_path,
            BATCHD_CHECKPOINT_EVERY="2",
            BATCHD_CHECKPOINT_INTERVAL_S="0.5",
            BATCHD_SHARD_MAX_REQUESTS="6",
            BATCHD_WORKER_SHARD_CONCURRENCY="2",
            BATCHD_ENGINE_OPTIONS=json.dumps({"max_num_seqs": 4}),
            BATCHD_HEARTBEAT_INTERVAL_S="1",
            BATCHD_SHARD_STALE_AFTER_S="20",
            BATCHD_RECLAIM_SWEEP_INTERVAL_S="2",
            BATCHD_RELEASE_SWEEP_INTERVAL_S="1",
            BATCHD_EXPIRY_SWEEP_INTERVAL_S="5",
        )
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {API_KEY}"})
        procs.start("api", api_command(port), env)
        procs.start("control", celery_command("control", "control", tmp_path), env)
        procs.start("beat", celery_command("beat", "beat", tmp_path), env)
        procs.start("model", celery_command("model", "model", tmp_path), env)
        procs.wait_log("model", f"model {MODEL} ready", 120)

        ids = [f"o{i:02d}" for i in range(18)]
        batch_id = _create_batch(client, ids, max_tokens=24)

        def batch() -> dict[str, Any]:
            return client.get(f"/v1/batches/{batch_id}").json()

        wait_for(lambda: batch()["request_counts"]["completed"] >= 2, 90, "progress", procs.logs)

        # Postgres goes away: the API says so (503), the workers wait and retry.
        pg.cut()
        try:
            down = _during_outage(client, f"/v1/batches/{batch_id}")
            assert down.status_code == 503, down.text
            error = down.json()["error"]
            assert error["code"] == "database_unavailable" and error["message"]
            time.sleep(OUTAGE_S)
        finally:
            pg.resume()
        assert pg.refused > 0
        after_db = _wait_for_ok(client, batch_id)
        assert after_db["status"] in ("in_progress", "finalizing", "completed")

        # Redis goes away while shards still run (or the finalize is being sent).
        rd.outage(OUTAGE_S).join()
        assert rd.refused > 0

        final = _wait_until_done(client, batch_id, procs)
        assert final["status"] == "completed", (final, procs.logs())
        out = _download(client, final["output_file_id"])
        err = _download(client, final["error_file_id"])
        assert not err, err[:3]
        assert Counter(r["custom_id"] for r in out) == Counter(ids)
        assert [r["custom_id"] for r in out] == ids
        assert final["request_counts"] == {"total": 18, "completed": 18, "failed": 0}
        procs.check_alive()  # no process died on the way
        logs = procs.log("model") + procs.log("control")
        assert "Unrecoverable error" not in logs
        print(
            f"pg refused {pg.refused} connections, redis {rd.refused}; "
            f"{logs.count('; retry ')} retried database/broker calls logged"
        )
    finally:
        pg.close()
        rd.close()


def _during_outage(client: Any, path: str) -> Any:
    """GET ``path`` while the database is cut off. A request served by a pooled connection
    that the cut killed may be dropped without a response (api/deps.py's session close
    raises after the response started); the next one must get a 503."""
    import httpx

    for _ in range(3):
        try:
            return client.get(path)
        except httpx.RemoteProtocolError:
            continue
    raise AssertionError(f"GET {path} never answered while the database was away")


def _wait_for_ok(client: Any, batch_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        r = client.get(f"/v1/batches/{batch_id}")
        if r.status_code == 200:
            return r.json()
        assert time.monotonic() < deadline, r.text
        time.sleep(0.3)


def _download(client: Any, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    r = client.get(f"/v1/files/{file_id}/content")
    assert r.status_code == 200, r.text
    return [json.loads(x) for x in r.text.splitlines() if x.strip()]


def test_outages_while_control_steps_hold_their_messages(
    pg_url, private_broker, tmp_path, procs: Procs
):
    import httpx

    from tests.conftest import PG_HOST, PG_PORT
    from worker.__main__ import check_health

    redis_port = int(private_broker.rsplit(":", 1)[1].split("/")[0])
    pg = TcpProxy(PG_HOST, PG_PORT).start()
    rd = TcpProxy("127.0.0.1", redis_port).start()
    pauses = tmp_path / "pauses"
    pauses.mkdir()
    try:
        env = stack_env(
            pg.url_for(pg_url, PG_PORT),
            rd.url_for(private_broker, redis_port),
            tmp_path,
            BATCHD_SHARD_MAX_REQUESTS="8",
            BATCHD_WORKER_SHARD_CONCURRENCY="2",
            BATCHD_ENGINE_OPTIONS=json.dumps({"max_num_seqs": 4}),
            BATCHD_RELEASE_SWEEP_INTERVAL_S="1",
            BATCHD_RECLAIM_SWEEP_INTERVAL_S="2",
            BATCHD_EXPIRY_SWEEP_INTERVAL_S="2",
            BATCHD_TEST_PAUSE_DIR=str(pauses),
            PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
        )
        port = free_port()
        client = httpx.Client(
            base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {API_KEY}"}
        )
        control = [*celery_command("control", "control", tmp_path), "-I", "outage_faults"]
        # Beat at DEBUG: the lines of the sweeps it sends are DEBUG (worker.infra.celery).
        beat = [*celery_command("beat", "beat", tmp_path)[:-1], "DEBUG"]
        # Each worker's liveness file, touched every second while its consumer loop turns or
        # it reconnects; a loop stalled for a minute would end the process
        # (worker/infra/liveness.py).
        alive = {name: tmp_path / f"{name}.alive" for name in ("control", "model")}
        live = {"BATCHD_WORKER_LIVENESS_INTERVAL_S": "1", "BATCHD_WORKER_HANG_TIMEOUT_S": "60"}
        procs.start("api", api_command(port), env)
        procs.start(
            "control",
            control,
            {**env, **live, "BATCHD_WORKER_LIVENESS_FILE": str(alive["control"])},
        )
        procs.start("beat", beat, env)
        procs.start(
            "model",
            celery_command("model", "model", tmp_path),
            {**env, **live, "BATCHD_WORKER_LIVENESS_FILE": str(alive["model"])},
        )
        procs.wait_log("model", f"model {MODEL} ready", 120)
        procs.wait_log("control", "ready.", 60)

        def broker_lost(count: int) -> None:
            procs.wait_log("control", "Connection to broker lost", 30, count=count)

        def beat_sends_again() -> None:
            seen = procs.log("beat").count("Sending due task")
            procs.wait_log("beat", "Sending due task", 30, count=seen + 2)

        # Validate: Redis goes while the control worker holds the validate's message (one of
        # its two threads busy, the other waiting in BRPOP), and comes back while it runs.
        (pauses / "validate").touch()
        (pauses / "finalize").touch()
        ids = [f"s{i}" for i in range(8)]
        batch_id = _create_batch(client, ids)
        started = pauses / f"validate-{batch_id}.started"
        wait_for(started.exists, 60, "the validate to start", procs.logs)
        rd.cut()
        broker_lost(1)
        (pauses / f"validate-{batch_id}.go").touch()
        time.sleep(OUTAGE_S)
        rd.resume()
        beat_sends_again()

        # Finalize: Postgres and Redis go while it holds its message; let go, it fails on the
        # database and publishes its retry through the broker outage.
        started = pauses / f"finalize-{batch_id}.started"
        wait_for(started.exists, 120, "the finalize to start", procs.logs)
        rd.cut()
        pg.cut()
        broker_lost(2)
        (pauses / f"finalize-{batch_id}.go").touch()
        time.sleep(OUTAGE_S)
        pg.resume()
        rd.resume()
        beat_sends_again()

        final = _wait_until_done(client, batch_id, procs)
        assert final["status"] == "completed", (final, procs.logs())
        out = _download(client, final["output_file_id"])
        assert not _download(client, final["error_file_id"])
        assert [r["custom_id"] for r in out] == ids
        assert final["request_counts"] == {"total": 8, "completed": 8, "failed": 0}
        # Every process rode it out: none exited, the control worker never gave up.
        procs.check_alive()
        control_log = procs.log("control")
        assert "Unrecoverable error" not in control_log, control_log[-5000:]
        assert "Error on stopping Hub" not in control_log
        assert control_log.count(f"resumed: finalize of {batch_id}") == 1
        for name, path in alive.items():
            healthy, why = check_health(str(path), interval_s=1.0)
            assert healthy, (name, why)
        assert rd.refused > 0 and pg.refused > 0
    finally:
        pg.close()
        rd.close()


def _create_batch(client: Any, ids: list[str], max_tokens: int = 8) -> str:
    data = b"".join(
        json.dumps(chat_line(c, f"the outage report {c}", max_tokens, ignore_eos=True)).encode()
        + b"\n"
        for c in ids
    )
    return create_batch(client, data)


def _wait_until_done(client: Any, batch_id: str, procs: Procs) -> dict[str, Any]:
    done = ("completed", "failed", "expired", "cancelled")
    last: dict[str, Any] = {}

    def finished() -> bool:
        procs.check_alive()
        r = client.get(f"/v1/batches/{batch_id}")
        if r.status_code == 200:
            last.update(r.json())
        return last.get("status") in done

    wait_for(finished, 150, "the batch to finish", procs.logs)
    return last


def test_a_silent_broker_costs_a_create_a_503_not_a_hung_thread(
    pg_url, private_broker, tmp_path, procs: Procs
):
    """The broker's route is lost without a reset (every connection open, nothing answered):
    a create waits out the producer's bounded sockets and answers 503 ``broker_unavailable``
    within half a minute instead of hanging, its batch failed and saying why; what needs no
    broker stays served; once the route is back the next create goes through."""
    import httpx

    from core.broker.queue import PRODUCER_SOCKET_TIMEOUT_S

    redis_port = int(private_broker.rsplit(":", 1)[1].split("/")[0])
    rd = TcpProxy("127.0.0.1", redis_port).start()
    try:
        env = stack_env(pg_url, rd.url_for(private_broker, redis_port), tmp_path)
        port = free_port()
        client = httpx.Client(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=120,
        )
        procs.start("api", api_command(port), env)
        wait_for(lambda: api_up(port), 60, "the API", procs.logs)
        first = _create_batch(client, ["a-1"])  # the producer is connected before the stall

        rd.stall()
        start = time.monotonic()
        data = json.dumps(chat_line("b-1", "hello")).encode() + b"\n"
        f = client.post(
            "/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", io.BytesIO(data))}
        )
        assert f.status_code == 200, f.text  # an upload needs no broker
        refused = client.post(
            "/v1/batches",
            json={
                "input_file_id": f.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        waited = time.monotonic() - start
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "broker_unavailable"
        # Celery's default publish policy: four attempts, each bounded by the socket timeout.
        assert waited < 4 * PRODUCER_SOCKET_TIMEOUT_S + 20, waited  # 26 s here
        failed_id = refused.json()["error"]["message"].split("Batch ")[1].split()[0]
        failed = client.get(f"/v1/batches/{failed_id}").json()
        assert failed["status"] == "failed"
        assert failed["errors"]["data"][0]["code"] == "broker_unavailable"
        assert client.get(f"/v1/batches/{first}").status_code == 200
        procs.check_alive()

        rd.resume()
        again = _create_batch(client, ["c-1"])
        assert client.get(f"/v1/batches/{again}").json()["status"] == "validating"
        assert rd.accepted >= 2  # the producer reconnected after the stall
    finally:
        rd.close()
