"""The telemetry stream: workers report every batch, the faust processor keeps windowed per-model
tables, publishes summaries to Redis, and survives a restart without forgetting what it counted."""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from prometheus_client.parser import text_string_to_metric_families

from kinfer.ops.control.telemetry import changelog, changelog_configs
from kinfer.ops.localstack.procs import spawn
from kinfer.ops.localstack.stack import StackInfo, free_port
from kinfer.producers import Client
from kinfer.topics import now_ms
from kinfer.topics.admin import TopicSpec, delete_topics, ensure_topics, set_topic_configs
from kinfer.topics.stats import STATS_TOPIC, BatchStats, ModelStats, stats_key
from tests.integration.conftest import WorkerProcess

pytestmark = pytest.mark.integration


class Telemetry:
    """A real ``kinfer telemetry`` process with its own app id (consumer group, changelog topics)."""

    def __init__(self, stack: StackInfo, log_dir: Path, app_id: str) -> None:
        self.stack, self.log_path, self.app_id = stack, log_dir / f"{app_id}.log", app_id
        self.proc: subprocess.Popen[bytes] | None = None
        self.metrics_port = free_port()

    def start(self) -> None:
        self.proc = spawn(self.stack, "telemetry", "--app-id", self.app_id, "--window-s", "120", "--publish-s", "0.3",
                          "--metrics-port", str(self.metrics_port), log_path=str(self.log_path))

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.terminate()
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def metrics(self, model: str) -> dict[str, float]:
        """The processor's samples labelled with ``model``."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
                if s.labels.get("model") == model}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


async def wait_summary(stack: StackInfo, model: str, done: Callable[[ModelStats], bool],
                       telemetry: Telemetry, timeout_s: float = 120.0) -> ModelStats:
    redis = aioredis.Redis.from_url(stack.redis_url)
    deadline = time.monotonic() + timeout_s
    last = None
    try:
        while True:
            data = await redis.get(stats_key(model))
            if data is not None:
                last = ModelStats.unpack(data)
                if done(last):
                    return last
            assert telemetry.proc is not None and telemetry.proc.poll() is None, telemetry.log()
            assert time.monotonic() < deadline, f"summary never matched; last: {last}\n{telemetry.log()}"
            await asyncio.sleep(0.2)
    finally:
        await redis.aclose()


async def wait_ready(stack: StackInfo, telemetry: Telemetry) -> None:
    """Until the processor consumes: a probe model's record shows up in a summary."""
    probe = f"probe-{uuid.uuid4().hex[:8]}"
    redis = aioredis.Redis.from_url(stack.redis_url)
    try:
        for _ in range(240):
            await publish(stack, [BatchStats(probe, "w0", now_ms(), size=1, requests=1, compute_ms=1.0)])
            if await redis.get(stats_key(probe)) is not None:
                return
            assert telemetry.proc is not None and telemetry.proc.poll() is None, telemetry.log()
            await asyncio.sleep(0.5)
        raise AssertionError(f"the processor never consumed:\n{telemetry.log()}")
    finally:
        await redis.aclose()


async def publish(stack: StackInfo, records: list[BatchStats]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap, acks="all")
    await producer.start()
    try:
        for r in records:
            await producer.send_and_wait(STATS_TOPIC, r.pack(), key=r.model.encode())
    finally:
        await producer.stop()


async def test_changelogs_made_before_their_configs_are_given_them_and_keep_faust_s_own(stack: StackInfo) -> None:
    app_id = f"kinfer-telemetry-old-{uuid.uuid4().hex[:6]}"
    windowed, latest = changelog(app_id, "inputs"), changelog(app_id, "workers")
    # As an older processor (or faust alone) made them: Kafka's week-long segments.
    await ensure_topics(stack.bootstrap, [
        TopicSpec(windowed, 1, configs={"cleanup.policy": "compact,delete", "retention.ms": "60000"}),
        TopicSpec(latest, 1, configs={"cleanup.policy": "compact"})])
    wanted = {name: configs for name, configs in changelog_configs(app_id, 10).items() if name in (windowed, latest)}
    wanted[changelog(app_id, "never-made")] = {"segment.ms": "1000"}
    try:
        assert sorted(await set_topic_configs(stack.bootstrap, wanted)) == sorted([windowed, latest])
        admin = AIOKafkaAdminClient(bootstrap_servers=stack.bootstrap)
        await admin.start()
        try:
            described = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, t)
                                                      for t in (windowed, latest)])
            configs = {r[3]: {e[0]: e[1] for e in r[4]} for response in described for r in response.resources}
            assert (await admin.list_topics()).count(changelog(app_id, "never-made")) == 0
        finally:
            await admin.close()
        assert {k: configs[windowed][k] for k in ("cleanup.policy", "retention.ms", "segment.ms")} == {
            "cleanup.policy": "compact,delete", "retention.ms": "60000", "segment.ms": "60000"}
        assert {k: configs[latest][k] for k in ("cleanup.policy", "segment.ms")} == {
            "cleanup.policy": "compact", "segment.ms": "3600000"}
        assert await set_topic_configs(stack.bootstrap, wanted) == []  # as wanted already: nothing to do
    finally:
        await delete_topics(stack.bootstrap, [windowed, latest])


async def test_windowed_tables_survive_a_restart(stack: StackInfo, tmp_path: Path) -> None:
    model = f"tele-{uuid.uuid4().hex[:8]}"
    telemetry = Telemetry(stack, tmp_path, f"kinfer-telemetry-test-{uuid.uuid4().hex[:6]}")
    telemetry.start()
    try:
        def batch(size: int, ms: float, **shed: int) -> BatchStats:
            return BatchStats(model, "w1", now_ms(), size=size, requests=size, tokens=size * 8, compute_ms=ms,
                              shed=dict(shed))

        await wait_ready(stack, telemetry)  # a new processor starts at the end of the topic
        await publish(stack, [batch(1, 10.0), batch(1, 12.0), batch(8, 40.0), batch(0, 0.0, codel=3, expired=2)])
        # The summary may be published between two of these records: wait for the last one (the shed).
        first = await wait_summary(stack, model, lambda s: s.inputs_total == 10 and bool(s.shed), telemetry)
        assert first.service_ms_by_size == {1: 11.0, 8: 40.0}
        assert first.shed == {"codel": 3, "expired": 2}
        assert first.mean_batch == pytest.approx(10 / 3, abs=1e-3)
        assert first.inputs_rps > 0
        metrics = telemetry.metrics(model)  # its Prometheus port says the same
        assert metrics["kinfer_telemetry_records_total"] == 4
        assert metrics["kinfer_telemetry_service_seconds"] == pytest.approx(first.service_ms / 1000)

        assert telemetry.stop() == 0  # graceful: commits, leaves the group
        # ... and leaves no folder behind: the tables come back from their changelogs alone.
        assert not [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(f"{telemetry.app_id}-")]
        restarted = now_ms()
        telemetry.start()
        # The restarted processor rebuilt its tables from the changelogs before it publishes again.
        await wait_summary(stack, model, lambda s: s.updated_ms > restarted + 1000 and s.inputs_total == 10, telemetry)
        await publish(stack, [batch(8, 44.0, codel=1)])
        # ... and adds to what it had.
        after = await wait_summary(stack, model, lambda s: s.inputs_total == 18, telemetry)
        assert after.service_ms_by_size == {1: 11.0, 8: 42.0}
        assert after.shed == {"codel": 4, "expired": 2}
    finally:
        if telemetry.proc is not None and telemetry.proc.poll() is None:
            telemetry.stop()


async def test_workers_report_every_batch_they_run(
    stack: StackInfo, topics: str, client: Client, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    consumer = AIOKafkaConsumer(bootstrap_servers=stack.bootstrap, enable_auto_commit=False)
    await consumer.start()
    tp = TopicPartition(STATS_TOPIC, 0)
    consumer.assign([tp])
    start = (await consumer.end_offsets([tp]))[tp]
    consumer.seek(tp, start)
    worker = spawn_worker(topics, "--family", "noop")
    try:
        results = await asyncio.gather(*(client.infer(topics, [f"text {i}", "b"], deadline_ms=60_000)
                                         for i in range(30)))
        assert all(r.outputs for r in results)
        seen: list[BatchStats] = []
        deadline = time.monotonic() + 30
        while sum(s.requests for s in seen) < 30:
            assert time.monotonic() < deadline, f"stats for {sum(s.requests for s in seen)} of 30 requests"
            for records in (await consumer.getmany(tp, timeout_ms=500)).values():
                seen += [s for r in records if (s := BatchStats.unpack(r.value or b"")).model == topics]
        assert sum(s.requests for s in seen) == 30
        assert sum(s.size for s in seen) == 60  # two inputs each
        assert all(s.worker == worker.worker_id and s.compute_ms >= 0 for s in seen)
    finally:
        await consumer.stop()
        worker.stop()
