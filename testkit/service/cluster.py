"""Nodes of a cluster on one machine, for the end-to-end test of a node lost mid-job.

A node is one process group (a SIGKILL to the group is the node lost at once: power cut,
kernel panic, a VM reclaimed) with a working directory of its own: its processes' cwd,
``HOME``, ``TMPDIR``, ``BATCHD_HOME`` and model cache all live under it, and no node reads
another's. What the nodes share is what a cluster's pods share: Postgres, the Redis broker and
S3-compatible storage (``BATCHD_STORAGE_URL=s3://…``), and the code and settings (the image
and the ConfigMap). The demo model is copied into each node's cache, as an image or an init
step would bring it; a node builds nothing another node could see.

Roles and their readiness lines: ``api`` (its ``/healthz``), ``control`` (``ready.``),
``model`` (``model <name> ready``), ``dispatch`` (``model <upstream> ready``) and ``beat``
(``beat: Starting``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

from cli.perf.service import api_up, free_port, wait_for
from core import launch
from core.launch import QUIET
from testkit.service.stack import REPO, api_command, stack_env

AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


def node_env(
    root: Path,
    database_url: str,
    broker_url: str,
    storage_url: str,
    s3_endpoint: str,
    **settings: str,
) -> dict[str, str]:
    """The environment of a node's processes: the shared settings (``settings`` win) on the
    shared database, broker and S3 storage, every local path under ``root``."""
    for sub in ("home", "tmp", "cache"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    env = stack_env(database_url, broker_url, root, **settings)
    python_path = [str(REPO), *filter(None, [env.get("PYTHONPATH")])]  # the image's code
    env.update(
        AWS,
        HOME=str(root / "home"),
        TMPDIR=str(root / "tmp"),
        XDG_CACHE_HOME=str(root / "cache"),
        HF_HOME=str(root / "cache" / "huggingface"),
        BATCHD_MODEL_CACHE=str(root / "cache" / "batchd"),
        BATCHD_STORAGE_URL=storage_url,
        BATCHD_S3_ENDPOINT_URL=s3_endpoint,
        PYTHONPATH=os.pathsep.join(python_path),
    )
    return env


def provision_model(env: dict[str, str], built: Path) -> None:
    """Copy a built model directory into the node's model cache (as its image carries it)."""
    target = Path(env["BATCHD_MODEL_CACHE"]) / built.name
    if not target.exists():
        shutil.copytree(built, target)


class Node:
    """One node: its processes in one process group, each run in ``root`` and logging to
    ``root/<role>.log``."""

    def __init__(self, name: str, root: Path, env: dict[str, str]):
        self.name = name
        self.root = root
        self.env = env
        self.procs: dict[str, subprocess.Popen] = {}
        self.ready_marks: dict[str, list[str]] = {}
        self.api_port: int | None = None
        self.pgid: int | None = None

    # -- starting ---------------------------------------------------------------------------

    def start(
        self, role: str, cmd: list[str], marks: Iterable[str] = (), **env: str
    ) -> subprocess.Popen:
        """Start ``cmd`` in the node's process group (the first process founds it)."""
        with open(self.root / f"{role}.log", "ab") as log:
            proc = subprocess.Popen(
                cmd, cwd=self.root, env={**self.env, **env}, stdout=log,
                stderr=subprocess.STDOUT, process_group=self.pgid or 0,
            )  # fmt: skip
        if self.pgid is None:
            self.pgid = proc.pid
        self.procs[role] = proc
        self.ready_marks[role] = list(marks)
        return proc

    def api(self) -> Node:
        self.api_port = free_port()
        self.start("api", api_command(self.api_port))
        return self

    def control(self) -> Node:
        cmd = launch.control_worker_command(f"control-{self.name}@{self.name}", extra=QUIET)
        self.start("control", cmd, ["ready."])
        return self

    def model(self, model: str, concurrency: int, extra: Iterable[str] = (), **env: str) -> Node:
        cmd = launch.model_worker_command(
            [model], concurrency, f"model-{self.name}@{self.name}", extra=[*QUIET, *extra]
        )
        self.start("model", cmd, [f"model {model} ready"], **env)
        return self

    def dispatch(self, model: str, concurrency: int) -> Node:
        cmd = launch.dispatch_worker_command(
            [model], concurrency, f"dispatch-{self.name}@{self.name}", extra=QUIET
        )
        self.start("dispatch", cmd, [f"model {model} ready"])
        return self

    def beat(self) -> Node:
        schedule = self.root / "home" / "celerybeat-schedule"
        self.start(
            "beat", launch.beat_command(schedule, extra=["--loglevel", "INFO"]), ["beat: Starting"]
        )
        return self

    # -- reading ----------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def log(self, role: str) -> str:
        path = self.root / f"{role}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self, chars: int = 3000) -> str:
        return "".join(
            f"\n--- {self.name}/{role}\n{self.log(role)[-chars:]}" for role in self.procs
        )

    def check_alive(self) -> None:
        for role, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{self.name}/{role} exited ({proc.returncode}):{self.logs()}")

    def ready(self) -> bool:
        self.check_alive()
        if "api" in self.procs and not api_up(self.api_port or 0):
            return False
        return all(
            mark in self.log(role) for role, marks in self.ready_marks.items() for mark in marks
        )

    def wait_ready(self, timeout: float) -> None:
        wait_for(self.ready, timeout, f"node {self.name}", self.logs)

    # -- ending -----------------------------------------------------------------------------

    def kill(self) -> None:
        """The node lost: SIGKILL to its whole process group at once; wait for every process."""
        if self.pgid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait(30)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the group, SIGKILL it after ``grace_s``."""
        if self.pgid is None or all(p.poll() is not None for p in self.procs.values()):
            return
        try:
            os.killpg(self.pgid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        self.kill()
