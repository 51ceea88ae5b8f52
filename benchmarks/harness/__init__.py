"""The processes a benchmark measures and the readings it takes of them."""
