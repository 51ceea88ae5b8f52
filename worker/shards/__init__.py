"""Shards: run a range of a batch's requests on a host, checkpoint, recover, release."""
