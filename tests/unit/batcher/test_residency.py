"""The residency policy: never over a budget, never evicts work in progress, LRU weighted by load."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kinfer.batcher.residency import Demand, Residency, ResidencyPolicy, Tier

MB = 1 << 20


def residency(device_mb: int, host_mb: int = 0, **kw: float) -> Residency:
    return Residency(ResidencyPolicy(device_mb * MB, host_mb * MB, **kw))  # type: ignore[arg-type]


def test_initial_fills_the_device_then_host_in_order() -> None:
    r = residency(250, 200)
    for name in "abcd":
        r.register(name, 100 * MB)
    moves = r.initial(0.0)
    assert [(m.model, m.to) for m in moves] == [("a", Tier.DEVICE), ("b", Tier.DEVICE), ("c", Tier.HOST),
                                                 ("d", Tier.HOST)]
    r2 = residency(250, 0)
    for name in "abc":
        r2.register(name, 100 * MB)
    r2.initial(0.0)
    assert r2.models(Tier.DISK) == ["c"]


def test_a_waiting_model_takes_the_place_of_the_least_recently_used_idle_one() -> None:
    r = residency(200)
    for name in "abc":
        r.register(name, 100 * MB)
    r.initial(0.0)  # a and b resident
    r.touch("a", 1.0)
    r.touch("b", 2.0)
    r.touch("a", 3.0)  # a used twice, last at 3; b once at 2
    plan = r.swaps(4.0, {"c": Demand(waiting=5)})
    assert [(m.model, m.source, m.to) for m in plan.moves] == [("b", Tier.DEVICE, Tier.DISK),
                                                              ("c", Tier.DISK, Tier.DEVICE)]


def test_equal_demand_evicts_the_least_recently_used() -> None:
    r = residency(200, half_life_s=1e9)
    for name in "abc":
        r.register(name, 100 * MB)
    r.initial(0.0)
    r.touch("b", 1.0)
    r.touch("a", 2.0)  # same demand (1 each): b is the older
    assert r.swaps(3.0, {"c": Demand(waiting=1)}).moves[0].model == "b"


def test_a_heavier_model_stays_longer() -> None:
    r = Residency(ResidencyPolicy(200 * MB, half_life_s=1e9))
    r.register("heavy", 100 * MB, weight=10.0)
    r.register("light", 100 * MB)
    r.register("new", 100 * MB)
    r.initial(0.0)
    r.touch("heavy", 1.0)
    r.touch("light", 2.0)  # more recent, but its load weight is a tenth
    assert r.swaps(3.0, {"new": Demand(waiting=1)}).moves[0].model == "light"


def test_never_evicts_a_model_with_work_and_waits_for_room() -> None:
    r = residency(100)
    r.register("a", 100 * MB)
    r.register("b", 100 * MB)
    r.initial(0.0)
    plan = r.swaps(1.0, {"a": Demand(busy=True), "b": Demand(waiting=3)})
    assert plan.moves == [] and plan.drain == frozenset()
    assert r.swaps(2.0, {"a": Demand(), "b": Demand(waiting=3)}).moves[-1].model == "b"


def test_time_slicing_drains_a_busy_model_after_a_quantum_then_swaps() -> None:
    r = residency(100, quantum_s=10.0)
    r.register("a", 100 * MB)
    r.register("b", 100 * MB)
    r.initial(0.0)
    both = {"a": Demand(waiting=100, busy=True), "b": Demand(waiting=100)}
    assert r.swaps(5.0, both).drain == frozenset()  # b waits, a has not had its quantum
    plan = r.swaps(16.0, both)  # b waited 11 s, a held the device 16 s
    assert plan.moves == [] and plan.drain == {"a"}
    drained = {"a": Demand(waiting=80), "b": Demand(waiting=100)}
    assert [m.model for m in r.swaps(17.0, drained).moves] == ["a", "b"]
    assert r.tier("b") == Tier.DEVICE


def test_keep_warm_protects_the_last_replicas() -> None:
    r = residency(100, keep_warm=1)
    r.register("a", 100 * MB)
    r.register("b", 100 * MB)
    r.initial(0.0)
    assert r.swaps(1.0, {"a": Demand(replicas=1), "b": Demand(waiting=1)}).moves == []
    assert r.swaps(2.0, {"a": Demand(replicas=2), "b": Demand(waiting=1)}).moves[-1].model == "b"


def test_evictions_go_to_host_ram_pushing_the_least_valuable_to_disk() -> None:
    r = residency(100, 100, half_life_s=1e9)
    for name in "abc":
        r.register(name, 100 * MB)
    r.initial(0.0)  # a on the device, b in host RAM, c on disk
    r.touch("a", 1.0)
    moves = r.swaps(2.0, {"c": Demand(waiting=1)}).moves
    assert [(m.model, m.to) for m in moves] == [("b", Tier.DISK), ("a", Tier.HOST), ("c", Tier.DEVICE)]


def test_a_model_larger_than_the_device_is_unservable() -> None:
    r = residency(100)
    r.register("huge", 300 * MB)
    plan = r.swaps(0.0, {"huge": Demand(waiting=1)})
    assert plan.moves == [] and plan.unservable == {"huge"}


def test_a_footprint_measured_larger_sheds_idle_models() -> None:
    r = residency(200)
    r.register("a", 100 * MB)
    r.register("b", 100 * MB)
    r.initial(0.0)
    r.resize("b", 150 * MB)
    r.touch("b", 1.0)
    plan = r.swaps(2.0, {})
    assert [(m.model, m.to) for m in plan.moves] == [("a", Tier.DISK)]
    assert r.used(Tier.DEVICE) <= 200 * MB


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, int, int, list[int], list[list[tuple[int, bool, int]]]]:
    device = draw(st.integers(1, 8))
    host = draw(st.integers(0, 8))
    keep = draw(st.integers(0, 2))
    n = draw(st.integers(1, 6))
    sizes = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    steps = draw(st.lists(st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.integers(0, 3)),
                                   min_size=n, max_size=n), min_size=1, max_size=30))
    return device, host, keep, sizes, steps


@settings(max_examples=1000, deadline=None)
@given(scenarios())
def test_properties(case: tuple[int, int, int, list[int], list[list[tuple[int, bool, int]]]]) -> None:
    device, host, keep, sizes, steps = case
    r = Residency(ResidencyPolicy(device, host, quantum_s=2.0, keep_warm=keep))
    names = [f"m{i}" for i in range(len(sizes))]
    for name, size in zip(names, sizes, strict=True):
        r.register(name, size)
    r.initial(0.0)
    tiers = {name: r.tier(name) for name in names}
    for t, step in enumerate(steps, start=1):
        now = float(t)
        seen = {}
        for name, (waiting, busy, replicas) in zip(names, step, strict=True):
            # Only a resident model can have work in this process; its replicas count this worker.
            resident = tiers[name] == Tier.DEVICE
            seen[name] = Demand(waiting, busy and resident, replicas + resident)
            if waiting:
                r.touch(name, now, waiting)
        plan = r.swaps(now, seen)
        for move in plan.moves:
            assert move.source == tiers[move.model], "moves start where the model is"
            if move.source == Tier.DEVICE:
                assert not seen[move.model].busy, "evicted a model with work in progress"
                assert not keep or seen[move.model].replicas > keep, "evicted one of the last warm replicas"
            tiers[move.model] = move.to
        assert tiers == {name: r.tier(name) for name in names}
        assert r.used(Tier.DEVICE) <= device, "over the device budget"
        assert r.used(Tier.HOST) <= host, "over the host budget"
        assert plan.drain <= set(r.models(Tier.DEVICE))
        for name in plan.unservable:
            assert r.footprint(name) > device


def test_no_starvation_between_two_busy_models_on_a_budget_of_one() -> None:
    r = residency(100, quantum_s=3.0)
    r.register("a", 100 * MB)
    r.register("b", 100 * MB)
    r.initial(0.0)
    held = []
    draining: frozenset[str] = frozenset()
    for t in range(1, 40):
        resident = r.models(Tier.DEVICE)[0]
        seen = {name: Demand(waiting=50, busy=(name == resident and name not in draining)) for name in "ab"}
        plan = r.swaps(float(t), seen)
        draining = plan.drain
        held.append(r.models(Tier.DEVICE)[0])
    assert held.count("a") >= 10 and held.count("b") >= 10


def test_policy_validation() -> None:
    with pytest.raises(ValueError):
        ResidencyPolicy(0)
    with pytest.raises(ValueError):
        ResidencyPolicy(1, keep_warm=-1)


def test_a_model_warm_elsewhere_is_prefetched_only_when_a_queue_forms() -> None:
    r = residency(200, prefetch_lag=50)
    r.register("a", 100 * MB)
    r.register("b", 100 * MB)
    r.initial(0.0)  # both fit: a and b resident
    r.register("c", 100 * MB)
    # c is warm on another worker: its lag of 10 is that worker's work in flight, not a queue.
    assert r.swaps(1.0, {"c": Demand(waiting=10, replicas=1)}).moves == []
    # Steady lag over the threshold is still their work in flight; a queue forming (rising three polls
    # in a row) brings it here too, before it is long.
    assert r.swaps(2.0, {"c": Demand(waiting=60, replicas=1)}).moves == []
    assert r.swaps(2.5, {"c": Demand(waiting=55, replicas=1)}).moves == []
    assert r.swaps(3.0, {"c": Demand(waiting=70, replicas=1)}).moves == []
    assert r.swaps(3.5, {"c": Demand(waiting=90, replicas=1)}).moves == []
    assert r.swaps(4.0, {"c": Demand(waiting=120, replicas=1)}).moves[-1].model == "c"
    # Cold (nobody has it warm): the first record is enough.
    r.register("d", 100 * MB)
    assert r.swaps(5.0, {"d": Demand(waiting=1, replicas=0)}).moves[-1].model == "d"


def test_a_hot_model_idle_between_two_requests_keeps_its_place_against_a_rare_one() -> None:
    r = residency(200, quantum_s=10.0)
    for name in ("hot", "rare1", "rare2"):
        r.register(name, 100 * MB)
    r.initial(0.0)  # hot and rare1 resident
    r.touch("hot", 1.0, 100)
    r.touch("rare1", 1.0, 2)
    # rare2 waits: the slot beside the hot model changes hands, the hot one stays.
    assert [(m.model, m.to) for m in r.swaps(2.0, {"rare2": Demand(waiting=1)}).moves] == [
        ("rare1", Tier.DISK), ("rare2", Tier.DEVICE)]
    # Budget for one: the rare one waits for the hot one's quantum, then takes its turn.
    r2 = residency(100, quantum_s=10.0)
    r2.register("hot", 100 * MB)
    r2.register("rare", 100 * MB)
    r2.initial(0.0)
    r2.touch("hot", 1.0, 100)
    assert r2.swaps(2.0, {"rare": Demand(waiting=1)}).moves == []
    assert [m.model for m in r2.swaps(13.0, {"rare": Demand(waiting=1)}).moves] == ["hot", "rare"]


def test_a_hot_idle_model_is_not_evicted_while_a_cheaper_one_is_busy_for_a_moment() -> None:
    """The slot beside the hot models changes hands: a rare model waits for the cheap one's request to
    finish rather than take the place of a hot model that happens to be idle."""
    r = residency(300, quantum_s=10.0)
    for name in ("hot", "warm", "cheap", "rare"):
        r.register(name, 100 * MB)
    r.initial(0.0)  # hot, warm and cheap resident
    r.touch("hot", 1.0, 240)
    r.touch("warm", 1.0, 80)  # within protect_ratio of rare's claim: it could be evicted when idle
    r.touch("cheap", 1.0, 40)
    r.touch("rare", 1.0, 30)
    busy = {"cheap": Demand(busy=True), "rare": Demand(waiting=1)}
    assert r.swaps(2.0, busy).moves == []  # not warm, though it is idle
    free = {"rare": Demand(waiting=1)}
    assert [(m.model, m.to) for m in r.swaps(2.5, free).moves] == [("cheap", Tier.DISK), ("rare", Tier.DEVICE)]


def test_two_busy_models_drain_together_so_a_large_one_gets_in() -> None:
    """Both must be idle at once to make room: the drain holds every chosen victim, the idle one too."""
    r = residency(200, quantum_s=1.0)
    r.register("a", 100 * MB)
    r.register("b", 100 * MB)
    r.register("w", 200 * MB)
    r.initial(0.0)
    assert r.swaps(0.5, {"a": Demand(9, True), "b": Demand(9, True), "w": Demand(5)}).drain == set()
    assert r.swaps(2.0, {"a": Demand(9, True), "b": Demand(9, True), "w": Demand(5)}).drain == {"a", "b"}
    # a has finished what it held, b has not: a stays drained (it would otherwise fetch again).
    assert r.swaps(2.5, {"a": Demand(9), "b": Demand(9, True), "w": Demand(5)}).drain == {"a", "b"}
    moves = r.swaps(3.0, {"a": Demand(9), "b": Demand(9), "w": Demand(5)}).moves
    assert [m.model for m in moves] == ["a", "b", "w"]


def test_a_failed_move_is_put_back() -> None:
    r = residency(100)
    r.register("a", 100 * MB)
    r.register("b", 100 * MB)
    r.initial(0.0)
    moves = r.swaps(1.0, {"b": Demand(waiting=1)}).moves
    assert r.tier("b") == Tier.DEVICE
    for m in reversed(moves):  # the swap-in failed: neither move stands
        r.place(m.model, m.source, 1.5)
    assert (r.tier("a"), r.tier("b"), r.used(Tier.DEVICE)) == (Tier.DEVICE, Tier.DISK, 100 * MB)


def test_arrivals_count_what_was_written_and_survive_a_topic_missing_from_a_read() -> None:
    r = residency(100, half_life_s=1e9)
    r.register("m", 10 * MB)
    assert r.written("m", 1.0, (5, 100, 7)) == 0  # the first look: a baseline, not a burst
    assert r.written("m", 2.0, (6, 103, 7)) == 4
    assert r.written("m", 3.0, (6, 0, 9)) == 2  # p1's topic missing from this read (an election)
    assert r.written("m", 4.0, (6, 104, 9)) == 1  # back: one new record, not 104
    assert r.value("m", 5.0) == pytest.approx(7)  # what arrived is the model's demand


def test_records_in_kafka_do_not_make_a_resident_model_busy_here() -> None:
    """Lag counts what is fetched and not committed yet (and other workers' queue): a cheap model with
    records there but nothing in this process gives up its room at once."""
    r = residency(200)
    for name in ("hot", "cheap", "rare"):
        r.register(name, 100 * MB)
    r.initial(0.0)
    r.touch("hot", 1.0, 100)
    r.touch("cheap", 1.0, 5)
    r.touch("rare", 1.0, 4)
    plan = r.swaps(2.0, {"cheap": Demand(waiting=2), "rare": Demand(waiting=1)})
    assert [(m.model, m.to) for m in plan.moves] == [("cheap", Tier.DISK), ("rare", Tier.DEVICE)]
