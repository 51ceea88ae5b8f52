"""What only the benchmarks use: CPU meters (:mod:`testkit.bench.cpu`), a private Postgres
(:mod:`testkit.bench.postgres`), other revisions' trees (:mod:`testkit.bench.revisions`)."""
