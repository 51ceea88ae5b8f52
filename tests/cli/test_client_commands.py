"""The client commands against a real API server (no worker), and against a closed port.

With no worker running, a created batch stays ``validating``; the tests that need a finished
batch move it with ``core.database.lifecycle.transition`` — the same conditional UPDATE the worker
uses.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.exit_codes import ExitCode
from cli.main import app

pytestmark = pytest.mark.services


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_batch_file(path: Path, n: int = 3) -> Path:
    with path.open("w") as fh:
        for i in range(n):
            body = {"model": "batchd-demo", "messages": [{"role": "user", "content": f"hi {i}"}]}
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions"}
            fh.write(json.dumps({**line, "body": body}) + "\n")
    return path


def invoke(cli: CliRunner, base_url: str, *args: str):
    return cli.invoke(app, [*args, "--base-url", base_url], catch_exceptions=False)


def set_status(batch_id: str, *path: str, **values) -> None:
    """Walk the batch through ``path`` with the lifecycle's conditional UPDATEs."""
    from core.database.lifecycle import transition
    from core.database.sessions import session_scope

    with session_scope() as session:
        from core.database.tables import Batch

        current = session.get(Batch, batch_id).status
        for i, target in enumerate(path):
            extra = values if i == len(path) - 1 else {}
            assert transition(session, batch_id, current, target, **extra), (current, target)
            current = target
        session.commit()


def test_submit_status_list_cancel_wait(cli: CliRunner, api_server, tmp_path: Path) -> None:
    url = api_server.base_url
    batch_file = write_batch_file(tmp_path / "in.jsonl")

    result = invoke(cli, url, "submit", str(batch_file), "--metadata", "team=nlp")
    assert result.exit_code == ExitCode.OK, result.output
    batch_id = result.stdout.strip()
    assert batch_id.startswith("batch_") and "\n" not in batch_id

    result = invoke(
        cli, url, "submit", str(batch_file), "--json", "--idempotency-key", "k-1", "--window", "24h"
    )
    assert result.exit_code == ExitCode.OK, result.output
    second = json.loads(result.stdout)
    assert second["object"] == "batch" and second["status"] == "validating"

    result = invoke(cli, url, "status", batch_id, "--json")
    assert result.exit_code == ExitCode.OK, result.output
    batch = json.loads(result.stdout)
    assert batch["id"] == batch_id
    assert batch["metadata"] == {"team": "nlp"}
    assert batch["endpoint"] == "/v1/chat/completions"

    result = invoke(cli, url, "status", batch_id)
    assert result.exit_code == ExitCode.OK
    assert batch_id in result.stdout and "validating" in result.stdout

    result = invoke(cli, url, "list", "--limit", "10")
    assert result.exit_code == ExitCode.OK, result.output
    assert batch_id in result.stdout and second["id"] in result.stdout
    result = invoke(cli, url, "list", "--json")
    assert {b["id"] for b in json.loads(result.stdout)["data"]} >= {batch_id, second["id"]}

    # Not finished: wait times out, download refuses.
    result = invoke(cli, url, "wait", batch_id, "--timeout", "0.3", "--poll-interval", "0.1")
    assert result.exit_code == ExitCode.TIMEOUT, result.output
    result = invoke(cli, url, "download", batch_id, "-o", str(tmp_path / "out.jsonl"))
    assert result.exit_code == ExitCode.ERROR
    assert "no results yet" in result.stderr

    result = invoke(cli, url, "cancel", batch_id)
    assert result.exit_code == ExitCode.OK, result.output
    assert result.stdout.split() == [batch_id, "cancelling"]

    # The worker's cancel task would finish it; do what it does, then wait sees it.
    set_status(batch_id, "cancelled")
    result = invoke(cli, url, "wait", batch_id, "--poll-interval", "0.1", "--json")
    assert result.exit_code == ExitCode.CANCELLED, result.output
    assert json.loads(result.stdout)["status"] == "cancelled"

    # Cancelling a finished batch: the server's own message, exit 1, no traceback.
    result = invoke(cli, url, "cancel", batch_id)
    assert result.exit_code == ExitCode.ERROR
    assert "Cannot cancel batch" in result.stderr and "Traceback" not in result.output


def test_wait_and_download_completed(cli: CliRunner, api_server, tmp_path: Path) -> None:
    url = api_server.base_url
    batch_file = write_batch_file(tmp_path / "in.jsonl")
    result = invoke(cli, url, "submit", str(batch_file))
    batch_id = result.stdout.strip()
    # Stand-ins for the result files: any uploaded file has content to download.
    output_src = write_batch_file(tmp_path / "fake-output.jsonl", 2)
    result = invoke(cli, url, "submit", str(output_src), "--json")
    output_file_id = json.loads(result.stdout)["input_file_id"]

    set_status(
        batch_id,
        "in_progress",
        "finalizing",
        "completed",
        output_file_id=output_file_id,
        request_total=3,
        request_completed=2,
        request_failed=1,
    )
    result = invoke(cli, url, "wait", batch_id, "--poll-interval", "0.1")
    assert result.exit_code == ExitCode.COMPLETED_WITH_FAILURES, result.output
    assert "2 completed, 1 failed of 3" in result.stderr

    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    result = invoke(cli, url, "download", batch_id, "-o", str(out), "--errors", str(err), "--json")
    assert result.exit_code == ExitCode.OK, result.output
    assert out.read_bytes() == output_src.read_bytes()
    assert err.read_bytes() == b""  # no error file id: an empty file, so the path exists
    assert json.loads(result.stdout)["output_bytes"] == output_src.stat().st_size


def test_submit_wait_with_timeout(cli: CliRunner, api_server, tmp_path: Path) -> None:
    batch_file = write_batch_file(tmp_path / "in.jsonl")
    result = invoke(
        cli, api_server.base_url, "submit", str(batch_file), "--wait",
        "--timeout", "0.3", "--poll-interval", "0.1",
    )  # fmt: skip
    assert result.exit_code == ExitCode.TIMEOUT, result.output
    assert result.stdout.strip().startswith("batch_")


def test_server_error_envelope(cli: CliRunner, api_server) -> None:
    result = invoke(cli, api_server.base_url, "status", "batch_doesnotexist")
    assert result.exit_code == ExitCode.ERROR
    assert "batch_doesnotexist" in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize(
    "args",
    [
        ["status", "batch_x"],
        ["list"],
        ["wait", "batch_x"],
        ["cancel", "batch_x"],
        ["submit", "FILE"],
    ],
)
def test_unreachable_server(cli: CliRunner, tmp_path: Path, args: list[str]) -> None:
    batch_file = write_batch_file(tmp_path / "in.jsonl")
    args = [str(batch_file) if a == "FILE" else a for a in args]
    result = invoke(cli, f"http://127.0.0.1:{free_port()}/v1", *args)
    assert result.exit_code == ExitCode.UNREACHABLE, result.output
    assert "Cannot reach the server" in result.stderr
    assert "Traceback" not in result.output


def test_connection_settings_from_env(cli: CliRunner, monkeypatch, tmp_path: Path) -> None:
    port = free_port()
    monkeypatch.delenv("BATCHD_BASE_URL", raising=False)
    monkeypatch.setenv("OPENAI_BASE_URL", f"http://127.0.0.1:{port}/v1")
    result = cli.invoke(app, ["status", "batch_x"])
    assert result.exit_code == ExitCode.UNREACHABLE
    assert f"127.0.0.1:{port}" in result.stderr
    monkeypatch.setenv("BATCHD_BASE_URL", f"http://127.0.0.1:{port + 1}/v1")
    result = cli.invoke(app, ["status", "batch_x"])
    assert f"127.0.0.1:{port + 1}" in result.stderr


def test_usage_errors(cli: CliRunner, tmp_path: Path) -> None:
    result = cli.invoke(app, ["submit", str(tmp_path / "missing.jsonl")])
    assert result.exit_code == ExitCode.USAGE
    batch_file = write_batch_file(tmp_path / "in.jsonl")
    result = cli.invoke(app, ["submit", str(batch_file), "--metadata", "novalue"])
    assert result.exit_code == ExitCode.USAGE
    result = cli.invoke(app, ["--help"])
    assert "Exit codes" in result.stdout and "cancelled" in result.stdout


def _flat(text: str) -> str:
    """Text from rich's error box, without its borders and line breaks."""
    return " ".join(text.replace("│", " ").split())


def _uploaded_files(base_url: str) -> list[dict]:
    import httpx

    from tests.conftest import STATIC_TEST_KEY

    headers = {"Authorization": f"Bearer {STATIC_TEST_KEY}"}
    return httpx.get(f"{base_url}/files", headers=headers).json()["data"]


def test_submit_takes_the_endpoint_from_the_file(
    cli: CliRunner, api_server, tmp_path: Path
) -> None:
    url = api_server.base_url
    examples = Path(__file__).resolve().parents[2] / "examples" / "completions.jsonl"
    result = invoke(cli, url, "submit", str(examples), "--json")
    assert result.exit_code == ExitCode.OK, result.output
    assert json.loads(result.stdout)["endpoint"] == "/v1/completions"
    assert "endpoint /v1/completions (from line 1" in result.stderr

    # A file mixing endpoints fails before anything is uploaded, naming the line.
    before = len(_uploaded_files(url))
    mixed = write_batch_file(tmp_path / "mixed.jsonl", 2)
    with mixed.open("a") as fh:
        fh.write(examples.read_text().splitlines()[0] + "\n")
    result = invoke(cli, url, "submit", str(mixed))
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "Line 3" in _flat(result.output) and "one endpoint" in _flat(result.output)
    # So does an --endpoint the file contradicts.
    result = invoke(cli, url, "submit", str(examples), "--endpoint", "/v1/chat/completions")
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "line 1 has url '/v1/completions'" in _flat(result.output)
    assert len(_uploaded_files(url)) == before


def test_failed_batch_writes_no_output(cli: CliRunner, api_server, tmp_path: Path) -> None:
    import threading

    url = api_server.base_url
    batch_file = write_batch_file(tmp_path / "in.jsonl")
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    stop = threading.Event()
    from core.database.sessions import session_scope
    from core.database.tables import Batch

    def validating() -> set[str]:
        with session_scope() as session:
            return {b.id for b in session.query(Batch).filter_by(status="validating")}

    earlier = validating()

    def fail_it() -> None:  # what the worker's validate does to a bad file
        while not stop.is_set():
            batch_id = next(iter(validating() - earlier), None)
            if batch_id:
                set_status(batch_id, "failed")
                return
            stop.wait(0.05)

    failer = threading.Thread(target=fail_it, daemon=True)
    failer.start()
    try:
        result = invoke(
            cli, url, "submit", str(batch_file), "--wait", "--poll-interval", "0.1",
            "--timeout", "60", "-o", str(out), "--errors", str(err),
        )  # fmt: skip
    finally:
        stop.set()
        failer.join()
    assert result.exit_code == ExitCode.FAILED, result.output
    assert "there is no output" in result.stderr and "wrote" not in result.stderr
    assert not out.exists() and not err.exists()

    batch_id = result.stdout.strip()
    result = invoke(cli, url, "download", batch_id, "-o", str(out))
    assert result.exit_code == ExitCode.FAILED, result.output
    assert "there is no output" in result.stderr and not out.exists()


def test_list_never_cuts_ids(cli: CliRunner, api_server, tmp_path: Path, monkeypatch) -> None:
    from rich.console import Console

    from cli.client_commands import _batch_table

    url = api_server.base_url
    batch_file = write_batch_file(tmp_path / "in.jsonl")
    ids = [invoke(cli, url, "submit", str(batch_file)).stdout.strip() for _ in range(2)]
    for width in (80, 60, 200):
        monkeypatch.setenv("COLUMNS", str(width))
        result = invoke(cli, url, "list")
        assert result.exit_code == ExitCode.OK, result.output
        lines = result.stdout.splitlines()
        assert all(len(line) <= width for line in lines), result.stdout
        for batch_id in ids:  # whole, on one line
            assert any(batch_id in line for line in lines), result.stdout
        assert ("endpoint" in result.stdout) == (width >= 120)

    # A status wider than the rest still leaves the id whole.
    batches = [{"id": "batch_" + "f" * 24, "status": "in_progress", "request_counts": {}}]
    console = Console(width=50, record=True)
    console.print(_batch_table(batches, 50))
    assert "batch_" + "f" * 24 in console.export_text()
