"""Validation: read a batch's input once, create its shards, count its tokens."""
