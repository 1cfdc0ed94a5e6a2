"""A client's reply readers survive whatever arrives on its Redis channel and on the shared reply
topic: nested, huge and garbage messages are counted and dropped, and the same client is still
answered, by either route, after them."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import httpx
import msgpack
import pytest
import redis.asyncio as aioredis
import uvicorn
from aiokafka import AIOKafkaProducer
from prometheus_client import REGISTRY

from kinfer.ops.localstack.procs import wait_until_served
from kinfer.ops.localstack.stack import StackInfo, free_port
from kinfer.producers import Client
from kinfer.producers.gateway import GatewaySettings, create_app
from kinfer.topics import Result, Status, seal
from kinfer.topics.names import DEFAULT_REPLY_TOPIC
from tests.integration.conftest import WorkerProcess

pytestmark = pytest.mark.integration

DEEP = 100_000


def plain_result(outputs: bytes) -> bytes:
    """A plain result map whose ``outputs`` are the raw msgpack bytes given."""
    head = msgpack.packb({"v": 1, "t": "res", "id": "r", "model": "m", "status": "ok"})
    return bytes([head[0] + 1]) + head[1:] + msgpack.packb("outputs") + outputs


def empty_maps(n: int) -> bytes:
    return plain_result(b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n)


# What a hostile publisher sends, and how a reader with a key refuses it on each route. On the shared
# topic a plain or foreign-sealed message is another client's as far as a reader can tell (not counted
# as refused, only as not ours).
HOSTILE: dict[str, tuple[bytes, str]] = {
    "nested arrays": (b"\x91" * DEEP + b"\xc0", "malformed"),
    "nested maps": (b"\x81\xa1k" * DEEP + b"\xc0", "malformed"),
    "nested under an unknown key": (b"\x82\xa1t\xa3res\xa1x" + b"\x91" * DEEP + b"\xc0", "malformed"),
    "nested outputs": (plain_result(b"\x91" * DEEP + b"\xc0"), "malformed"),
    "garbage": (bytes(range(256)) * 16, "malformed"),
    "a forged seal": (msgpack.packb({"t": "sealed", "v": 2, "salt": os.urandom(16), "box": os.urandom(64)}),
                      "unopened"),
    "a result sealed under another key": (seal(Result("r", "m", Status.OK, outputs=[666]), b"k" * 16), "unopened"),
}


async def test_hostile_replies_on_both_routes_leave_the_readers_serving(
    stack: StackInfo, topics: str, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    spawn_worker(topics, "--family", "noop")
    by_redis = Client(stack.bootstrap, stack.redis_url, tenant="tests")
    by_kafka = Client(stack.bootstrap, stack.redis_url, tenant="tests", reply_via="kafka")
    await by_redis.start()
    await by_kafka.start()
    producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap, max_request_size=4 * 1_048_576)
    await producer.start()
    try:
        await wait_until_served(by_redis, topics)
        huge_redis = empty_maps(16_000_000)  # 16 MB of empty maps: ~1 GB had they been built
        huge_kafka = empty_maps(900_000)  # what the broker's 1 MB message limit lets through
        async with aioredis.Redis.from_url(stack.redis_url) as r:
            for client in (by_redis, by_kafka):
                for data, _ in HOSTILE.values():
                    assert await r.publish(client.reply_channel, data) == 1
                assert await r.publish(client.reply_channel, huge_redis) == 1
        for data, _ in HOSTILE.values():
            await producer.send_and_wait(DEFAULT_REPLY_TOPIC, data)
        await producer.send_and_wait(DEFAULT_REPLY_TOPIC, huge_kafka)
        await producer.send_and_wait(DEFAULT_REPLY_TOPIC, None, key=b"tombstone")

        reasons = [reason for _, reason in HOSTILE.values()]
        expected_redis = {reason: reasons.count(reason) for reason in reasons}
        expected_redis["unsealed"] = 1  # the huge one
        expected_kafka = {"malformed": reasons.count("malformed") + 1}  # and the tombstone
        for client in (by_redis, by_kafka):
            for _ in range(600):
                got = client.refused_replies
                if ({k: got.get(("redis", k), 0) for k in expected_redis} == expected_redis
                        and got.get(("kafka", "malformed"), 0) == expected_kafka["malformed"]):
                    break
                await asyncio.sleep(0.05)
            assert {k: got.get(("redis", k), 0) for k in expected_redis} == expected_redis, got
            assert got.get(("kafka", "malformed"), 0) == expected_kafka["malformed"], got
            assert set(got) <= {("redis", r) for r in expected_redis} | {("kafka", "malformed")}, got  # no "error"
            assert (await client.ping())["replies"]  # readiness: every reader runs

        # The same clients are still answered, each by its own route.
        before = by_kafka.replies_received["kafka"]
        assert (await by_redis.infer(topics, ["after"], deadline_ms=30_000)).outputs == [len("after")]
        assert (await by_kafka.infer(topics, ["by kafka"], deadline_ms=30_000)).outputs == [len("by kafka")]
        assert by_kafka.replies_received["kafka"] == before + 1 and by_redis.replies_received["redis"] >= 2
    finally:
        await producer.stop()
        await by_kafka.close()
        await by_redis.close()


async def test_the_gateway_answers_and_stays_ready_through_hostile_replies(
    stack: StackInfo, topics: str, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    spawn_worker(topics, "--family", "noop")
    async with Client(stack.bootstrap, stack.redis_url, tenant="tests") as probe:
        await wait_until_served(probe, topics)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(GatewaySettings(stack.bootstrap, stack.redis_url, None)),
                                          host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:  # noqa: ASYNC110 - uvicorn exposes a flag, not an event
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http, \
                aioredis.Redis.from_url(stack.redis_url) as r:
            # What an attacker on an open Redis does: find the gateways' reply channels, flood them.
            channels = [c.decode() for c in await r.pubsub_channels("kinfer:reply:gateway:*")]
            assert channels
            labels = {"reader": "redis", "reason": "malformed"}
            before = REGISTRY.get_sample_value("kinfer_client_replies_refused_total", labels) or 0.0
            for _ in range(3):
                for data, _ in HOSTILE.values():
                    for channel in channels:
                        await r.publish(channel, data)
            for i in range(5):
                got = await http.post(f"/v1/models/{topics}/infer", json={"inputs": ["x" * i]})
                assert got.status_code == 200 and got.json()["outputs"] == [i], got.text
            ready = await http.get("/readyz")
            assert ready.status_code == 200 and ready.json()["replies"], ready.text
            # The gateway runs in this process: its reader counted every malformed message it was sent.
            malformed = sum(reason == "malformed" for _, reason in HOSTILE.values())
            after = REGISTRY.get_sample_value("kinfer_client_replies_refused_total", labels) or 0.0
            assert after - before >= 3 * malformed
            assert 'reason="malformed"' in (await http.get("/metrics")).text
    finally:
        server.should_exit = True
        await task
