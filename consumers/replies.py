"""Publishing what a worker produces: results on their reply route, bad records to the DLQ."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from topics import Chunk, ReplyRoute, Result, RouteKind, Unavailable, pack
from topics.names import DLQ_TOPIC

log = logging.getLogger(__name__)


class ReplySink:
    """Publishes results, batched: one Redis pipeline and one Kafka flush per call.

    Idempotent by request id on the receiving side, so publishing the same result twice (after a
    redelivery) is harmless.
    """

    def __init__(self, producer: AIOKafkaProducer, redis: aioredis.Redis) -> None:
        self._producer = producer
        self._redis = redis

    async def publish(self, replies: Sequence[tuple[ReplyRoute, Result | Chunk]]) -> None:
        """Publish every reply; raises ``Unavailable`` if any could not go out (the caller retries).

        A Redis reply whose route names a fallback topic goes to Kafka when Redis is unreachable:
        slower, but nothing is lost while Redis is down.
        """
        to_redis = [(r, m) for r, m in replies if r.kind is RouteKind.REDIS]
        to_kafka = [(r.name, m) for r, m in replies if r.kind is RouteKind.KAFKA]
        if to_redis:
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for route, message in to_redis:
                        pipe.publish(route.name, pack(message))
                    await pipe.execute()
            except (RedisError, OSError) as exc:
                stranded = [(r, m) for r, m in to_redis if r.fallback_topic is None]
                if stranded:
                    raise Unavailable(f"Redis unreachable for {len(stranded)} replies: {exc}") from exc
                to_kafka += [(r.fallback_topic, m) for r, m in to_redis if r.fallback_topic is not None]
        if to_kafka:
            try:
                futures = [await self._producer.send(topic, pack(m), key=m.id.encode()) for topic, m in to_kafka]
                await asyncio.gather(*futures)
            except KafkaError as exc:
                raise Unavailable(f"publishing {len(to_kafka)} replies to Kafka failed: {exc}") from exc

    async def dead_letter(self, value: bytes, reason: str, field: str | None, source: str) -> None:
        """Send a record that failed validation to the DLQ, with why and where it came from."""
        headers = [
            ("reason", reason.encode()[:1024]),
            ("field", (field or "").encode()),
            ("source", source.encode()),
        ]
        try:
            await self._producer.send_and_wait(DLQ_TOPIC, value, headers=headers)
        except KafkaError as exc:
            raise Unavailable(f"dead-lettering a record from {source} failed: {exc}") from exc
