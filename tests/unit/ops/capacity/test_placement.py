"""``kinfer place``: the invariants of a placement (Hypothesis), the worked example of docs/capacity.md, the
models file's validation, and the outputs (worker commands that the real command line parses,
Kubernetes Deployments)."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kinfer.ops.capacity.placement import EPS as PLACE_EPS
from kinfer.ops.capacity.placement import (
    MIN_WEIGHT,
    Fleet,
    ModelLoad,
    Placement,
    k8s_deployments,
    load_models,
    parse_models,
    place,
    render_k8s,
    render_table,
)
from kinfer.ops.cli import build_parser, main
from tests import ROOT

EXAMPLE = ROOT / "ops" / "deploy" / "models.example.yaml"
PARSER = build_parser()
EPS = 1e-6


def parses(command: tuple[str, ...] | list[str]) -> Any:
    assert command[0] == "kinfer", command
    try:
        return PARSER.parse_args(list(command[1:]))
    except SystemExit as exc:
        raise AssertionError(f"`{shlex.join(command)}` does not parse") from exc


def worker_args(command: tuple[str, ...]) -> Any:
    return parses(list(command))


def model(name: str, footprint: float, replica_rps: float, expected_rps: float, **kw: Any) -> ModelLoad:
    return ModelLoad(name, footprint, replica_rps, expected_rps, **kw)


def hot(m: ModelLoad, fleet: Fleet) -> bool:
    """The documented rule: a GPU share at least the threshold, less a relative float slack."""
    return fleet.gpu_share(m) >= fleet.dedicated_threshold * (1 - PLACE_EPS)


# --- properties ---------------------------------------------------------------------------------------


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[ModelLoad], Fleet]:
    fleet = Fleet(
        gpus=draw(st.integers(0, 24)),
        gpu_memory_gib=draw(st.sampled_from([16.0, 24.0, 40.0, 80.0, 141.0])),
        target_utilisation=draw(st.floats(0.3, 1.0)),
        dedicated_threshold=draw(st.floats(0.05, 1.0)),
        keep_warm=draw(st.integers(1, 3)),
        memory_headroom=draw(st.floats(0.0, 0.3)),
        spare_replicas=draw(st.integers(0, 2)),
    )
    n = draw(st.integers(1, 14))
    models = []
    for i in range(n):
        replica_rps = draw(st.floats(1.0, 5000.0))
        models.append(ModelLoad(
            name=f"m{i}",
            footprint_gib=draw(st.floats(0.05, 1.0)) * fleet.usable_gib,
            replica_rps=replica_rps,
            # From idle to a few GPUs' worth of traffic; long tails are the common case.
            expected_rps=replica_rps * draw(st.one_of(st.floats(0.0, 0.3), st.floats(0.0, 3.0))),
            keep_warm=draw(st.one_of(st.none(), st.integers(1, 3))),
        ))
    return models, fleet


def check_invariants(models: list[ModelLoad], fleet: Fleet, p: Placement) -> None:
    by_name = {m.name: m for m in models}
    usable, util = fleet.usable_gib, fleet.target_utilisation
    if not p.feasible:
        assert p.pools == () and p.gpus_needed > fleet.gpus and p.reason
        # The number it gives is one that works.
        again = place(models, _with_gpus(fleet, p.gpus_needed))
        assert again.feasible and again.gpus_used == p.gpus_needed and again.gpus_needed == p.gpus_needed
        return
    # Every model exactly once.
    placed = [m for pool in p.pools for m in pool.models]
    assert sorted(placed) == sorted(by_name)
    assert p.gpus_used <= fleet.gpus and p.idle_gpus == fleet.gpus - p.gpus_used
    assert p.gpus_needed <= p.gpus_used <= p.gpus_needed_resident
    for pool in p.pools:
        members = [by_name[m] for m in pool.models]
        assert set(pool.resident) | set(pool.swapped) == set(pool.models)
        assert not set(pool.resident) & set(pool.swapped)
        # Never over a GPU's memory: the resident models plus the swap slot (the largest swapped one).
        resident_gib = sum(by_name[m].footprint_gib for m in pool.resident)
        slot_gib = max((by_name[m].footprint_gib for m in pool.swapped), default=0.0)
        assert pool.memory_gib == pytest.approx(resident_gib + slot_gib)
        assert pool.memory_gib <= usable + EPS
        # Never over the target utilisation on any GPU, even if one replica had to carry it all
        # (co-located) or with the traffic spread evenly (dedicated).
        assert 0 <= pool.utilisation <= util + EPS
        if pool.kind == "dedicated":
            (m,) = members
            assert hot(m, fleet)
            # The replicas cover the traffic at the target utilisation, and keep-warm, and the spares.
            assert pool.replicas * m.replica_rps * util >= m.expected_rps * (1 - EPS)
            assert pool.replicas >= fleet.keep_warm_of(m) + fleet.spare_replicas
            assert pool.swapped == () and pool.memory_budget_gib is None
        else:
            assert sum(m.compute for m in members) <= util + EPS
            assert not any(hot(m, fleet) for m in members)
            assert pool.replicas == max(fleet.keep_warm_of(m) for m in members)
            assert pool.memory_budget_gib == usable
            # Fair-share weights follow the compute share (with a floor, so none is 0).
            assert set(pool.weights) == set(pool.models)
            total = sum(m.compute for m in members)
            for m in members:
                share = m.compute / total if total else 1 / len(members)
                assert pool.weights[m.name] == pytest.approx(max(share, MIN_WEIGHT), abs=6e-4)
                assert pool.weights[m.name] > 0
    # Hot models get dedicated pools, and only they do.
    dedicated = {pool.models[0] for pool in p.pools if pool.kind == "dedicated"}
    assert dedicated == {m.name for m in models if hot(m, fleet)}
    # Swapping only when the long tail does not fit resident.
    if p.gpus_needed_resident <= fleet.gpus:
        assert p.swapped == []


def _with_gpus(fleet: Fleet, gpus: int) -> Fleet:
    return Fleet(gpus, fleet.gpu_memory_gib, fleet.target_utilisation, fleet.dedicated_threshold,
                 fleet.keep_warm, fleet.memory_headroom, fleet.spare_replicas)


@settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
# 0.35 of a replica's traffic at 70 % busy is 0.5 GPU, the threshold, in decimals, and a rounding step
# under it in floats (0.49999999999999994): hot, and the invariants say so too.
@example(([ModelLoad("m0", 0.8, 3.0, 3.0 * 0.35)], Fleet(1, 16.0, 0.7, 0.5, 1, 0.0, 0)))
def test_every_placement_keeps_the_invariants(scenario: tuple[list[ModelLoad], Fleet]) -> None:
    models, fleet = scenario
    check_invariants(models, fleet, place(models, fleet))


@settings(max_examples=100, derandomize=True, deadline=None)
@given(scenarios(), st.integers(1, 8))
def test_more_gpus_never_make_a_placement_infeasible(scenario: tuple[list[ModelLoad], Fleet], more: int) -> None:
    models, fleet = scenario
    before = place(models, fleet)
    after = place(models, _with_gpus(fleet, fleet.gpus + more))
    assert after.feasible or not before.feasible
    assert after.gpus_needed == before.gpus_needed  # what it takes does not depend on what is given


@settings(max_examples=60, derandomize=True, deadline=None)
@given(scenarios())
def test_every_emitted_command_parses_with_the_real_command_line(scenario: tuple[list[ModelLoad], Fleet]) -> None:
    models, fleet = scenario
    p = place(models, fleet)
    for pool in p.pools:
        args = worker_args(pool.command)
        assert args.command == "worker" and args.model == list(pool.models)
        weights = dict(w.split("=") for w in args.weight)
        if len(pool.models) > 1:
            assert {k: float(v) for k, v in weights.items()} == pool.weights
        else:
            assert weights == {}
        assert args.memory_budget == pool.memory_budget_gib
        if pool.keep_warm is not None:
            assert args.keep_warm == pool.keep_warm
    for obj, pool in zip(k8s_deployments(p), p.pools, strict=True):
        container = obj["spec"]["template"]["spec"]["containers"][0]
        assert worker_args(tuple(container["command"])).model == list(pool.models)


def test_the_new_worker_flags_round_trip() -> None:
    p = place(load_models(EXAMPLE), Fleet(gpus=12, gpu_memory_gib=80))
    shared = next(pool for pool in p.pools if pool.kind == "colocated")
    args = parses(shared.command)
    assert args.memory_budget == 72.0 and args.keep_warm == 0
    # The worker's residency policy, given the command, starts as planned: every resident model on the
    # device (and of the swapped ones what fits beside them: the budget is the GPU's usable memory).
    from kinfer.batcher.residency import Residency, ResidencyPolicy, Tier

    gib = 1 << 30
    footprints = {k: float(v) for k, v in (f.split("=") for f in args.footprint)}
    assert set(footprints) == set(shared.models)
    worker = Residency(ResidencyPolicy(int(args.memory_budget * gib)))
    for name in args.model:
        worker.register(name, int(footprints[name] * gib))
    worker.initial(0.0)
    on_device = set(worker.models(Tier.DEVICE))
    assert set(shared.resident) <= on_device and worker.used(Tier.DEVICE) <= args.memory_budget * gib


# --- the rule, by example ---------------------------------------------------------------------------


def test_the_readme_example_dedicates_the_hot_models_and_packs_the_tail() -> None:
    models = load_models(EXAMPLE)
    roomy = place(models, Fleet(gpus=16, gpu_memory_gib=80))
    assert [(pool.name, pool.kind, pool.replicas) for pool in roomy.pools] == [
        ("chat-7b", "dedicated", 9),  # 900 / (150 x 0.7) = 8.57
        ("embed-large", "dedicated", 2),  # 2000 / (2400 x 0.7) = 1.19
        ("shared-1", "colocated", 1),
        ("shared-2", "colocated", 1),
    ]
    assert roomy.swapped == [] and (roomy.gpus_used, roomy.idle_gpus) == (13, 3)
    # embed-multilingual: 700 / (3000 x 0.7) = 0.33 GPU, under the 0.5 threshold: co-located.
    assert "embed-multilingual" in roomy.pools[2].models
    assert roomy.pools[0].command == ("kinfer", "worker", "--model", "chat-7b", "--family", "generator",
                                      "--path", "/models/chat-7b")

    # One GPU for the tail: the coldest large models are registered, swapped in on demand.
    tight = place(models, Fleet(gpus=12, gpu_memory_gib=80))
    assert tight.feasible and tight.gpus_used == 12 and tight.gpus_needed_resident == 13
    (shared,) = [pool for pool in tight.pools if pool.kind == "colocated"]
    assert shared.swapped == ("caption-2b", "sql-7b", "summarize-3b")
    assert shared.memory_gib == pytest.approx(29.3 + 30)  # residents + the 30 GiB slot (sql-7b)
    assert shared.keep_warm == 0 and "--keep-warm" in shared.command
    assert "coldest" in shared.rationale
    # legal-embed (2 requests/s) is colder than summarize-3b (3) but small: it stays resident.
    assert "legal-embed" in shared.resident

    short = place(models, Fleet(gpus=11, gpu_memory_gib=80))
    assert not short.feasible and short.gpus_needed == 12 and short.pools == ()


def test_the_threshold_is_reached_within_float_rounding_only() -> None:
    fleet = Fleet(gpus=4, gpu_memory_gib=80, target_utilisation=0.75, dedicated_threshold=0.4)
    at = model("at", 1, 10, 3)  # 3 / (10 x 0.75) = 0.4 GPU exactly, computed a rounding step under it
    assert fleet.gpu_share(at) < 0.4
    under = model("under", 1, 10, 2.99999)  # a few millionths under: the long tail
    p = place([at, under], fleet)
    assert [(pool.name, pool.kind) for pool in p.pools] == [("at", "dedicated"), ("shared-1", "colocated")]
    assert p.pools[1].models == ("under",)
    # The slack is relative: however small the threshold, a model with no traffic is not hot.
    tiny = place([model("idle", 1, 100, 0)], Fleet(gpus=1, gpu_memory_gib=16, dedicated_threshold=1e-12))
    assert [(pool.kind, pool.models) for pool in tiny.pools] == [("colocated", ("idle",))]


def test_a_model_larger_than_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"'big' needs 90 GiB resident.*80 GiB less 10% headroom = 72 GiB"):
        place([model("big", 90, 10, 100)], Fleet(gpus=4, gpu_memory_gib=80))
    with pytest.raises(ValueError, match="more than one GPU holds"):  # within the GPU, not within the headroom
        place([model("tail", 75, 1000, 1)], Fleet(gpus=4, gpu_memory_gib=80))


def test_keep_warm_and_spares_raise_replicas() -> None:
    fleet = Fleet(gpus=10, gpu_memory_gib=80, keep_warm=2, spare_replicas=1)
    p = place([model("hot", 10, 100, 80), model("cold", 1, 1000, 1, keep_warm=3)], fleet)
    hot, cold = p.pools
    assert (hot.replicas, cold.replicas) == (2 + 1, 3)  # 80 / 70 -> 2 for traffic; cold: its own keep_warm
    assert "spare" in hot.rationale and "keep-warm" in cold.rationale


def test_weights_follow_compute_share_with_a_floor() -> None:
    p = place([model("a", 1, 100, 21), model("b", 1, 100, 7), model("idle", 1, 100, 0)],
              Fleet(gpus=1, gpu_memory_gib=80))
    (pool,) = p.pools
    assert pool.weights == {"a": 0.75, "b": 0.25, "idle": MIN_WEIGHT}
    assert "--weight" in pool.command and "a=0.75" in pool.command


def test_family_and_path_only_when_the_pool_agrees() -> None:
    p = place([model("a", 1, 100, 1, family="embedding", path="/m/a"), model("b", 1, 100, 1, family="embedding",
                                                                           path="/m/b")],
              Fleet(gpus=1, gpu_memory_gib=80))
    (pool,) = p.pools
    assert pool.command[6:8] == ("--family", "embedding")
    assert "--path" not in pool.command
    assert pool.warnings and "--path differs" in pool.warnings[0]


@pytest.mark.parametrize("change, message", [
    ({"target_utilisation": 0}, "target_utilisation"),
    ({"dedicated_threshold": 1.5}, "dedicated_threshold"),
    ({"keep_warm": 0}, "keep_warm"),
    ({"memory_headroom": 1.0}, "memory_headroom"),
    ({"gpu_memory_gib": 0}, "gpu_memory_gib"),
])
def test_settings_are_checked(change: dict[str, Any], message: str) -> None:
    fleet = Fleet(**{"gpus": 1, "gpu_memory_gib": 80, **change})
    with pytest.raises(ValueError, match=message):
        place([model("a", 1, 100, 1)], fleet)


# --- the models file --------------------------------------------------------------------------------


def test_the_models_file_reads_json_and_yaml(tmp_path: Path) -> None:
    models = load_models(EXAMPLE)
    assert len(models) == 15 and models[0].name == "chat-7b" and models[0].path == "/models/chat-7b"
    as_json = tmp_path / "models.json"
    as_json.write_text(json.dumps([{"name": "a", "footprint_gib": 2, "replica_rps": 10, "expected_rps": 1}]))
    assert load_models(as_json) == [ModelLoad("a", 2.0, 10.0, 1.0)]


def test_the_models_file_errors_name_the_field() -> None:
    with pytest.raises(ValueError) as err:
        parse_models({"models": [
            {"name": "ok", "footprint_gib": 1, "replica_rps": 10, "expected_rps": 1},
            {"name": "bad", "footprint_gib": -1, "replica_rps": 10, "expected_rps": 1, "colour": "red"},
            {"name": "Bad.Name", "footprint_gib": 1, "expected_rps": 1},
        ]}, "m.yaml")
    text = str(err.value)
    assert text.startswith("m.yaml: 4 problems")
    assert "models[1] ('bad').footprint_gib: Input should be greater than 0 (got -1)" in text
    assert "models[1] ('bad').colour: Extra inputs are not permitted" in text
    assert "models[2] ('Bad.Name').name: String should match pattern" in text
    assert "models[2] ('Bad.Name').replica_rps: Field required" in text
    with pytest.raises(ValueError, match="named more than once: a"):
        parse_models([{"name": "a", "footprint_gib": 1, "replica_rps": 1, "expected_rps": 1}] * 2)
    with pytest.raises(ValueError, match="non-empty list"):
        parse_models({"models": []})


# --- the command ------------------------------------------------------------------------------------


def test_the_command_prints_json_a_table_and_manifests(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["place", "--models", str(EXAMPLE), "--gpu-memory", "80"]
    assert main([*base, "--gpus", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["feasible"] and out["totals"] == {"gpus": 12, "gpus_used": 12, "idle_gpus": 0}
    assert out["swapped"] == ["caption-2b", "sql-7b", "summarize-3b"]
    assert {"name", "models", "replicas", "gpus", "weights", "memory_gib", "utilisation", "command",
            "rationale"} <= set(out["pools"][0])

    assert main([*base, "--gpus", "16"]) == 0
    table = capsys.readouterr().out
    assert "16 GPUs of 80 GiB (72 usable)" in table and "13 used, 3 idle" in table

    assert main([*base, "--gpus", "11", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["feasible"] and out["gpus_needed"] == 12
    assert main([*base, "--gpus", "11"]) == 1
    assert "rerun with --gpus 12" in capsys.readouterr().err

    assert main([*base, "--gpus", "12", "--emit", "k8s"]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert [d["kind"] for d in docs] == ["Deployment", "PodDisruptionBudget"] * 3
    assert [d["spec"]["replicas"] for d in docs[::2]] == [9, 2, 1]


def test_a_bad_models_file_exits_2_with_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "m.yaml"
    bad.write_text("- {name: a, footprint_gib: 1, replica_rps: 0, expected_rps: 1}\n")
    assert main(["place", "--models", str(bad), "--gpus", "1", "--gpu-memory", "80"]) == 2
    assert "models[0] ('a').replica_rps: Input should be greater than 0" in capsys.readouterr().err


def test_the_manifests_follow_the_repository_conventions() -> None:
    p = place(load_models(EXAMPLE), Fleet(gpus=12, gpu_memory_gib=80))
    text = render_k8s(p)
    every = list(yaml.safe_load_all(text))
    assert len(every) == 2 * len(p.pools) and text.count("\n---\n") == 2 * len(p.pools) - 1
    docs, budgets = every[::2], every[1::2]  # each pool's Deployment, then its disruption budget
    for obj, budget in zip(docs, budgets, strict=True):
        assert budget["kind"] == "PodDisruptionBudget" and budget["spec"]["maxUnavailable"] == 1
        assert budget["spec"]["selector"] == obj["spec"]["selector"]
    config = yaml.safe_load_all((ROOT / "ops" / "deploy" / "k8s" / "config.yaml").read_text())
    config_maps = {d["metadata"]["name"] for d in config if d and d["kind"] == "ConfigMap"}
    for obj, pool in zip(docs, p.pools, strict=True):
        assert obj["apiVersion"] == "apps/v1" and obj["kind"] == "Deployment"
        assert obj["metadata"]["name"] == f"kinfer-worker-{pool.name}"
        assert obj["spec"]["replicas"] == pool.replicas
        labels = obj["spec"]["template"]["metadata"]["labels"]
        assert obj["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert labels["app.kubernetes.io/part-of"] == "kinfer" and labels["app.kubernetes.io/component"] == "worker"
        if pool.kind == "dedicated":  # where `kinfer autoscale --mode kubernetes` looks for a model's workers
            assert labels["kinfer.model"] == pool.name
        spec = obj["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        assert c["resources"]["requests"]["nvidia.com/gpu"] == 1 == c["resources"]["limits"]["nvidia.com/gpu"]
        assert c["command"][:len(pool.command)] == list(pool.command)
        args = worker_args(tuple(c["command"]))
        assert spec["terminationGracePeriodSeconds"] > args.drain_timeout_s
        assert all(ref["configMapRef"]["name"] in config_maps for ref in c["envFrom"])
    assert "kinfer place: dedicated pool chat-7b" in text.splitlines()[0]


def test_the_table_says_why() -> None:
    p = place(load_models(EXAMPLE), Fleet(gpus=12, gpu_memory_gib=80))
    table = render_table(p)
    assert "summarize-3b 0.101 (swapped)" in table
    assert all(pool.rationale in table for pool in p.pools)
    assert math.isclose(p.pools[0].utilisation, 900 / (150 * 9))
