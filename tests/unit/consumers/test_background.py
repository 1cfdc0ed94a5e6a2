"""The background tier (p3) in the engine cores and the schedulers, driven by hand (no clock, no Kafka).

What it promises: background work runs only when nothing interactive waits, one slice at a time, so an
interactive request that arrives meanwhile waits for at most the slice running; it is never shed for
load (CoDel, deadline feasibility of a standing queue), only refused once its completion window has
passed; and in generation it holds at most its share of the running slots and of the KV budget.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kinfer.batcher import BatchPolicy, BusyShare, ContinuousScheduler, Finish, GenPolicy, Sequence
from kinfer.topics import Priority, Result, Status
from tests.unit.consumers.test_cores import FAR, T0, batch_core, drain_batches, execute, gen_core, job, request

BG = Priority.P3


def test_background_waits_while_anything_interactive_does_and_runs_in_slices() -> None:
    core, runner, _ = batch_core(BatchPolicy(max_batch_size=4, background_slice_ms=1_000.0))
    for i in range(10):
        core.admit(job(request(f"b{i}", (f"b{i}",), priority=BG)), T0)
    for i in range(6):
        core.admit(job(request(f"i{i}", (f"i{i}",), priority=Priority.P2)), T0)
    replies = drain_batches(core, T0)
    assert all(isinstance(r.message, Result) and r.message.status is Status.OK for r in replies)
    kinds = ["".join(sorted({t[0] for t in call})) for call in runner.calls]
    assert kinds == ["i", "i", "b", "b", "b"]  # never mixed; interactive first; background in batches of <= 4
    assert max(len(c) for c in runner.calls) == 4
    assert core.background_buffered() == 0 and core.buffered() == 0


def test_an_interactive_arrival_waits_for_the_slice_running_and_no_more() -> None:
    core, runner, _ = batch_core(BatchPolicy(max_batch_size=2))
    for i in range(8):
        core.admit(job(request(f"b{i}", (f"b{i}",), priority=BG)), T0)
    plan = core.next(T0)
    assert plan.work is not None and core.background_buffered() == 6
    core.admit(job(request("urgent", ("urgent",), priority=Priority.P0)), T0)  # while the slice runs
    core.complete(plan.work, execute(plan.work, T0))
    after = core.next(T0 + 0.01)
    assert after.work is not None and after.work.call().answers[0][0] == ["out(urgent)"]
    assert runner.calls[-1] == ["urgent"]


def test_a_slice_is_bounded_by_its_predicted_time() -> None:
    core, runner, _ = batch_core(BatchPolicy(max_batch_size=64, background_slice_ms=30.0))
    for _ in range(20):  # teach the service-time model: 10 ms an input, nothing fixed
        for size in range(1, 9):
            core.batcher.service.observe(size * runner.count_tokens("b10"), size, 0.01 * size)
    for i in range(20):
        core.admit(job(request(f"b{i}", (f"b{i}",), priority=BG)), T0)
    drain_batches(core, T0)
    assert max(len(c) for c in runner.calls) <= 4  # about 30 ms of work a slice, never the 20 at once


def test_background_is_never_shed_for_load_only_when_its_window_has_passed() -> None:
    core, _, observer = batch_core(BatchPolicy(max_batch_size=1, codel_target_ms=1.0, codel_interval_ms=1.0))
    for i in range(20):  # a standing queue of background work, hours old: CoDel would shed interactive work
        core.admit(job(request(f"b{i}", (f"b{i}",), priority=BG), queue_ms=7_200_000.0, deadline=FAR), T0)
    core.admit(job(request("late", ("late",), priority=BG), deadline=T0 + 0.5), T0)
    now = T0 + 10.0
    refused = core.shed(now, now)
    assert [r.message.id for r in refused] == ["late"] and refused[0].message.status is Status.EXPIRED
    assert observer.of("shed") == [("m", BG, "expired")]
    replies = drain_batches(core, now)
    assert sorted(r.message.id for r in replies) == sorted(f"b{i}" for i in range(20))
    assert all(r.message.status is Status.OK for r in replies)


def test_revoked_partitions_take_their_background_work_with_them() -> None:
    core, _, _ = batch_core()
    core.admit(job(request("b0", priority=BG), partition="p3-0"), T0)
    core.admit(job(request("b1", priority=BG), partition="p3-1"), T0)
    assert core.revoke({"p3-0"}) == 1 and core.background_buffered() == 1


def test_generation_keeps_background_to_its_share_and_an_interactive_arrival_joins_at_the_next_step() -> None:
    core, runner, _ = gen_core(GenPolicy(max_running=4, kv_budget_tokens=4_000, background_share=0.5))
    for i in range(6):
        core.admit(job(request(f"b{i}", ("x" * 30,), priority=BG, params={"max_new_tokens": 50})), T0)
    plan = core.next(T0)
    assert plan.work is not None
    execute(plan.work, T0)
    assert sorted(runner.rows) == ["b0", "b1"]  # half the slots
    assert core.background_room() == 4 and core.background_buffered() == 4
    core.admit(job(request("i0", ("hello",), priority=Priority.P1, params={"max_new_tokens": 5})), T0)
    plan = core.next(T0 + 0.01)
    assert plan.work is not None
    execute(plan.work, T0 + 0.01)
    assert runner.steps[-1][0] == ["i0"]  # the very next step


@settings(max_examples=200, deadline=None)
@given(
    arrivals=st.lists(st.tuples(st.booleans(), st.integers(1, 60), st.integers(1, 40)), min_size=1, max_size=40),
    max_running=st.integers(2, 8),
    share=st.sampled_from([0.25, 0.5, 0.75]),
)
def test_the_scheduler_never_lets_background_take_more_than_its_share(
    arrivals: list[tuple[bool, int, int]], max_running: int, share: float
) -> None:
    policy = GenPolicy(max_running=max_running, kv_budget_tokens=400, background_share=share)
    sched = ContinuousScheduler(policy)
    for i, (background, prompt, new) in enumerate(arrivals):
        sched.add(Sequence(f"s{i}", prompt, new, priority=3 if background else 1, arrival=float(i)))
        step = sched.schedule(float(i))
        bg = [s for s in sched.running if s.priority >= 3]
        assert len(bg) <= int(max_running * share)
        assert sum(s.reserved for s in bg) <= 400 * share
        for s, why in step.evict:  # only a background request larger than its share is refused
            assert why is Finish.TOO_LARGE and (s.reserved > 400 or (s.priority >= 3 and s.reserved > 400 * share))
        # An interactive sequence waits only while the interactive work ahead of it fills the batch.
        waiting = [s for s in sched.waiting if s.priority < 3]
        if waiting:
            interactive = [s for s in sched.running if s.priority < 3]
            assert interactive, "an interactive request waits behind background work alone"
        for s in list(sched.running):
            sched.finish(s.id)


def test_the_wait_for_a_slice_is_reported_from_the_first_arrival_to_the_slice_end() -> None:
    core, _, observer = batch_core(BatchPolicy(max_batch_size=2))
    calls: list[float] = []
    observer.behind_background = lambda model, seconds: calls.append(seconds)  # type: ignore[method-assign]
    for i in range(4):
        core.admit(job(request(f"b{i}", (f"b{i}",), priority=BG)), T0)
    plan = core.next(T0)
    assert plan.work is not None
    core.admit(job(request("i0", ("i0",), priority=Priority.P0)), T0 + 0.005)  # came 5 ms into the slice
    core.admit(job(request("i1", ("i1",), priority=Priority.P0)), T0 + 0.008)
    core.complete(plan.work, execute(plan.work, T0, took_s=0.02))
    assert calls == [pytest.approx(0.015)]  # the first to come waited 15 ms for the 20 ms slice to end
    plan = core.next(T0 + 0.02)  # interactive now: nothing more is reported for it
    assert plan.work is not None
    core.complete(plan.work, execute(plan.work, T0 + 0.02))
    assert len(calls) == 1


def test_near_the_peak_background_work_waits_until_interactive_load_eases() -> None:
    core, _, _ = batch_core(BatchPolicy(max_batch_size=4, background_max_busy=0.8))
    now = T0
    for i in range(60):  # interactive work back to back for 6 s: the executor busy all the time
        core.admit(job(request(f"i{i}", (f"i{i}",))), now)
        plan = core.next(now)
        assert plan.work is not None
        core.complete(plan.work, execute(plan.work, now, took_s=0.1))
        now += 0.1
    core.admit(job(request("b0", ("b0",), priority=BG)), now)
    assert not core.background_allowed(now) and core.next(now).work is None
    assert core.wake_at(now, idle=True) == pytest.approx(now + 0.1)  # it looks again
    later = now + 3.0  # the load eased: three seconds with nothing interactive
    assert core.background_allowed(later)
    plan = core.next(later)
    assert plan.work is not None and plan.work.call().answers[0][0] == ["out(b0)"]


def test_the_busy_share_is_an_average_over_the_last_seconds() -> None:
    share = BusyShare(tau_s=2.0)
    assert share.share(0.0) == 0.0
    for i in range(200):  # half of every second computing, for 20 s
        share.add(i * 0.1 + 0.05, 0.05)
    assert share.share(19.95) == pytest.approx(0.5, rel=0.1)
    assert share.share(19.95 + 10.0) < 0.01
