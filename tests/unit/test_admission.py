"""Admission rules, time and randomness passed in."""

from __future__ import annotations

import pytest

from producers.admission import AdaptiveThrottle, health_decision
from topics import Priority
from topics.health import HealthState, Level


def state(level: Level, wait_ms: float = 0.0) -> HealthState:
    return HealthState("m", level, wait_ms, 1500, 0, 0.0, 0.0, 0)


def test_levels_refuse_lowest_priorities_first() -> None:
    admits = {
        level: [health_decision(state(level), p, 1_000, 10).admit for p in Priority]
        for level in Level
    }
    assert admits[Level.OK] == [True, True, True]
    assert admits[Level.DEGRADED] == [True, True, True]
    assert admits[Level.SHEDDING] == [True, True, False]
    assert admits[Level.REJECTING] == [True, False, False]
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
