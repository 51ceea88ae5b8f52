"""The producers' and the workers' broker sockets are bounded on Redis, and left to the
transport elsewhere (the SQLAlchemy transport hands every option to ``create_engine``)."""

from __future__ import annotations

from core.broker import queue


def test_a_redis_producer_bounds_its_sockets() -> None:
    queue._producer.cache_clear()
    try:
        app = queue._producer("redis://127.0.0.1:6379/15")
        options = app.conf.broker_transport_options
        assert options == {
            "socket_connect_timeout": queue.SOCKET_CONNECT_TIMEOUT_S,
            "socket_timeout": queue.PRODUCER_SOCKET_TIMEOUT_S,
            "socket_keepalive": True,
        }
        assert app.conf.broker_connection_retry_on_startup is True
        sqla = queue._producer("sqla+sqlite:///nothing.db")
        assert sqla.conf.broker_transport_options == {}
    finally:
        queue._producer.cache_clear()


def test_the_workers_consumers_bound_theirs_with_a_longer_read() -> None:
    from worker.infra.celery import SOCKET_TIMEOUT_S, transport_options

    redis = transport_options("rediss://broker:6380/0")
    assert redis["socket_timeout"] == SOCKET_TIMEOUT_S > queue.PRODUCER_SOCKET_TIMEOUT_S
    assert redis["socket_connect_timeout"] == queue.SOCKET_CONNECT_TIMEOUT_S
    assert "visibility_timeout" in redis
    assert transport_options("sqla+sqlite:///x.db") == {}
