"""Where each worker keeps its models' weights, and the demand notes that wake a cold model.

Every worker writes a ``WorkerResidency`` to the Redis hash ``kinfer:residency`` (field: its worker
id) every couple of seconds: per model it may serve, the tier its weights are in and the measured
time of its last swap-in from each tier. The lag monitor reads it to tell producers how long a cold
model (one with no warm replica: its consumer group has no members) should take to come back, and
``kinfer status`` shows it. An entry older than ``RESIDENCY_FRESH_MS`` is a worker that is gone.

A producer that refuses a request because the model is cold and the cold start would outlast the
deadline publishes a ``Demand`` note on ``kinfer:demand``: the request never reaches Kafka, so
without the note no worker would see any reason to swap the model in.
"""

from __future__ import annotations

import msgspec

from kinfer.topics.record import Record

RESIDENCY_KEY = "kinfer:residency"
RESIDENCY_FRESH_MS = 10_000
DEMAND_CHANNEL = "kinfer:demand"

TIERS = ("device", "host", "disk")  # where weights can be: served / a copy away / a load away


class ModelResidency(Record, frozen=True):
    model: str
    tier: str  # one of TIERS, or "loading" while a swap-in runs
    footprint_bytes: int = 0  # device memory of the weights (measured once loaded; estimated before)
    # By source tier ("host", "disk"): how long the last swap-in took, to serving (warm-up and group join in).
    swap_in_ms: dict[str, float] = msgspec.field(default_factory=dict)


class WorkerResidency(Record, frozen=True):
    worker: str
    updated_ms: int
    budget_bytes: int = 0  # device memory for weights; 0: no budget (every model resident)
    models: list[ModelResidency] = msgspec.field(default_factory=list)


class Demand(Record, frozen=True):
    model: str


__all__ = ["DEMAND_CHANNEL", "RESIDENCY_FRESH_MS", "RESIDENCY_KEY", "TIERS", "Demand", "ModelResidency",
           "WorkerResidency"]
