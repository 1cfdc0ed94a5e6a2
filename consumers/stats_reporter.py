"""Per-batch statistics to the telemetry stream (``kinfer.stats``), off the serving path.

The dispatch loop only adds each batch to a per-flush sum (one per model, size bucket, kind and
outcome); a background task turns the sums into records and sends them every ``interval_s``.
Telemetry is best effort: when the buffer is full the oldest records go, and a broker error costs
the records of one flush, never a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections import Counter, deque
from dataclasses import dataclass

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from kinfer.topics import now_ms
from kinfer.topics.record import MAX_DURATION_MS, WORKER_NAME_PATTERN
from kinfer.topics.stats import STATS_TOPIC, BatchStats, size_bucket

_COUNT_MAX = 2**31 - 1  # what a record's counts may hold (one flush of one worker)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Sum:
    """The batches of one model, size bucket, kind and outcome since the last flush (one record)."""

    size: int = 0
    requests: int = 0
    tokens: int = 0
    compute_ms: float = 0.0
    predicted_ms: float = 0.0
    errors: int = 0
    batches: int = 0

    def add(self, size: int, requests: int, tokens: int, compute_ms: float, predicted_ms: float, errors: int) -> None:
        self.size += size
        self.requests += requests
        self.tokens += tokens
        self.compute_ms += compute_ms
        self.predicted_ms += predicted_ms
        self.errors += errors
        self.batches += 1


class StatsReporter:
    def __init__(self, worker: str, max_buffered: int = 10_000, interval_s: float = 0.25,
                 flush_timeout_s: float = 5.0) -> None:
        if not re.search(WORKER_NAME_PATTERN, worker):  # else every record would be refused by its readers
            raise ValueError(f"worker id {worker!r} must be 1-128 letters, digits, '_', '.', ':' or '-'")
        self.worker = worker
        self.interval_s = interval_s
        self.flush_timeout_s = flush_timeout_s  # a missing topic or a slow broker costs records, not the worker
        self.sent = 0
        self.dropped = 0
        self._buffer: deque[BatchStats] = deque(maxlen=max_buffered)
        self._shed: dict[str, Counter[str]] = {}  # model -> reason -> count, not yet reported
        self._sums: dict[tuple[str, int, bool, bool], _Sum] = {}  # (model, bucket, step, failed), this flush
        self._max_keys = 4_096

    def batch(self, model: str, size: int, requests: int, tokens: int, compute_s: float, predicted_s: float = 0.0,
              errors: int = 0, step: bool = False) -> None:
        """Add one batch (or step) to its model's sum for this flush: per flush, not per batch."""
        key = (model, size_bucket(size), step, errors > 0)
        total = self._sums.get(key)
        if total is None:
            if len(self._sums) >= self._max_keys:  # models × buckets × kinds: bounded, but say so
                self.dropped += 1
                return
            total = self._sums[key] = _Sum()
        total.add(size, requests, tokens, compute_s * 1000.0, predicted_s * 1000.0, errors)

    def shed(self, model: str, reason: str, count: int = 1) -> None:
        self._shed.setdefault(model, Counter())[reason] += count

    def _append(self, stats: BatchStats) -> None:
        if len(self._buffer) == self._buffer.maxlen:
            self.dropped += 1
        self._buffer.append(stats)

    def _records(self) -> None:
        """This flush's sums become records; sheds ride on their model's first, else go alone."""
        at = now_ms()
        sums, self._sums = self._sums, {}
        for (model, _, step, _), t in sums.items():
            self._append(BatchStats(  # within the record's ranges, as its readers hold it to them
                model=model, worker=self.worker, at_ms=at, size=min(t.size, _COUNT_MAX),
                requests=min(t.requests, _COUNT_MAX), tokens=min(t.tokens, _COUNT_MAX),
                compute_ms=round(min(t.compute_ms, MAX_DURATION_MS), 3),
                predicted_ms=round(min(t.predicted_ms, MAX_DURATION_MS), 3), errors=min(t.errors, _COUNT_MAX),
                shed=dict(self._shed.pop(model, {})), step=step, batches=min(t.batches, _COUNT_MAX),
            ))
        for model in list(self._shed):
            self._append(BatchStats(model=model, worker=self.worker, at_ms=at, shed=dict(self._shed.pop(model))))

    async def run(self, producer: AIOKafkaProducer, stop: asyncio.Event) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
            try:
                await asyncio.wait_for(self.flush(producer), self.flush_timeout_s)
            except TimeoutError:
                log.warning("telemetry: flush to %s timed out (does the topic exist? `kinfer topics`)", STATS_TOPIC)
            if stop.is_set():
                return

    async def flush(self, producer: AIOKafkaProducer) -> None:
        self._records()
        records = list(self._buffer)
        self._buffer.clear()
        if not records:
            return
        try:
            futures = [await producer.send(STATS_TOPIC, r.pack(), key=r.model.encode()) for r in records]
            await asyncio.gather(*futures)
            self.sent += len(records)
        except KafkaError as exc:
            self.dropped += len(records)
            log.warning("telemetry: %d batch records not sent: %s", len(records), exc)
        except asyncio.CancelledError:  # timed out (see run): these are gone too
            self.dropped += len(records)
            raise
