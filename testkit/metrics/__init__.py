"""Metrics as the tests read them: a Prometheus text endpoint as samples
(:mod:`testkit.metrics.scrape`), and the rules every batchd metric follows
(:mod:`testkit.metrics.metrics_lint`)."""
