"""The dynamic batcher: what runs next, what waits, and what is refused.

A synchronous state machine in the style of TGI's ``State::next_batch`` and vLLM's scheduler: the
worker calls ``add`` for each request it fetches, ``shed(now, free_at)`` and then
``next_batch(now)`` whenever its executor is free, and ``observe`` after each forward pass.
``now`` is always passed in (seconds on one monotonic clock); the batcher never reads a clock.

**Which requests run together**

* Requests are ranked by *effective level*: their priority (0 first), improved by one level for
  every ``aging_ms`` they have waited, then by arrival. A p2 request cannot starve: after
  ``2 × aging_ms`` it competes with fresh p0 requests. (Under a surge, p2 requests with short
  deadlines are refused long before aging lifts them: aging is for long-deadline batch work.)
* The best-ranked request anchors the batch. Others join in rank order while the batch stays
  within ``max_batch_size`` inputs and ``max_batch_tokens`` *padded* tokens (inputs × longest),
  and only where joining *pays*: it lowers the queue's total time to completion (it delays the
  requests already in the batch by less than it saves the request and those queued behind it).
  Costs come from the online ``ServiceTimeModel``, so on a GPU (a large fixed cost per batch)
  almost everything joins, while on a CPU (cost follows padded tokens) a 100-token request does not
  ride with 5-token ones, and similar ones batch only once a backlog makes it worth it: length
  bucketing and the batch size both adapt to the device and the load. ``max_padding_ratio`` caps
  padding outright (memory). A request skipped for any of these reasons closes the batch to every
  lower level, so a higher priority never waits behind a lower one except as aging allows.
  ``mode="window"`` (the naive baseline) fills in rank order only.

**When a batch goes out**

* ``mode="dynamic"`` is work-conserving: the caller asks for a batch when its executor is free,
  and gets one at once — at low rates any window would only add latency, and under load everything
  that arrived during one forward pass joins the next, so batches grow with load by themselves.
* ``mode="window"`` is the naive baseline for benchmarks: a batch goes out only when full or when
  its oldest request has waited ``max_wait_ms``, idle executor or not.

**What is refused** (``shed``), each with a reason the caller turns into a reply:

* ``expired``: the deadline has passed.
* ``deadline``: it cannot finish in time even if it ran alone as soon as the executor is free
  (``free_at`` + its predicted service time): refused now, not computed late.
* ``codel``: a standing queue persists (CoDel on the sojourn time in this queue, since the request
  was added), and it would make a request late: served in rank order, in full batches, from when the
  executor is free, some request is predicted to finish past its deadline. Of those, the lowest
  priority at or above ``codel_min_priority`` goes first, oldest first. A request the queue still
  serves in time is never shed: a short standing queue (a burst, a process stalled for a moment) costs
  latency, not answers; one that outgrows the deadlines is cut at its tail before the tail expires.
  Time spent before, in Kafka or on the way, is not this queue's: a worker whose records
  arrive late, because a broker or the box is slow or its clock is not the producer's, has no
  standing queue to shed, and dropping its requests would not make the rest faster. A worker that
  cannot keep up does have one: what it cannot serve waits here (up to its buffer) before it waits
  in Kafka, and a request that can no longer make its deadline is refused by ``deadline`` anyway.

Service times come from an online ``ServiceTimeModel`` fed by ``observe``.

**Background work** waits in a queue of its own (``BatchPolicy.for_background``: one level, no
aging, no CoDel: it is deferred, never shed for load, and refused only once its completion window has
passed), sharing the service-time model; a worker runs it only when this queue is empty, in batches
predicted to finish within ``background_slice_ms``. An interactive request that arrives meanwhile
waits for at most that one batch (or for one background request alone, should it take longer). And
only while interactive work leaves the executor idle more than ``1 - background_max_busy`` of the time
(``BusyShare``): near the peak, a slice would queue interactive requests for longer than itself.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Generic, Literal, TypeVar

from kinfer.batcher.codel import CoDel
from kinfer.batcher.service import ServiceTimeModel

T = TypeVar("T")

MAX_WAIT_CEILING_MS = 100.0


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    max_batch_size: int = 32  # inputs (sequences) in one forward pass
    max_batch_tokens: int = 8_192  # padded tokens (inputs × longest) in one forward pass
    max_wait_ms: float = 20.0  # window mode: how long the oldest request waits for its batch (<= 100)
    mode: Literal["dynamic", "window"] = "dynamic"
    # Waiting this long improves a request by one priority level. Keep it above the interactive
    # deadlines: then aging never makes an interactive request late, and still gives long-deadline
    # batch work a turn under sustained higher-priority load.
    aging_ms: float = 1_000.0
    max_padding_ratio: float = 4.0  # hard cap on padded / real tokens (memory), whatever the cost model says
    codel_target_ms: float = 50.0  # acceptable standing-queue sojourn
    codel_interval_ms: float = 500.0  # how long it must persist before shedding starts
    codel_min_priority: int = 1  # CoDel never sheds priorities below this (p0 is protected)
    levels: int = 3  # priority levels (0 is served first)
    # The longest a batch of background work may be predicted to take: what an interactive request
    # arriving while it runs may wait for it. On a GPU, about one forward pass of a full batch.
    background_slice_ms: float = 50.0
    # Background work runs only while interactive work keeps the executor busy less than this share of
    # the time (its average over the last seconds): near the peak, any slice would queue interactive
    # requests behind it for longer than the slice itself.
    background_max_busy: float = 0.8

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if not 0.0 <= self.max_wait_ms <= MAX_WAIT_CEILING_MS:
            raise ValueError(f"max_wait_ms must be within [0, {MAX_WAIT_CEILING_MS}], got {self.max_wait_ms}")
        if self.mode not in ("dynamic", "window"):
            raise ValueError(f"mode must be 'dynamic' or 'window', got {self.mode!r}")
        if self.aging_ms <= 0:
            raise ValueError(f"aging_ms must be > 0 (use math.inf for no aging), got {self.aging_ms}")
        if self.max_padding_ratio < 1.0:
            raise ValueError(f"max_padding_ratio must be >= 1, got {self.max_padding_ratio}")
        if self.codel_target_ms <= 0 or self.codel_interval_ms <= 0:
            raise ValueError(
                f"codel_target_ms ({self.codel_target_ms}) and codel_interval_ms ({self.codel_interval_ms}) "
                "must be > 0"
            )
        if self.levels < 1:
            raise ValueError(f"levels must be >= 1, got {self.levels}")
        if not self.background_slice_ms > 0:
            raise ValueError(f"background_slice_ms must be > 0, got {self.background_slice_ms}")
        if not 0.0 < self.background_max_busy <= 1.0:
            raise ValueError(f"background_max_busy must be within (0, 1], got {self.background_max_busy}")

    def for_background(self) -> BatchPolicy:
        """The policy of a background queue: one level, no aging, no CoDel, work-conserving."""
        return replace(self, levels=1, mode="dynamic", aging_ms=math.inf, codel_target_ms=math.inf)


class BusyShare:
    """The share of time spent computing, averaged over the last ``tau_s`` seconds (exponentially)."""

    def __init__(self, tau_s: float = 2.0) -> None:
        self.tau_s = tau_s
        self._value = 0.0
        self._at: float | None = None

    def add(self, now: float, seconds: float) -> None:
        """``seconds`` of compute ended at ``now``."""
        self._value = self.share(now) + seconds / self.tau_s
        self._at = now

    def share(self, now: float) -> float:
        if self._at is None:
            return 0.0
        return self._value * math.exp(-max(0.0, now - self._at) / self.tau_s)


class Reason(enum.StrEnum):
    EXPIRED = "expired"  # deadline already passed
    DEADLINE = "deadline"  # would finish after its deadline
    CODEL = "codel"  # standing queue: shed to protect the rest


@dataclass(frozen=True, slots=True)
class Pending(Generic[T]):
    """One queued request as the batcher sees it."""

    payload: T  # opaque to the batcher
    priority: int  # 0 first
    arrival: float  # when it was added: its sojourn in this queue runs from here
    deadline: float  # when its result stops being useful
    size: int  # inputs it contributes to the batch
    longest: int  # tokens in its longest input (drives padding)
    seq: int  # arrival order, breaks ties

    def level(self, now: float, aging_s: float) -> int:
        return max(0, self.priority - int((now - self.arrival) / aging_s))


@dataclass(frozen=True, slots=True)
class Dropped(Generic[T]):
    pending: Pending[T]
    reason: Reason


@dataclass(frozen=True, slots=True)
class Batch(Generic[T]):
    """The requests to run together, in the order they were taken."""

    items: tuple[Pending[T], ...]
    predicted_s: float  # the service-time model's guess for it

    @property
    def size(self) -> int:
        return sum(p.size for p in self.items)

    @property
    def padded_tokens(self) -> int:
        return self.size * max(p.longest for p in self.items)

    @property
    def real_tokens(self) -> int:
        """Tokens if each request's inputs were as long as its longest: real work, bounded above."""
        return sum(p.size * p.longest for p in self.items)

    @property
    def padding_ratio(self) -> float:
        return self.padded_tokens / self.real_tokens

    @property
    def payloads(self) -> list[T]:
        return [p.payload for p in self.items]


class DynamicBatcher(Generic[T]):
    def __init__(self, policy: BatchPolicy, service: ServiceTimeModel | None = None) -> None:
        self.policy = policy
        self.service = service or ServiceTimeModel()
        self._items: dict[int, Pending[T]] = {}  # by seq; dicts keep arrival order
        # Heaps of (deadline, seq) and (arrival, seq) over the queue, pruned lazily: the decisions
        # made on every event (shed, wake_at, CoDel's sojourn) look at the few requests near the
        # front, not at the whole queue — a backlog must not make each event slower.
        self._deadlines: list[tuple[float, int]] = []
        self._arrivals: list[tuple[float, int]] = []
        # The largest request (padded tokens, inputs) queued since the queue was last empty: with
        # it, no queued request can cost more alone than ``_alone_bound()``.
        self._largest = (1, 1)
        self._seq = itertools.count()
        self._inputs = 0
        self._inputs_by_priority = [0] * policy.levels
        self._codel = CoDel(policy.codel_target_ms / 1000.0, policy.codel_interval_ms / 1000.0)
        self._aging_s = policy.aging_ms / 1000.0
        self._max_wait_s = policy.max_wait_ms / 1000.0

    # -- state -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Pending[T]]:
        return iter(list(self._items.values()))

    @property
    def pending_inputs(self) -> int:
        return self._inputs

    def pending_inputs_at(self, priority: int) -> int:
        return self._inputs_by_priority[priority]

    @property
    def shedding(self) -> bool:
        """CoDel is in its dropping state: a standing queue persists."""
        return self._codel.dropping

    def add(
        self, payload: T, *, priority: int, size: int, longest: int, deadline: float, now: float,
    ) -> Pending[T]:
        if not 0 <= priority < self.policy.levels:
            raise ValueError(f"priority must be within [0, {self.policy.levels}), got {priority}")
        if size < 1 or longest < 1:
            raise ValueError(f"size and longest must be >= 1, got {size} and {longest}")
        p = Pending(payload, priority, now, deadline, size, longest, next(self._seq))
        self._items[p.seq] = p
        heapq.heappush(self._deadlines, (p.deadline, p.seq))
        heapq.heappush(self._arrivals, (p.arrival, p.seq))
        self._largest = (max(self._largest[0], size * longest), max(self._largest[1], size))
        self._account(p, +1)
        return p

    def remove(self, predicate: Callable[[Pending[T]], bool]) -> list[Pending[T]]:
        """Remove and return every queued request matching ``predicate`` (e.g. of a revoked partition)."""
        gone = [p for p in self._items.values() if predicate(p)]
        for p in gone:
            self._take(p)
        return gone

    # -- decisions ---------------------------------------------------------------------------

    def predict(self, items: list[Pending[T]] | tuple[Pending[T], ...]) -> float:
        size = sum(p.size for p in items)
        return self.service.predict(size * max(p.longest for p in items), size)

    def shed(self, now: float, *, free_at: float | None = None) -> list[Dropped[T]]:
        """Remove and return the requests to refuse now, each with its reason.

        ``free_at``: when the executor is expected to be free (``now`` when it is idle).
        """
        start = now if free_at is None else max(now, free_at)
        dropped: list[Dropped[T]] = []
        # Only a request whose deadline is within the largest alone-cost of ``start`` can miss it.
        for p in sorted(self._near_deadline(start + self._alone_bound()), key=lambda p: p.seq):
            if p.deadline <= now:
                dropped.append(Dropped(p, Reason.EXPIRED))
            elif start + self.predict([p]) > p.deadline:
                dropped.append(Dropped(p, Reason.DEADLINE))
        for d in dropped:
            self._take(d.pending)
        self._codel.observe(self._standing(now), now)
        while self._codel.should_drop(now):
            victim = self._codel_victim(now, start)
            if victim is None:
                self._codel.spare()
                break
            self._take(victim)
            dropped.append(Dropped(victim, Reason.CODEL))
            self._codel.observe(self._standing(now), now)
        return dropped

    def next_batch(self, now: float, *, max_batch_s: float | None = None) -> Batch[T] | None:
        """The next batch to run, or None if nothing should go out yet (see the module doc).

        ``max_batch_s``: no request joins a batch whose predicted run would exceed it (the first
        always goes) — a worker passes its fair-share quantum while other models wait, so a
        backlog here cannot hold the executor for a long batch while a neighbour's request waits.
        """
        if not self._items:
            return None
        taken, full = self._plan(now, max_batch_s)
        # The window is on the oldest queued request, taken or not: a request held out of this batch
        # (by priority or padding) still makes the batch go, so it is next in line.
        if self.policy.mode == "window" and not full and now - self._oldest_arrival() < self._max_wait_s:
            return None
        for p in taken:
            self._take(p)
        self._codel.observe(self._standing(now), now)
        return Batch(tuple(taken), self.predict(taken))

    def observe(self, batch: Batch[T], seconds: float) -> None:
        """Feed the measured duration of a finished batch to the service-time model."""
        self.service.observe(batch.padded_tokens, batch.size, seconds)

    def wake_at(self, now: float, *, idle: bool) -> float | None:
        """The next time a decision could change with no new arrival (None: only events matter).

        ``idle``: the executor is free now (only then does a naive window's closing matter).
        """
        if not self._items:
            return None
        times: list[float] = []
        if self.policy.mode == "window" and idle:
            times.append(self._oldest_arrival() + self._max_wait_s)
        # The moment a queued request can no longer make its deadline: refuse it then, not later.
        # Only requests within the largest alone-cost of the earliest deadline can be the first.
        first = self._live_root(self._deadlines)[0]
        times.append(min(p.deadline - self.predict([p]) for p in self._near_deadline(first + self._alone_bound())))
        drop_at = self._codel.next_drop_at()
        if drop_at is not None:
            times.append(drop_at)
        return max(now, min(times))

    # -- internals ---------------------------------------------------------------------------

    def _plan(self, now: float, max_batch_s: float | None = None) -> tuple[list[Pending[T]], bool]:
        ranked = sorted(self._items.values(), key=lambda p: (p.level(now, self._aging_s), p.seq))
        first = ranked[0]
        taken = [first]
        size, longest, real = first.size, first.longest, first.size * first.longest
        full = size >= self.policy.max_batch_size or size * longest >= self.policy.max_batch_tokens
        closed_below: int | None = None  # after a skip, no request of a worse level may join
        cost_aware = self.policy.mode == "dynamic"
        cost = self._cost(size, longest) if cost_aware else 0.0
        # One probe per batch beyond the largest size seen lately: a model that has only seen batches
        # of one size cannot tell a fixed cost from a per-input one, and a wrong split (a CPU-like prior
        # on a GPU) would keep batches at that size for ever — it must see the next size to learn.
        # (A fresh model has seen nothing: its prior decides.)
        largest = self.service.largest_recent
        probe = cost_aware and 0 < largest < self.policy.max_batch_size
        for i, p in enumerate(ranked[1:], start=1):
            lvl = p.level(now, self._aging_s)
            if closed_below is not None and lvl > closed_below:
                break
            new_size, new_longest, new_real = size + p.size, max(longest, p.longest), real + p.size * p.longest
            padded = new_size * new_longest
            if new_size > self.policy.max_batch_size or padded > self.policy.max_batch_tokens:
                full = True
                closed_below = lvl if closed_below is None else closed_below
                continue
            new_cost = self._cost(new_size, new_longest) if cost_aware or max_batch_s is not None else 0.0
            if max_batch_s is not None and new_cost > max_batch_s:
                full = True  # as long as it may be: it goes now
                break
            pays = not cost_aware or self._pays(
                grows_by=new_cost - cost, alone=self._cost(p.size, p.longest), riding=len(taken),
                behind=len(ranked) - i - 1 + (i - len(taken)),
            )
            if not pays and probe and new_size > largest and new_longest == longest:
                pays, probe = True, False  # the probe: one request more than the model has seen lately
            if not pays or padded > self.policy.max_padding_ratio * new_real:
                closed_below = lvl if closed_below is None else closed_below
                continue
            taken.append(p)
            size, longest, real, cost = new_size, new_longest, new_real, new_cost
            if size >= self.policy.max_batch_size:
                full = True
                break
        return taken, full

    def _cost(self, size: int, longest: int) -> float:
        return self.service.predict(size * longest, size)

    @staticmethod
    def _pays(grows_by: float, alone: float, riding: int, behind: int) -> bool:
        """Does a request joining the batch lower the total time to completion of the queue?

        Joining delays the ``riding`` requests already in the batch by ``grows_by``; it saves
        ``alone - grows_by`` for the request itself and for each of the ``behind`` requests still
        queued, which would otherwise also wait for it to run on its own. On a GPU (a large fixed
        cost per batch) this says yes almost always; on a CPU (cost follows padded tokens) it says
        yes only for similar lengths, and only once a backlog makes the saved overhead worth it —
        at low load, batching there would only add latency.
        """
        return riding * grows_by <= (behind + 1) * (alone - grows_by)

    def _oldest_arrival(self) -> float:
        return self._live_root(self._arrivals)[0]

    def _standing(self, now: float) -> float:
        """The sojourn of the oldest request still queued (0 when the queue is empty)."""
        return now - self._oldest_arrival() if self._items else 0.0

    def _live_root(self, heap: list[tuple[float, int]]) -> tuple[float, int]:
        """The smallest entry of ``heap`` that is still queued (the queue is not empty)."""
        while heap[0][1] not in self._items:
            heapq.heappop(heap)
        return heap[0]

    def _near_deadline(self, limit: float) -> Iterator[Pending[T]]:
        """Queued requests with a deadline at or before ``limit``: the heap's top, walked in place."""
        heap, items, stack = self._deadlines, self._items, [0]
        while stack:
            i = stack.pop()
            if i < len(heap) and heap[i][0] <= limit:
                p = items.get(heap[i][1])
                if p is not None:
                    yield p
                stack += (2 * i + 1, 2 * i + 2)

    def _alone_bound(self) -> float:
        """No queued request costs more alone than this (the cost model is linear: check the corners)."""
        tokens, size = self._largest
        return max(self.service.predict(t, n) for t in (1, tokens) for n in (1, size))

    def _codel_victim(self, now: float, start: float) -> Pending[T] | None:
        """Of the requests the queue ahead of them would make late, the lowest priority, oldest first (None
        when every one is predicted in time: a standing queue that drains within its deadlines costs none)."""
        late = [p for p in self._late_behind_queue(now, start) if p.priority >= self.policy.codel_min_priority]
        return min(late, key=lambda p: (-p.priority, p.seq), default=None)

    def _late_behind_queue(self, now: float, start: float) -> Iterator[Pending[T]]:
        """Queued requests predicted to finish past their deadline when the queue is served in rank order
        from ``start``, in batches as full as the policy allows, each ending with the request that joined it
        last: a hopeful prediction, so what it names late is late."""
        policy, done, size, longest = self.policy, start, 0, 0
        for p in sorted(self._items.values(), key=lambda p: (p.level(now, self._aging_s), p.seq)):
            grown, wider = size + p.size, max(longest, p.longest)
            if size and (grown > policy.max_batch_size or grown * wider > policy.max_batch_tokens):
                done += self.service.predict(size * longest, size)  # the batch before goes out whole
                grown, wider = p.size, p.longest
            size, longest = grown, wider
            if done + self.service.predict(size * longest, size) > p.deadline:
                yield p

    def _take(self, p: Pending[T]) -> None:
        del self._items[p.seq]
        self._account(p, -1)
        if not self._items:
            self._deadlines.clear()
            self._arrivals.clear()
            self._largest = (1, 1)
        elif len(self._deadlines) > 4 * len(self._items) + 64:  # mostly entries of requests gone
            self._deadlines = [(q.deadline, q.seq) for q in self._items.values()]
            self._arrivals = [(q.arrival, q.seq) for q in self._items.values()]
            heapq.heapify(self._deadlines)
            heapq.heapify(self._arrivals)

    def _account(self, p: Pending[T], sign: int) -> None:
        self._inputs += sign * p.size
        self._inputs_by_priority[p.priority] += sign * p.size
