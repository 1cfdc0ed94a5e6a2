"""The worker's answered report: every owned partition's safe position, written when one moved and at
least every ``ANSWERED_EVERY_S`` regardless; nothing for a model the worker is not a member for."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiokafka import TopicPartition

from kinfer.consumers.feed import Feed
from kinfer.consumers.offsets import OffsetTracker
from kinfer.consumers.progress import AnsweredReporter
from kinfer.topics.names import request_topic
from kinfer.topics.progress import ANSWERED_EVERY_S, Answered, Position

P0, P2 = TopicPartition(request_topic("m", 0), 0), TopicPartition(request_topic("m", 2), 3)


@dataclass
class _Consumer:
    owned: set[TopicPartition] = field(default_factory=set)

    def assignment(self) -> set[TopicPartition]:
        return self.owned


def feed(consumer: _Consumer | None) -> Feed:
    f = Feed.__new__(Feed)  # only what the reporter reads: the consumer, the tracker, priorities
    f.consumer = consumer  # type: ignore[assignment]
    f.tracker = OffsetTracker()
    f.priority_of = {}
    return f


def test_positions_are_reported_when_they_move_and_refreshed_while_they_do_not() -> None:
    consumer = _Consumer({P0, P2})
    m = feed(consumer)
    reporter = AnsweredReporter("w1", {"m": m, "cold": feed(None)})
    for offset in (10, 11, 12):
        m.tracker.track(P0, offset)
    m.tracker.track(P2, 4)
    m.tracker.done(P0, 10)
    m.tracker.done(P2, 4)

    first = reporter.due(0.0)
    assert list(first) == ["m"]  # the cold model has no consumer: nothing to say
    assert isinstance(first["m"], Answered) and first["m"].worker == "w1"
    assert first["m"].positions == [Position(0, 0, 11), Position(2, 3, 5)]  # 11 waits: position stops there
    reporter.sent(first, 0.0)

    assert reporter.due(0.5) == {}  # nothing moved
    m.tracker.done(P0, 11)
    moved = reporter.due(0.6)
    assert moved["m"].positions == [Position(0, 0, 12), Position(2, 3, 5)]
    reporter.sent(moved, 0.6)
    assert reporter.due(0.6 + ANSWERED_EVERY_S)["m"].positions == moved["m"].positions  # a refresh: still fresh


def test_a_failed_write_is_written_again_and_a_revoked_partition_is_left_out() -> None:
    consumer = _Consumer({P0, P2})
    m = feed(consumer)
    reporter = AnsweredReporter("w1", {"m": m})
    m.tracker.track(P0, 0)
    m.tracker.track(P2, 0)
    assert reporter.due(0.0)  # not marked sent (Redis refused): due again at once
    assert reporter.due(0.1)
    consumer.owned = {P0}
    m.tracker.forget([P2])
    assert reporter.due(0.2)["m"].positions == [Position(0, 0, 0)]
