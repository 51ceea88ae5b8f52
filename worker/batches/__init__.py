"""Batch-level tasks: validate/cancel/expire, finalize, webhooks, file retention."""
