"""A Redis outage slows replies but loses none: they come over the Kafka reply topic."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from kinfer.ops.localstack.procs import wait_until_served
from kinfer.ops.localstack.stack import StackInfo, free_port
from kinfer.producers import Client
from tests.integration.conftest import WorkerProcess

pytestmark = pytest.mark.integration


def start_redis(port: int) -> subprocess.Popen[bytes]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    return subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


async def wait_redis(url: str) -> None:
    for _ in range(100):
        try:
            async with aioredis.Redis.from_url(url) as r:
                if await r.ping():
                    return
        except (OSError, aioredis.ConnectionError):
            await asyncio.sleep(0.05)
    raise AssertionError(f"no Redis at {url}")


async def until(predicate: object, timeout_s: float = 30.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition never held")


async def test_replies_arrive_over_the_reply_topic_while_redis_is_down(
    stack: StackInfo, topics: str, tmp_path: Path
) -> None:
    port = free_port()  # a Redis of this test's own, so stopping it disturbs nobody else
    url = f"redis://127.0.0.1:{port}/0"
    redis = start_redis(port)
    worker = None
    try:
        await wait_redis(url)
        worker = WorkerProcess(dataclasses.replace(stack, redis_url=url), topics, tmp_path, "--family", "noop")
        async with Client(stack.bootstrap, url) as client:
            await wait_until_served(client, topics)
            assert client.redis_healthy
            redis.kill()
            redis.wait()
            # Sent while the client still believes in Redis (the worker falls back), then after.
            before = client.replies_received["kafka"]
            results = [await client.infer(topics, [f"r{i}"], deadline_ms=30_000) for i in range(5)]
            assert [r.outputs for r in results] == [[2]] * 5
            assert client.replies_received["kafka"] - before == 5  # every one of them over the topic
            await until(lambda: not client.redis_healthy)
            assert (await client.infer(topics, ["kafka only"], deadline_ms=30_000)).outputs == [len("kafka only")]

            redis = start_redis(port)  # Redis comes back: the client returns to it by itself
            await wait_redis(url)
            await until(lambda: client.redis_healthy)
            assert (await client.infer(topics, ["back"], deadline_ms=30_000)).outputs == [4]
            assert client.duplicate_replies == 0
    finally:
        redis.kill()
        redis.wait()
        if worker is not None:
            worker.stop()


async def test_replies_over_kafka_by_choice(stack: StackInfo, topics: str, tmp_path: Path) -> None:
    worker = WorkerProcess(stack, topics, tmp_path, "--family", "noop")
    try:
        async with Client(stack.bootstrap, stack.redis_url, reply_via="kafka") as client:
            await wait_until_served(client, topics)
            results = await client.infer_many(topics, ["a", "bb", "ccc"], deadline_ms=30_000)
            assert [r.outputs for r in results if not isinstance(r, Exception)] == [[1], [2], [3]]
            assert client.redis_healthy  # Redis is fine; the client chose the durable route
            assert client.replies_received["redis"] == 0 and client.replies_received["kafka"] >= 3
    finally:
        worker.stop()
