"""Batching decisions over plain data: no I/O, no asyncio, no torch, no clock (``now`` is passed in).

- ``DynamicBatcher``: one model's queue — priorities with aging, padded-token budgets, length
  bucketing, work-conserving dispatch, deadline-aware shedding and CoDel.
- ``ServiceTimeModel``: online estimate of a batch's compute time.
- ``DeficitRoundRobin``: fair sharing of one executor between co-located models.
- ``ContinuousScheduler``: iteration-level scheduling for generation (join and leave per step).
- ``BackgroundShare``: the Batch API's lines in flight per model, about a second of work, shared by tenant.
"""

from kinfer.batcher.codel import CoDel
from kinfer.batcher.continuous import ContinuousScheduler, Finish, GenPolicy, Sequence, Step
from kinfer.batcher.dynamic import Batch, BatchPolicy, BusyShare, Dropped, DynamicBatcher, Pending, Reason
from kinfer.batcher.fair import DeficitRoundRobin
from kinfer.batcher.service import ServicePrior, ServiceTimeModel
from kinfer.batcher.share import BackgroundShare

__all__ = [
    "BackgroundShare",
    "Batch",
    "BatchPolicy",
    "BusyShare",
    "CoDel",
    "ContinuousScheduler",
    "DeficitRoundRobin",
    "Dropped",
    "DynamicBatcher",
    "Finish",
    "GenPolicy",
    "Pending",
    "Reason",
    "Sequence",
    "ServicePrior",
    "ServiceTimeModel",
    "Step",
]
