"""Telemetry: what workers report per batch, and what the telemetry stream makes of it.

Workers publish one ``BatchStats`` per batch (or generation step) to ``kinfer.stats``, keyed by
model; records that only carry sheds go out when work is refused without any batch running. The
telemetry stream processor (``ops.telemetry``, faust) keeps windowed per-model tables of them and
publishes a ``ModelStats`` summary per model to Redis (``kinfer:stats:<model>``), where the lag
monitor (service time for admission) and ``kinfer status`` read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack

from topics.errors import InvalidRequest

T = TypeVar("T")

STATS_TOPIC = "kinfer.stats"
STATS_KEY_PREFIX = "kinfer:stats:"


def stats_key(model: str) -> str:
    return f"{STATS_KEY_PREFIX}{model}"


def size_bucket(size: int) -> int:
    """Batch sizes are grouped by the next power of two (1, 2, 4, ... 64): a service-time table key."""
    bucket = 1
    while bucket < size and bucket < 64:
        bucket *= 2
    return bucket


def _decode(data: bytes, what: str, build: Callable[[dict[str, Any]], T]) -> T:
    """msgpack map → record; any malformation is an ``InvalidRequest`` naming ``what``."""
    try:
        obj = msgpack.unpackb(data, raw=False, max_str_len=256, max_map_len=64, max_array_len=64)
        if not isinstance(obj, dict):
            raise TypeError("not a map")
        return build(obj)
    except (ValueError, KeyError, TypeError, AttributeError, msgpack.ExtraData, msgpack.FormatError) as exc:
        raise InvalidRequest(f"malformed {what}: {exc}", "stats") from exc


@dataclass(frozen=True, slots=True)
class BatchStats:
    model: str
    worker: str
    at_ms: int  # wall clock when the batch ended
    size: int = 0  # inputs in the batch (sequences in a generation step); 0: a record of sheds only
    requests: int = 0  # requests answered by the batch (sequences admitted, for a generation step)
    tokens: int = 0  # tokens the batch processed (generated, for a step)
    compute_ms: float = 0.0  # measured forward pass
    predicted_ms: float = 0.0  # the service-time model's forecast (0 where there is none)
    errors: int = 0  # requests the batch failed
    shed: dict[str, int] = field(default_factory=dict)  # reason -> requests refused since the last record
    step: bool = False  # a generation step (size: sequences in it), not a one-shot batch

    def to_wire(self) -> dict[str, Any]:
        return {
            "model": self.model, "worker": self.worker, "at_ms": self.at_ms, "size": self.size,
            "requests": self.requests, "tokens": self.tokens, "compute_ms": self.compute_ms,
            "predicted_ms": self.predicted_ms, "errors": self.errors, "shed": self.shed, "step": self.step,
        }

    def pack(self) -> bytes:
        data: bytes = msgpack.packb(self.to_wire())
        return data

    @classmethod
    def unpack(cls, data: bytes) -> BatchStats:
        return _decode(data, "stats", lambda obj: cls(
            model=str(obj["model"]), worker=str(obj["worker"]), at_ms=int(obj["at_ms"]), size=int(obj["size"]),
            requests=int(obj["requests"]), tokens=int(obj["tokens"]), compute_ms=float(obj["compute_ms"]),
            predicted_ms=float(obj["predicted_ms"]), errors=int(obj["errors"]),
            shed={str(k): int(v) for k, v in obj["shed"].items()}, step=bool(obj.get("step", False)),
        ))


@dataclass(frozen=True, slots=True)
class ModelStats:
    """One model's recent throughput and service time, over the last one or two windows."""

    model: str
    window_s: float
    inputs_rps: float  # inputs served per second
    batches_rps: float
    mean_batch: float  # inputs per batch
    service_ms: float  # mean compute time of a batch
    service_ms_by_size: dict[int, float]  # size bucket (power of two) -> mean compute ms
    shed: dict[str, int]  # reason -> requests refused within the window
    inputs_total: int  # since the telemetry stream began (survives its restarts)
    updated_ms: int
    workers: int = 0  # distinct workers that ran batches of it within the window
    requests_per_batch: float = 0.0  # requests (Kafka records) a batch answers, on average
    steps_rps: float = 0.0  # generation steps per second

    @property
    def capacity_rps(self) -> float:
        """Requests (records) per second its workers could answer if always busy, at the batch
        sizes they run: each clears ``requests_per_batch`` per ``service_ms``. 0 when unknown —
        and for generation, whose cost per request depends on how many tokens it asks for.
        A worker shared with other models is counted whole for each of them."""
        if self.service_ms <= 0 or self.workers <= 0:
            return 0.0
        return self.workers * self.requests_per_batch * 1000.0 / self.service_ms

    def to_wire(self) -> dict[str, Any]:
        return {
            "model": self.model, "window_s": self.window_s, "inputs_rps": self.inputs_rps,
            "batches_rps": self.batches_rps, "mean_batch": self.mean_batch, "service_ms": self.service_ms,
            "service_ms_by_size": {str(b): ms for b, ms in self.service_ms_by_size.items()},
            "shed": self.shed, "inputs_total": self.inputs_total, "workers": self.workers,
            "requests_per_batch": self.requests_per_batch, "steps_rps": self.steps_rps,
            "updated_ms": self.updated_ms,
        }

    def pack(self) -> bytes:
        data: bytes = msgpack.packb(self.to_wire())
        return data

    @classmethod
    def unpack(cls, data: bytes) -> ModelStats:
        return _decode(data, "model stats", lambda obj: cls(
            model=str(obj["model"]), window_s=float(obj["window_s"]), inputs_rps=float(obj["inputs_rps"]),
            batches_rps=float(obj["batches_rps"]), mean_batch=float(obj["mean_batch"]),
            service_ms=float(obj["service_ms"]),
            service_ms_by_size={int(k): float(v) for k, v in obj["service_ms_by_size"].items()},
            shed={str(k): int(v) for k, v in obj["shed"].items()}, inputs_total=int(obj["inputs_total"]),
            updated_ms=int(obj["updated_ms"]), workers=int(obj.get("workers", 0)),
            requests_per_batch=float(obj.get("requests_per_batch", 0.0)),
            steps_rps=float(obj.get("steps_rps", 0.0)),
        ))
