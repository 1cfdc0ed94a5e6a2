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
  group). What it had in flight is unknown, so the next ``careful_records`` records are worked one
  at a time: each is marked IN_FLIGHT (a commit of its own offset) before it runs, and committed
  (CAREFUL) after its reply is out, before the next is fetched.
- IN_FLIGHT n: an owner stopped while working on exactly that record, alone. It has stopped ``n + 1``
  workers: it is dead-lettered without being run, and the careful stretch goes on after it.

So a record that stops a worker stops at most one more — the careful owner that pins it down — and
never a third; a worker killed for another reason costs its partitions' next owner one careful
stretch (two commits a record, milliseconds each), never a lost request.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

TP = TypeVar("TP", bound=Hashable)

_PREFIX = "kinfer:"
CAREFUL_RECORDS = 256  # records worked one at a time after an owner stopped without handing over


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


@dataclass
class _Careful:
    left: int  # records still to work one at a time
    crashes: int  # owners stopped in this stretch
    poison_at: int | None  # the offset to dead-letter unread (the committed position a careful owner died at)
    in_flight: int | None = None  # the one record of the partition being worked on now
    committed_to: int = -1  # the position committed with the careful mark (the marker of the next record)


class DeliveryGuard(Generic[TP]):
    """Per partition: normal, or careful (one record at a time, each committed before the next)."""

    def __init__(self, careful_records: int = CAREFUL_RECORDS) -> None:
        self.careful_records = careful_records
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
            self._careful.pop(tp, None)
            if position < 0:
                continue
            self._taken[tp] = position
            mark, count = parse_mark(metadata)
            if self.careful_records > 0 and mark in (Mark.OWNED, Mark.CAREFUL, Mark.IN_FLIGHT):
                crashes = max(count, 0) + 1
                poison = position if mark is Mark.IN_FLIGHT else None
                self._careful[tp] = _Careful(self.careful_records, crashes, poison, committed_to=position)
                # A poison record keeps its mark until it is dead-lettered and committed past: an owner
                # that stops before getting to it must not make the next one forget it.
                out[tp] = (position, mark_text(Mark.IN_FLIGHT if poison is not None else Mark.CAREFUL, crashes))
            else:
                out[tp] = (position, mark_text(Mark.OWNED))
        return out

    def forget(self, tps: Iterable[TP]) -> None:
        for tp in tps:
            self._careful.pop(tp, None)
            self._unchecked.discard(tp)
            self._taken.pop(tp, None)

    def clear(self) -> None:
        self._careful.clear()
        self._unchecked.clear()
        self._taken.clear()

    def taken(self, tps: Iterable[TP]) -> dict[TP, int]:
        """The positions ``tps`` were taken at (for handing back partitions nothing was fetched from)."""
        return {tp: self._taken[tp] for tp in tps if tp in self._taken}

    # -- fetching -----------------------------------------------------------------------------

    def held(self) -> set[TP]:
        """Partitions that may not be fetched now: marks unread, or careful with a record in flight or
        its marker not yet committed."""
        out = set(self._unchecked)
        for tp, c in self._careful.items():
            if c.in_flight is not None:
                out.add(tp)
        return out

    def verdict(self, tp: TP, offset: int) -> Verdict:
        """What to do with a fetched record (records of a partition come in offset order)."""
        c = self._careful.get(tp)
        if c is None:
            return Verdict.RUN
        if c.in_flight is not None or offset < c.committed_to:
            return Verdict.DEFER  # one at a time (a position past the marker: the log moved on without it)
        c.in_flight = offset
        if offset == c.poison_at:
            return Verdict.POISON
        return Verdict.MARK

    def in_flight_mark(self, tp: TP) -> str:
        return mark_text(Mark.IN_FLIGHT, self.crashes(tp))

    def crashes(self, tp: TP) -> int:
        c = self._careful.get(tp)
        return c.crashes if c is not None else 0

    # -- committing ---------------------------------------------------------------------------

    def metadata(self, tp: TP) -> str:
        """What a commit of ``tp`` carries: the careful mark while careful, else OWNED."""
        c = self._careful.get(tp)
        return mark_text(Mark.CAREFUL, c.crashes) if c is not None else mark_text(Mark.OWNED)

    def committed(self, tp: TP, position: int) -> None:
        """A commit of ``tp`` at ``position`` succeeded: a careful partition's record before it is done,
        and the next one may be fetched (the marker names it)."""
        c = self._careful.get(tp)
        if c is None or c.in_flight is None or position <= c.in_flight:
            return
        c.in_flight, c.committed_to, c.poison_at = None, position, None
        c.left -= 1
        if c.left <= 0:
            del self._careful[tp]

    def careful(self, tp: TP) -> bool:
        return tp in self._careful

    def awaiting_commit(self) -> bool:
        """A careful partition waits for a commit before its next record: commit now, not coalesced."""
        return any(c.in_flight is not None for c in self._careful.values())
