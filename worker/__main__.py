"""``python -m worker control|model|beat [celery options…]``: start a worker from the settings.

* ``control``: the control queue (validate, finalize, cancel, sweep), threads pool; and the
  webhook queue, whose attempts run on threads of their own (:mod:`worker.webhooks`).
* ``model [NAME…]``: the queues of the named served models (default: all of them), threads
  pool with ``BATCHD_WORKER_SHARD_CONCURRENCY`` shard tasks in flight; the engine loads once.
* ``dispatch [NAME…]``: the queues of the named upstream models (default: every ``upstream:``
  model), threads pool; no model in memory and no torch, so it starts in seconds and many can
  run on one small node; they share each upstream's limit (:mod:`worker.upstream.shared`).
* ``beat``: the scheduler that sends the expiry sweep.
* ``health``: exits 0 while this container's worker touches ``BATCHD_WORKER_LIVENESS_FILE``
  (see :mod:`worker.liveness`), 1 otherwise: a healthcheck that tells a hung worker from a busy
  one and needs no broker.
"""

from __future__ import annotations

import os
import sys

from core import launch
from core.llms import specs
from core.settings import get_settings


def command(role: str, names: list[str]) -> list[str]:
    """The command line of ``role`` for the served models ``names`` (default: all of the
    role's), resolved from the settings; built by :mod:`core.launch`."""
    settings = get_settings()
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
        models = names or list(settings.models)
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
    whose free pages :mod:`worker.memory` hands back. An operator's own ``PYTHONMALLOC``
    wins."""
    env = dict(os.environ if base is None else base)
    if role == "control":
        env.setdefault("PYTHONMALLOC", "malloc")
    return env


def health() -> None:
    from worker.liveness import health as check

    ok, why = check()
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
