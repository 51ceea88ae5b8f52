"""What keeps the service from being turned against its operator: where it may send its own
requests (``netcheck``), and credentials taken out of text it passes on (``redaction``)."""
