"""Hostile input through the whole service: malformed batch files uploaded with the official
``openai`` client and run by the real workers.

Every file either fails validation with clear ``errors.data`` entries (code, message, param and
the line an editor shows) or completes with per-request error lines; the API never answers 500
and no worker crashes: after the corpus a normal batch still completes on the same worker
processes. Hostile upload file names are stored harmlessly and downloaded with a safe
``Content-Disposition``.

The files are all uploaded and submitted first, so they validate (and run) side by side; one
stack serves the whole module.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.builders.lines import MODEL
from testkit.service.stack import API_KEY

pytestmark = [pytest.mark.services, pytest.mark.slow]

TERMINAL = {"completed", "failed", "expired", "cancelled"}
CHAT = "/v1/chat/completions"
CONTEXT = 1024  # demo:llama-tiny's max_position_embeddings
MAX_LINE_BYTES = 8 * 1024 * 1024  # BATCHD_MAX_LINE_BYTES's default


def chat(custom_id: Any, text: str = "hello", max_tokens: Any = 4, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "temperature": 0,
            **body,
        },
    }


def line(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def jsonl(*lines: Any, end: bytes = b"\n") -> bytes:
    return b"".join((x if isinstance(x, bytes) else line(x)) + end for x in lines)


def with_(obj: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {**obj, **fields}


def body_with(custom_id: str, **fields: Any) -> dict[str, Any]:
    req = chat(custom_id)
    req["body"].update(fields)
    return req


# (line, code, param) expected in errors.data, in this order.
Expected = list[tuple[int | None, str, str | None]]


@dataclass
class Case:
    name: str
    data: bytes
    errors: Expected | None = None  # None: the batch completes
    outputs: list[str] = field(default_factory=list)  # custom_ids of the output file
    request_errors: dict[str, str] = field(default_factory=dict)  # custom_id -> code
    check: Callable[[Any, list[dict[str, Any]]], None] | None = None


def _duplicate_message(batch: Any, errors: list[dict[str, Any]]) -> None:
    message = errors[0]["message"]
    assert "line 1" in message and "line 3" in message, message


def _line_limit_message(batch: Any, errors: list[dict[str, Any]]) -> None:
    assert str(MAX_LINE_BYTES) in errors[0]["message"], errors[0]


def _max_tokens_message(batch: Any, errors: list[dict[str, Any]]) -> None:
    err = next(e for e in errors if e["custom_id"] == "huge-max-tokens")
    body = err["response"]["body"]["error"]
    assert str(CONTEXT) in body["message"] and body["param"] == "body.max_tokens", body


HUGE_LINE = b'{"custom_id": "huge", "pad": "' + b"x" * (20 * 1024 * 1024) + b'"}'
DEEP_ARRAY = b"[" * 10_000 + b"]" * 10_000
DEEP_OBJECT = b'{"custom_id": "deep", "body": ' + b'{"a": ' * 10_000 + b"1" + b"}" * 10_001

CORPUS = [
    Case(
        "invalid-utf8",
        jsonl(chat("ok"), b'{"custom_id": "bad\xff\xfeutf8", "method": "POST"}', chat("ok2")),
        [(2, "invalid_encoding", None)],
    ),
    Case("bom", b"\xef\xbb\xbf" + jsonl(chat("b1"), chat("b2")), outputs=["b1", "b2"]),
    Case(
        "crlf", jsonl(chat("c1"), chat("c2"), chat("c3"), end=b"\r\n"), outputs=["c1", "c2", "c3"]
    ),
    Case(
        "blank-lines-accepted",
        jsonl(b"", chat("k1"), b"", b"   \t", chat("k2"), b"", b"", end=b"\n"),
        outputs=["k1", "k2"],
    ),
    Case(
        "blank-lines-numbered",
        jsonl(chat("n1"), b"", b"  ", chat("n2"), b"\r", with_(chat("n3"), method="GET"), b"", b""),
        [(6, "invalid_method", "method")],
    ),
    Case(
        "20mb-line",
        jsonl(chat("before"), HUGE_LINE, chat("after")),
        [(2, "line_too_long", None)],
        check=_line_limit_message,
    ),
    Case(
        "nested-10000-deep",
        jsonl(chat("shallow"), DEEP_ARRAY, DEEP_OBJECT),
        [(2, "invalid_json_line", None), (3, "invalid_json_line", None)],
    ),
    Case(
        "duplicate-custom-ids",
        jsonl(chat("same"), chat("other"), chat("same")),
        [(3, "duplicate_custom_id", "custom_id")],
        check=_duplicate_message,
    ),
    Case(
        "wrong-types",
        jsonl(
            chat(12345),
            with_(chat("w2"), body=[{"model": MODEL}]),
            body_with("w3", messages="hello"),
            body_with("w4", max_tokens="16"),
            body_with("w5", temperature="0.5"),
            body_with("w6", stop=7),
            body_with("w7", n=0),
            body_with("w8", logprobs="yes"),
            with_(chat("w9"), custom_id=None),
            with_(chat("w10"), body="{}"),
        ),
        [
            (1, "invalid_custom_id", "custom_id"),
            (2, "invalid_type", "body"),
            (3, "invalid_type", "body.messages"),
            (4, "invalid_type", "body.max_tokens"),
            (5, "invalid_type", "body.temperature"),
            (6, "invalid_type", "body.stop"),
            (7, "invalid_value", "body.n"),
            (8, "invalid_type", "body.logprobs"),
            (9, "missing_custom_id", "custom_id"),
            (10, "invalid_type", "body"),
        ],
    ),
    Case(
        "unknown-urls",
        jsonl(
            with_(chat("u1"), url="/v1/moderations"),
            with_(chat("u2"), url="/v2/chat/completions"),
            with_(chat("u3"), url=["/v1/chat/completions"]),
            with_(chat("u4"), url="/v1/completions"),
            {k: v for k, v in chat("u5").items() if k != "url"},
        ),
        [
            (1, "invalid_url", "url"),
            (2, "invalid_url", "url"),
            (3, "invalid_url", "url"),
            (4, "mismatched_url", "url"),
            (5, "invalid_url", "url"),
        ],
    ),
    Case(
        "unknown-model",
        jsonl(chat("m1"), body_with("m2", model="gpt-9-ultra"), body_with("m3", model="")),
        [(2, "model_not_found", "body.model"), (3, "model_not_found", "body.model")],
    ),
    Case(
        "methods",
        jsonl(with_(chat("g1"), method="GET"), with_(chat("g2"), method="post"), chat("g3")),
        [(1, "invalid_method", "method"), (2, "invalid_method", "method")],
    ),
    Case("empty-file", b"", [(None, "empty_file", None)]),
    Case("only-blank-lines", b"\n\n   \r\n\t\n\n", [(None, "empty_file", None)]),
    Case(
        "json-array-line",
        jsonl(chat("a1"), [chat("a2")], b'"just a string"', b"42", b"null"),
        [(i, "invalid_json_line", None) for i in (2, 3, 4, 5)],
    ),
    Case(
        "not-json",
        jsonl(b"{'custom_id': 'single quotes'}", b'{"custom_id": "x", "t": NaN}', b"{"),
        [(i, "invalid_json_line", None) for i in (1, 2, 3)],
    ),
    Case(
        # Valid JSON that is not valid Unicode: a lone UTF-16 surrogate escape.
        "lone-surrogates",
        jsonl(
            chat("s1"),
            b'{"custom_id": "s\\ud800", "method": "POST", "url": "/v1/chat/completions", '
            b'"body": {"model": "batchd-demo", "messages": [{"role": "user", "content": "x"}]}}',
            b'{"custom_id": "s3", "method": "POST", "url": "/v1/chat/completions", '
            b'"body": {"model": "batchd-demo", "messages": [{"role": "user", "content": "\\udc00"}]}}',
            b'{"custom_id": "s4", "method": "POST", "url": "/v1/chat/completions", '
            b'"body": {"model": "\\ud83d", "messages": [{"role": "user", "content": "x"}]}}',
        ),
        [
            (2, "invalid_encoding", None),
            (3, "invalid_encoding", None),
            (4, "invalid_encoding", None),
        ],
    ),
    Case(
        # NUL characters are valid JSON; an error message quoting one must still be storable.
        "nul-characters",
        jsonl(chat("nul\x00id"), chat("nul\x00id"), body_with("z3", model="m\x00")),
        [(2, "duplicate_custom_id", "custom_id"), (3, "model_not_found", "body.model")],
    ),
    Case(
        "per-request-errors",
        jsonl(
            chat("fine-1", max_tokens=3),
            chat("too-long-prompt", "the cat sat on the mat " * 300, max_tokens=4),
            chat("huge-max-tokens", max_tokens=10**9),
            body_with("huge-max-completion-tokens", max_tokens=None, max_completion_tokens=10**20),
            chat("fine-2", max_tokens=3),
        ),
        outputs=["fine-1", "fine-2"],
        request_errors={
            "too-long-prompt": "context_length_exceeded",
            "huge-max-tokens": "invalid_value",
            "huge-max-completion-tokens": "invalid_value",
        },
        check=_max_tokens_message,
    ),
]


def _worker_pids(stack) -> dict[str, int]:
    """The PIDs of this stack's control and model workers (found by their BATCHD_HOME)."""
    home = f"BATCHD_HOME={stack.env['BATCHD_HOME']}".encode()
    found: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if home not in environ:
            continue
        for name in ("control", "model"):
            if f"{name}@e2e".encode() in cmdline:
                assert name not in found, f"two {name} workers: {found[name]} and {entry.name}"
                found[name] = int(entry.name)
    return found


def _wait_all(stack, ids: list[str], timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    done: dict[str, Any] = {}
    while True:
        for batch_id in ids:
            if batch_id not in done:
                batch = stack.client.batches.retrieve(batch_id)
                if batch.status in TERMINAL:
                    done[batch_id] = batch
        if len(done) == len(ids):
            return done
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{len(ids) - len(done)} batches unfinished after {timeout}s\n"
                + stack.log("control")[-4000:]
                + stack.log("model")[-3000:]
            )
        time.sleep(0.3)


def _download(stack, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    text = stack.client.files.content(file_id).text
    return [json.loads(x) for x in text.splitlines() if x.strip()]


@pytest.fixture(scope="module")
def corpus(stack) -> dict[str, tuple[Case, Any]]:
    """Upload and submit every file at once; their batches once they have all ended."""
    pids = _worker_pids(stack)
    assert set(pids) == {"control", "model"}, pids
    stack.pids_before = pids
    submitted: dict[str, tuple[Case, str]] = {}
    for case in CORPUS:
        f = stack.client.files.create(
            file=(f"{case.name}.jsonl", io.BytesIO(case.data)), purpose="batch"
        )
        assert f.bytes == len(case.data), (case.name, f)
        batch = stack.client.batches.create(
            input_file_id=f.id, endpoint=CHAT, completion_window="24h"
        )
        submitted[case.name] = (case, batch.id)
    done = _wait_all(stack, [b for _, b in submitted.values()], 90)
    return {name: (case, done[batch_id]) for name, (case, batch_id) in submitted.items()}


@pytest.mark.parametrize("case", CORPUS, ids=[c.name for c in CORPUS])
def test_hostile_file(stack, corpus, case: Case):
    _, batch = corpus[case.name]
    if case.errors is not None:
        assert batch.status == "failed", batch
        assert batch.errors is not None, batch
        errors = [e.model_dump() for e in batch.errors.data]
        got = [(e["line"], e["code"], e["param"]) for e in errors]
        assert got == case.errors, errors
        for e in errors:
            assert e["message"] and len(e["message"]) < 1000, e
            if e["line"] is not None:
                assert f"line {e['line']}" in e["message"].lower() or e["param"], e
        assert batch.output_file_id is None
        if case.check:
            case.check(batch, errors)
        return

    assert batch.status == "completed", batch
    out = _download(stack, batch.output_file_id)
    err = _download(stack, batch.error_file_id)
    assert [r["custom_id"] for r in out] == case.outputs
    assert all(r["response"]["status_code"] == 200 for r in out)
    got = {r["custom_id"]: r["response"]["body"]["error"]["code"] for r in err}
    assert got == case.request_errors, err
    for r in err:
        assert r["response"]["status_code"] == 400, r
        assert r["response"]["body"]["error"]["message"], r
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (
        len(case.outputs) + len(case.request_errors),
        len(case.outputs),
        len(case.request_errors),
    )
    if case.check:
        case.check(batch, err)


# ---------------------------------------------------------------------------------------------
# Hostile file names (tests/api covers traversal and control characters through a raw
# multipart body; here: the openai client's encoding, NUL, CR/LF, over-long names, and a
# hostile name on a file that a batch then really reads).

GOOD = jsonl(chat("named-1"), chat("named-2"))
CLIENT_NAMES = [
    "../../etc/passwd",
    "dir/sub/file.jsonl",
    "dir\\sub\\file.jsonl",
    "nul\x00name.jsonl",
    "cr\r\nlf.jsonl",
    "é" * 300 + ".jsonl",
    "x" * 5000,
]


def _safe_disposition(value: str) -> None:
    assert value.isascii() and value.isprintable(), value
    assert value.startswith('attachment; filename="'), value
    plain = value.split('filename="', 1)[1].split('"; filename*=', 1)[0]
    assert not any(ch in plain for ch in '"\\/;'), value


def _check_stored(stack, file_id: str, name: str) -> None:
    assert name and len(name) <= 255, name
    assert not any(ch in name for ch in "/\\\x00\r\n"), name
    assert name not in {".", ".."}
    resp = httpx.get(
        f"{stack.base_url}/files/{file_id}/content",
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    assert resp.content == GOOD
    _safe_disposition(resp.headers["content-disposition"])


@pytest.mark.parametrize("name", CLIENT_NAMES, ids=range(len(CLIENT_NAMES)))
def test_hostile_file_name_through_the_client(stack, name: str):
    f = stack.client.files.create(file=(name, io.BytesIO(GOOD)), purpose="batch")
    _check_stored(stack, f.id, f.filename)
    assert stack.client.files.retrieve(f.id).filename == f.filename


RAW_NAMES = [
    b"raw\x00nul.jsonl",
    b"raw\x7f\xc2\x85nel\xe2\x80\xa8ls\xe2\x80\xaertl.jsonl",
    b"\xff\xfe not utf-8 .jsonl",
    b"..",
    b"/",
    b"a" * 20_000 + b".jsonl",
]


def _raw_upload(stack, disposition_tail: bytes) -> httpx.Response:
    boundary = b"hostileboundary"
    body = (
        b"--" + boundary + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="'
        + disposition_tail + b"\r\nContent-Type: application/jsonl\r\n\r\n" + GOOD
        + b"\r\n--" + boundary + b"--\r\n"
    )  # fmt: skip
    return httpx.post(
        f"{stack.base_url}/files",
        content=body,
        headers={
            "Authorization": f"Bearer {API_KEY}",
            "Content-Type": "multipart/form-data; boundary=" + boundary.decode(),
        },
        timeout=30,
    )


@pytest.mark.parametrize("raw", RAW_NAMES, ids=range(len(RAW_NAMES)))
def test_hostile_raw_file_name_is_stored_harmlessly(stack, raw: bytes):
    resp = _raw_upload(stack, raw + b'"')
    assert resp.status_code == 200, resp.text
    created = resp.json()
    _check_stored(stack, created["id"], created["filename"])


@pytest.mark.parametrize(
    "tail",
    [b'raw\rcr.jsonl"', b'a\r\nX-Injected: yes.jsonl"', b'a\nb.jsonl"'],
    ids=["cr", "crlf", "lf"],
)
def test_raw_line_break_in_file_name_is_refused_or_stored_harmlessly(stack, tail: bytes):
    """A line break inside the part's header breaks the header: a clear 400, or (CR LF, which
    ends the header line) the name up to it, the rest an ignored header."""
    resp = _raw_upload(stack, tail)
    assert resp.status_code in (200, 400), resp.text
    if resp.status_code == 200:
        created = resp.json()
        _check_stored(stack, created["id"], created["filename"])
    else:
        assert resp.json()["error"]["message"].startswith("Malformed multipart body"), resp.text


def test_file_name_over_the_part_header_limit_is_a_clear_400(stack):
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as refused:
        stack.client.files.create(file=("n" * 40_000 + ".jsonl", io.BytesIO(GOOD)), purpose="batch")
    assert refused.value.status_code == 400
    assert "header is longer than" in str(refused.value), refused.value


# ---------------------------------------------------------------------------------------------
# Afterwards: the same workers still run a normal batch, and nothing crashed.


def test_workers_survive_the_corpus(stack, corpus):
    f = stack.client.files.create(file=("../../etc/passwd", io.BytesIO(GOOD)), purpose="batch")
    batch = stack.client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    batch = _wait_all(stack, [batch.id], 60)[batch.id]
    assert batch.status == "completed", batch
    assert [r["custom_id"] for r in _download(stack, batch.output_file_id)] == [
        "named-1",
        "named-2",
    ]
    assert _worker_pids(stack) == stack.pids_before
    for pid in stack.pids_before.values():
        os.kill(pid, 0)  # still there
    api_log = stack.log("api")
    assert "Traceback" not in api_log and "500 Internal" not in api_log, api_log[-3000:]
    for name in ("control", "model"):
        log = stack.log(name)
        assert "raised unexpected" not in log, log[-4000:]
        assert "WorkerLostError" not in log, log[-4000:]
