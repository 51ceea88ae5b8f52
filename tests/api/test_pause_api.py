"""The pause and resume verbs over HTTP (the API under uvicorn, Postgres, Redis): scoped to
the caller's tenant like cancel, idempotent, 409 once the batch may no longer change, and each
asks the workers for a release (the resume's shards go back into the window)."""

from __future__ import annotations

import pytest

from core.broker.queue import TASK_RELEASE_SWEEP
from tests.api.test_tenancy import LINES, MISSING_BATCH, _same_as_missing

pytestmark = pytest.mark.services


def _batch(client):
    file = client.files.create(file=("in.jsonl", LINES), purpose="batch")
    return client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def test_pause_and_resume_are_idempotent_and_refused_once_the_batch_is_cancelling(
    server, control_messages
):
    batch = _batch(server.client())  # no worker here: it stays validating
    with server.http() as http:
        paused = http.post(f"/v1/batches/{batch.id}/pause")
        assert paused.status_code == 200, paused.text
        body = paused.json()
        assert body["paused"] is True and body["status"] == "validating"
        again = http.post(f"/v1/batches/{batch.id}/pause").json()
        assert again["paused"] is True and again["paused_at"] == body["paused_at"]
        assert http.get(f"/v1/batches/{batch.id}").json()["paused"] is True
        resumed = http.post(f"/v1/batches/{batch.id}/resume").json()
        assert resumed["paused"] is False and resumed["paused_at"] is None
        assert http.post(f"/v1/batches/{batch.id}/resume").json()["paused"] is False
        assert len(control_messages(TASK_RELEASE_SWEEP)) >= 2  # after the pause and the resume
        assert http.post(f"/v1/batches/{batch.id}/pause").status_code == 200
        assert http.post(f"/v1/batches/{batch.id}/cancel").status_code == 200  # while paused
        for verb in ("pause", "resume"):
            refused = http.post(f"/v1/batches/{batch.id}/{verb}")
            assert refused.status_code == 409, refused.text
            error = refused.json()["error"]
            assert (
                error["code"]
                == {"pause": "batch_not_pausable", "resume": "batch_not_resumable"}[verb]
            )
            assert "'cancelling'" in error["message"]


def test_another_tenants_batch_answers_pause_and_resume_as_missing(server, make_key):
    batch = _batch(server.client())
    with server.http(api_key=make_key()) as http:
        for verb in ("pause", "resume"):
            _same_as_missing(http, "POST", f"/v1/batches/{{id}}/{verb}", batch.id, MISSING_BATCH)
    with server.http() as http:
        assert http.get(f"/v1/batches/{batch.id}").json()["paused"] is False
