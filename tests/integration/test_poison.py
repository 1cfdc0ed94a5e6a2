"""A record that kills the worker handling it: pinned down by the next owner, dead-lettered by the one after.

The noop model's ``abort_at_chars`` ends the process on the spot (``os._exit``) when an input has that
many characters — a stand-in for a native crash or the OOM killer, which no ``try`` can catch.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer

from kinfer.ops.localstack.stack import StackInfo
from kinfer.producers import Client
from kinfer.topics import Priority, ReplyRoute, Request, Status, now_ms, pack
from kinfer.topics.names import request_topic
from tests.integration.conftest import WorkerProcess
from tests.integration.test_faults import NO_CODEL, dead_letters_from, first_result

pytestmark = pytest.mark.integration

POISON = "x" * 13


async def test_a_record_that_kills_workers_stops_two_at_most(
    client: Client, stack: StackInfo, topics: str, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    args = ("--family", "noop", "--option", f"abort_at_chars={len(POISON)}", "--session-timeout-ms", "6000",
            *NO_CODEL)
    channel = f"kinfer:reply:tests:{uuid.uuid4().hex[:8]}"
    first = spawn_worker(topics, *args)
    async with aioredis.Redis.from_url(stack.redis_url) as r, r.pubsub() as sub:
        await sub.subscribe(channel)
        producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap)
        await producer.start()
        try:
            request = Request(id="poison", model=topics, priority=Priority.P1, tenant="tests", created_ms=now_ms(),
                              deadline_ms=now_ms() + 600_000, inputs=(POISON,), reply=ReplyRoute.channel(channel))
            await producer.send_and_wait(request_topic(topics, Priority.P1), pack(request), partition=0)
        finally:
            await producer.stop()
        await asyncio.to_thread(first.proc.wait, 120)
        assert first.proc.returncode == 70  # stopped by the record
        second = spawn_worker(topics, *args)  # careful: the record runs alone, marked, and stops it too
        await asyncio.to_thread(second.proc.wait, 120)
        assert second.proc.returncode == 70
        assert "records alone" in second.log()
        third = spawn_worker(topics, *args)  # finds the mark on it: dead-lettered, never run
        reply = await first_result(sub, timeout_s=120.0)
        assert reply is not None and reply.id == "poison" and reply.status is Status.INVALID, reply
        assert "stopped 2 workers" in (reply.error or "")
    letters = await dead_letters_from(stack.bootstrap, topics, want=1)
    assert [h["reason"] for h in letters] == ["the record stopped 2 workers while in flight"]
    # ...and the third serves on, every partition of it.
    results = await asyncio.gather(*(client.infer(topics, [f"after {i}"], deadline_ms=60_000) for i in range(12)))
    assert [r.outputs for r in results] == [[len(f"after {i}")] for i in range(12)]
    assert third.proc.poll() is None
