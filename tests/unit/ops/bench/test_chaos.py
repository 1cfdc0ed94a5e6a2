"""The chaos soak's pure parts: its fault schedule and how a fault's recovery is read off the timeline."""

from __future__ import annotations

import itertools

import pytest

from kinfer.ops.bench.chaos import FAULTS, VARIANTS, ChaosConfig, recovery_s, schedule


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
    off = [k for k in ("hedging", "failover", "static", "answered") if not getattr(c, k)]
    assert off == ([] if name == "all" else [name.removeprefix("no-")])
    with pytest.raises(ValueError):
        ChaosConfig().variant("no-such")
