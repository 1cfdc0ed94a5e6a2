"""A hostile tenant on a live secure stack: every class of bad input, everywhere it may write.

As the tenant ``demo`` (its own Kafka and Redis credentials and its signing key, as ``kinfer stack env
--principal tenant-demo`` hands them out, and an API key at the gateway), ``kinfer.ops.bench.hostile`` sends
what takes decoders down — nesting to 100,000 levels in every field, million-element containers,
non-finite and extreme numbers, random bytes, tombstones, records at the size limit, reply routes
aimed at control channels, sampling parameters that break softmax, forged chat turns — on the request
topics, the cancel and demand channels, its own reply channel, the gateway's routes and WebSocket.
Valid requests go out before, between and after. Then: every kinfer process is alive, every valid
request was answered, and no hostile request got an HTTP 5xx.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from kinfer.ops.bench import hostile
from kinfer.ops.localstack.stack import StackInfo, apply_tenant_acls, free_port
from kinfer.producers import Client
from kinfer.producers.tenants import hash_key
from kinfer.topics import KinferError
from kinfer.topics.auth import signer_from_env
from kinfer.topics.connect import kafka_options, tls_closes_settled
from kinfer.topics.health import HEALTH_TOPIC
from kinfer.topics.names import DEFAULT_REPLY_TOPIC, DLQ_TOPIC, request_topic
from kinfer.topics.stats import STATS_TOPIC

pytestmark = pytest.mark.integration

NOOP = f"hostile-{uuid.uuid4().hex[:6]}"
GEN = "tiny-lm"
API_KEY = f"k-{uuid.uuid4().hex}"


def _spawn(info: StackInfo, principal: str, log: Path, *args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, **info.env(principal), "HF_HUB_OFFLINE": "1"}
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "kinfer.ops.cli", *args], env=env, stdout=out,
                                stderr=subprocess.STDOUT)


async def _topics(info: StackInfo) -> None:
    opts = kafka_options(info.bootstrap, request_timeout_ms=10_000, **info.kafka_auth("admin").options())
    admin = AIOKafkaAdminClient(**opts)
    await admin.start()
    try:
        names = [*(request_topic(m, p) for m in (NOOP, GEN) for p in range(3)),
                 HEALTH_TOPIC, DEFAULT_REPLY_TOPIC, DLQ_TOPIC, STATS_TOPIC]
        for name in names:
            try:
                await admin.create_topics([NewTopic(name, 3 if name.startswith("infer.") else 1, 1)])
            except TopicAlreadyExistsError:
                continue
    finally:
        await admin.close()
    await apply_tenant_acls(info, [NOOP, GEN])
    await tls_closes_settled()


@pytest.fixture
def fleet(secure_stack: StackInfo, tmp_path: Path) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """Every long-lived kinfer process a tenant's input reaches, each as its own principal."""
    info = secure_stack
    asyncio.run(_topics(info))
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": [{"name": "demo", "key_sha256": hash_key(API_KEY), "max_priority": 1}]}))
    port = free_port()
    procs = {
        # --memory-budget: the residency and demand loops run (the noop model fits)
        "worker": _spawn(info, "kinfer-worker", tmp_path / "worker.log", "worker", "--model", NOOP, "--family", "noop",
                         "--tenants", str(tenants), "--memory-budget", "1"),
        "generator": _spawn(info, "kinfer-worker", tmp_path / "generator.log", "worker", "--model", GEN,
                            "--tenants", str(tenants)),
        "gateway": _spawn(info, "kinfer-gateway", tmp_path / "gateway.log", "gateway", "--port", str(port),
                          "--tenants", str(tenants)),
        "lagmon": _spawn(info, "kinfer-lagmon", tmp_path / "lagmon.log", "lagmon", "--model", NOOP, "--model", GEN),
        "telemetry": _spawn(info, "kinfer-telemetry", tmp_path / "telemetry.log", "telemetry"),
    }
    procs["gateway"].port = port  # type: ignore[attr-defined]
    try:
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for name, proc in procs.items():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            print(f"--- {name} (exit {proc.returncode}):\n{(tmp_path / f'{name}.log').read_text()[-3000:]}")


async def _valid(client: Client, http: httpx.AsyncClient, tag: str) -> int:
    """Valid traffic: library calls to both models and gateway calls; how many were answered ok."""
    calls = [client.infer(NOOP, [f"{tag}-{i}"], deadline_ms=60_000) for i in range(10)]
    calls.append(client.infer(GEN, [f"{tag} hello"], params={"max_new_tokens": 3}, deadline_ms=60_000))
    results = await asyncio.gather(*calls)
    assert [r.outputs for r in results[:10]] == [[len(f"{tag}-{i}")] for i in range(10)]
    assert results[10].ok
    for _ in range(30):  # the gateway obeys the health signal: a caller waits as told and asks again
        answer = await http.post(f"/v1/models/{NOOP}/infer", json={"inputs": [tag]})
        if answer.status_code not in (429, 503):
            break
        await asyncio.sleep(min(2.0, float(answer.headers.get("retry-after", "1"))))
    assert answer.status_code == 200 and answer.json()["outputs"] == [len(tag)], answer.text
    return len(results) + 1


async def _until_served(client: Client, model: str) -> None:
    for _ in range(600):
        try:
            await client.infer(model, ["ready?"], deadline_ms=5_000)
            return
        except KinferError:
            await asyncio.sleep(0.2)
    raise AssertionError(f"{model} never served")


async def test_a_hostile_tenant_stops_nothing(secure_stack: StackInfo, fleet: dict[str, subprocess.Popen[bytes]],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    info = secure_stack
    for key, value in info.env("tenant-demo").items():
        monkeypatch.setenv(key, value)
    signer = signer_from_env()
    assert signer is not None
    port = fleet["gateway"].port  # type: ignore[attr-defined]
    # Admission off: every valid request is accepted, so every one must be answered (none may be lost
    # to what the hostile tenant sends beside it).
    client = Client(info.bootstrap, os.environ["KINFER_REDIS_URL"], admission=False)
    await client.start()
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers={"authorization": f"Bearer {API_KEY}"},
                             timeout=60)
    try:
        await _until_served(client, NOOP)
        await _until_served(client, GEN)
        answered = await _valid(client, http, "before")
        target = hostile.Target(
            bootstrap=info.bootstrap, redis_url=os.environ["KINFER_REDIS_URL"], model=NOOP, tenant="demo", priority=1,
            kafka_options=info.kafka_auth("tenant-demo").options(), signer=signer, generator=GEN,
            reply_channel=client.reply_channel, gateway=("127.0.0.1", port), api_key=API_KEY,
        )
        sent = hostile.Sent()
        valid = asyncio.create_task(_valid(client, http, "during"))
        await hostile.attack_kafka(target, sent)
        await hostile.attack_redis(target, sent)
        statuses = await hostile.attack_gateway(target, sent)
        answered += await valid
        assert sent.total > 200, sent.counts
        assert {k: v for k, v in statuses.items() if v >= 500 or v == 0} == {}, statuses
        answered += await _valid(client, http, "after")
        # The hostile requests are all dead-lettered or answered by now: one more round goes through them.
        await asyncio.sleep(2.0)
        answered += await _valid(client, http, "last")
        assert answered == 4 * 12
        assert {name: proc.poll() for name, proc in fleet.items()} == dict.fromkeys(fleet)
        assert (await http.get("/readyz")).status_code == 200
    finally:
        await http.aclose()
        await client.close()
        await tls_closes_settled()
