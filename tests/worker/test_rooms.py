"""The worker's rooms: ``worker.infra`` and every task module a worker registers import without
torch (a dispatch worker never loads it; only a process that runs a model does)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import importlib, sys
import worker.infra
from worker.infra.celery import INCLUDE
for name in [*INCLUDE, "worker.shards.recovery", "worker.upstream.handler", "worker.__main__"]:
    importlib.import_module(name)
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


def test_the_worker_imports_without_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
