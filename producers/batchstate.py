"""A batch's state over its lifetime, as a join: no I/O.

Several writers change one batch: the runner (its progress, its end), and any gateway (a cancel), each
from the state it has read, which may be stale by the time its write lands. So a state is never simply
replaced. Every reader of ``kinfer.batches`` folds each record it reads into what it knows with
``merge``, and every writer writes ``merge(current, changed)``. ``merge`` only moves a batch forward:

- **A terminal state is never left.** The first terminal state read stands; anything after it is
  ignored.
- **A cancel is never lost.** ``cancelling_at``, once set, stays set. A batch that is not terminal
  and has been asked to cancel is ``cancelling`` (``finalizing`` if it has got that far), and the
  terminal state it reaches is ``cancelled``, unless it failed. What was answered before the cancel is
  still its output.
- **Nothing goes back.** The status never returns to an earlier stage (validating, in progress,
  cancelling or finalizing, terminal). ``published`` and the first ``in_progress_at`` stay. The
  counts are those with more lines ended.

So a progress write computed before a cancel and landing after it keeps the cancel, and so does a
terminal write (``completed`` becomes ``cancelled``): the writes commute with the cancel.
"""

from __future__ import annotations

from msgspec.structs import replace

from kinfer.topics.batches import TERMINAL, BatchObject, RequestCounts

_STAGE = {"validating": 0, "in_progress": 1, "cancelling": 2, "finalizing": 3, **dict.fromkeys(TERMINAL, 4)}
_ENDED_BY_CANCEL = ("completed", "expired")  # what a cancel turns into ``cancelled``


def merge(known: BatchObject | None, incoming: BatchObject) -> BatchObject:
    """What a reader knows of a batch after reading ``incoming`` where it knew ``known`` (None: nothing)."""
    if known is None:
        return _settled(incoming)
    if known.terminal:
        return known
    cancel = known.cancelling_at or incoming.cancelling_at
    status = max(known.status, incoming.status, key=stage)
    merged = replace(
        incoming,
        status=status,
        cancelling_at=cancel,
        published=known.published or incoming.published,
        in_progress_at=known.in_progress_at or incoming.in_progress_at,
        finalizing_at=known.finalizing_at or incoming.finalizing_at,
        request_counts=_further(known.request_counts, incoming.request_counts),
    )
    return _settled(merged)


def stage(status: str) -> int:
    """How far along a status is: validating 0, in progress 1, cancelling 2, finalizing 3, terminal 4."""
    return _STAGE[status]


def _settled(batch: BatchObject) -> BatchObject:
    """A batch asked to cancel: ``cancelling`` until it finalizes, ``cancelled`` where it would end."""
    if batch.cancelling_at is None:
        return batch
    if batch.status in ("validating", "in_progress"):
        return replace(batch, status="cancelling")
    if batch.status in _ENDED_BY_CANCEL:
        ended = batch.completed_at if batch.status == "completed" else batch.expired_at
        return replace(batch, status="cancelled", cancelled_at=batch.cancelled_at or ended,
                       completed_at=None, expired_at=None)
    return batch


def _further(a: RequestCounts, b: RequestCounts) -> RequestCounts:
    """Of two counts of one batch, the one with more lines ended (the later one on a tie)."""
    return a if a.completed + a.failed > b.completed + b.failed else b


def cancelled(batch: BatchObject, now: int) -> BatchObject:
    """``batch`` asked to cancel at ``now`` (a terminal batch is as it was: nothing to cancel)."""
    if batch.terminal:
        return batch
    return merge(batch, replace(batch, cancelling_at=batch.cancelling_at or now))


def ending(batch: BatchObject, answered: int, lines: int) -> str:
    """The terminal status a batch finalizing now reaches: cancelled if it was asked to, expired if a line
    is unanswered (its window passed), else completed."""
    if batch.cancelling_at is not None:
        return "cancelled"
    return "expired" if answered < lines else "completed"


__all__ = ["cancelled", "ending", "merge", "stage"]
