"""Per-batch statistics to the telemetry stream (``kinfer.stats``), off the serving path.

The dispatch loop only appends to a bounded buffer; a background task sends what is there every
``interval_s``. Telemetry is best effort: when the buffer is full the oldest records go, and a
broker error costs the records of one flush, never a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, deque

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from topics import now_ms
from topics.stats import STATS_TOPIC, BatchStats

log = logging.getLogger(__name__)


class StatsReporter:
    def __init__(self, worker: str, max_buffered: int = 10_000, interval_s: float = 0.25,
                 flush_timeout_s: float = 5.0) -> None:
        self.worker = worker
        self.interval_s = interval_s
        self.flush_timeout_s = flush_timeout_s  # a missing topic or a slow broker costs records, not the worker
        self.sent = 0
        self.dropped = 0
        self._buffer: deque[BatchStats] = deque(maxlen=max_buffered)
        self._shed: dict[str, Counter[str]] = {}  # model -> reason -> count, not yet reported

    def batch(self, model: str, size: int, requests: int, tokens: int, compute_s: float, predicted_s: float = 0.0,
              errors: int = 0, step: bool = False) -> None:
        self._append(BatchStats(
            model=model, worker=self.worker, at_ms=now_ms(), size=size, requests=requests, tokens=tokens,
            compute_ms=round(compute_s * 1000.0, 3), predicted_ms=round(predicted_s * 1000.0, 3), errors=errors,
            shed=dict(self._shed.pop(model, {})), step=step,
        ))

    def shed(self, model: str, reason: str, count: int = 1) -> None:
        self._shed.setdefault(model, Counter())[reason] += count

    def _append(self, stats: BatchStats) -> None:
        if len(self._buffer) == self._buffer.maxlen:
            self.dropped += 1
        self._buffer.append(stats)

    def _flush_sheds(self) -> None:
        """Sheds with no batch to ride on (everything refused) go out on their own."""
        for model in list(self._shed):
            self._append(BatchStats(model=model, worker=self.worker, at_ms=now_ms(), shed=dict(self._shed.pop(model))))

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
        self._flush_sheds()
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
