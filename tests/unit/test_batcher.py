"""The dynamic batcher, driven by hand-picked cases and by Hypothesis-generated schedules."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batcher import Batch, BatchPolicy, DynamicBatcher


def make_batcher(**policy: float) -> DynamicBatcher[str]:
    return DynamicBatcher(BatchPolicy(**policy))  # type: ignore[arg-type]


def add(b: DynamicBatcher[str], name: str, now: float, *, priority: int = 1, size: int = 1, longest: int = 10,
        deadline: float = 1e9) -> None:
    b.add(name, priority=priority, size=size, longest=longest, deadline=deadline, now=now)


def names(batch: Batch[str] | None) -> list[str]:
    assert batch is not None
    return batch.payloads


def test_idle_executor_dispatches_at_once() -> None:
    b = make_batcher(max_wait_ms=100)
    add(b, "a", now=0.0)
    assert names(b.next_batch(0.0, idle=True)) == ["a"]  # no waiting for company
    assert b.next_batch(0.0, idle=True) is None


def test_busy_executor_seals_when_full_or_at_the_ceiling() -> None:
    b = make_batcher(max_batch_size=3, max_wait_ms=50)
    add(b, "a", now=0.0)
    add(b, "b", now=0.01)
    assert b.next_batch(0.02, idle=False) is None  # open: not full, oldest waited 20 ms
    assert b.wake_at() == pytest.approx(0.05)
    assert names(b.next_batch(0.05, idle=False)) == ["a", "b"]  # ceiling reached
    for n in "cde":
        add(b, n, now=0.06)
    assert names(b.next_batch(0.06, idle=False)) == ["c", "d", "e"]  # full: sealed at once


def test_priorities_first_then_arrival() -> None:
    b = make_batcher(max_batch_size=3)
    add(b, "p2-old", 0.0, priority=2)
    add(b, "p1", 0.1, priority=1)
    add(b, "p0-a", 0.2, priority=0)
    add(b, "p0-b", 0.3, priority=0)
    assert names(b.next_batch(0.3, idle=True)) == ["p0-a", "p0-b", "p1"]
    assert names(b.next_batch(0.3, idle=True)) == ["p2-old"]


def test_token_budget_counts_padding() -> None:
    b = make_batcher(max_batch_size=32, max_batch_tokens=400)
    add(b, "short-1", 0.0, longest=10)
    add(b, "short-2", 0.0, longest=10)
    add(b, "long", 0.0, longest=150)  # 3 × 150 = 450 padded tokens > 400
    add(b, "short-3", 0.0, longest=10)
    first = b.next_batch(0.0, idle=True)
    assert names(first) == ["short-1", "short-2"]  # stops at the first misfit: no overtaking
    assert first is not None and first.padded_tokens == 20
    assert names(b.next_batch(0.0, idle=True)) == ["long", "short-3"]


def test_oversized_request_runs_alone() -> None:
    b = make_batcher(max_batch_size=4, max_batch_tokens=100)
    add(b, "huge", 0.0, size=10, longest=50)
    add(b, "next", 0.0)
    assert names(b.next_batch(0.0, idle=False)) == ["huge"]  # counts as full
    assert names(b.next_batch(0.0, idle=True)) == ["next"]


def test_expire_and_remove() -> None:
    b = make_batcher()
    add(b, "late", 0.0, deadline=1.0)
    add(b, "fine", 0.0, deadline=5.0)
    add(b, "other-partition", 0.0, size=2)
    assert [p.payload for p in b.expire(1.0)] == ["late"]
    assert [p.payload for p in b.remove(lambda p: p.payload.startswith("other"))] == ["other-partition"]
    assert b.pending_inputs == 1 and len(b) == 1


def test_policy_validation_names_the_value() -> None:
    with pytest.raises(ValueError, match="max_wait_ms"):
        BatchPolicy(max_wait_ms=150)
    with pytest.raises(ValueError, match="max_batch_size"):
        BatchPolicy(max_batch_size=0)


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
)


@settings(max_examples=300, deadline=None)
@given(arrivals=arrivals, policy=policies, service_s=st.floats(0.001, 0.2))
def test_invariants_under_random_schedules(arrivals: list[Arrival], policy: BatchPolicy, service_s: float) -> None:
    """Simulate a one-executor worker; check every step against the batcher's promises."""
    b: DynamicBatcher[int] = DynamicBatcher(policy)
    pending = sorted(enumerate(arrivals), key=lambda ia: ia[1].at)
    outcome: dict[int, str] = {}
    busy_until = 0.0
    now = 0.0
    events = sorted({a.at for a in arrivals} | {0.0})
    while pending or len(b):
        # Advance to the next interesting time: an arrival, the executor freeing, or the seal time.
        candidates = [t for t in events if t > now] + ([busy_until] if busy_until > now else [])
        wake = b.wake_at()
        if wake is not None and wake > now:
            candidates.append(wake)
        now = min(candidates) if candidates else now + 0.01
        while pending and pending[0][1].at <= now:
            i, a = pending.pop(0)
            b.add(i, priority=a.priority, size=a.size, longest=a.longest, deadline=a.at + a.ttl, now=a.at)
        for p in b.expire(now):
            assert p.payload not in outcome
            outcome[p.payload] = "expired"
        idle = now >= busy_until
        queued_before = list(b)
        batch = b.next_batch(now, idle=idle)
        if idle and queued_before:
            # Work-conserving: an idle executor never waits while something is queued.
            assert batch is not None
        if batch is None:
            continue
        items = batch.items
        # Limits, unless a single request is bigger than the limits on its own.
        if len(items) > 1:
            assert batch.size <= policy.max_batch_size
            assert batch.padded_tokens <= policy.max_batch_tokens
        # Sealed while busy only when full or the oldest has waited the ceiling.
        if not idle:
            oldest = min(p.arrival for p in queued_before)
            assert now - oldest >= policy.max_wait_ms / 1000 - 1e-9 or len(items) < len(queued_before) or (
                batch.size >= policy.max_batch_size or batch.padded_tokens >= policy.max_batch_tokens
            )
        # Priority: nothing left behind outranks anything taken.
        worst_taken = max(p.priority for p in items)
        assert all(p.priority >= worst_taken for p in b)
        for p in items:
            assert p.payload not in outcome  # nothing is both dispatched and expired, or twice
            outcome[p.payload] = "dispatched"
        busy_until = max(busy_until, now) + service_s
    # Every request ended in exactly one terminal state.
    assert set(outcome) == set(range(len(arrivals)))
    assert b.pending_inputs == 0
