"""Records that stop workers: recognised on their next delivery, isolated, then dead-lettered. No I/O.

A record that kills the process handling it (a native crash in a tokenizer or a kernel, the kernel's
OOM killer) is never committed, so every new owner of its partition would fetch it and die in turn.
Each partition therefore carries a mark in its committed offset's metadata, written by whoever holds
the partition (Kafka keeps it with the position, for every future owner, on every broker):

    OWNED       an owner is working from this position (written when it takes the partition, and
                with every commit after that)
    HANDED      the owner gave the partition up cleanly (its revocation, swap-out or stop committed)
    CAREFUL n   a careful owner (below) was here, between two records; ``n`` owners have stopped in
                this stretch of the log
    IN_FLIGHT n a careful owner was working on exactly the record at this position, alone

A new owner reads the mark at the committed position before it fetches anything:

- none or HANDED: business as usual.
- OWNED or CAREFUL: the last owner stopped without handing over (killed, or thrown out of the
  group). What it had in flight is unknown, so the next ``careful_records`` records of the partition
  are worked alone: one record at a time in the whole worker (a ``CarefulToken`` shared by its
  models' guards), with nothing else fetched or running meanwhile, each marked IN_FLIGHT (a commit of
  its own offset) before it runs and committed (CAREFUL) after its reply is out.
- IN_FLIGHT n: an owner stopped while working on exactly that record, alone. It has stopped ``n + 1``
  workers: it is dead-lettered without being run, and the careful stretch goes on after it.

A careful partition handed over (a rebalance, a swap-out, a stop) keeps its mark: the next owner is
careful too, and a record marked in flight stays marked until it is dead-lettered.

So a record that stops a worker within the careful stretch after its first victim stops at most one
more — the careful owner that pins it down — and never a third (one further out stops the next owner
again, which moves the stretch to it). The price of an owner stopped for any other reason is its
partitions' careful stretch on the next owner: ``careful_records`` records each, worked alone (about
two commits and a lone model call a record), never a lost request.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

TP = TypeVar("TP", bound=Hashable)

_PREFIX = "kinfer:"
# Records of each partition worked alone after its owner stopped without handing it over: enough to
# cover what an owner has fetched and not committed (commits go out every 100 ms), few enough that
# the next owner's careful stretch over a dozen partitions takes seconds, not minutes.
CAREFUL_RECORDS = 16


class Mark(enum.Enum):
    NONE = "none"
    OWNED = "owned"
    HANDED = "handed"
    CAREFUL = "careful"
    IN_FLIGHT = "inflight"


def parse_mark(metadata: str | None) -> tuple[Mark, int]:
    """The mark in a committed offset's metadata, and its count (CAREFUL); anything else is NONE."""
    if not metadata or not metadata.startswith(_PREFIX):
        return Mark.NONE, 0
    text = metadata[len(_PREFIX):]
    if text == "owned":
        return Mark.OWNED, 0
    if text == "handed":
        return Mark.HANDED, 0
    kind, _, count = text.partition("=")
    if kind in ("careful", "inflight") and count.isascii() and count.isdigit() and len(count) < 6:
        return (Mark.CAREFUL if kind == "careful" else Mark.IN_FLIGHT), int(count)
    return Mark.NONE, 0


def mark_text(mark: Mark, count: int = 0) -> str:
    if mark in (Mark.CAREFUL, Mark.IN_FLIGHT):
        return f"{_PREFIX}{mark.value}={count}"
    return "" if mark is Mark.NONE else f"{_PREFIX}{mark.value}"


class Verdict(enum.Enum):
    RUN = "run"  # work on it as usual
    MARK = "mark"  # careful: commit its IN_FLIGHT mark (``in_flight_mark``), then work on it
    DEFER = "defer"  # careful, and another record of the partition is in flight: fetch it again later
    POISON = "poison"  # it stopped workers: dead-letter it, do not run it


class CarefulToken:
    """One careful record in flight per worker, whatever its model: it runs alone, so a crash while it
    is in flight is its doing."""

    def __init__(self) -> None:
        self.holder: tuple[object, Hashable] | None = None  # (guard, partition)

    @property
    def busy(self) -> bool:
        return self.holder is not None


@dataclass
class _Careful:
    left: int  # records still to work alone
    crashes: int  # owners stopped in this stretch
    poison_at: int | None  # the offset to dead-letter unread (the committed position a careful owner died at)
    in_flight: int | None = None  # the one record of the partition being worked on now
    committed_to: int = -1  # the position committed with the careful mark (the marker of the next record)


class DeliveryGuard(Generic[TP]):
    """Per partition of one model: normal, or careful (its records worked alone, each committed before
    the next is fetched)."""

    def __init__(self, careful_records: int = CAREFUL_RECORDS, token: CarefulToken | None = None) -> None:
        self.careful_records = careful_records
        self.token = token or CarefulToken()
        self._careful: dict[TP, _Careful] = {}
        self._unchecked: set[TP] = set()  # assigned, mark not read yet: fetch nothing
        self._taken: dict[TP, int] = {}  # the committed position each partition was taken at

    # -- assignment ---------------------------------------------------------------------------

    def assigning(self, tps: Iterable[TP]) -> None:
        """Partitions just assigned: hold them until their marks are read."""
        self._unchecked.update(tps)

    def assigned(self, marks: dict[TP, tuple[int, str | None]]) -> dict[TP, tuple[int, str]]:
        """The committed (position, metadata) of newly assigned partitions → the marks to commit now
        (this owner takes them). A partition without a committed position is taken from wherever the
        consumer starts, unmarked."""
        out: dict[TP, tuple[int, str]] = {}
        for tp, (position, metadata) in marks.items():
            self._unchecked.discard(tp)
            self._drop(tp)
            if position < 0:
                continue
            self._taken[tp] = position
            mark, count = parse_mark(metadata)
            if self.careful_records > 0 and mark in (Mark.OWNED, Mark.CAREFUL, Mark.IN_FLIGHT):
                crashes = count + 1  # the owner that wrote the mark stopped too
                poison = position if mark is Mark.IN_FLIGHT else None
                self._careful[tp] = _Careful(self.careful_records, crashes, poison, committed_to=position)
                out[tp] = (position, self.metadata(tp, position))
            else:
                out[tp] = (position, mark_text(Mark.OWNED))
        return out

    def forget(self, tps: Iterable[TP]) -> None:
        for tp in tps:
            self._drop(tp)
            self._unchecked.discard(tp)
            self._taken.pop(tp, None)

    def clear(self) -> None:
        self.forget([*self._careful, *self._unchecked, *self._taken])

    def _drop(self, tp: TP) -> None:
        self._careful.pop(tp, None)
        if self.token.holder == (self, tp):
            self.token.holder = None

    def taken(self, tps: Iterable[TP]) -> dict[TP, int]:
        """The positions ``tps`` were taken at (for handing back partitions nothing was fetched from)."""
        return {tp: self._taken[tp] for tp in tps if tp in self._taken}

    # -- fetching -----------------------------------------------------------------------------

    def held(self) -> set[TP]:
        """Partitions that may not be fetched now: marks unread, or careful while a careful record (of
        any model of the worker) is in flight. While one is, ``quiet`` says nothing at all is fetched."""
        out = set(self._unchecked)
        if self.token.busy:
            out.update(self._careful)
        return out

    @property
    def quiet(self) -> bool:
        """A careful record is in flight somewhere in the worker: it runs alone, fetch nothing."""
        return self.token.busy

    def verdict(self, tp: TP, offset: int) -> Verdict:
        """What to do with a fetched record (records of a partition come in offset order)."""
        c = self._careful.get(tp)
        if c is None:
            return Verdict.RUN
        if self.token.busy or offset < c.committed_to:
            return Verdict.DEFER  # alone, and only from the marker on
        c.in_flight = offset
        self.token.holder = (self, tp)
        if offset == c.poison_at:
            return Verdict.POISON
        return Verdict.MARK

    def refetch_from(self, tp: TP, offset: int) -> int:
        """Where a deferred record's partition is fetched again from."""
        c = self._careful.get(tp)
        return max(offset, c.committed_to) if c is not None and c.in_flight is None else offset

    def in_flight(self, tp: TP) -> int | None:
        c = self._careful.get(tp)
        return c.in_flight if c is not None else None

    def in_flight_mark(self, tp: TP) -> str:
        return mark_text(Mark.IN_FLIGHT, self.crashes(tp))

    def crashes(self, tp: TP) -> int:
        c = self._careful.get(tp)
        return c.crashes if c is not None else 0

    # -- committing ---------------------------------------------------------------------------

    def metadata(self, tp: TP, position: int) -> str:
        """What a commit of ``tp`` at ``position`` carries: the in-flight mark where a careful record is
        in flight (or one marked poison waits), the careful mark elsewhere while careful, else OWNED."""
        c = self._careful.get(tp)
        if c is None:
            return mark_text(Mark.OWNED)
        if position in (c.in_flight, c.poison_at):
            return mark_text(Mark.IN_FLIGHT, c.crashes)
        return mark_text(Mark.CAREFUL, c.crashes)

    def handing(self, tp: TP, position: int) -> str:
        """What a commit that hands ``tp`` over carries: HANDED, unless it is careful. Then the next owner
        is careful too, counting the same stops (this owner did not stop: one less, which it adds back),
        and a record known to be poison stays marked; a record merely running here is not marked (it
        may still be running when the next owner takes it)."""
        c = self._careful.get(tp)
        if c is None:
            return mark_text(Mark.HANDED)
        return mark_text(Mark.IN_FLIGHT if position == c.poison_at else Mark.CAREFUL, c.crashes - 1)

    def committed(self, tp: TP, position: int) -> None:
        """A commit of ``tp`` at ``position`` succeeded: a careful partition's record before it is done,
        and the next one may be fetched (the marker names it)."""
        c = self._careful.get(tp)
        if c is None or c.in_flight is None or position <= c.in_flight:
            return
        c.in_flight, c.committed_to, c.poison_at = None, position, None
        if self.token.holder == (self, tp):
            self.token.holder = None
        c.left -= 1
        if c.left <= 0:
            del self._careful[tp]

    def careful(self, tp: TP) -> bool:
        return tp in self._careful

    def careful_any(self) -> bool:
        return bool(self._careful)

    def awaiting_commit(self) -> bool:
        """A careful record is done or running here: its commit goes out at once, not coalesced."""
        return any(c.in_flight is not None for c in self._careful.values())
