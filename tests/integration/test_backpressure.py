"""Lag becomes a signal and producers obey it: refused at once, not enqueued to expire; a stall of
commits alone (the workers answering) is not a queue."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from prometheus_client import REGISTRY

from kinfer.consumers.runners.registry import ModelSpec
from kinfer.consumers.swapping import announcing
from kinfer.consumers.worker import Worker, WorkerSettings
from kinfer.ops.control.estimator import HealthPolicy
from kinfer.ops.control.lagmon import LagMonitor
from kinfer.ops.control.status import render, snapshot
from kinfer.ops.localstack.procs import wait_until_served
from kinfer.ops.localstack.stack import StackInfo
from kinfer.producers import Client
from kinfer.topics import Overloaded, Priority
from kinfer.topics.admin import offset_clients
from kinfer.topics.health import Level
from kinfer.topics.names import request_topic
from kinfer.topics.progress import answered_key
from kinfer.topics.residency import RESIDENCY_FRESH_MS
from tests.integration.conftest import WorkerProcess

pytestmark = pytest.mark.integration


async def end_offsets(bootstrap: str, topic: str) -> int:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        parts = [TopicPartition(topic, p) for p in range(3)]
        return sum((await consumer.end_offsets(parts)).values())
    finally:
        await consumer.stop()


async def test_a_standing_backlog_makes_producers_refuse_before_enqueueing(
    stack: StackInfo, topics: str, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    # Capacity 10/s (one request per 100 ms batch); CoDel off, so the backlog stands.
    spawn_worker(topics, "--family", "noop", "--option", "compute_ms=100", "--max-batch-size", "1",
                 "--codel-target-ms", "inf")
    monitor = LagMonitor(stack.bootstrap, stack.redis_url, models=[topics], interval_s=0.2,
                         policy=HealthPolicy(min_dwell_s=1.0))
    stop = asyncio.Event()
    watching = asyncio.create_task(monitor.run(stop))
    async with Client(stack.bootstrap, stack.redis_url, admission=False) as flood, \
            Client(stack.bootstrap, stack.redis_url) as polite:
        await wait_until_served(flood, topics)
        backlog = [asyncio.create_task(flood.infer(topics, [f"b{i}"], priority=Priority.P2, deadline_ms=120_000))
                   for i in range(150)]
        try:
            for _ in range(300):  # the monitor sees the standing queue within seconds
                state = monitor.states.get(topics)
                if state is not None and state.level >= Level.SHEDDING:
                    break
                await asyncio.sleep(0.1)
            assert state is not None and state.level >= Level.SHEDDING, state
            await asyncio.sleep(0.5)  # the notification reaches the polite client

            p2_topic = request_topic(topics, Priority.P2)
            before = await end_offsets(stack.bootstrap, p2_topic)
            with pytest.raises(Overloaded) as refused:
                await polite.infer(topics, ["more batch work"], priority=Priority.P2, deadline_ms=120_000)
            assert refused.value.retry_after_s >= 1.0 and refused.value.level in ("shedding", "rejecting")
            assert await end_offsets(stack.bootstrap, p2_topic) == before  # never enqueued

            for _ in range(300):  # the first poll of a burst knows the queue, not yet the workers' speed
                known = polite._health.get(topics)
                if known is not None and known.capacity_rps > 0:
                    break
                await asyncio.sleep(0.1)
            with pytest.raises(Overloaded, match="exceeds"):  # cannot make a 1 s deadline behind 15 s
                await polite.infer(topics, ["urgent but hopeless"], priority=Priority.P0, deadline_ms=1_000)
            refusals = REGISTRY.get_sample_value(
                "kinfer_admission_refused_total", {"model": topics, "priority": "p2", "cause": "level"})
            assert refusals == 1  # every refusal is visible in the process's metrics

            redis = aioredis.Redis.from_url(stack.redis_url)
            try:
                snap = await snapshot(redis, decisions=200)
            finally:
                await redis.aclose()
            seen = snap.health[topics]  # what `kinfer status` prints
            assert seen.level >= Level.SHEDDING
            assert seen.lag_by_priority[0] == 0 and seen.lag_by_priority[2] > 0  # the backlog is p2's
            assert next(c.after for c in snap.changes if c.model == topics) >= Level.SHEDDING  # newest first
            assert topics in render(snap)

            for _ in range(300):  # the first poll of a burst knows the queue, not yet the workers' speed
                seen_by_client = polite._health.get(topics)
                if seen_by_client is not None and seen_by_client.capacity_rps > 0:
                    break
                await asyncio.sleep(0.1)
            ok = await polite.infer(topics, ["urgent, patient"], priority=Priority.P0, deadline_ms=60_000)
            assert ok.ok  # p0 with a feasible deadline is admitted, and served ahead of the backlog
            # The service level's series (what the alert rules burn on) saw each ending.
            def ended(priority: str, outcome: str) -> float | None:
                labels = {"model": topics, "priority": priority, "outcome": outcome}
                return REGISTRY.get_sample_value("kinfer_client_requests_total", labels)

            assert ended("p2", "refused") == 1 and ended("p0", "refused") == 1 and ended("p0", "ok") == 1
            p0 = {"model": topics, "priority": "p0"}
            assert REGISTRY.get_sample_value("kinfer_client_request_seconds_count", p0) == 1
            assert sum(t.done() for t in backlog) < 100
        finally:
            for t in backlog:
                t.cancel()
            for t in backlog:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            stop.set()
            await watching


async def test_a_commit_stall_while_workers_answer_is_not_read_as_a_stopped_model(
    stack: StackInfo, topics: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Commits refused as they are while a group's coordinator moves (its broker died): the worker fetches,
    answers and reports what it answered. A monitor that reads committed offsets alone sees the queue
    grow and refuses the model; one that reads the answered reports too keeps admitting."""
    stalled = True

    async def commit(self: AIOKafkaConsumer, offsets: object = None) -> None:
        if stalled:
            raise KafkaError("the group coordinator is not available")
        await real_commit(self, offsets)

    real_commit = AIOKafkaConsumer.commit
    monkeypatch.setattr(AIOKafkaConsumer, "commit", commit)
    settings = WorkerSettings(models=(ModelSpec(topics, "noop"),), bootstrap=stack.bootstrap,
                              redis_url=stack.redis_url, worker_id="stalled-commits")
    worker = Worker(settings)
    serving = asyncio.create_task(worker.run())
    informed = LagMonitor(stack.bootstrap, stack.redis_url, models=[topics])
    blind = LagMonitor(stack.bootstrap, stack.redis_url, models=[topics], answered=False, name="blind")
    redis = aioredis.Redis.from_url(stack.redis_url)
    answered = []
    try:
        async with Client(stack.bootstrap, stack.redis_url, admission=False) as client, \
                offset_clients(stack.bootstrap) as (admin, consumer):
            await wait_until_served(client, topics)

            async def traffic() -> None:
                while True:
                    answered.append(asyncio.create_task(client.infer(topics, ["x"], deadline_ms=30_000)))
                    await asyncio.sleep(0.04)

            sending = asyncio.create_task(traffic())
            levels = []
            try:
                for _ in range(300):  # until the blind monitor refuses the model (seconds)
                    await asyncio.sleep(0.2)
                    levels.append((await informed.poll(admin, consumer, redis))[0].level)
                    if (await blind.poll(admin, consumer, redis))[0].level == Level.REJECTING:
                        break
            finally:
                sending.cancel()
            assert blind.states[topics].level == Level.REJECTING and blind.states[topics].lag > 50
            assert len(levels) > 5 and max(levels) < Level.SHEDDING, levels  # it kept admitting throughout
            assert informed.states[topics].lag < 50, informed.states[topics]
            results = await asyncio.gather(*answered)
            assert all(r.ok for r in results) and len(results) > 50
            assert await redis.hexists(answered_key(topics), "stalled-commits")

            stalled = False  # the coordinator is back: commits land, and both monitors agree again
            for _ in range(300):
                await asyncio.sleep(0.2)
                await informed.poll(admin, consumer, redis)
                if (await blind.poll(admin, consumer, redis))[0].lag == 0:
                    break
            assert blind.states[topics].lag == 0 and informed.states[topics].lag == 0
    finally:
        worker.stop()
        await asyncio.wait_for(serving, 60)
        assert not await redis.hexists(answered_key(topics), "stalled-commits")  # a stopped worker says so
        await redis.aclose()


async def test_a_request_that_waits_while_the_first_worker_loads_is_a_cold_start_not_a_stall(
    stack: StackInfo, topics: str
) -> None:
    """A worker starting (building its runners for longer than a report stays fresh, then loading its
    model: no worker warm yet) and a request already waiting: the worker says throughout that its models
    are loading, so the monitor reads the wait as the cold start's and the level stays where it was.
    Read as a stall, it rose to REJECTING and stayed there seconds after the worker came."""
    settings = WorkerSettings(models=(ModelSpec(topics, "noop", options={"load_ms": 4_000.0}),),
                              bootstrap=stack.bootstrap, redis_url=stack.redis_url, worker_id="slow-start")
    monitor = LagMonitor(stack.bootstrap, stack.redis_url, models=[topics])
    redis = aioredis.Redis.from_url(stack.redis_url)
    serving = None

    async def build() -> Worker:  # as `kinfer worker` builds its runners: here longer than a report stays fresh
        await asyncio.sleep(RESIDENCY_FRESH_MS / 1000.0 + 2.0)
        return Worker(settings)

    try:
        async with Client(stack.bootstrap, stack.redis_url, admission=False) as client, \
                offset_clients(stack.bootstrap) as (admin, consumer):
            building = asyncio.create_task(announcing(settings, build()))
            waiting = asyncio.create_task(client.infer(topics, ["early"], deadline_ms=60_000))
            seen = []
            while not building.done():
                await asyncio.sleep(0.2)
                state = (await monitor.poll(admin, consumer, redis))[0]
                seen.append((state.level, state.lag, state.warm_replicas, state.cold_start_ms > 0))
            worker = await building
            serving = asyncio.create_task(worker.run())
            while not waiting.done():
                await asyncio.sleep(0.2)
                state = (await monitor.poll(admin, consumer, redis))[0]
                seen.append((state.level, state.lag, state.warm_replicas, state.cold_start_ms > 0))
            assert (await waiting).ok
            for _ in range(5):  # and after it was answered
                await asyncio.sleep(0.2)
                state = (await monitor.poll(admin, consumer, redis))[0]
                seen.append((state.level, state.lag, state.warm_replicas, state.cold_start_ms > 0))
    finally:
        if serving is not None:
            worker.stop()
            await asyncio.wait_for(serving, 60)
        await redis.aclose()
    assert sum(1 for level, lag, warm, _ in seen if lag >= 1 and warm <= 0) >= 30, seen  # it waited on the start
    assert max(level for level, *_ in seen) < Level.SHEDDING, [(i, x) for i, x in enumerate(seen) if x[0]][:6]
