"""Projected completion times of batches."""
