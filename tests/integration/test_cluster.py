"""Three brokers on this machine, started once for the module: topics follow the cluster (three copies, two
in sync), losing one broker under load loses nothing and duplicates nothing a caller sees, and the fleet
as a whole comes through a short chaos soak (``kinfer bench chaos``)."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from kinfer.ops.bench.chaos import FAULTS, KINDS, ChaosConfig, bench_chaos
from kinfer.ops.localstack.procs import wait_until_served
from kinfer.ops.localstack.stack import LocalStack, StackInfo
from kinfer.producers import Client
from kinfer.topics import now_ms
from kinfer.topics.admin import ensure_topics, model_topic_specs, shared_topic_specs
from kinfer.topics.names import request_topic
from kinfer.topics.stats import BatchStats
from tests.integration.conftest import WorkerProcess
from tests.integration.test_telemetry import Telemetry, publish, wait_ready, wait_summary

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalStack, StackInfo]]:
    local = LocalStack(tmp_path_factory.mktemp("cluster"), brokers=3, controllers=3)  # as production runs it
    info, _ = local.up(timeout_s=180)
    try:
        yield local, info
    finally:
        local.down()


async def test_topics_follow_the_cluster_and_one_broker_down_loses_nothing(
    cluster: tuple[LocalStack, StackInfo], tmp_path: Path
) -> None:
    local, info = cluster
    model = f"r-{uuid.uuid4().hex[:8]}"
    await ensure_topics(info.bootstrap, [*shared_topic_specs(), *model_topic_specs(model, 3)])
    admin = AIOKafkaAdminClient(bootstrap_servers=info.bootstrap)
    await admin.start()
    try:
        described = await admin.describe_topics([request_topic(model, 1)])
        assert all(len(p["replicas"]) == 3 for p in described[0]["partitions"])
        entries: dict[str, str] = {}
        for _ in range(100):  # a broker that has not yet applied the topic's config answers empty, or the default
            configs = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, request_topic(model, 1))])
            entries = {c[0]: c[1] for c in configs[0].resources[0][4]}
            if entries.get("min.insync.replicas") == "2":
                break
            await asyncio.sleep(0.1)
        assert entries.get("min.insync.replicas") == "2", configs
    finally:
        await admin.close()

    worker = WorkerProcess(info, model, tmp_path, "--family", "noop")
    try:
        async with Client(info.bootstrap, info.redis_url, tenant="tests", admission=False) as client:
            await wait_until_served(client, model, timeout_s=180)
            ids = [f"q{i}-{model}" for i in range(300)]

            async def one(rid: str) -> str:
                result = await client.infer(model, [rid], deadline_ms=120_000, request_id=rid)
                return result.id

            async def load() -> list[str]:
                tasks = []
                for rid in ids:
                    tasks.append(asyncio.create_task(one(rid)))
                    await asyncio.sleep(0.02)  # ~50/s
                return list(await asyncio.gather(*tasks))

            running = asyncio.create_task(load())
            await asyncio.sleep(2.0)
            victim = info.brokers[1]
            os.kill(victim.pid, signal.SIGKILL)  # a broker this test started
            answered = await asyncio.wait_for(running, 180)
            # Nothing lost, nothing answered twice to the caller, no error: the producer's retries and
            # the replicas covered the broker's death.
            assert sorted(answered) == sorted(ids)
            await asyncio.to_thread(local.up)
            assert local.restarted == [f"kafka-{victim.node_id}"]
            assert (await client.infer(model, ["after"], deadline_ms=60_000)).ok
            # The metadata quorum is three controllers of its own: one dying is nothing the data path sees,
            # and `up` starts that one again alone.
            os.kill(info.controllers[0].pid, signal.SIGKILL)
            assert (await client.infer(model, ["no controller"], deadline_ms=60_000)).ok
            await asyncio.to_thread(local.up)
            assert local.restarted == ["controller-1"]
            assert (await client.infer(model, ["quorum whole"], deadline_ms=60_000)).ok
    finally:
        worker.stop()


async def test_a_new_telemetry_processor_counts_from_its_first_record_on_three_brokers(
    cluster: tuple[LocalStack, StackInfo], tmp_path: Path
) -> None:
    """A processor that makes its changelog topics on a fresh cluster of three counts what it reads at
    once: the moment after it made them, its consumer may see them without partitions yet (no leader
    elected), which faust's partition check reads as a mismatch on every write to a table."""
    _, info = cluster
    await ensure_topics(info.bootstrap, shared_topic_specs())
    telemetry = Telemetry(info, tmp_path, f"kinfer-telemetry-fresh-{uuid.uuid4().hex[:6]}")
    telemetry.start()
    try:
        await wait_ready(info, telemetry)
        model = f"t-{uuid.uuid4().hex[:8]}"
        await publish(info, [BatchStats(model, "w0", now_ms(), size=4, requests=4, compute_ms=2.0) for _ in range(5)])
        summary = await wait_summary(info, model, lambda s: s.inputs_rps > 0, telemetry)
        assert summary.workers == 1
        assert "could not be counted" not in telemetry.log_path.read_text(errors="replace")
    finally:
        telemetry.stop()


@pytest.mark.clock
def test_every_fault_class_loses_nothing_and_each_costs_at_most_its_bound(
    cluster: tuple[LocalStack, StackInfo],
) -> None:
    """Every fault of the chaos soak's menu in turn under steady traffic on the three-broker fleet (a worker
    killed and paused, a broker killed and paused, Redis killed and paused, the lag monitor and the
    telemetry processor killed): nothing lost, nothing answered twice, what was killed restarted, every
    request accounted for, and each fault within its class's bound (``FAULT_BOUNDS``, scaled to the rate:
    at 80/s a worker's death may fail 20 requests, a broker's 120, the lag monitor's 4). Marked ``clock``:
    a bound counts requests that missed a one-second deadline, and beside the rest of the suite on two
    cores a third of the requests between faults once missed it, so it runs after the others, alone.
    Each fault class is also tested on its own in ``test_faults`` and ``test_fault_suite``."""
    faults = FAULTS
    # eight faults 13-14 s apart from 5 s in: the last (a worker paused up to 12 s) ends inside the soak
    config = ChaosConfig(minutes=2.0, rate=80.0, every_s=(13.0, 14.0), first_fault_s=5.0, warmup_s=8.0, drain_s=5.0,
                         faults=faults)
    report = bench_chaos(config, stack=cluster[0])
    assert {f["kind"] for f in report["faults"]} == set(faults)
    assert sum(report[k] for k in KINDS) == report["offered"] > 2_000
    assert sum(report["warmup"].values()) > 300  # 8 s at 80/s, each ended somehow, not counted above
    assert report["lost"] == 0 and report["duplicates_delivered"] == 0, report["lost_ids"]
    killed = next(f["target"] for f in report["faults"] if f["kind"] == "worker_sigkill")
    assert report["restarts"][killed] >= 1
    over = [f for f in report["faults"] if not f["within_bound"]]
    assert not over, over
