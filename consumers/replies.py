"""Publishing what a worker produces: replies on their routes, bad records to the DLQ."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import NamedTuple

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from kinfer.topics import Reply, ReplyBatch, ReplyRoute, Unavailable, pack, seal
from kinfer.topics.auth import reply_record_key
from kinfer.topics.names import DLQ_TOPIC

log = logging.getLogger(__name__)

# A dead-lettered record is copied up to this many bytes (the rest is cut, and the header
# ``truncated`` gives the original length): the copy plus its headers always fits the producer's
# and the topic's limit, so one oversized poison record can never stop a worker.
DLQ_MAX_COPY_BYTES = 512 * 1024
MISSING_TOPIC_TTL_S = 10.0  # a reply topic found missing is believed missing this long
METADATA_TIMEOUT_S = 5.0
# Replies over Redis: a PUBLISH that takes longer than this has failed (a Redis that is stopped or
# swapping accepts the connection and never answers). No retries on that connection: the fallback is the retry.
REDIS_REPLY_TIMEOUT_S = 0.25
# After Redis failed, replies that have a fallback topic go straight to it this long before Redis is tried
# again: a dead or stalled Redis costs each reply nothing, not a timeout each.
REDIS_RETRY_S = 1.0


def reply_redis(url: str) -> aioredis.Redis:
    """The Redis client replies are published with: short timeouts, no retries of its own."""
    return aioredis.Redis.from_url(url, socket_timeout=REDIS_REPLY_TIMEOUT_S,
                                   socket_connect_timeout=REDIS_REPLY_TIMEOUT_S, retry=Retry(NoBackoff(), 0))


class ReplyTopics:
    """Which reply topics exist, from cluster metadata: a reply is never retried against a topic that is not there.

    A producer asked to send to an unknown topic waits for it up to its request timeout (40 s), and a
    retry loop around that pins the request's partition for as long as its deadline allows. Here a topic
    is looked up once (one metadata round trip, shared by concurrent askers); a missing one is
    remembered for ``MISSING_TOPIC_TTL_S``, so intake can refuse requests routed to it before any
    compute, and a topic created since is found at the next lookup.
    """

    def __init__(self, fetch_topics: Callable[[], Awaitable[Collection[str]]]) -> None:
        self._fetch_topics = fetch_topics
        self._known: set[str] = set()
        self._missing: dict[str, float] = {}
        self._lookup: asyncio.Task[None] | None = None

    def known_missing(self, topic: str) -> bool:
        return self._missing.get(topic, 0.0) > time.monotonic()

    async def exists(self, topic: str) -> bool:
        """False only when the broker said so; a lookup that fails counts as existing (retried as transient)."""
        if topic in self._known:
            return True
        if self.known_missing(topic):
            return False
        if self._lookup is None or self._lookup.done():
            self._lookup = asyncio.create_task(self._refresh())
        try:
            await asyncio.shield(self._lookup)
        except (KafkaError, TimeoutError, OSError) as exc:
            log.warning("reply topic lookup failed: %s", exc)
            return True
        if topic in self._known:
            return True
        now = time.monotonic()
        if len(self._missing) >= 1024:  # names from a fuzzer: keep the live ones
            self._missing = {t: until for t, until in self._missing.items() if until > now}
        self._missing[topic] = now + MISSING_TOPIC_TTL_S
        return False

    async def _refresh(self) -> None:
        self._known = set(await asyncio.wait_for(self._fetch_topics(), METADATA_TIMEOUT_S))


class Delivery(NamedTuple):
    """One reply and where it goes."""

    route: ReplyRoute
    message: Reply
    batchable: bool = False  # the request reads ``batch`` messages (``batch_reply``)
    key: bytes | None = None  # the request's reply key: the message goes out sealed (encrypted) with it

    def pack(self) -> bytes:
        return pack(self.message) if self.key is None else seal(self.message, self.key)

    def record_key(self) -> bytes:
        """Its Kafka record key: the request id, or for a sealed reply a keyed hash of it (the same for
        every reply to the request, so they share a partition, and nothing a reader of the topic can use)."""
        rid = self.message.id
        return rid.encode() if self.key is None else reply_record_key(self.key, rid)


class ReplySink:
    """Publishes replies, batched: one Redis pipeline and one Kafka flush per call.

    Replies for the same Redis channel go out as one ``batch`` message when their requests said
    they read batches (``batch_reply``). A Redis PUBLISH that reached no subscriber is not a
    delivery: such replies go to the request's fallback topic, like replies Redis could not take
    at all. Idempotent by request id on the receiving side, so publishing twice is harmless.

    Once Redis fails (an error, or no answer within ``REDIS_REPLY_TIMEOUT_S`` when it is built with
    ``reply_redis``), replies with a fallback topic skip it for ``REDIS_RETRY_S``; the first reply
    after that tries it again.
    """

    def __init__(self, producer: AIOKafkaProducer, redis: aioredis.Redis, topics: ReplyTopics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._producer = producer
        self._redis = redis
        self.topics = topics or ReplyTopics(_topics_of(producer))
        self._clock = clock
        self._redis_down_until = -1.0
        self.redis_skipped = 0  # replies sent straight to their fallback topic while Redis was failing

    async def publish(self, replies: Sequence[Delivery]) -> int:
        """Publish every reply; raises ``Unavailable`` if any could not go out (the caller retries).

        Returns how many reached nobody and cannot be retried: a PUBLISH with no subscriber and no
        fallback topic, or a reply topic that does not exist.
        """
        channels: dict[str, list[Delivery]] = {}
        to_kafka: list[tuple[str, Delivery]] = []
        redis_failing = self._clock() < self._redis_down_until
        for out in replies:
            route = out.route
            if route.redis is not None and not (redis_failing and route.fallback_topic is not None):
                channels.setdefault(route.redis, []).append(out)
            else:
                to_kafka.append((route.fallback_topic or route.name, out))
                self.redis_skipped += route.redis is not None
        undelivered = 0
        if channels:
            fallback, undelivered = await self._publish_redis(channels)
            to_kafka += fallback
        routable = []
        for topic, out in to_kafka:
            if await self.topics.exists(topic):
                routable.append((topic, out))
            else:
                undelivered += 1
                log.warning("reply for %s dropped: its reply topic %s does not exist", out.message.id, topic,
                            extra={"request_id": out.message.id})
        to_kafka = routable
        if to_kafka:
            try:
                futures = [await self._producer.send(topic, out.pack(), key=out.record_key())
                           for topic, out in to_kafka]
                await asyncio.gather(*futures)
            except KafkaError as exc:
                raise Unavailable(f"publishing {len(to_kafka)} replies to Kafka failed: {exc}") from exc
        return undelivered

    async def _publish_redis(self, channels: dict[str, list[Delivery]]) -> tuple[list[tuple[str, Delivery]], int]:
        """Publish on Redis; returns the replies that must go to their fallback topics instead, and how many
        reached nobody and have no fallback."""
        messages: list[tuple[str, bytes, list[Delivery]]] = []
        for channel, outs in channels.items():
            batches: dict[bytes | None, list[Delivery]] = {}  # one message per reader: same channel, same seal
            for o in outs:
                if o.batchable:
                    batches.setdefault(o.key, []).append(o)
                else:
                    messages.append((channel, o.pack(), [o]))
            for key, group in batches.items():
                if len(group) == 1:
                    messages.append((channel, group[0].pack(), group))
                else:
                    batch = ReplyBatch([o.message for o in group])
                    messages.append((channel, pack(batch) if key is None else seal(batch, key), group))
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for channel, data, _ in messages:
                    pipe.publish(channel, data)
                receivers = await pipe.execute()
        except (RedisError, OSError) as exc:
            self._redis_down_until = self._clock() + REDIS_RETRY_S
            unsent = [o for _, _, outs in messages for o in outs]
            stranded = sum(1 for o in unsent if o.route.fallback_topic is None)
            if stranded:
                raise Unavailable(f"Redis unreachable for {stranded} replies: {exc}") from exc
            return [(o.route.kafka, o) for o in unsent], 0  # type: ignore[misc]
        fallback: list[tuple[str, Delivery]] = []
        undelivered = 0
        for (_, _, outs), heard in zip(messages, receivers, strict=True):
            if heard:
                continue
            for o in outs:
                topic = o.route.fallback_topic
                if topic is not None:
                    fallback.append((topic, o))
                else:
                    undelivered += 1  # its client is gone, and said where else to look: nowhere
        return fallback, undelivered

    async def dead_letter(self, value: bytes | None, reason: str, field: str | None, source: str) -> None:
        """Send a record that failed validation to the DLQ, with why and where it came from (a null
        value stays null)."""
        headers = [
            ("reason", reason.encode(errors="replace")[:1024]),
            ("field", (field or "").encode()[:64]),
            ("source", source.encode()[:256]),
        ]
        if value is not None and len(value) > DLQ_MAX_COPY_BYTES:
            headers.append(("truncated", str(len(value)).encode()))
            value = value[:DLQ_MAX_COPY_BYTES]
        try:
            # A record needs a key or a value: a null one gets an empty key, and stays null.
            await self._producer.send_and_wait(DLQ_TOPIC, value, key=b"" if value is None else None, headers=headers)
        except KafkaError as exc:
            raise Unavailable(f"dead-lettering a record from {source} failed: {exc}") from exc


def _topics_of(producer: AIOKafkaProducer) -> Callable[[], Awaitable[Collection[str]]]:
    async def fetch() -> Collection[str]:
        return (await producer.client.fetch_all_metadata()).topics()  # type: ignore[no-any-return]

    return fetch
