"""docker-compose.yml, .env.example and the Dockerfiles against the project (docker itself is not
needed): every service the deployment needs, every variable documented, every command runnable
in this code base, queues named as ``core.broker.queue`` names them, healthchecks and start
order."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / ".env.example"

REQUIRED_SERVICES = {
    "postgres", "redis", "minio", "migrate", "api", "control-worker", "worker", "beat", "flower",
}  # fmt: skip
ONE_SHOT = {"migrate"}
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
REQUIRED_SECRETS = {"POSTGRES_PASSWORD", "MINIO_ROOT_PASSWORD", "BATCHD_API_KEYS",
                    "FLOWER_BASIC_AUTH"}  # fmt: skip
CELERY = ["celery", "-A", "worker.infra.celery"]

# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?message}, ${VAR?message}, $VAR; $$ is a $.
_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


def parse_env_file(path: Path) -> dict[str, str]:
    """A dotenv file as compose reads it (comments, blank lines, optional quotes)."""
    values: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f".env.example: not KEY=value: {raw!r}"
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def interpolate(node: Any, env: dict[str, str], used: dict[str, str | None]) -> Any:
    """Compose's variable substitution on every string of ``node``; ``used`` collects each
    variable's name and its operator (``:?``, ``:-``, … or None)."""
    if isinstance(node, dict):
        return {k: interpolate(v, env, used) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env, used) for v in node]
    if not isinstance(node, str):
        return node

    def sub(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        name = m["braced"] or m["bare"]
        op, arg = m["op"], m["arg"] or ""
        used.setdefault(name, op)
        value = env.get(name)
        if op in (":-", "-") and (value is None or (op == ":-" and value == "")):
            return arg
        if op in (":?", "?") and (value is None or (op == ":?" and value == "")):
            raise AssertionError(f"required variable {name} is not set: {arg}")
        return value or ""

    return _VAR.sub(sub, node)


@cache
def loaded() -> tuple[dict[str, Any], dict[str, str], dict[str, str | None]]:
    """(the compose file interpolated with .env.example, .env.example, variables used)."""
    raw = yaml.safe_load(COMPOSE.read_text())
    env = parse_env_file(ENV_EXAMPLE)
    used: dict[str, str | None] = {}
    return interpolate(raw, env, used), env, used


def services() -> dict[str, dict[str, Any]]:
    return loaded()[0]["services"]


def argv(command: Any) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(x) for x in command]


def service_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def healthcheck_argv(service: dict[str, Any]) -> list[str]:
    test = service["healthcheck"]["test"]
    if isinstance(test, str):
        return shlex.split(test)
    kind, *rest = test
    return shlex.split(rest[0]) if kind == "CMD-SHELL" else rest


def queues(cmd: list[str]) -> list[str]:
    for flag in ("-Q", "--queues"):
        if flag in cmd:
            return cmd[cmd.index(flag) + 1].split(",")
    return []


def served_models(env: dict[str, str]) -> dict[str, str]:
    from core.settings import Settings

    return Settings(models=env["BATCHD_MODELS"]).models


# ---------------------------------------------------------------------------------------------


def test_every_required_service_exists() -> None:
    assert set(services()) >= REQUIRED_SERVICES


def test_every_variable_is_in_env_example_and_secrets_are_required() -> None:
    _, env, used = loaded()
    assert set(used) - set(env) == set(), "variables missing from .env.example"
    assert set(env) - set(used) == set(), ".env.example lists variables the compose file ignores"
    for name in REQUIRED_SECRETS:
        assert used.get(name) == ":?", f"{name} must be required (${{{name}:?…}})"


# A release: "16.6", "7.4.2-alpine", "v0.11.0", "RELEASE.2025-09-07T16-13-09Z" (not "16", "7",
# "latest").
_PINNED_TAG = re.compile(
    r"^(v?\d+\.\d+(\.\d+)?|RELEASE\.\d{4}-\d\d-\d\dT\d\d-\d\d-\d\dZ)(-[\w.]+)?$"
)


def test_third_party_images_are_pinned_to_a_release() -> None:
    """An image pulled by the deployment names a release (or a digest), so that two
    `docker compose up` a month apart run the same store, database and broker."""
    pulled = {n: s["image"] for n, s in services().items() if "build" not in s}
    assert {"postgres", "redis", "minio"} <= set(pulled)
    for name, image in pulled.items():
        if "@sha256:" in image:
            continue
        repository, sep, tag = image.rpartition(":")
        assert sep and "/" not in tag, f"{name}: {image} has no tag"
        assert _PINNED_TAG.match(tag), f"{name}: {image} is not pinned to a release"


def test_depends_on_targets_and_conditions() -> None:
    all_services = services()
    for name, service in all_services.items():
        deps = service.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        for target, spec in deps.items():
            assert target in all_services, f"{name} depends on unknown {target}"
            condition = spec.get("condition", "service_started")
            assert condition in CONDITIONS, f"{name} -> {target}: {condition}"
            if condition == "service_healthy":
                assert "healthcheck" in all_services[target], f"{target} has no healthcheck"
            if condition == "service_completed_successfully":
                assert target in ONE_SHOT, f"{target} is not a one-shot service"
    for name in ("api", "control-worker", "worker", "beat"):
        deps = all_services[name]["depends_on"]
        assert deps["migrate"]["condition"] == "service_completed_successfully", name
    assert all_services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_long_running_services_have_healthchecks_and_one_shots_do_not_restart() -> None:
    for name, service in services().items():
        if name in ONE_SHOT:
            assert service.get("restart", "no") in ("no", "on-failure"), name
            continue
        check = service.get("healthcheck")
        assert check and check.get("test") and not check.get("disable"), f"{name}: no healthcheck"
        assert service.get("restart") in ("unless-stopped", "always"), f"{name}: no restart policy"
    all_services = services()
    assert "/healthz" in " ".join(healthcheck_argv(all_services["api"]))
    for name in ("control-worker", "worker"):
        # The worker's own liveness file (worker/infra/liveness.py), not a ping through the broker:
        # a broker outage must not mark every worker unhealthy.
        assert healthcheck_argv(all_services[name]) == ["python", "-m", "worker", "health"]
        assert service_env(all_services[name])["BATCHD_WORKER_LIVENESS_FILE"].startswith("/")


def test_gpu_worker_reserves_a_gpu_and_mounts_models_read_only() -> None:
    _, env, _ = loaded()
    worker = services()["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)
    assert all(("count" in d) != ("device_ids" in d) for d in devices), "count or device_ids"
    assert worker["build"]["dockerfile"] == "Dockerfile.gpu"
    models = served_models(service_env(worker))
    assert models
    for name in ("worker", "control-worker"):  # the control worker counts tokens
        mounts = [argv_mount(v) for v in services()[name].get("volumes", [])]
        read_only = [target for target, ro in mounts if ro]
        for path in models.values():
            assert any(path.startswith(t.rstrip("/") + "/") for t in read_only), (name, path)


def argv_mount(volume: Any) -> tuple[str, bool]:
    if isinstance(volume, dict):
        return volume["target"], bool(volume.get("read_only"))
    parts = volume.split(":")
    return parts[1], len(parts) > 2 and "ro" in parts[2].split(",")


def test_queues_follow_core_queue() -> None:
    from core.broker.queue import CONTROL_QUEUE, model_queue

    all_services = services()
    control = queues(argv(all_services["control-worker"]["command"]))
    assert control == [CONTROL_QUEUE]
    models = served_models(service_env(all_services["worker"]))
    consumed: set[str] = set()
    for name, service in all_services.items():
        cmd = argv(service.get("command") or [])
        if cmd[:4] != [*CELERY, "worker"] or name == "control-worker" or "profiles" in service:
            continue  # an opt-in profile's workers serve models of its own (see below)
        for queue in queues(cmd):
            assert queue in {model_queue(m) for m in models}, f"{name}: {queue} serves no model"
            consumed.add(queue)
    assert consumed == {model_queue(m) for m in models}, "every served model needs a worker"


def test_the_fleet_profile_drives_a_vllm_server_from_a_worker_without_a_gpu() -> None:
    """The opt-in profile "fleet": vLLM on a GPU of its own, and a dispatch worker with no GPU
    and no model files that consumes the queue of the upstream model .env.example shows."""
    from core.broker.queue import model_queue
    from core.llms import specs

    all_services = services()
    assert all_services["vllm"]["profiles"] == ["fleet"]
    devices = all_services["vllm"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" for d in devices)
    dispatch = all_services["dispatch-worker"]
    assert dispatch["profiles"] == ["fleet"]
    assert "deploy" not in dispatch and not dispatch.get("volumes")
    assert healthcheck_argv(dispatch) == ["python", "-m", "worker", "health"]
    example = ENV_EXAMPLE.read_text()
    spec = re.search(r'"fleet": "(upstream:[^"]+)"', example)
    assert spec, "the example upstream model"
    upstream = specs.upstream_spec(spec.group(1), "fleet")
    assert upstream.base_url == "http://vllm:8000/v1" and upstream.key_env == "VLLM_API_KEY"
    assert queues(argv(dispatch["command"])) == [model_queue("fleet")]


def test_migrations_have_one_head() -> None:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    assert argv(services()["migrate"]["command"]) == ["alembic", "upgrade", "head"]
    config = Config(str(REPO / "alembic.ini"))
    location = config.get_main_option("script_location")
    assert location and (REPO / location / "env.py").is_file()
    config.set_main_option("script_location", str(REPO / location))
    assert len(ScriptDirectory.from_config(config).get_heads()) == 1


def test_storage_bucket_is_created_by_the_app() -> None:
    """No bucket-creation service: the S3 backend creates its bucket on first use."""
    import inspect

    from core.storage.s3 import S3Storage

    env = service_env(services()["api"])
    assert env["BATCHD_STORAGE_URL"].startswith("s3://")
    assert env["BATCHD_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert inspect.signature(S3Storage).parameters["create_bucket"].default is True


# Runs in a subprocess with a service's environment (settings are read at import).
_CHECK = r"""
import importlib, json, sys
checks = json.loads(sys.argv[1])
for cmd in checks:
    if cmd[:3] == ["python", "-m", "worker"]:  # runs (and, with no worker here, says unhealthy)
        import subprocess
        out = subprocess.run([sys.executable, *cmd[1:]], capture_output=True, text=True)
        verdict = {0: "healthy: ", 1: "unhealthy: "}.get(out.returncode)
        assert verdict and out.stdout.startswith(verdict), out
        continue
    if cmd[:3] == ["python", "-m", "cli"]:  # a `batchd` command
        from cli.main import app
        names = {c.name or c.callback.__name__ for c in app.registered_commands}
        assert cmd[3] in names, (cmd, sorted(names))
        continue
    if cmd[0] == "uvicorn":
        module, _, attr = cmd[1].partition(":")
        app = getattr(importlib.import_module(module), attr)
        assert callable(app), cmd
        continue
    assert cmd[:2] == ["celery", "-A"], cmd
    module, _, attr = cmd[2].partition(":")
    app = getattr(importlib.import_module(module), attr or "app")
    from celery import Celery
    assert isinstance(app, Celery), cmd
    from celery.bin.celery import celery as cli
    sub = cmd[3]
    if sub == "flower":
        import flower.command  # the `celery flower` subcommand comes from this package
        from importlib.metadata import entry_points
        assert "flower" in {e.name for e in entry_points(group="celery.commands")}
    else:
        assert sub in cli.commands, (sub, sorted(cli.commands))
    if sub == "inspect":
        from celery.app.control import Inspect
        assert callable(getattr(Inspect, cmd[4], None)), cmd
    if sub == "worker":
        assert cmd[cmd.index("--pool") + 1] == "threads", "threads pool: never fork the engine"
print("ok")
"""


def test_every_command_exists_in_the_project() -> None:
    groups: dict[str, tuple[dict[str, str], list[list[str]]]] = {}
    for name, service in services().items():
        if "build" not in service:  # third-party images
            continue
        cmds = [argv(service["command"])]
        if service.get("healthcheck"):
            check = healthcheck_argv(service)
            if check[:1] == ["celery"] or check[:3] == ["python", "-m", "worker"]:
                cmds.append(check)
        cmds = [c for c in cmds if c[0] != "alembic"]  # test_migrations_have_one_head
        for c in cmds:
            assert c[0] in ("celery", "uvicorn", "python"), f"{name}: unknown program {c[0]}"
        env = service_env(service)
        key = json.dumps(env, sort_keys=True)
        groups.setdefault(key, (env, []))[1].extend(cmds)
    assert groups
    for env, cmds in groups.values():
        proc = subprocess.run(
            [sys.executable, "-c", _CHECK, json.dumps(cmds)],
            cwd=REPO, env={**os.environ, **env, "HF_HUB_OFFLINE": "1"},
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfiles(dockerfile: str) -> None:
    text = (REPO / dockerfile).read_text()
    lines = [ln.strip() for ln in text.replace("\\\n", " ").splitlines()]
    for line in lines:
        if line.startswith("COPY") and "--from" not in line:
            *sources, _dest = line.split()[1:]
            for src in sources:
                assert (REPO / src).exists(), f"{dockerfile}: COPY {src}: no such path"
    runs = [ln for ln in lines if ln.startswith("RUN")]
    torch_at = next(i for i, ln in enumerate(runs) if "torch==2.13.0" in ln)
    install_at = next(i for i, ln in enumerate(runs) if re.search(r"pip install \.(\s|$)", ln))
    assert torch_at < install_at, "torch must be installed before `pip install .`"
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"torch==2.13.0"' in pyproject, "the Dockerfiles pin the project's torch"
    base = next(ln for ln in lines if ln.startswith("FROM")).split()[1]
    if base.startswith("python:"):
        major, minor = (int(x) for x in re.match(r"python:(\d+)\.(\d+)", base).groups())
        assert (major, minor) >= (3, 11)
    else:  # the distribution's python3: Ubuntu 24.04's is 3.12 (22.04's 3.10 is too old)
        assert base.endswith("ubuntu24.04"), base
    packages = {p.strip().rstrip("*") for p in re.findall(r'include = \[([^\]]*)\]', pyproject)[0]
                .replace('"', "").split(",")}  # fmt: skip
    copied = {src.rstrip("/") for ln in lines if ln.startswith("COPY") for src in ln.split()[1:-1]}
    assert packages <= copied, f"{dockerfile}: packages not copied: {packages - copied}"
    licenses = set(re.findall(r'^license-files = \[([^\]]*)\]', pyproject, re.M)[0]
                   .replace('"', "").replace(",", " ").split())  # fmt: skip
    assert licenses <= copied, f"{dockerfile}: `pip install .` needs {licenses - copied}"
    if dockerfile == "Dockerfile":  # CPU model workers build the engine's kernel at start
        assert any("gcc" in ln for ln in runs), "the CPU image needs a C compiler"


def test_api_runs_as_many_processes_as_batchd_up_with_metrics_of_its_own() -> None:
    """The api service runs `batchd api` (the API processes `batchd up` would run), counting
    its metrics in multiprocess mode in a tmpfs of its own, which no worker reads."""
    _, env, _ = loaded()
    api = services()["api"]
    assert argv(api["command"])[:4] == ["python", "-m", "cli", "api"]
    api_env = service_env(api)
    assert api_env["BATCHD_API_WORKERS"] == env["BATCHD_API_WORKERS"] == "0"
    directory = api_env["PROMETHEUS_MULTIPROC_DIR"]
    assert directory in api.get("tmpfs", []), "the metrics directory starts empty"
    for name, service in services().items():
        if name != "api":
            assert "PROMETHEUS_MULTIPROC_DIR" not in service_env(service), name


@pytest.mark.services
@pytest.mark.slow
def test_api_command_starts_min_4_cpus_processes(
    pg_url: str, redis_url: str, tmp_path: Path
) -> None:
    """The api service's own command and environment (its database, broker and storage
    pointed at this machine's): min(4, CPUs) uvicorn processes answer on the one port."""
    import signal
    import time

    from cli.perf.service import free_port

    api = services()["api"]
    cmd = argv(api["command"])
    port = free_port()
    cmd[cmd.index("--host") + 1] = "127.0.0.1"
    cmd[cmd.index("--port") + 1] = str(port)
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    (metrics_dir / "counter_1.db").write_bytes(b"")  # a file a previous run left
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHD_")}
    env.update(service_env(api))
    env.update(
        BATCHD_DATABASE_URL=pg_url, BATCHD_BROKER_URL=redis_url,
        BATCHD_STORAGE_URL=str(tmp_path / "storage"), BATCHD_HOME=str(tmp_path / "home"),
        PROMETHEUS_MULTIPROC_DIR=str(metrics_dir),
    )  # fmt: skip
    expected = min(4, len(os.sched_getaffinity(0)))
    proc = subprocess.Popen(
        [sys.executable, *cmd[1:]], cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while len(_spawned(proc.pid)) < expected or not _healthy(port):
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, _spawned(proc.pid)
            time.sleep(0.3)
        assert len(_spawned(proc.pid)) == expected  # uvicorn's manager runs them
        assert not (metrics_dir / "counter_1.db").exists()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _spawned(pid: int) -> list[int]:
    """The worker processes uvicorn's manager ``pid`` spawned (not its resource tracker)."""
    from cli.procfs import children

    found = []
    for child in children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            found.append(child)
    return found


def _healthy(port: int) -> bool:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_control_worker_runs_on_the_c_heap() -> None:
    """As ``python -m worker control`` does (worker/__main__.py ``environment``): compose
    starts Celery itself, so its control worker sets PYTHONMALLOC, beside every setting."""
    import worker.__main__ as worker_main

    all_services = services()
    control = service_env(all_services["control-worker"])
    assert control["PYTHONMALLOC"] == worker_main.environment("control", {})["PYTHONMALLOC"]
    assert set(service_env(all_services["worker"])) <= set(control)
