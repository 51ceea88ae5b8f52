"""A message a worker held unacknowledged (a task waiting for its retry time, or running) when
the broker went away is queued again once the broker is back: restoring it when the channel
closed failed with the broker (worker/infra/celery.py, ``RedisQoS``)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from kombu import Connection

from testkit.proxies.tcp_proxy import TcpProxy
from testkit.service.stack import private_redis
from worker.infra import celery as infra_celery


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def test_a_message_held_through_a_broker_outage_is_queued_again(
    redis_url: str, tmp_path: Path
) -> None:
    with private_redis(redis_url, tmp_path) as url:
        proxy = TcpProxy("127.0.0.1", _port(url)).start()
        through = proxy.url_for(url, _port(url))
        assert through.startswith("redis://")
        options = infra_celery.transport_options(through)
        try:
            with Connection(url, transport_options=options) as direct:
                direct.SimpleQueue("held").put({"step": "finalize"})
            conn = Connection(
                through, transport=infra_celery.REDIS_TRANSPORT, transport_options=options
            )
            held = conn.SimpleQueue("held").get(timeout=5)  # delivered, not acknowledged
            assert held.payload == {"step": "finalize"}
            proxy.cut()  # the broker goes away while the message is held
            with contextlib.suppress(Exception):  # the restore at close cannot reach it
                conn.release()
            proxy.resume()
            with Connection(
                through, transport=infra_celery.REDIS_TRANSPORT, transport_options=options
            ) as again:
                back = again.SimpleQueue("held").get(timeout=5)
                back.ack()
            assert back.payload == {"step": "finalize"}
        finally:
            proxy.close()
