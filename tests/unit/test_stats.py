"""The telemetry contract and the worker's reporter, without a broker."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kinfer.consumers.telemetry import StatsReporter
from kinfer.ops.control.telemetry import summarize
from kinfer.topics import MalformedRecord
from kinfer.topics.stats import BatchStats, ModelStats, size_bucket


def test_records_round_trip_and_bad_input_is_typed() -> None:
    b = BatchStats("m", "w1", 1, size=8, requests=3, tokens=90, compute_ms=12.5, predicted_ms=11.0,
                   shed={"codel": 2}, step=True)
    assert BatchStats.unpack(b.pack()) == b
    s = ModelStats("m", 10.0, 50.0, 6.0, 8.3, 21.0, {8: 20.0, 16: 30.0}, {"expired": 1}, 900, 5, workers=2,
                   requests_per_batch=3.5, steps_rps=0.0)
    assert ModelStats.unpack(s.pack()) == s
    with pytest.raises(MalformedRecord):
        BatchStats.unpack(b"\x93\x01\x02\x03")


def test_size_buckets_and_capacity() -> None:
    assert [size_bucket(n) for n in (1, 2, 3, 5, 16, 17, 64, 500)] == [1, 2, 4, 8, 16, 32, 64, 64]
    # Capacity counts requests (Kafka records, what lag counts), not inputs: 2 workers × 2 requests
    # (of 4 inputs) every 20 ms.
    two_workers = ModelStats("m", 10.0, 0, 0, mean_batch=4.0, service_ms=20.0, service_ms_by_size={}, shed={},
                             inputs_total=0, updated_ms=0, workers=2, requests_per_batch=2.0)
    assert two_workers.capacity_rps == pytest.approx(200.0)
    assert ModelStats("m", 10.0, 0, 0, 0.0, 0.0, {}, {}, 0, 0).capacity_rps == 0.0  # unknown, not zero speed


def test_summary_of_two_windows() -> None:
    windows: dict[str, Any] = {
        "inputs": 30, "requests": 20, "batches": 10, "steps": 0, "service_n": {1: 5, 4: 5},
        "service_ms": {1: 50.0, 4: 150.0}, "shed": {"codel": 2, "expired": 0},
    }
    s = summarize("m", window_s=10.0, elapsed_s=5.0, windows=windows, total=99, workers=1)
    assert s.inputs_rps == pytest.approx(2.0) and s.mean_batch == 3.0
    assert s.service_ms == pytest.approx(20.0) and s.service_ms_by_size == {1: 10.0, 4: 30.0}
    assert s.shed == {"codel": 2} and s.inputs_total == 99
    assert s.capacity_rps == pytest.approx(100.0)  # 2 requests per batch, a batch every 20 ms


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
