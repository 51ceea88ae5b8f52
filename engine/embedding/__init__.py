"""Embedding models: a padded-batch engine and the thread-safe host the worker feeds."""
