"""An upstream's refusal as the tenant's error line: its status and message kept, whatever
looks like a key in it redacted, whichever shape the server's error takes. (Against a real
server: tests/upstream/test_upstream_privacy.py.)"""

from __future__ import annotations

import pytest

from core.batchfile.request import BatchRequest
from worker.upstream.dispatcher import Reply
from worker.upstream.handler import reply_error

REQ = BatchRequest(line=1, offset=0, length=1, custom_id="r1", url="/v1/chat/completions",
                   model="m", body={}, kind="chat")  # fmt: skip
KEY_TEXT = "Incorrect API key provided: sk-abc***wxyz. Find your key at your dashboard."


@pytest.mark.parametrize(
    "reply",
    [
        Reply(401, {"error": {"message": KEY_TEXT, "code": "invalid_api_key"}}),  # OpenAI
        Reply(401, {"message": KEY_TEXT}),  # vLLM
        Reply(401, {"detail": KEY_TEXT}),  # FastAPI
        Reply(401, None, KEY_TEXT),  # not JSON
    ],
)
def test_a_quoted_key_is_redacted_and_the_rest_kept(reply: Reply) -> None:
    line = reply_error(REQ, reply)
    assert line["response"]["status_code"] == 401
    message = line["response"]["body"]["error"]["message"]
    assert message == (
        "The upstream answered 401: Incorrect API key provided: [redacted] Find your key at "
        "your dashboard."
    )
    assert "abc" not in message and "wxyz" not in message


def test_code_and_param_are_redacted_too() -> None:
    body = {
        "error": {"message": "bad", "code": "key sk-live-0123456789", "param": "Bearer abcdef12"}
    }
    error = reply_error(REQ, Reply(400, body))["response"]["body"]["error"]
    assert "0123456789" not in error["code"] and "abcdef12" not in error["param"]
