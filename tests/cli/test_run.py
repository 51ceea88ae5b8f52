"""``batchd run``: the offline runner on the llama-tiny demo model.

Output shapes and greedy parity with ``LLM.generate``; invalid lines; a run killed with
SIGKILL half-way and re-run ends with exactly one line per request, recomputing nothing
before its last checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.exit_codes import ExitCode
from cli.main import app
from testkit.builders import lines

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model() -> str:
    from core.llms.demo import build

    return str(build("llama-tiny"))


def completion_line(i: int, *, max_tokens: int = 6, **body) -> dict:
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": "/v1/completions",
        "body": {
            "model": "tiny",
            "prompt": f"the quick brown fox {i} jumps over",
            "max_tokens": max_tokens,
            "temperature": 0,
            **body,
        },
    }


def chat_line(i: int, *, max_tokens: int = 5) -> dict:
    return lines.chat_line(f"chat-{i}", f"hello world {i}", max_tokens, model="tiny")


def write_jsonl(path: Path, rows: list) -> Path:
    with path.open("w") as fh:
        for row in rows:
            fh.write(row if isinstance(row, str) else json.dumps(row))
            fh.write("\n")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# Where a test compares with LLM.generate: both in float32, whose greedy text does not depend
# on which sequences share a step (bf16, the default on a CPU that multiplies it, may).
FLOAT32 = ("--engine-options", '{"dtype": "float32"}')


def run_cli(*args: str) -> tuple[int, dict | None, str]:
    result = CliRunner().invoke(app, ["run", *args, "--json"], catch_exceptions=False)
    summary = json.loads(result.stdout) if result.stdout.strip() else None
    return result.exit_code, summary, result.stderr


def test_run_matches_llm_generate(tiny_model: str, tmp_path: Path) -> None:
    from engine import LLM, SamplingParams

    rows = [completion_line(i, max_tokens=3 + i % 5) for i in range(12)]
    rows[4]["body"]["n"] = 2  # two greedy choices: identical texts
    batch = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    code, summary, err = run_cli(
        str(batch), "-o", str(out), "--model", tiny_model, "--endpoint", "/v1/completions",
        "--max-num-seqs", "4", "--window", "4", "--model-name", "tiny", *FLOAT32,
    )  # fmt: skip
    assert code == ExitCode.OK, err
    assert summary["succeeded"] == 12 and summary["failed"] == 0
    lines = read_jsonl(out)
    assert [line["custom_id"] for line in lines] == [f"req-{i}" for i in range(12)]
    assert (tmp_path / "out.errors.jsonl").read_text() == ""
    assert not list(tmp_path.glob("*.partial")) and not list(tmp_path.glob("*.progress.json"))

    llm = LLM(tiny_model, dtype="float32")
    prompts = [row["body"]["prompt"] for row in rows]
    expected = llm.generate(
        prompts,
        [SamplingParams(max_tokens=row["body"]["max_tokens"], temperature=0) for row in rows],
        use_tqdm=False,
    )
    for line, want, row in zip(lines, expected, rows, strict=True):
        assert line["error"] is None and line["id"].startswith("batch_req_")
        response = line["response"]
        assert response["status_code"] == 200
        body = response["body"]
        assert body["object"] == "text_completion" and body["model"] == "tiny"
        n = row["body"].get("n", 1)
        assert [c["index"] for c in body["choices"]] == list(range(n))
        for choice in body["choices"]:
            assert choice["text"] == want.outputs[0].text
        assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        assert body["usage"]["completion_tokens"] == n * len(want.outputs[0].token_ids)


def test_run_chat_and_invalid_lines(tiny_model: str, tmp_path: Path) -> None:
    from engine import LLM, SamplingParams

    rows = [
        chat_line(0),
        "{not json",
        chat_line(1),
        {**chat_line(2), "url": "/v1/completions"},  # mismatched url
        {**chat_line(3), "custom_id": "chat-0"},  # duplicate custom_id
        {  # a prompt longer than the model's context
            **chat_line(4),
            "body": {
                **chat_line(4)["body"],
                "messages": [{"role": "user", "content": "hi " * 3000}],
            },
        },
        "",
        chat_line(5),
    ]
    batch = write_jsonl(tmp_path / "in.jsonl", rows)
    out, errors = tmp_path / "res.jsonl", tmp_path / "errs.jsonl"
    code, summary, err = run_cli(
        str(batch), "-o", str(out), "--errors", str(errors), "--model", tiny_model, *FLOAT32
    )
    assert code == ExitCode.COMPLETED_WITH_FAILURES, err
    assert summary["total"] == 7 and summary["invalid_lines"] == 3
    ok = read_jsonl(out)
    assert [line["custom_id"] for line in ok] == ["chat-0", "chat-1", "chat-5"]
    assert ok[0]["response"]["body"]["object"] == "chat.completion"
    assert ok[0]["response"]["body"]["model"] == "tiny"  # the request's own model name

    bad = read_jsonl(errors)
    codes = [line["response"]["body"]["error"]["code"] for line in bad]
    assert codes == [
        "invalid_json_line",
        "mismatched_url",
        "duplicate_custom_id",
        "context_length_exceeded",
    ]
    assert [line["custom_id"] for line in bad] == [None, "chat-2", "chat-0", "chat-4"]
    assert "Line 2" in bad[0]["response"]["body"]["error"]["message"]
    assert "line 4" in bad[1]["response"]["body"]["error"]["message"].lower()
    assert "line 5" in bad[2]["response"]["body"]["error"]["message"]
    assert all(line["response"]["status_code"] == 400 for line in bad)

    llm = LLM(tiny_model, dtype="float32")
    tok = llm.tokenizer
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "hello world 1"}], add_generation_prompt=True, tokenize=True
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    want = llm.generate([list(ids)], SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    assert ok[1]["response"]["body"]["choices"][0]["message"]["content"] == want[0].outputs[0].text


def test_run_refuses_a_file_with_no_valid_request(tmp_path: Path) -> None:
    batch = write_jsonl(tmp_path / "in.jsonl", [chat_line(i) for i in range(3)])
    # Every line targets chat, the run completions: nothing to run, and the model (a path
    # that does not exist) is never loaded.
    code, summary, err = run_cli(
        str(batch), "-o", str(tmp_path / "o.jsonl"), "--model", str(tmp_path / "no-model"),
        "--endpoint", "/v1/completions",
    )  # fmt: skip
    assert code == ExitCode.USAGE, err
    assert "no line" in err and "mismatched_url" in err
    assert not (tmp_path / "o.jsonl").exists()

    rows = [chat_line(0), "{bad"]
    batch = write_jsonl(tmp_path / "in2.jsonl", rows)
    code, _, err = run_cli(str(batch), "-o", str(tmp_path / "o.jsonl"), "--model", "x", "--strict")
    assert code == ExitCode.USAGE and "--strict" in err


def _spawn_run(batch: Path, out: Path, model: str, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "cli", "run", str(batch), "-o", str(out), "--model", model,
         "--endpoint", "/v1/completions", "--max-num-seqs", "8", "--window", "16",
         "--checkpoint-every", "8", "--json", *extra],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


@pytest.mark.slow
def test_sigkill_and_resume(tiny_model: str, tmp_path: Path) -> None:
    total = 400
    rows = [completion_line(i, max_tokens=1 + i % 3) for i in range(total)]
    rows[100] = "{broken"  # an invalid line on the way: an error line, also resumed correctly
    batch = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    progress_file = tmp_path / "out.jsonl.progress.json"

    proc = _spawn_run(batch, out, tiny_model)
    seen = 0
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                seen = json.loads(progress_file.read_text())["requests_done"]
            except (FileNotFoundError, ValueError, KeyError):
                seen = 0
            if seen >= 120:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        assert 120 <= seen < total
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    checkpoint = json.loads(progress_file.read_text())["requests_done"]
    assert checkpoint >= seen
    assert not out.exists()  # results are still in the partial files

    proc = _spawn_run(batch, out, tiny_model)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == ExitCode.COMPLETED_WITH_FAILURES, stderr.decode()[-2000:]
    summary = json.loads(stdout)
    assert summary["resumed_requests"] == checkpoint >= seen
    assert summary["computed_requests"] == total - checkpoint
    assert b"resuming at line" in stderr

    lines = read_jsonl(out)
    errors = read_jsonl(tmp_path / "out.errors.jsonl")
    expected_ids = [f"req-{i}" for i in range(total) if i != 100]
    assert [line["custom_id"] for line in lines] == expected_ids
    assert len(errors) == 1 and "Line 101" in errors[0]["response"]["body"]["error"]["message"]
    assert summary["succeeded"] == total - 1 and summary["failed"] == 1
    assert not progress_file.exists() and not list(tmp_path.glob("*.partial"))

    # The resumed output is what one uninterrupted run produces.
    fresh = tmp_path / "fresh.jsonl"
    code, _, err = run_cli(
        str(batch), "-o", str(fresh), "--model", tiny_model, "--endpoint", "/v1/completions",
        "--max-num-seqs", "32",
    )  # fmt: skip
    assert code == ExitCode.COMPLETED_WITH_FAILURES, err

    def texts(path: Path) -> list[str]:
        return [line["response"]["body"]["choices"][0]["text"] for line in read_jsonl(path)]

    assert texts(out) == texts(fresh)


@pytest.mark.slow
def test_sigint_checkpoints_and_resume_refuses_other_options(
    tiny_model: str, tmp_path: Path
) -> None:
    rows = [completion_line(i, max_tokens=2) for i in range(300)]
    batch = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    progress_file = tmp_path / "out.jsonl.progress.json"
    proc = _spawn_run(batch, out, tiny_model, "--checkpoint-every", "100000")
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if (
                out.with_name("out.jsonl.partial").exists()
                and out.with_name("out.jsonl.partial").stat().st_size > 2000
            ):
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == ExitCode.INTERRUPTED, stderr.decode()[-2000:]
    done = json.loads(progress_file.read_text())["requests_done"]
    assert done > 0  # the interrupt wrote a checkpoint although --checkpoint-every is huge

    code, _, err = run_cli(
        str(batch), "-o", str(out), "--model", tiny_model, "--endpoint", "/v1/chat/completions"
    )
    assert code == ExitCode.USAGE and "--restart" in err

    proc = _spawn_run(batch, out, tiny_model)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == ExitCode.OK, stderr.decode()[-2000:]
    assert json.loads(stdout)["resumed_requests"] == done
    assert [line["custom_id"] for line in read_jsonl(out)] == [f"req-{i}" for i in range(300)]


def test_run_reports_a_model_that_does_not_load(tmp_path: Path) -> None:
    batch = write_jsonl(tmp_path / "in.jsonl", [chat_line(0)])
    code, _, err = run_cli(str(batch), "-o", str(tmp_path / "o.jsonl"), "--model", "/nonexistent")
    assert code == ExitCode.ERROR
    assert "cannot load the model /nonexistent" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == [batch]  # no partial or progress files


def test_engine_options_json_reaches_the_engine(tiny_model: str, tmp_path: Path) -> None:
    batch = write_jsonl(tmp_path / "in.jsonl", [completion_line(i) for i in range(3)])
    out = tmp_path / "o.jsonl"
    code, summary, err = run_cli(
        str(batch), "-o", str(out), "--model", tiny_model, "--endpoint", "/v1/completions",
        "--engine-options", '{"admission": "fcfs", "max_model_len": 64}',
    )  # fmt: skip
    assert code == ExitCode.OK, err
    assert summary["succeeded"] == 3 and len(read_jsonl(out)) == 3

    code, _, err = run_cli(
        str(batch), "-o", str(tmp_path / "o2.jsonl"), "--model", tiny_model,
        "--endpoint", "/v1/completions", "--engine-options", '{"no_such_option": 1}',
    )  # fmt: skip
    assert code == ExitCode.ERROR and "no_such_option" in err
    code, _, err = run_cli(
        str(batch), "-o", str(tmp_path / "o3.jsonl"), "--model", tiny_model,
        "--engine-options", "[1]",
    )  # fmt: skip
    assert code == ExitCode.USAGE and "JSON object" in err
