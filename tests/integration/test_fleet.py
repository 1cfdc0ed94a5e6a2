"""The fleet as a whole: a short chaos soak (``kinfer bench chaos``) asserted by counts."""

from __future__ import annotations

import pytest

from kinfer.ops.bench.chaos import KINDS, ChaosConfig, bench_chaos

pytestmark = pytest.mark.integration


@pytest.mark.slow
def test_three_faults_lose_nothing() -> None:
    """Faults under steady traffic on a three-broker fleet: nothing lost, nothing answered twice, what was
    killed restarted, every request accounted for. Availability here is a smoke bound: the soak shares two
    cores with the rest of the suite; the 20-minute figure is the benchmark's. The soak's own machinery
    (the supervisor, the accounting) is what this tests: each fault class is tested on its own in
    ``test_faults`` and ``test_fault_suite``."""
    faults = ("worker_sigkill", "worker_sigstop")
    config = ChaosConfig(minutes=0.5, rate=80.0, every_s=(13.0, 14.0), first_fault_s=5.0, warmup_s=8.0, drain_s=5.0,
                         faults=faults)
    report = bench_chaos(config)
    assert {f["kind"] for f in report["faults"]} == set(faults)
    assert sum(report[k] for k in KINDS) == report["offered"] > 2_000
    assert report["lost"] == 0 and report["duplicates_delivered"] == 0, report["lost_ids"]
    killed = next(f["target"] for f in report["faults"] if f["kind"] == "worker_sigkill")
    assert report["restarts"][killed] >= 1
    assert report["ok"] >= 0.8 * report["offered"], {k: report[k] for k in (*KINDS, "why")}
