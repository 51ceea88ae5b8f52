"""The service as subprocesses, and what tests and benchmarks put around it.

The stack (:mod:`tests.harness.stack`), the soak's stack and checks, TCP and HTTP fault
proxies and a fake upstream server. The benchmarks import these; nothing here imports
``benchmarks``. No module here is named ``test_*``, so pytest collects none of them."""
