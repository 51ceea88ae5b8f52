"""Static secrets (``BATCHD_API_KEYS``, ``BATCHD_ADMIN_API_KEYS``, ``BATCHD_METRICS_TOKEN``)
shorter than the minimum are refused at start, with a message that names the variable and
never the secret."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from core.settings import MIN_STATIC_KEY_CHARS, Settings

ROOT = Path(__file__).resolve().parents[2]
LONG = "sk-" + "k" * MIN_STATIC_KEY_CHARS


@pytest.fixture(autouse=True)
def _no_inherited_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("BATCHD_API_KEYS", "BATCHD_ADMIN_API_KEYS", "BATCHD_METRICS_TOKEN"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("BATCHD_API_KEYS", f"{LONG},sk-short", "key 2 of 2 is 8 characters"),
        ("BATCHD_API_KEYS", '["sk-tiny"]', "key 1 of 1 is 7 characters"),
        ("BATCHD_ADMIN_API_KEYS", "sk-admin", "key 1 of 1 is 8 characters"),
        ("BATCHD_METRICS_TOKEN", "scrape-me", "is 9 characters"),
    ],
)
def test_a_short_static_secret_is_refused_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, says: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError) as refused:
        Settings()
    message = str(refused.value)
    assert variable in message and says in message
    assert f"at least {MIN_STATIC_KEY_CHARS}" in message
    for secret in ("sk-short", "sk-tiny", "sk-admin", "scrape-me"):
        assert secret not in message  # named, never echoed


def test_long_enough_secrets_and_no_secrets_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().api_keys == [] and Settings().metrics_token == ""
    monkeypatch.setenv("BATCHD_API_KEYS", f"{LONG}, {LONG}-2")
    monkeypatch.setenv("BATCHD_ADMIN_API_KEYS", f"{LONG}-admin")
    monkeypatch.setenv("BATCHD_METRICS_TOKEN", "m" * MIN_STATIC_KEY_CHARS)
    settings = Settings()
    assert settings.api_keys == [LONG, f"{LONG}-2"]
    assert settings.admin_api_keys == [f"{LONG}-admin"]


def test_the_api_refuses_to_start_with_a_short_key(tmp_path: Path) -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "BATCHD_HOME": str(tmp_path),
        "BATCHD_API_KEYS": "sk-short",
    }
    started = subprocess.run(
        [sys.executable, "-c", "import api.app"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode != 0
    assert "BATCHD_API_KEYS" in started.stderr and "sk-short" not in started.stderr
