"""The continuous (iteration-level) scheduler, without a model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kinfer.batcher import ContinuousScheduler, Finish, GenPolicy, Sequence


def seq(sid: str, prompt: int = 10, new: int = 5, **kw: float) -> Sequence:
    return Sequence(sid, prompt_tokens=prompt, max_new_tokens=new, **kw)  # type: ignore[arg-type]


def run_step(s: ContinuousScheduler, now: float, lengths: dict[str, int]) -> list[str]:
    """One step: everybody in the plan makes a token; those at their length finish. Returns finished ids."""
    plan = s.schedule(now)
    done = []
    for x in plan.admit + plan.decode:
        s.advance(x.id)
        if x.generated >= lengths[x.id]:
            s.finish(x.id)
            done.append(x.id)
    return done


def test_a_short_request_joins_mid_flight_and_leaves_first() -> None:
    s = ContinuousScheduler(GenPolicy(max_running=4))
    s.add(seq("long", new=100))
    lengths = {"long": 100, "short": 3}
    for t in range(10):
        run_step(s, t, lengths)
    s.add(seq("short", new=3))
    finished_at = {}
    for t in range(10, 200):
        for sid in run_step(s, t, lengths):
            finished_at[sid] = t
        if not s.has_work():
            break
    assert finished_at["short"] == 12  # admitted at the next step boundary, three steps later gone
    assert finished_at["long"] == 99
    assert s.steps == 100  # one step each: the short one never added a step of its own


def test_static_baseline_admits_only_into_an_empty_batch() -> None:
    s = ContinuousScheduler(GenPolicy(mode="static", max_running=4))
    s.add(seq("long", new=100))
    lengths = {"long": 100, "short": 3}
    run_step(s, 0, lengths)
    s.add(seq("short", new=3))
    finished_at = {}
    for t in range(1, 200):
        for sid in run_step(s, t, lengths):
            finished_at[sid] = t
    assert finished_at == {"long": 99, "short": 102}  # the short one waited for the long one


def test_kv_budget_queues_newcomers_and_never_preempts() -> None:
    s = ContinuousScheduler(GenPolicy(max_running=8, kv_budget_tokens=100))
    s.add(seq("a", prompt=40, new=20))  # reserves 60
    s.add(seq("b", prompt=30, new=20))  # 50: would exceed 100
    plan = s.schedule(0)
    assert [x.id for x in plan.admit] == ["a"]
    assert s.kv_reserved == 60 and [x.id for x in s.waiting] == ["b"]
    s.advance("a", 20)
    s.finish("a")
    assert [x.id for x in s.schedule(1).admit] == ["b"]


def test_cancel_frees_the_slot_and_reservation_at_the_next_step() -> None:
    s = ContinuousScheduler(GenPolicy(max_running=1, kv_budget_tokens=1000))
    s.add(seq("streaming", new=500))
    s.add(seq("next"))
    s.schedule(0)
    assert s.kv_reserved == 510
    assert s.cancel("streaming")
    plan = s.schedule(1)
    assert [(x.id, why) for x, why in plan.evict] == [("streaming", Finish.CANCELLED)]
    assert [x.id for x in plan.admit] == ["next"]
    assert s.kv_reserved == 15
    assert not s.cancel("streaming")  # already gone


def test_deadlines_and_impossible_requests_leave_with_a_reason() -> None:
    s = ContinuousScheduler(GenPolicy(kv_budget_tokens=50))
    s.add(seq("late", deadline=1.0))
    s.add(seq("huge", prompt=40, new=40))
    s.add(seq("ok"))
    plan = s.schedule(2.0)
    assert sorted((x.id, why) for x, why in plan.evict) == [("huge", Finish.TOO_LARGE), ("late", Finish.DEADLINE)]
    assert [x.id for x in plan.admit] == ["ok"]


def test_prefill_cap_and_priorities() -> None:
    s = ContinuousScheduler(GenPolicy(max_prefill_tokens=100))
    s.add(seq("p2", prompt=60, priority=2))
    s.add(seq("p0-a", prompt=60, priority=0))
    s.add(seq("p0-b", prompt=60, priority=0))
    assert [x.id for x in s.schedule(0).admit] == ["p0-a"]  # a second 60-token prefill would exceed 100
    assert [x.id for x in s.schedule(0).admit] == ["p0-b"]
    assert [x.id for x in s.schedule(0).admit] == ["p2"]


def test_validation() -> None:
    with pytest.raises(ValueError, match="max_running"):
        GenPolicy(max_running=0)
    s = ContinuousScheduler()
    s.add(seq("x"))
    with pytest.raises(ValueError, match="already"):
        s.add(seq("x"))


@settings(max_examples=200, deadline=None)
@given(
    reqs=st.lists(
        st.tuples(st.integers(0, 30), st.integers(1, 64), st.integers(1, 40), st.integers(1, 40), st.booleans()),
        min_size=1, max_size=30,
    ),
    max_running=st.integers(1, 8),
    budget=st.integers(20, 400),
)
def test_invariants(reqs: list[tuple[int, int, int, int, bool]], max_running: int, budget: int) -> None:
    """Random arrivals, lengths and cancellations: limits hold and every sequence ends exactly once."""
    s = ContinuousScheduler(GenPolicy(max_running=max_running, kv_budget_tokens=budget, max_prefill_tokens=64))
    lengths: dict[str, int] = {}
    ended: dict[str, str] = {}
    pending = sorted(enumerate(reqs), key=lambda r: r[1][0])
    for step in range(2_000):
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, new, actual, cancel) = pending.pop(0)
            sid = f"r{i}"
            lengths[sid] = min(actual, new)
            s.add(seq(sid, prompt=prompt, new=new))
            if cancel:
                s.cancel(sid)
        plan = s.schedule(float(step))
        for x, why in plan.evict:
            assert x.id not in ended
            ended[x.id] = why.value
        assert len(s.running) <= max_running
        assert s.kv_reserved <= budget
        for x in plan.admit + plan.decode:
            s.advance(x.id)
            if x.generated >= lengths[x.id]:
                s.finish(x.id)
                assert x.id not in ended
                ended[x.id] = "done"
        if not pending and not s.has_work():
            break
    assert set(ended) == set(lengths)
