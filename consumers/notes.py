"""Best-effort notes a worker reads from Redis channels (a client's cancellation, a producer's demand).

A note lost while Redis is away costs little (a stream runs to its end, a cold model is swapped in
on its lag instead), so a subscription outlives Redis outages: it subscribes again, with backoff, and
a worker never stops for want of Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kinfer.topics.backoff import Backoff

log = logging.getLogger(__name__)


async def subscribed(redis: aioredis.Redis, channel: str, until: asyncio.Event) -> AsyncIterator[bytes]:
    """Messages on ``channel`` until ``until`` is set; through Redis outages (it resubscribes)."""
    backoff = Backoff()
    while not until.is_set():
        pubsub = redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(channel)
            backoff.reset()
            while not until.is_set():
                msg = await pubsub.get_message(timeout=0.5)
                if msg is not None and msg.get("type") == "message" and isinstance(msg["data"], bytes):
                    yield msg["data"]
        except (RedisError, OSError) as exc:
            log.warning("%s: Redis unavailable, resubscribing: %s", channel, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(until.wait(), backoff.next_delay())
        finally:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()  # type: ignore[no-untyped-call]
