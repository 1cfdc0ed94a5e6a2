"""The background tier (p3) on the real broker: interactive work overtakes it, and it is all answered.

A worker is paused while a background backlog is published, so all of it waits when the worker
resumes; interactive requests sent one after the other meanwhile are each answered while background
work still waits, and nothing is shed, with CoDel as eager as it goes. Had the backlog been p2 work,
the interactive requests would have queued behind it and CoDel would have shed it.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable

import pytest

from kinfer.ops.localstack.procs import wait_until_served
from kinfer.ops.localstack.stack import StackInfo
from kinfer.producers import Client
from kinfer.topics import Priority
from kinfer.topics.admin import offset_clients, read_offsets
from tests.integration.conftest import WorkerProcess

pytestmark = pytest.mark.integration

BATCH = 4
BACKLOG = 200  # background requests: 50 slices of 20 ms, a second of work


async def published(stack: StackInfo, model: str, at_least: int) -> None:
    """Until the model's topics hold ``at_least`` records (the producer's sends have reached the broker)."""
    async with offset_clients(stack.bootstrap) as (admin, consumer):
        for _ in range(600):
            offsets = await read_offsets(admin, consumer, model)
            if offsets is not None and sum(offsets.lag) + offsets.background >= at_least:
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"{model}: the broker never held {at_least} records")


async def test_interactive_work_overtakes_a_background_backlog_which_is_never_shed(
    client: Client, stack: StackInfo, topics: str, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    # CoDel at its most eager: a standing queue of interactive work would be shed within 100 ms.
    worker = spawn_worker(topics, "--family", "noop", "--option", "compute_ms=20", "--max-batch-size", str(BATCH),
                          "--codel-target-ms", "20", "--codel-interval-ms", "100", "--session-timeout-ms", "60000")
    await wait_until_served(client, topics)
    background_done: list[bool] = []

    async def background(i: int) -> None:
        result = await client.infer(topics, [f"bg-{i}"], priority=Priority.P3, deadline_ms=600_000)
        background_done.append(result.ok)

    os.kill(worker.proc.pid, signal.SIGSTOP)  # the whole backlog waits before the worker takes any of it
    try:
        backlog = [asyncio.create_task(background(i)) for i in range(BACKLOG)]
        await published(stack, topics, BACKLOG)
    finally:
        os.kill(worker.proc.pid, signal.SIGCONT)
    # Interactive requests one after the other while the backlog drains: each overtakes it.
    seen_at: list[int] = []
    for i in range(10):
        result = await client.infer(topics, [f"p2-{i}"], priority=Priority.P2, deadline_ms=30_000)
        assert result.ok, result
        seen_at.append(len(background_done))
    await asyncio.gather(*backlog)

    assert len(background_done) == BACKLOG and all(background_done)
    assert seen_at[-1] < BACKLOG, seen_at  # all ten answered while background work still waited
    # A standing queue of background work is no queue to CoDel: it shed nothing (the probes that found
    # the worker serving may have expired while it joined), and no background request was refused.
    assert worker.metric("kinfer_shed_total", reason="codel") == 0
    assert worker.metric("kinfer_shed_total", priority="p3") == 0
    assert worker.metric("kinfer_results_total", priority="p3") >= BACKLOG
