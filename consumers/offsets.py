"""Which offsets are safe to commit: at-least-once bookkeeping, no I/O.

A worker finishes requests out of order (batches mix partitions; priorities reorder). Kafka's
commit is a single position per partition, so the position may only move up to the lowest offset
that is still unfinished. Everything below it has had its reply published.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

TP = TypeVar("TP")


class OffsetTracker(Generic[TP]):
    def __init__(self) -> None:
        self._open: dict[TP, set[int]] = {}  # fetched, reply not yet published
        self._next: dict[TP, int] = {}  # one past the highest offset fetched
        self._committed: dict[TP, int] = {}  # last position handed to Kafka

    def track(self, tp: TP, offset: int) -> None:
        self._open.setdefault(tp, set()).add(offset)
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)

    def done(self, tp: TP, offset: int) -> None:
        opened = self._open.get(tp)
        if opened is not None:
            opened.discard(offset)

    def in_flight(self) -> int:
        return sum(len(s) for s in self._open.values())

    def committable(self, assigned: Iterable[TP] | None = None) -> dict[TP, int]:
        """Positions that moved since the last ``mark_committed``, limited to ``assigned``."""
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
        for tp, position in positions.items():
            self._committed[tp] = max(self._committed.get(tp, -1), position)

    def forget(self, tps: Iterable[TP]) -> None:
        """Drop partitions this worker no longer owns; their open offsets will be redelivered elsewhere."""
        for tp in tps:
            self._open.pop(tp, None)
            self._next.pop(tp, None)
            self._committed.pop(tp, None)
