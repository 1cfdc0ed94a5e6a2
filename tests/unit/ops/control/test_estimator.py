"""The lag monitor's estimate: smoothing, hysteresis, and the wire form of the state."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kinfer.ops.control.estimator import HealthEstimator, HealthPolicy, PartitionProgress
from kinfer.topics import MalformedRecord
from kinfer.topics.health import HealthState, Level


def feed(h: HealthEstimator, start: float, seconds: float, lag: int, arrive: float, drain: float,
         totals: list[int]) -> list[Level]:
    """Observe every 0.1 s: ``arrive`` and ``drain`` records/s, with ``lag`` records waiting."""
    levels = []
    t = start
    while t < start + seconds - 1e-9:
        t += 0.1
        totals[0] += int(arrive * 0.1)
        totals[1] += int(drain * 0.1)
        levels.append(h.observe(t, lag, totals[0], totals[1]))
    return levels


def test_answered_but_uncommitted_records_are_not_a_queue() -> None:
    """Workers commit every 100 ms: at 2,000/s about 200 answered records always read as lag."""
    coalesced, eager = HealthEstimator(), HealthEstimator(HealthPolicy(commit_interval_ms=0))
    for h in (coalesced, eager):
        feed(h, 0, 10, lag=200, arrive=2000, drain=2000, totals=[0, 0])
    assert coalesced.level == Level.OK and coalesced.wait_ms < 5
    assert eager.level == Level.DEGRADED  # the same lag read as 100 ms of queue


def test_traffic_after_an_idle_spell_is_not_read_as_a_queue() -> None:
    """The smoothed rates ramp up from zero; the lag of work in flight (less than a poll's arrivals)
    goes at the rate it comes, so the first busy polls do not look like seconds of wait."""
    h = HealthEstimator()
    totals = [0, 0]
    feed(h, 0, 5, lag=0, arrive=0, drain=0, totals=totals)
    levels = feed(h, 5, 3, lag=15, arrive=200, drain=200, totals=totals)
    assert set(levels) == {Level.OK}, levels


def test_a_momentary_spike_does_not_change_the_level() -> None:
    h = HealthEstimator()
    totals = [0, 0]
    feed(h, 0, 5, lag=0, arrive=100, drain=100, totals=totals)
    levels = feed(h, 5, 0.2, lag=50, arrive=100, drain=100, totals=totals)  # 0.5 s of queue, 200 ms long
    levels += feed(h, 5.2, 5, lag=0, arrive=100, drain=100, totals=totals)
    assert set(levels) <= {Level.OK, Level.DEGRADED}
    assert h.level == Level.OK


def test_one_slow_poll_that_read_a_stall_drained_by_the_next_raises_nothing() -> None:
    """As a chaos soak saw it: polls every half second at ~215/s; the cluster moved 18 partitions'
    leadership at once, the monitor's next poll came 1.86 s later and read 343 records waiting (1.6 s at
    the drain rate), and the poll after found 62, then none. That one reading, with its long interval's
    weight, took the smoothed wait past REJECTING, and the hysteresis held it five seconds after the
    queue was gone: every p1 request of those seconds refused. A queue that stands does raise it."""
    h = HealthEstimator()
    totals = [0, 0]
    t = 0.0
    for _ in range(40):  # 20 s of calm
        t += 0.5
        totals[0] += 107
        totals[1] += 107
        h.observe(t, 19, totals[0], totals[1])
    assert h.level == Level.OK
    t += 1.86
    totals[0] += 390
    totals[1] += 66  # nothing fetched while leaders moved
    levels = [h.observe(t, 343, totals[0], totals[1])]
    for lag in (62, 0, 0, 0, 0):  # the telemetry stream's capacity is back: 600/s
        t += 0.5
        totals[0] += 90
        totals[1] += 90 + 281 if lag == 62 else 90
        levels.append(h.observe(t, lag, totals[0], totals[1], capacity_rps=600.0))
    assert max(levels) < Level.SHEDDING, levels
    # The same reading, and the queue still there at the next poll: the level rises.
    for _ in range(3):
        t += 0.5
        totals[0] += 107
        levels.append(h.observe(t, 400, totals[0], totals[1], capacity_rps=600.0))
    assert h.level == Level.REJECTING


def test_a_standing_queue_raises_the_level_and_it_falls_back_one_step_at_a_time() -> None:
    h = HealthEstimator(HealthPolicy(min_dwell_s=1.0))
    totals = [0, 0]
    feed(h, 0, 3, lag=0, arrive=100, drain=100, totals=totals)
    rising = feed(h, 3, 6, lag=100, arrive=100, drain=100, totals=totals)  # one second of queue
    assert rising[-1] == Level.REJECTING and h.wait_ms > 500
    assert rising == sorted(rising)  # never down while the queue stands
    falling = feed(h, 9, 10, lag=0, arrive=100, drain=100, totals=totals)
    assert falling[-1] == Level.OK
    steps = [lvl for i, lvl in enumerate(falling) if i == 0 or lvl != falling[i - 1]]
    assert steps == [Level.REJECTING, Level.SHEDDING, Level.DEGRADED, Level.OK]
    assert h.retry_after_ms() >= 1000


def test_no_flapping_around_a_threshold() -> None:
    h = HealthEstimator(HealthPolicy(min_dwell_s=2.0, commit_interval_ms=0))
    totals = [0, 0]
    feed(h, 0, 6, lag=7, arrive=100, drain=100, totals=totals)  # ~70 ms: DEGRADED
    assert h.level == Level.DEGRADED
    changes = 0
    for i in range(20):  # hovering just around the 50 ms threshold, both sides
        before = h.level
        feed(h, 6 + i * 0.5, 0.5, lag=4 if i % 2 else 6, arrive=100, drain=100, totals=totals)
        changes += h.level != before
    assert changes == 0


def test_capacity_is_learned_from_busy_intervals_only() -> None:
    h = HealthEstimator(HealthPolicy(commit_interval_ms=0))
    totals = [0, 0]
    feed(h, 0, 3, lag=0, arrive=30, drain=30, totals=totals)  # below saturation: drain is arrival
    assert h.capacity_rps == 0 and h.drain_rps == pytest.approx(30, rel=0.05)
    feed(h, 3, 2, lag=40, arrive=150, drain=50, totals=totals)  # a standing queue: drain is capacity
    assert h.capacity_rps == pytest.approx(50, rel=0.05)
    assert h.instant_wait_ms() == pytest.approx(800, rel=0.05)  # 40 records at 50/s
    feed(h, 5, 0.1, lag=0, arrive=10, drain=50, totals=totals)  # the backlog drains at capacity...
    feed(h, 5.1, 3, lag=0, arrive=10, drain=10, totals=totals)  # ...quiet again: capacity is remembered
    assert h.capacity_rps == pytest.approx(50, rel=0.05)


def test_a_burst_after_a_quiet_spell_is_not_read_as_seconds_of_wait() -> None:
    h = HealthEstimator()
    totals = [0, 0]
    feed(h, 0, 2, lag=1, arrive=20, drain=20, totals=totals)  # light load
    feed(h, 2, 30, lag=0, arrive=0, drain=0, totals=totals)  # a long quiet spell
    assert h.drain_rps == pytest.approx(20, rel=0.1)  # idle intervals say nothing about speed
    levels = feed(h, 32, 0.3, lag=6, arrive=100, drain=60, totals=totals)
    assert h.instant_wait_ms() < 500 and max(levels) <= Level.DEGRADED


def test_a_queue_that_never_moves_raises_the_level_by_itself() -> None:
    h = HealthEstimator(HealthPolicy(smoothing_s=0.5))
    totals = [0, 0]
    feed(h, 0, 1, lag=0, arrive=0, drain=0, totals=totals)
    levels = feed(h, 1, 3, lag=5, arrive=0, drain=0, totals=totals)  # no worker: nothing drains
    assert h.instant_wait_ms() >= 2_500 and levels[-1] == Level.REJECTING


def test_a_long_generation_is_not_a_stall_while_the_workers_make_progress() -> None:
    h = HealthEstimator(HealthPolicy(smoothing_s=0.5))
    totals = [0, 0]
    feed(h, 0, 1, lag=0, arrive=0, drain=0, totals=totals)
    t = 1.0
    for _ in range(60):  # one 6 s generation: its offset commits only at the end
        t += 0.1
        h.observe(t, 1, totals[0], totals[1], progressing=True)
    assert h.level == Level.OK and h.instant_wait_ms() == 0.0


def test_a_cold_spell_does_not_leave_the_level_raised() -> None:
    """While cold the queue is the cold start's (producers are told it apart): the wait and the level
    hold, and the model comes back warm at the level it had, not one its cold spell raised."""
    h = HealthEstimator(HealthPolicy(smoothing_s=0.5))
    totals = [0, 0]
    feed(h, 0, 1, lag=0, arrive=0, drain=0, totals=totals)
    t = 1.0
    for lag in range(1, 30):  # three seconds cold: records pile up, nothing drains
        t += 0.1
        totals[0] += 1
        h.observe(t, lag, totals[0], totals[1], progressing=True, cold=True)
    assert h.level == Level.OK and h.wait_ms == 0.0
    hot = HealthEstimator(HealthPolicy(smoothing_s=0.5))  # the same spell, not told it was cold
    totals = [0, 0]
    feed(hot, 0, 1, lag=0, arrive=0, drain=0, totals=totals)
    t = 1.0
    for lag in range(1, 30):
        t += 0.1
        totals[0] += 1
        hot.observe(t, lag, totals[0], totals[1])
    assert hot.level == Level.REJECTING


def test_a_measured_capacity_stands_until_it_stops_coming() -> None:
    h = HealthEstimator(HealthPolicy(commit_interval_ms=0))
    totals = [0, 0]
    for i in range(30):  # refused records commit at once: the drain rate (200/s) is no speed
        totals[0] += 20
        totals[1] += 20
        h.observe(i * 0.1, 40, totals[0], totals[1], capacity_rps=50.0)
    assert h.instant_wait_ms() == pytest.approx(800.0)  # 40 records at the measured 50/s
    h.observe(3.1, 40, totals[0] + 20, totals[1] + 20)  # telemetry gone: offsets take over from 50/s
    assert h.instant_wait_ms() < 800.0


def test_state_round_trip_and_bad_input() -> None:
    s = HealthState("m", Level.SHEDDING, 180.5, 2000, 42, 90.0, 60.0, 1_700_000_000_000, (2, 10, 30), 12.5, 75.0)
    assert HealthState.unpack(s.pack()) == s
    new_fields = ("lag_by_priority", "service_ms", "capacity_rps")
    older = msgpack.packb({k: v for k, v in s.to_wire().items() if k not in new_fields})
    assert HealthState.unpack(older).lag_by_priority == (0, 0, 0)  # a monitor from before these fields
    with pytest.raises(MalformedRecord):
        HealthState.unpack(b"\x81\xa1x\x01")


def test_policy_names_the_conflict() -> None:
    with pytest.raises(ValueError, match="thresholds must rise"):
        HealthPolicy(degraded_wait_ms=200, shedding_wait_ms=100)


def test_cold_start_estimates_take_the_fastest_fresh_worker_from_the_tier_its_weights_are_in() -> None:
    from kinfer.ops.control.lagmon import cold_start_estimates
    from kinfer.topics.residency import ModelResidency, WorkerResidency

    now = 1_000_000
    reports = [
        WorkerResidency("w1", now - 1_000, 1, [ModelResidency("a", "disk", 1, {"disk": 900.0, "host": 80.0}),
                                              ModelResidency("b", "device", 1, {"disk": 500.0})]),
        WorkerResidency("w2", now - 2_000, 1, [ModelResidency("a", "host", 1, {"host": 120.0}),
                                              ModelResidency("c", "loading", 1, {"host": 50.0, "disk": 700.0})]),
        WorkerResidency("gone", now - 60_000, 1, [ModelResidency("a", "host", 1, {"host": 1.0})]),  # stale
        WorkerResidency("w3", now, 1, [ModelResidency("d", "disk", 1, {})]),  # never measured
    ]
    # a: w1 has it on disk (900), w2 in host RAM (120): 120. b is warm on w1: nobody would swap it in.
    # c is being loaded: its slowest measured tier. d: registered, never measured.
    assert cold_start_estimates(reports, now) == {"a": 120.0, "c": 700.0, "d": 0.0}


def test_a_cold_model_that_nobody_brings_back_is_a_stall_again() -> None:
    import time

    from kinfer.ops.control.lagmon import COLD_GRACE_S, LagMonitor

    m = LagMonitor("unused:9092", "redis://unused")
    assert not m._cold("a", warm=1, lag=5, cold_start_ms=800.0, loading=False)  # warm somewhere
    assert not m._cold("a", warm=0, lag=5, cold_start_ms=None, loading=False)  # nobody has it registered
    assert m._cold("a", warm=0, lag=0, cold_start_ms=800.0, loading=False)  # registered, nothing waits
    assert m._cold("a", warm=0, lag=5, cold_start_ms=800.0, loading=False)  # records start waiting
    # The group cannot be read (a fresh cluster's first seconds): cold only while a worker is loading it.
    assert m._cold("a", warm=-1, lag=5, cold_start_ms=0.0, loading=True)
    assert not m._cold("a", warm=-1, lag=5, cold_start_ms=800.0, loading=False)
    m._cold_since["a"] = time.monotonic() - COLD_GRACE_S - 1  # ...and nobody came for them
    assert not m._cold("a", warm=0, lag=5, cold_start_ms=800.0, loading=False)
    assert m._cold("a", warm=0, lag=5, cold_start_ms=800.0, loading=True)  # unless a worker is loading it
    m._cold_since["a"] = time.monotonic() - COLD_GRACE_S - 1
    assert m._cold("a", warm=0, lag=5, cold_start_ms=10_000.0, loading=False)  # twice a long cold start


def test_the_lag_monitor_exports_what_admission_sees() -> None:
    from prometheus_client import REGISTRY

    from kinfer.ops.control.lagmon import export_state

    export_state(HealthState(model="exported", level=Level.SHEDDING, predicted_wait_ms=250.0, retry_after_ms=500, lag=7,
                        arrival_rps=3.0, drain_rps=2.0, updated_ms=1, capacity_rps=4.0, warm_replicas=0,
                        cold_start_ms=1500.0))
    seen = {name: REGISTRY.get_sample_value(name, {"model": "exported"}) for name in (
        "kinfer_lag_records", "kinfer_health_level", "kinfer_predicted_wait_seconds", "kinfer_arrival_rps",
        "kinfer_drain_rps", "kinfer_capacity_rps", "kinfer_warm_replicas", "kinfer_cold_start_seconds")}
    assert seen == {"kinfer_lag_records": 7, "kinfer_health_level": int(Level.SHEDDING),
                    "kinfer_predicted_wait_seconds": 0.25, "kinfer_arrival_rps": 3.0, "kinfer_drain_rps": 2.0,
                    "kinfer_capacity_rps": 4.0, "kinfer_warm_replicas": 0, "kinfer_cold_start_seconds": 1.5}


def test_a_partition_stuck_on_its_own_is_left_out_of_the_queue_and_a_stuck_model_is_not() -> None:
    progress: PartitionProgress[str] = PartitionProgress(after_s=1.0)
    assert progress.stuck_lag({"a": (100, 90), "b": (100, 95)}, 0.0) == 0
    assert progress.stuck_lag({"a": (150, 90), "b": (140, 130)}, 0.6) == 0  # a: not yet a second
    assert progress.stuck_lag({"a": (200, 90), "b": (190, 185)}, 1.2) == 110  # a stuck, b moves
    assert progress.stuck_lag({"a": (210, 90), "b": (200, 185)}, 2.5) == 0  # b stopped too: the model is stuck
    assert progress.stuck_lag({"a": (260, 250), "b": (260, 185)}, 2.6) == 75  # a moved again; b stuck alone
    assert progress.stuck_lag({"a": (260, 260)}, 2.7) == 0  # b's topic gone: forgotten


def test_an_idle_partition_is_never_stuck() -> None:
    progress: PartitionProgress[str] = PartitionProgress(after_s=1.0)
    for t in range(10):
        assert progress.stuck_lag({"idle": (50, 50), "busy": (100 + 10 * t, 95 + 10 * t)}, float(t)) == 0


@given(st.lists(st.dictionaries(st.sampled_from("abcd"), st.tuples(st.integers(0, 2**62), st.integers(0, 2**62)),
                                max_size=4), max_size=30),
       st.lists(st.floats(0, 5, allow_nan=False), min_size=30, max_size=30))
def test_stuck_lag_is_never_more_than_what_waits_whatever_the_offsets(
        reads: list[dict[str, tuple[int, int]]], gaps: list[float]) -> None:
    progress: PartitionProgress[str] = PartitionProgress(after_s=1.0)
    now = 0.0
    for read, gap in zip(reads, gaps, strict=False):
        now += gap
        stuck = progress.stuck_lag(read, now)
        assert 0 <= stuck <= sum(max(0, end - done) for end, done in read.values())


def test_the_queue_a_blind_spell_left_is_judged_by_whether_it_drains_not_by_one_reading() -> None:
    """Polls hung for 6 s (a broker paused): the first reading after it shows the records producers held
    meanwhile. Draining at once, they never raise the level; standing, they do, one poll later."""
    for drains, expected in ((True, Level.OK), (False, Level.REJECTING)):
        h = HealthEstimator(HealthPolicy(commit_interval_ms=0))
        totals = [0, 0]
        feed(h, 0, 5, lag=0, arrive=200, drain=200, totals=totals)
        totals[0] += 1200 + 400  # 6 s of arrivals, 400 of them still waiting
        totals[1] += 1200
        assert h.observe(11.0, 400, totals[0], totals[1]) == Level.OK and h.gaps == 1
        if drains:
            levels = feed(h, 11, 3, lag=0, arrive=200, drain=200, totals=totals)
        else:  # nothing moves: a stall, told one poll on
            levels = feed(h, 11, 3, lag=400, arrive=0, drain=0, totals=totals)
        assert max(levels) == expected, levels
    assert h.gaps == 1  # polls at the usual pace are never gaps


def test_a_monitor_that_polls_slower_for_good_soon_sees_no_gaps() -> None:
    h = HealthEstimator()
    t = 0.0
    for _ in range(20):
        t += 0.5
        h.observe(t, 0, 0, 0)
    for _ in range(20):  # every 5 s from now on
        t += 5.0
        h.observe(t, 0, 0, 0)
    assert 1 <= h.gaps <= 3
