"""Measuring batchd: ``batchd bench`` (the service under a workload) and ``batchd tune`` (the
engine's operating point)."""
