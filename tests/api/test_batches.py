"""The Batches API: create (and the validate task on the broker), list, cancel, and bad input."""

from __future__ import annotations

import httpx
import openai
import pytest

from core.broker.queue import TASK_CANCEL, TASK_VALIDATE
from core.database.lifecycle import transition

pytestmark = pytest.mark.services

LINES = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


@pytest.fixture
def input_file(client) -> str:
    return client.files.create(file=("in.jsonl", LINES), purpose="batch").id


def _create(client, input_file: str, **kwargs):
    params = {
        "input_file_id": input_file,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        **kwargs,
    }
    return client.batches.create(**params)


def test_create_retrieve_and_validate_task_enqueued(client, input_file, control_messages):
    batch = _create(client, input_file, metadata={"team": "search", "run": "7"})
    assert batch.id.startswith("batch_")
    assert batch.object == "batch"
    assert batch.status == "validating"
    assert batch.endpoint == "/v1/chat/completions"
    assert batch.input_file_id == input_file
    assert batch.completion_window == "24h"
    assert batch.expires_at - batch.created_at == 24 * 3600
    assert batch.metadata == {"team": "search", "run": "7"}
    assert batch.errors is None
    assert (
        batch.request_counts.total,
        batch.request_counts.completed,
        batch.request_counts.failed,
    ) == (0, 0, 0)
    assert batch.usage.total_tokens == 0
    assert batch.usage.input_tokens_details.cached_tokens == 0
    assert batch.usage.output_tokens_details.reasoning_tokens == 0
    assert batch.output_file_id is None and batch.in_progress_at is None

    assert client.batches.retrieve(batch.id) == batch
    assert {"task": TASK_VALIDATE, "args": [batch.id]} in control_messages(TASK_VALIDATE)


def test_short_completion_windows(client, input_file):
    batch = _create(client, input_file, completion_window="90s")
    assert batch.expires_at - batch.created_at == 90
    with pytest.raises(openai.BadRequestError) as caught:
        _create(client, input_file, completion_window="200h")  # over the 7-day maximum
    assert caught.value.body["param"] == "completion_window"
    with pytest.raises(openai.BadRequestError) as caught:
        _create(client, input_file, completion_window="soon")
    assert caught.value.body["param"] == "completion_window"


@pytest.mark.parametrize(
    "metadata",
    [
        {f"k{i}": "v" for i in range(17)},
        {"k" * 65: "v"},
        {"k": "v" * 513},
        {"k": 5},
    ],
    ids=["17-pairs", "long-key", "long-value", "not-a-string"],
)
def test_metadata_limits(client, input_file, metadata):
    with pytest.raises(openai.BadRequestError) as caught:
        _create(client, input_file, metadata=metadata)
    error = caught.value.body
    assert error["param"].startswith("metadata")
    assert error["type"] == "invalid_request_error"


def test_metadata_at_the_limits_is_accepted(client, input_file):
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    assert _create(client, input_file, metadata=metadata).metadata == metadata


def test_bad_create_requests(server, client, input_file):
    with pytest.raises(openai.NotFoundError) as caught:
        _create(client, "file-doesnotexist")
    assert caught.value.body["message"] == "No such File object: file-doesnotexist"
    assert caught.value.body["param"] == "input_file_id"

    with pytest.raises(openai.BadRequestError) as caught:
        _create(client, input_file, endpoint="/v1/moderations")
    assert caught.value.body["param"] == "endpoint"

    with server.http() as http:
        missing = http.post(
            "/v1/batches", json={"endpoint": "/v1/completions", "completion_window": "24h"}
        )
        not_json = http.post(
            "/v1/batches", content=b"{nope", headers={"content-type": "application/json"}
        )
    assert missing.status_code == 400
    assert missing.json()["error"] == {
        "message": "Missing required parameter: 'input_file_id'.",
        "type": "invalid_request_error",
        "param": "input_file_id",
        "code": None,
    }
    assert not_json.status_code == 400
    assert "JSON" in not_json.json()["error"]["message"]


def test_list_newest_first_with_pagination(client, input_file):
    ids = [_create(client, input_file).id for _ in range(3)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == [ids[2], ids[1]]
    assert page.has_more is True
    nxt = client.batches.list(limit=2, after=ids[1])
    assert nxt.data[0].id == ids[0]
    walked = [b.id for b in client.batches.list(limit=1)]
    assert walked[:3] == ids[::-1]
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.list(limit=101)
    assert caught.value.body["param"] == "limit"


def _force_status(pg_url: str, batch_id: str, *path: str) -> None:
    from core.database.sessions import session_scope

    with session_scope(pg_url) as session:
        current = "validating"
        for target in path:
            assert transition(session, batch_id, current, target)
            current = target


def test_cancel(client, input_file, pg_url, control_messages):
    batch = _create(client, input_file)
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelling"
    assert cancelled.cancelling_at is not None
    assert {"task": TASK_CANCEL, "args": [batch.id]} in control_messages(TASK_CANCEL)

    again = client.batches.cancel(batch.id)
    assert again.status == "cancelling"
    assert again.cancelling_at == cancelled.cancelling_at

    running = _create(client, input_file)
    _force_status(pg_url, running.id, "in_progress")
    assert client.batches.cancel(running.id).status == "cancelling"

    for path in (
        ("in_progress", "finalizing"),
        ("in_progress", "finalizing", "completed"),
        ("failed",),
    ):
        other = _create(client, input_file)
        _force_status(pg_url, other.id, *path)
        with pytest.raises(openai.ConflictError) as caught:
            client.batches.cancel(other.id)
        assert path[-1] in caught.value.body["message"]
        assert client.batches.retrieve(other.id).status == path[-1]

    with pytest.raises(openai.NotFoundError) as caught:
        client.batches.cancel("batch_missing")
    assert caught.value.body["message"] == "No such Batch object: batch_missing"


def test_deleting_the_input_of_an_unfinished_batch_hides_it_but_keeps_its_bytes(
    client, input_file, server
):
    """A running batch still reads its input: DELETE answers like OpenAI (deleted) and the
    file is gone from the API at once, but its bytes stay until the batch ends."""
    from core.storage import open_storage

    batch = _create(client, input_file)
    assert client.files.delete(input_file).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(input_file)
    assert input_file not in [f.id for f in client.files.list()]
    assert open_storage(server.storage_url).exists(f"files/{input_file}")
    assert client.batches.retrieve(batch.id).input_file_id == input_file

    unused = client.files.create(file=("other.jsonl", LINES), purpose="batch").id
    assert client.files.delete(unused).deleted is True
    assert not open_storage(server.storage_url).exists(f"files/{unused}")


def test_a_bad_results_cursor_is_refused_before_the_batch_shows_results(client, input_file):
    """No worker runs here: the batch stays ``validating`` and shows no results. A cursor it
    cannot show is still a 400 naming ``after`` (not an empty 200 that turns into a 400 once
    validation is done); without one the page is empty."""
    batch = _create(client, input_file)
    assert client.batches.retrieve(batch.id).status == "validating"
    page = client.get(f"/batches/{batch.id}/results", cast_to=httpx.Response)
    assert (page.json()["data"], page.json()["has_more"]) == ([], False)
    with pytest.raises(openai.BadRequestError) as caught:
        client.get(
            f"/batches/{batch.id}/results",
            cast_to=httpx.Response,
            options={"params": {"after": "batch_req_000000000000000000000000"}},
        )
    assert caught.value.body["param"] == "after"
