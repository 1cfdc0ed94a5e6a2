"""The chaos soak's pure parts: its fault schedule and how a fault's recovery is read off the timeline."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from kinfer.ops.bench.chaos import (
    FAULT_BOUNDS,
    FAULTS,
    VARIANTS,
    ChaosConfig,
    availability_outside,
    bench_chaos,
    charge,
    fault_bound,
    projection,
    recovery_s,
    schedule,
    timeline_of,
)
from kinfer.ops.localstack.stack import LocalStack


def test_the_schedule_is_the_seed_s_every_kind_in_turn_within_the_soak() -> None:
    config = ChaosConfig(minutes=20.0)
    plan = schedule(config)
    assert plan == schedule(config)  # reproducible
    assert plan != schedule(ChaosConfig(minutes=20.0, seed=2))
    kinds = [k for _, k in plan]
    assert set(kinds[: len(FAULTS)]) == set(FAULTS)  # each kind once before any twice
    times = [t for t, _ in plan]
    assert times[0] == config.first_fault_s and times[-1] < 20 * 60 - 10
    assert all(30.0 <= b - a <= 60.0 for a, b in itertools.pairwise(times))
    assert len(plan) >= 20


def test_recovery_ends_at_the_first_quiet_stretch() -> None:
    offered = [100] * 30
    failed = [0] * 10 + [5, 9, 0, 3, 0, 0, 0, 0, 0, 4] + [0] * 10
    assert recovery_s(failed, offered, 10.0, 30.0) == 4  # seconds 10-13 bad, then five quiet ones
    assert recovery_s(failed, offered, 10.0, 30.0, quiet_s=10) == 10  # the bad second at 19 counts
    assert recovery_s(failed, offered, 0.0, 10.0) == 0  # nothing failed in its window
    assert recovery_s([5] * 5, offered, 0.0, 100.0) == 5  # to the end of what was measured
    late = [0] * 8 + [2, 2] + [0] * 10  # the effect comes 8 s after the fault
    assert recovery_s(late, offered, 0.0, 20.0) == 10
    stray = [0, 0, 1, 0, 0, 0, 0, 0, 1, 0]  # one request in a hundred: the background, not the fault
    assert recovery_s(stray, offered, 0.0, 10.0) == 0


@pytest.mark.parametrize("name", VARIANTS)
def test_each_variant_switches_off_one_mechanism(name: str) -> None:
    c = ChaosConfig().variant(name)
    off = [k for k in ("hedging", "failover", "static", "answered", "careful") if not getattr(c, k)]
    off += ["combined"] if c.controllers == 0 else []  # the quorum on the brokers: no controllers of its own
    assert off == ([] if name == "all" else [name.removeprefix("no-")])
    with pytest.raises(ValueError):
        ChaosConfig().variant("no-such")


def test_a_given_stack_runs_one_variant_with_its_own_failover_and_quorum(tmp_path: Path) -> None:
    """Refused before anything starts: a variant's failover and controllers are the stack's, fixed when it started."""
    shaped = LocalStack(tmp_path, brokers=3, controllers=3)
    with pytest.raises(ValueError, match="one variant"):
        bench_chaos(ChaosConfig(), ("all", "no-hedging"), stack=shaped)
    with pytest.raises(ValueError, match="failover"):
        bench_chaos(ChaosConfig(), ("no-failover",), stack=shaped)
    with pytest.raises(ValueError, match="controllers"):
        bench_chaos(ChaosConfig(), ("all",), stack=LocalStack(tmp_path, brokers=3))
    assert not any(tmp_path.iterdir())


def test_a_fault_s_bound_scales_with_the_rate() -> None:
    assert fault_bound("worker_sigkill", 200.0) == 50 and fault_bound("broker_slow", 200.0) == 300
    assert fault_bound("worker_sigstop", 60.0) == 15 and fault_bound("lagmon_sigkill", 60.0) == 3
    assert set(FAULT_BOUNDS) == set(FAULTS)


def test_a_fault_is_charged_the_requests_in_flight_when_it_struck_and_those_sent_until_the_next() -> None:
    faults: list[dict[str, Any]] = [{"at_s": 10.0}, {"at_s": 40.0}]
    failures = [(8.5, "expired"), (9.2, "timed_out"), (12.0, "expired"), (38.9, "unaccepted"), (39.0, "expired"),
                (41.0, "refused:deadline")]
    charge(faults, failures, before_s=1.0)
    assert [(f["failed"], f["failed_in_flight"]) for f in faults] == [(3, 1), (2, 1)]  # 8.5 s was over by 10 s
    assert faults[0]["by_kind"] == {"timed_out": 1, "expired": 1, "unaccepted": 1}
    assert faults[1]["by_kind"] == {"expired": 1, "refused:deadline": 1}


def test_availability_outside_faults_leaves_out_each_window() -> None:
    faults = [{"at_s": 10.0, "recovery_s": 5}, {"at_s": 40.0, "recovery_s": 0}]
    # windows: [10, 25) and [40, 50); the failures inside them do not count, the one at 30 s does
    calls = [(5.0, True), (12.0, False), (24.9, False), (25.0, True), (30.0, False), (45.0, False), (50.0, True)]
    assert availability_outside(calls, faults, before_s=0.0) == (3 / 4, 4)
    assert availability_outside([(12.0, False)], faults, before_s=0.0) == (None, 0)
    # a request in flight when a fault strikes (sent less than a deadline before it) is the fault's
    assert availability_outside([(9.5, False), (8.9, True), (39.0, False)], faults, before_s=1.0) == (1 / 1, 1)


def test_the_projection_charges_each_kind_its_worst_cost_once_a_day() -> None:
    # measured at 100/s: two worker kills (20 and 40 failed: 80 at 200/s), one broker pause (150: 300)
    faults = [{"kind": "worker_sigkill", "failed": 20}, {"kind": "worker_sigkill", "failed": 40},
              {"kind": "broker_slow", "failed": 150}]
    p = projection(faults, between=0.99995, rate=100.0)
    assert p is not None and p["cost_per_fault"] == {"worker_sigkill": 80.0, "broker_slow": 300.0}
    offered = 200.0 * 30 * 86_400  # a month at 200/s
    failed = 30 * (80 + 300) + 0.00005 * offered
    assert p["failed_per_month"] == round(failed)
    assert p["availability_month"] == round(1 - failed / offered, 6)
    assert projection(faults, between=None, rate=100.0) is None


def test_the_timeline_counts_by_second_sent_and_keeps_each_failure_s_outcome() -> None:
    calls = [(0.2, "ok"), (0.9, "expired"), (1.0, "ok"), (1.5, "refused:deadline"), (1.7, "expired"), (9.0, "expired")]
    t = timeline_of(calls, seconds=3)
    assert t["offered"] == [2, 3, 1]  # a request sent past the end counts in the last second
    assert t["failed"] == [1, 2, 1]
    assert t["failed_by_outcome"] == {"expired": {"0": 1, "1": 1, "2": 1}, "refused:deadline": {"1": 1}}
