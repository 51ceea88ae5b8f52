"""`batchd up` on embedded defaults (SQLite, Celery's SQLAlchemy transport, a local storage
directory): the command a newcomer runs first must serve a batch end to end."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_batchd_up_embedded_mode_serves_a_batch(tmp_path: Path) -> None:
    from openai import OpenAI

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BATCHD_", "OPENAI_"))}
    env.update(BATCHD_HOME=str(tmp_path / "home"), BATCHD_MODELS="batchd-demo=demo:llama-tiny")
    log = (tmp_path / "up.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "up", "--port", str(port)],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        key = None
        deadline = time.monotonic() + 120
        while key is None and time.monotonic() < deadline:
            assert proc.poll() is None, Path(log.name).read_text()
            match = re.search(
                r"development API key \(tenant 'default'\): (\S+)", Path(log.name).read_text()
            )
            key = match.group(1) if match else None
            time.sleep(0.5)
        assert key, Path(log.name).read_text()
        assert (tmp_path / "home" / "batchd.db").exists()  # SQLite, not a server

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=8)
        while True:  # the API may still be starting
            try:
                models = client.models.list()
                break
            except Exception:
                assert time.monotonic() < deadline, Path(log.name).read_text()
                time.sleep(0.5)
        assert [m.id for m in models.data] == ["batchd-demo"]

        upload = client.files.create(
            file=(ROOT / "examples" / "chat.jsonl").open("rb"), purpose="batch"
        )
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 180
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, (batch, Path(log.name).read_text()[-3000:])
            time.sleep(0.5)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        assert batch.request_counts.completed == batch.request_counts.total == 8
        lines = client.files.content(batch.output_file_id).text.splitlines()
        assert [line.split('"custom_id":"')[1].split('"')[0] for line in lines] == [
            f"req-{i}" for i in range(8)
        ]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
