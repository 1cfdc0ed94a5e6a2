"""Reply correlation without a broker: batched replies reach each caller once; bad replies are dropped."""

from __future__ import annotations

import asyncio
import contextlib

import msgpack
import msgspec
import pytest
import redis.asyncio as aioredis
from aiokafka.errors import KafkaConnectionError
from redis.exceptions import ConnectionError as RedisConnectionError

from kinfer.consumers.replies import Delivery, ReplySink, ReplyTopics
from kinfer.producers.replies import ReplyMux
from kinfer.topics import (
    Chunk,
    ReplyBatch,
    ReplyRoute,
    Result,
    Sealed,
    Status,
    Unavailable,
    Usage,
    decode_replies,
    pack,
    seal,
)
from kinfer.topics.auth import seal_box
from kinfer.topics.envelope import ReplyRefused


def result(rid: str, output: int = 1) -> Result:
    return Result(rid, "m", Status.OK, outputs=[output])


async def test_a_batch_of_replies_reaches_each_caller_exactly_once() -> None:
    mux = ReplyMux(aioredis.Redis(), "kinfer:reply:test")
    waiters = {rid: mux.expect(rid) for rid in ("a", "b", "c")}
    stream = mux.open_stream("s")
    mux._receive(seal(ReplyBatch([result("a", 1), Chunk("s", "m", 0, text="x"), result("b", 2), result("a", 9)]),
                      mux.key), "redis")
    assert waiters["a"].result().outputs == [1]  # the first answer wins; the repeat is a duplicate
    assert waiters["b"].result().outputs == [2]
    assert not waiters["c"].done()
    assert mux.duplicates == 1
    mux._receive(seal(ReplyBatch([result("c", 3), Chunk("s", "m", 1, final=True, status=Status.OK,
                                                         usage=Usage(2, 2))]), mux.key), "kafka")
    assert waiters["c"].result().outputs == [3]
    assert [c.seq for c in (await stream.next(1.0), await stream.next(1.0))] == [0, 1]
    assert mux.received == {"redis": 3, "kafka": 2}
    for rid in ("a", "b", "c", "s"):
        mux.forget(rid)


def sealed_bytes(body: bytes, key: bytes) -> bytes:
    """Any bytes as a sealed body: what only a worker (or a bug in one) could send."""
    return msgspec.msgpack.encode(Sealed(*seal_box(key, body)))


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
        mux._receive(sealed_bytes(bad, mux.key), "redis")  # sealed with our key, not a reply inside
        mux._receive(bad, "redis")
    mux._receive(None, "kafka")  # a tombstone
    assert mux.malformed == 7 and mux.forged == 4 and not waiter.done()
    assert mux.refused == {("redis", "malformed"): 6, ("redis", "unsealed"): 4, ("kafka", "malformed"): 1}
    mux._receive(seal(result("r"), mux.key), "redis")
    assert waiter.result().ok
    mux.forget("r")


async def test_a_forged_reply_is_dropped_and_counted_and_the_real_one_delivered() -> None:
    mux = ReplyMux(aioredis.Redis(), "kinfer:reply:t:test")
    waiter = mux.expect("r")
    mux._receive(pack(result("r", 666)), "redis")  # a forger who read the id and the channel: unsealed
    mux._receive(seal(result("r", 666), b"k" * 16), "redis")  # sealed, but not with our key
    mux._receive(seal(result("other", 1), b"k" * 16), "kafka")  # another client's reply on a shared topic
    assert not waiter.done() and mux.forged == 2 and mux.unknown == 1
    mux._receive(seal(result("r", 1), mux.key), "redis")
    assert waiter.result().outputs == [1]
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


async def test_a_reader_that_fails_restarts_with_backoff_and_readiness_says_so_meanwhile() -> None:
    mux = ReplyMux(aioredis.Redis(), "kinfer:reply:test")
    mux.RESTART_FIRST_S = mux.RESTART_MAX_S = 0.2
    waiter = mux.expect("w")
    runs: list[str] = []
    down = asyncio.Event()
    serving = asyncio.Event()

    async def reader() -> None:
        runs.append("run")
        if len(runs) == 1:
            down.set()
            raise RuntimeError("a bug in a reader")
        serving.set()
        await asyncio.Event().wait()  # reads on

    assert mux.reading
    mux._spawn(reader, "test")
    await down.wait()
    await asyncio.sleep(0)
    assert not mux.reading and mux.restarts["test"] == 1  # down: readiness says so
    await asyncio.wait_for(serving.wait(), 5.0)
    assert mux.reading and len(runs) == 2  # restarted after the backoff, and ready again
    assert not waiter.done()  # its reply may still come: nobody was failed for it
    mux._receive(seal(result("w"), mux.key), "redis")
    assert waiter.result().ok
    mux.forget("w")
    await mux.close()


class _Pipe:
    def __init__(self, sent: list[tuple[str, bytes]]) -> None:
        self.sent = sent

    async def __aenter__(self) -> _Pipe:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def publish(self, channel: str, data: bytes) -> None:
        self.sent.append((channel, data))

    async def execute(self) -> list[int]:
        return [1] * len(self.sent)


class _Redis:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def pipeline(self, transaction: bool) -> _Pipe:
        return _Pipe(self.sent)


async def test_replies_are_sealed_with_each_request_key_and_batched_only_under_one_key() -> None:
    redis = _Redis()
    sink = ReplySink(_Producer(), redis, ReplyTopics(_Metadata(set())))  # type: ignore[arg-type]
    a, b = b"a" * 16, b"b" * 16
    route = ReplyRoute.channel("kinfer:reply:t:c")
    await sink.publish([Delivery(route, result("1"), True, a), Delivery(route, result("2"), True, b),
                        Delivery(route, result("3"), True, a), Delivery(route, result("4"), False, None)])
    opened = []
    for _, data in redis.sent:
        for key in (a, b, None):
            with contextlib.suppress(ReplyRefused):
                opened.append((key, [r.id for r in decode_replies(data, key).replies]))
                break
    assert sorted(opened, key=str) == sorted([(a, ["1", "3"]), (b, ["2"]), (None, ["4"])], key=str)


class _DownRedis:
    """A Redis whose every pipeline fails, counting the attempts."""

    def __init__(self) -> None:
        self.tries = 0
        self.up = False

    def pipeline(self, transaction: bool) -> _Pipe:
        self.tries += 1
        if not self.up:
            raise RedisConnectionError("stalled")
        return _Pipe([])


async def test_after_redis_fails_replies_with_a_fallback_skip_it_for_a_while_then_try_it_again() -> None:
    now = [100.0]
    redis, producer = _DownRedis(), _Producer()
    sink = ReplySink(producer, redis, ReplyTopics(_Metadata({"replies.default"})),  # type: ignore[arg-type]
                     clock=lambda: now[0])
    route = ReplyRoute.channel("kinfer:reply:t:c", "replies.default")
    await sink.publish([Delivery(route, result("1"))])
    assert redis.tries == 1 and producer.sent == ["replies.default"]  # failed over, and remembered
    await sink.publish([Delivery(route, result("2")), Delivery(route, result("3"))])
    assert redis.tries == 1 and producer.sent == ["replies.default"] * 3 and sink.redis_skipped == 2
    with pytest.raises(Unavailable):  # no fallback: Redis is its only way, so it is tried (and fails)
        await sink.publish([Delivery(ReplyRoute.channel("kinfer:reply:t:c"), result("4"))])
    assert redis.tries == 2
    now[0] += 1.5  # past the retry interval: Redis is tried again, and it is back
    redis.up = True
    await sink.publish([Delivery(route, result("5"))])
    assert redis.tries == 3 and producer.sent == ["replies.default"] * 3


async def test_a_reply_just_after_its_caller_timed_out_is_late_not_unknown() -> None:
    mux = ReplyMux(aioredis.Redis(), "kinfer:reply:test")
    waiter = mux.expect("slow")
    waiter.set_exception(TimeoutError())  # the deadline fired; the caller has not forgotten it yet
    mux._receive(seal(result("slow"), mux.key), "redis")
    assert (mux.late, mux.unknown, list(mux.late_ids)) == (1, 0, ["slow"])
    waiter.exception()
    mux.forget("slow")
    mux._receive(seal(result("slow"), mux.key), "kafka")  # the fallback copy: late again, never a duplicate answer
    assert (mux.late, mux.duplicates) == (2, 0)
    await mux.close()


class _Connection:
    """A Redis pub/sub connection the test can break: one subscription, confirmed, then what is sent."""

    def __init__(self, redis: _BreakableRedis) -> None:
        self.redis = redis
        self.subscribed = False
        self._confirm = False
        self.lost = asyncio.Event()

    async def subscribe(self, channel: str) -> None:
        if self.redis.down:
            raise RedisConnectionError("refused")
        self.subscribed = self._confirm = True
        self.redis.live = self

    async def get_message(self, timeout: float | None = None) -> dict[str, object] | None:  # noqa: ASYNC109 -- redis-py's signature
        if self._confirm:
            self._confirm = False
            return {"type": "subscribe"}
        await self.lost.wait()
        raise RedisConnectionError("connection lost")

    async def aclose(self) -> None:
        self.subscribed = False


class _BreakableRedis:
    """Hands out ``_Connection``s; ``drop`` ends the live one and refuses new ones until ``serve``."""

    def __init__(self) -> None:
        self.down = False
        self.live: _Connection | None = None

    def pubsub(self, **_: object) -> _Connection:
        return _Connection(self)

    def drop(self) -> None:
        self.down = True
        if self.live is not None:
            self.live.lost.set()

    def serve(self) -> None:
        self.down = False


async def test_requests_waiting_on_the_channel_are_asked_again_when_it_is_subscribed_anew() -> None:
    """Between losing its channel and subscribing again, a client hears nothing that is published there,
    and a worker whose PUBLISH another subscriber heard sends it nowhere else. So what waits on the channel
    when it is back is asked again, once per loss; what was answered, forgotten or routed elsewhere is not."""
    redis = _BreakableRedis()
    mux = ReplyMux(redis, "kinfer:reply:t:test")  # type: ignore[arg-type]
    await mux.start()
    asked: list[str] = []
    waiting = {rid: mux.expect(rid, lambda rid=rid: asked.append(rid)) for rid in ("answered", "forgotten", "a")}
    mux.expect("kafka")  # routed to the topic: never asked again
    stream = mux.open_stream("s", lambda: asked.append("s"))
    mux._receive(seal(result("answered"), mux.key), "redis")
    assert waiting["answered"].done()
    mux.forget("answered")
    mux.forget("forgotten")

    redis.drop()
    await until(lambda: not mux.redis_healthy)
    mux.expect("meanwhile")  # sent while the channel is down: its route is the topic
    assert asked == []  # nothing is asked again while nobody can be told
    redis.serve()
    await until(lambda: mux.redis_healthy)
    assert sorted(asked) == ["a", "s"] and mux.asked_again == 2

    later = mux.expect("later", lambda: asked.append("later"))  # sent after: its reply comes here
    redis.drop()
    redis.serve()
    await until(lambda: mux.asked_again == 5)
    assert sorted(asked) == ["a", "a", "later", "s", "s"]
    assert not later.done() and not stream.finished
    await mux.close()


async def until(predicate: object, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")
