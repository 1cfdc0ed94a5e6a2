"""Batching decisions over plain data: no I/O, no clock (``now`` is always passed in)."""

from batcher.dynamic import Batch, BatchPolicy, DynamicBatcher, Pending

__all__ = ["Batch", "BatchPolicy", "DynamicBatcher", "Pending"]
