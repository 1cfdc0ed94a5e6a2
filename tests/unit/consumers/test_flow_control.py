"""A worker's flow control for background work (p3), with a stand-in consumer (no broker, no clock).

What it promises: background records are fetched whatever the interactive load (the core, not the
fetch, decides when they run), up to the core's ``background_room``, and again once half of that has
run; what a fetch brings beyond the room is left on the broker (the partition is sought back), never
buffered; a draining model fetches none.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kinfer.batcher import BatchPolicy
from kinfer.consumers.feed import Feed, Signals
from kinfer.consumers.membership import Membership
from kinfer.consumers.poison import CarefulToken
from kinfer.consumers.runners import ModelSpec
from kinfer.consumers.settings import WorkerSettings
from kinfer.topics import Priority, ReplyRoute, Request, pack
from kinfer.topics.envelope import now_ms
from tests.unit.consumers.test_cores import T0, batch_core, job, request

P1, P3 = TopicPartition("infer.m.p1", 0), TopicPartition("infer.m.p3", 0)
ROOM = 8  # BatchCore: four batches of two


class StandInConsumer:
    """What flow control and ``_take`` use of an ``AIOKafkaConsumer``."""

    def __init__(self, *tps: TopicPartition) -> None:
        self.tps, self.held, self.seeks = set(tps), set[TopicPartition](), list[tuple[TopicPartition, int]]()

    def assignment(self) -> set[TopicPartition]:
        return set(self.tps)

    def paused(self) -> set[TopicPartition]:
        return set(self.held)

    def pause(self, *tps: TopicPartition) -> None:
        self.held |= set(tps)

    def resume(self, *tps: TopicPartition) -> None:
        self.held -= set(tps)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks.append((tp, offset))


def setup(spawned: list[Any] | None = None) -> tuple[Membership, Feed, StandInConsumer]:
    core, _, observer = batch_core(BatchPolicy(max_batch_size=2))
    assert core.background_room() == ROOM
    feed = Feed(core)
    consumer = StandInConsumer(P1, P3)
    feed.consumer = consumer  # type: ignore[assignment]
    settings = WorkerSettings(models=(ModelSpec("m", "noop"),), bootstrap="127.0.0.1:1", redis_url="redis://x")

    def spawn(coro: Any) -> Any:
        coro.close()
        if spawned is None:
            raise AssertionError("nothing is spawned here")
        spawned.append(coro)  # a refusal (dead letter and reply), not run here

    async def commit(feed: Feed, handover: bool) -> None: ...

    membership = Membership(settings, {"m": feed}, Signals(), observer, CarefulToken(), spawn=spawn,
                            spawn_tracked=spawn, commit=commit, computing=lambda: False)
    return membership, feed, consumer


def flow(membership: Membership, feed: Feed, consumer: StandInConsumer) -> set[TopicPartition]:
    membership._flow_control(feed, consumer)  # type: ignore[arg-type]
    return consumer.paused()


def background(feed: Feed, n: int, first: int = 0) -> None:
    for i in range(first, first + n):
        feed.core.admit(job(request(f"b{i}", priority=Priority.P3), partition=P3, offset=i), T0)


def test_background_is_fetched_while_interactive_work_waits_up_to_its_room_and_again_at_half() -> None:
    membership, feed, consumer = setup()
    for i in range(5):  # interactive work buffered: the core runs it first, the fetch need not wait for it
        feed.core.admit(job(request(f"i{i}"), partition=P1, offset=i), T0)
    assert flow(membership, feed, consumer) == set()
    background(feed, ROOM)  # the room is full: no more
    assert flow(membership, feed, consumer) == {P3}
    while True:  # slices run
        feed.core.background.next_batch(T0, max_batch_s=None)
        if feed.core.background_buffered() <= ROOM // 2:
            break
        assert flow(membership, feed, consumer) == {P3}  # more than half left: not yet
    assert flow(membership, feed, consumer) == set()


def test_a_draining_model_fetches_no_background_work() -> None:
    membership, feed, consumer = setup()
    for step in ("load", "warm", "join", "joined", "drain"):
        getattr(feed.lifecycle, step)()
    assert feed.lifecycle.draining and P3 in flow(membership, feed, consumer)


def valid(offset: int) -> bytes:
    created = now_ms()
    return pack(Request(id=f"r{offset}", model="m", priority=Priority.P3, tenant="t", created_ms=created,
                        deadline_ms=created + 3_600_000, inputs=("x",), reply=ReplyRoute.channel("kinfer:reply:t:c")))


def record(offset: int, value: bytes | None = None) -> ConsumerRecord[bytes, bytes]:
    value = valid(offset) if value is None else value
    return ConsumerRecord(P3.topic, P3.partition, offset, now_ms(), 0, None, value, None, 0, len(value), ())


HOSTILE = st.one_of(
    st.binary(max_size=256),  # anything at all
    st.integers(1, 200_000).map(lambda depth: b"\x91" * depth + b"\xc0"),  # nesting past any recursion limit
    st.sampled_from([b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00",  # NaN, inf: a float where a map belongs
                     b"\xcb\x7f\xf0\x00\x00\x00\x00\x00\x00", b"\xdd\xff\xff\xff\xff",  # an array of 4e9
                     b"\xdb\xff\xff\xff\xff" + b"x" * 16]),  # a string claiming 4 GiB
)


def test_background_records_beyond_the_room_stay_on_the_broker() -> None:
    membership, feed, consumer = setup()
    background(feed, 3, first=100)
    membership._take(feed, consumer, P3, [record(i) for i in range(20)], T0, now_ms())  # type: ignore[arg-type]
    assert feed.core.background_buffered() == ROOM
    assert consumer.seeks == [(P3, ROOM - 3)]  # the first record not taken is fetched again, later
    assert feed.tracker.in_flight() == ROOM - 3  # only what was taken waits for its commit


def test_taking_no_background_record_when_the_room_is_full() -> None:
    membership, feed, consumer = setup()
    background(feed, ROOM)
    membership._take(feed, consumer, P3, [record(7)], T0, now_ms())  # type: ignore[arg-type]
    assert consumer.seeks == [(P3, 7)] and feed.core.background_buffered() == ROOM


@settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=st.lists(st.one_of(st.none(), HOSTILE), min_size=1, max_size=30), held=st.integers(0, ROOM))
def test_any_background_records_are_each_taken_refused_or_left_on_the_broker(
    values: list[bytes | None], held: int
) -> None:
    spawned: list[Any] = []
    membership, feed, consumer = setup(spawned)
    background(feed, held, first=1_000)
    records = [record(i, v) for i, v in enumerate(values)]  # None: a valid request
    membership._take(feed, consumer, P3, records, T0, now_ms())  # type: ignore[arg-type]
    assert feed.core.background_buffered() <= ROOM  # never beyond the room, whatever came
    taken = feed.tracker.in_flight()  # admitted or refused: each waits for its commit
    assert feed.core.background_buffered() - held + len(spawned) == taken
    # The rest, from the first record not taken, stays on the broker.
    assert consumer.seeks == ([] if taken == len(records) else [(P3, taken)])


@pytest.fixture(autouse=True)
def _loop() -> Any:  # Signals makes asyncio events
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield
    loop.close()
    asyncio.set_event_loop(None)
