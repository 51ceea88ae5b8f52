"""Measuring batchd: ``batchd bench`` (the service) and ``batchd tune`` (the engine alone)."""
