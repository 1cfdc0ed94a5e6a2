"""Faults: bad input, a worker killed mid-batch, a graceful stop, requests that expire in the queue."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from redis.asyncio.client import PubSub

from kinfer.ops.localstack.procs import wait_until_served
from kinfer.ops.localstack.stack import StackInfo
from kinfer.producers import Client
from kinfer.topics import (
    DeadlineExceeded,
    Priority,
    ReplyRoute,
    Request,
    Result,
    Status,
    decode_result,
    now_ms,
    pack,
)
from kinfer.topics.names import DLQ_TOPIC, consumer_group, request_topic, request_topics
from tests.integration.conftest import WorkerProcess

pytestmark = pytest.mark.integration

# For tests about something other than overload: a deliberate backlog must not be shed.
NO_CODEL = ("--codel-target-ms", "inf")


async def dead_letters_from(bootstrap: str, model: str, want: int, timeout_s: float = 60.0) -> list[dict[str, str]]:
    """Headers of the DLQ records whose source is one of ``model``'s topics (and ``null: "1"`` for a null value)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([TopicPartition(DLQ_TOPIC, 0)])
        found: list[dict[str, str]] = []
        deadline = time.monotonic() + timeout_s
        while len(found) < want and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for rec in records:
                    headers = {k: v.decode() for k, v in rec.headers}
                    if rec.value is None:
                        headers["null"] = "1"
                    if headers["source"].startswith(f"infer.{model}."):
                        found.append(headers)
        return found
    finally:
        await consumer.stop()


async def first_result(sub: PubSub, timeout_s: float) -> Result | None:
    """The first result published on ``sub``'s channel within ``timeout_s`` (None: nothing came)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        msg = await sub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if msg is not None:
            return decode_result(msg["data"])
    return None


async def test_bad_records_go_to_the_dead_letter_topic_and_the_worker_keeps_answering(
    client: Client, stack: StackInfo, topics: str, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    worker = spawn_worker(topics, "--family", "noop")
    await wait_until_served(client, topics)
    channel = f"kinfer:reply:test-{uuid.uuid4().hex[:8]}"
    over_limit = Request(
        id="too-big", model=topics, priority=Priority.P1, tenant="tests", created_ms=now_ms(),
        deadline_ms=now_ms() + 30_000, inputs=("x" * 20_000,), reply=ReplyRoute.channel(channel),
    )
    async with aioredis.Redis.from_url(stack.redis_url) as r, r.pubsub() as sub:
        await sub.subscribe(channel)
        producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap)
        await producer.start()
        try:
            topic = request_topic(topics, Priority.P1)
            await producer.send_and_wait(topic, b"\x93\x01\x02 this is not an envelope")
            await producer.send_and_wait(topic, pack(over_limit))
            await producer.send_and_wait(topic, msgpack.packb({"v": 1, "t": "req", "id": "no-fields"}))
            await producer.send_and_wait(topic, None, key=b"gone")  # a tombstone
        finally:
            await producer.stop()
        # The over-limit request named its reply route, so its caller hears why it was refused.
        reply = await first_result(sub, timeout_s=20.0)
        assert reply is not None and reply.id == "too-big" and reply.status is Status.INVALID
        assert "over the limit of 16384" in (reply.error or "")

    letters = await dead_letters_from(stack.bootstrap, topics, want=4)
    tombstone = [h for h in letters if "tombstone" in h["reason"]]
    assert len(tombstone) == 1 and tombstone[0].get("null") == "1"  # dead-lettered as it came: null
    letters.remove(tombstone[0])
    reasons = sorted((h["field"], h["reason"]) for h in letters)
    assert [f for f, _ in reasons] == ["inputs", "message", "model"], reasons
    assert "not a valid msgpack envelope" in dict(reasons)["message"]
    assert "over the limit" in dict(reasons)["inputs"]
    # ...and the worker is still serving.
    result = await client.infer(topics, ["still here"], deadline_ms=10_000)
    assert result.outputs == [len("still here")]
    assert worker.metric("kinfer_dead_letters_total") == 4


async def test_worker_killed_after_fetching_loses_nothing(
    client: Client, topics: str, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    instance = f"inst-{uuid.uuid4().hex[:6]}"
    common = ("--family", "noop", "--instance-id", instance, "--session-timeout-ms", "6000", *NO_CODEL)
    # This worker fetches, starts its first batch and never finishes it.
    stuck = spawn_worker(topics, *common, "--option", "compute_ms=600000")
    calls = [
        asyncio.create_task(client.infer(topics, [f"request {i}"], deadline_ms=120_000, request_id=f"k{i}-{instance}"))
        for i in range(20)
    ]
    await stuck.wait_metric("kinfer_queue_wait_seconds_count", 20)  # all 20 fetched, none answered
    assert not any(c.done() for c in calls)
    stuck.proc.kill()
    stuck.proc.wait()

    rescuer = spawn_worker(topics, *common)  # same static member id: takes the partitions over at once
    results = await asyncio.wait_for(asyncio.gather(*calls), 120)
    assert sorted(r.id for r in results) == sorted(f"k{i}-{instance}" for i in range(20))
    assert all(r.ok and r.worker == rescuer.worker_id for r in results)
    assert [r.outputs for r in results] == [[len(f"request {i}")] for i in range(20)]


async def test_sigterm_finishes_the_batch_replies_and_commits(
    client: Client, stack: StackInfo, topics: str, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    worker = spawn_worker(
        topics, "--family", "noop", "--option", "compute_ms=200", "--max-batch-size", "4", *NO_CODEL
    )
    await wait_until_served(client, topics)
    calls = [asyncio.create_task(client.infer(topics, [f"r{i}"], deadline_ms=60_000)) for i in range(30)]
    await worker.wait_metric("kinfer_queue_wait_seconds_count", 31)  # the probe + 30 fetched
    assert worker.stop() == 0
    results = await asyncio.gather(*calls)
    assert all(r.ok and r.worker == worker.worker_id for r in results)

    # Everything it answered is committed: a successor would find nothing to redo.
    admin = AIOKafkaAdminClient(bootstrap_servers=stack.bootstrap)
    consumer = AIOKafkaConsumer(bootstrap_servers=stack.bootstrap)
    await admin.start()
    await consumer.start()
    try:
        committed = await admin.list_consumer_group_offsets(consumer_group(topics))
        parts = [TopicPartition(t, p) for t in request_topics(topics) for p in range(3)]
        ends = await consumer.end_offsets(parts)
        for tp in parts:
            position = committed[tp].offset if tp in committed else 0
            assert position == ends[tp], (tp, position, ends[tp])
    finally:
        await consumer.stop()
        await admin.close()


async def test_request_that_expires_in_the_queue_gets_no_compute(
    client: Client, topics: str, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    worker = spawn_worker(topics, "--family", "noop", "--option", "compute_ms=1500")
    await wait_until_served(client, topics, timeout_s=180)
    slow = asyncio.create_task(client.infer(topics, ["occupies the model"], deadline_ms=30_000))
    await worker.wait_metric("kinfer_queue_wait_seconds_count", 2)
    with pytest.raises(DeadlineExceeded):
        await client.infer(topics, ["too late"], priority=Priority.P0, deadline_ms=300)
    assert (await slow).ok
    # Its one terminal reply is "expired", given before compute (a computed request answers "ok").
    await worker.wait_metric("kinfer_results_total", 1, status="expired")
    assert worker.metric("kinfer_shed_total", priority="p0") == 1


async def test_sigkill_with_coalesced_commits_replays_but_loses_nothing(
    client: Client, topics: str, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    """Commits every 60 s: the kill surely lands after replies went out and before their commit. The
    rescuer answers those again; the caller sees each request answered once, and nothing is lost."""
    instance = f"inst-{uuid.uuid4().hex[:6]}"
    common = ("--family", "noop", "--instance-id", instance, "--session-timeout-ms", "6000", *NO_CODEL)
    first = spawn_worker(topics, *common, "--commit-interval-ms", "60000")
    await wait_until_served(client, topics)
    answered = [await client.infer(topics, [f"early {i}"], deadline_ms=60_000) for i in range(30)]
    assert all(r.worker == first.worker_id for r in answered)
    stuck = [
        asyncio.create_task(client.infer(topics, [f"late {i}"], deadline_ms=120_000, request_id=f"l{i}-{instance}"))
        for i in range(20)
    ]
    await asyncio.sleep(0)  # in flight, some possibly answered, none committed
    first.proc.kill()
    first.proc.wait()
    rescuer = spawn_worker(topics, *common)
    results = await asyncio.wait_for(asyncio.gather(*stuck), 120)
    assert sorted(r.id for r in results) == sorted(f"l{i}-{instance}" for i in range(20))
    assert all(r.ok for r in results)
    # The rescuer started from the last commit: the 30 early requests (answered, never committed) ran again,
    # and their second replies were dropped by the client, not handed to anyone.
    await rescuer.wait_metric("kinfer_results_total", 30)
    assert client.duplicate_replies >= 1


def _state(pid: int) -> str:
    """The process's command and its threads' states ("T": stopped), from /proc."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[-120:].decode(errors="replace")
        states = sorted({Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()[0]
                         for t in os.listdir(f"/proc/{pid}/task")})
    except OSError as exc:
        return f"pid {pid}: {exc}"
    return f"pid {pid} ({command}): thread states {states}"


def _stopped(pid: int, looks: int = 200) -> bool:
    """Whether every thread of ``pid`` is stopped, looking up to ``looks`` times 10 ms apart."""
    for _ in range(looks):
        if _state(pid).endswith("thread states ['T']"):
            return True
        time.sleep(0.01)
    return False


async def test_infer_returns_by_its_deadline_while_the_broker_is_stopped(
    stack: StackInfo, topics: str, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    if not stack.kafka_pid:
        pytest.skip("needs the broker of the local stack (KINFER_BOOTSTRAP names one this test did not start)")
    spawn_worker(topics, "--family", "noop")
    async with Client(stack.bootstrap, stack.redis_url, tenant="tests") as client:
        await wait_until_served(client, topics)
        os.kill(stack.kafka_pid, signal.SIGSTOP)  # the broker takes connections and answers nothing
        try:
            # Every thread of the broker stopped before a request goes out (and the pid is the broker's).
            assert await asyncio.to_thread(_stopped, stack.kafka_pid), _state(stack.kafka_pid)
            calls = [client.infer(topics, [f"r{i}"], deadline_ms=1_500) for i in range(20)]
            # Unbounded, these would wait for the producer's 40 s request timeout (or for SIGCONT).
            outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 20)
        finally:
            os.kill(stack.kafka_pid, signal.SIGCONT)
        assert all(isinstance(o, DeadlineExceeded) and not o.answered and not o.accepted for o in outcomes), outcomes
        assert (await client.infer(topics, ["after"], deadline_ms=60_000)).ok


async def test_a_reply_topic_that_does_not_exist_pins_no_partition(
    client: Client, stack: StackInfo, topics: str, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    worker = spawn_worker(topics, "--family", "noop")
    await wait_until_served(client, topics)
    nowhere = f"replies.nowhere-{uuid.uuid4().hex[:6]}"
    topic = request_topic(topics, Priority.P1)

    def routed_nowhere(i: int) -> Request:
        return Request(id=f"nowhere-{i}", model=topics, priority=Priority.P1, tenant="tests", created_ms=now_ms(),
                       deadline_ms=now_ms() + 3_600_000, inputs=("x",), reply=ReplyRoute(kafka=nowhere))

    producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap)
    await producer.start()
    try:
        # The first is computed; its reply has nowhere to go: counted and dropped, never retried.
        await producer.send_and_wait(topic, pack(routed_nowhere(0)), partition=0)
        await worker.wait_metric("kinfer_replies_undelivered_total", 1)
        # The next is refused before any compute: the topic is known to be missing.
        await producer.send_and_wait(topic, pack(routed_nowhere(1)), partition=0)
        await worker.wait_metric("kinfer_dead_letters_total", 1, field="reply")
        end = await producer.send_and_wait(topic, pack(Request(
            id="after", model=topics, priority=Priority.P1, tenant="tests", created_ms=now_ms(),
            deadline_ms=now_ms() + 60_000, inputs=("y",), reply=ReplyRoute(kafka="replies.default"),
        )), partition=0)
    finally:
        await producer.stop()
    # The partition's commit moves past all three: nothing pins it, nothing will be answered twice.
    admin = AIOKafkaAdminClient(bootstrap_servers=stack.bootstrap)
    await admin.start()
    try:
        for _ in range(300):
            committed = await admin.list_consumer_group_offsets(consumer_group(topics))
            position = committed.get(TopicPartition(topic, 0))
            if position is not None and position.offset > end.offset:
                break
            await asyncio.sleep(0.1)
        assert position is not None and position.offset == end.offset + 1
    finally:
        await admin.close()
    assert worker.metric("kinfer_results_total") >= 2  # "after" and the first one were answered


async def test_a_static_member_leaves_its_group_on_sigterm(
    client: Client, stack: StackInfo, topics: str, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    """Otherwise its partitions would sit idle for the session timeout on every graceful restart."""
    worker = spawn_worker(topics, "--family", "noop", "--instance-id", f"inst-{uuid.uuid4().hex[:6]}")
    await wait_until_served(client, topics)
    admin = AIOKafkaAdminClient(bootstrap_servers=stack.bootstrap)
    await admin.start()

    async def members() -> int:
        described = await admin.describe_consumer_groups([consumer_group(topics)])
        return sum(len(group[5]) for response in described for group in response.groups)

    try:
        assert await members() == 1
        assert worker.stop() == 0
        assert await members() == 0  # gone at once, not after the session timeout
    finally:
        await admin.close()
