"""The fleet as a whole: a short chaos soak (``kinfer bench chaos``) asserted by counts."""

from __future__ import annotations

import pytest

from kinfer.ops.bench.chaos import KINDS, ChaosConfig, bench_chaos, fault_bound

pytestmark = pytest.mark.integration


@pytest.mark.slow
def test_three_faults_lose_nothing() -> None:
    """Faults under steady traffic on a three-broker fleet: nothing lost, nothing answered twice, what was
    killed restarted, every request accounted for, and each fault within its class's bound
    (``FAULT_BOUNDS``, scaled to the soak's rate: a worker's death or pause may fail a quarter of a
    second of traffic, 20 requests at 80/s). Measured alone on two cores: 0 failed for either fault."""
    faults = ("worker_sigkill", "worker_sigstop")
    config = ChaosConfig(minutes=0.5, rate=80.0, every_s=(13.0, 14.0), first_fault_s=5.0, warmup_s=8.0, drain_s=5.0,
                         faults=faults)
    report = bench_chaos(config)
    assert {f["kind"] for f in report["faults"]} == set(faults)
    assert sum(report[k] for k in KINDS) == report["offered"] > 2_000
    assert report["lost"] == 0 and report["duplicates_delivered"] == 0, report["lost_ids"]
    killed = next(f["target"] for f in report["faults"] if f["kind"] == "worker_sigkill")
    assert report["restarts"][killed] >= 1
    for fault in report["faults"]:
        assert fault["bound"] == fault_bound(fault["kind"], config.rate) == 20
        assert fault["within_bound"], fault  # its failed requests, by kind
    # Before the first fault nothing is a fault's: all of it within the bounds together.
    assert report["offered"] - report["ok"] <= sum(f["bound"] for f in report["faults"]), \
        {k: report[k] for k in (*KINDS, "why")}
