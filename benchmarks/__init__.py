"""batchd's benchmarks, each run as ``python -m benchmarks.<name>``.

The parts they share: the workloads (:mod:`cli.perf.workload`, shared with ``batchd bench``
and ``batchd tune``), the harness that starts the service or the engine and samples its
processes (:mod:`benchmarks.harness`). Not a runtime package: nothing here ships with the
service, and nothing in the service imports it; the tests may import the harness.
"""
