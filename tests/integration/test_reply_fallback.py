"""A Redis outage slows replies but loses none: they come over the Kafka reply topic, and a request whose
reply was published on the client's channel while the client could not read it is asked for again."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from kinfer.ops.localstack.procs import wait_until_served
from kinfer.ops.localstack.stack import StackInfo, free_port
from kinfer.producers import Client
from kinfer.producers.hedging import HedgePolicy
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


class RedisCut:
    """A TCP relay in front of Redis for one client: ``cut()`` drops the client's connections and turns new
    ones away (closed as soon as they are accepted) until ``mend()``. Redis itself serves on for everyone else."""

    def __init__(self, redis_port: int) -> None:
        self.redis_port = redis_port
        self.refusing = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}/0"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.redis_port)
        self._writers |= {writer, up_writer}

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except OSError:
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        self._writers -= {writer, up_writer}

    def cut(self) -> None:
        self.refusing = True
        for writer in self._writers:
            writer.close()

    def mend(self) -> None:
        self.refusing = False

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def test_a_reply_published_while_the_client_could_not_read_its_channel_is_asked_for_again(
    stack: StackInfo, topics: str, tmp_path: Path
) -> None:
    """The lost-reply mechanism, in order. A request goes out with the client's Redis channel as its route;
    the client loses its subscription before the reply; the worker publishes it on the channel, where
    another subscriber hears it, so the worker takes it as delivered and sends nothing to the fallback
    topic; the client subscribes again. Without asking again, the call would wait out its deadline."""
    relay = RedisCut(stack.redis_port)
    worker = WorkerProcess(stack, topics, tmp_path, "--family", "noop")
    witness = aioredis.Redis.from_url(stack.redis_url)
    listening = witness.pubsub(ignore_subscribe_messages=True)
    try:
        async with Client(stack.bootstrap, await relay.start(), hedging=HedgePolicy(enabled=False)) as client:
            await wait_until_served(client, topics)
            await listening.subscribe(client.reply_channel)  # heard by it, a PUBLISH counts as delivered
            worker.proc.send_signal(signal.SIGSTOP)
            call = asyncio.create_task(client.infer(topics, ["while away"], deadline_ms=20_000))
            await asyncio.sleep(0)  # the request takes its route: the channel, Redis being fine
            relay.cut()
            await until(lambda: not client.redis_healthy)
            worker.proc.send_signal(signal.SIGCONT)
            heard = None
            while heard is None or heard.get("type") != "message":  # the worker answered, on the channel
                heard = await listening.get_message(timeout=30.0)
            assert not call.done() and client.asked_again == 0
            relay.mend()  # the client subscribes again, and asks again
            assert (await call).outputs == [len("while away")]
            assert client.asked_again == 1
    finally:
        worker.proc.send_signal(signal.SIGCONT)
        worker.stop()
        await relay.close()
        await listening.aclose()
        await witness.aclose()
