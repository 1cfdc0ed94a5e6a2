"""The telemetry records: round trips, typed refusals, size buckets and capacity."""

from __future__ import annotations

import pytest

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
