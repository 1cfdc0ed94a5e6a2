"""``kinfer stack up --secure``: a real broker with SASL_SSL and ACLs, a real Redis with ACL users.

The module starts its own secure stack (its own home under a temporary folder, free ports) and stops
it at the end; the session's insecure stack is not involved.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.client import AIOKafkaClient
from aiokafka.errors import (
    GroupAuthorizationFailedError,
    KafkaConnectionError,
    TopicAlreadyExistsError,
    TopicAuthorizationFailedError,
)
from prometheus_client import REGISTRY
from redis.exceptions import AuthenticationError, NoPermissionError

from kinfer.ops.localstack.stack import StackInfo, apply_tenant_acls
from kinfer.producers import Client
from kinfer.topics import KinferError, Priority, ReplyRoute, Request, Result, Status, decode_result, now_ms, pack, seal
from kinfer.topics.auth import KID_HEADER, SIG_HEADER, new_reply_key, signer_from_env
from kinfer.topics.connect import KafkaAuth, kafka_options, tls_closes_settled
from kinfer.topics.envelope import ReplyRefused, decode_replies
from kinfer.topics.health import HEALTH_CHANNEL, HEALTH_TOPIC, HealthState, Level
from kinfer.topics.names import (
    CANCEL_CHANNEL,
    DEFAULT_REPLY_TOPIC,
    DLQ_TOPIC,
    consumer_group,
    redis_reply_channel,
    request_topic,
)
from kinfer.topics.progress import answered_key
from kinfer.topics.residency import RESIDENCY_KEY
from kinfer.topics.stats import STATS_TOPIC

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(bool(os.environ.get("KINFER_BOOTSTRAP") and os.environ.get("KINFER_REDIS_URL")),
                       reason="an external stack was given: no local stack is started"),
]

MODEL = f"sec-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def secure(secure_stack: StackInfo) -> StackInfo:
    asyncio.run(_create_topics(secure_stack))
    asyncio.run(apply_tenant_acls(secure_stack, [MODEL]))  # what `kinfer topics --model` does on a secure stack
    return secure_stack


async def _create_topics(info: StackInfo) -> None:
    admin = AIOKafkaAdminClient(**_options(info, "admin"))
    await admin.start()
    try:
        shared = [HEALTH_TOPIC, DEFAULT_REPLY_TOPIC, DLQ_TOPIC, STATS_TOPIC]
        names = [*(request_topic(MODEL, p) for p in range(3)), *shared]
        for name in names:  # another module may have created the shared ones on this stack
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics([NewTopic(name, 1, 1)])
    finally:
        await admin.close()
        await tls_closes_settled()  # this loop ends now: let the TLS connections finish closing


def _options(info: StackInfo, principal: str, **extra: Any) -> dict[str, Any]:
    return kafka_options(info.bootstrap, request_timeout_ms=5_000, **info.kafka_auth(principal).options(), **extra)


async def _produce(info: StackInfo, principal: str, topic: str, **extra: Any) -> int:
    producer = AIOKafkaProducer(**_options(info, principal, **extra))
    try:
        await producer.start()
        return int((await asyncio.wait_for(producer.send_and_wait(topic, b"x"), 15)).offset)
    finally:
        await producer.stop()


async def _bootstrap(**options: Any) -> None:
    client = AIOKafkaClient(**{"request_timeout_ms": 2_000, **options})
    quiet = logging.getLogger("aiokafka")
    level, quiet.level = quiet.level, logging.CRITICAL
    try:
        await asyncio.wait_for(client.bootstrap(), 15)
    finally:
        quiet.setLevel(level)
        await client.close()


async def test_anonymous_and_wrong_password_connections_are_refused(secure: StackInfo) -> None:
    with pytest.raises(KafkaConnectionError):
        await _bootstrap(bootstrap_servers=secure.bootstrap)  # PLAINTEXT: no TLS, no SASL
    ca = str(secure.secure_files.ca_cert)
    with pytest.raises(KafkaConnectionError):  # TLS, but no SASL
        await _bootstrap(**kafka_options(secure.bootstrap, **KafkaAuth("SSL", ca_file=ca).options()))
    wrong = KafkaAuth("SASL_SSL", "SCRAM-SHA-512", "admin", "not-the-password", ca)
    with pytest.raises(KafkaConnectionError):
        await _bootstrap(**kafka_options(secure.bootstrap, **wrong.options()))
    # The controller listener wants a certificate from the stack's CA: a valid SCRAM login is not enough.
    controller = f"127.0.0.1:{secure.brokers[0].controller_port}"
    with pytest.raises(KafkaConnectionError):
        await _bootstrap(**kafka_options(controller, **secure.kafka_auth("admin").options()))
    await _bootstrap(**_options(secure, "admin"))  # and the right password gets in


async def test_a_tenant_writes_only_its_priorities(secure: StackInfo) -> None:
    assert secure.secrets().tenants["demo"] == 1
    with pytest.raises(TopicAuthorizationFailedError):
        await _produce(secure, "tenant-demo", request_topic(MODEL, 0), enable_idempotence=True)
    assert await _produce(secure, "tenant-demo", request_topic(MODEL, 1), enable_idempotence=True) >= 0
    assert await _produce(secure, "kinfer-gateway", request_topic(MODEL, 0)) >= 0


async def _commit(info: StackInfo, principal: str, group: str) -> None:
    consumer = AIOKafkaConsumer(**_options(info, principal, group_id=group, enable_auto_commit=False))
    tp = TopicPartition(DEFAULT_REPLY_TOPIC, 0) if principal.startswith("tenant-") else \
        TopicPartition(request_topic(MODEL, 1), 0)
    consumer.assign([tp])
    try:
        await consumer.start()
        await asyncio.wait_for(consumer.commit({tp: 0}), 15)
    finally:
        await consumer.stop()


async def test_only_the_worker_commits_the_worker_group(secure: StackInfo) -> None:
    group = consumer_group(MODEL)
    with pytest.raises(GroupAuthorizationFailedError):
        await _commit(secure, "tenant-demo", group)
    with pytest.raises(GroupAuthorizationFailedError):
        await _commit(secure, "kinfer-lagmon", group)
    await _commit(secure, "kinfer-worker", group)


async def test_only_the_lag_monitor_writes_health(secure: StackInfo) -> None:
    assert await _produce(secure, "kinfer-lagmon", HEALTH_TOPIC) >= 0
    for principal in ("kinfer-worker", "kinfer-gateway", "tenant-demo"):
        with pytest.raises(TopicAuthorizationFailedError):
            await _produce(secure, principal, HEALTH_TOPIC)


def test_redis_users(secure: StackInfo) -> None:
    with redis.Redis.from_url(secure.redis_url) as anonymous, pytest.raises(AuthenticationError):
        anonymous.ping()
    with redis.Redis.from_url(secure.redis_url_for("tenant-demo")) as tenant:
        assert tenant.ping()
        with pytest.raises(NoPermissionError):
            tenant.publish(HEALTH_CHANNEL, b"forged")
        with pytest.raises(NoPermissionError):
            tenant.execute_command("PUBSUB", "CHANNELS")
        with pytest.raises(NoPermissionError):
            tenant.set("kinfer:health:x", b"forged")
        assert tenant.publish(CANCEL_CHANNEL, b"{}") >= 0
        own = tenant.pubsub()
        try:
            own.subscribe(redis_reply_channel("demo", "abc"), HEALTH_CHANNEL)
            assert own.get_message(timeout=2)["type"] == "subscribe"
        finally:
            own.close()
        for channel in (redis_reply_channel("gateway", "abc"), redis_reply_channel("other", "abc")):
            other = tenant.pubsub()
            try:
                with pytest.raises(NoPermissionError):
                    other.subscribe(channel)
                    other.get_message(timeout=2)
            finally:
                other.close()
        for key in (RESIDENCY_KEY, answered_key("x")):  # the workers' reports the lag monitor trusts
            with pytest.raises(NoPermissionError):
                tenant.hset(key, "forged", b"report")
    with redis.Redis.from_url(secure.redis_url_for("kinfer-worker")) as worker:
        assert worker.publish(redis_reply_channel("demo", "abc"), b"reply") >= 0
        with pytest.raises(NoPermissionError):
            worker.publish(HEALTH_CHANNEL, b"forged")
        for key in (RESIDENCY_KEY, answered_key("x")):
            worker.hset(key, "w1", b"report")
    with redis.Redis.from_url(secure.redis_url_for("kinfer-lagmon")) as lagmon:
        assert lagmon.publish(HEALTH_CHANNEL, b"state") >= 0
        assert lagmon.set("kinfer:health:x", b"state", px=1000)
        for key in (RESIDENCY_KEY, answered_key("x")):  # read page by page, dead workers' entries removed
            assert lagmon.hscan(key, 0, count=10)[1] == {b"w1": b"report"}
            assert lagmon.hdel(key, "w1") == 1


def test_a_component_takes_its_principal_from_the_stack(secure: StackInfo) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KINFER_")}
    env["KINFER_HOME"] = secure.home
    code = ("import json, os; from kinfer.ops.localstack.stack import resolve_endpoints; "
            "b, r = resolve_endpoints(principal='kinfer-worker'); "
            "print(json.dumps({'user': os.environ['KINFER_KAFKA_USER'], 'redis': r, 'bootstrap': b}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=60)
    got = json.loads(out.stdout)
    assert got == {"user": "kinfer-worker", "redis": secure.redis_url_for("kinfer-worker"),
                   "bootstrap": secure.bootstrap}


# -- the attacks of the security issue, against a deployment on this stack ------------------------


@contextlib.contextmanager
def acting_as(info: StackInfo, principal: str) -> Iterator[None]:
    """This process's environment is ``principal``'s while clients are built and started in it."""
    saved = dict(os.environ)
    os.environ.update(info.env(principal))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _start_worker(info: StackInfo, tenants: Path, log: Path) -> subprocess.Popen[bytes]:
    """A worker as ``kinfer-worker``, checking signatures and the tenants file."""
    with log.open("wb") as out:
        cmd = [sys.executable, "-m", "kinfer.ops.cli", "worker", "--model", MODEL, "--family", "noop",
               "--tenants", str(tenants)]
        env = {**os.environ, **info.env("kinfer-worker"), "HF_HUB_OFFLINE": "1"}
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def _stop_worker(worker: subprocess.Popen[bytes]) -> None:
    worker.terminate()
    worker.wait(30)


async def _raw_request(info: StackInfo, request: Request, topic: str, headers: list[tuple[str, bytes]]) -> None:
    producer = AIOKafkaProducer(**_options(info, "admin"))  # admin may write any topic: the worker must refuse
    try:
        await producer.start()
        await producer.send_and_wait(topic, pack(request), headers=headers)
    finally:
        await producer.stop()


async def test_forged_replies_health_tenants_and_priorities_are_refused(secure: StackInfo, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": [{"name": "demo", "key_sha256": "0" * 64, "max_priority": 1},
                                               {"name": "ads", "key_sha256": "1" * 64, "max_priority": 2}]}))
    with acting_as(secure, "tenant-demo"):
        victim = Client(secure.bootstrap, os.environ["KINFER_REDIS_URL"])
        await victim.start()
        demo = signer_from_env()
    with acting_as(secure, "admin"):
        forger = aioredis.Redis.from_url(os.environ["KINFER_REDIS_URL"])  # Redis rights to every channel
    worker: subprocess.Popen[bytes] | None = None
    try:
        assert demo is not None and victim.reply_channel.startswith("kinfer:reply:demo:")
        # 1. A forger who knows a request's id and reply channel answers first; nothing serves the model yet.
        call = asyncio.create_task(victim.infer(MODEL, ["real"], request_id="victim-1", deadline_ms=120_000))
        forged = Result("victim-1", MODEL, Status.OK, outputs=[666])
        while victim.forged_replies < 2:
            await forger.publish(victim.reply_channel, pack(forged))  # unsealed
            await forger.publish(victim.reply_channel, seal(forged, b"k" * 16))  # sealed under another key
            await asyncio.sleep(0.05)
        assert not call.done()
        worker = _start_worker(secure, tenants, tmp_path / "worker.log")
        assert (await call).outputs == [len("real")]  # the real answer, not the forged one

        # 2. Forged health: "rejecting", dated an hour ahead. The client ignores it and still serves p1.
        future = {"reader": "health-watch", "reason": "future"}
        ignored = REGISTRY.get_sample_value("kinfer_malformed_records_total", future) or 0.0
        state = HealthState(model=MODEL, level=Level.REJECTING, predicted_wait_ms=1e6, retry_after_ms=60_000,
                            lag=10_000, arrival_rps=0.0, drain_rps=0.0, updated_ms=now_ms() + 3_600_000)
        while (REGISTRY.get_sample_value("kinfer_malformed_records_total", future) or 0) == ignored:
            await forger.publish(HEALTH_CHANNEL, state.pack())
            await asyncio.sleep(0.05)
        assert victim.health(MODEL) is None
        assert (await victim.infer(MODEL, ["p1 still served"], priority=1, deadline_ms=30_000)).ok

        # 3. p0 from a tenant whose best is p1: the broker refuses the write.
        with pytest.raises(KinferError):
            await victim.infer(MODEL, ["p0?"], priority=0, deadline_ms=10_000)

        # 4. Records a principal that may write p0 publishes (here: admin): the worker checks who signed them.
        async with aioredis.Redis.from_url(secure.redis_url_for("admin")) as r, r.pubsub() as sub:
            channel = "kinfer:reply:demo:raw"
            await sub.subscribe(channel)
            base = {"model": MODEL, "created_ms": now_ms(), "deadline_ms": now_ms() + 60_000, "inputs": ("x",),
                    "reply": ReplyRoute.channel(channel)}
            p0 = Request(id="p0", priority=Priority.P0, tenant="demo", **base)  # type: ignore[arg-type]
            other = Request(id="other", priority=Priority.P2, tenant="ads", **base)  # type: ignore[arg-type]
            unsigned = Request(id="unsigned", priority=Priority.P1, tenant="demo", **base)  # type: ignore[arg-type]
            await _raw_request(secure, p0, request_topic(MODEL, 0), demo.headers("demo", pack(p0)))
            # demo's key speaking for "ads": its credential refuses, so the forger signs by hand
            cred = demo.credential("demo")
            mac = hmac.digest(cred.key, pack(other), "sha256")
            forged = [(KID_HEADER, cred.kid.encode()), (SIG_HEADER, mac)]
            await _raw_request(secure, other, request_topic(MODEL, 2), forged)
            await _raw_request(secure, unsigned, request_topic(MODEL, 1), [])
            refused: dict[str, str] = {}
            while len(refused) < 3:
                msg = await sub.get_message(timeout=30.0)
                assert msg is not None, f"no answer to {sorted({'p0', 'other', 'unsigned'} - set(refused))}"
                if msg["type"] == "message":
                    result = decode_result(msg["data"])
                    assert result.status is Status.INVALID, result
                    refused[result.id] = result.error or ""
        assert "may not use p0" in refused["p0"]
        assert "bad signature" in refused["other"] and "unsigned" in refused["unsigned"]
    finally:
        await victim.close()
        await forger.aclose()
        if worker is not None:
            _stop_worker(worker)
        await tls_closes_settled()


async def test_another_tenant_reading_the_shared_reply_topic_recovers_no_output(
    secure: StackInfo, tmp_path: Path
) -> None:
    """Tenants may read ``replies.default`` (their clients' durable route): what another tenant's
    replies carry there is sealed for that tenant's client alone."""
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": [{"name": "demo", "key_sha256": "0" * 64, "max_priority": 1},
                                               {"name": "rival", "key_sha256": "1" * 64, "max_priority": 1}]}))
    with acting_as(secure, "tenant-demo"):
        victim = Client(secure.bootstrap, os.environ["KINFER_REDIS_URL"], reply_via="kafka")
        await victim.start()
    rival = AIOKafkaConsumer(**_options(secure, "tenant-rival"), enable_auto_commit=False)
    await rival.start()
    worker = _start_worker(secure, tenants, tmp_path / "worker.log")
    try:
        tps = [TopicPartition(DEFAULT_REPLY_TOPIC, 0)]  # the one partition this module's topic has
        rival.assign(tps)
        await rival.seek_to_end()
        start = {tp: await rival.position(tp) for tp in tps}
        # The noop model answers each text with its length: lengths nobody else asks for are the outputs.
        lengths = [12_345 + i for i in range(8)]
        ids = [f"confidential-{uuid.uuid4().hex[:12]}-{i}" for i in range(len(lengths))]
        results = await asyncio.gather(*(
            victim.infer(MODEL, ["s" * n], priority=1, request_id=rid, deadline_ms=120_000)
            for n, rid in zip(lengths, ids, strict=True)))
        assert [r.outputs for r in results] == [[n] for n in lengths]
        assert victim.replies_received["kafka"] == len(lengths)  # every reply came over the shared topic

        records = []
        while len(records) < len(lengths):
            batch = await asyncio.wait_for(rival.getmany(timeout_ms=1_000), 30)
            records += [r for rs in batch.values() for r in rs]
        assert sum([await rival.position(tp) - start[tp] for tp in tps]) == len(records) == len(lengths)
        secrets = [rid.encode() for rid in ids] + [MODEL.encode(), b"s" * 64]
        secrets += [b"\xa7outputs" + pack_output(n) for n in lengths] + [pack_output(n) for n in lengths]
        for record in records:
            assert record.value is not None
            for clear in secrets:
                assert clear not in record.value and clear not in (record.key or b"")
            for key in (None, new_reply_key(), b"k" * 16):  # no key, the rival's own, a guess
                with pytest.raises(ReplyRefused):
                    decode_replies(record.value, key)
    finally:
        _stop_worker(worker)
        await rival.stop()
        await victim.close()
        await tls_closes_settled()


def pack_output(n: int) -> bytes:
    """How the noop model's output ``n`` travels inside a plain result: a one-element array."""
    return msgpack.packb([n])
