"""What the tests and the benchmarks put around the service, in one package both import.

- :mod:`testkit.service`: the whole service as subprocesses (``stack``), nodes of a cluster
  on one machine (``cluster``), the soak's stack and the checks it judges by
  (``soak_stack``, ``soak_checks``);
- :mod:`testkit.proxies`: a loopback TCP proxy that cuts Postgres or Redis off
  (``tcp_proxy``), an HTTP proxy that injects an upstream server's refusals (``fault_proxy``);
- :mod:`testkit.upstream_server`: a real OpenAI-compatible server for upstream models;
- :mod:`testkit.engine_gate`: a gate in an engine that holds work on purpose;
- :mod:`testkit.builders`: request lines, batches and rows, LoRA adapters;
- :mod:`testkit.metrics`: a Prometheus endpoint read into samples, and the metrics' lint;
- :mod:`testkit.bench`: the benchmarks' meters: CPU seconds, a private Postgres, other
  revisions' trees.

Nothing here imports ``tests`` or ``benchmarks``, and it is not installed with the service.
No module here is named ``test_*``, so pytest collects none of them."""
