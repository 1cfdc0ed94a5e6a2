"""Hedged requests on a live stack: a partition whose owner stops answering costs a hedge, not a timeout.

Two workers share a model's three partitions; one is paused (SIGSTOP), so the requests on its
partitions wait for the group's session timeout. A client without hedging loses those to their
deadline; a client with hedging answers every one: the stalled copy is published again to another
partition, and the partitions that stopped answering are avoided after their first hedge.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import Callable

import pytest
import redis.asyncio as aioredis

from kinfer.ops.localstack.procs import wait_until_served
from kinfer.ops.localstack.stack import StackInfo
from kinfer.producers import Client
from kinfer.producers.hedging import HedgePolicy
from kinfer.topics import DeadlineExceeded
from kinfer.topics.admin import offset_clients, read_offsets
from kinfer.topics.auth import cancel_mac, new_reply_key
from kinfer.topics.cancel import CANCEL_CHANNEL, CancelNote
from tests.integration.conftest import WorkerProcess

pytestmark = pytest.mark.integration


async def burst(client: Client, model: str, n: int, deadline_ms: int) -> tuple[int, int]:
    """``n`` requests, 20 a second: (answered ok, timed out)."""
    async def one(i: int) -> bool:
        await asyncio.sleep(i / 20.0)
        try:
            return (await client.infer(model, [f"x{i}"], deadline_ms=deadline_ms)).ok
        except DeadlineExceeded:
            return False

    outcomes = await asyncio.gather(*(one(i) for i in range(n)))
    return sum(outcomes), n - sum(outcomes)


async def test_a_paused_owner_costs_hedges_not_answers(
    stack: StackInfo, topics: str, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    # A session timeout far past the test: the paused worker keeps its partitions throughout, so no
    # rebalance stalls the live worker meanwhile (a busy box stretches the bursts past a short one).
    workers = [spawn_worker(topics, "--family", "noop", "--session-timeout-ms", "60000") for _ in range(2)]
    policy = HedgePolicy(min_samples=16)
    async with Client(stack.bootstrap, stack.redis_url, tenant="tests", hedging=policy, admission=False) as hedged, \
            Client(stack.bootstrap, stack.redis_url, tenant="tests", hedging=HedgePolicy(enabled=False),
                   admission=False) as plain:
        await wait_until_served(hedged, topics)
        for _ in range(30):  # until both serve (the second one's join splits the partitions)
            ok, _ = await burst(hedged, topics, 40, 5_000)  # meanwhile the client learns the model's latency
            assert ok == 40
            if all(w.metric("kinfer_results_total") > 0 for w in workers):
                break
        else:
            raise AssertionError("the second worker never got a partition")
        os.kill(workers[0].proc.pid, signal.SIGSTOP)
        try:
            _, plain_lost = await burst(plain, topics, 20, 1_500)
            ok, lost = await burst(hedged, topics, 40, 1_500)
        finally:
            os.kill(workers[0].proc.pid, signal.SIGCONT)
    assert plain_lost >= 4, "the paused worker owned no partition: the test proves nothing"
    # None lost. A live partition that answers one request slowly (a busy box) is suspect for a moment
    # too; a request whose hedge finds every other partition suspect then puts the hedge off, not away.
    assert (ok, lost) == (40, 0), (ok, lost, plain_lost, hedged.hedges)
    counts = hedged.hedges
    assert 1 <= counts["hedged"] < 20, counts  # after the first hedges its partitions are skipped


async def test_a_copy_whose_sender_has_its_answer_is_dropped_unrun_and_its_offset_done(
    stack: StackInfo, topics: str, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    """A hedged request's stalled copy reaches its worker after the answer came through another copy (a
    broker's failover writes it seconds later), and after its sender's cancel note. Played here by sending
    the note first: the worker drops that copy unrun and its offset is done; a note not from the request's
    sender (its MAC made with another key) drops nothing."""
    worker = spawn_worker(topics, "--family", "noop")
    async with aioredis.Redis.from_url(stack.redis_url) as redis, \
            Client(stack.bootstrap, stack.redis_url, tenant="tests", hedging=HedgePolicy(enabled=False),
                   admission=False) as client, offset_clients(stack.bootstrap) as (admin, consumer):
        await wait_until_served(client, topics)
        answered, forged = f"answered-{uuid.uuid4().hex}", f"forged-{uuid.uuid4().hex}"
        await client._cancel(topics, answered)  # what the client sends once a hedged request is answered
        await redis.publish(CANCEL_CHANNEL, CancelNote(forged, topics, cancel_mac(new_reply_key(), forged)).pack())
        # Sent after the notes, which reach the worker through Redis well before a request comes through the
        # producer, the broker and a fetch: once this one is answered, the notes have been read.
        assert (await client.infer(topics, ["after the notes"], deadline_ms=10_000)).ok
        with pytest.raises(DeadlineExceeded):
            await client.infer(topics, ["never run"], request_id=answered, deadline_ms=2_000)
        assert (await client.infer(topics, ["run"], request_id=forged, deadline_ms=10_000)).ok
        assert worker.metric("kinfer_copies_dropped_total") == 1
        assert worker.metric("kinfer_results_total", status="expired") == 0  # dropped, not shed: no reply at all
        for _ in range(300):  # the dropped copy's offset is committed with the rest: nothing is left behind
            offsets = await read_offsets(admin, consumer, topics)
            if offsets is not None and sum(offsets.lag) == 0:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"the model's lag stayed {offsets}")
