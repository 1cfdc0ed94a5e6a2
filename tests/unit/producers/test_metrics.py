"""The service-level series: every way a request can end has its outcome label, the caller's own
mistakes none; answered requests' latency lands in buckets bounded at the SLA's thresholds."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from kinfer.producers.metrics import OUTCOMES, Outcomes, outcome_of
from kinfer.topics import (
    ColdStart,
    DeadlineExceeded,
    InvalidRequest,
    KinferError,
    ModelError,
    Overloaded,
    Shed,
    Unavailable,
    UnknownModel,
)


@pytest.mark.parametrize("error, outcome", [
    (Overloaded("busy"), "refused"), (ColdStart("cold", 3.0), "refused"), (Shed("shed"), "shed"),
    (DeadlineExceeded("late"), "expired"), (DeadlineExceeded("no reply", answered=False), "timed_out"),
    (DeadlineExceeded("not taken", answered=False, accepted=False), "unaccepted"),
    (ModelError("boom"), "error"), (Unavailable("kafka"), "unavailable"), (KinferError("other"), "error"),
    (InvalidRequest("bad"), None), (UnknownModel("nobody"), None),
])
def test_each_ending_has_its_outcome(error: KinferError, outcome: str | None) -> None:
    assert outcome_of(error) == outcome
    assert outcome is None or outcome in OUTCOMES


def test_outcomes_count_endings_and_time_the_answered_ones() -> None:
    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, {"model": "metrics-m", "priority": "p1", **labels}) or 0.0

    outcomes = Outcomes()
    outcomes.ok("metrics-m", "p1", 0.12)
    outcomes.ok("metrics-m", "p1", 0.2)
    outcomes.failed("metrics-m", "p1", Overloaded("busy"))
    outcomes.failed("metrics-m", "p1", InvalidRequest("bad"))  # the caller's: not against the service
    assert sample("kinfer_client_requests_total", outcome="ok") == 2
    assert sample("kinfer_client_requests_total", outcome="refused") == 1
    assert sum(sample("kinfer_client_requests_total", outcome=o) for o in OUTCOMES) == 3
    assert sample("kinfer_client_request_seconds_bucket", le="0.15") == 1  # within the P95's bound
    assert sample("kinfer_client_request_seconds_bucket", le="0.25") == 2
    assert sample("kinfer_client_request_seconds_count") == 2
