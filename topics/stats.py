"""Telemetry: what workers report per batch, and what the telemetry stream makes of it.

Workers publish ``BatchStats`` to ``kinfer.stats``, keyed by model: every flush (a quarter of a
second), one record per model, batch-size bucket, kind (batch or generation step) and outcome,
summing the batches it stands for; records that only carry sheds go out when work is refused
without any batch running. The
telemetry stream processor (``ops.control.telemetry``, faust) keeps windowed per-model tables of them and
publishes a ``ModelStats`` summary per model to Redis (``kinfer:stats:<model>``), where the lag
monitor (service time for admission) and ``kinfer status`` read it.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kinfer.topics.record import (
    MAX_LABELS,
    MAX_RATE_RPS,
    Count,
    Counts,
    Millis,
    ModelName,
    Rate,
    Ratio,
    Record,
    SmallCount,
    WallMs,
    WorkerName,
)

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


def smallest_in_bucket(bucket: int) -> int:
    """The fewest inputs a batch of ``size_bucket`` ``bucket`` holds (bucket 4 holds 3 and 4)."""
    return 1 if bucket <= 1 else bucket // 2 + 1


SizeBucket = Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]


class BatchStats(Record, frozen=True):
    """Every field is held to its range when decoded (``Record.unpack``): counts non-negative and
    below 2**31 (one flush of one worker), times finite within ``MAX_DURATION_MS``, names matching
    their patterns, at most ``MAX_LABELS`` shed reasons."""

    max_bytes = 4_096  # one record is ~200 bytes
    dated_by = "at_ms"

    model: ModelName
    worker: WorkerName
    at_ms: WallMs  # wall clock when the batch ended
    size: SmallCount = 0  # inputs in the batch (sequences in a generation step); 0: a record of sheds only
    requests: SmallCount = 0  # requests answered by the batch (sequences admitted, for a generation step)
    tokens: SmallCount = 0  # tokens the batch processed (generated, for a step)
    compute_ms: Millis = 0.0  # measured forward pass
    predicted_ms: Millis = 0.0  # the service-time model's forecast (0 where there is none)
    errors: SmallCount = 0  # requests the batch failed
    shed: Counts = msgspec.field(default_factory=dict)  # reason -> requests refused since the last record
    step: bool = False  # a generation step (size: sequences in it), not a one-shot batch
    # How many batches (or steps) this record sums: a worker reports per flush, not per batch, one
    # record per model, size bucket, kind and outcome; size, requests, tokens, compute_ms,
    # predicted_ms and errors are then totals over them. Absent in older records: one batch.
    batches: SmallCount = 1


class ModelStats(Record, frozen=True):
    """One model's recent throughput and service time, over the last one or two windows."""

    max_bytes = 4_096
    dated_by = "updated_ms"

    model: ModelName
    window_s: Annotated[float, msgspec.Meta(ge=0.0, le=86_400.0)]
    inputs_rps: Rate  # inputs served per second
    batches_rps: Rate
    mean_batch: Ratio  # inputs per batch
    service_ms: Millis  # mean compute time of a batch
    # size bucket (power of two) -> mean compute ms
    service_ms_by_size: Annotated[dict[SizeBucket, Millis], msgspec.Meta(max_length=MAX_LABELS)]
    shed: Counts  # reason -> requests refused within the window
    inputs_total: Count  # since the telemetry stream began (survives its restarts)
    updated_ms: WallMs
    workers: SmallCount = 0  # distinct workers that ran batches of it within the window
    requests_per_batch: Ratio = 0.0  # requests (Kafka records) a batch answers, on average
    steps_rps: Rate = 0.0  # generation steps per second

    @property
    def capacity_rps(self) -> float:
        """Requests (records) per second its workers could answer if always busy.

        A queue fills batches, and an accelerator's batch costs little more for more inputs, so this
        is the best rate any batch size they ran within the window gives (a size bucket's smallest
        size over its mean compute time), and never below the rate at the mean batch (each clears
        ``requests_per_batch`` per ``service_ms``). Under light load the mean batch is small and the
        rate at it is the arrival rate only: read as the capacity, it turned any short queue into a
        long predicted wait, and admission refused what the workers could have served. 0 when
        unknown — and for generation, whose cost per request depends on how many tokens it asks
        for. A worker shared with other models is counted whole for each of them."""
        if self.service_ms <= 0 or self.workers <= 0:
            return 0.0
        per_ms = self.requests_per_batch / self.service_ms
        if self.mean_batch > 0:
            per_input = self.requests_per_batch / self.mean_batch  # requests an input stands for
            for bucket, ms in self.service_ms_by_size.items():
                if ms > 0:
                    per_ms = max(per_ms, smallest_in_bucket(bucket) * per_input / ms)
        return min(MAX_RATE_RPS, self.workers * per_ms * 1000.0)
