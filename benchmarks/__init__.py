"""batchd's benchmarks, each run as ``python -m benchmarks.<name>``.

The parts they share: the workloads (:mod:`cli.perf.workload`, shared with ``batchd bench``
and ``batchd tune``), the process handling of :mod:`cli.perf.service`, the service's stack
(:mod:`testkit.service`) and the benchmarks' own meters (:mod:`testkit.bench`). Not a
runtime package: nothing in the service, ``cli`` or ``testkit`` imports it; only tests
whose subject is a benchmark do.
"""
