"""Deficit round-robin over measured compute time."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kinfer.batcher import DeficitRoundRobin


def run(drr: DeficitRoundRobin[str], cost: dict[str, float], steps: int, ready: set[str]) -> dict[str, float]:
    used = dict.fromkeys(cost, 0.0)
    for _ in range(steps):
        lane = drr.pick(ready)
        assert lane is not None
        drr.charge(lane, cost[lane])
        used[lane] += cost[lane]
    return used


def test_equal_weights_share_compute_time_not_batches() -> None:
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(quantum_s=0.05)
    drr.add("heavy")
    drr.add("light")
    used = run(drr, {"heavy": 0.08, "light": 0.01}, steps=2000, ready={"heavy", "light"})
    assert used["heavy"] / used["light"] == pytest.approx(1.0, rel=0.1)


def test_weights_set_the_shares() -> None:
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(quantum_s=0.02)
    drr.add("a", weight=3)
    drr.add("b", weight=1)
    used = run(drr, {"a": 0.01, "b": 0.01}, steps=4000, ready={"a", "b"})
    assert used["a"] / used["b"] == pytest.approx(3.0, rel=0.1)


def test_a_lane_that_comes_back_is_served_at_once_but_banks_no_credit() -> None:
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(quantum_s=0.05)
    drr.add("busy")
    drr.add("quiet")
    for _ in range(50):  # "quiet" has nothing; "busy" runs alone
        lane = drr.pick({"busy"})
        assert lane == "busy"
        drr.charge(lane, 0.03)
    assert drr.credit("quiet") == 0.0
    # quiet gets work: it is picked within one busy batch, not after busy's backlog.
    picks = []
    for _ in range(3):
        lane = drr.pick({"busy", "quiet"})
        assert lane is not None
        picks.append(lane)
        drr.charge(lane, 0.03)
    assert "quiet" in picks[:2]


def test_validation() -> None:
    drr: DeficitRoundRobin[str] = DeficitRoundRobin()
    with pytest.raises(ValueError, match="weight"):
        drr.add("x", weight=0)
    assert drr.pick(set()) is None


@given(
    costs=st.lists(st.floats(0.001, 0.2), min_size=2, max_size=5),
    weights=st.lists(st.floats(0.5, 4.0), min_size=5, max_size=5),
)
def test_every_backlogged_lane_gets_its_weighted_share(costs: list[float], weights: list[float]) -> None:
    lanes = [f"m{i}" for i in range(len(costs))]
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(quantum_s=0.05)
    for lane, w in zip(lanes, weights, strict=False):
        drr.add(lane, weight=w)
    used = run(drr, dict(zip(lanes, costs, strict=True)), steps=3000, ready=set(lanes))
    total_w = sum(weights[: len(lanes)])
    total = sum(used.values())
    for lane, w in zip(lanes, weights, strict=False):
        # Within one batch cost plus one quantum of the ideal share.
        slack = max(costs) + 0.05 * max(weights) * 2
        assert abs(used[lane] - total * w / total_w) <= slack * len(lanes) + 0.1 * total * w / total_w
