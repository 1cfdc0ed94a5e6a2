"""The worker log's sink: one line a second while a model's requests are refused, saying why."""

from __future__ import annotations

import logging

import pytest

from kinfer.consumers.sinks import ShedLog
from kinfer.topics import Priority


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kinfer.consumers.sinks"]


def test_a_second_of_refusals_is_one_line_with_each_reason_and_the_longest_wait_at_fetch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    sink = ShedLog(clock=clock)
    with caplog.at_level(logging.WARNING, logger="kinfer.consumers.sinks"):
        sink.fetched("m", Priority.P1, 0.010)
        sink.fetched("m", Priority.P1, 1.250)  # the broker held this one
        for reason in ("expired", "expired", "deadline", "codel"):
            sink.shed("m", Priority.P1, reason)
        sink.shed("other", Priority.P1, "codel")
        clock.now += 0.5
        sink.fetched("m", Priority.P1, 0.020)
        assert lines(caplog) == []  # within the second: counted, not said
        clock.now += 0.6
        sink.fetched("m", Priority.P1, 0.030)  # the second is over: said once
        sink.fetched("m", Priority.P1, 0.030)
    assert lines(caplog) == [
        "m: 4 refused before compute in the last 1.1 s (codel 1, deadline 1, expired 2); "
        "the longest wait at fetch 1250 ms",
    ]


def test_a_second_without_refusals_says_nothing_and_starts_afresh(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    sink = ShedLog(clock=clock)
    with caplog.at_level(logging.WARNING, logger="kinfer.consumers.sinks"):
        sink.fetched("m", Priority.P1, 2.0)
        clock.now += 1.5
        sink.fetched("m", Priority.P1, 0.005)  # a quiet second ends: no line, its wait forgotten
        sink.shed("m", Priority.P1, "expired")
        clock.now += 1.0
        sink.fetched("m", Priority.P1, 0.001)
    assert lines(caplog) == [
        "m: 1 refused before compute in the last 1.0 s (expired 1); the longest wait at fetch 5 ms",
    ]
