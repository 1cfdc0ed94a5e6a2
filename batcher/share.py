"""The background tier's share between tenants: which waiting batch lines go to the broker next. No I/O,
no clock of its own (``now`` is passed in).

A batch's lines are not published all at once. Published, they would queue on the model's one p3 topic
in arrival order, and a tenant's 2-line batch would wait behind every line of another tenant's 50,000.
Instead the Batch API's runner hands each batch's lines to a ``BackgroundShare`` and publishes only
what ``take`` gives it:

- **A window per model.** At most ``window(model)`` lines of a model are in flight (published, not
  yet ended). The window follows the model's measured rate: ``rate × slice_s`` lines, at least
  ``min_window``, where ``rate`` is a moving average of the lines that ended per second while
  lines were in flight. So the workers always have about a slice of work queued (a window that
  drains faster than a slice grows, by the rate it measures), and what a new batch waits behind
  on the broker is at most one slice of work.
- **Deficit round robin by tenant.** Among the tenants with lines waiting for a model, each gets
  its turn, charged by the inputs of the lines it takes (a line of 100 inputs costs 100 of
  one): a tenant with 50,000 lines queued and one with 2 alternate. Within a tenant, its batches
  take turns the same way, one line each.
- **A withdrawn batch** (cancelled, ended, or no longer this runner's) leaves: its waiting lines are
  dropped, never published, and its lines in flight stop counting.

So a small batch completes in about the time it would take alone, plus one slice, whatever else is
queued; and a cancel withdraws every line not yet published.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kinfer.batcher.fair import DeficitRoundRobin

T = TypeVar("T")
BatchId = str


@dataclass
class _Rate:
    """Lines ended per second of the time some were in flight: an exponential moving average over spans of
    at least ``interval_s`` of such time. Idle time (nothing in flight) is not counted: it says nothing
    of what the workers can do."""

    interval_s: float = 1.0
    alpha: float = 0.5
    per_s: float = 0.0
    ended: int = 0
    busy_s: float = 0.0
    since: float | None = None  # lines have been in flight since

    def flying(self, now: float, in_flight: int) -> None:
        """``in_flight`` lines are in flight from ``now`` on."""
        if in_flight > 0 and self.since is None:
            self.since = now
        elif in_flight == 0 and self.since is not None:
            self.busy_s += max(0.0, now - self.since)
            self.since = None
        busy = self.busy_s + (max(0.0, now - self.since) if self.since is not None else 0.0)
        if busy >= self.interval_s:
            measured = self.ended / busy
            self.per_s = measured if self.per_s == 0 else self.alpha * measured + (1 - self.alpha) * self.per_s
            self.ended, self.busy_s = 0, 0.0
            self.since = now if self.since is not None else None


@dataclass
class _Model(Generic[T]):
    rate: _Rate
    tenants: DeficitRoundRobin[str] = field(default_factory=lambda: DeficitRoundRobin(quantum_s=8.0))
    waiting: dict[str, deque[BatchId]] = field(default_factory=dict)  # tenant -> its batches, in turn
    in_flight: int = 0


@dataclass
class _Batch(Generic[T]):
    tenant: str
    lines: dict[str, deque[tuple[str, int, T]]] = field(default_factory=dict)  # model -> (line id, cost, item)
    in_flight: dict[str, tuple[str, int]] = field(default_factory=dict)  # line id -> (model, cost)


class BackgroundShare(Generic[T]):
    def __init__(self, min_window: int = 64, max_window: int = 20_000, slice_s: float = 1.0) -> None:
        if not 1 <= min_window <= max_window:
            raise ValueError(f"windows must satisfy 1 <= min_window <= max_window, got {min_window}, {max_window}")
        if slice_s <= 0:
            raise ValueError(f"slice_s must be > 0, got {slice_s}")
        self.min_window, self.max_window, self.slice_s = min_window, max_window, slice_s
        self._models: dict[str, _Model[T]] = {}
        self._batches: dict[BatchId, _Batch[T]] = {}

    # -- what the runner tells it --------------------------------------------------------------------

    def add(self, batch: BatchId, tenant: str, lines: Iterable[tuple[str, str, int, T]]) -> None:
        """``batch``'s lines to publish, in order: (line id, model, cost in inputs, item)."""
        entry = self._batches.setdefault(batch, _Batch(tenant))
        for line_id, model, cost, item in lines:
            queue = entry.lines.get(model)
            if queue is None:
                queue = entry.lines[model] = deque()
            if not queue:
                self._wait(model, tenant, batch)
            queue.append((line_id, max(1, cost), item))

    def ended(self, batch: BatchId, line_id: str, now: float) -> None:
        """A line of ``batch`` has its result (or will never be waited for): its place in the window is free."""
        entry = self._batches.get(batch)
        flying = entry.in_flight.pop(line_id, None) if entry is not None else None
        if flying is not None:
            state = self._models[flying[0]]
            state.in_flight -= 1
            state.rate.ended += 1
            state.rate.flying(now, state.in_flight)

    def failed(self, batch: BatchId, line_id: str, item: T, now: float) -> None:
        """A line ``take`` gave could not be published: it goes back to the front of its batch's turn."""
        entry = self._batches.get(batch)
        flying = entry.in_flight.pop(line_id, None) if entry is not None else None
        if entry is None or flying is None:
            return
        model, cost = flying
        state = self._models[model]
        state.in_flight -= 1
        state.rate.flying(now, state.in_flight)
        queue = entry.lines.setdefault(model, deque())
        if not queue:
            self._wait(model, entry.tenant, batch)
        queue.appendleft((line_id, cost, item))

    def withdraw(self, batch: BatchId, now: float) -> int:
        """``batch`` leaves: its waiting lines are dropped and its lines in flight stop counting. Returns the
        number of waiting lines dropped."""
        entry = self._batches.pop(batch, None)
        if entry is None:
            return 0
        for model, _ in entry.in_flight.values():
            state = self._models[model]
            state.in_flight -= 1
            state.rate.flying(now, state.in_flight)
        dropped = 0
        for model, queue in entry.lines.items():
            dropped += len(queue)
            turns = self._models[model].waiting.get(entry.tenant)
            if turns is not None and batch in turns:
                turns.remove(batch)
                if not turns:
                    del self._models[model].waiting[entry.tenant]
        return dropped

    # -- what it decides ----------------------------------------------------------------------------

    def take(self, now: float) -> list[tuple[BatchId, str, T]]:
        """The lines to publish now, fairly, each (batch, line id, item); each is in flight until ``ended``."""
        out: list[tuple[BatchId, str, T]] = []
        for model, state in self._models.items():
            state.rate.flying(now, state.in_flight)
            room = self.window(model) - state.in_flight
            while room > 0 and state.waiting:
                tenant = state.tenants.pick(state.waiting)
                assert tenant is not None
                turns = state.waiting[tenant]
                batch = turns[0]
                entry = self._batches[batch]
                queue = entry.lines[model]
                line_id, cost, item = queue.popleft()
                state.tenants.charge(tenant, float(cost))
                entry.in_flight[line_id] = (model, cost)
                state.in_flight += 1
                room -= 1
                out.append((batch, line_id, item))
                turns.rotate(-1)  # the tenant's next batch goes next time
                if not queue:
                    turns.remove(batch)
                    if not turns:
                        del state.waiting[tenant]
            state.rate.flying(now, state.in_flight)
        return out

    def window(self, model: str) -> int:
        """Lines of ``model`` allowed in flight: a slice at its measured rate, within the bounds."""
        state = self._models.get(model)
        rate = state.rate.per_s if state is not None else 0.0
        return max(self.min_window, min(self.max_window, round(rate * self.slice_s)))

    def waiting(self, model: str | None = None) -> int:
        """Lines not yet taken (of ``model``, or of every model)."""
        return sum(len(queue) for entry in self._batches.values() for m, queue in entry.lines.items()
                   if model is None or m == model)

    def in_flight(self, model: str | None = None) -> int:
        return sum(s.in_flight for m, s in self._models.items() if model is None or m == model)

    def _wait(self, model: str, tenant: str, batch: BatchId) -> None:
        state = self._models.get(model)
        if state is None:
            state = self._models[model] = _Model(_Rate(interval_s=self.slice_s))
        if tenant not in state.waiting:
            state.tenants.add(tenant)
            state.waiting[tenant] = deque()
        if batch not in state.waiting[tenant]:
            state.waiting[tenant].append(batch)


__all__ = ["BackgroundShare"]
