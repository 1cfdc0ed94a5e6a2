"""Tenant rate limits shared through the real Redis: two limiters (two gateways) together admit at most
``burst + rate * elapsed`` for one tenant, counted, not timed; and two real gateway apps on one Redis
answer 429 with Retry-After once the tenant's one bucket is empty, whichever gateway is asked."""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
import uvicorn

from kinfer.ops.localstack.stack import StackInfo, free_port
from kinfer.producers.gateway import GatewaySettings, create_app
from kinfer.producers.ratelimit import KEY_PREFIX, LOCAL_DECISIONS, RedisRateLimiter
from kinfer.producers.tenants import Tenant, Tenants, hash_key

pytestmark = pytest.mark.integration


def tenant_name() -> str:
    return f"rl-{uuid.uuid4().hex[:10]}"  # a bucket of its own, on a Redis other runs may share


async def test_two_limiters_together_admit_at_most_burst_plus_rate_times_elapsed(stack: StackInfo) -> None:
    name, rate, burst = tenant_name(), 20.0, 100
    gateways = [RedisRateLimiter.from_url(stack.redis_url) for _ in range(2)]
    # Each gateway loads the tenants file itself: its own Tenant objects, its own local buckets.
    tenants = [Tenant(name, hash_key("k"), rate_per_s=rate, burst=burst) for _ in gateways]
    local_before = LOCAL_DECISIONS._value.get()
    waits: list[float] = []

    async def caller(limiter: RedisRateLimiter, tenant: Tenant, n: int) -> None:
        for _ in range(n):
            waits.append(await limiter.take(tenant))

    started = time.monotonic()
    # 300 takes as fast as they go: 3 callers on each gateway, interleaved, 50 each.
    await asyncio.gather(*(caller(gateways[i % 2], tenants[i % 2], 50) for i in range(6)))
    elapsed = time.monotonic() - started
    try:
        admitted = sum(w == 0.0 for w in waits)
        assert len(waits) == 300 and LOCAL_DECISIONS._value.get() == local_before  # Redis decided every one
        slack = math.ceil(rate * elapsed) + 1  # refills during the run (Redis's clock; +1 for rounding)
        assert burst <= admitted <= burst + slack, (admitted, elapsed)
        refused = [w for w in waits if w > 0]
        assert refused and all(0 < w <= 1 / rate + 1e-6 for w in refused)  # the next token, never later
        redis = aioredis.Redis.from_url(stack.redis_url)
        key = KEY_PREFIX + name
        ttl_ms = await redis.pttl(key)
        assert 0 < ttl_ms <= burst / rate * 1000 + 1  # gone once it would be full again
        tokens, at = await redis.hmget(key, ["tokens", "at"])
        assert 0 <= float(tokens) < 1 + rate * elapsed and int(at) > 1.6e15  # microseconds of the server's clock
        await redis.aclose()
    finally:
        for g in gateways:
            await g.close()


async def test_an_idle_bucket_vanishes_and_a_flushed_script_is_loaded_again(stack: StackInfo) -> None:
    name = tenant_name()
    limiter = RedisRateLimiter.from_url(stack.redis_url)
    redis = aioredis.Redis.from_url(stack.redis_url)
    try:
        t = Tenant(name, hash_key("k"), rate_per_s=5, burst=2)
        assert await limiter.take(t) == 0.0
        assert 0 < await redis.pttl(KEY_PREFIX + name) <= 201  # one token spent: full again in 200 ms
        await asyncio.sleep(0.5)
        assert not await redis.exists(KEY_PREFIX + name)
        await redis.script_flush()  # a restarted or failed-over Redis forgets scripts: NOSCRIPT, SCRIPT LOAD, again
        local_before = LOCAL_DECISIONS._value.get()
        assert [await limiter.take(t) for _ in range(2)] == [0.0, 0.0]
        assert LOCAL_DECISIONS._value.get() == local_before
    finally:
        await redis.aclose()
        await limiter.close()


async def test_a_dead_redis_fails_open_to_the_local_bucket() -> None:
    limiter = RedisRateLimiter.from_url("redis://127.0.0.1:1/0", timeout_s=0.2)
    t = Tenant(tenant_name(), hash_key("k"), rate_per_s=0.001, burst=2)
    before = LOCAL_DECISIONS._value.get()
    started = time.monotonic()
    waits = [await limiter.take(t) for _ in range(3)]
    assert waits[:2] == [0.0, 0.0] and waits[2] > 0
    assert LOCAL_DECISIONS._value.get() - before == 3 and time.monotonic() - started < 2
    await limiter.close()


KEY = "shared-key"


@pytest.fixture
async def two_gateways(stack: StackInfo, tmp_path: Path) -> AsyncIterator[tuple[str, list[str]]]:
    """Two gateway apps, as two processes would run them: each loads the same tenants file."""
    name = tenant_name()
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [
        {"name": name, "key_sha256": hash_key(KEY), "rate_per_s": 0.01, "burst": 3},
    ]}))
    servers, tasks, urls = [], [], []
    for _ in range(2):
        port = free_port()
        app = create_app(GatewaySettings(stack.bootstrap, stack.redis_url, Tenants.from_file(path)))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        servers.append(server)
        tasks.append(asyncio.create_task(server.serve()))
        urls.append(f"http://127.0.0.1:{port}")
    while not all(s.started for s in servers):
        assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
        await asyncio.sleep(0.05)
    yield name, urls
    for s in servers:
        s.should_exit = True
    await asyncio.gather(*tasks)


async def test_two_gateways_share_a_tenants_limit_and_answer_429_with_retry_after(
        two_gateways: tuple[str, list[str]]) -> None:
    name, urls = two_gateways
    codes = []
    async with httpx.AsyncClient(timeout=30) as http:
        for i in range(6):  # alternating: each gateway alone would admit 3 of its own
            r = await http.post(f"{urls[i % 2]}/v1/models/no-such-model/infer", json={"inputs": "x"},
                                headers={"Authorization": f"Bearer {KEY}"})
            codes.append(r.status_code)
            if r.status_code == 429:
                assert int(r.headers["Retry-After"]) >= 60  # a token every 100 s: not "retry in a second"
                assert r.json()["error"]["type"] == "RateLimited" and name in r.json()["error"]["message"]
        metrics = (await http.get(f"{urls[1]}/metrics")).text
    assert codes[:3] == [404, 404, 404] and codes[3:] == [429, 429, 429]  # admitted, then refused, both gateways
    assert f'kinfer_gateway_requests_total{{code="429",route="infer",tenant="{name}"}}' in metrics
