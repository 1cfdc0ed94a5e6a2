"""Publishing what a worker produces: replies on their routes, bad records to the DLQ."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import NamedTuple

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from topics import Reply, ReplyBatch, ReplyRoute, Unavailable, pack
from topics.names import DLQ_TOPIC

log = logging.getLogger(__name__)

# A dead-lettered record is copied up to this many bytes (the rest is cut, and the header
# ``truncated`` gives the original length): the copy plus its headers always fits the producer's
# and the topic's limit, so one oversized poison record can never stop a worker.
DLQ_MAX_COPY_BYTES = 512 * 1024


class Delivery(NamedTuple):
    """One reply and where it goes."""

    route: ReplyRoute
    message: Reply
    batchable: bool = False  # the request reads ``batch`` messages (``batch_reply``)


class ReplySink:
    """Publishes replies, batched: one Redis pipeline and one Kafka flush per call.

    Replies for the same Redis channel go out as one ``batch`` message when their requests said
    they read batches (``batch_reply``). A Redis PUBLISH that reached no subscriber is not a
    delivery: such replies go to the request's fallback topic, like replies Redis could not take
    at all. Idempotent by request id on the receiving side, so publishing twice is harmless.
    """

    def __init__(self, producer: AIOKafkaProducer, redis: aioredis.Redis) -> None:
        self._producer = producer
        self._redis = redis
        self.undelivered = 0  # replies that reached nobody and had no fallback topic

    async def publish(self, replies: Sequence[Delivery]) -> None:
        """Publish every reply; raises ``Unavailable`` if any could not go out (the caller retries)."""
        channels: dict[str, list[Delivery]] = {}
        to_kafka: list[tuple[str, Delivery]] = []
        for out in replies:
            route = out.route
            if route.redis is not None:
                channels.setdefault(route.redis, []).append(out)
            else:
                to_kafka.append((route.name, out))
        if channels:
            to_kafka += await self._publish_redis(channels)
        if to_kafka:
            try:
                futures = [await self._producer.send(topic, pack(out.message), key=out.message.id.encode())
                           for topic, out in to_kafka]
                await asyncio.gather(*futures)
            except KafkaError as exc:
                raise Unavailable(f"publishing {len(to_kafka)} replies to Kafka failed: {exc}") from exc

    async def _publish_redis(self, channels: dict[str, list[Delivery]]) -> list[tuple[str, Delivery]]:
        """Publish on Redis; returns the replies that must go to their fallback topics instead."""
        messages: list[tuple[str, bytes, list[Delivery]]] = []
        for channel, outs in channels.items():
            batched = [o for o in outs if o.batchable]
            if len(batched) > 1:
                messages.append((channel, pack(ReplyBatch([o.message for o in batched])), batched))
                outs = [o for o in outs if not o.batchable]
            messages += [(channel, pack(o.message), [o]) for o in outs]
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for channel, data, _ in messages:
                    pipe.publish(channel, data)
                receivers = await pipe.execute()
        except (RedisError, OSError) as exc:
            unsent = [o for _, _, outs in messages for o in outs]
            stranded = sum(1 for o in unsent if o.route.fallback_topic is None)
            if stranded:
                raise Unavailable(f"Redis unreachable for {stranded} replies: {exc}") from exc
            return [(o.route.kafka, o) for o in unsent]  # type: ignore[misc]
        fallback: list[tuple[str, Delivery]] = []
        for (_, _, outs), heard in zip(messages, receivers, strict=True):
            if heard:
                continue
            for o in outs:
                topic = o.route.fallback_topic
                if topic is not None:
                    fallback.append((topic, o))
                else:
                    self.undelivered += 1  # its client is gone, and said where else to look: nowhere
        return fallback

    async def dead_letter(self, value: bytes, reason: str, field: str | None, source: str) -> None:
        """Send a record that failed validation to the DLQ, with why and where it came from."""
        headers = [
            ("reason", reason.encode(errors="replace")[:1024]),
            ("field", (field or "").encode()[:64]),
            ("source", source.encode()[:256]),
        ]
        if len(value) > DLQ_MAX_COPY_BYTES:
            headers.append(("truncated", str(len(value)).encode()))
            value = value[:DLQ_MAX_COPY_BYTES]
        try:
            await self._producer.send_and_wait(DLQ_TOPIC, value, headers=headers)
        except KafkaError as exc:
            raise Unavailable(f"dead-lettering a record from {source} failed: {exc}") from exc
