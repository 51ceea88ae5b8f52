"""The service as subprocesses: the whole stack (:mod:`testkit.service.stack`), a cluster's
nodes on one machine, and the soak's stack and checks."""
