"""A worker under a memory budget: models beyond it are swapped in when their records wait, never fetched cold."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from kinfer.batcher.dynamic import BatchPolicy
from kinfer.batcher.residency import Tier
from kinfer.consumers.feed import FeedState
from kinfer.consumers.runners.noop import NoopRunner
from kinfer.consumers.runners.registry import ModelSpec
from kinfer.consumers.worker import Worker, WorkerSettings
from kinfer.ops.control.lagmon import LagMonitor
from kinfer.ops.localstack.stack import StackInfo
from kinfer.producers import Client
from kinfer.topics import ColdStart, DeadlineExceeded, Priority, Status
from kinfer.topics.admin import ensure_topics, model_topic_specs, shared_topic_specs
from kinfer.topics.residency import RESIDENCY_KEY, WorkerResidency
from tests.integration.conftest import delete_model_topics

pytestmark = pytest.mark.integration

MB = 100  # each model's declared footprint; the budget holds one


@pytest.fixture
async def two_models(stack: StackInfo) -> AsyncIterator[tuple[str, str]]:
    names = (f"ra-{uuid.uuid4().hex[:8]}", f"rb-{uuid.uuid4().hex[:8]}")
    await ensure_topics(stack.bootstrap, [*shared_topic_specs(), *(t for n in names for t in model_topic_specs(n, 3))])
    yield names
    for name in names:
        await delete_model_topics(stack.bootstrap, name)


class _Watched(Worker):
    """Records every fetched record's model state: a record of a model that is not warm (off the device, or
    its swap-in still joining the group) is a violation."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fetched_cold: list[str] = []
        self.fetched: dict[str, int] = {}
        told = self.observer.fetched

        def fetched(model: str, priority: Priority, queue_s: float) -> None:
            feed = self.feeds[model]
            if feed.tier != Tier.DEVICE or feed.lifecycle.state is FeedState.JOINING:
                self.fetched_cold.append(model)
            self.fetched[model] = self.fetched.get(model, 0) + 1
            told(model, priority, queue_s)

        self.observer.fetched = fetched  # type: ignore[method-assign]


async def test_a_budget_of_one_model_serves_two_alternately(
    stack: StackInfo, two_models: tuple[str, str], client: Client
) -> None:
    a, b = two_models
    specs = tuple(ModelSpec(n, "noop", options={"footprint_mb": MB}) for n in two_models)
    settings = WorkerSettings(
        models=specs, bootstrap=stack.bootstrap, redis_url=stack.redis_url,
        policy=BatchPolicy(max_batch_size=4, codel_target_ms=float("inf")), max_buffered_inputs=16,
        memory_budget=1.5 * MB / 1024, swap_quantum_s=0.5, residency_interval_s=0.2, worker_id="residency-test",
    )
    # 50 ms a batch of at most 4: 200 requests keep a model busy for 2.5 s, five quanta.
    runners = {n: NoopRunner(footprint_mb=MB, load_ms=100, compute_ms=50) for n in two_models}
    worker = _Watched(settings, runners=runners)
    swaps: list[str] = []
    worker.observer.swapped_in = lambda model, source, seconds: swaps.append(model)  # type: ignore[method-assign]
    serving = asyncio.create_task(worker.run())
    redis = aioredis.Redis.from_url(stack.redis_url)
    try:
        async def burst(model: str, n: int) -> list[Status]:
            results = await asyncio.gather(*(client.infer(model, [f"{model} {i}"], deadline_ms=60_000)
                                             for i in range(n)))
            return [r.status for r in results]

        # One at a time, back and forth: each switch is a swap (the other model is idle, so it goes).
        for model in (a, b, a, b):
            assert await asyncio.wait_for(burst(model, 20), 90) == [Status.OK] * 20
        # Both at once, all the time: time slicing, each holds the device for a quantum, nobody starves.
        swaps_before = len(swaps)
        both = await asyncio.wait_for(asyncio.gather(burst(a, 200), burst(b, 200)), 120)
        assert both == [[Status.OK] * 200, [Status.OK] * 200]
        assert len(swaps) - swaps_before >= 2, f"no time slicing: {swaps}"

        assert worker.fetched_cold == [], "records were fetched for a model that was not warm"
        assert worker.fetched[a] >= 240 and worker.fetched[b] >= 240
        # Never both on the device (the budget holds one), and every swap-in was measured.
        assert worker.residency is not None and worker.residency.used(Tier.DEVICE) <= 1.5 * MB * (1 << 20)
        assert all("disk" in worker.feeds[n].swap_in_ms for n in two_models)
        raw = await redis.hget(RESIDENCY_KEY, "residency-test")
        assert raw is not None
        report = WorkerResidency.unpack(raw)
        assert {m.model for m in report.models} == {a, b}
        assert sorted(m.tier for m in report.models) in (["device", "disk"], ["disk", "loading"])
    finally:
        worker.stop()
        await asyncio.wait_for(serving, 60)
        await redis.aclose()


async def test_a_cold_model_is_announced_refused_with_its_cold_start_and_woken_by_demand(
    stack: StackInfo, two_models: tuple[str, str], client: Client
) -> None:
    """The lag monitor marks a model nobody has warm as cold, with the measured cold start; a request
    whose deadline is shorter is refused up front (ColdStart, not a timeout), and the refusal itself
    makes the worker swap the model in; then it is served."""
    a, b = two_models
    specs = tuple(ModelSpec(n, "noop", options={"footprint_mb": MB}) for n in two_models)
    settings = WorkerSettings(
        models=specs, bootstrap=stack.bootstrap, redis_url=stack.redis_url,
        memory_budget=1.5 * MB / 1024, residency_interval_s=0.2, worker_id="cold-test",
    )
    runners = {n: NoopRunner(footprint_mb=MB, load_ms=1_500) for n in two_models}
    worker = Worker(settings, runners=runners)
    serving = asyncio.create_task(worker.run())
    monitor = LagMonitor(stack.bootstrap, stack.redis_url, models=[a, b], interval_s=0.2)
    stop = asyncio.Event()
    watching = asyncio.create_task(monitor.run(stop))
    try:
        # b in, then a back: b's swap-in from disk is measured, and b is cold again.
        for model in (b, a):
            result = await asyncio.wait_for(client.infer(model, ["x"], deadline_ms=60_000), 90)
            assert result.status == Status.OK
        await until(lambda: (s := monitor.states.get(b)) is not None and s.warm_replicas == 0
                    and s.cold_start_ms >= 1_500, "b announced cold with its measured cold start")
        cold = monitor.states[b]
        await until(lambda: (h := client.health(b)) is not None and h.warm_replicas == 0, "the client sees it")

        with pytest.raises(ColdStart) as refused:
            await client.infer(b, ["x"], deadline_ms=500)
        assert refused.value.retry_after_s >= cold.cold_start_ms / 1000.0 * 0.99
        assert "cold" in str(refused.value)

        # Nothing reached Kafka, but the refusal said the model was wanted: the worker swaps it in.
        await until(lambda: worker.feeds[b].tier == Tier.DEVICE and worker.feeds[b].consumer is not None,
                    "b swapped in on demand")
        await until(lambda: (s := monitor.states.get(b)) is not None and s.warm_replicas == 1, "b warm")
        await until(lambda: (h := client.health(b)) is not None and h.warm_replicas == 1, "the client sees it")
        result = await asyncio.wait_for(client.infer(b, ["x"], deadline_ms=5_000), 30)
        assert result.status == Status.OK
    finally:
        stop.set()
        worker.stop()
        await asyncio.wait_for(asyncio.gather(serving, watching), 60)


async def until(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"never: {what}"
        await asyncio.sleep(0.1)


class _Broken(NoopRunner):
    """Weights that do not load."""

    def load(self) -> None:
        raise OSError("corrupt weights")


async def test_a_swap_that_fails_leaves_the_worker_serving_the_others(
    stack: StackInfo, two_models: tuple[str, str], client: Client
) -> None:
    a, b = two_models
    specs = tuple(ModelSpec(n, "noop", options={"footprint_mb": MB}) for n in two_models)
    settings = WorkerSettings(models=specs, bootstrap=stack.bootstrap, redis_url=stack.redis_url,
                              memory_budget=1.5 * MB / 1024, residency_interval_s=0.2, worker_id="broken-test")
    worker = Worker(settings, runners={a: NoopRunner(footprint_mb=MB), b: _Broken(footprint_mb=MB)})
    serving = asyncio.create_task(worker.run())
    try:
        assert (await asyncio.wait_for(client.infer(a, ["x"], deadline_ms=60_000), 90)).status == Status.OK
        doomed = asyncio.create_task(client.infer(b, ["x"], deadline_ms=3_000))
        await until(lambda: worker.feeds[b].retry_at > 0, "b's swap tried and failed")
        assert not serving.done(), "the worker died of one model's failed swap"
        assert worker.residency is not None and worker.residency.tier(b) == Tier.DISK
        # a was swapped out to make room, then b failed: a comes back for its next request.
        assert (await asyncio.wait_for(client.infer(a, ["y"], deadline_ms=60_000), 90)).status == Status.OK
        with pytest.raises(DeadlineExceeded):
            await doomed
    finally:
        worker.stop()
        await asyncio.wait_for(serving, 60)
