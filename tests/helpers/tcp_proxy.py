"""Moved to :mod:`cli.perf.tcp_proxy` (``benchmarks.soak`` uses it too); re-exported here."""

from cli.perf.tcp_proxy import TcpProxy

__all__ = ["TcpProxy"]
