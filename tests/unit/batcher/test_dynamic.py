"""The dynamic batcher, driven by hand-picked cases and by Hypothesis-generated schedules."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kinfer.batcher import Batch, BatchPolicy, DynamicBatcher, Reason, ServicePrior, ServiceTimeModel

FAST = ServicePrior(fixed_s=0.001, per_token_s=0.0, per_input_s=0.0)  # predictions never shed by accident


def make_batcher(prior: ServicePrior = FAST, **policy: object) -> DynamicBatcher[str]:
    return DynamicBatcher(BatchPolicy(**policy), ServiceTimeModel(prior))  # type: ignore[arg-type]


def add(b: DynamicBatcher[str], name: str, now: float, *, priority: int = 1, size: int = 1, longest: int = 10,
        deadline: float = 1e9) -> None:
    b.add(name, priority=priority, size=size, longest=longest, deadline=deadline, now=now)


def names(batch: Batch[str] | None) -> list[str]:
    assert batch is not None
    return batch.payloads


def test_idle_executor_dispatches_at_once() -> None:
    b = make_batcher(max_wait_ms=100)
    add(b, "a", now=0.0)
    assert names(b.next_batch(0.0)) == ["a"]  # no waiting for company
    assert b.next_batch(0.0) is None


def test_window_mode_waits_even_when_idle() -> None:
    b = make_batcher(mode="window", max_batch_size=4, max_wait_ms=100)
    add(b, "a", now=0.0)
    assert b.next_batch(0.05) is None  # the naive window sits it out
    assert b.wake_at(0.05, idle=True) == pytest.approx(0.1)
    assert b.wake_at(0.05, idle=False) == pytest.approx(1e9 - 0.001)  # busy: the seal cannot start anyway
    assert names(b.next_batch(0.1)) == ["a"]


def test_priorities_first_then_arrival() -> None:
    b = make_batcher(max_batch_size=3)
    add(b, "p2-old", 0.0, priority=2)
    add(b, "p1", 0.01, priority=1)
    add(b, "p0-a", 0.02, priority=0)
    add(b, "p0-b", 0.03, priority=0)
    assert names(b.next_batch(0.03)) == ["p0-a", "p0-b", "p1"]
    assert names(b.next_batch(0.03)) == ["p2-old"]


def test_aging_lets_old_low_priority_work_through() -> None:
    b = make_batcher(max_batch_size=1, aging_ms=100)
    add(b, "p2-old", 0.0, priority=2)
    add(b, "p0-new", 0.25, priority=0)
    # p2-old waited 250 ms: two levels up, level 0, and older than p0-new.
    assert names(b.next_batch(0.25)) == ["p2-old"]


def test_token_budget_counts_padding() -> None:
    b = make_batcher(max_batch_size=32, max_batch_tokens=400, max_padding_ratio=100)
    add(b, "short-1", 0.0, longest=10)
    add(b, "short-2", 0.0, longest=10)
    add(b, "long", 0.0, longest=150)  # 3 × 150 = 450 padded tokens > 400
    add(b, "short-3", 0.0, longest=10)
    first = b.next_batch(0.0)
    assert names(first) == ["short-1", "short-2", "short-3"]  # the long one waits for a batch of its own
    assert first is not None and first.padded_tokens == 30
    assert names(b.next_batch(0.0)) == ["long"]


CPU = ServicePrior(fixed_s=0.004, per_token_s=0.0002)  # cost follows padded tokens
GPU = ServicePrior(fixed_s=0.015, per_token_s=0.000001)  # a large fixed cost per batch


def test_gpu_like_costs_batch_everything_together() -> None:
    b = make_batcher(GPU, max_batch_size=8)
    for i, n in enumerate([20, 120, 22, 110, 25, 115]):
        add(b, f"len{n}", i * 0.001, longest=n)
    assert names(b.next_batch(0.01)) == ["len20", "len120", "len22", "len110", "len25", "len115"]


def test_a_batch_may_be_capped_in_predicted_duration() -> None:
    # A backlog under a large fixed cost (30 ms + 5 ms an input) batches nearly all of itself;
    # capped at 45 ms, three inputs fit; and the first request always goes, however long it takes.
    prior = ServicePrior(fixed_s=0.030, per_token_s=0.0, per_input_s=0.005)

    def backlog() -> DynamicBatcher[str]:
        b = make_batcher(prior, max_batch_size=32)
        for i in range(10):
            add(b, f"r{i}", i * 0.001)
        return b

    assert len(names(backlog().next_batch(0.02))) >= 9
    assert len(names(backlog().next_batch(0.02, max_batch_s=0.045))) == 3
    assert len(names(backlog().next_batch(0.02, max_batch_s=0.001))) == 1


def test_cpu_like_costs_batch_only_similar_lengths_and_only_under_backlog() -> None:
    light = make_batcher(CPU, max_batch_size=8)
    add(light, "a", 0.0, longest=30)
    add(light, "b", 0.0, longest=30)
    # Two requests: batching saves 4 ms of overhead but delays "a" by all of "b"'s tokens.
    assert names(light.next_batch(0.0)) == ["a"]

    backlog = make_batcher(CPU, max_batch_size=8)
    for i in range(30):
        add(backlog, f"short{i}", 0.0, longest=30)
    add(backlog, "long", 0.0, longest=200)
    batch = backlog.next_batch(0.0)
    assert batch is not None and len(batch.items) > 1  # a backlog makes the overhead worth saving
    assert "long" not in names(batch) and batch.padding_ratio == 1.0


def test_padding_cap_holds_whatever_the_cost_model_says() -> None:
    b = make_batcher(ServicePrior(fixed_s=0.015, per_token_s=0.0), max_padding_ratio=1.5)
    add(b, "short", 0.0, longest=10)
    add(b, "long", 0.0, longest=100)
    assert names(b.next_batch(0.0)) == ["short"]


def test_skipped_higher_priority_closes_the_batch_to_lower_ones() -> None:
    b = make_batcher(GPU, max_batch_size=8, max_padding_ratio=1.5)
    add(b, "p0-short", 0.0, priority=0, longest=10)
    add(b, "p0-long", 0.0, priority=0, longest=200)
    add(b, "p2-short", 0.0, priority=2, longest=10)
    # p2-short would fit by length, but must not overtake p0-long.
    assert names(b.next_batch(0.0)) == ["p0-short"]
    assert names(b.next_batch(0.0)) == ["p0-long"]


def test_oversized_request_runs_alone() -> None:
    b = make_batcher(max_batch_size=4, max_batch_tokens=100)
    add(b, "huge", 0.0, size=10, longest=50)
    add(b, "next", 0.0)
    assert names(b.next_batch(0.0)) == ["huge"]  # counts as full
    assert names(b.next_batch(0.0)) == ["next"]


def test_deadline_aware_shedding_refuses_what_cannot_finish() -> None:
    b = make_batcher(ServicePrior(fixed_s=0.05, per_token_s=0.0))
    add(b, "gone", 0.0, deadline=0.5)
    add(b, "hopeless", 0.0, deadline=1.2)  # executor free at 1.2: 1.2 + 0.05 > 1.2
    add(b, "fine", 0.0, deadline=5.0)
    dropped = b.shed(0.6, free_at=1.2)
    assert [(d.pending.payload, d.reason) for d in dropped] == [("gone", Reason.EXPIRED), ("hopeless", Reason.DEADLINE)]
    assert [p.payload for p in b] == ["fine"]
    # The batcher says when to look again: when "fine" could no longer make it.
    assert b.wake_at(0.6, idle=True) == pytest.approx(4.95)


def test_codel_sheds_only_after_a_standing_queue_persists_and_only_what_it_would_make_late() -> None:
    """A standing queue for a whole interval starts the shedding; each shed takes, of the requests the queue
    ahead of them would make late (served in rank order, one 100 ms batch each), the lowest priority first.
    What the queue still serves in time stays, however long CoDel goes on seeing the standing queue."""
    b = make_batcher(ServicePrior(fixed_s=0.1, per_token_s=0.0, per_input_s=0.0, strength=1e9),
                     codel_target_ms=50, codel_interval_ms=100, max_batch_size=1)
    add(b, "p0", 0.0, priority=0, deadline=10.0)
    add(b, "p1", 0.0, priority=1, deadline=10.0)
    add(b, "p2-old", 0.0, priority=2, deadline=0.5)
    add(b, "p2-new", 0.01, priority=2, deadline=0.5)
    assert b.shed(0.06) == []  # above target, but not yet for a whole interval
    assert b.shed(0.12) == []
    # Above target for 100 ms. From 0.17: p0 ends at 0.27, p1 at 0.37, p2-old at 0.47 (in time), p2-new
    # at 0.57, past its deadline: it goes, though alone it would still fit.
    dropped = b.shed(0.17)
    assert [(d.pending.payload, d.reason) for d in dropped] == [("p2-new", Reason.CODEL)]
    assert b.shedding
    assert [d.pending.payload for d in b.shed(0.3)] == ["p2-old"]  # from 0.3 it would end at 0.6
    for t in (0.5, 0.9, 2.0):  # p0 and p1 make their deadlines behind any queue left: never shed
        assert b.shed(t) == []
    assert b.shedding  # the standing queue is still there (nothing was served)
    assert names(b.next_batch(2.0)) == ["p0"]


def test_a_short_standing_queue_that_drains_in_time_costs_no_request() -> None:
    """A worker stalled for a moment (a starved box) finds 13 requests waiting, with 600 ms or more left
    each: a standing queue by CoDel's measure, interval after interval, and four batches of 25 ms to serve
    it. Nothing is shed. A queue that outgrows the deadlines is cut at its tail, before the tail expires."""
    b = make_batcher(ServicePrior(fixed_s=0.025, per_token_s=0.0, per_input_s=0.0, strength=1e9),
                     codel_target_ms=50, codel_interval_ms=500, max_batch_size=4)
    for i in range(13):
        add(b, f"r{i}", 0.0, deadline=1.5)
    for t in (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
        assert b.shed(t) == []
    assert b.shedding  # CoDel sees the standing queue, and sheds none of it
    for i in range(13, 80):  # the queue outgrows the deadlines: 80 requests are 20 batches, 0.5 s
        add(b, f"r{i}", 0.9, deadline=1.5)
    dropped = b.shed(1.2)  # CoDel's next drop: from 1.2, the 13th batch (r48-r51) on ends past 1.5
    assert [(d.pending.payload, d.reason) for d in dropped] == [("r48", Reason.CODEL)]
    assert 1.2 + 0.025 < 1.5  # alone it would still fit: the deadline check would have let it wait to expire


def test_codel_sees_only_the_queue_a_batch_drains_not_the_time_before_it() -> None:
    """Requests that come late (a slow broker, a starved box) but are served as they come form no standing
    queue: shedding them would make nothing faster. Requests this worker does not serve as fast as they come
    do, and CoDel sheds them, however recently they were written."""
    b = make_batcher(codel_target_ms=50, codel_interval_ms=100, max_batch_size=1)
    now = 0.0
    for i in range(40):  # one every 20 ms, each served within 30 ms of its arrival
        add(b, f"late-{i}", now, priority=2)
        assert b.shed(now + 0.03) == []
        assert names(b.next_batch(now + 0.03)) == [f"late-{i}"]
        now += 0.02
    assert not b.shedding
    for i in range(20):  # now one every 20 ms, served one every 40 ms: a queue builds here
        add(b, f"behind-{i}", now, priority=2)
        b.shed(now)
        if i % 2:
            b.next_batch(now)
        now += 0.02
    assert b.shedding


def test_remove_and_per_priority_accounting() -> None:
    b = make_batcher()
    add(b, "keep", 0.0, priority=0, size=3)
    add(b, "other-partition", 0.0, priority=2, size=2)
    assert b.pending_inputs_at(2) == 2
    assert [p.payload for p in b.remove(lambda p: p.payload.startswith("other"))] == ["other-partition"]
    assert b.pending_inputs == 3 and b.pending_inputs_at(0) == 3 and b.pending_inputs_at(2) == 0


def test_policy_validation_names_the_value() -> None:
    with pytest.raises(ValueError, match="max_wait_ms"):
        BatchPolicy(max_wait_ms=150)
    with pytest.raises(ValueError, match="max_batch_size"):
        BatchPolicy(max_batch_size=0)
    with pytest.raises(ValueError, match="mode"):
        BatchPolicy(mode="greedy")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Property tests: random arrival schedules against the invariants the worker relies on.


@dataclass(frozen=True)
class Arrival:
    at: float
    priority: int
    size: int
    longest: int
    ttl: float


arrivals = st.lists(
    st.builds(
        Arrival,
        at=st.floats(0, 1.0),
        priority=st.integers(0, 2),
        size=st.integers(1, 6),
        longest=st.integers(1, 300),
        ttl=st.floats(0.001, 2.0),
    ),
    max_size=60,
)
policies = st.builds(
    BatchPolicy,
    max_batch_size=st.integers(1, 16),
    max_batch_tokens=st.integers(1, 2000),
    max_wait_ms=st.floats(0, 100),
    mode=st.sampled_from(["dynamic", "window"]),
    aging_ms=st.sampled_from([50.0, 250.0, math.inf]),
    max_padding_ratio=st.floats(1.0, 4.0),
    codel_target_ms=st.floats(5, 100),
    codel_interval_ms=st.floats(20, 500),
)


@settings(max_examples=300, deadline=None)
@given(arrivals=arrivals, policy=policies, per_token_s=st.floats(0.0, 0.0005), fixed_s=st.floats(0.001, 0.1))
def test_invariants_under_random_schedules(
    arrivals: list[Arrival], policy: BatchPolicy, per_token_s: float, fixed_s: float
) -> None:
    """Simulate a one-executor worker; check every step against the batcher's promises."""
    b: DynamicBatcher[int] = DynamicBatcher(policy, ServiceTimeModel(ServicePrior(0.005, 0.0001)))
    pending = sorted(enumerate(arrivals), key=lambda ia: ia[1].at)
    outcome: dict[int, str] = {}
    busy_until = 0.0
    now = 0.0
    aging_s = policy.aging_ms / 1000
    for _ in range(10_000):
        if not pending and not len(b):
            break
        # Advance to the next interesting time: an arrival, the executor freeing, or a batcher wake-up.
        idle = now >= busy_until
        candidates = [pending[0][1].at] if pending else []
        if busy_until > now:
            candidates.append(busy_until)
        wake = b.wake_at(now, idle=idle)
        if wake is not None:
            candidates.append(wake)
        later = [t for t in candidates if t > now]
        now = min(later) if later else now + 0.001
        while pending and pending[0][1].at <= now:
            i, a = pending.pop(0)
            b.add(i, priority=a.priority, size=a.size, longest=a.longest, deadline=a.at + a.ttl, now=a.at)
        idle = now >= busy_until
        for d in b.shed(now, free_at=max(now, busy_until)):
            assert d.pending.payload not in outcome  # one terminal state each
            outcome[d.pending.payload] = d.reason.value
            if d.reason is Reason.EXPIRED:
                assert d.pending.deadline <= now
            if d.reason is Reason.CODEL:
                assert d.pending.priority >= policy.codel_min_priority
        if not idle:
            continue  # one executor: nothing starts while it is busy
        queued = list(b)
        batch = b.next_batch(now)
        if policy.mode == "dynamic" and queued:
            assert batch is not None  # work-conserving: an idle executor never waits
        if batch is None:
            # Only the naive window may hold work back, and never past its ceiling.
            assert all(now - p.arrival < policy.max_wait_ms / 1000 + 1e-9 for p in queued)
            continue
        if len(batch.items) > 1:  # limits hold, unless one request alone is bigger than them
            assert batch.size <= policy.max_batch_size
            assert batch.padded_tokens <= policy.max_batch_tokens
            assert batch.padded_tokens <= policy.max_padding_ratio * batch.real_tokens + 1e-9
        # Priority (as aged): nothing left behind has a better level than anything taken.
        worst_taken = max(p.level(now, aging_s) for p in batch.items)
        assert all(p.level(now, aging_s) >= worst_taken for p in b)
        for p in batch.items:
            assert p.payload not in outcome  # never both dispatched and shed, never twice
            outcome[p.payload] = "dispatched"
        took = fixed_s + per_token_s * batch.padded_tokens
        b.observe(batch, took)
        busy_until = now + took
    # Every request ended in exactly one terminal state.
    assert set(outcome) == set(range(len(arrivals)))
    assert b.pending_inputs == 0


# ---------------------------------------------------------------------------------------------
# The service-time model


def test_service_model_learns_a_linear_cost() -> None:
    model = ServiceTimeModel()
    for tokens, inputs in [(100, 1), (800, 8), (3200, 32), (1600, 16), (400, 4)] * 30:
        model.observe(tokens, inputs, 0.004 + 0.00002 * tokens)
    assert model.predict(2000, 20) == pytest.approx(0.004 + 0.00002 * 2000, rel=0.02)
    assert model.predict(0, 0) > 0


def _steady(model: ServiceTimeModel, rng: random.Random, batches: int, seconds: float) -> None:
    """Batches of 1-4 short inputs, each taking ``seconds`` (+ up to 12 %)."""
    for _ in range(batches):
        n = rng.randint(1, 4)
        model.observe(n * rng.randint(8, 20), n, seconds * (1.0 + rng.uniform(0.0, 0.12)))


def test_one_batch_that_measured_a_stalled_process_does_not_lock_requests_out() -> None:
    """A worker SIGSTOPped for 9 s mid-batch: that batch measures 9 s. Fed whole, it tilted the fit to 0.09 s
    for one request and 0.31 s for four (from 0.026), and a worker then refused by DEADLINE whatever had
    less left. Capped, it moves the prediction by a few per cent, and a request with 0.2 s left runs."""
    rng = random.Random(1)
    model = ServiceTimeModel()
    _steady(model, rng, 300, 0.025)
    before = [model.predict(t, n) for t, n in ((10, 1), (40, 4), (80, 4))]
    model.observe(48, 3, 9.0)
    after = [model.predict(t, n) for t, n in ((10, 1), (40, 4), (80, 4))]
    assert all(a <= 1.25 * b for a, b in zip(after, before, strict=True)), (before, after)
    b: DynamicBatcher[str] = DynamicBatcher(BatchPolicy(), model)
    add(b, "fresh", 100.0, deadline=100.2)
    assert b.shed(100.0, free_at=100.0) == []
    assert names(b.next_batch(100.0)) == ["fresh"]


def test_service_model_still_follows_a_device_that_really_became_slower() -> None:
    """The same batches fed to the model and to one without the cap: a device twice as slow is followed
    alike; ten times as slow, the capped model lags, then catches up."""

    def fed(slower: float, batches: int, outlier: float) -> float:
        model = ServiceTimeModel(outlier=outlier)
        rng = random.Random(2)
        _steady(model, rng, 300, 0.025)
        _steady(model, rng, batches, 0.025 * slower)
        return model.predict(40, 4)

    assert fed(2.0, 20, 4.0) == fed(2.0, 20, math.inf) > 0.03
    assert fed(10.0, 60, 4.0) >= 0.6 * fed(10.0, 60, math.inf)
    assert fed(10.0, 200, 4.0) == pytest.approx(fed(10.0, 200, math.inf), rel=0.1)


@given(st.lists(st.tuples(st.integers(1, 8192), st.integers(1, 64), st.floats(0.0001, 1.0)), min_size=1, max_size=50))
def test_service_model_never_predicts_below_what_it_has_seen(obs: list[tuple[int, int, float]]) -> None:
    model = ServiceTimeModel()
    for tokens, inputs, seconds in obs:
        model.observe(tokens, inputs, seconds)
    floor = min(s for _, _, s in obs)
    assert all(model.predict(t, i) >= floor for t, i, _ in obs)


@settings(max_examples=200, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.integers(1, 8), st.integers(1, 400), st.floats(0.0, 2.0), st.floats(0.0, 1.0)),
        min_size=1, max_size=60,
    ),
    observed=st.lists(st.tuples(st.integers(1, 3000), st.integers(1, 32), st.floats(0.0, 0.5)), max_size=6),
    takes=st.integers(0, 3),
    at=st.floats(0.0, 2.5),
    busy_for=st.floats(0.0, 0.5),
)
def test_shed_and_wake_at_look_only_near_the_front_yet_agree_with_a_full_scan(
    requests: list[tuple[int, int, float, float]], observed: list[tuple[int, int, float]], takes: int, at: float,
    busy_for: float,
) -> None:
    """The heap-based shortcuts decide exactly what a scan of the whole queue would."""
    b = make_batcher(ServicePrior(fixed_s=0.01, per_token_s=0.0001, per_input_s=0.001), codel_target_ms=math.inf,
                     max_batch_size=4)
    for tokens, size, seconds in observed:
        b.service.observe(tokens, size, seconds)
    for i, (size, longest, deadline, arrival) in enumerate(sorted(requests, key=lambda r: r[3])):
        add(b, f"r{i}", now=arrival, size=size, longest=longest, deadline=deadline)
    for _ in range(takes):  # some leave in batches, so the heaps hold stale entries
        b.next_batch(1.0)
    queued = list(b)
    if not queued:
        return
    now, free_at = 1.0 + at, 1.0 + at + busy_for
    expected_wake = min(p.deadline - b.predict([p]) for p in queued)
    assert b.wake_at(now, idle=True) == max(now, expected_wake)
    expected = {p.payload for p in queued if p.deadline <= now or free_at + b.predict([p]) > p.deadline}
    assert {d.pending.payload for d in b.shed(now, free_at=free_at)} == expected
    assert {p.payload for p in b} == {p.payload for p in queued} - expected


def test_a_model_fitted_at_batch_one_alone_still_finds_out_that_batching_pays() -> None:
    """Seen in the fleet simulator: a few small batches, then hundreds at batch one, all of one
    length, teach the service model one point along the only direction it ever sees; the rest of the
    fit is the prior's (CPU-like: 50 us a token), so it predicts a batch of two at twice a batch of
    one, no request ever 'pays' to join, batches stay at one under any backlog, and the model never
    sees the point that would correct it. On a device where a batch of 64 costs four times a batch
    of one (a GPU), a backlog must grow the batches within a few dozen of them."""
    def true_ms(n: int) -> float:
        return 1.5 + 0.08 * n

    b: DynamicBatcher[int] = DynamicBatcher(BatchPolicy(max_batch_size=64, max_batch_tokens=10**9))
    now = 0.0
    warm = [1] * 3 + [2] * 5 + [3] * 4 + [1] * 300  # the worker's first seconds, then low load
    for i, size in enumerate(warm):
        b.add(i, priority=1, size=1, longest=32, deadline=now + 10, now=now)
        batch = b.next_batch(now)
        assert batch is not None
        b.service.observe(32 * size, size, true_ms(size) / 1000.0 * (1 + 0.02 * ((i % 7) - 3) / 3))
        now += 0.01
    for i in range(4000):  # a step: a backlog forms
        b.add(10_000 + i, priority=1, size=1, longest=32, deadline=now + 60, now=now)
    sizes = []
    for _ in range(60):
        batch = b.next_batch(now)
        assert batch is not None
        sizes.append(batch.size)
        b.observe(batch, true_ms(batch.size) / 1000.0)
        now += true_ms(batch.size) / 1000.0
    assert max(sizes[-10:]) == 64, sizes
