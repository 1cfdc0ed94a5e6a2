"""``kinfer status``: the table and the JSON, from what the monitor and the telemetry publish."""

from __future__ import annotations

import json

from kinfer.ops.control.status import Snapshot, render
from kinfer.topics.health import HealthState, Level, LevelChange
from kinfer.topics.stats import ModelStats


def test_status_shows_each_model_and_the_latest_decisions() -> None:
    health = HealthState("emb", Level.SHEDDING, 180.0, 2000, 42, 90.0, 60.0, 10_000, (0, 12, 30), 8.5)
    stats = ModelStats("emb", 10.0, 61.5, 7.7, 8.0, 8.5, {8: 8.5}, {"codel": 4}, 1234, 10_000)
    only_stats = ModelStats("cls", 10.0, 5.0, 5.0, 1.0, 2.0, {1: 2.0}, {}, 50, 9_000)
    change = LevelChange(9_500, "emb", Level.DEGRADED, Level.SHEDDING, 42, 180.0)
    snap = Snapshot({"emb": health}, {"emb": stats, "cls": only_stats}, [change])

    lines = render(snap, now_ms=11_000).splitlines()
    emb = next(line for line in lines if line.startswith("emb"))
    assert "shedding" in emb and "0/12/30" in emb and "61.5" in emb and "codel=4" in emb
    cls = next(line for line in lines if line.startswith("cls"))
    assert cls.split()[1] == "-"  # no health state for it: shown, not invented
    assert any("emb: degraded -> shedding" in line for line in lines)

    doc = json.loads(json.dumps(snap.to_json()))
    assert doc["models"]["emb"]["health"]["lag_by_priority"] == [0, 12, 30]
    assert doc["models"]["cls"]["health"] is None
    assert doc["decisions"][0]["to"] == "shedding"


def test_level_change_round_trip() -> None:
    first = LevelChange(1, "m", None, Level.OK, 0, 0.0)
    assert LevelChange.unpack(first.pack()) == first


def test_status_shows_what_the_autoscaler_runs_and_decided() -> None:
    from kinfer.ops.control.scaling import ScaleDecision, ScaleState

    stats = ModelStats("emb", 10.0, 61.5, 7.7, 8.0, 8.5, {8: 8.5}, {}, 1234, 10_000, workers=2)
    state = ScaleState("emb", "local", 3, 3, 1, 6, 210.0, 100.0, 10_000)
    up = ScaleDecision(9_000, "emb", 1, 3, "up", 210.0, 100.0, 400.0, 4000.0)
    snap = Snapshot({}, {"emb": stats}, [], {"emb": state}, [up])

    lines = render(snap, now_ms=11_000).splitlines()
    emb = next(line for line in lines if line.startswith("emb"))
    assert "2/3 (wants 3) [1..6]" in emb  # serving / running
    assert any("emb: 1 -> 3 workers (up: load 210.0/s" in line for line in lines)
    doc = json.loads(json.dumps(snap.to_json()))
    assert doc["models"]["emb"]["autoscale"]["replicas"] == 3
    assert doc["scale_decisions"][0]["after"] == 3


def test_status_shows_cold_models_and_each_workers_tiers_with_measured_swap_ins() -> None:
    from kinfer.topics.residency import ModelResidency, WorkerResidency

    gib = 1 << 30
    cold = HealthState("rare", Level.OK, 0.0, 1000, 3, 0.0, 0.0, 10_000, warm_replicas=0, cold_start_ms=1850.0)
    report = WorkerResidency("w1", 10_000, 2 * gib, [
        ModelResidency("emb", "device", gib, {"disk": 2400.0}),
        ModelResidency("rare", "host", gib // 2, {"host": 310.0, "disk": 1850.0}),
    ])
    snap = Snapshot({"rare": cold}, {}, [], residency=[report])
    lines = render(snap, now_ms=11_000).splitlines()
    assert "cold 1850" in next(line for line in lines if line.startswith("rare"))
    assert any("w1: 1.00 of 2.00 GiB" in line for line in lines)
    rare = next(line for line in lines if line.strip().startswith("rare ") and "GiB" in line)
    assert "host" in rare and "from disk 1850 ms, from host 310 ms" in rare
    assert json.loads(json.dumps(snap.to_json()))["residency"][0]["models"][1]["swap_in_ms"]["host"] == 310.0
