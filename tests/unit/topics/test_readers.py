"""Long-lived readers take each record on its own: a bad one is counted by reader and reason and skipped,
the loop goes on; a loop that fails otherwise restarts with backoff and says so. Admission never admits
on a wait that is not a number, and names a retry-after that fits a header."""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from typing import Any

import msgpack
import pytest
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from kinfer.ops.control.autoscaler import AutoscaleLoop, KubernetesPool
from kinfer.ops.control.estimator import HealthEstimator
from kinfer.ops.control.lagmon import (
    LagMonitor,
    cold_start_estimates,
    export_state,
    read_answered,
    read_residency,
    read_stats,
)
from kinfer.ops.control.telemetry import Aggregator, workers_by_model
from kinfer.producers.admission import MAX_RETRY_AFTER_S, expected_wait_ms, health_decision
from kinfer.producers.gateway_pipeline import error_payload
from kinfer.producers.health import HealthWatch
from kinfer.topics import ColdStart, Overloaded, Priority
from kinfer.topics.health import HealthState, Level
from kinfer.topics.progress import Answered, Position
from kinfer.topics.readers import Supervised
from kinfer.topics.record import MAX_DURATION_MS, MAX_SKEW_MS
from kinfer.topics.residency import ModelResidency, WorkerResidency
from kinfer.topics.stats import BatchStats, ModelStats

NOW = 1_700_000_000_000


def refused(reader: str, reason: str) -> float:
    return REGISTRY.get_sample_value("kinfer_malformed_records_total", {"reader": reader, "reason": reason}) or 0.0


def nested(depth: int) -> bytes:
    """Arrays ``depth`` deep, under an unknown key of a map: what a decoder must skip, recursing."""
    return b"\x81\xa3zzz" + b"\x91" * depth + b"\xc0"


def state(model: str = "m", updated_ms: int = NOW, **fields: Any) -> HealthState:
    base: dict[str, Any] = {"level": Level.OK, "predicted_wait_ms": 10.0, "retry_after_ms": 1000, "lag": 0,
                            "arrival_rps": 0.0, "drain_rps": 0.0}
    return HealthState(model=model, updated_ms=updated_ms, **{**base, **fields})


def with_field(record: Any, **fields: Any) -> bytes:
    """The record's bytes with fields set to anything (NaN included), as a forger would write them."""
    return msgpack.packb({**msgpack.unpackb(record.pack(), strict_map_key=False), **fields})


# -- the shared supervisor ---------------------------------------------------------------------------


async def test_a_failing_loop_is_restarted_with_backoff_and_reported_down_meanwhile() -> None:
    failed, again = asyncio.Event(), asyncio.Event()
    runs = 0

    async def loop() -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            failed.set()
            raise RuntimeError("a bug")
        again.set()
        await asyncio.Event().wait()  # runs until cancelled

    reader = Supervised("test-restart", loop, first_s=0.2, max_s=1.0)
    task = asyncio.create_task(reader.run())
    try:
        await asyncio.wait_for(failed.wait(), 5)  # the supervisor counted it before it began to wait
        assert reader.restarts == 1 and not reader.up and isinstance(reader.last_error, RuntimeError)
        assert REGISTRY.get_sample_value("kinfer_reader_up", {"reader": "test-restart"}) == 0
        assert REGISTRY.get_sample_value("kinfer_reader_restarts_total", {"reader": "test-restart"}) == 1
        await asyncio.wait_for(again.wait(), 5)  # after the backoff it runs again, and says so
        assert reader.up and REGISTRY.get_sample_value("kinfer_reader_up", {"reader": "test-restart"}) == 1
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert not reader.up


async def test_a_supervised_loop_ends_when_it_is_told_to() -> None:
    stop = asyncio.Event()
    runs = 0

    async def loop() -> None:
        nonlocal runs
        runs += 1
        if runs < 3:
            raise ValueError("again")
        stop.set()

    reader = Supervised("test-stop", loop, first_s=0.001, max_s=0.002)
    await asyncio.wait_for(reader.run(stop), 5)
    assert runs == 3 and reader.restarts == 2 and not reader.up


async def test_the_autoscaler_restarts_its_loop_while_kafka_is_unreachable() -> None:
    """Nothing listens on the broker's port: each start fails, is counted, and is tried again."""
    loop = AutoscaleLoop("127.0.0.1:1", "redis://127.0.0.1:1", "m", KubernetesPool("d", api="http://127.0.0.1:1"),
                         interval_s=0.01)
    before = REGISTRY.get_sample_value("kinfer_reader_restarts_total", {"reader": "autoscale"}) or 0.0
    stop = asyncio.Event()
    task = asyncio.create_task(loop.run(stop))
    try:
        for _ in range(600):
            if (REGISTRY.get_sample_value("kinfer_reader_restarts_total", {"reader": "autoscale"}) or 0) >= before + 2:
                break
            assert not task.done(), task
            await asyncio.sleep(0.05)
        assert REGISTRY.get_sample_value("kinfer_reader_restarts_total", {"reader": "autoscale"}) >= before + 2
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert REGISTRY.get_sample_value("kinfer_reader_up", {"reader": "autoscale"}) == 0


# -- the producers' health watch -------------------------------------------------------------------


def watch(max_models: int = 1_024) -> HealthWatch:
    return HealthWatch(aioredis.Redis.from_url("redis://127.0.0.1:1"), max_models=max_models)  # never connected


def test_the_health_watch_skips_each_bad_message_and_keeps_the_good_ones() -> None:
    w = watch()
    before = {r: refused("health-watch", r) for r in ("depth", "size", "schema", "tombstone", "syntax", "future")}
    good = state(model="hw-good", level=Level.SHEDDING)
    for data in (nested(3_000), nested(100_000), with_field(good, predicted_wait_ms=math.nan),
                 with_field(good, cold_start_ms=math.inf), with_field(good, model="Not A Model"), None, b"\xc1",
                 state(model="hw-good", updated_ms=NOW + MAX_SKEW_MS + 1).pack(), good.pack()):
        w.accept(data, NOW)
    assert w._states["hw-good"] == good
    after = {r: refused("health-watch", r) for r in before}
    assert {r: after[r] - before[r] for r in before} == {
        "depth": 1, "size": 1, "schema": 3, "tombstone": 1, "syntax": 1, "future": 1}


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats() | st.text(max_size=40)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=8) | st.dictionaries(st.text(max_size=20), inner, max_size=8),
    max_leaves=40,
)


def packed(value: Any) -> bytes:
    try:
        return msgpack.packb(value)
    except (OverflowError, ValueError):  # an integer msgpack cannot carry: its bytes are garbage then
        return repr(value).encode()


@settings(max_examples=300, deadline=None)
@given(data=st.one_of(st.binary(max_size=2_000), msgpack_values.map(packed),
                      st.dictionaries(st.sampled_from(sorted(HealthState.__struct_fields__)), msgpack_values,
                                      max_size=12).map(packed)))
def test_the_health_watch_takes_any_message_as_a_state_or_a_refusal(data: bytes) -> None:
    """Whatever arrives on the channel (bytes, any msgpack value, a health record with any field
    replaced: NaN, inf, huge numbers, deep nesting), one message is a state or a counted refusal, and
    the next good one is still taken."""
    w = watch()
    got = w.accept(data, NOW)
    assert got is None or isinstance(got, HealthState)
    good = state(model="hw-after")
    assert w.accept(good.pack(), NOW) == good


def test_the_health_watch_keeps_at_most_its_models_and_drops_their_labels() -> None:
    w = watch(max_models=3)
    for i in range(3):
        w.accept(state(model=f"cap-{i}", updated_ms=NOW - 60_000 + i).pack(), NOW)  # stale, oldest first
    w.accept(state(model="cap-fresh").pack(), NOW)
    assert set(w._states) == {"cap-fresh"}  # the stale ones made room, all of them
    for i in range(5):
        w.accept(state(model=f"capf-{i}", updated_ms=NOW + i).pack(), NOW + 10)
    assert len(w._states) == 3 and "capf-4" in w._states and "cap-fresh" not in w._states
    assert REGISTRY.get_sample_value("kinfer_client_health_level", {"model": "cap-0"}) is None
    assert REGISTRY.get_sample_value("kinfer_client_health_level", {"model": "capf-4"}) == 0


def test_a_far_future_state_is_not_believed() -> None:
    w = watch()
    w.accept(state(model="ahead", updated_ms=NOW + 3_600_000, level=Level.REJECTING).pack(), NOW)
    assert "ahead" not in w._states


# -- admission on states that no decoder would pass (built in process) ------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_wait_that_is_not_a_finite_number_refuses_with_a_finite_retry_after(bad: float) -> None:
    for health in (state(predicted_wait_ms=bad), state(service_ms=bad), state(retry_after_ms=10**15)):
        decision = health_decision(health, Priority.P0, deadline_in_ms=60_000)
        if health.retry_after_ms == 10**15:
            continue  # a finite wait: admitted, and nothing to say about a retry
        assert not decision.admit and decision.cause == "deadline"
        assert 0 <= decision.retry_after_s <= MAX_RETRY_AFTER_S
    refused_nan = health_decision(state(), Priority.P1, deadline_in_ms=60_000, wait_ms=bad)
    assert not refused_nan.admit


def test_an_infinite_cold_start_refuses_with_a_retry_after_that_fits_a_header() -> None:
    cold = state(warm_replicas=0, cold_start_ms=math.inf)
    decision = health_decision(cold, Priority.P1, deadline_in_ms=60_000)
    assert not decision.admit and decision.cause == "cold" and decision.retry_after_s == MAX_RETRY_AFTER_S
    status, _, headers = error_payload(ColdStart(decision.reason, decision.retry_after_s))
    assert status == 503 and headers["Retry-After"] == str(int(MAX_RETRY_AFTER_S))
    levelled = health_decision(state(level=Level.REJECTING, retry_after_ms=2**40), Priority.P1, 60_000)
    assert not levelled.admit and levelled.retry_after_s == MAX_RETRY_AFTER_S
    assert error_payload(Overloaded("x", levelled.retry_after_s))[2]["Retry-After"] == str(int(MAX_RETRY_AFTER_S))


def test_a_vanishing_capacity_is_an_endless_wait_not_an_open_door() -> None:
    tiny = state(lag=1_000, capacity_rps=1e-300, updated_ms=NOW)
    wait = expected_wait_ms(tiny, Priority.P1, sent_since=0, now_ms=NOW)
    assert not health_decision(tiny, Priority.P1, deadline_in_ms=60_000, wait_ms=wait).admit


floats = st.floats(allow_nan=True, allow_infinity=True)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(wait=floats, service=floats, cold=floats, capacity=floats, warm=st.sampled_from([-1, 0, 1]),
       deadline=st.integers(1, 600_000))
def test_admission_admits_only_what_a_finite_estimate_fits(wait: float, service: float, cold: float,
                                                         capacity: float, warm: int, deadline: int) -> None:
    health = state(predicted_wait_ms=wait, service_ms=service, cold_start_ms=cold, capacity_rps=capacity,
                   warm_replicas=warm, lag=5)
    decision = health_decision(health, Priority.P0, deadline_in_ms=deadline)
    assert math.isfinite(decision.retry_after_s) and 0 <= decision.retry_after_s <= MAX_RETRY_AFTER_S
    if decision.admit:  # on a finite estimate that fits: the cold start's while cold, else the wait's
        used = cold if warm == 0 and cold > 0 else wait
        assert math.isfinite(used + service) and used + service <= deadline


# -- the lag monitor's reads (the autoscaler reads the same way) -----------------------------------


def test_telemetry_summaries_that_do_not_decode_or_come_from_the_future_are_no_evidence() -> None:
    good = ModelStats("m", 10.0, 5.0, 1.0, 5.0, 20.0, {4: 20.0}, {}, 100, NOW, workers=1, requests_per_batch=1.0)
    before = refused("lagmon-stats", "depth"), refused("autoscale-stats", "schema"), refused("lagmon-stats", "future")
    assert read_stats(nested(3_000), NOW) is None
    assert read_stats(with_field(good, service_ms=math.inf), NOW, reader="autoscale-stats") is None
    assert read_stats(with_field(good, updated_ms=NOW + 3_600_000), NOW) is None
    assert read_stats(good.pack(), NOW) == good
    after = refused("lagmon-stats", "depth"), refused("autoscale-stats", "schema"), refused("lagmon-stats", "future")
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 1]


def test_residency_reports_are_read_one_by_one_and_bad_ones_removed() -> None:
    fresh = WorkerResidency("w1", NOW - 1_000, 1, [ModelResidency("a", "disk", 1, {"disk": 900.0})])
    raw: dict[bytes, object] = {
        b"w1": fresh.pack(),
        b"nested": nested(20_000),
        b"inf": with_field(fresh, models=[{"model": "a", "tier": "host", "swap_in_ms": {"host": math.inf}}]),
        b"future": WorkerResidency("w9", NOW + 3_600_000, 1, [ModelResidency("a", "host", 1, {"host": 1.0})]).pack(),
        b"stale": WorkerResidency("w0", NOW - 700_000, 1, []).pack(),
        b"tombstone": None,
    }
    reports, gone = read_residency(raw, NOW)
    assert reports == [fresh]
    assert sorted(gone) == [b"future", b"inf", b"nested", b"stale", b"tombstone"]
    assert cold_start_estimates(reports, NOW) == {"a": 900.0}  # the forged 1 ms and inf never counted


def test_answered_reports_count_when_fresh_take_the_highest_position_and_bad_ones_are_removed() -> None:
    before = refused("lagmon-answered", "schema"), refused("lagmon-answered", "future")
    raw: dict[bytes, object] = {
        b"w1": Answered("w1", NOW - 500, [Position(0, 0, 120), Position(2, 3, 7)]).pack(),
        b"w2": Answered("w2", NOW - 100, [Position(0, 0, 90), Position(1, 1, 40)]).pack(),  # older owner's lower one
        b"slow": Answered("w3", NOW - 5_000, [Position(0, 0, 10_000)]).pack(),  # paused: no evidence, kept
        b"stale": Answered("w4", NOW - 700_000, [Position(0, 0, 10_000)]).pack(),
        b"future": Answered("w5", NOW + 3_600_000, [Position(0, 0, 10_000)]).pack(),
        b"negative": with_field(Answered("w6", NOW, []), positions=[[0, 0, -1]]),
        b"priority": with_field(Answered("w6", NOW, []), positions=[[4, 0, 5]]),
        b"nested": nested(20_000),
    }
    positions, gone = read_answered(raw, NOW)
    assert positions == {(0, 0): 120, (2, 3): 7, (1, 1): 40}
    assert sorted(gone) == [b"future", b"negative", b"nested", b"priority", b"stale"]
    after = refused("lagmon-answered", "schema"), refused("lagmon-answered", "future")
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 1]


def test_the_lag_monitor_tracks_at_most_its_models_and_forgets_their_series(monkeypatch: pytest.MonkeyPatch) -> None:
    import kinfer.ops.control.lagmon as lagmon

    monkeypatch.setattr(lagmon, "MAX_MODELS", 2)
    monitor = LagMonitor("unused:9092", "redis://unused")
    for model in ("cap-a", "cap-b", "cap-c"):
        monitor.estimators[model] = HealthEstimator()
        export_state(state(model=model))
    assert monitor._tracked(["cap-c", "cap-b", "cap-a"]) == ["cap-a", "cap-b"]
    assert set(monitor.estimators) == {"cap-a", "cap-b"}
    assert REGISTRY.get_sample_value("kinfer_lag_records", {"model": "cap-c"}) is None
    assert REGISTRY.get_sample_value("kinfer_lag_records", {"model": "cap-a"}) == 0


async def test_a_poll_that_hangs_is_given_up_and_the_next_one_publishes() -> None:
    """A request to a broker that just died can hang for as long as the failover lasts, or longer; the
    state published before it would stand meanwhile. The hung poll is given up, and the next one reads
    and publishes again."""
    hang = asyncio.Event()  # never set
    published: list[HealthState] = []

    class Monitor(LagMonitor):
        polls = 0

        async def poll(self, admin: Any, consumer: Any, redis: Any = None) -> list[HealthState]:
            Monitor.polls += 1
            if Monitor.polls == 1:
                await hang.wait()
            return [state()]

        async def _publish(self, st: HealthState, producer: Any, redis: Any) -> None:
            published.append(st)

    monitor = Monitor("unused:9092", "redis://unused", poll_timeout_s=0.05)
    outcomes = [await monitor._poll_once(None, None, None, None) for _ in range(2)]  # type: ignore[arg-type]
    assert outcomes == [False, True] and published == [state()]


def test_the_published_state_is_within_the_ranges_its_readers_hold_it_to() -> None:
    h = HealthEstimator()
    h.observe(0.0, 10, 10, 0)
    h.observe(10_000_000.0, 10, 10, 0)  # a queue stalled for months: its wait is "an hour or more"
    published = h.state("m", NOW, service_ms=math.inf, cold_start_ms=math.nan)
    assert HealthState.unpack(published.pack()) == published
    assert published.predicted_wait_ms == MAX_DURATION_MS and published.cold_start_ms == MAX_DURATION_MS


# -- the telemetry agent ------------------------------------------------------------------------------


def tables(**limits: int) -> Aggregator:
    windowed = {name: defaultdict(int) for name in ("inputs", "requests", "batches", "steps", "service_n", "shed")}
    return Aggregator(window_s=10.0, service_ms=defaultdict(float), totals=defaultdict(int), seen={}, models={},
                      **windowed, **limits)  # type: ignore[arg-type]


def test_the_telemetry_agent_counts_good_records_and_skips_each_bad_one() -> None:
    agg = tables()
    good = BatchStats("tm", "w1", NOW, size=8, requests=2, compute_ms=20.0, shed={"codel": 1})
    reasons = ("tombstone", "depth", "size", "schema", "syntax", "future")
    before = {r: refused("telemetry", r) for r in reasons}
    stream = [None, nested(3_000), nested(100_000), with_field(good, compute_ms=math.nan),
              with_field(good, model="a\n"), with_field(good, shed={"x" * 40: 1}), b"\xc1",
              with_field(good, at_ms=NOW + 3_600_000), good.pack(),
              BatchStats("tm", "w2", NOW, shed={"not-a-reason": 5, "expired": 2}).pack()]
    assert [agg.add(v, NOW) for v in stream] == [False] * 8 + [True, True]
    assert agg.inputs == {"tm": 8} and agg.totals == {"tm": 8} and agg.service_ms == {"tm|8": 20.0}
    assert agg.shed == {"tm|codel": 1, "tm|expired": 2}  # unknown reasons never become table keys
    after = {r: refused("telemetry", r) for r in reasons}
    assert {r: after[r] - before[r] for r in reasons} == {
        "tombstone": 1, "depth": 1, "size": 1, "schema": 3, "syntax": 1, "future": 1}


@settings(max_examples=300, deadline=None)
@given(data=st.one_of(st.binary(max_size=2_000), msgpack_values.map(packed),
                      st.dictionaries(st.sampled_from(sorted(BatchStats.__struct_fields__)), msgpack_values,
                                      max_size=12).map(packed)))
def test_the_telemetry_agent_takes_any_message_and_counts_the_next_good_one(data: bytes) -> None:
    """Whatever a record of kinfer.stats holds (bytes, any msgpack value, a stats record with any field
    replaced: NaN, inf, huge numbers, deep nesting), the agent says whether it counted it, never raises,
    and the good record after it is counted."""
    agg = tables()
    assert agg.add(data, NOW) in (True, False)
    good = BatchStats("fz-after", "w1", NOW, size=3, requests=3, compute_ms=1.0)
    assert agg.add(good.pack(), NOW) is True
    assert agg.totals["fz-after"] == 3


class _FailsOnce(dict[str, int]):
    """A table whose first write raises, as faust's did for a changelog its metadata did not show yet."""

    failed = False

    def __setitem__(self, key: str, value: int) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("PartitionsMismatch")
        super().__setitem__(key, value)


def test_a_table_that_fails_under_one_record_loses_that_record_not_the_agent() -> None:
    agg = tables()
    agg.models = _FailsOnce()
    before = refused("telemetry", "error")
    record = BatchStats("tf", "w1", NOW, size=2, requests=2, compute_ms=1.0).pack()
    assert [agg.add(record, NOW) for _ in range(3)] == [False, True, True]
    assert agg.totals == {"tf": 4} and refused("telemetry", "error") == before + 1


def test_the_telemetry_tables_hold_at_most_their_models_and_workers() -> None:
    agg = tables(max_models=2, max_workers=3)
    hour = 3_600_000
    assert agg.add(BatchStats("old", "w", NOW - 2 * hour, size=1).pack(), NOW - 2 * hour)
    assert agg.add(BatchStats("keep", "w", NOW, size=1).pack(), NOW)
    before = refused("telemetry", "capacity")
    assert agg.add(BatchStats("new", "w", NOW, size=1).pack(), NOW)  # "old" was idle an hour: forgotten
    assert set(agg.models) == {"keep", "new"} and "old" not in agg.totals and agg.forgotten == ["old"]
    assert not agg.add(BatchStats("third", "w", NOW, size=1).pack(), NOW)  # nobody idle: refused
    assert refused("telemetry", "capacity") == before + 1
    for i in range(10):
        agg.add(BatchStats("keep", f"w{i}", NOW, size=1).pack(), NOW)
    assert len(agg.seen) == 3 and agg.inputs["keep"] == 11  # every batch counts; only 3 workers are known
    later = NOW + 120_000  # past six windows: the old workers make room
    agg.add(BatchStats("keep", "late", later, size=1).pack(), later)
    assert "keep|late" in agg.seen and len(agg.seen) == 1


class Writes(dict[str, int]):
    """A table that counts its writes: each one is a changelog record in the processor."""

    writes = 0

    def __setitem__(self, key: str, value: int) -> None:
        self.writes += 1
        super().__setitem__(key, value)


def test_when_a_model_or_worker_was_seen_is_written_at_most_once_a_second() -> None:
    agg = tables()
    agg.seen, agg.models = Writes(), Writes()
    for i in range(100):  # two workers' batches, 50 a second, for two seconds
        at = NOW + i * 20
        assert agg.add(BatchStats("m", f"w{i % 2}", at, size=1).pack(), at)
    assert agg.totals["m"] == 100 and agg.inputs["m"] == 100  # every batch counts
    assert agg.models.writes == 2 and agg.seen.writes == 4  # the last-seen times: a write a second each
    assert agg.models["m"] >= NOW + 1_000 and min(agg.seen.values()) >= NOW + 1_000


def test_a_record_older_than_the_windows_kept_counts_in_the_running_total_only() -> None:
    agg = tables()  # windows of 10 s, six kept
    assert agg.add(BatchStats("m", "w1", NOW - 61_000, size=4, requests=4, compute_ms=9.0, shed={"codel": 2}).pack(),
                   NOW)  # read after a long stop: its windows are gone
    assert agg.totals == {"m": 4} and "m" in agg.models
    assert not agg.inputs and not agg.service_ms and not agg.shed and not agg.seen
    assert agg.add(BatchStats("m", "w1", NOW - 59_000, size=4, requests=4, compute_ms=9.0).pack(), NOW)
    assert agg.totals == {"m": 8} and agg.inputs == {"m": 4} and agg.seen == {"m|w1": NOW - 59_000}


def test_publishing_counts_workers_per_model_in_one_pass() -> None:
    seen = [("a|w1", 100), ("a|w2", 50), ("b|w1", 100), ("b|w3", 99)]
    assert workers_by_model(seen, since_ms=99) == {"a": 1, "b": 2}


def test_a_worker_reports_only_what_the_telemetry_readers_accept() -> None:
    from kinfer.consumers.stats_reporter import StatsReporter

    with pytest.raises(ValueError, match="worker id"):
        StatsReporter("a worker\n")
    reporter = StatsReporter("host-1.example:42")
    reporter.batch("m", size=4, requests=1, tokens=8, compute_s=1e9)  # a batch stuck for decades
    reporter._records()
    (record,) = reporter._buffer
    assert BatchStats.unpack(record.pack()).compute_ms == MAX_DURATION_MS
