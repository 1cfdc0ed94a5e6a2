"""Which offsets are safe to commit: at-least-once bookkeeping, no I/O.

**The invariant.** The committed offset of a partition never passes a record whose result was not
published. Everything below it is answered (its reply published, or the record dead-lettered, or its
reply given up on past the request's deadline); everything at or above it is fetched again by
whoever owns the partition next.

How the tracker keeps it, whatever the order of events:

- A worker finishes requests out of order (batches mix partitions; priorities reorder). Kafka's
  commit is one position per partition, so the position may only move up to the lowest offset that
  is still open: fetched (``track``) and its reply not yet published (``done``).
- A revocation drops the partition's queued requests without replies and ``forget``s it: nothing of
  it is open here any more, and nothing of it is committed from here until it is assigned again. The
  next owner (this worker again, after an eager rebalance that hands the same partitions back) starts
  from the committed offset, so every dropped record is fetched again.
- Work from before a revocation may finish after it. Its ``done`` is about the same record (a
  partition and offset name one record for ever), whose reply it has just published: if the record
  was fetched again meanwhile, that copy's reply is already out, and committing past it is safe.
- Commits are answered late, refused, or answered after a later one (aiokafka retries a commit that
  failed for a transient reason, so an earlier position can land last). Positions are computed from
  what was published when they were computed, so any of them is safe whenever it lands. The broker
  keeps the last one it accepted; ``mark_committed`` records exactly that, so a position that landed
  after a higher one is followed by the higher one again instead of being believed already there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

TP = TypeVar("TP")


class OffsetTracker(Generic[TP]):
    def __init__(self) -> None:
        self._open: dict[TP, set[int]] = {}  # fetched, reply not yet published
        self._next: dict[TP, int] = {}  # one past the highest offset fetched
        self._committed: dict[TP, int] = {}  # the position the broker last accepted from here

    def track(self, tp: TP, offset: int) -> None:
        self._open.setdefault(tp, set()).add(offset)
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)

    def done(self, tp: TP, offset: int) -> None:
        """The reply for the record at ``offset`` is published (a no-op for a forgotten partition)."""
        opened = self._open.get(tp)
        if opened is not None:
            opened.discard(offset)

    def in_flight(self) -> int:
        return sum(len(s) for s in self._open.values())

    def committable(self, assigned: Iterable[TP] | None = None) -> dict[TP, int]:
        """Positions above the last one the broker accepted from here, limited to ``assigned``."""
        allowed = set(self._next) if assigned is None else set(assigned) & set(self._next)
        out: dict[TP, int] = {}
        for tp in allowed:
            opened = self._open.get(tp)
            position = min(opened) if opened else self._next[tp]
            if position > self._committed.get(tp, -1):
                out[tp] = position
        return out

    def positions(self, assigned: Iterable[TP]) -> dict[TP, int]:
        """The safe position of every partition of ``assigned`` seen here, moved since the last commit or not."""
        out: dict[TP, int] = {}
        for tp in set(assigned) & set(self._next):
            opened = self._open.get(tp)
            out[tp] = min(opened) if opened else self._next[tp]
        return out

    def mark_committed(self, positions: dict[TP, int]) -> None:
        """The broker accepted ``positions``: it now holds them, even where they are lower than a
        position it accepted before (a retried commit that landed last)."""
        self._committed.update(positions)

    def forget(self, tps: Iterable[TP]) -> None:
        """Drop partitions this worker no longer owns; their open offsets will be redelivered elsewhere."""
        for tp in tps:
            self._open.pop(tp, None)
            self._next.pop(tp, None)
            self._committed.pop(tp, None)
