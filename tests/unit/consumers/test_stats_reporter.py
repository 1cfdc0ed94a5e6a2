"""The worker's telemetry reporter, without a broker."""

from __future__ import annotations

import asyncio

import pytest

from kinfer.consumers.stats_reporter import StatsReporter
from kinfer.topics.stats import BatchStats


class StuckProducer:
    """A producer whose topic never appears: every send waits forever."""

    async def send(self, *args: object, **kwargs: object) -> None:
        await asyncio.Event().wait()


async def test_reporter_rides_sheds_on_batches_and_gives_up_on_a_stuck_broker() -> None:
    r = StatsReporter("w1", interval_s=0.01, flush_timeout_s=0.05)
    r.shed("m", "codel", 2)
    r.batch("m", size=4, requests=2, tokens=40, compute_s=0.02)
    r.shed("other", "expired")
    stop = asyncio.Event()
    task = asyncio.create_task(r.run(StuckProducer(), stop))  # type: ignore[arg-type]
    await asyncio.sleep(0.2)
    stop.set()
    await asyncio.wait_for(task, 1.0)  # the worker's shutdown is not held up by telemetry
    assert r.sent == 0 and r.dropped == 2  # the batch (carrying m's sheds) and other's shed-only record


class RecordingProducer:
    def __init__(self) -> None:
        self.records: list[BatchStats] = []

    async def send(self, topic: str, value: bytes, key: bytes) -> asyncio.Future[None]:
        self.records.append(BatchStats.unpack(value))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


async def test_reporter_sends_one_record_per_model_bucket_and_kind_per_flush() -> None:
    """500 batches between two flushes are a handful of records, which sum them exactly."""
    r = StatsReporter("w1")
    for i in range(500):
        r.batch("m", size=1 if i % 2 else 3, requests=1, tokens=10, compute_s=0.001)
    r.batch("m", size=3, requests=1, tokens=10, compute_s=0.5, errors=1)
    r.batch("g", size=4, requests=1, tokens=4, compute_s=0.01, step=True)
    r.shed("m", "codel", 3)
    producer = RecordingProducer()
    await r.flush(producer)  # type: ignore[arg-type]
    by_kind = {(s.model, s.size // s.batches, s.step, s.errors > 0): s for s in producer.records}
    assert len(producer.records) == 4
    assert by_kind["m", 1, False, False].batches == 250 and by_kind["m", 3, False, False].size == 750
    assert by_kind["m", 3, False, True].errors == 1 and by_kind["g", 4, True, False].batches == 1
    assert sum(s.shed.get("codel", 0) for s in producer.records) == 3  # the sheds ride once
    assert sum(s.compute_ms for s in producer.records if not s.step) == pytest.approx(1000.0)
