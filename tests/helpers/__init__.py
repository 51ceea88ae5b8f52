"""Helpers the test modules share: request lines (:mod:`tests.helpers.lines`), the service's
processes (:mod:`tests.helpers.service`, also used by the service benchmarks in scripts/), and
batches and rows for the worker tests (:mod:`tests.helpers.worker`)."""
