"""The dynamic batcher: size cap, padded-token cap, a wait ceiling, priorities, deadlines.

It is a synchronous state machine in the style of TGI's ``State::next_batch``: the worker calls
``add`` for each request it fetches and ``next_batch(now, idle=...)`` whenever something changed.

* **Work-conserving.** When the executor is idle, whatever is queued goes out at once: at low
  arrival rates a fixed window would only add latency.
* **The window is a ceiling.** A caller whose executor is busy but could take another batch
  (several devices, or a pipeline that prepares the next batch during the current forward pass)
  asks with ``idle=False``: the batch is sealed only once it is full — by inputs or by padded
  tokens — or once its oldest request has waited ``max_wait_ms``. A single-executor worker asks
  only when its executor is free, so everything that arrived during the previous pass joins.
* **Priorities.** Lower ``priority`` values are taken first; within a priority, arrival order.
* **Deadlines.** ``expire(now)`` removes requests whose deadline has passed, so they get an
  ``expired`` reply instead of compute.

``now`` and deadlines are seconds on one monotonic clock chosen by the caller.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

MAX_WAIT_CEILING_MS = 100.0


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    max_batch_size: int = 32  # inputs (sequences) in one forward pass
    max_batch_tokens: int = 16_384  # padded tokens: inputs × longest input, in one forward pass
    max_wait_ms: float = 20.0  # ceiling on how long the oldest request waits for its batch to seal
    levels: int = 3  # number of priority levels (0 is served first)

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if not 0.0 <= self.max_wait_ms <= MAX_WAIT_CEILING_MS:
            raise ValueError(f"max_wait_ms must be within [0, {MAX_WAIT_CEILING_MS}], got {self.max_wait_ms}")
        if self.levels < 1:
            raise ValueError(f"levels must be >= 1, got {self.levels}")


@dataclass(frozen=True, slots=True)
class Pending(Generic[T]):
    """One queued request as the batcher sees it."""

    payload: T  # opaque to the batcher
    priority: int  # 0 first
    arrival: float  # when it was added (caller's monotonic seconds)
    deadline: float  # when its result stops being useful (same clock)
    size: int  # inputs it contributes to the batch
    longest: int  # tokens in its longest input (drives padding)
    seq: int  # arrival order, breaks ties


@dataclass(frozen=True, slots=True)
class Batch(Generic[T]):
    """A sealed batch: the requests to run together, in the order they were taken."""

    items: tuple[Pending[T], ...]
    sealed_at: float  # when next_batch returned it

    @property
    def size(self) -> int:
        return sum(p.size for p in self.items)

    @property
    def padded_tokens(self) -> int:
        return self.size * max(p.longest for p in self.items)

    @property
    def real_tokens_upper(self) -> int:
        """Tokens if every input were as long as its request's longest: an upper bound on real work."""
        return sum(p.size * p.longest for p in self.items)

    @property
    def payloads(self) -> list[T]:
        return [p.payload for p in self.items]


class DynamicBatcher(Generic[T]):
    def __init__(self, policy: BatchPolicy) -> None:
        self.policy = policy
        self._queues: list[deque[Pending[T]]] = [deque() for _ in range(policy.levels)]
        self._seq = itertools.count()
        self._inputs = 0

    # -- state -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues)

    @property
    def pending_inputs(self) -> int:
        return self._inputs

    def __iter__(self) -> Iterator[Pending[T]]:
        for q in self._queues:
            yield from q

    def add(self, payload: T, *, priority: int, size: int, longest: int, deadline: float, now: float) -> None:
        if not 0 <= priority < self.policy.levels:
            raise ValueError(f"priority must be within [0, {self.policy.levels}), got {priority}")
        if size < 1 or longest < 1:
            raise ValueError(f"size and longest must be >= 1, got {size} and {longest}")
        self._queues[priority].append(Pending(payload, priority, now, deadline, size, longest, next(self._seq)))
        self._inputs += size

    # -- decisions ---------------------------------------------------------------------------

    def next_batch(self, now: float, *, idle: bool) -> Batch[T] | None:
        """The next batch to run, or None if nothing should go out yet.

        ``idle``: the executor could start this batch right now. Otherwise a batch is returned only
        once sealed: full, or its oldest request has waited ``max_wait_ms``.
        """
        if not self:
            return None
        taken, full = self._plan()
        if not idle and not full and now - self._oldest_arrival() < self.policy.max_wait_ms / 1000.0:
            return None
        for p in taken:
            self._queues[p.priority].popleft()
            self._inputs -= p.size
        return Batch(tuple(taken), now)

    def wake_at(self) -> float | None:
        """When a busy-executor batch would seal by time alone (None when the queue is empty)."""
        if not self:
            return None
        return self._oldest_arrival() + self.policy.max_wait_ms / 1000.0

    def expire(self, now: float) -> list[Pending[T]]:
        """Remove and return every request whose deadline has passed."""
        return self.remove(lambda p: p.deadline <= now)

    def remove(self, predicate: Callable[[Pending[T]], bool]) -> list[Pending[T]]:
        """Remove and return every queued request matching ``predicate`` (e.g. of a revoked partition)."""
        gone: list[Pending[T]] = []
        for i, q in enumerate(self._queues):
            keep: deque[Pending[T]] = deque()
            for p in q:
                (gone if predicate(p) else keep).append(p)
            self._queues[i] = keep
        self._inputs -= sum(p.size for p in gone)
        return gone

    # -- internals ---------------------------------------------------------------------------

    def _oldest_arrival(self) -> float:
        return min(q[0].arrival for q in self._queues if q)

    def _plan(self) -> tuple[list[Pending[T]], bool]:
        """Requests for the next batch in priority order, and whether the batch is full.

        Takes the head of the queue in order and stops at the first request that does not fit, so
        nothing is overtaken by a smaller request behind it. A single request larger than the
        limits still forms a batch of its own (requests are never split).
        """
        taken: list[Pending[T]] = []
        size = longest = 0
        for q in self._queues:
            for p in q:
                new_size = size + p.size
                new_longest = max(longest, p.longest)
                if taken and (
                    new_size > self.policy.max_batch_size
                    or new_size * new_longest > self.policy.max_batch_tokens
                ):
                    return taken, True
                taken.append(p)
                size, longest = new_size, new_longest
        full = size >= self.policy.max_batch_size or size * longest >= self.policy.max_batch_tokens
        return taken, full
