"""A simulated engine: deterministic tokens at a configured rate, no weights, for service tests."""
