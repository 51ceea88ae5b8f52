"""OpenAI's Uploads API against a real server, with the ``openai`` SDK unmodified: a chunked
upload in bounded memory, a part sent twice, an upload resumed after its client was killed,
the md5 and size checks, cancel and expiry; the completed upload is an ordinary file that a
batch can run. Its bounds, races and recovery: ``test_upload_bounds.py``; the sweep:
``test_upload_sweep.py``."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from testkit.builders.lines import chat_line, jsonl
from tests.api.conftest import REPO_ROOT, Server

pytestmark = pytest.mark.services

MiB = 1024 * 1024


def _stored_parts(server: Server) -> list[Path]:
    root = Path(server.storage_url) / "uploads"
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def test_chunked_upload_streams_in_bounded_memory(server: Server, tmp_path: Path) -> None:
    client = server.client()
    size = 160 * MiB  # ten 16 MiB parts; the server's memory must not grow by the file
    path = tmp_path / "big.bin"
    with path.open("wb") as out:
        block = hashlib.sha256(b"seed").digest() * (MiB // 32)
        for i in range(size // MiB):
            out.write(block[:-4] + i.to_bytes(4, "big"))
    digest = hashlib.md5(path.read_bytes()).hexdigest()
    warm_up = client.uploads.upload_file_chunked(  # the first call's imports and caches
        file=b"{}\n", filename="w.jsonl", bytes=3, mime_type="application/jsonl", purpose="batch"
    )
    assert warm_up.status == "completed"
    before = server.status("VmHWM")
    upload = client.uploads.upload_file_chunked(
        file=path, mime_type="application/jsonl", purpose="batch", part_size=16 * MiB, md5=digest
    )
    grown = server.status("VmHWM") - before
    assert upload.status == "completed" and upload.file is not None
    assert upload.file.bytes == size and upload.file.filename == "big.bin"
    # Less than one part: a server that held a part (or the file) in memory cannot pass.
    assert grown < 12 * MiB, f"the server's peak memory grew by {grown / MiB:.0f} MiB"
    stored = Path(server.storage_url) / "files" / upload.file.id
    assert hashlib.md5(stored.read_bytes()).hexdigest() == digest
    assert _stored_parts(server) == []  # the parts are gone once joined


def test_a_part_sent_twice_md5_and_size_checks(server: Server) -> None:
    from openai import BadRequestError

    client = server.client()
    data = jsonl([chat_line(f"r{i}", f"hello {i}") for i in range(6)])
    head, tail = data[:100], data[100:]
    upload = client.uploads.create(
        bytes=len(data), filename="in.jsonl", mime_type="application/jsonl", purpose="batch"
    )
    assert upload.status == "pending" and upload.object == "upload"
    first = client.uploads.parts.create(upload.id, data=head)
    again = client.uploads.parts.create(upload.id, data=head)  # a retry after a lost answer
    assert first.id != again.id and first.object == "upload.part"
    # The copy counts towards the declared size: the last part no longer fits.
    with pytest.raises(BadRequestError) as caught:
        client.uploads.parts.create(upload.id, data=tail)
    assert caught.value.body["param"] == "data"
    assert f"the {len(data)} bytes it was created for" in caught.value.message
    assert f"hold {2 * len(head)} bytes so far" in caught.value.message
    with pytest.raises(BadRequestError) as caught:  # both copies: not the bytes declared
        client.uploads.complete(upload.id, part_ids=[first.id, again.id])
    assert caught.value.body["param"] == "part_ids" and str(len(data)) in caught.value.message
    assert client.uploads.cancel(upload.id).status == "cancelled"

    upload = client.uploads.create(
        bytes=len(data), filename="in.jsonl", mime_type="application/jsonl", purpose="batch"
    )
    first = client.uploads.parts.create(upload.id, data=head)
    last = client.uploads.parts.create(upload.id, data=tail)
    with pytest.raises(BadRequestError) as caught:
        client.uploads.complete(upload.id, part_ids=[first.id, last.id], md5="0" * 32)
    assert caught.value.body["param"] == "md5"
    with pytest.raises(BadRequestError) as caught:
        client.uploads.complete(upload.id, part_ids=[first.id, "part_nope"])
    assert caught.value.body["param"] == "part_ids[1]"

    done = client.uploads.complete(
        upload.id, part_ids=[first.id, last.id], md5=hashlib.md5(data).hexdigest()
    )
    assert done.status == "completed" and done.file.bytes == len(data)
    assert client.files.content(done.file.id).content == data
    assert _stored_parts(server) == []
    with pytest.raises(BadRequestError):
        client.uploads.parts.create(upload.id, data=b"more")

    # The completed upload is an ordinary batch input file.
    batch = client.batches.create(
        input_file_id=done.file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "validating"


_DYING_CLIENT = textwrap.dedent(
    """
    import json, os, signal, sys
    from openai import OpenAI
    client = OpenAI(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0)
    data = open(sys.argv[3], "rb").read()
    upload = client.uploads.create(
        bytes=len(data), filename="resumed.jsonl", mime_type="application/jsonl", purpose="batch"
    )
    parts = []
    for start in range(0, len(data), 1000):
        if start >= 3000:
            os.kill(os.getpid(), signal.SIGKILL)  # dies mid-upload, after three parts
        parts.append(client.uploads.parts.create(upload.id, data=data[start:start + 1000]).id)
        print(json.dumps({"upload": upload.id, "parts": parts}), flush=True)
    """
)


def test_an_upload_resumes_after_its_client_was_killed(server: Server, tmp_path: Path) -> None:
    data = jsonl([chat_line(f"r{i}", f"hello number {i}") for i in range(60)])
    assert len(data) > 4000
    path = tmp_path / "in.jsonl"
    path.write_bytes(data)
    dying = subprocess.run(
        [sys.executable, "-c", _DYING_CLIENT, f"{server.url}/v1", server.api_key, str(path)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ},
        timeout=120,
    )
    assert dying.returncode == -signal.SIGKILL, dying.stderr
    state = json.loads(dying.stdout.splitlines()[-1])
    assert len(state["parts"]) == 3

    client = server.client()  # a new client carries on from the parts the first one saw
    parts = list(state["parts"])
    for start in range(3000, len(data), 1000):
        parts.append(
            client.uploads.parts.create(state["upload"], data=data[start : start + 1000]).id
        )
    done = client.uploads.complete(state["upload"], part_ids=parts)
    assert client.files.content(done.file.id).content == data


def test_cancel_and_expiry_drop_the_parts(server: Server, pg_url: str, make_key) -> None:
    from openai import BadRequestError, NotFoundError
    from sqlalchemy import create_engine, text

    from worker.batches.uploads import sweep_uploads

    client = server.client()
    cancelled = client.uploads.create(
        bytes=10, filename="a.jsonl", mime_type="application/jsonl", purpose="batch"
    )
    client.uploads.parts.create(cancelled.id, data=b"12345")
    assert len(_stored_parts(server)) == 1
    assert client.uploads.cancel(cancelled.id).status == "cancelled"
    assert _stored_parts(server) == []
    with pytest.raises(BadRequestError) as caught:
        client.uploads.complete(cancelled.id, part_ids=["part_x"])
    assert "cancelled" in caught.value.message

    expiring = client.uploads.create(
        bytes=10, filename="b.jsonl", mime_type="application/jsonl", purpose="batch"
    )
    client.uploads.parts.create(expiring.id, data=b"12345")
    engine = create_engine(pg_url)
    with engine.begin() as connection:  # an hour passes
        connection.execute(
            text("UPDATE uploads SET expires_at = now() - interval '1 second' WHERE id = :id"),
            {"id": expiring.id},
        )
    with pytest.raises(BadRequestError) as caught:
        client.uploads.parts.create(expiring.id, data=b"67890")
    assert "expired" in caught.value.message
    # The upload sweep (beat's, run here by hand) marks it expired and deletes its parts.
    assert sweep_uploads() >= 1
    assert _stored_parts(server) == []
    with engine.connect() as connection:
        status = connection.scalar(
            text("SELECT status FROM uploads WHERE id = :id"), {"id": expiring.id}
        )
    engine.dispose()
    assert status == "expired"

    with pytest.raises(BadRequestError) as caught:
        client.uploads.create(bytes=10, filename="d", mime_type="text/plain", purpose="assistants")
    assert caught.value.body["param"] == "purpose"
    with pytest.raises(NotFoundError):
        client.uploads.cancel("upload_nope")
    other = server.client(api_key=make_key())  # another tenant cannot see it at all
    with pytest.raises(NotFoundError):
        other.uploads.parts.create(expiring.id, data=b"x")


def test_the_cli_client_sends_a_file_larger_than_a_part_through_uploads(
    server: Server, tmp_path: Path, pg_url: str
) -> None:
    from sqlalchemy import create_engine, text

    from cli.client import BatchdClient

    data = jsonl([chat_line(f"r{i}", f"hello {i}") for i in range(40)])
    path = tmp_path / "in.jsonl"
    path.write_bytes(data)
    with BatchdClient(f"{server.url}/v1", server.api_key) as client:
        uploaded = client.upload_file(path, part_bytes=1000)
        assert uploaded["bytes"] == len(data) and uploaded["filename"] == "in.jsonl"
        assert client.file_content(uploaded["id"]) == data
    assert _stored_parts(server) == []
    engine = create_engine(pg_url)
    with engine.connect() as connection:
        status = connection.scalar(
            text("SELECT status FROM uploads WHERE file_id = :f"), {"f": uploaded["id"]}
        )
    engine.dispose()
    assert status == "completed"  # it went through the Uploads API, not one POST /v1/files
