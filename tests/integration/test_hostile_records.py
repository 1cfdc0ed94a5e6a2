"""Hostile records on kinfer's own channels and keys stop nothing.

A tenant that can write to Redis or ``kinfer.stats`` sends what nobody's code would: containers nested
100,000 deep, NaN and infinite waits, far-future dates, tombstones. The health watch, a worker under a
memory budget (its demand notes), the lag monitor (stats and residency) and the telemetry processor
count them, skip them and go on serving what is valid.
"""

from __future__ import annotations

import asyncio
import math
import urllib.request
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import msgpack
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from kinfer.consumers.runners.noop import NoopRunner
from kinfer.consumers.runners.registry import ModelSpec
from kinfer.consumers.worker import Worker, WorkerSettings
from kinfer.ops.control.lagmon import LagMonitor
from kinfer.ops.control.status import snapshot
from kinfer.ops.localstack.stack import StackInfo
from kinfer.producers import Client
from kinfer.topics import Status, now_ms
from kinfer.topics.admin import ensure_topics, model_topic_specs, shared_topic_specs
from kinfer.topics.health import HEALTH_CHANNEL, HealthState, Level, health_key
from kinfer.topics.progress import Answered, Position, answered_key
from kinfer.topics.residency import DEMAND_CHANNEL, RESIDENCY_KEY, ModelResidency, WorkerResidency
from kinfer.topics.stats import STATS_TOPIC, BatchStats, stats_key
from tests.integration.conftest import delete_model_topics
from tests.integration.test_residency import until
from tests.integration.test_telemetry import Telemetry, wait_ready, wait_summary

pytestmark = pytest.mark.integration

MB = 100  # each model's declared footprint; the budget holds one


def deep(depth: int) -> bytes:
    """A map whose one unknown key holds arrays ``depth`` deep: skipping it recurses."""
    return b"\x81\xa3zzz" + b"\x91" * depth + b"\xc0"


def forged(record: HealthState | WorkerResidency | BatchStats | Answered, **fields: object) -> bytes:
    return msgpack.packb({**msgpack.unpackb(record.pack(), strict_map_key=False), **fields})


def refused(reader: str) -> float:
    return sum(REGISTRY.get_sample_value("kinfer_malformed_records_total", {"reader": reader, "reason": r}) or 0.0
               for r in ("size", "depth", "syntax", "schema", "memory", "tombstone", "type", "future", "capacity"))


@pytest.fixture
async def two_models(stack: StackInfo) -> AsyncIterator[tuple[str, str]]:
    names = (f"ha-{uuid.uuid4().hex[:8]}", f"hb-{uuid.uuid4().hex[:8]}")
    await ensure_topics(stack.bootstrap, [*shared_topic_specs(), *(t for n in names for t in model_topic_specs(n, 3))])
    yield names
    for name in names:
        await delete_model_topics(stack.bootstrap, name)


async def test_hostile_health_demand_stats_residency_and_answered_records_stop_nothing(
    stack: StackInfo, two_models: tuple[str, str], client: Client
) -> None:
    a, b = two_models
    specs = tuple(ModelSpec(n, "noop", options={"footprint_mb": MB}) for n in two_models)
    worker = Worker(WorkerSettings(models=specs, bootstrap=stack.bootstrap, redis_url=stack.redis_url,
                                   memory_budget=1.5 * MB / 1024, residency_interval_s=0.2, worker_id="hostile-test"),
                    runners={n: NoopRunner(footprint_mb=MB) for n in two_models})
    serving = asyncio.create_task(worker.run())
    monitor = LagMonitor(stack.bootstrap, stack.redis_url, models=[a, b], interval_s=0.2)
    stop = asyncio.Event()
    watching = asyncio.create_task(monitor.run(stop))
    redis = aioredis.Redis.from_url(stack.redis_url)
    try:
        assert (await asyncio.wait_for(client.infer(a, ["x"], deadline_ms=60_000), 90)).status == Status.OK
        await until(lambda: client.health(a) is not None, "the client sees a's state")
        watch_refused, lagmon_refused = refused("health-watch"), refused("lagmon-residency")
        answered_refused = refused("lagmon-answered")
        valid = client.health(a)
        assert valid is not None
        now = now_ms()
        health_attacks = [
            deep(100_000), deep(3_000),  # too long; too deep (within the size limit)
            forged(valid, predicted_wait_ms=math.nan), forged(valid, cold_start_ms=math.inf, warm_replicas=0),
            forged(valid, level=int(Level.REJECTING), updated_ms=now + 3_600_000), b"\xc1",
        ]
        for data in health_attacks:
            await redis.publish(HEALTH_CHANNEL, data)
        await redis.set(health_key("hostile-only"), deep(100_000), px=60_000)  # what `kinfer status` reads
        for data in (deep(100_000), deep(200), msgpack.packb({"model": "a\n"}), msgpack.packb({"model": [[[a]]]})):
            await redis.publish(DEMAND_CHANNEL, data)  # the notes that would wake a cold model
        report = WorkerResidency("forged", now, 1, [ModelResidency(b, "host", 1, {"host": 1.0})])
        await redis.hset(RESIDENCY_KEY, mapping={
            "forged-deep": deep(60_000), "forged-inf": forged(report, models=[
                {"model": b, "tier": "host", "swap_in_ms": {"host": math.inf}}]),
            "forged-future": forged(report, updated_ms=now + 3_600_000),
        })
        await redis.set(stats_key(a), deep(3_000), px=60_000)
        # Answered reports that would raise a's floor past its log (a queue hidden), or break the reader.
        claim = Answered("forged", now, [Position(1, 0, 10)])
        await redis.hset(answered_key(a), mapping={
            "forged-deep": deep(200_000), "forged-negative": forged(claim, positions=[[1, 0, -5]]),
            "forged-nan": forged(claim, positions=[[1, math.nan, 5]]),
            "forged-future": forged(claim, updated_ms=now + 3_600_000, positions=[[1, 0, 2**62]]),
        })

        # The monitor reads, counts and removes the forged reports; nobody died.
        await until(lambda: refused("lagmon-residency") >= lagmon_refused + 3, "the monitor refused the reports")
        await until(lambda: refused("health-watch") >= watch_refused + len(health_attacks), "the watch refused all")
        assert not await redis.hexists(RESIDENCY_KEY, "forged-deep")
        assert not await redis.hexists(RESIDENCY_KEY, "forged-future")
        await until(lambda: refused("lagmon-answered") >= answered_refused + 4, "the monitor refused the claims")
        assert await redis.hlen(answered_key(a)) <= 1  # the forgeries removed; the worker's own report stays
        snap = await snapshot(redis)
        assert "hostile-only" not in snap.health and a in snap.health
        for task, what in ((serving, "worker"), (watching, "lag monitor")):
            assert not task.done(), f"the {what} died: {task.exception() if task.done() else ''}"
        assert (await client.ping())["health"]  # the watch never went down

        # ... and everything valid still goes through: the cold model is swapped in and served, the
        # client keeps a believable state.
        for model in (b, a):
            assert (await asyncio.wait_for(client.infer(model, ["y"], deadline_ms=60_000), 90)).status == Status.OK
        await until(lambda: (h := client.health(a)) is not None and h.updated_ms > now, "a fresh state after")
        seen = client.health(a)
        assert seen is not None and math.isfinite(seen.predicted_wait_ms) and seen.updated_ms <= now_ms() + 2_000
        assert not serving.done() and not watching.done()
    finally:
        stop.set()
        worker.stop()
        await asyncio.wait_for(asyncio.gather(serving, watching), 60)
        await redis.delete(health_key("hostile-only"))
        await redis.hdel(RESIDENCY_KEY, "forged-deep", "forged-inf", "forged-future")
        await redis.aclose()


def scrape(port: int, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


async def test_the_telemetry_processor_skips_tombstones_nesting_and_nan(stack: StackInfo, tmp_path: Path) -> None:
    model = f"tele-{uuid.uuid4().hex[:8]}"
    telemetry = Telemetry(stack, tmp_path, f"kinfer-telemetry-hostile-{uuid.uuid4().hex[:6]}")
    telemetry.start()
    try:
        await wait_ready(stack, telemetry)
        good = BatchStats(model, "w1", now_ms(), size=4, requests=4, compute_ms=8.0)
        hostile = [None, deep(100_000), deep(3_000), forged(good, compute_ms=math.nan),
                   forged(good, model="x" * 300), forged(good, at_ms=now_ms() + 3_600_000), b"\xc1"]
        producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap, acks="all")
        await producer.start()
        try:
            for _ in range(20):  # far more than one crash each would allow
                for value in hostile:
                    await producer.send(STATS_TOPIC, value, key=model.encode())
            await producer.send_and_wait(STATS_TOPIC, good.pack(), key=model.encode())
        finally:
            await producer.stop()
        summary = await wait_summary(stack, model, lambda s: s.inputs_total == 4, telemetry)
        assert summary.service_ms == pytest.approx(8.0)
        assert telemetry.proc is not None and telemetry.proc.poll() is None, telemetry.log()
        assert scrape(telemetry.metrics_port, "kinfer_malformed_records_total", reader="telemetry") == 20 * len(hostile)
    finally:
        if telemetry.proc is not None and telemetry.proc.poll() is None:
            telemetry.stop()
