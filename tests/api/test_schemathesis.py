"""Hostile input from the service's own OpenAPI document: schemathesis generates valid and
invalid requests for every operation and checks that none gets a 5xx and that every answer
conforms to the document (status codes, content types, bodies, headers).

It runs against the ASGI app in-process, on the real Postgres, Redis and storage, with a real
key; bounded to a few dozen examples per operation so that it stays well under a minute and a
half.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

pytestmark = pytest.mark.services

#: Per operation: this many requests that fit the schema, and as many that do not.
EXAMPLES_PER_MODE = 13
LINES = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


@pytest.fixture
def api_app(service_env, monkeypatch):
    from api.app import create_app
    from core.settings import get_settings

    monkeypatch.setenv("BATCHD_RATE_LIMIT_PER_MINUTE", "0")
    # Its invalid-auth check sends wrong keys by the hundred: a 401 each, not the 429 of the
    # per-address throttle (tests/api/test_limits.py tests that).
    monkeypatch.setenv("BATCHD_AUTH_FAILURES_PER_MINUTE", "0")
    monkeypatch.setenv("BATCHD_MAX_UPLOAD_BYTES", str(64 * 1024))
    get_settings.cache_clear()
    return create_app(get_settings())


#: Schema-valid values that only the server's state, its settings or rules a schema cannot say
#: refuse (400): a cursor naming no object, a window longer than the server's maximum, a
#: webhook URL whose host part is not a host, an Idempotency-Key header and body field that
#: disagree, an upload's file name with nothing left once sanitised, an upload larger than the
#: server's maximum. (param, words in the message)
SEMANTIC_REFUSALS = {
    ("idempotency_key", "differ"),
    ("after", "No such"),
    ("completion_window", "maximum"),
    ("webhook_url", ""),
    ("filename", "no usable name"),
    ("bytes", "max_chunked_upload_bytes"),
}


def valid_data_accepted(ctx, response, case):
    """Schemathesis' "valid data must be accepted", but for the refusals above."""
    try:
        return positive_data_acceptance(ctx, response, case)
    except Exception:
        if response.status_code == 400:
            error = response.json()["error"]
            if any(
                error["param"] == param and words in error["message"]
                for param, words in SEMANTIC_REFUSALS
            ):
                return None
        raise


def _fuzz(operation, mode: GenerationMode, headers: dict[str, str]) -> str | None:
    """Run one operation's examples; the first failure, described, or None."""

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES_PER_MODE,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: report what was found
        suppress_health_check=list(HealthCheck),
    )
    def run(case) -> None:
        # A negative case may drop the key on purpose ("header: violates required"); adding
        # it back would make the request valid again.
        drops_key = mode is GenerationMode.NEGATIVE and "Authorization" in str(case.meta.phase.data)
        case.call_and_validate(
            headers={} if drops_key else headers,
            excluded_checks=[positive_data_acceptance],
            additional_checks=[valid_data_accepted],
        )

    try:
        run()
    except Unsatisfiable:  # nothing in the operation can be made invalid (e.g. no parameters)
        return None
    except Exception as error:  # schemathesis reports every failed check in one exception
        return f"{operation.label} ({mode.value}):\n{error}"
    return None


def test_no_server_errors_and_answers_match_the_schema(api_app, api_key):
    # schemathesis' own pytest integration does not run on this pytest; drive it directly.
    schema = schemathesis.openapi.from_asgi("/openapi.json", api_app)
    headers = {"Authorization": f"Bearer {api_key}"}
    failures = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if (failure := _fuzz(operation, mode, headers)) is not None:
                failures.append(failure)
    assert not failures, "\n\n".join(failures)
