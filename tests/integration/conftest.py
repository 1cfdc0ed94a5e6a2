"""Integration fixtures: a real Kafka broker and a real Redis, real worker processes.

The session starts its own stack in a temporary folder (free ports) and stops it at the end,
unless KINFER_BOOTSTRAP and KINFER_REDIS_URL name an external broker and Redis to use instead.
Each test serves its own model name, so its topics and consumer group are its own.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from prometheus_client.parser import text_string_to_metric_families

from kinfer.ops.deploy.secure import ensure_secure_dir
from kinfer.ops.localstack.stack import LocalStack, StackInfo, free_port
from kinfer.producers import Client
from kinfer.topics.admin import ensure_topics, model_topic_specs, shared_topic_specs
from kinfer.topics.names import request_topics

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    bootstrap, redis_url = os.environ.get("KINFER_BOOTSTRAP"), os.environ.get("KINFER_REDIS_URL")
    if bootstrap and redis_url:
        info = StackInfo.external(bootstrap, redis_url)
        asyncio.run(ensure_topics(info.bootstrap, shared_topic_specs()))
        yield info
        return
    local = LocalStack(tmp_path_factory.mktemp("stack"))
    info, _ = local.up()
    try:
        asyncio.run(ensure_topics(info.bootstrap, shared_topic_specs()))
        yield info
    finally:
        local.down()


@pytest.fixture(scope="session")
def secure_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    """``kinfer stack up --secure``: SASL_SSL and ACLs on the broker, ACL users on Redis (its own home and
    ports), shared by the tests that need one; the session's insecure stack is not involved."""
    if os.environ.get("KINFER_BOOTSTRAP") and os.environ.get("KINFER_REDIS_URL"):
        pytest.skip("an external stack was given: no local secure stack is started")
    home = tmp_path_factory.mktemp("secure-stack")
    ensure_secure_dir(home / "secure", {"demo": 1, "rival": 1})  # two tenants: one reads what the other may not
    local = LocalStack(home, secure=True)
    info, _ = local.up()
    try:
        yield info
    finally:
        local.down()


@pytest.fixture
def model_name() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def topics(stack: StackInfo, model_name: str) -> AsyncIterator[str]:
    """The test's model topics, deleted after it: a later test (or a fuzzer listing /v1/models) never
    finds a model whose workers are gone."""
    await ensure_topics(stack.bootstrap, [*shared_topic_specs(), *model_topic_specs(model_name, 3)])
    yield model_name
    await delete_model_topics(stack.bootstrap, model_name)


async def delete_model_topics(bootstrap: str, model: str) -> None:
    """A test's model topics, gone: a later test (the gateway's fuzzer) must not find a model nobody serves."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_topics(request_topics(model))
    except KafkaError as exc:  # a stack a test broke on purpose: leave them, they harm nothing but listings
        print(f"could not delete the topics of {model}: {exc}")
    finally:
        await admin.close()


@pytest.fixture
async def client(stack: StackInfo) -> AsyncIterator[Client]:
    async with Client(stack.bootstrap, stack.redis_url, tenant="tests") as c:
        yield c


class WorkerProcess:
    """A real ``kinfer worker`` process, its log, and its metrics endpoint."""

    def __init__(self, stack: StackInfo, model: str, log_dir: Path, *args: str) -> None:
        self.metrics_port = free_port()
        self.worker_id = f"w-{uuid.uuid4().hex[:6]}"
        self.log_path = log_dir / f"{self.worker_id}.log"
        env = {**os.environ, **stack.env(), "HF_HUB_OFFLINE": "1"}
        cmd = [
            sys.executable, "-m", "kinfer.ops.cli", "worker", "--model", model, "--worker-id", self.worker_id,
            "--metrics-port", str(self.metrics_port), *args,
        ]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a metric's samples whose labels include ``labels``; 0 before the endpoint is up."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as resp:
                text = resp.read().decode()
        except OSError:
            return 0.0
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )

    async def wait_metric(self, name: str, at_least: float, timeout_s: float = 120.0, **labels: str) -> None:
        deadline = time.monotonic() + timeout_s
        while self.metric(name, **labels) < at_least:
            assert self.proc.poll() is None, f"worker exited:\n{self.log()[-3000:]}"
            assert time.monotonic() < deadline, f"{name} never reached {at_least}:\n{self.log()[-3000:]}"
            await asyncio.sleep(0.1)

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture
def spawn_worker(stack: StackInfo, tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def spawn(model: str, *args: str) -> WorkerProcess:
        w = WorkerProcess(stack, model, tmp_path, *args)
        started.append(w)
        return w

    yield spawn
    for w in started:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait()
