"""``batchd keys``: create, list and revoke against the real database, and the keys they make
against a real API server."""

from __future__ import annotations

import re

import httpx
import pytest
from typer.testing import CliRunner

from cli.admin import keys_app
from cli.exit_codes import ExitCode

pytestmark = pytest.mark.services

KEY = re.compile(r"API key:\s+(sk-bd-\S+)")
KEY_ID = re.compile(r"Created key (key_[0-9a-f]+)")


def run(cli: CliRunner, *args: str):
    return cli.invoke(keys_app, list(args), catch_exceptions=False)


def _create(cli: CliRunner, *args: str) -> tuple[str, str, str]:
    result = run(cli, "create", *args)
    assert result.exit_code == 0, result.output
    return KEY_ID.search(result.stdout).group(1), KEY.search(result.stdout).group(1), result.stdout


def test_create_list_revoke(cli, service_env, pg_url):
    from core.database.auth import hash_key, lookup
    from core.database.sessions import session_scope
    from core.database.tables import ApiKey

    key_id, plaintext, shown = _create(cli, "--tenant", "acme", "--name", "ci")
    assert re.search(r"Webhook secret:\s+whsec_\S+", shown)
    with session_scope(pg_url) as session:
        row = session.get(ApiKey, key_id)
        assert (row.tenant, row.name, row.key_hash) == ("acme", "ci", hash_key(plaintext))
        assert plaintext not in {row.key_hash, row.prefix} and plaintext.startswith(row.prefix)
        assert lookup(session, plaintext).id == key_id

    other_id, _other, _ = _create(cli, "--tenant", "globex")
    listed = run(cli, "list")
    assert listed.exit_code == 0, listed.output
    assert key_id in listed.stdout and other_id in listed.stdout
    assert plaintext not in listed.stdout  # only the prefix is ever shown again
    assert plaintext[:12] in listed.stdout
    only_acme = run(cli, "list", "--tenant", "acme")
    assert key_id in only_acme.stdout and other_id not in only_acme.stdout

    revoked = run(cli, "revoke", key_id)
    assert revoked.exit_code == 0, revoked.output
    with session_scope(pg_url) as session:
        assert session.get(ApiKey, key_id).revoked_at is not None
        assert lookup(session, plaintext) is None
    line = next(x for x in run(cli, "list", "--tenant", "acme").stdout.splitlines() if key_id in x)
    assert len(re.findall(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", line)) >= 2  # created and revoked

    missing = run(cli, "revoke", "key_nope")
    assert missing.exit_code == ExitCode.ERROR
    assert "no such key" in missing.output


def test_webhook_url_is_validated_and_stored(cli, service_env, pg_url):
    from core.database.sessions import session_scope
    from core.database.tables import ApiKey

    for bad in ("ftp://example.com/hook", "not a url", "http:///nohost"):
        result = run(cli, "create", "--tenant", "acme", "--webhook-url", bad)
        assert result.exit_code == ExitCode.USAGE, result.output
        assert "--webhook-url" in result.output
    key_id, _key, shown = _create(
        cli, "--tenant", "acme", "--webhook-url", "https://hooks.example.com/batchd"
    )
    assert "https://hooks.example.com/batchd" in shown
    with session_scope(pg_url) as session:
        row = session.get(ApiKey, key_id)
        assert row.webhook_url == "https://hooks.example.com/batchd"
        assert row.webhook_secret and row.webhook_secret in shown


def test_bad_tenant_is_a_usage_error(cli, service_env):
    result = run(cli, "create", "--tenant", " ")
    assert result.exit_code == ExitCode.USAGE
    assert "tenant" in result.output


def test_keys_work_against_the_api_until_revoked(cli, api_server):
    key_id, plaintext, _ = _create(cli, "--tenant", "acme")
    headers = {"authorization": f"Bearer {plaintext}"}
    with httpx.Client(base_url=api_server.base_url, timeout=30) as http:
        assert http.get("/files", headers=headers).status_code == 200
        listed = run(cli, "list", "--tenant", "acme").stdout.splitlines()
        cells = [cell.strip() for cell in next(x for x in listed if key_id in x).split("│")]
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", cells[6])  # last used
        assert run(cli, "revoke", key_id).exit_code == 0
        refused = http.get("/files", headers=headers)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"


def test_unreachable_database_is_a_clear_error(cli, monkeypatch):
    from core.settings import get_settings

    monkeypatch.setenv("BATCHD_DATABASE_URL", "postgresql://postgres:hunter2@127.0.0.1:1/none")
    get_settings.cache_clear()
    try:
        result = run(cli, "list")
    finally:
        get_settings.cache_clear()
    assert result.exit_code == ExitCode.ERROR
    assert "database" in result.output and "hunter2" not in result.output


def _cells(listing: str, key_id: str) -> list[str]:
    return [
        cell.strip() for cell in next(x for x in listing.splitlines() if key_id in x).split("│")
    ]


def test_max_priority_is_set_listed_and_enforced(cli, api_server):
    plain_id, plain, shown = _create(cli, "--tenant", "acme")
    assert "priorities up to normal" in shown
    high_id, high, shown = _create(cli, "--tenant", "acme", "--max-priority", "high")
    assert "priorities up to high" in shown
    listed = run(cli, "list", "--tenant", "acme").stdout
    assert "max priority" in listed
    assert _cells(listed, plain_id)[8] == "normal" and _cells(listed, high_id)[8] == "high"
    bad = cli.invoke(keys_app, ["create", "--tenant", "acme", "--max-priority", "urgent"])
    assert bad.exit_code == ExitCode.USAGE, bad.output

    body = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
    with httpx.Client(base_url=api_server.base_url, timeout=30) as http:
        answers = {}
        for key in (plain, high):
            headers = {"authorization": f"Bearer {key}"}
            f = http.post(
                "/files", data={"purpose": "batch"}, files={"file": ("a.jsonl", body)},
                headers=headers,
            )  # fmt: skip
            assert f.status_code == 200, f.text
            answers[key] = http.post(
                "/batches",
                json={"input_file_id": f.json()["id"], "endpoint": "/v1/chat/completions",
                      "completion_window": "24h", "priority": "high"},
                headers=headers,
            )  # fmt: skip
    assert answers[high].status_code == 200, answers[high].text
    assert answers[high].json()["priority"] == "high"
    refused = answers[plain]
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert error["code"] == "priority_not_allowed" and "'normal'" in error["message"]
