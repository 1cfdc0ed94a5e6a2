"""What each worker has answered, by partition: the queue's true start while commits cannot land.

A worker commits its offsets through its consumer group's coordinator, one broker. When that broker
dies or stalls, commits stop for seconds (until the group finds a new coordinator) although the
worker goes on fetching, computing and answering from the partitions' leaders. Read from committed
offsets alone, every partition of the model then looks stopped, its lag grows at the arrival rate,
and the lag monitor would tell producers to refuse a model that is serving.

So every worker also writes, per model it serves, the position it would commit for each partition it
owns (everything below it is answered) to the Redis hash ``kinfer:answered:<model>``, field its worker
id: at every commit round that moved a position, and at least every ``ANSWERED_EVERY_S`` regardless.
The lag monitor counts a partition's queue from the higher of its committed offset and the freshest
report (at most ``ANSWERED_FRESH_MS`` old), never past the log's end.

What this changes is the *estimate* of the queue, never delivery: a record is fetched again after a
handover from the committed offset alone, whatever a report says (at-least-once is Kafka's).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kinfer.topics.record import Count, Record, WallMs, WorkerName

ANSWERED_PREFIX = "kinfer:answered:"
ANSWERED_EVERY_S = 1.0  # a worker writes its report at least this often while it owns partitions
ANSWERED_FRESH_MS = 3_000  # a report older than this is no evidence (its worker may be gone or paused)
ANSWERED_FORGET_MS = 600_000  # one this old is a dead worker's: removed by the lag monitor
MAX_POSITIONS = 4 * 4_096  # partitions one report may name: four priorities of 4,096 partitions


def answered_key(model: str) -> str:
    return f"{ANSWERED_PREFIX}{model}"


class Position(Record, frozen=True, array_like=True):
    """One partition of a model's request topics (by priority) and the answered position in it."""

    priority: Annotated[int, msgspec.Meta(ge=0, le=3)]
    partition: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
    position: Count


class Answered(Record, frozen=True):
    """A worker's report for one model. Its fields are held to their ranges when decoded; whether
    ``updated_ms`` is fresh or dated ahead of now is the reader's to judge."""

    max_bytes = 262_144  # MAX_POSITIONS entries of at most 17 bytes, and room
    dated_by = "updated_ms"

    worker: WorkerName
    updated_ms: WallMs
    positions: Annotated[list[Position], msgspec.Meta(max_length=MAX_POSITIONS)] = msgspec.field(
        default_factory=list)


__all__ = ["ANSWERED_EVERY_S", "ANSWERED_FORGET_MS", "ANSWERED_FRESH_MS", "ANSWERED_PREFIX", "MAX_POSITIONS",
           "Answered", "Position", "answered_key"]
