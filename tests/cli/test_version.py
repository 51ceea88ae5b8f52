"""``batchd --version`` prints the installed version (pyproject's), the API reports the same."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

from tests.api.conftest import REPO_ROOT


def test_version_is_the_installed_one() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "from cli.main import app; app()", "--version"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"batchd {metadata.version('batchd')}"


def test_the_api_reports_the_same_version() -> None:
    from api.app import create_app
    from core.settings import Settings

    app = create_app(Settings(auth="off"))
    assert app.version == metadata.version("batchd")
