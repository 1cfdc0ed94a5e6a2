"""The worker's answered positions, reported to Redis for the lag monitor (``kinfer.topics.progress``).

Per model it serves, the position it would commit for each partition it owns (the offset tracker's:
everything below is answered), written to ``kinfer:answered:<model>`` field its worker id whenever a
position moved (checked every ``every_s``) and at least every ``ANSWERED_EVERY_S``. The commits go
through the group's coordinator; this goes through Redis, so a coordinator's broker that dies or
stalls does not make a serving model look stopped. Redis being down only stops the reports: they go
stale and the lag monitor falls back to the committed offsets alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kinfer.consumers.feed import Feed
from kinfer.topics import now_ms
from kinfer.topics.progress import ANSWERED_EVERY_S, Answered, Position, answered_key

WRITE_TIMEOUT_S = 1.0  # a stalled Redis holds neither the reports (they go stale) nor the worker's stop


class AnsweredReporter:
    def __init__(self, worker_id: str, feeds: Mapping[str, Feed], every_s: float = 0.1) -> None:
        self.worker_id = worker_id
        self.feeds = feeds
        self.every_s = every_s
        self._sent: dict[str, tuple[frozenset[tuple[int, int, int]], float]] = {}  # model -> positions, when

    def due(self, now: float) -> dict[str, Answered]:
        """The reports to write now: models whose positions moved, or last written ``ANSWERED_EVERY_S`` ago."""
        out = {}
        for name, feed in self.feeds.items():
            consumer = feed.consumer
            if consumer is None:
                continue
            positions = frozenset((int(feed.priority(tp)), tp.partition, pos)
                                  for tp, pos in feed.tracker.positions(consumer.assignment()).items())
            sent = self._sent.get(name)
            if sent is not None and sent[0] == positions and now - sent[1] < ANSWERED_EVERY_S:
                continue
            out[name] = Answered(self.worker_id, now_ms(), [Position(*p) for p in sorted(positions)])
        return out

    def sent(self, reports: Mapping[str, Answered], now: float) -> None:
        for name, report in reports.items():
            self._sent[name] = (frozenset((p.priority, p.partition, p.position) for p in report.positions), now)

    async def run(self, redis: aioredis.Redis, drained: asyncio.Event) -> None:
        """Report until ``drained``, then remove this worker's entries (its partitions have new owners)."""
        while not drained.is_set():
            now = time.monotonic()
            reports = self.due(now)
            if reports:
                with contextlib.suppress(RedisError, OSError, TimeoutError):
                    async with asyncio.timeout(WRITE_TIMEOUT_S), redis.pipeline(transaction=False) as pipe:
                        for name, report in reports.items():
                            pipe.hset(answered_key(name), self.worker_id, report.pack())
                        await pipe.execute()
                    self.sent(reports, now)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(drained.wait(), self.every_s)
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(WRITE_TIMEOUT_S), redis.pipeline(transaction=False) as pipe:
                for name in self.feeds:
                    pipe.hdel(answered_key(name), self.worker_id)
                await pipe.execute()


__all__ = ["AnsweredReporter"]
