"""The telemetry records: round trips, typed refusals, size buckets and capacity."""

from __future__ import annotations

import msgspec
import pytest

from kinfer.topics import MalformedRecord
from kinfer.topics.stats import BatchStats, ModelStats, size_bucket, smallest_in_bucket


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
    assert [smallest_in_bucket(b) for b in (1, 2, 4, 8, 64)] == [1, 2, 3, 5, 33]


def test_capacity_is_the_best_rate_of_the_batch_sizes_run_not_the_rate_at_a_light_load() -> None:
    """Three workers whose batch costs 25 ms however full (an accelerator: up to 4 inputs), at a load of
    about 1.7 requests a batch: they could answer 3 × 3 / 25 ms (bucket 4 holds batches of 3 or more),
    not the 3 × 1.7 / 25 ms they answer now; at the mean alone every queue of 200 would read as a second."""
    light = ModelStats("m", 10.0, 204.0, 120.0, mean_batch=1.7, service_ms=25.0,
                       service_ms_by_size={1: 25.0, 2: 25.0, 4: 25.0}, shed={}, inputs_total=0, updated_ms=0,
                       workers=3, requests_per_batch=1.7)
    assert light.capacity_rps == pytest.approx(360.0)
    # Two inputs a request: the same batches answer half as many requests.
    paired = msgspec.structs.replace(light, requests_per_batch=0.85)
    assert paired.capacity_rps == pytest.approx(180.0)
    # A cost that grows with the inputs (10 ms each): no batch size beats the mean, which stands.
    linear = ModelStats("m", 10.0, 0, 0, mean_batch=2.5, service_ms=25.0,
                        service_ms_by_size={1: 10.0, 2: 20.0, 4: 35.0}, shed={}, inputs_total=0, updated_ms=0,
                        workers=1, requests_per_batch=2.5)
    assert linear.capacity_rps == pytest.approx(100.0)
