"""Celery infrastructure of the workers: the app, engines of the process, liveness."""
