"""Paged attention over the packed step, with its CPU (SDPA) and CUDA (FlexAttention) backends."""
