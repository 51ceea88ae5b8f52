"""Loopback proxies that break the service's connections on demand: TCP to Postgres or Redis
(:mod:`testkit.proxies.tcp_proxy`), HTTP to an upstream server (:mod:`testkit.proxies.fault_proxy`)."""
