"""Admission rules, time and randomness passed in."""

from __future__ import annotations

import pytest

from kinfer.producers.admission import (
    MAX_EXTRAPOLATION_S,
    AdaptiveThrottle,
    SendLog,
    expected_wait_ms,
    health_decision,
    wait_with_sends,
)
from kinfer.topics import Priority
from kinfer.topics.health import HealthState, Level


def state(level: Level, wait_ms: float = 0.0) -> HealthState:
    return HealthState("m", level, wait_ms, 1500, 0, 0.0, 0.0, 0)


def test_levels_refuse_lowest_priorities_first() -> None:
    admits = {
        level: [health_decision(state(level), p, 1_000, 10).admit for p in Priority]
        for level in Level
    }
    assert admits[Level.OK] == [True, True, True, True]
    assert admits[Level.DEGRADED] == [True, True, True, True]
    assert admits[Level.SHEDDING] == [True, True, False, True]  # background work is never refused for load
    assert admits[Level.REJECTING] == [True, False, False, True]
    refused = health_decision(state(Level.SHEDDING), Priority.P2, 1_000, 10)
    assert refused.retry_after_s == 1.5 and "shedding p2" in refused.reason


def test_a_request_that_cannot_meet_its_deadline_is_refused_whatever_the_level() -> None:
    assert not health_decision(state(Level.OK, wait_ms=400), Priority.P0, 300, 20).admit
    assert health_decision(state(Level.OK, wait_ms=200), Priority.P0, 300, 20).admit
    assert health_decision(None, Priority.P2, 1, 1_000).admit  # no signal: the worker decides


def test_adaptive_throttling_follows_the_formula() -> None:
    t = AdaptiveThrottle(k=2.0, window_s=1e9)  # no decay: exact counts
    for _ in range(20):  # a fresh client's burst, all still in flight: nothing to hold against it
        assert t.decide(0.0, draw=0.0).admit
    for _ in range(100):
        t.record(0.0, accepted=True)
    assert t.reject_probability(0.0) == 0.0
    for _ in range(300):  # the backend refuses everything now
        t.record(0.0, accepted=False)
    # requests 400, accepts 100: (400 - 2·100) / 401
    assert t.reject_probability(0.0) == pytest.approx(200 / 401)
    assert not t.decide(0.0, draw=0.1).admit
    assert t.decide(0.0, draw=0.9).admit  # still lets some through, to notice recovery


def test_a_few_failures_are_no_evidence() -> None:
    t = AdaptiveThrottle(min_requests=20)
    for _ in range(5):  # e.g. a worker still starting
        t.record(0.0, accepted=False)
    t.record(0.0, accepted=True)
    assert t.reject_probability(0.0) == 0.0


def test_adaptive_throttling_forgets_with_time() -> None:
    t = AdaptiveThrottle(window_s=10.0)
    for _ in range(100):
        t.record(0.0, accepted=False)
    assert t.reject_probability(0.0) > 0.9
    assert t.reject_probability(100.0) < 0.01  # ten windows later the failures are forgotten


def test_the_models_service_time_counts_against_the_deadline() -> None:
    slow = HealthState("m", Level.OK, 50.0, 1000, 5, 10.0, 10.0, 0, lag_by_priority=(0, 5, 0), service_ms=80.0)
    assert not health_decision(slow, Priority.P1, 120).admit  # 50 ms wait + 80 ms compute > 120 ms
    assert health_decision(slow, Priority.P1, 140).admit
    assert health_decision(slow, Priority.P1, 120, service_ms=10.0).admit  # the caller knows better


def test_refusals_name_their_cause() -> None:
    assert health_decision(state(Level.REJECTING), Priority.P1, 1_000, 10).cause == "level"
    t = AdaptiveThrottle(k=2.0, window_s=1e9)
    for _ in range(100):
        t.record(0.0, accepted=False)
    assert t.decide(0.0, draw=0.0).cause == "throttle"


def test_the_wait_is_brought_up_to_date_with_what_this_producer_sent_since_the_state() -> None:
    # 10 queued, the workers clear 100/s (drain is lower: they were not busy the whole window);
    # this producer is the only one (its own rate is all the arrivals).
    standing = HealthState("m", Level.DEGRADED, 100.0, 1000, 10, 150.0, 60.0, 10_000, capacity_rps=100.0)
    assert expected_wait_ms(standing, Priority.P0, 0, 10_000, own_rps=150.0) == pytest.approx(100.0)
    # 30 more sent in the 100 ms since, 10 drained: 30 queued, 300 ms.
    assert expected_wait_ms(standing, Priority.P0, 30, 10_100, own_rps=150.0) == pytest.approx(300.0)
    assert expected_wait_ms(standing, Priority.P0, 0, 12_000, own_rps=150.0) == 0.0  # drained since
    # Capacity unknown: while a queue stands the drain rate stands in for it...
    queue = HealthState("m", Level.DEGRADED, 200.0, 1000, 10, 80.0, 50.0, 10_000)
    assert expected_wait_ms(queue, Priority.P0, sent_since=5, now_ms=10_000) == pytest.approx(300.0)
    # ...but without one the drain rate is the arrival rate: a burst to an idle model is not extrapolated.
    idle = HealthState("m", Level.OK, 0.0, 1000, 0, 1.0, 1.0, 10_000)
    assert expected_wait_ms(idle, Priority.P0, sent_since=50, now_ms=10_010) == 0.0
    # A p1 request drains at what p0 arrivals leave over: 100/s - 60/s p0.
    busy = HealthState("m", Level.DEGRADED, 100.0, 1000, 10, 150.0, 60.0, 10_000, capacity_rps=100.0,
                       arrival_by_priority=(60.0, 90.0, 0.0))
    assert expected_wait_ms(busy, Priority.P0, 0, 10_000) == pytest.approx(100.0)
    assert expected_wait_ms(busy, Priority.P1, 0, 10_000) == pytest.approx(250.0)
    assert expected_wait_ms(busy, Priority.P2, 0, 10_000) >= 1000.0  # nothing left over: p2 waits "forever"
    refused = health_decision(standing, Priority.P1, 250, 10, wait_ms=300.0)
    assert not refused.admit and refused.cause == "deadline"


def test_other_producers_arrivals_count_and_an_old_state_is_not_extrapolated_forever() -> None:
    # 4 producers, 300/s in all against 100/s: this one sends 75/s, the others 225/s.
    surge = HealthState("m", Level.SHEDDING, 500.0, 1000, 50, 300.0, 100.0, 10_000, capacity_rps=100.0)
    half_second_later = expected_wait_ms(surge, Priority.P0, sent_since=37, now_ms=10_500, own_rps=75.0)
    assert half_second_later == pytest.approx(1000.0 * (50 + 37 + 112.5 - 50) / 100.0)
    # A stalled queue (the state's wait is the time nothing moved) does not look better by arithmetic.
    stalled = HealthState("m", Level.REJECTING, 3000.0, 1000, 5, 0.0, 0.0, 10_000, capacity_rps=100.0)
    assert expected_wait_ms(stalled, Priority.P0, 0, 10_500) == pytest.approx(2500.0)
    # A state from a monitor that fell behind is brought forward by at most MAX_EXTRAPOLATION_S.
    old = expected_wait_ms(surge, Priority.P0, sent_since=0, now_ms=60_000, own_rps=0.0)
    assert old == pytest.approx(1000.0 * (50 + 300 * MAX_EXTRAPOLATION_S - 100 * MAX_EXTRAPOLATION_S) / 100.0)


def test_send_log_counts_sends_after_a_moment_and_forgets_old_ones() -> None:
    log = SendLog(keep_ms=1_000)
    for t in range(0, 5_000, 10):
        log.record(t)
    assert log.since(4_899) == 10
    assert log.since(-1) <= 300  # trimmed: at most about 2 × keep_ms of history
    assert log.rate(4_990, window_ms=1_000) == pytest.approx(100.0)


def test_a_cold_model_is_judged_by_its_cold_start_not_its_level() -> None:
    # Nobody drains a cold model's queue, so its level climbs; the cold start is what decides.
    cold = state(Level.REJECTING, wait_ms=5_000.0).__replace__(warm_replicas=0, cold_start_ms=2_000.0, lag=0)
    assert health_decision(cold, Priority.P2, deadline_in_ms=10_000).admit
    refused = health_decision(cold, Priority.P0, deadline_in_ms=500)
    assert not refused.admit and refused.cause == "cold" and refused.retry_after_s == 2.0
    assert "cold start 2000 ms" in refused.reason
    # The records queued before it count, at the capacity last measured.
    queued = cold.__replace__(lag=300, capacity_rps=100.0)
    assert not health_decision(queued, Priority.P1, deadline_in_ms=4_000).admit  # 2 s + 3 s queue > 4 s
    # No cold start known (nobody measured one, or nobody has the model at all): the level rules.
    unknown = cold.__replace__(cold_start_ms=0.0)
    assert health_decision(unknown.__replace__(level=Level.OK, predicted_wait_ms=0.0), Priority.P2, 100).admit
    assert not health_decision(unknown, Priority.P2, deadline_in_ms=10_000).admit
    # Warm again: the level rules as before.
    assert not health_decision(cold.__replace__(warm_replicas=1), Priority.P2, deadline_in_ms=10_000).admit


def test_sends_are_counted_within_the_extrapolation_window_only() -> None:
    """A monitor that died leaves its last state: extrapolated for MAX_EXTRAPOLATION_S with this producer's
    sends of that window, then held as it was (not a queue that grows by every send until the state is stale)."""
    log = SendLog()
    for t in range(10_000, 20_000, 5):  # 200/s for 10 s after the state
        log.record(t)
    window = log.since(10_000, 10_000 + int(1000 * MAX_EXTRAPOLATION_S))
    assert window == pytest.approx(200 * MAX_EXTRAPOLATION_S, abs=1)
    assert log.since(10_000) == 1_999 and log.since(20_000) == 0 and log.since(15_000, 14_000) == 0
    calm = HealthState("m", Level.OK, 20.0, 0, 5, 200.0, 200.0, 10_000, capacity_rps=480.0)
    held = [expected_wait_ms(calm, Priority.P1, window, now, own_rps=200.0) for now in (12_000, 15_000, 19_000)]
    assert held[0] == held[1] == held[2] < 1_000.0  # the same wait all along: nothing refused for it


def test_answers_this_producer_sees_are_a_floor_under_the_drain_rate() -> None:
    """A state whose capacity was measured while its monitor's view was stale (2/s against 200/s of this
    producer's traffic) does not turn this producer's own sends into a queue: they are being answered."""
    stale = HealthState("m", Level.OK, 0.0, 0, 6, 6.0, 6.0, 10_000, capacity_rps=2.0)
    blind = expected_wait_ms(stale, Priority.P1, 200, 11_000, own_rps=200.0)
    seen = expected_wait_ms(stale, Priority.P1, 200, 11_000, own_rps=200.0, answered_rps=200.0)
    assert blind > 10_000.0 and seen < 50.0
    assert expected_wait_ms(stale, Priority.P1, 200, 11_000, answered_rps=5_000.0) == pytest.approx(0.0)


def test_a_producer_that_refuses_does_not_count_its_own_refused_traffic_as_other_producers() -> None:
    """The monitor's arrival rate was this producer's own 200/s. Refusing everything on a state read
    mid-failover, it sends nothing more: its wait must hold (its rate is taken over the window the state
    saw), not grow as if 200/s came from others (the rate taken now falls to 0 as it refuses)."""
    sent = SendLog()
    for t in range(5_000, 10_000, 5):  # 200/s until the state was measured, nothing after
        sent.record(t)
    failover = HealthState("m", Level.DEGRADED, 3157.0, 1000, 737, 193.0, 191.0, 10_000, capacity_rps=227.0)
    held = [wait_with_sends(failover, Priority.P1, sent, now) for now in (11_000, 12_000, 13_000, 15_000)]
    assert held[1] == held[2] == held[3] == pytest.approx(1000.0 * (737 - 227.0 * MAX_EXTRAPOLATION_S) / 227.0)
    assert held[0] > held[1]  # a second in, the backlog has drained for one second only
    growing = expected_wait_ms(failover, Priority.P1, 0, 15_000, own_rps=sent.rate(15_000))
    assert growing > held[3] + 1_500.0  # the rate now: 193/s of imagined arrivals for two seconds
    # Its sends after the state count (within the extrapolation window), as before.
    busy = SendLog()
    for t in range(5_000, 12_000, 5):
        busy.record(t)
    assert wait_with_sends(failover, Priority.P1, busy, 12_000) == pytest.approx(
        expected_wait_ms(failover, Priority.P1, busy.since(10_000, 12_000), 12_000, own_rps=busy.rate(10_000)))
