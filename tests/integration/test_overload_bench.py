"""`kinfer bench overload`, shortened: the same surge with and without the health signal.

Asserted by counts, not by the clock: with the signal, work is refused at admission, nothing
accepted is lost, far fewer accepted requests miss their deadline, and the worker serves at least
as many requests in time; without it, the surge shows as deadline misses.
"""

from __future__ import annotations

import pytest

from kinfer.ops.bench.overload import bench_overload
from kinfer.ops.localstack.stack import StackInfo

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_backpressure_turns_a_surge_into_early_refusals_instead_of_deadline_misses(stack: StackInfo) -> None:
    report = bench_overload(surge_s=8.0, normal_s=4.0, info=stack, neighbour_s=0)
    with_bp, without = report["with_backpressure"], report["without_backpressure"]

    assert with_bp["offered"] == without["offered"]  # the same schedule, side by side
    assert with_bp["lost"] == 0 and without["lost"] == 0  # every accepted request is answered
    assert with_bp["rejected"] > 0 and without["rejected"] == 0
    assert without["deadline_misses"] > 0.3 * without["accepted"]  # the surge without the signal
    assert with_bp["deadline_misses"] < 0.5 * without["deadline_misses"]
    assert with_bp["served_in_time"] >= 0.8 * without["served_in_time"]  # refusing did not idle the worker
    # Lowest priority first: p2 is refused more than p1, and p1 more than p0.
    share = {p: v["accepted"] / v["offered"] for p, v in with_bp["by_priority"].items()}
    assert share["p0"] > share["p1"] > share["p2"]
    assert with_bp["recovery_s"] is not None
