"""``python -m worker control|model|dispatch|beat [celery options…] | health``.

``control``: the control and webhook queues; ``model [NAME…]``: the served models' queues, one
engine per model, ``BATCHD_WORKER_SHARD_CONCURRENCY`` shards at a time; ``dispatch [NAME…]``:
the upstream models' queues, no torch; ``beat``: the sweeps. :mod:`core.launch` builds each
command line from the settings. ``health`` exits 0 while this container's worker touches
``BATCHD_WORKER_LIVENESS_FILE``: a healthcheck that needs no broker and loads no Celery.
"""

from __future__ import annotations

import os
import sys
import time

from core import launch
from core.llms import specs
from core.settings import get_settings


def command(role: str, names: list[str]) -> list[str]:
    """The command line of ``role`` for the served models ``names`` (default: all of the
    role's), resolved from the settings; built by :mod:`core.launch`. A LoRA adapter runs on
    its base's queue: named, it stands for its base; it has no queue of its own."""
    settings = get_settings()
    try:
        specs.adapters(settings.models)  # a LoRA entry with no base, naming it
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    adapters = specs.engine_models(settings.models)
    names = list(dict.fromkeys(adapters.get(m, m) for m in names))
    if role == "beat":
        return launch.beat_command(settings.home / "celerybeat-schedule")
    if role == "control":
        return launch.control_worker_command(launch.node_name("control"))
    if role == "dispatch":
        upstream = [m for m, spec in settings.models.items() if specs.is_upstream(spec)]
        models = names or upstream
        wrong = [m for m in models if m not in upstream]
        if wrong or not models:
            raise SystemExit(
                f"not an upstream model (see BATCHD_MODELS): {', '.join(wrong)}"
                if wrong
                else "no upstream model is served (see BATCHD_MODELS)"
            )
        return launch.dispatch_worker_command(
            models, settings.worker_shard_concurrency, launch.node_name("dispatch")
        )
    if role == "model":
        models = names or [m for m in settings.models if m not in adapters]
        unknown = [m for m in models if m not in settings.models]
        if unknown:
            raise SystemExit(f"not served (see BATCHD_MODELS): {', '.join(unknown)}")
        return launch.model_worker_command(
            models, settings.worker_shard_concurrency, launch.node_name("model")
        )
    raise SystemExit(
        "usage: python -m worker control|model [NAME…]|dispatch [NAME…]|beat "
        "[-- celery options] | health"
    )


def environment(role: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a worker of ``role`` runs in. The control worker allocates in bursts
    (a file of a million lines validated, a cancelled batch's 50,000 error lines, an estimate's
    scan) between long-lived objects, and Python's small-object allocator returns a 1 MiB
    arena only once every object in it is gone, so a few survivors kept hundreds of MiB
    resident after each burst. With ``PYTHONMALLOC=malloc`` its objects live in the C heap,
    whose free pages :mod:`worker.infra.memory` hands back. An operator's own ``PYTHONMALLOC``
    wins."""
    env = dict(os.environ if base is None else base)
    if role == "control":
        env.setdefault("PYTHONMALLOC", "malloc")
    return env


def max_age_s(interval_s: float) -> float:
    """How old the liveness file may be while its worker is healthy."""
    return max(3 * interval_s, 30.0)


def file_age_s(path: str | os.PathLike[str]) -> float | None:
    """Seconds since ``path`` was last touched; None if it does not exist."""
    try:
        return max(0.0, time.time() - os.stat(path).st_mtime)
    except FileNotFoundError:
        return None


def check_health(path: str | None = None, interval_s: float | None = None) -> tuple[bool, str]:
    """(healthy, why) for the worker that touches ``path`` (default: the settings'). Read here,
    not in :mod:`worker.infra.liveness`: the healthcheck runs every 30 s and loads no Celery."""
    settings = get_settings()
    path = path or settings.worker_liveness_file
    if not path:
        return False, "BATCHD_WORKER_LIVENESS_FILE is not set"
    limit = max_age_s(settings.worker_liveness_interval_s if interval_s is None else interval_s)
    age = file_age_s(path)
    if age is None:
        return False, f"{path} does not exist (the worker is not ready, or never was)"
    if age > limit:
        return False, f"{path} was last touched {age:.0f}s ago (more than {limit:.0f}s)"
    return True, f"{path} touched {age:.1f}s ago"


def health() -> None:
    ok, why = check_health()
    print(("healthy: " if ok else "unhealthy: ") + why)
    raise SystemExit(0 if ok else 1)


def main(argv: list[str]) -> None:
    if not argv:
        command("", [])
    role, rest = argv[0], argv[1:]
    if role == "health":
        health()
    extra: list[str] = []
    if "--" in rest:
        cut = rest.index("--")
        rest, extra = rest[:cut], rest[cut + 1 :]
    settings = get_settings()
    settings.home.mkdir(parents=True, exist_ok=True)
    cmd = command(role, rest) + extra
    os.execve(cmd[0], cmd, environment(role))


if __name__ == "__main__":
    main(sys.argv[1:])
