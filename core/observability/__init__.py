"""What a process tells about itself: its log lines and their context (``logs``), the
request id an API call hands on to the tasks it causes (``request_ids``), Prometheus metrics
and the autoscaler's query (``metrics``), OpenTelemetry traces (``tracing``)."""
