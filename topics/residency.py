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

from typing import Annotated

import msgspec

from kinfer.topics.record import Bytes, Millis, ModelName, Record, WallMs, WorkerName

RESIDENCY_KEY = "kinfer:residency"
RESIDENCY_FRESH_MS = 10_000
DEMAND_CHANNEL = "kinfer:demand"

TIERS = ("device", "host", "disk")  # where weights can be: served / a copy away / a load away
MAX_MODELS_PER_WORKER = 256  # models one residency report may list

# A tier's name (str, so a worker's own strings type-check; the pattern is what is enforced).
Tier = Annotated[str, msgspec.Meta(pattern=r"^(device|host|disk)\Z")]
Placement = Annotated[str, msgspec.Meta(pattern=r"^(device|host|disk|loading)\Z")]


class ModelResidency(Record, frozen=True):
    model: ModelName
    tier: Placement  # one of TIERS, or "loading" while a swap-in runs
    footprint_bytes: Bytes = 0  # device memory of the weights (measured once loaded; estimated before)
    # By source tier ("host", "disk"): how long the last swap-in took, to serving (warm-up and group join in).
    swap_in_ms: Annotated[dict[Tier, Millis], msgspec.Meta(max_length=len(TIERS))] = msgspec.field(
        default_factory=dict)


class WorkerResidency(Record, frozen=True):
    """A worker's report. Its fields are held to their ranges when decoded; whether ``updated_ms`` is
    fresh (``RESIDENCY_FRESH_MS``) or dated ahead of now (``MAX_SKEW_MS``) is the reader's to judge."""

    max_bytes = 65_536  # MAX_MODELS_PER_WORKER entries of ~150 bytes, and room
    dated_by = "updated_ms"

    worker: WorkerName
    updated_ms: WallMs
    budget_bytes: Bytes = 0  # device memory for weights; 0: no budget (every model resident)
    models: Annotated[list[ModelResidency], msgspec.Meta(max_length=MAX_MODELS_PER_WORKER)] = msgspec.field(
        default_factory=list)


class Demand(Record, frozen=True):
    max_bytes = 256  # a model name and its key

    model: ModelName


__all__ = ["DEMAND_CHANNEL", "MAX_MODELS_PER_WORKER", "RESIDENCY_FRESH_MS", "RESIDENCY_KEY", "TIERS", "Demand",
           "ModelResidency", "WorkerResidency"]
