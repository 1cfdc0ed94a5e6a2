"""One real request path: client → Kafka → worker (batched, all-MiniLM-L6-v2) → Redis → client."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis

from kinfer.batcher.dynamic import BatchPolicy
from kinfer.consumers.runners.noop import NoopRunner
from kinfer.consumers.runners.registry import ModelSpec, minilm_path
from kinfer.consumers.worker import Worker, WorkerSettings
from kinfer.ops.bench.texts import make_texts
from kinfer.ops.localstack.procs import wait_until_served
from kinfer.ops.localstack.stack import StackInfo
from kinfer.producers import BlockingClient, Client
from kinfer.producers.client import MISSING_TOPIC_TTL_S
from kinfer.topics import DeadlineExceeded, InvalidRequest, KinferError, Priority, Result, UnknownModel, seal
from kinfer.topics.admin import ensure_topics, model_topic_specs
from tests.integration.conftest import WorkerProcess, delete_model_topics

pytestmark = pytest.mark.integration

# A deliberate backlog (500 requests at once) is not overload to shed here.
MINILM = ("--family", "embedding", "--path", str(minilm_path()), "--codel-target-ms", "inf")


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


async def test_embedding_matches_a_direct_model_call(
    client: Client, topics: str, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    from sentence_transformers import SentenceTransformer

    spawn_worker(topics, *MINILM)
    await wait_until_served(client, topics)
    texts = [
        "The quick brown fox jumps over the lazy dog.",
        "Consumer groups share the partitions of a topic among their members.",
        " ".join(make_texts(1, 100, 120)),
    ]
    result = await client.infer(topics, texts, priority=Priority.P0, deadline_ms=30_000)
    reference = SentenceTransformer(str(minilm_path()), device="cpu").encode(texts)
    got = np.array(result.outputs, dtype=np.float32)
    assert got.shape == (3, 384)
    assert (cosine(got, reference) > 0.999).all(), cosine(got, reference)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-4)


async def test_500_concurrent_requests_each_answered_once_and_batched(
    client: Client, topics: str, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    worker = spawn_worker(topics, *MINILM)
    await wait_until_served(client, topics)
    texts = make_texts(500, min_words=3, max_words=16, seed=5)
    ids = [f"c-{uuid.uuid4().hex[:12]}" for _ in texts]
    results = await asyncio.gather(
        *(client.infer(topics, [t], deadline_ms=180_000, request_id=i) for t, i in zip(texts, ids, strict=True))
    )
    assert [r.id for r in results] == ids  # each caller got its own result
    assert all(r.ok and len(r.outputs) == 1 and len(r.outputs[0]) == 384 for r in results)
    sizes = [r.timings.batch_size for r in results]
    assert max(sizes) > 1 and sum(sizes) / len(sizes) > 2, f"no batching: {sorted(set(sizes))}"
    assert client.duplicate_replies == 0
    # The results belong to their own texts: a few checked against a single-text call.
    for k in (0, 123, 499):
        alone = await client.infer(topics, [texts[k]], deadline_ms=30_000)
        assert cosine(np.array(results[k].outputs), np.array(alone.outputs))[0] > 0.999
    assert worker.metric("kinfer_results_total") >= 503


async def test_a_second_copy_of_a_reply_never_reaches_the_caller(
    client: Client, stack: StackInfo, topics: str, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    spawn_worker(topics, "--family", "noop")
    await wait_until_served(client, topics)
    result = await client.infer(topics, ["once"], deadline_ms=10_000)
    # What a worker does after a redelivery: publish the same result again on the same route, sealed
    # with the key the request carried.
    async with aioredis.Redis.from_url(stack.redis_url) as r:
        assert await r.publish(client.reply_channel, seal(result, client._replies.key)) == 1
    for _ in range(100):
        if client.duplicate_replies:
            break
        await asyncio.sleep(0.05)
    assert client.duplicate_replies == 1
    again = await client.infer(topics, ["still works"], deadline_ms=10_000)
    assert again.outputs == [len("still works")]


async def test_unknown_model_fails_before_sending(client: Client) -> None:
    with pytest.raises(UnknownModel, match="not served"):
        await client.infer("no-such-model", ["x"], deadline_ms=2_000)


async def test_a_missing_model_is_remembered_briefly_and_found_once_created(
    client: Client, stack: StackInfo, model_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(UnknownModel):
        await client.infer(model_name, ["x"], deadline_ms=300)
    lookups = 0
    fetch = client._producer.client.fetch_all_metadata

    async def counting() -> object:
        nonlocal lookups
        lookups += 1
        return await fetch()

    monkeypatch.setattr(client._producer.client, "fetch_all_metadata", counting)
    with pytest.raises(UnknownModel):
        await client.infer(model_name, ["x"], deadline_ms=300)
    assert lookups == 0  # answered from memory: no metadata round trip per request

    await ensure_topics(stack.bootstrap, model_topic_specs(model_name, 3))
    try:
        await asyncio.sleep(MISSING_TOPIC_TTL_S)
        with pytest.raises(DeadlineExceeded) as waited:  # published this time (no worker serves it)
            await client.infer(model_name, ["x"], deadline_ms=300)
        assert not waited.value.answered and lookups == 1
    finally:
        await delete_model_topics(stack.bootstrap, model_name)


def test_blocking_client_and_pipelined_infer_many(
    stack: StackInfo, topics: str, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    spawn_worker(topics, "--family", "noop")
    with BlockingClient(stack.bootstrap, stack.redis_url) as c:
        for _ in range(60):  # until the worker has joined its group
            try:
                c.infer(topics, ["ready?"], deadline_ms=3_000)
                break
            except KinferError:
                continue
        outcomes = c.infer_many(topics, ["a", "bb", [], "dddd"] * 25, max_in_flight=8, deadline_ms=30_000)
    assert len(outcomes) == 100
    for i, outcome in enumerate(outcomes):
        if i % 4 == 2:
            assert isinstance(outcome, InvalidRequest)  # one bad request does not hide the others
        else:
            assert isinstance(outcome, Result) and outcome.outputs == [len(["a", "bb", [], "dddd"][i % 4])]


class _Rendezvous(NoopRunner):
    """A model call that returns only once ``parties`` calls are in flight at the same time."""

    def __init__(self, parties: int) -> None:
        super().__init__()
        self.barrier = threading.Barrier(parties, timeout=60)

    def run(self, texts: list[str]) -> list[Any]:
        self.barrier.wait()
        return super().run(texts)


async def test_executors_run_model_calls_side_by_side_from_one_queue(
    client: Client, stack: StackInfo, topics: str
) -> None:
    """Two requests, batches of one, two executors: both calls must be in flight at once to return."""
    settings = WorkerSettings(models=(ModelSpec(topics, "noop"),), bootstrap=stack.bootstrap,
                              redis_url=stack.redis_url, policy=BatchPolicy(max_batch_size=1), executors=2)
    worker = Worker(settings, runners={topics: _Rendezvous(2)})
    serving = asyncio.create_task(worker.run())
    try:
        results = await asyncio.wait_for(asyncio.gather(
            client.infer(topics, ["one"], deadline_ms=60_000), client.infer(topics, ["two"], deadline_ms=60_000),
        ), 90)
        assert [r.outputs for r in results] == [[3], [3]]
    finally:
        worker.stop()
        await asyncio.wait_for(serving, 60)


def test_the_cli_says_what_to_do_when_a_model_has_no_topics(stack: StackInfo, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from kinfer.ops.cli import main

    for key, value in stack.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("KINFER_DEBUG", raising=False)
    name = f"t-{uuid.uuid4().hex[:10]}"
    assert main(["infer", "--model", name, "hello"]) == 2  # nobody serves it
    err = capsys.readouterr().err
    assert err.startswith(f"kinfer infer: no topic infer.{name}.p1: model '{name}' is not served")
    assert "Traceback" not in err
    assert main(["worker", "--model", name, "--family", "noop"]) == 2  # it would idle with 0 partitions
    err = capsys.readouterr().err
    assert err.startswith(f"kinfer worker: no topics infer.{name}.p0") and f"kinfer topics --model {name}" in err
