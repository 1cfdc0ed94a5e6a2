"""The health signal: how loaded a model is, published by the lag monitor, obeyed by producers.

Published three ways, same content: a Redis hash ``kinfer:health:<model>`` (read on demand), a
pub/sub notification on ``kinfer:health`` (pushed on every level change), and a compacted Kafka
topic ``kinfer.health`` keyed by model (durable, for consumers that start later).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgpack

from topics.errors import InvalidRequest

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


@dataclass(frozen=True, slots=True)
class HealthState:
    model: str
    level: Level
    predicted_wait_ms: float  # queueing a new request should expect now (unsmoothed; the level is smoothed)
    retry_after_ms: int  # when a refused caller should try again
    lag: int  # records waiting in the model's request topics
    arrival_rps: float  # records/s written to the request topics (smoothed)
    drain_rps: float  # records/s committed by the workers (smoothed)
    updated_ms: int  # wall clock of the estimate
    # Of ``lag``: records waiting in p0, p1, p2. Admission still uses the whole predicted wait for
    # every priority: workers age buffered lower-priority work up to p0, so a p0 request can wait
    # behind part of a p2 backlog, and an estimate that ignored it would admit it to expire.
    lag_by_priority: tuple[int, int, int] = (0, 0, 0)
    service_ms: float = 0.0  # recent mean compute time of a batch (telemetry); 0: unknown
    capacity_rps: float = 0.0  # records/s the workers drain while busy; 0: not measured yet
    arrival_by_priority: tuple[float, float, float] = (0.0, 0.0, 0.0)  # of ``arrival_rps``: p0, p1, p2

    def to_wire(self) -> dict[str, Any]:
        return {
            "model": self.model, "level": int(self.level), "predicted_wait_ms": self.predicted_wait_ms,
            "retry_after_ms": self.retry_after_ms, "lag": self.lag, "arrival_rps": self.arrival_rps,
            "drain_rps": self.drain_rps, "updated_ms": self.updated_ms, "lag_by_priority": list(self.lag_by_priority),
            "service_ms": self.service_ms, "capacity_rps": self.capacity_rps,
            "arrival_by_priority": list(self.arrival_by_priority),
        }

    def pack(self) -> bytes:
        data: bytes = msgpack.packb(self.to_wire())
        return data

    @classmethod
    def unpack(cls, data: bytes) -> HealthState:
        try:
            obj = msgpack.unpackb(data, raw=False, max_str_len=256, max_map_len=16, max_array_len=3)
            p0, p1, p2 = (int(n) for n in obj.get("lag_by_priority", (0, 0, 0)))
            a0, a1, a2 = (float(r) for r in obj.get("arrival_by_priority", (0.0, 0.0, 0.0)))
            return cls(
                model=str(obj["model"]), level=Level(int(obj["level"])),
                predicted_wait_ms=float(obj["predicted_wait_ms"]), retry_after_ms=int(obj["retry_after_ms"]),
                lag=int(obj["lag"]), arrival_rps=float(obj["arrival_rps"]), drain_rps=float(obj["drain_rps"]),
                updated_ms=int(obj["updated_ms"]), lag_by_priority=(p0, p1, p2),
                service_ms=float(obj.get("service_ms", 0.0)), capacity_rps=float(obj.get("capacity_rps", 0.0)),
                arrival_by_priority=(a0, a1, a2),
            )
        except (ValueError, KeyError, TypeError, AttributeError, msgpack.ExtraData, msgpack.FormatError) as exc:
            raise InvalidRequest(f"malformed health state: {exc}", "health") from exc


@dataclass(frozen=True, slots=True)
class LevelChange:
    """One decision of the lag monitor, kept for ``kinfer status``."""

    at_ms: int
    model: str
    before: Level | None  # None: the first state the monitor published
    after: Level
    lag: int
    predicted_wait_ms: float  # the smoothed wait the level was decided on

    def pack(self) -> bytes:
        data: bytes = msgpack.packb([self.at_ms, self.model, None if self.before is None else int(self.before),
                                     int(self.after), self.lag, self.predicted_wait_ms])
        return data

    @classmethod
    def unpack(cls, data: bytes) -> LevelChange:
        try:
            at, model, before, after, lag, wait = msgpack.unpackb(data, raw=False, max_str_len=256, max_array_len=6)
            return cls(int(at), str(model), None if before is None else Level(int(before)), Level(int(after)),
                       int(lag), float(wait))
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
            raise InvalidRequest(f"malformed level change: {exc}", "health") from exc


def health_key(model: str) -> str:
    return f"{HEALTH_KEY_PREFIX}{model}"
