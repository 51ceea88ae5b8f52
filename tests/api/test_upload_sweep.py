"""The upload sweep as it runs in a deployment: beat sends ``batchd.sweep_uploads`` every
``upload_sweep_interval_s`` to a control worker (both real subprocesses, on a broker of their
own), which marks uploads past their hour ``expired`` and deletes their parts, gives back the
uploads whose complete died holding its claim, and deletes the parts an ended upload kept."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text

from testkit.service.stack import Procs, celery_command, private_redis
from tests.api.conftest import Server
from tests.api.test_upload_bounds import _add, _create, _error, _stick, _stored, _upload_row

pytestmark = [pytest.mark.services, pytest.mark.slow]

#: Only the upload sweep runs often; beat's other sweeps wait an hour.
QUIET_SWEEPS = {
    f"BATCHD_{name.upper()}_INTERVAL_S": "3600"
    for name in ("expiry_sweep", "release_sweep", "file_sweep", "webhook_sweep", "eta_refresh",
                 "reclaim_sweep")
}  # fmt: skip


@pytest.fixture
def db(pg_url: str) -> Iterator[Engine]:
    engine = create_engine(pg_url)
    yield engine
    engine.dispose()


def _sql(db: Engine, statement: str, **params: object) -> None:
    with db.begin() as conn:
        conn.execute(text(statement), params)


def test_beat_and_a_control_worker_sweep_the_uploads(
    server: Server, db: Engine, redis_url: str, tmp_path: Path
) -> None:
    files = Path(server.storage_url) / "files"
    with server.http() as http:
        expired = _create(http, 10)["id"]
        _add(http, expired, b"12345")
        stuck = _create(http, 3)["id"]
        stuck_part = _add(http, stuck, b"abc").json()["id"]
        stuck_expired = _create(http, 2)["id"]
        _add(http, stuck_expired, b"xy")
        ended = _create(http, 2)["id"]
        _add(http, ended, b"zz")
        live = _create(http, 5)["id"]
        _add(http, live, b"12")
    _sql(db, "UPDATE uploads SET expires_at = now() - interval '1 second' WHERE id = :id",
         id=expired)  # fmt: skip
    # Two completes died, one of them after its upload's hour: each wrote half a file.
    for upload, file_id in ((stuck, "file-dead-1"), (stuck_expired, "file-dead-2")):
        _stick(db, upload, file_id, age_s=3600)
        files.mkdir(parents=True, exist_ok=True)
        (files / file_id).write_bytes(b"half")
    _sql(db, "UPDATE uploads SET expires_at = now() - interval '1 second' WHERE id = :id",
         id=stuck_expired)  # fmt: skip
    # A cancel that died between its status and deleting the parts.
    _sql(db, "UPDATE uploads SET status = 'cancelled' WHERE id = :id", id=ended)

    procs = Procs(tmp_path)
    with private_redis(redis_url, tmp_path) as broker:
        env = {**os.environ, **server.env, **QUIET_SWEEPS, "BATCHD_BROKER_URL": broker,
               "BATCHD_UPLOAD_SWEEP_INTERVAL_S": "1"}  # fmt: skip
        try:
            procs.start("control", celery_command("control", "control", tmp_path), env)
            procs.start("beat", celery_command("beat", "beat", tmp_path), env)
            procs.wait_log("control", "ready.", 180)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                procs.check_alive()
                states = {u: _upload_row(db, u) for u in (expired, stuck, stuck_expired, ended)}
                if (
                    states[expired]["status"] == "expired"
                    and states[stuck]["status"] == "pending"
                    and states[stuck_expired]["status"] == "expired"
                    and all(s["part_rows"] == 0 for u, s in states.items() if u != stuck)
                ):
                    break
                time.sleep(0.5)
            else:
                pytest.fail(f"the sweep did not run: {states}{procs.logs()}")
        finally:
            procs.stop_all()

    for upload in (expired, stuck_expired, ended):
        assert _stored(server, upload) == []
    assert not (files / "file-dead-1").exists() and not (files / "file-dead-2").exists()
    assert _upload_row(db, stuck)["file_id"] is None
    # The live upload is as it was, and the one given back completes.
    assert (_upload_row(db, live)["status"], _upload_row(db, live)["part_rows"]) == ("pending", 1)
    with server.http() as http:
        assert "expired" in _error(_add(http, expired, b"6"))["message"]
        done = http.post(f"/v1/uploads/{stuck}/complete", json={"part_ids": [stuck_part]})
        assert done.status_code == 200, done.text
        assert http.get(f"/v1/files/{done.json()['file']['id']}/content").content == b"abc"


def test_beat_schedules_the_upload_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    from core.broker.queue import TASK_SWEEP_UPLOADS
    from core.settings import get_settings
    from worker.infra.celery import app, create_app

    assert "worker.batches.uploads" in app.conf.include  # every worker registers the task
    monkeypatch.setenv("BATCHD_UPLOAD_SWEEP_INTERVAL_S", "7")
    get_settings.cache_clear()
    try:
        entry = create_app().conf.beat_schedule["sweep-uploads"]
    finally:
        get_settings.cache_clear()
    assert entry["task"] == TASK_SWEEP_UPLOADS and entry["schedule"] == 7.0
