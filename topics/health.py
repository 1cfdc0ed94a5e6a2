"""The health signal: how loaded a model is, published by the lag monitor, obeyed by producers.

Published three ways, same content: a Redis hash ``kinfer:health:<model>`` (read on demand), a
pub/sub notification on ``kinfer:health`` (pushed on every level change), and a compacted Kafka
topic ``kinfer.health`` keyed by model (durable, for consumers that start later).
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from kinfer.topics.record import MAX_DURATION_MS, Count, Millis, ModelName, Rate, Record, WallMs

HEALTH_TOPIC = "kinfer.health"
HEALTH_CHANNEL = "kinfer:health"
HEALTH_KEY_PREFIX = "kinfer:health:"
DECISIONS_KEY = "kinfer:decisions"  # the latest level changes, newest first (a Redis list)
DECISIONS_KEPT = 200


class Level(enum.IntEnum):
    """What producers do with new requests for the model, by priority."""

    OK = 0  # admit everything that can meet its deadline
    DEGRADED = 1  # as OK; the system is slower than usual (upstream may slow down)
    SHEDDING = 2  # refuse p2 at once
    REJECTING = 3  # refuse p1 and p2; p0 only if it can meet its deadline


RetryMs = Annotated[int, msgspec.Meta(ge=0, le=int(MAX_DURATION_MS))]
Replicas = Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)]


class HealthState(Record, frozen=True):
    """Every field is held to its range when decoded (``Record.unpack``): numbers finite, waits and
    times within ``MAX_DURATION_MS``, rates within ``MAX_RATE_RPS``, the model a model name. The lag
    monitor clamps what it publishes to the same ranges. Whether ``updated_ms`` is near enough to now
    is the reader's to judge (``MAX_SKEW_MS``)."""

    max_bytes = 4_096  # one state is ~300 bytes
    dated_by = "updated_ms"

    model: ModelName
    level: Level
    predicted_wait_ms: Millis  # queueing a new request should expect now (unsmoothed; the level is smoothed)
    retry_after_ms: RetryMs  # when a refused caller should try again
    lag: Count  # records waiting in the model's request topics
    arrival_rps: Rate  # records/s written to the request topics (smoothed)
    drain_rps: Rate  # records/s committed by the workers (smoothed)
    updated_ms: WallMs  # wall clock of the estimate
    # Of ``lag``: records waiting in p0, p1, p2. Admission still uses the whole predicted wait for
    # every priority: workers age buffered lower-priority work up to p0, so a p0 request can wait
    # behind part of a p2 backlog, and an estimate that ignored it would admit it to expire.
    lag_by_priority: tuple[Count, Count, Count] = (0, 0, 0)
    service_ms: Millis = 0.0  # recent mean compute time of a batch (telemetry); 0: unknown
    capacity_rps: Rate = 0.0  # records/s the workers drain while busy; 0: not measured yet
    arrival_by_priority: tuple[Rate, Rate, Rate] = (0.0, 0.0, 0.0)  # of ``arrival_rps``: p0, p1, p2
    # Members of the model's consumer group: workers that have it warm (a worker joins only once the
    # model is loaded and warmed up). 0: the model is *cold*; -1: not known.
    warm_replicas: Replicas = -1
    # While cold: how long until a worker should have it warm (its workers' last measured swap-in from
    # the tier its weights are in; 0: no worker has measured one).
    cold_start_ms: Millis = 0.0
    # Records waiting in the background topic (p3): work that waits for idle capacity by design. Not
    # in ``lag`` (no interactive request waits behind it); the autoscaler keeps a worker while it is not 0.
    background_lag: Count = 0


class LevelChange(Record, frozen=True, array_like=True):
    """One decision of the lag monitor, kept for ``kinfer status`` (a msgpack array, in field order)."""

    max_bytes = 1_024

    at_ms: WallMs
    model: ModelName
    before: Level | None  # None: the first state the monitor published
    after: Level
    lag: Count
    predicted_wait_ms: Millis  # the smoothed wait the level was decided on


def health_key(model: str) -> str:
    return f"{HEALTH_KEY_PREFIX}{model}"
