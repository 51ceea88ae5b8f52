"""Other revisions of this repository, run beside the working tree.

A ``git worktree`` of a revision, a revision's files exported by ``git archive``, and a child
process run from a tree that takes a JSON job on stdin and prints its JSON answer last."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

from testkit.service.stack import REPO


def worktree(rev: str, dest: Path) -> Path:
    """A detached ``git worktree`` of ``rev`` at ``dest`` (:func:`remove_worktree` removes it)."""
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(dest), rev],
        check=True,
        capture_output=True,
    )
    return dest


def remove_worktree(path: Path) -> None:
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)],
        check=False,
        capture_output=True,
    )


def export_tree(rev: str, dest: Path, *paths: str) -> Path:
    """The files of ``rev`` (only ``paths`` when given) extracted under ``dest``; returns
    ``dest``, the directory to run or import them from."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / ".export.tar"
    subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", "-o", str(archive), rev, *paths],
        check=True,
    )
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()
    return dest


def run_json(
    code: str, job: dict[str, Any], what: str, *, cwd: Path, env: dict[str, str]
) -> dict[str, Any]:
    """Run ``code`` in a fresh Python in ``cwd`` with ``job`` as JSON on its stdin; return the
    JSON of its last line (its stderr's tail in the error when it fails)."""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{what} in {cwd} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
