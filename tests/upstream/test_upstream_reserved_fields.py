"""Fields reserved to the operator (``UPSTREAM_RESERVED``): a line for an upstream model that
carries one is refused at validation, naming the line, the field and why, unless the upstream's
spec allows it (``allow_fields``); and the spec's other new options. (Through a batch's real
validation and shard run: tests/worker/upstream/test_upstream_line_limits.py.)"""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from core.batchfile.bodies.fields import UPSTREAM_RESERVED
from core.batchfile.reader import RawLine, parse_request, validate_file
from core.batchfile.request import CHAT_URL, LineError
from core.llms.specs import forwarded_models, upstream_spec


def test_the_spec_carries_the_new_options() -> None:
    spec = upstream_spec(
        "upstream:http://h:1/v1?allow_fields=priority,service_tier&cache_salt_field=none"
        "&metrics_key_env=METRICS_KEY",
        "m",
    )
    assert spec.allow_fields == {"priority", "service_tier"}
    assert (spec.cache_salt_field, spec.metrics_key_env) == ("none", "METRICS_KEY")
    plain = upstream_spec("upstream:http://h:1/v1", "m")
    assert (plain.allow_fields, plain.cache_salt_field) == (frozenset(), "cache_salt")


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("allow_fields=priority,temperature", "allow_fields must be a comma-separated list of"),
        ("allow_fields=", "allow_fields must be a comma-separated list of"),
        (
            "cache_salt_field=salt",
            "cache_salt_field must be cache_salt or prompt_cache_key or none",
        ),
        ("metrics_key_env=sk-1", "the name of an environment variable"),
    ],
)
def test_a_bad_new_option_is_named(query: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        upstream_spec(f"upstream:http://h:1/v1?{query}", "m")


MODELS = {
    "fleet": "upstream:http://127.0.0.1:9/v1",
    "open": "upstream:http://127.0.0.1:9/v1?allow_fields=priority,service_tier",
    "local": "demo:llama-tiny",
}


def _line(n: int, model: str, **body: Any) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **body}
    return json.dumps({"custom_id": f"r{n}", "method": "POST", "url": CHAT_URL, "body": body})


@pytest.mark.parametrize("field", list(UPSTREAM_RESERVED))
def test_a_reserved_field_refuses_an_upstream_line_naming_line_field_and_why(field: str) -> None:
    data = "\n".join([_line(1, "fleet"), _line(2, "fleet", **{field: 1})]) + "\n"
    report = validate_file(
        io.BytesIO(data.encode()),
        endpoint=CHAT_URL,
        served_models=list(MODELS),
        max_requests=10,
        forwarded=forwarded_models(MODELS),
    )
    assert report.num_requests == 1
    (error,) = report.errors
    assert (error.line, error.code, error.param) == (2, "unsupported_parameter", f"body.{field}")
    assert UPSTREAM_RESERVED[field] in error.message
    assert f"allow_fields={field}" in error.message


def test_the_operator_allows_reserved_fields_per_upstream() -> None:
    forwarded = forwarded_models(MODELS)
    assert forwarded == {"fleet": frozenset(), "open": {"priority", "service_tier"}}

    def parse(model: str, **body: Any) -> Any:
        data = _line(1, model, **body).encode()
        return parse_request(RawLine(1, 0, len(data) + 1, data), endpoint=CHAT_URL,
                             served_models=list(MODELS), forwarded=forwarded)  # fmt: skip

    assert parse("open", priority=-10, service_tier="flex").body["priority"] == -10
    with pytest.raises(LineError) as store:
        parse("open", store=True)  # allowed there: priority and service_tier only
    assert store.value.param == "body.store"
    with pytest.raises(LineError):
        parse("fleet", priority=-10)
    assert parse("fleet", priority=None).body["priority"] is None  # null is no value
    # a local model's lines are checked in full, as before (these fields are OpenAI's there)
    assert parse("local", service_tier="auto").body["service_tier"] == "auto"


def test_a_spec_that_does_not_parse_allows_nothing() -> None:
    assert forwarded_models({"bad": "upstream:http://h/v1?allow_fields=nope"}) == {
        "bad": frozenset()
    }
