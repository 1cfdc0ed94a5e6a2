"""What every long-lived reader loop shares: the count of what it refused, and its own restarts.

A reader (a Redis subscription, a Kafka agent, a poll of Redis keys) handles each message in
isolation: one it cannot use is counted in ``kinfer_malformed_records_total{reader, reason}`` and
skipped, and the loop goes on. A reader that fails for any other reason (a bug, a dependency's
surprise) is restarted by ``Supervised`` with backoff; ``kinfer_reader_up{reader}`` is 0 while it
waits to restart, and ``Supervised.up`` says so to the process's readiness.

Labels are bounded: ``reader`` is a name from the code, ``reason`` one of ``MalformedRecord``'s
reasons (size, depth, syntax, schema, memory, tombstone, type, future, capacity).

``subscribed`` is the Redis side of a reader: a channel's messages through Redis outages. A message
lost while Redis is away costs little on the channels read this way (a cancellation, a producer's
demand, a health state superseded within a second), so the subscription outlives the outage: it
subscribes again, with backoff, and its reader never stops for want of Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from kinfer.topics.backoff import Backoff
from kinfer.topics.errors import MalformedRecord
from kinfer.topics.record import MAX_SKEW_MS, Record

R = TypeVar("R", bound=Record)

log = logging.getLogger(__name__)

MALFORMED = Counter(
    "kinfer_malformed_records_total", "Messages a reader refused and skipped, by reader and reason",
    ["reader", "reason"],
)
READER_UP = Gauge(
    "kinfer_reader_up", "1 while a long-lived reader loop runs, 0 while it waits to restart after a failure", ["reader"]
)
READER_RESTARTS = Counter(
    "kinfer_reader_restarts_total", "Reader loops restarted after a failure other than a bad message", ["reader"]
)


def refused(reader: str, reason: str | MalformedRecord) -> None:
    """Count one message ``reader`` skipped (``reason``: a word, or the refusal that says it)."""
    MALFORMED.labels(reader, reason.reason if isinstance(reason, MalformedRecord) else reason).inc()


def read(kind: type[R], data: object, reader: str, now_ms: int) -> R | None:
    """The ``kind`` record in one message, or None, counted by ``reader`` and reason: it does not
    decode, or it is dated (``kind.dated_by``) more than ``MAX_SKEW_MS`` ahead of ``now_ms`` — a record
    from the future would never go stale."""
    try:
        record = kind.unpack(data)
    except MalformedRecord as exc:
        refused(reader, exc)
        return None
    if kind.dated_by is not None and getattr(record, kind.dated_by) > now_ms + MAX_SKEW_MS:
        refused(reader, "future")
        return None
    return record


class Supervised:
    """Runs ``loop`` until cancelled; restarts it with backoff whenever it raises (or returns).

    The backoff starts again from ``first_s`` once a run has lasted ``max_s``: a loop that fails
    now and then is restarted quickly, one that fails at once every time no faster than ``max_s``.
    """

    def __init__(self, reader: str, loop: Callable[[], Awaitable[None]], *, first_s: float = 0.5,
                 max_s: float = 30.0) -> None:
        self.reader = reader
        self.restarts = 0
        self.last_error: BaseException | None = None
        self._loop = loop
        self._backoff = Backoff(first_s, max_s)
        self._max_s = max_s
        self._up = False

    @property
    def up(self) -> bool:
        """True while the loop runs (False before it starts and while it waits to restart)."""
        return self._up

    def _set_up(self, up: bool) -> None:
        self._up = up
        READER_UP.labels(self.reader).set(1 if up else 0)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Until cancelled, or until ``stop`` is set and the loop has returned."""
        try:
            while stop is None or not stop.is_set():
                started = time.monotonic()
                self._set_up(True)
                try:
                    await self._loop()
                    if stop is not None and stop.is_set():
                        return
                    self.last_error = None
                    log.warning("reader %s ended: starting it again", self.reader)
                except Exception as exc:  # anything but cancellation: the loop restarts
                    self.last_error = exc
                    log.exception("reader %s failed: starting it again", self.reader)
                self._set_up(False)
                self.restarts += 1
                READER_RESTARTS.labels(self.reader).inc()
                if time.monotonic() - started >= self._max_s:
                    self._backoff.reset()
                delay = self._backoff.next_delay()
                if stop is None:
                    await asyncio.sleep(delay)
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), delay)
        finally:
            self._set_up(False)


async def close_pubsub(pubsub: PubSub) -> None:
    """Close a subscription whatever state its connection is in (Redis gone, half-subscribed)."""
    with contextlib.suppress(RedisError, OSError):
        # redis-py types ``aclose`` from 8.2 on; before that it is an untyped call.
        await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]


async def subscribed(redis: aioredis.Redis, channel: str, until: asyncio.Event | None = None,
                     backoff: Backoff | None = None) -> AsyncIterator[bytes]:
    """Messages on ``channel`` until ``until`` is set (for ever without one); through Redis outages:
    it subscribes again after ``backoff``'s delay."""
    backoff = backoff or Backoff()
    stop = until or asyncio.Event()
    while not stop.is_set():
        pubsub = redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(channel)
            backoff.reset()
            while not stop.is_set():
                msg = await pubsub.get_message(timeout=0.5)
                if msg is not None and msg.get("type") == "message" and isinstance(msg["data"], bytes):
                    yield msg["data"]
        except (RedisError, OSError) as exc:
            log.warning("%s: Redis unavailable, resubscribing: %s", channel, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), backoff.next_delay())
        finally:
            await close_pubsub(pubsub)
