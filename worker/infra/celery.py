"""The Celery application shared by the control worker, the model workers and beat.

``python -m worker control|model|dispatch|beat`` builds their command lines (``celery -A
worker.infra.celery``). A control worker also consumes the webhook queue; model workers use a
threads pool and never fork after the model loads. Every worker imports its tasks' lazy
dependencies at start, in one thread (:func:`import_task_dependencies`). Tasks are idempotent
and re-read the database, so late acknowledgement is safe. More: ``docs/worker.md``.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from importlib.util import find_spec
from typing import Any

from celery import Celery
from celery.signals import (
    after_setup_logger,
    after_setup_task_logger,
    worker_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutting_down,
)
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis
from prometheus_client import multiprocess
from redis.exceptions import ConnectionError as RedisConnectionError

from core.broker.queue import (
    CONTROL_QUEUE,
    TASK_CANCEL,
    TASK_DELIVER_WEBHOOK,
    TASK_ESTIMATE,
    TASK_FINALIZE,
    TASK_RECLAIM,
    TASK_REFRESH_ETAS,
    TASK_RELEASE_SWEEP,
    TASK_SWEEP_EXPIRED,
    TASK_SWEEP_FILES,
    TASK_SWEEP_UPLOADS,
    TASK_SWEEP_WEBHOOKS,
    TASK_VALIDATE,
    WEBHOOK_QUEUE,
    model_queue,
    redis_socket_options,
)
from core.llms import specs
from core.observability import tracing
from core.observability.logs import install
from core.settings import get_settings
from worker.infra import drain, liveness, memory
from worker.infra.exporter import start_exporter

# The tasks of the control queue (what the liveness watchdog's pool check watches).
CONTROL_TASKS = frozenset({TASK_VALIDATE, TASK_FINALIZE, TASK_CANCEL, TASK_SWEEP_EXPIRED,
                           TASK_RELEASE_SWEEP, TASK_SWEEP_FILES, TASK_SWEEP_UPLOADS,
                           TASK_SWEEP_WEBHOOKS, TASK_RECLAIM, TASK_ESTIMATE,
                           TASK_REFRESH_ETAS})  # fmt: skip

# Task modules every process registers. ``worker.shards.recovery`` (heartbeats and the reclaim
# sweep) is included when it is present.
INCLUDE = ["worker.batches.tasks", "worker.batches.webhooks", "worker.batches.retention",
           "worker.batches.uploads", "worker.shards.task", "worker.shards.release",
           "worker.validation.estimate"]  # fmt: skip


def _has_recovery() -> bool:
    try:
        return find_spec("worker.shards.recovery") is not None
    except (ImportError, ValueError):
        return False


def _every(task: str, seconds: float) -> dict:
    seconds = float(seconds)
    return {
        "task": task,
        "schedule": seconds,
        # A sweep not started before the next one is due is dropped, never piled up.
        "options": {"queue": CONTROL_QUEUE, "expires": max(seconds, 1.0)},
    }


# Celery's own loggers that write one INFO line per task sent by beat, received and finished.
_TASK_LIFECYCLE_LOGGERS = ("celery.beat", "celery.worker.strategy", "celery.app.trace")


class _QuietHousekeeping(logging.Filter):
    """Demotes Celery's per-task INFO lines about the periodic sweeps to DEBUG: a sweep runs
    every few seconds and mostly finds nothing to do, so at INFO those lines drown the log. A
    sweep that acts logs its own INFO line; a failing one keeps Celery's ERROR line."""

    def __init__(self, task_names: set[str]) -> None:
        super().__init__()
        self.task_names = frozenset(task_names)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        message = record.getMessage()
        if not any(name in message for name in self.task_names):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_housekeeping_logs(task_names: set[str]) -> None:
    """Install :class:`_QuietHousekeeping` for ``task_names`` (replacing an earlier one)."""
    for name in _TASK_LIFECYCLE_LOGGERS:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, _QuietHousekeeping)]:
            logger.removeFilter(old)
        logger.addFilter(_QuietHousekeeping(task_names))


def transport_options(broker_url: str) -> dict:
    """Redis (and SQS) redeliver an unacknowledged task after the visibility timeout; the
    SQLAlchemy transport of embedded mode has none and hands every option to create_engine.

    On Redis every socket is bounded (``core.broker.queue.redis_socket_options``), so that a broker
    that vanishes without closing its connections (a lost host, a dropped route) costs a
    reconnect instead of a worker blocked in a read or a connect for the kernel's TCP
    timeouts. The consumer's BRPOP blocks on the server for a second at most (kombu's
    ``brpop_timeout``): a reply slower than ``SOCKET_TIMEOUT_S`` means a dead link."""
    if broker_url.startswith(("sqla+", "sqlalchemy+")):
        return {}
    options: dict[str, Any] = {"visibility_timeout": get_settings().visibility_timeout_s}
    options.update(redis_socket_options(broker_url, SOCKET_TIMEOUT_S))
    return options


REDIS_TRANSPORT = "redis-batchd"
SOCKET_TIMEOUT_S = 30.0  # a consumer's read (BRPOP blocks on the server for a second at most)


logger = logging.getLogger(__name__)


class _Unrestored:
    """Delivery tags of messages that a closing channel held unacknowledged and could not put
    back on their queue (the broker was gone), by broker; the next channel opened to that
    broker puts them back. Without this they wait in Redis's unacknowledged set for the
    visibility timeout (hours): a control step's retry held for its countdown, or a task that
    was running, when the broker went away."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tags: dict[tuple[Any, ...], set[str]] = {}

    @staticmethod
    def broker(channel: kombu_redis.Channel) -> tuple[Any, ...]:
        conninfo = channel.connection.client if channel.connection is not None else None
        if conninfo is None:
            return ()
        return (conninfo.hostname, conninfo.port, conninfo.virtual_host, channel.unacked_key)

    def remember(self, channel: kombu_redis.Channel, tags: list[str]) -> None:
        with self._lock:
            self._tags.setdefault(self.broker(channel), set()).update(tags)

    def take(self, channel: kombu_redis.Channel) -> set[str]:
        with self._lock:
            return self._tags.pop(self.broker(channel), set())


UNRESTORED = _Unrestored()


class RedisQoS(kombu_redis.QoS):
    """kombu's Redis QoS, except that the messages a restore at close fails to put back are
    remembered (:data:`UNRESTORED`); the failure still raises, as before."""

    def restore_unacked(self, client: Any = None) -> None:
        try:
            super().restore_unacked(client)
        except Exception:
            UNRESTORED.remember(self.channel, list(self._delivered))
            raise


class RedisChannel(kombu_redis.Channel):
    """kombu's Redis channel, except that one already closed raises a connection error when it
    is used (a pooled producer that still holds it publishes; a task delivered on it finishes
    and is acknowledged) instead of ``AttributeError: 'NoneType' object has no attribute
    'client'``: a closed channel is detached from its transport (``connection`` None), which
    ``_connparams`` reads. A connection error is what callers handle: kombu's ``ensure``
    reconnects and revives the producer; an acknowledgement is logged as not sent (its message
    was restored to the queue when the channel closed, or, the broker gone then, when the
    next channel to it opens (:data:`UNRESTORED`); its task runs again, and tasks are
    idempotent)."""

    QoS = RedisQoS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # reaches the broker (a ping) or raises
        tags = sorted(UNRESTORED.take(self))
        for n, tag in enumerate(tags):
            try:
                self.qos.restore_by_tag(tag, client=self.client)
            except Exception:
                UNRESTORED.remember(self, tags[n:])
                raise
        if tags:
            logger.warning("%d message(s) held when the broker went away queued again", len(tags))

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        if self.connection is None:
            raise RedisConnectionError("the channel is closed (its broker connection was lost)")
        return super()._connparams(asynchronous=asynchronous)


class RedisTransport(kombu_redis.Transport):
    """kombu's Redis transport, except that a closed transport keeps its connection info, and
    its channels are :class:`RedisChannel`.

    When the consumer loses the broker, Celery closes its connection
    (``Consumer.on_connection_error_after_connected``: ``connection.collect()`` then
    ``connection.close()``). ``collect`` fails to close the task channel, whose BRPOP read
    raises on the dead socket before the channel is marked closed, and then drops the
    transport's connection info (``kombu.Connection._do_close_transport`` sets
    ``transport.client = None``, only to break a reference cycle). ``close`` closes that
    channel again, which restores the messages it delivered and has not acknowledged (a task
    running under ``task_acks_late``); the restore opens a new Redis pool from
    ``transport.client`` (``Channel._connparams``) and raises ``AttributeError: 'NoneType'
    object has no attribute 'hostname'``. That is no connection error, so Celery takes it for
    a bug: "Unrecoverable error", and the worker shuts down; its pending acknowledgements
    fail the same way in ``Hub.close``. It happens whenever the broker goes away while a
    task runs and the consumer waits in BRPOP for the next one (a free pool thread).

    Keeping the connection info turns those calls into what they should be: the restore (or
    an acknowledgement of a task that finished during the outage) reaches Redis, or fails
    with a connection error that Celery handles; the consumer reconnects.
    """

    Channel = RedisChannel

    @property
    def client(self) -> Any:
        return self.__dict__.get("_conninfo")

    @client.setter
    def client(self, value: Any) -> None:
        if value is not None:
            self.__dict__["_conninfo"] = value


# The name logs show for it (``Connected to redis-batchd://…``); kombu resolves the alias.
TRANSPORT_ALIASES.setdefault(REDIS_TRANSPORT, f"{__name__}:RedisTransport")


def broker_transport(broker_url: str) -> str | None:
    """The transport for ``broker_url`` (None: the one its scheme names). Not for
    ``rediss://``: kombu derives its TLS defaults from that scheme's name."""
    return REDIS_TRANSPORT if broker_url.startswith("redis://") else None


# Publishing (a task that a task sends, a control step's retry, beat's sweeps) waits out a
# broker outage of up to about a minute. Celery's default gives up after about a second, and
# a control step whose retry cannot be published is rejected: lost until the stuck-batch
# sweep sends it again (stuck_batch_after_s, minutes later).
PUBLISH_RETRY_POLICY = {"max_retries": 30, "interval_start": 0, "interval_step": 0.5,
                        "interval_max": 2.0}  # fmt: skip


def create_app() -> Celery:
    settings = get_settings()
    recovery = _has_recovery()
    include = [*INCLUDE, "worker.shards.recovery"] if recovery else list(INCLUDE)
    celery = Celery("batchd", broker=settings.broker_url, include=include)
    control = {"queue": CONTROL_QUEUE}
    routes = {name: control for name in CONTROL_TASKS}
    routes[TASK_DELIVER_WEBHOOK] = {"queue": WEBHOOK_QUEUE}
    schedule = {
        "sweep-expired": _every(TASK_SWEEP_EXPIRED, settings.expiry_sweep_interval_s),
        "release-shards": _every(TASK_RELEASE_SWEEP, settings.release_sweep_interval_s),
        "sweep-files": _every(TASK_SWEEP_FILES, settings.file_sweep_interval_s),
        "sweep-uploads": _every(TASK_SWEEP_UPLOADS, settings.upload_sweep_interval_s),
        "sweep-webhooks": _every(TASK_SWEEP_WEBHOOKS, settings.webhook_sweep_interval_s),
        "refresh-etas": _every(TASK_REFRESH_ETAS, settings.eta_refresh_interval_s),
    }
    if recovery:
        schedule["reclaim-stale-shards"] = _every(TASK_RECLAIM, settings.reclaim_sweep_interval_s)
    quiet_housekeeping_logs({entry["task"] for entry in schedule.values()})
    celery.conf.update(
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport=broker_transport(settings.broker_url),
        broker_transport_options=transport_options(settings.broker_url),
        broker_connection_retry_on_startup=True,
        # A lost broker costs a reconnect, never the tasks in flight: they are idempotent and
        # their acknowledgement waits (Celery 6 would cancel them by default).
        worker_cancel_long_running_tasks_on_connection_loss=False,
        # A channel error (Redis answering READONLY after a failover, say) reconnects too.
        broker_channel_error_retry=True,
        task_publish_retry_policy=PUBLISH_RETRY_POLICY,
        task_default_queue=CONTROL_QUEUE,
        # Shard tasks name their model's queue when they are sent (core.broker.queue.model_queue).
        task_routes=routes,
        beat_schedule=schedule,
    )
    return celery


# What tasks import on first use. transformers resolves names through a lazy module that is
# not safe for concurrent first imports: two task threads importing ``AutoTokenizer`` and
# ``AutoModelForCausalLM`` at once (a validate beside the engine load) can fail with
# ``ImportError: cannot import name 'AutoTokenizer' from 'transformers'``. ``AutoModel`` loads
# the embedding models (engine.embedding.encoder).
TRANSFORMERS_NAMES = ("AutoConfig", "AutoTokenizer", "AutoModelForCausalLM", "AutoModel")
TASK_DEPENDENCIES = ("engine", "engine.host.host", "engine.text.tokenizer")


def import_task_dependencies() -> None:
    """Import :data:`TRANSFORMERS_NAMES` and :data:`TASK_DEPENDENCIES` once, in one thread."""
    transformers = importlib.import_module("transformers")
    for name in TRANSFORMERS_NAMES:
        getattr(transformers, name)
    for module in TASK_DEPENDENCIES:
        importlib.import_module(module)


def consume_webhooks(worker: Any) -> bool:
    """Make ``worker`` consume the webhook queue too if it consumes the control queue (so every
    deployment that runs a control worker delivers webhooks, whatever its ``-Q`` says); whether
    it does. Its deliveries run on their own threads (``worker.batches.webhooks``), not the
    pool's."""
    queues = worker.app.amqp.queues
    consumed = queues.consume_from
    names = set(consumed or ()) if consumed is not None else set(queues)
    if CONTROL_QUEUE not in names:
        return False
    if WEBHOOK_QUEUE not in names:
        queues.select_add(WEBHOOK_QUEUE)
    return True


@worker_init.connect
def _consume_webhooks(sender: Any = None, **_: Any) -> None:
    # After the worker selected its queues (-Q), before its consumer starts.
    if sender is not None and getattr(sender, "app", None) is not None:
        consume_webhooks(sender)


@worker_init.connect
def _start_tracing(sender: Any = None, **_: Any) -> None:
    tracing.setup(str(getattr(sender, "hostname", "") or "worker").partition("@")[0])


@worker_init.connect
def _import_before_tasks(sender: Any = None, **_: Any) -> None:
    if not _dispatch_only(sender):  # a dispatch worker never loads torch or transformers
        import_task_dependencies()


def _dispatch_only(worker: Any) -> bool:
    """Whether ``worker`` consumes the queues of upstream models and nothing else."""
    try:
        consumed = set(worker.app.amqp.queues.consume_from or ())
    except Exception:
        return False
    upstream = {
        model_queue(name) for name, spec in get_settings().models.items() if specs.is_upstream(spec)
    }
    return bool(consumed) and consumed <= upstream


@worker_ready.connect
def _start_metrics_exporter(**_: Any) -> None:
    # Not at worker_init: Celery sets up logging after it, and the exporter's "listening on"
    # line (or the error naming a port it cannot bind) would go nowhere. At worker_ready (in
    # the main process) logging is set up and the start banner printed, so the line sits just
    # above "ready."; a prefork pool's first children, forked by then, do not inherit the socket.
    start_exporter()


@worker_ready.connect
def _start_trimming(**_: Any) -> None:
    memory.start()


@worker_ready.connect
def _start_liveness(sender: Any = None, **_: Any) -> None:
    liveness.start(sender, CONTROL_TASKS)


@worker_shutting_down.connect
def _stop_liveness(**_: Any) -> None:
    # A requested shutdown: whoever asked for it bounds it (see worker.infra.liveness).
    liveness.stop()
    tracing.flush()


@worker_init.connect
def _arm_drain(**_: Any) -> None:
    drain.arm()


@worker_shutting_down.connect
def _begin_drain(how: str = "", **_: Any) -> None:
    # A warm shutdown (SIGTERM): running shards hand back what they cannot finish in time,
    # and the drain bounds the process's exit (worker.infra.drain).
    if how == "Warm":
        drain.begin(get_settings().worker_drain_s)


@after_setup_logger.connect
@after_setup_task_logger.connect
def _log_format(logger: logging.Logger, **_: Any) -> None:
    install(logger.handlers, get_settings().log_format)


@worker_process_shutdown.connect
def _forget_pool_process(pid: int | None = None, **_: Any) -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.mark_process_dead(pid or os.getpid())


app = create_app()
