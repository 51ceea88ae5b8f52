"""What only the benchmarks use: CPU meters, a private Postgres, other revisions' trees.

The service's processes, proxies and the soak's stack are the tests' (:mod:`tests.harness`)."""
