"""Helpers the test modules share: request lines (:mod:`tests.helpers.lines`) and batches and
rows for the worker tests (:mod:`tests.helpers.worker`); the service's processes come from
:mod:`tests.harness.stack`."""
