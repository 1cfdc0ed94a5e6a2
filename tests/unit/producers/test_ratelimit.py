"""The shared rate limiter's own logic, without Redis: what a reply means, batching the requests that
come while a call is in flight, and failing open to the tenant's local bucket when Redis does not
answer (the Lua script itself runs against the real Redis in tests/integration/test_ratelimit.py)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from kinfer.producers.ratelimit import KEY_PREFIX, LOCAL_DECISIONS, RedisRateLimiter
from kinfer.producers.tenants import Tenant, hash_key


class FakeLimiter(RedisRateLimiter):
    """Redis's side played by queued replies (one list per call; an exception is raised); each call's
    (key, rate, burst, count) tuples recorded. ``gate``, when set, holds every call until it opens."""

    def __init__(self, *replies: Any, retry_s: float = 1.0) -> None:
        redis: Any = SimpleNamespace(register_script=lambda script: SimpleNamespace(sha="0" * 40))
        super().__init__(redis, retry_s=retry_s)
        self.replies = list(replies)
        self.calls: list[list[tuple[str, str, str, int]]] = []
        self.gate: asyncio.Event | None = None

    async def _call(self, calls: list[tuple[str, str, str, int]]) -> list[Any]:
        self.calls.append(calls)
        if self.gate is not None:
            await self.gate.wait()
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return list(reply)


def tenant(name: str = "search", rate: float = 2.0, burst: float = 2) -> Tenant:
    return Tenant(name, hash_key(name), rate_per_s=rate, burst=burst)


async def test_a_reply_is_a_grant_or_the_wait_for_the_next_token() -> None:
    limiter = FakeLimiter([[1, 0]], [[0, 250_000]], [[0, 0]])
    t = tenant(rate=2.5, burst=7)
    assert await limiter.take(t) == 0.0
    assert await limiter.take(t) == pytest.approx(0.25)
    assert await limiter.take(t) > 0  # refused, even if the wait rounds to nothing
    assert limiter.calls[0] == [(f"{KEY_PREFIX}search", "2.5", "7.0", 1)]


async def test_requests_that_come_during_a_call_go_together_in_the_next_one() -> None:
    a, b = tenant("a"), tenant("b")
    # The first call: a's one request. The next: a's three (two granted), b's two (none: 0.5 s to wait).
    limiter = FakeLimiter([[1, 0]], [[2, 100_000], [0, 500_000]])
    limiter.gate = asyncio.Event()
    takes = [asyncio.create_task(limiter.take(t)) for t in (a, a, b, a, b, a)]
    await asyncio.sleep(0)
    assert len(limiter.calls) == 1  # the rest wait for it
    limiter.gate.set()
    waits = await asyncio.gather(*takes)
    assert limiter.calls[1] == [(f"{KEY_PREFIX}a", "2.0", "2.0", 3), (f"{KEY_PREFIX}b", "2.0", "2.0", 2)]
    assert waits == [0.0, 0.0, 0.5, 0.0, 0.5, 0.1]  # a's in arrival order: granted, granted, then refused
    assert limiter.round_trips == 2 and not limiter._busy
    limiter.replies.append([[1, 0]])
    assert await limiter.take(a) == 0.0 and len(limiter.calls) == 3  # idle again: straight to Redis


async def test_redis_down_fails_open_to_the_local_bucket_counted_and_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    down = RedisConnectionError("Connection refused")
    limiter = FakeLimiter(down, down, [[1, 0]], retry_s=3600)
    t = tenant(rate=1.0, burst=2)
    before = LOCAL_DECISIONS._value.get()
    with caplog.at_level(logging.WARNING, logger="kinfer.producers.ratelimit"):
        waits = [await limiter.take(t) for _ in range(3)]
    assert waits[:2] == [0.0, 0.0] and waits[2] > 0  # the local bucket: burst 2, then its rate
    assert len(limiter.calls) == 1  # after a failure Redis is left alone for retry_s
    assert LOCAL_DECISIONS._value.get() - before == 3
    assert len(caplog.records) == 1 and "fail open" in caplog.records[0].message

    limiter._retry_s = limiter._local_until = 0.0  # time passes: Redis is asked again, still down, then back
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kinfer.producers.ratelimit"):
        assert await limiter.take(t) > 0  # local, still empty
        assert await limiter.take(t) == 0.0  # Redis decides again
    assert len(limiter.calls) == 3
    assert len(caplog.records) == 1 and "answers again" in caplog.records[0].message


async def test_a_failed_batch_is_decided_locally_and_a_malformed_reply_is_a_failure() -> None:
    limiter = FakeLimiter([[1, 0]], RedisConnectionError("reset"), retry_s=3600)
    limiter.gate = asyncio.Event()
    t = tenant(rate=0.001, burst=2)
    takes = [asyncio.create_task(limiter.take(t)) for _ in range(4)]
    await asyncio.sleep(0)
    limiter.gate.set()
    assert await asyncio.gather(*takes) == [0.0, 0.0, 0.0, pytest.approx(1000, rel=0.01)]  # 1 Redis, 3 local
    assert not limiter._busy
    assert await FakeLimiter([None], retry_s=3600).take(tenant()) == 0.0  # decided by the full local bucket
