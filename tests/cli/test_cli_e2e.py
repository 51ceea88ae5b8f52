"""The client commands against the whole service (API, control and model workers, beat) on the
tiny demo model: the exit codes a pipeline sees for completed, completed-with-failures,
failed, expired and cancelled batches, and the downloaded files."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.exit_codes import ExitCode
from cli.main import app
from testkit.builders.lines import chat_line
from tests.e2e.conftest import API_KEY, MODEL, stack  # noqa: F401  (the e2e service fixture)

pytestmark = [pytest.mark.services, pytest.mark.slow]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def batchd(stack, *args: str):  # noqa: F811
    return CliRunner().invoke(
        app,
        [*args, "--base-url", stack.base_url, "--api-key", API_KEY],
        catch_exceptions=False,
    )


def test_submit_wait_download(stack, tmp_path: Path) -> None:  # noqa: F811
    rows = [chat_line(f"r{i}", f"hello {i}", 4) for i in range(6)]
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    result = batchd(
        stack, "submit", str(write_jsonl(tmp_path / "in.jsonl", rows)), "--wait",
        "-o", str(out), "--errors", str(err), "--poll-interval", "0.2", "--timeout", "240",
    )  # fmt: skip
    assert result.exit_code == ExitCode.OK, result.output
    batch_id = result.stdout.strip()
    assert batch_id.startswith("batch_")
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == [f"r{i}" for i in range(6)]
    assert err.read_text() == ""

    rows[2] = chat_line("r2", "hi " * 3000, 4)  # longer than the model's context
    result = batchd(
        stack, "submit", str(write_jsonl(tmp_path / "in2.jsonl", rows)), "--wait", "--json",
        "-o", str(out), "--errors", str(err), "--poll-interval", "0.2", "--timeout", "240",
    )  # fmt: skip
    assert result.exit_code == ExitCode.COMPLETED_WITH_FAILURES, result.output
    assert json.loads(result.stdout)["request_counts"]["failed"] == 1
    assert len(out.read_text().splitlines()) == 5
    (error,) = [json.loads(x) for x in err.read_text().splitlines()]
    assert error["custom_id"] == "r2"

    result = batchd(stack, "download", batch_id, "-o", str(tmp_path / "again.jsonl"))
    assert result.exit_code == ExitCode.OK, result.output
    assert len((tmp_path / "again.jsonl").read_text().splitlines()) == 6


def test_validation_failure_exit_code(stack, tmp_path: Path) -> None:  # noqa: F811
    rows = [chat_line("a", "hi", 2), "{not json", chat_line("a", "again", 2)]
    result = batchd(
        stack, "submit", str(write_jsonl(tmp_path / "in.jsonl", rows)), "--wait",
        "--poll-interval", "0.2", "--timeout", "120",
    )  # fmt: skip
    assert result.exit_code == ExitCode.FAILED, result.output
    assert "line 2:" in result.stderr and "line 3:" in result.stderr


def test_cancel_then_wait_exits_cancelled(stack, tmp_path: Path) -> None:  # noqa: F811
    rows = [chat_line(f"long-{i}", f"river {i}", 16, ignore_eos=True) for i in range(31)]
    with stack.gate("cli_cancel") as gate:  # the last line holds the batch until cancelled
        rows.append(chat_line("long-31", f"river {gate.marker}", 16, ignore_eos=True))
        result = batchd(stack, "submit", str(write_jsonl(tmp_path / "in.jsonl", rows)))
        assert result.exit_code == ExitCode.OK, result.output
        batch_id = result.stdout.strip()
        deadline = time.monotonic() + 90
        while True:
            status = json.loads(batchd(stack, "status", batch_id, "--json").stdout)["status"]
            if status == "in_progress" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert status == "in_progress"
        result = batchd(stack, "cancel", batch_id)
        assert result.exit_code == ExitCode.OK and result.stdout.split() == [batch_id, "cancelling"]
        result = batchd(stack, "wait", batch_id, "--poll-interval", "0.2", "--timeout", "60")
        assert result.exit_code == ExitCode.CANCELLED, result.output
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    result = batchd(stack, "download", batch_id, "-o", str(out), "--errors", str(err))
    assert result.exit_code == ExitCode.OK, result.output
    ids = [json.loads(x)["custom_id"] for x in out.read_text().splitlines()]
    ids += [json.loads(x)["custom_id"] for x in err.read_text().splitlines()]
    assert sorted(ids) == sorted(f"long-{i}" for i in range(32))


def test_expired_batch_exits_expired(stack, tmp_path: Path) -> None:  # noqa: F811
    """A real expiry: an 8-second window (time to validate even on a busy machine) over a
    workload held past it (its last line holds the engine, however fast the machine); the
    beat sweep expires it and `submit --wait` exits with the expired code, the finished
    results and `batch_expired` lines downloaded."""
    with stack.gate("cli_expiry") as gate:
        rows = [chat_line(f"slow-{i}", f"ocean {i}", 16, ignore_eos=True) for i in range(15)]
        rows.append(chat_line("slow-15", f"ocean {gate.marker}", 16, ignore_eos=True))
        out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
        result = batchd(
            stack, "submit", str(write_jsonl(tmp_path / "in.jsonl", rows)), "--window", "8s",
            "--wait", "-o", str(out), "--errors", str(err), "--poll-interval", "0.2",
            "--timeout", "120",
        )  # fmt: skip
    assert result.exit_code == ExitCode.EXPIRED, result.output
    errors = [json.loads(x) for x in err.read_text().splitlines()] if err.exists() else []
    assert errors, (result.output, out.exists(), err.exists())
    assert all(e["error"]["code"] == "batch_expired" for e in errors)
    done = out.read_text().splitlines() if out.exists() else []
    assert len(done) + len(errors) == len(rows)
    assert "slow-15" in {e["custom_id"] for e in errors}
