"""The fleet simulator: its queueing agrees with queueing theory, failures lose nothing, sizing is minimal."""

from __future__ import annotations

from pathlib import Path

import pytest

from kinfer.ops.capacity.simulate import SimConfig, SimModel, Simulation, load_models, size_fleet

QUIET = SimConfig(transport_ms=6.0, transport_jitter_ms=0.0, reply_ms=1.0, worker_cpu_ms=0.0, batch_overhead_ms=0.0,
                  service_cv=0.0, admission=False)


def test_service_curve_interpolates_and_extrapolates() -> None:
    m = SimModel("m", 1.0, batch_ms={1: 2.0, 9: 6.0})
    assert m.forward_ms(1) == 2.0 and m.forward_ms(5) == pytest.approx(4.0) and m.forward_ms(13) == pytest.approx(8.0)
    assert m.capacity_rps() == pytest.approx(32 / m.forward_ms(32) * 1000.0)


def test_one_worker_at_batch_one_is_an_md1_queue() -> None:
    """Poisson arrivals, a constant 10 ms service, one server: Pollaczek-Khinchine's mean wait
    rho * S / (2 (1 - rho)) = 5 ms at rho 0.5, on top of the fixed 6 + 10 + 1 ms."""
    m = SimModel("m", 1.0, batch_ms={1: 10.0, 2: 20.0}, max_batch_size=1, deadline_ms=60_000, partitions=4)
    sim = Simulation([m], {"m": 1}, 50.0, QUIET, seed=3)
    sim.run(seconds=400.0, warmup_s=5.0)
    lat = [(r.done - r.sent) * 1000.0 for r in sim.requests if r.outcome == "ok" and r.sent >= 5.0]
    mean = sum(lat) / len(lat)
    assert mean == pytest.approx(17.0 + 5.0, rel=0.06)
    assert min(lat) == pytest.approx(17.0, abs=0.01)


def test_a_dead_worker_loses_nothing_and_its_records_wait_for_the_new_owner() -> None:
    m = SimModel("m", 1.0, batch_ms={1: 2.0, 32: 10.0}, partitions=6, deadline_ms=30_000)
    cfg = SimConfig(fail="worker", fail_at_s=2.0, admission=False)
    report = Simulation([m], {"m": 3}, 600.0, cfg, seed=2).run(seconds=15.0)
    outcomes = report["fleet"]["outcomes"]
    assert "unanswered" not in outcomes and set(outcomes) <= {"ok", "codel", "deadline", "expired"}
    assert outcomes["ok"] > 0.99 * report["fleet"]["requests"]  # the redelivered backlog: a little shed
    during = report["during_failure"]
    assert during["p99_ms"] > 0.5 * cfg.session_timeout_s * 1000.0  # a third of the partitions waited


def test_a_dead_broker_delays_the_partitions_it_led() -> None:
    m = SimModel("m", 1.0, batch_ms={1: 2.0, 32: 10.0}, partitions=6, deadline_ms=30_000)
    cfg = SimConfig(fail="broker", fail_at_s=2.0, broker_failover_s=3.0, admission=False)
    report = Simulation([m], {"m": 2}, 300.0, cfg, seed=2).run(seconds=10.0)
    assert report["fleet"]["outcomes"] == {"ok": report["fleet"]["requests"]}
    assert report["during_failure"]["p99_ms"] > 1000.0


def test_sizing_finds_the_fewest_workers_that_meet_the_sla() -> None:
    m = SimModel("m", 1.0, batch_ms={1: 10.0, 2: 20.0}, max_batch_size=1, partitions=8, deadline_ms=5_000)
    report = size_fleet([m], 170.0, SimConfig(admission=False), seconds=30.0)
    tried = report["search"]["m"]
    assert tried[0]["workers"] == 2  # 170/s at 100/s a worker
    n = report["fleet"]["m"]
    assert tried[-1]["workers"] == n and report["meets_sla"]
    assert all(not (t["p95_ms"] < 150 and t["p99_ms"] < 250) for t in tried[:-1])
    assert "worker_failure" in report and "broker_failure" in report


def test_generators_run_through_the_continuous_scheduler() -> None:
    m = SimModel("g", 1.0, kind="generate", step_ms=5.0, step_ms_per_seq=0.0, prefill_ms_per_token=0.0,
                 output_tokens=8, max_running=16, partitions=4, deadline_ms=10_000)
    report = Simulation([m], {"g": 1}, 20.0, SimConfig(transport_jitter_ms=0.0, service_cv=0.0,
                                                       admission=False), seed=1).run(seconds=20.0)
    stats = report["models"]["g"]
    assert stats["ok_fraction"] == 1.0
    assert stats["p50_ms"] >= 8 * 5.0  # eight steps of 5 ms at least, plus transport
    assert stats["p50_ms"] < 8 * 5.0 + 30.0


def test_models_file(tmp_path: Path) -> None:
    path = tmp_path / "mix.yaml"
    path.write_text("models:\n  - {name: e, share: 0.7, batch_ms: {'1': 2, '32': 6}}\n"
                    "  - {name: g, share: 0.3, kind: generate}\n")
    models = load_models(str(path))
    assert [m.name for m in models] == ["e", "g"] and models[0].batch_ms == {1: 2.0, 32: 6.0}
    path.write_text("models:\n  - {name: e, share: 1, bogus: 3}\n")
    with pytest.raises(ValueError, match="bogus"):
        load_models(str(path))
