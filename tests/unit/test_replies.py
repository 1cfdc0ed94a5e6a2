"""Reply correlation without a broker: batched replies reach each caller once; bad replies are dropped."""

from __future__ import annotations

import asyncio

import msgpack
import redis.asyncio as aioredis
from aiokafka.errors import KafkaConnectionError

from consumers.replies import Delivery, ReplySink, ReplyTopics
from producers.replies import ReplyMux
from topics import Chunk, ReplyBatch, ReplyRoute, Result, Status, Unavailable, Usage, pack


def result(rid: str, output: int = 1) -> Result:
    return Result(rid, "m", Status.OK, outputs=[output])


async def test_a_batch_of_replies_reaches_each_caller_exactly_once() -> None:
    mux = ReplyMux(aioredis.Redis(), "kinfer:reply:test")
    waiters = {rid: mux.expect(rid) for rid in ("a", "b", "c")}
    stream = mux.open_stream("s")
    mux._receive(pack(ReplyBatch([result("a", 1), Chunk("s", "m", 0, text="x"), result("b", 2), result("a", 9)])),
                 "redis")
    assert waiters["a"].result().outputs == [1]  # the first answer wins; the repeat is a duplicate
    assert waiters["b"].result().outputs == [2]
    assert not waiters["c"].done()
    assert mux.duplicates == 1
    mux._receive(pack(ReplyBatch([result("c", 3), Chunk("s", "m", 1, final=True, status=Status.OK,
                                                         usage=Usage(2, 2))])), "kafka")
    assert waiters["c"].result().outputs == [3]
    assert [c.seq for c in (await stream.next(1.0), await stream.next(1.0))] == [0, 1]
    assert mux.received == {"redis": 3, "kafka": 2}
    for rid in ("a", "b", "c", "s"):
        mux.forget(rid)


async def test_malformed_replies_are_counted_and_dropped_and_the_reader_lives_on() -> None:
    mux = ReplyMux(aioredis.Redis(), "kinfer:reply:test")
    waiter = mux.expect("r")
    for bad in (
        b"\xc1",
        msgpack.packb({"v": 1, "t": "res", "id": "r", "model": "m", "status": "ok", "timings": [1]}),
        msgpack.packb({"v": 1, "t": "res", "id": "r", "model": "m", "status": "maybe"}),
        msgpack.packb({"v": 1, "t": "batch", "replies": [{"t": "req"}]}),
        msgpack.packb({"v": 2, "t": "res", "id": "r", "model": "m", "status": "ok"}),
    ):
        mux._receive(bad, "redis")
    assert mux.malformed == 5 and not waiter.done()
    mux._receive(pack(result("r")), "redis")
    assert waiter.result().ok
    mux.forget("r")


class _Metadata:
    """A broker's topic list, counting lookups."""

    def __init__(self, topics: set[str]) -> None:
        self.topics, self.lookups = topics, 0

    async def __call__(self) -> set[str]:
        self.lookups += 1
        await asyncio.sleep(0)
        return set(self.topics)


async def test_reply_topics_are_looked_up_once_and_a_missing_one_is_remembered() -> None:
    metadata = _Metadata({"replies.default"})
    topics = ReplyTopics(metadata)
    # Concurrent askers share one lookup.
    found = await asyncio.gather(topics.exists("replies.default"), topics.exists("replies.gone"))
    assert found == [True, False] and metadata.lookups == 1
    assert topics.known_missing("replies.gone") and not topics.known_missing("replies.default")
    assert not await topics.exists("replies.gone") and metadata.lookups == 1  # remembered, not asked again
    metadata.topics.add("replies.new")
    assert await topics.exists("replies.new") and metadata.lookups == 2  # created since: found at once


async def test_a_lookup_that_fails_counts_as_existing_so_the_send_is_retried_as_transient() -> None:
    async def down() -> set[str]:
        raise KafkaConnectionError("broker down")

    topics = ReplyTopics(down)
    assert await topics.exists("replies.x") and not topics.known_missing("replies.x")


class _Producer:
    def __init__(self) -> None:
        self.sent: list[str] = []

    async def send(self, topic: str, value: bytes, key: bytes) -> asyncio.Future[None]:
        self.sent.append(topic)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


async def test_replies_to_a_missing_topic_are_counted_undelivered_not_retried() -> None:
    producer = _Producer()
    sink = ReplySink(producer, aioredis.Redis(), ReplyTopics(_Metadata({"replies.default"})))  # type: ignore[arg-type]
    undelivered = await sink.publish([
        Delivery(ReplyRoute(kafka="replies.default"), result("a")),
        Delivery(ReplyRoute(kafka="replies.nowhere"), result("b")),
    ])
    assert undelivered == 1 and producer.sent == ["replies.default"]


async def test_a_reader_that_dies_fails_the_waiters_and_readiness_says_so() -> None:
    mux = ReplyMux(aioredis.Redis(), "kinfer:reply:test")
    waiter = mux.expect("w")
    assert mux.reading

    async def broken() -> None:
        raise RuntimeError("a bug in a reader")

    mux._spawn(broken(), "test")
    await asyncio.sleep(0.01)
    assert not mux.reading and isinstance(waiter.exception(), Unavailable)
