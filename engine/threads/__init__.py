"""The intra-op thread team of a CPU engine, sized between steps to the cores the rest of the
machine leaves free (``governor``)."""
