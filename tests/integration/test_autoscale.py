"""The autoscaler in local mode against a real broker: a step up and back down, nothing lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from kinfer.ops.bench.autoscale import Trace, bench_autoscale
from kinfer.ops.control.scaling import ScalePolicy
from kinfer.ops.localstack.stack import StackInfo

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_local_pool_follows_a_step_from_one_to_three_and_back(stack: StackInfo, tmp_path: Path) -> None:
    """30/s, then 150/s, then 30/s again, open loop; each worker drains ~100/s (10 ms an input): the
    pool goes 1 -> 3 -> 1 (3: the load's need, and the maximum: on a busy machine the workers start
    late and the backlog asks for more) with real worker processes (scale-down by SIGTERM), and every request is
    answered — served, or shed by a worker's own overload control while the new workers start."""
    policy = ScalePolicy(min_replicas=1, max_replicas=3, replica_rps=100.0, up_cooldown_s=2.0, down_cooldown_s=2.0,
                         down_window_s=5.0, smoothing_s=2.0, drain_s=3.0)
    trace = Trace(quiet_rps=30.0, step=5.0, quiet_s=6.0, peak_s=14.0, ramp_s=0.0, tail_s=24.0)
    report = bench_autoscale(trace, per_input_ms=10.0, policy=policy, compare=False, info=stack,
                             plot=str(tmp_path / "autoscale.png"))
    run = report["autoscaled"]
    counts = [n for _, n in run["replicas_over_time"]]
    assert counts[0] == 1 and max(counts) == 3 and counts[-1] == 1, run["replicas_over_time"]
    assert run["lost"] == 0
    assert set(run["outcomes"]) <= {"ok", "Shed"}, run["outcomes"]  # every request got its terminal answer
    assert run["outcomes"]["ok"] >= 0.9 * run["offered"]
    assert run["restarts"] == 0 and run["workers_started"] == 3
    assert (tmp_path / "autoscale.png").stat().st_size > 10_000
