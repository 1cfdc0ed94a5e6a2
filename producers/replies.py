"""Reply correlation: one Redis pub/sub subscription per client, futures keyed by request id.

Every reply reader survives any single message: each one is opened by ``decode_replies`` (total:
replies or ``ReplyRefused``) inside its own ``try``, and what it refuses is counted by reader and
reason (``kinfer_client_replies_refused_total``). A reader that fails for any other reason restarts
with backoff (``kinfer_client_reply_reader_restarts_total``), and ``ReplyMux.reading`` is False while
it is down, which the gateway's ``/readyz`` reports.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Coroutine
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from kinfer.producers import metrics
from kinfer.producers.streams import StreamBuffer
from kinfer.topics import Chunk, KinferError, Reply, ReplyRoute, Result, Unavailable, decode_replies, tracing
from kinfer.topics.auth import new_reply_key
from kinfer.topics.backoff import Backoff
from kinfer.topics.connect import kafka_options
from kinfer.topics.envelope import ReplyRefused
from kinfer.topics.readers import close_pubsub

log = logging.getLogger(__name__)


async def stop_task(task: asyncio.Task[None]) -> None:
    """Cancel a reader task and wait for it, insisting.

    On Python 3.11 a cancellation that lands as an ``asyncio.timeout`` inside redis-py's
    ``get_message(timeout=...)`` expires can be swallowed (turned into a timeout), and the reader
    loops on; one ``cancel()`` is then not enough, and awaiting the task would hang.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.5)
    if not task.cancelled() and task.exception() is not None:
        log.debug("reader task ended with %r", task.exception())


class ReplyMux:
    """Owns the client's reply sources and hands each result to the caller waiting for it.

    Two sources feed one dispatcher: the client's Redis pub/sub channel (fast, at most once) and,
    when the client has one, a Kafka reply topic (durable). Requests name the Redis channel with the
    topic as fallback while Redis is healthy, and the topic alone while it is not; the Redis reader
    reconnects in the background. Either way a caller sees exactly one result per request.

    A result whose id nobody waits for is dropped. Recently finished ids are remembered (bounded)
    to tell the two kinds of stray reply apart: ``duplicates`` are second copies of an answered
    request (a worker redelivery after a crash); ``late`` are replies to requests whose caller had
    already given up.

    A reply published on the channel while the client is not subscribed to it reaches nobody who reads
    it: Redis keeps nothing for an absent subscriber, and a worker whose PUBLISH some other subscriber of
    the channel heard does not send the reply to the fallback topic. So every request still waiting on
    the channel when the client subscribes to it anew (after losing it) is asked again: the ``ask_again``
    it was registered with publishes it once more, byte for byte (``asked_again`` counts them). Its copy
    is answered on the channel the client reads again; a second answer is a duplicate, dropped by id.

    Only replies sealed with this client's key are taken. On its own Redis channel anything else is
    ``forged`` (only workers may publish there); on a shared reply topic a message that does not open
    is another client's (``unknown``): it cannot be read, and cannot be told from a forgery.
    """

    RECENT = 50_000  # finished request ids remembered for the counters above
    RESTART_FIRST_S = 0.1  # a failed reader restarts after this, doubling up to RESTART_MAX_S
    RESTART_MAX_S = 5.0

    def __init__(self, redis: aioredis.Redis, channel: str, reply_topic: str | None = None,
                 bootstrap: str | None = None, prefer_kafka: bool = False) -> None:
        self.channel = channel
        self.prefer_kafka = prefer_kafka  # every reply over the topic, even while Redis is fine
        self.reply_topic = reply_topic
        self.duplicates = 0
        self.late = 0
        self.late_ids: deque[str] = deque(maxlen=self.RECENT)  # the requests those late replies answered
        self.unknown = 0  # replies for ids this client never sent, and other clients' on a shared topic
        self.malformed = 0  # messages that are not replies (dropped)
        self.forged = 0  # messages on our own channel not sealed with our key (dropped)
        self.legacy = 0  # replies under the older HMAC seal (taken: a worker not upgraded yet)
        self.refused: Counter[tuple[str, str]] = Counter()  # (reader, reason) -> messages dropped
        self.restarts: Counter[str] = Counter()  # reader -> restarts after a failure
        self.key = new_reply_key()  # our requests carry it; workers seal our replies with it
        self.redis_healthy = False
        self.received = {"redis": 0, "kafka": 0}  # replies read from each source
        self.asked_again = 0  # requests published again after the channel was subscribed anew
        self._bootstrap = bootstrap
        self._recent: OrderedDict[str, bool] = OrderedDict()  # id → answered (False: abandoned)
        self._redis = redis
        self._pubsub = redis.pubsub(ignore_subscribe_messages=False)
        self._waiters: dict[str, asyncio.Future[Result]] = {}
        self._streams: dict[str, StreamBuffer] = {}
        self._ask_again: dict[str, Callable[[], None]] = {}  # waiting on the channel: how to ask again
        self._tasks: list[asyncio.Task[None]] = []
        self._kafka: AIOKafkaConsumer | None = None
        self._down: dict[str, BaseException] = {}  # reader -> why it is not running now

    @property
    def reading(self) -> bool:
        """Every reply reader runs now (False while one waits to restart after a failure)."""
        return not self._down

    def route(self) -> ReplyRoute:
        """Where the next request should ask for its reply."""
        kafka = self._kafka is not None and "kafka" not in self._down
        if self.redis_healthy and not (self.prefer_kafka and kafka):
            return ReplyRoute.channel(self.channel, self.reply_topic if self._kafka else None)
        if kafka and self.reply_topic is not None:
            return ReplyRoute.topic(self.reply_topic)
        raise Unavailable("no reply route: Redis is unreachable and there is no reply topic")

    async def start(self, reply_partitions: set[int] | None = None) -> None:
        """``reply_partitions``: the reply topic's partitions (None: no durable fallback)."""
        if self.reply_topic is not None and self._bootstrap is not None and reply_partitions:
            await self._start_kafka(self.reply_topic, reply_partitions, self._bootstrap)
        try:
            await self._subscribe()
        except Unavailable:
            if self._kafka is None:
                raise
            log.warning("Redis unreachable at start; replies come over %s until it is back", self.reply_topic)
        self._spawn(self._read_redis, "redis")

    async def _start_kafka(self, topic: str, partitions: set[int], bootstrap: str) -> None:
        consumer = AIOKafkaConsumer(**kafka_options(bootstrap), enable_auto_commit=False)
        try:
            await consumer.start()
            consumer.assign([TopicPartition(topic, p) for p in partitions])
            await consumer.seek_to_end()
            for tp in consumer.assignment():  # resolve the end now: replies from here on are ours
                await consumer.position(tp)
        except KafkaError as exc:
            await consumer.stop()
            raise Unavailable(f"reply topic {topic} unavailable: {exc}") from exc
        self._kafka = consumer
        self._spawn(lambda: self._read_kafka(consumer), "kafka")

    async def _subscribe(self) -> None:
        try:
            await self._pubsub.subscribe(self.channel)
            # Wait for the subscription to be confirmed, so no reply can be published before it.
            while (msg := await self._pubsub.get_message(timeout=1.0)) is None or msg["type"] != "subscribe":
                if msg is None and not self._pubsub.subscribed:
                    raise Unavailable(f"could not subscribe to {self.channel}")
        except (RedisError, OSError) as exc:
            raise Unavailable(f"Redis subscription to {self.channel} failed: {exc}") from exc
        self.redis_healthy = True

    def _spawn(self, reader: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        task = asyncio.create_task(self._supervise(reader, name), name=f"kinfer-replies-{name}-{self.channel}")
        task.add_done_callback(self._reader_done)
        self._tasks.append(task)

    async def _supervise(self, reader: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        """Run ``reader`` for as long as the client lives: one that fails (it handles its own Kafka
        and Redis errors, and each message in its own ``try``, so this is a bug or the unforeseen)
        is started again after a backoff, and counted; readiness says so meanwhile."""
        backoff = Backoff(self.RESTART_FIRST_S, self.RESTART_MAX_S)
        while True:
            started = time.monotonic()
            self._down.pop(name, None)
            try:
                await reader()
                raise RuntimeError("the reader returned")
            except Exception as exc:
                self._down[name] = exc
                self.restarts[name] += 1
                metrics.REPLY_READER_RESTARTS.labels(name).inc()
                log.exception("reply reader %s on %s failed; restarting it", name, self.channel)
            if time.monotonic() - started > 60.0:  # it had run a good while: not a crash loop
                backoff.reset()
            await asyncio.sleep(backoff.next_delay())

    async def close(self) -> None:
        for task in self._tasks:
            await stop_task(task)
        await close_pubsub(self._pubsub)
        if self._kafka is not None:
            await self._kafka.stop()
        self._fail_all(Unavailable("client closed"))

    def expect(self, request_id: str, ask_again: Callable[[], None] | None = None) -> asyncio.Future[Result]:
        """Register interest before publishing the request (a fast reply must find its waiter).
        ``ask_again``: for a request whose reply comes over the Redis channel, how to publish it once
        more should the channel be lost before its reply comes."""
        fut: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = fut
        if ask_again is not None:
            self._ask_again[request_id] = ask_again
        return fut

    def open_stream(self, request_id: str, ask_again: Callable[[], None] | None = None) -> StreamBuffer:
        """Register a streaming request before publishing it (``ask_again`` as for ``expect``)."""
        buffer = self._streams[request_id] = StreamBuffer()
        if ask_again is not None:
            self._ask_again[request_id] = ask_again
        return buffer

    def forget(self, request_id: str) -> None:
        """The caller is done with ``request_id`` (answered or not)."""
        self._ask_again.pop(request_id, None)
        fut = self._waiters.pop(request_id, None)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self.duplicates += stream.duplicates
            self._remember(request_id, answered=stream.finished)
            return
        answered = fut is None or (fut.done() and not fut.cancelled() and fut.exception() is None)
        self._remember(request_id, answered=answered)

    def _remember(self, request_id: str, answered: bool) -> None:
        self._recent[request_id] = answered
        self._recent.move_to_end(request_id)
        while len(self._recent) > self.RECENT:
            self._recent.popitem(last=False)

    async def _read_redis(self) -> None:
        backoff = Backoff(0.1)
        try:
            while True:
                try:
                    if not self.redis_healthy:
                        await self._subscribe()
                        log.info("Redis is back: replies on %s again", self.channel)
                        backoff.reset()
                        self._ask_everyone_again()
                    msg = await self._pubsub.get_message(timeout=None)  # blocks until a message (or an error)
                except (RedisError, OSError, Unavailable) as exc:
                    if self.redis_healthy:
                        log.warning("Redis reply channel lost (%s); falling back to %s", exc, self.reply_topic)
                    await self._resubscribe_later()
                    await asyncio.sleep(backoff.next_delay())
                    continue
                if msg is not None and msg.get("type") == "message":
                    self._receive(msg.get("data"), "redis")
        except Exception:
            await self._resubscribe_later()  # the subscription this run had is not trusted again
            raise

    def _ask_everyone_again(self) -> None:
        """Subscribed anew: every request still waiting on the channel may have had its reply published
        while nobody here listened. Each is published once more; its answer now comes here."""
        waiting = [ask for rid, ask in self._ask_again.items() if rid in self._waiters or rid in self._streams]
        if not waiting:
            return
        log.warning("asking %d requests again: their replies may have been published while %s was not read",
                    len(waiting), self.channel)
        self.asked_again += len(waiting)
        metrics.ASKED_AGAIN.inc(len(waiting))
        for ask in waiting:
            try:
                ask()
            except Exception:  # one request's copy must not keep the others from theirs
                log.exception("asking a request again failed")

    async def _resubscribe_later(self) -> None:
        """Drop the subscription (requests go by the topic meanwhile); the reader subscribes anew."""
        self.redis_healthy = False
        await close_pubsub(self._pubsub)
        self._pubsub = self._redis.pubsub(ignore_subscribe_messages=False)

    async def _read_kafka(self, consumer: AIOKafkaConsumer) -> None:
        backoff = Backoff()
        while True:
            try:
                batches = await consumer.getmany(timeout_ms=500)
                backoff.reset()
            except KafkaError as exc:
                log.warning("reply topic read failed, retrying: %s", exc)
                await asyncio.sleep(backoff.next_delay())
                continue
            for records in batches.values():
                for record in records:
                    self._receive(record.value, "kafka")

    def _receive(self, data: object, source: str) -> None:
        """Take one message from ``source``; never raises (a reader goes on whatever it was)."""
        try:
            if not isinstance(data, bytes):  # a tombstone, or not what a reply channel carries
                raise ReplyRefused(f"a {type(data).__name__}, not bytes", "malformed")
            replies, seal = decode_replies(data, self.key)
        except ReplyRefused as exc:
            self._refused(exc, source)
            return
        except Exception:  # a bug, not the message: it must not stop the reader either
            if self._count(source, "error"):
                log.exception("a reply from %s could not be read", source)
            return
        if seal == 1:
            self._legacy()
        for reply in replies:
            try:
                wanted = reply.id in self._waiters or reply.id in self._streams
                if wanted:
                    self.received[source] += 1
                self._deliver(reply)
                if wanted and reply.trace is not None:  # after the caller has it: tracing never holds it back
                    tracing.received(source, reply.id, reply.trace)
            except Exception:
                if self._count(source, "error"):
                    log.exception("a reply to %s from %s could not be delivered", reply.id, source)

    def _refused(self, exc: ReplyRefused, source: str) -> None:
        reason = exc.reason
        if source == "kafka" and reason in ("unsealed", "unopened"):
            self.unknown += 1  # another client's reply on the shared topic: the normal case there
            return
        if reason in ("unsealed", "unopened"):
            self.forged += 1
            metrics.FORGED_REPLIES.inc()
        else:
            self.malformed += 1
        if self._count(source, reason):
            log.warning("dropping a message on %s: %s", source, exc)

    def _count(self, source: str, reason: str) -> bool:
        """Count a dropped message; True when it is worth a log line (the 1st, 2nd, 4th, 8th, ... of
        its kind: a flood of garbage costs counters, not a log line each)."""
        self.refused[source, reason] += 1
        metrics.REPLIES_REFUSED.labels(source, reason).inc()
        n = self.refused[source, reason]
        return n & (n - 1) == 0

    def _legacy(self) -> None:
        if not self.legacy:
            log.warning("a reply came under the older, unencrypted seal: a worker is not upgraded "
                        "(its replies can be read by anyone who reads the reply topic)")
        self.legacy += 1
        metrics.LEGACY_SEALED_REPLIES.inc()

    def _deliver(self, reply: Reply) -> None:
        stream = self._streams.get(reply.id)
        if stream is not None:
            if isinstance(reply, Chunk):
                stream.push(reply)
            else:  # refused before it could stream (expired, shed, invalid)
                try:
                    reply.raise_for_status()
                except KinferError as exc:
                    stream.fail(exc)
            return
        fut = self._waiters.get(reply.id)
        if fut is not None and isinstance(reply, Result):
            if fut.done():  # its caller timed out a moment ago and has not said so yet (``forget``)
                self.late += 1
                self.late_ids.append(reply.id)
                return
            del self._waiters[reply.id]
            fut.set_result(reply)
            self._remember(reply.id, answered=True)
            return
        answered = self._recent.get(reply.id)
        if answered is None:
            self.unknown += 1
        elif answered:
            self.duplicates += 1
        else:
            self.late += 1
            self.late_ids.append(reply.id)

    def _reader_done(self, task: asyncio.Task[None]) -> None:
        """A supervisor ends only when cancelled (``close``); anything else (a ``BaseException``
        it does not restart on) leaves the client not ready, and its callers told at once."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("reply reader on %s stopped: %r", self.channel, exc)
            self._down[task.get_name()] = exc
            self._fail_all(Unavailable(f"reply channel {self.channel} failed: {exc}"))

    def _fail_all(self, exc: BaseException) -> None:
        self._ask_again.clear()
        waiters, self._waiters = self._waiters, {}
        for fut in waiters.values():
            if not fut.done():
                fut.set_exception(exc)
        error = exc if isinstance(exc, KinferError) else Unavailable(str(exc))
        for stream in self._streams.values():
            stream.fail(error)
