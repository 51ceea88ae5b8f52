"""Benchmarks of batchd's engine (``python -m benchmarks.engine``). Not a runtime package:
nothing here ships with the service; the tests import it from the repository root."""
