"""Hedging and partition avoidance (producers.hedging): budgets, quantiles, suspicion and probes."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kinfer.producers import Client
from kinfer.producers.client import InFlight
from kinfer.producers.hedging import HedgeBudget, HedgePolicy, Hedger, LatencyWindow, PartitionBoard
from kinfer.topics import DeadlineExceeded, Priority, Request, Result, Status, Unavailable, now_ms
from kinfer.topics.auth import cancel_mac
from kinfer.topics.cancel import CANCEL_CHANNEL, CancelNote
from kinfer.topics.envelope import ReplyRoute

T = "infer.m.p1"
Offline = Callable[..., Client]


@pytest.fixture
async def offline() -> AsyncIterator[Offline]:
    """Clients of tenant ``t`` that reach no broker nor Redis (each test fakes their sends), closed after it."""
    made: list[Client] = []

    def make(**options: Any) -> Client:
        made.append(Client("127.0.0.1:1", "redis://127.0.0.1:1", tenant="t", **options))
        return made[-1]

    yield make
    for client in made:
        await client._producer.stop()
        await client._redis.aclose()
FAR = 10**13  # a deadline no test reaches


def taken() -> asyncio.Future[None]:
    """The broker's acknowledgement of a copy, already in."""
    delivery = asyncio.get_running_loop().create_future()
    delivery.set_result(None)
    return delivery


def test_a_hedge_kept_out_of_the_reserve_leaves_it_whole() -> None:
    budget = HedgeBudget(rate=0.02, burst=4)
    assert [budget.spend(keep=2.0) for _ in range(3)] == [True, True, False]
    assert budget.tokens == 2 and [budget.spend() for _ in range(3)] == [True, True, False]


def test_budget_earns_a_fraction_per_request_and_caps_at_the_burst() -> None:
    budget = HedgeBudget(rate=0.02, burst=3)
    assert [budget.spend() for _ in range(4)] == [True, True, True, False]
    for _ in range(49):
        budget.earn()
    assert not budget.spend()  # 0.98 of a hedge
    budget.earn()
    assert budget.spend()
    for _ in range(10_000):
        budget.earn()
    assert budget.tokens == 3
    assert budget.spent == 4 and budget.refused == 2


def test_the_bucket_holds_a_second_of_a_busy_clients_requests() -> None:
    """At 200 requests/s the bucket grows to 200 hedges (a broker's death strands about that many), and
    fills at the same 0.02 a request; at 1 request/s it stays at its floor; when the rate falls, so does
    the bucket, and what it held above its new size is gone."""
    budget = HedgeBudget(rate=0.02, burst=50, burst_s=1.0)
    now = 0.0
    for _ in range(200 * 60):  # a minute at 200/s: 240 hedges earned, the bucket full
        now += 1 / 200
        budget.earn(now)
    assert budget.burst == pytest.approx(200, rel=0.01) and budget.tokens == budget.burst
    assert sum(budget.spend() for _ in range(250)) == int(budget.burst)
    for _ in range(1000):  # then 1/s: the size measured over each window falls to the floor
        now += 1.0
        budget.earn(now)
    assert budget.burst == 50 and budget.tokens <= 50


def test_without_the_time_the_bucket_keeps_its_floor() -> None:
    budget = HedgeBudget(rate=0.02, burst=5, burst_s=1.0)
    for _ in range(10_000):
        budget.earn()
    assert budget.burst == 5 and budget.tokens == 5


@pytest.mark.parametrize("burst_s", [-1.0, math.nan, math.inf])
def test_a_burst_in_seconds_must_be_a_finite_duration(burst_s: float) -> None:
    with pytest.raises(ValueError, match="burst_s"):
        HedgePolicy(burst_s=burst_s)


@given(st.lists(st.tuples(st.sampled_from(["send", "hedge"]), st.floats(0, 0.5)), max_size=3_000))
def test_hedges_never_exceed_the_budget(steps: list[tuple[str, float]]) -> None:
    """However the bucket's size follows the send rate, hedges over time are paid from what requests
    earned: at most the floor plus 0.02 a request."""
    hedger = Hedger(HedgePolicy(budget=0.02, burst=5, burst_s=2.0))
    now = 0.0
    for step, gap in steps:
        now += gap
        if step == "send":
            hedger.sent_one(now)
        else:
            hedger.budget.spend()
    assert hedger.budget.spent <= 5 + 0.02 * hedger.sent + 1e-9


@given(st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=300), st.integers(1, 64))
def test_latency_window_quantile_is_over_the_last_samples(samples: list[float], size: int) -> None:
    window = LatencyWindow(size)
    for s in samples:
        window.add(s)
    last = sorted(samples[-size:])
    assert len(window) == len(last)
    assert window.quantile(0.95) == last[min(len(last) - 1, int(0.95 * len(last)))]
    assert window.quantile(0.0) == last[0]


def test_latency_window_ignores_what_is_not_a_duration() -> None:
    window = LatencyWindow(4)
    for bad in (math.nan, math.inf, -1.0):
        window.add(bad)
    assert len(window) == 0 and window.quantile(0.5) is None


def test_no_hedging_until_enough_answers_then_at_the_quantile_with_a_floor() -> None:
    hedger = Hedger(HedgePolicy(min_samples=10, min_delay_ms=20))
    for _ in range(9):
        hedger.observe("m", 0.005)
    assert hedger.delay_s("m") is None
    hedger.observe("m", 0.005)
    assert hedger.delay_s("m") == pytest.approx(0.020)  # the floor
    for i in range(100):
        hedger.observe("m", 0.001 * i)
    assert 0.090 <= (hedger.delay_s("m") or 0) <= 0.099  # p99 of 0..99 ms
    assert Hedger(HedgePolicy(enabled=False)).delay_s("m") is None


def test_a_fault_s_slow_answers_do_not_push_the_hedge_delay_past_a_few_medians() -> None:
    hedger = Hedger(HedgePolicy(window=100, min_samples=10))
    for _ in range(90):
        hedger.observe("m", 0.050)
    for _ in range(10):  # a stalled partition's answers, seconds late
        hedger.observe("m", 3.0)
    assert hedger.delay_s("m") == pytest.approx(0.200)  # 4 x the 50 ms median, not the 3 s p99


def test_a_hedge_leaves_its_copy_a_median_answer_before_the_deadline() -> None:
    """On a busy box (answers near the deadline) a hedge at the p99 comes too late to be answered in time:
    it goes out no later than the median before the deadline, and never before the floor."""
    hedger = Hedger(HedgePolicy(window=100, min_samples=10))
    for _ in range(60):
        hedger.observe("m", 0.300)
    for _ in range(40):
        hedger.observe("m", 0.900)
    assert hedger.delay_s("m") == pytest.approx(0.900)  # the p99, within 4 x the 300 ms median
    assert hedger.delay_s("m", left_s=1.0) == pytest.approx(0.700)  # a copy then may still make it
    assert hedger.delay_s("m", left_s=0.2) == pytest.approx(0.020)  # too late whenever: at the floor


def test_a_partition_turns_suspect_once() -> None:
    board = PartitionBoard(probe_s=1.0)
    assert board.hedged(T, 0, sent=1.0, now=1.2)
    assert not board.hedged(T, 0, sent=1.1, now=1.3)  # already suspect
    board.answered(T, 0, 2.0)
    assert not board.hedged(T, 0, sent=1.9, now=2.1)  # it answered since that request was sent
    assert board.hedged(T, 0, sent=2.5, now=2.7)


def test_round_robin_over_trusted_partitions() -> None:
    board = PartitionBoard(probe_s=1.0)
    assert [board.pick(T, [0, 1, 2], 0.0) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_a_hedged_partition_is_avoided_and_probed_once_a_period() -> None:
    board = PartitionBoard(probe_s=1.0)
    board.hedged(T, 1, sent=10.0, now=10.1)
    assert board.suspect(T, 1)
    picks = [board.pick(T, [0, 1, 2], 10.2) for _ in range(30)]
    assert 1 not in picks and set(picks) == {0, 2}
    picks = [board.pick(T, [0, 1, 2], 11.2) for _ in range(30)]
    assert picks.count(1) == 1  # one probe a period
    board.answered(T, 1, 11.25)  # the probe came back: trusted again
    assert not board.suspect(T, 1)
    assert 1 in [board.pick(T, [0, 1, 2], 11.3) for _ in range(3)]


def test_a_partition_that_answered_since_the_request_was_sent_is_not_suspect() -> None:
    board = PartitionBoard(probe_s=1.0)
    board.answered(T, 0, 5.0)
    board.hedged(T, 0, sent=4.9, now=5.2)  # one slow request on a partition that answers: not stalled
    assert not board.suspect(T, 0)
    board.hedged(T, 0, sent=5.1, now=5.3)
    assert board.suspect(T, 0)


def test_a_hedge_goes_elsewhere_and_all_suspect_still_picks_one() -> None:
    board = PartitionBoard(probe_s=10.0)
    assert all(board.pick(T, [0, 1], 0.0, avoid=(0,)) == 1 for _ in range(5))
    for p in (0, 1, 2):
        board.hedged(T, p, sent=0.0, now=0.1)
    for _ in range(10):
        assert board.pick(T, [0, 1, 2], 0.2, avoid=(2,)) in (0, 1, 2)
    with pytest.raises(ValueError):
        board.pick(T, [], 0.0)


def test_a_hedge_goes_only_to_a_trusted_partition_and_leaves_the_probes_to_new_requests() -> None:
    board = PartitionBoard(probe_s=1.0)
    for p in (0, 1):
        board.hedged(T, p, sent=0.0, now=0.1)
    assert {board.trusted(T, [0, 1, 2], avoid=(0,)) for _ in range(4)} == {2}
    board.hedged(T, 2, sent=0.0, now=0.1)
    for _ in range(10):  # every partition suspect, every probe due: hedges looked for and put off
        assert board.trusted(T, [0, 1, 2], avoid=(0,)) is None
    assert sorted(board.pick(T, [0, 1, 2], 1.2) for _ in range(3)) == [0, 1, 2]  # the probes are still there


def test_a_partition_whose_writes_stall_gets_no_hedge_until_the_broker_takes_one_again() -> None:
    """With acks=all a dead follower holds up the writes of every partition it follows: a hedge sent to
    one that has held our copies since before the hedged copy, and taken none since, would wait as long.
    A copy handed to a partition that held none is fresh, not stalled; one acknowledgement there after
    the hedged copy was sent ends it."""
    board = PartitionBoard(probe_s=1.0)
    board.handed(T, 1, now=1.0)  # two held since 1.0, nothing taken since
    board.handed(T, 1, now=1.1)
    board.handed(T, 2, now=2.5)  # held since 2.5: after the hedged copy (2.0), so no stall of its length
    assert not board.writing(T, 1, since=2.0) and board.writing(T, 2, since=2.0) and board.writing(T, 0, since=2.0)
    assert {board.trusted(T, [0, 1, 2], avoid=(0,), since=2.0) for _ in range(4)} == {2}
    board.handed(T, 2, now=2.6)
    board.acknowledged(T, 2, now=1.5, taken=True)  # (an old copy's acknowledgement: before the hedged copy)
    board.handed(T, 2, now=2.7)
    assert board.trusted(T, [0, 1, 2], avoid=(0,), since=3.0) is None  # both held since before 3.0
    board.acknowledged(T, 1, now=3.1, taken=False)  # a refusal is no sign the broker writes
    assert board.trusted(T, [0, 1, 2], avoid=(0,), since=3.0) is None
    board.acknowledged(T, 1, now=3.2, taken=True)
    assert board.trusted(T, [0, 1, 2], avoid=(0,), since=3.0) == 1
    board.acknowledged(T, 3, now=3.3, taken=True)  # nothing handed there: nothing to count
    assert (T, 3) not in board._parts


def test_a_stall_at_the_broker_makes_no_partition_suspect_and_is_news_once() -> None:
    """A copy the broker still holds when its hedge comes due says the partition's writes stall, not that
    its consumer fails: no suspicion. The first such hedge of a stall is news (what else waits there is
    hedged at once), the next ones of the same stall are not; writes that moved and stalled again are a
    new stall. A copy taken and unanswered is the consumer's, as before."""
    board = PartitionBoard(probe_s=1.0)
    board.handed(T, 0, now=1.0)
    assert board.hedged(T, 0, sent=1.0, now=1.2, taken=False)
    board.handed(T, 0, now=1.1)
    assert not board.hedged(T, 0, sent=1.1, now=1.3, taken=False)  # the same stall
    assert not board.suspect(T, 0)
    board.acknowledged(T, 0, now=1.5, taken=True)  # one taken, one still held: writes moved at 1.5
    assert board.hedged(T, 0, sent=1.6, now=1.8, taken=False)
    assert not board.hedged(T, 0, sent=1.6, now=1.9, taken=False)
    assert not board.suspect(T, 0)
    assert board.hedged(T, 0, sent=1.6, now=2.0)  # taken by the broker and unanswered: the consumer's
    assert board.suspect(T, 0)


def test_a_copy_held_where_the_broker_takes_others_is_the_tail_not_a_stall() -> None:
    """A busy producer acknowledges late but steadily: a copy still held at its hedge, on a partition whose
    other copies the broker took since it was sent, is waiting in line. No stall, no news (nothing else
    there is hurried), and the client counts the request as the tail's (it may not spend the reserve)."""
    board = PartitionBoard(probe_s=1.0)
    board.handed(T, 0, now=1.0)
    board.handed(T, 0, now=1.1)
    board.acknowledged(T, 0, now=1.15, taken=True)  # the first copy taken after the second was sent
    assert not board.stalled(T, 0, sent=1.1) and not board.hedged(T, 0, sent=1.1, now=1.2, taken=False)
    board.handed(T, 0, now=1.3)
    assert board.stalled(T, 0, sent=1.3) and board.hedged(T, 0, sent=1.3, now=1.4, taken=False)
    assert not board.suspect(T, 0)


@given(st.lists(st.tuples(st.sampled_from(["hand", "take", "refuse"]), st.integers(0, 2),
                          st.floats(0, 1, allow_nan=False)), max_size=200))
def test_the_board_counts_each_copy_out_once_and_back_once(steps: list[tuple[str, int, float]]) -> None:
    """Whatever the order, a partition holds the copies handed to it less those answered (never fewer
    than none), and one that holds none takes writes."""
    board = PartitionBoard(probe_s=1.0)
    held = [0, 0, 0]
    now = 0.0
    for kind, p, dt in steps:
        now += dt
        if kind == "hand":
            board.handed(T, p, now)
            held[p] += 1
        else:
            board.acknowledged(T, p, now, taken=kind == "take")
            held[p] = max(0, held[p] - 1)
        assert [board._parts[T, q].unacked if (T, q) in board._parts else 0 for q in range(3)] == held
        assert all(board.writing(T, q, now + 1.0) for q in range(3) if not held[q])


Held = dict[tuple[str, int | None], asyncio.Future[None]]


def _stalled_broker(client: Client) -> tuple[Held, asyncio.Queue[tuple[str, int | None]], asyncio.Event]:
    """Fake the producer of ``client`` as a broker that holds every copy until the test acknowledges it:
    the futures by request id and partition, the copies in the order handed over, and an event set when a
    hedge was looked for."""
    held: Held = {}
    handed: asyncio.Queue[tuple[str, int | None]] = asyncio.Queue()
    looked, hedge = asyncio.Event(), client._hedge

    async def hand(topic: str, data: bytes, request: Request, headers: object, partition: int | None
                   ) -> asyncio.Future[None]:
        held[request.id, partition] = asyncio.get_running_loop().create_future()
        handed.put_nowait((request.id, partition))
        return held[request.id, partition]

    def hedge_and_tell(*args: Any) -> bool | None:
        sent = hedge(*args)
        looked.set()
        return sent

    client._partitions = lambda topic: [0, 1, 2]  # type: ignore[method-assign]
    client._hand = hand  # type: ignore[method-assign]
    client._hedge = hedge_and_tell  # type: ignore[method-assign]
    return held, handed, looked


async def test_a_hedge_is_put_off_unpaid_while_every_partition_s_writes_stall_and_goes_where_one_moves(
    offline: Offline,
) -> None:
    """A broker dies and, until it leaves the in-sync set, no partition takes a write: the request's hedge
    comes due with every other partition holding older copies, so it is put off and costs nothing (a copy
    would have waited as well). Once partition 1 takes a write again, the hedge goes there."""
    client = offline(hedging=HedgePolicy(min_samples=1))
    hedger = client._hedger
    hedger.observe("m", 0.001)  # the hedge delay is its floor, 20 ms
    held, handed, looked = _stalled_broker(client)
    for p in (0, 1, 2):  # our earlier copies, held there since a moment ago: new requests go round robin
        hedger.board.handed(T, p, time.monotonic() - 0.5)
    stranded = InFlight(client, T, b"", _request("r0", 600_000), None)
    exchange = asyncio.create_task(client._exchange(stranded))
    assert await asyncio.wait_for(handed.get(), 10) == ("r0", 0)
    await asyncio.wait_for(looked.wait(), 10)
    assert handed.empty() and hedger.nowhere == 1 and hedger.budget.spent == 0
    other = InFlight(client, T, b"", _request("r1", 600_000), None)  # a copy that partition 1 will take
    other_exchange = asyncio.create_task(client._exchange(other))
    assert await asyncio.wait_for(handed.get(), 10) == ("r1", 1)
    held["r1", 1].set_result(None)  # partition 1's leader takes writes again, and its worker answers
    other.waiter.set_result(Result("r1", "m", Status.OK))
    assert (await other_exchange).ok
    assert await asyncio.wait_for(handed.get(), 10) == ("r0", 1)
    assert hedger.budget.spent == 1 and hedger.nowhere == 1
    stranded.waiter.set_result(Result("r0", "m", Status.OK))
    assert (await exchange).ok


async def test_a_stall_at_the_broker_leaves_every_partition_trusted_once_it_ends(offline: Offline) -> None:
    """A broker dies, and every partition's writes stall (each follows it): requests on each come due for
    their hedge and are put off. That is the broker's doing, not the consumers': once it takes writes
    again, new requests spread over every partition as before. Had the stall made them suspect, the
    first partition trusted again would have taken every request until each probe came back, more than
    one consumer serves."""
    client = offline(hedging=HedgePolicy(min_samples=1))
    hedger = client._hedger
    hedger.observe("m", 0.001)  # the hedge delay is its floor, 20 ms
    held, handed, looked = _stalled_broker(client)
    for p in (0, 1, 2):  # our earlier copies, held there since a moment ago
        hedger.board.handed(T, p, time.monotonic() - 0.5)
    copies = [InFlight(client, T, b"", _request(f"r{i}", 600_000), None) for i in range(3)]
    exchanges = []
    for i, c in enumerate(copies):
        exchanges.append(asyncio.create_task(client._exchange(c)))
        assert await asyncio.wait_for(handed.get(), 10) == (f"r{i}", i)
    while hedger.nowhere < 3:  # each one's hedge came due with nowhere to go
        await asyncio.wait_for(looked.wait(), 10)
        looked.clear()
    assert handed.empty() and hedger.budget.spent == 0
    assert not any(hedger.board.suspect(T, p) for p in (0, 1, 2))
    for p in (0, 1, 2):
        hedger.board.acknowledged(T, p, time.monotonic(), taken=True)  # the earlier copies
    for delivery in held.values():
        delivery.set_result(None)
    for c in copies:
        c.waiter.set_result(Result(c.request.id, "m", Status.OK))
    assert all(r.ok for r in await asyncio.gather(*exchanges))
    assert sorted(hedger.board.pick(T, [0, 1, 2], time.monotonic()) for _ in range(3)) == [0, 1, 2]


async def test_a_put_off_request_whose_copy_the_broker_took_meanwhile_gives_its_worker_the_delay(
    offline: Offline,
) -> None:
    """Put off while every partition stalled, the request's own copy is then taken, and the other
    partitions move too: its next look does not hedge it (its worker has only just got it) but waits
    its hedge delay from then. Another request finding its partition stalled still hurries it at once."""
    client = offline(hedging=HedgePolicy(min_samples=1))
    hedger = client._hedger
    hedger.observe("m", 0.001)
    held, handed, looked = _stalled_broker(client)
    for p in (1, 2):
        hedger.board.handed(T, p, time.monotonic() - 0.5)
    copies = InFlight(client, T, b"", _request("r0", 600_000), None)
    exchange = asyncio.create_task(client._exchange(copies))
    assert await asyncio.wait_for(handed.get(), 10) == ("r0", 0)
    await asyncio.wait_for(looked.wait(), 10)
    assert hedger.nowhere == 1
    held["r0", 0].set_result(None)  # its own partition took it
    for p in (1, 2):
        hedger.board.acknowledged(T, p, time.monotonic(), taken=True)
    await asyncio.sleep(0)
    acked_at = copies._acked_at
    assert acked_at is not None
    copies._hedge_at = asyncio.get_running_loop().time()  # its next look comes now
    copies._due()
    assert handed.empty() and hedger.budget.spent == 0 and copies._hedge_at == acked_at + 0.02
    copies.hurry()  # its partition found stalled by another request's hedge: no delay more
    assert await asyncio.wait_for(handed.get(), 10) in {("r0", 1), ("r0", 2)}
    copies.waiter.set_result(Result("r0", "m", Status.OK))
    assert (await exchange).ok


async def test_a_hedge_with_nowhere_to_go_is_put_off_not_dropped(offline: Offline) -> None:
    """Two partitions stopped, the third suspected for one slow batch: a request waiting on a stopped
    one is hedged to the third once it answers again, not left to its deadline."""
    client = offline(hedging=HedgePolicy(min_samples=1))
    hedger = client._hedger
    hedger.observe("m", 0.001)  # the hedge delay is its floor, 20 ms
    for p in (0, 1, 2):
        hedger.board.answered(T, p, 0.0)
        hedger.board.hedged(T, p, sent=0.1, now=0.2)  # all three suspect, every probe due
    published: asyncio.Queue[int | None] = asyncio.Queue()

    async def hand(topic: str, data: bytes, request: Request, headers: object, partition: int | None
                   ) -> asyncio.Future[None]:
        published.put_nowait(partition)
        return taken()

    client._partitions = lambda topic: [0, 1, 2]  # type: ignore[method-assign]
    client._hand = hand  # type: ignore[method-assign]
    looked, hedge = asyncio.Event(), client._hedge

    def hedge_and_tell(*args: Any) -> bool | None:
        sent = hedge(*args)
        looked.set()
        return sent

    client._hedge = hedge_and_tell  # type: ignore[method-assign]
    request = Request(id="r1", model="m", priority=Priority.P1, tenant="t", created_ms=1, deadline_ms=FAR,
                      inputs=("x",), reply=ReplyRoute(redis="c"))
    copies = InFlight(client, T, b"", request, None)
    exchange = asyncio.create_task(client._exchange(copies))
    first = await asyncio.wait_for(published.get(), 10)  # a probe of a suspect partition
    await asyncio.wait_for(looked.wait(), 10)  # its hedge came due: the others are suspect too
    assert hedger.nowhere == 1 and published.empty()
    live = next(p for p in (0, 1, 2) if p != first)
    hedger.board.answered(T, live, 1.0)  # another request's answer: that partition only was slow
    assert await asyncio.wait_for(published.get(), 10) == live  # the put-off hedge goes there
    copies.waiter.set_result(Result("r1", "m", Status.OK))
    assert (await exchange).ok
    assert (hedger.nowhere, hedger.budget.spent) == (1, 1)


async def test_requests_waiting_on_a_partition_that_turns_suspect_are_hedged_at_once(offline: Offline) -> None:
    """Four requests over three partitions, two of them on partition 0. The first one's hedge comes due
    (its deadline is near) and makes partition 0 suspect: the other request waiting there is hedged
    then, not at its own delay (here 100 s), and the requests on the other partitions are left alone."""
    client = offline(hedging=HedgePolicy(min_samples=1, max_hedges=1))
    client._hedger.observe("m", 100.0)  # the delay is the p99: 100 s, unless a deadline is nearer
    published: asyncio.Queue[tuple[str, int | None]] = asyncio.Queue()

    async def hand(topic: str, data: bytes, request: Request, headers: object, partition: int | None
                   ) -> asyncio.Future[None]:
        published.put_nowait((request.id, partition))
        return taken()

    client._partitions = lambda topic: [0, 1, 2]  # type: ignore[method-assign]
    client._hand = hand  # type: ignore[method-assign]
    waiters: dict[str, asyncio.Future[Result]] = {}
    exchanges = []
    for i, left_ms in enumerate((10_000_000, 10_000_000, 10_000_000, 100_010)):  # the last: hedged at the floor
        rid = f"r{i}"
        created = now_ms()
        request = Request(id=rid, model="m", priority=Priority.P1, tenant="t", created_ms=created,
                          deadline_ms=created + left_ms, inputs=("x",), reply=ReplyRoute(redis="c"))
        copies = InFlight(client, T, b"", request, None)
        waiters[rid] = copies.waiter
        exchanges.append(asyncio.create_task(client._exchange(copies)))
        assert await asyncio.wait_for(published.get(), 10) == (rid, i % 3)
    hedges = {await asyncio.wait_for(published.get(), 10), await asyncio.wait_for(published.get(), 10)}
    assert {rid for rid, _ in hedges} == {"r3", "r0"} and all(p != 0 for _, p in hedges)
    assert client._hedger.board.suspect(T, 0) and published.empty()
    notes: list[tuple[str, bytes]] = []

    async def publish(channel: str, data: bytes) -> int:
        notes.append((channel, data))
        return 1

    client._redis.publish = publish  # type: ignore[method-assign]
    for rid, waiter in waiters.items():
        waiter.set_result(Result(rid, "m", Status.OK))
    assert all(r.ok for r in await asyncio.gather(*exchanges))
    assert client._waiting == {}  # nothing is left listed once the requests are over
    # Answered, each hedged request tells the workers its other copy needs no running (a cancel note with
    # its sender's MAC); a request that was never hedged sends nothing.
    await asyncio.gather(*client._background)
    sent = {(channel, CancelNote.unpack(data)) for channel, data in notes}
    key = client._replies.key
    assert sent == {(CANCEL_CHANNEL, CancelNote(rid, "m", cancel_mac(key, rid))) for rid in ("r0", "r3")}


async def test_the_tail_leaves_the_reserve_to_requests_stranded_on_a_suspect_partition(offline: Offline) -> None:
    """The bucket holds 2.5 hedges, 2 of them the reserve. A request slow on a partition that answers others
    (the tail) is not hedged; a request on a partition that answers nothing is, from the reserve."""
    client = offline(hedging=HedgePolicy(min_samples=1, max_hedges=1, burst=4.0, reserve=0.5))
    hedger = client._hedger
    hedger.observe("m", 0.001)  # the hedge delay is its floor, 20 ms
    published: asyncio.Queue[tuple[str, int | None]] = asyncio.Queue()

    async def hand(topic: str, data: bytes, request: Request, headers: object, partition: int | None
                   ) -> asyncio.Future[None]:
        published.put_nowait((request.id, partition))
        return taken()

    client._partitions = lambda topic: [0, 1, 2]  # type: ignore[method-assign]
    client._hand = hand  # type: ignore[method-assign]
    looked, hedge = asyncio.Queue[str](), client._hedge

    def hedge_and_tell(topic: str, request: Request, *args: Any) -> bool | None:
        sent = hedge(topic, request, *args)
        looked.put_nowait(request.id)
        return sent

    client._hedge = hedge_and_tell  # type: ignore[method-assign]
    hedger.budget.tokens = 2.5
    waiters: dict[str, asyncio.Future[Result]] = {}
    exchanges = []
    for rid in ("tail", "stranded"):
        request = Request(id=rid, model="m", priority=Priority.P1, tenant="t", created_ms=now_ms(),
                          deadline_ms=now_ms() + 10_000_000, inputs=("x",), reply=ReplyRoute(redis="c"))
        copies = InFlight(client, T, b"", request, None)
        waiters[rid] = copies.waiter
        exchanges.append(asyncio.create_task(client._exchange(copies)))
        _, partition = await asyncio.wait_for(published.get(), 10)
        assert partition is not None
        if rid == "tail":  # another request's answer from the same partition: it works, this one is slow
            hedger.board.answered(T, partition, time.monotonic())
            assert await asyncio.wait_for(looked.get(), 10) == "tail"
            assert published.empty() and hedger.budget.refused == 1 and not hedger.board.suspect(T, partition)
    assert await asyncio.wait_for(looked.get(), 10) == "stranded"
    rid, copy = await asyncio.wait_for(published.get(), 10)
    assert rid == "stranded" and copy is not None and hedger.budget.spent == 1
    assert hedger.budget.tokens == pytest.approx(2.5 + 2 * 0.02 - 1)  # two requests sent earned 0.04
    for rid, waiter in waiters.items():
        waiter.set_result(Result(rid, "m", Status.OK))
    assert all(r.ok for r in await asyncio.gather(*exchanges))


async def test_a_request_whose_copy_the_broker_holds_is_stranded_and_may_spend_the_reserve(
    offline: Offline,
) -> None:
    """A stall at the broker makes no partition suspect, but the request it holds is as stranded as one on
    a suspect partition: with only the reserve in the bucket (2.5 hedges, 2 of them kept), it is hedged."""
    client = offline(hedging=HedgePolicy(min_samples=1, max_hedges=1, burst=4.0, reserve=0.5))
    hedger = client._hedger
    hedger.observe("m", 0.001)  # the hedge delay is its floor, 20 ms
    held, handed, looked = _stalled_broker(client)
    hedger.budget.tokens = 2.5
    copies = InFlight(client, T, b"", _request("r0", 600_000), None)
    exchange = asyncio.create_task(client._exchange(copies))
    assert await asyncio.wait_for(handed.get(), 10) == ("r0", 0)
    assert await asyncio.wait_for(handed.get(), 10) in {("r0", 1), ("r0", 2)}  # hedged where nothing waits
    assert hedger.budget.spent == 1 and hedger.budget.refused == 0 and not hedger.board.suspect(T, 0)
    copies.waiter.set_result(Result("r0", "m", Status.OK))
    assert (await exchange).ok
    assert looked.is_set() and len(held) == 2


@pytest.mark.parametrize("first_taken", [True, False])
async def test_a_refused_copy_fails_the_call_only_when_no_copy_was_taken(first_taken: bool, offline: Offline) -> None:
    """The first copy is still being handed to the broker when its hedge is refused: the call goes on,
    and once the first copy is taken the reply is the answer. With every copy refused, the first refusal is."""
    client = offline(hedging=HedgePolicy(min_samples=1))
    client._hedger.observe("m", 0.001)  # the hedge delay is its floor, 20 ms
    outcomes: dict[int | None, asyncio.Future[None]] = {}
    sent = asyncio.Queue[int | None]()

    async def hand(topic: str, data: bytes, request: Request, headers: object, partition: int | None
                   ) -> asyncio.Future[None]:
        outcomes[partition] = asyncio.get_running_loop().create_future()
        sent.put_nowait(partition)
        return outcomes[partition]

    client._partitions = lambda topic: [0, 1]  # type: ignore[method-assign]
    client._hand = hand  # type: ignore[method-assign]
    request = Request(id="r1", model="m", priority=Priority.P1, tenant="t", created_ms=1, deadline_ms=FAR,
                      inputs=("x",), reply=ReplyRoute(redis="c"))
    copies = InFlight(client, T, b"", request, None)
    waiter = copies.waiter
    exchange = asyncio.create_task(client._exchange(copies))
    first = await asyncio.wait_for(sent.get(), 10)
    hedge = await asyncio.wait_for(sent.get(), 10)  # unanswered at the hedge delay: a copy elsewhere
    assert hedge != first
    outcomes[hedge].set_exception(Unavailable("hedge refused"))
    for _ in range(10):  # the refused copy's task ends and its callbacks run
        await asyncio.sleep(0)
    assert not exchange.done() and not waiter.done()  # the first copy may still be taken
    if first_taken:
        outcomes[first].set_result(None)
        waiter.set_result(Result("r1", "m", Status.OK))
        assert (await exchange).ok
    else:
        outcomes[first].set_exception(Unavailable("first refused"))
        with pytest.raises(Unavailable, match="hedge refused"):  # the first refusal the client saw
            await exchange


@given(st.lists(st.tuples(st.sampled_from(["pick", "hedge", "held", "answer", "hand", "take"]), st.integers(0, 5),
                          st.floats(0, 1, allow_nan=False)), max_size=200))
def test_pick_always_names_an_offered_partition(steps: list[tuple[str, int, float]]) -> None:
    """Whatever the board has seen (copies handed and taken, hedges of copies taken or held, answers), a pick
    names an offered partition other than the one to avoid."""
    board = PartitionBoard(probe_s=0.5)
    now = 0.0
    offered = [0, 1, 2, 3]
    for kind, p, dt in steps:
        now += dt
        if kind == "pick":
            picked = board.pick(T, offered, now, avoid=(p,))
            assert picked in offered and picked != p
        elif kind in ("hedge", "held"):
            board.hedged(T, p, now - dt, now, taken=kind == "hedge")
        elif kind == "hand":
            board.handed(T, p, now)
        elif kind == "take":
            board.acknowledged(T, p, now, taken=True)
        else:
            board.answered(T, p, now)


def test_policy_refuses_nonsense() -> None:
    for bad in ({"budget": 1.5}, {"quantile": 1.0}, {"burst": 0.5}, {"min_samples": 10, "window": 5},
                {"probe_s": 0}, {"min_delay_ms": math.nan}):
        with pytest.raises(ValueError):
            HedgePolicy(**bad)  # type: ignore[arg-type]


def _request(rid: str, left_ms: int) -> Request:
    created = now_ms()
    return Request(id=rid, model="m", priority=Priority.P1, tenant="t", created_ms=created,
                   deadline_ms=created + left_ms, inputs=("x",), reply=ReplyRoute(redis="c"))


async def test_a_request_answered_before_its_hedge_costs_one_timer_and_no_task(offline: Offline) -> None:
    """The hot path: the caller hands its copy over itself and waits on the reply alone; the hedge's moment
    and the deadline share one timer. Counted on the loop, not timed."""
    client = offline(hedging=HedgePolicy(min_samples=1))
    client._hedger.observe("m", 100.0)
    client._partitions = lambda topic: [0, 1, 2]  # type: ignore[method-assign]

    async def hand(topic: str, data: bytes, request: Request, headers: object, partition: int | None
                   ) -> asyncio.Future[None]:
        return taken()

    client._hand = hand  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    counts = {"call_at": 0, "create_task": 0}
    call_at, create_task = loop.call_at, loop.create_task

    def counted_call_at(*args: Any, **kwargs: Any) -> asyncio.TimerHandle:
        counts["call_at"] += 1
        return call_at(*args, **kwargs)

    def counted_create_task(*args: Any, **kwargs: Any) -> asyncio.Task[Any]:
        counts["create_task"] += 1
        return create_task(*args, **kwargs)

    copies = InFlight(client, T, b"", _request("r1", 60_000), None)
    copies.waiter.set_result(Result("r1", "m", Status.OK))  # answered as soon as it is sent
    loop.call_at, loop.create_task = counted_call_at, counted_create_task  # type: ignore[method-assign]
    try:
        assert (await client._exchange(copies)).ok
    finally:
        loop.call_at, loop.create_task = call_at, create_task  # type: ignore[method-assign]
    assert counts == {"call_at": 1, "create_task": 0}
    await asyncio.sleep(0)  # the acknowledgement's callback
    assert copies.accepted and client._waiting == {}


@pytest.mark.parametrize("taken_by_the_broker", [True, False])
async def test_the_deadline_ends_the_wait_and_says_whether_the_broker_took_the_request(
    taken_by_the_broker: bool, offline: Offline) -> None:
    """A request the broker took and nobody answered, and one whose copy the producer never took (its
    buffer full, the broker gone): both end at the deadline, told apart; the caller's task is not left
    cancelled by the hand-over that was called off."""
    client = offline(reply_grace_ms=0,
                    hedging=HedgePolicy(enabled=False))
    client._partitions = lambda topic: [0, 1, 2]  # type: ignore[method-assign]
    stuck = asyncio.Event()

    async def hand(topic: str, data: bytes, request: Request, headers: object, partition: int | None
                   ) -> asyncio.Future[None]:
        if not taken_by_the_broker:
            await stuck.wait()  # never set: the producer's buffer stays full
        return taken()

    client._hand = hand  # type: ignore[method-assign]
    copies = InFlight(client, T, b"", _request("r1", 30), None)
    with pytest.raises(DeadlineExceeded) as raised:
        await client._exchange(copies)
    assert raised.value.accepted is taken_by_the_broker and not raised.value.answered
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0)  # still runs: no cancellation is pending on the caller


async def test_a_caller_cancelled_while_handing_over_is_cancelled_not_timed_out(offline: Offline) -> None:
    client = offline(hedging=HedgePolicy(enabled=False))
    client._partitions = lambda topic: [0]  # type: ignore[method-assign]
    handing = asyncio.Event()

    async def hand(topic: str, data: bytes, request: Request, headers: object, partition: int | None
                   ) -> asyncio.Future[None]:
        handing.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    client._hand = hand  # type: ignore[method-assign]
    copies = InFlight(client, T, b"", _request("r1", 60_000), None)
    exchange = asyncio.create_task(client._exchange(copies))
    await asyncio.wait_for(handing.wait(), 10)
    exchange.cancel()
    with pytest.raises(asyncio.CancelledError):
        await exchange
    assert copies._timer is None or copies._timer.cancelled()


async def test_a_copy_the_producer_refuses_at_once_is_the_answer(offline: Offline) -> None:
    from aiokafka.errors import KafkaTimeoutError

    client = offline(hedging=HedgePolicy(enabled=False))
    client._partitions = lambda topic: [0]  # type: ignore[method-assign]

    async def hand(topic: str, data: bytes, request: Request, headers: object, partition: int | None
                   ) -> asyncio.Future[None]:
        raise KafkaTimeoutError()

    client._hand = hand  # type: ignore[method-assign]
    with pytest.raises(Unavailable, match=r"publishing to infer\.m\.p1 failed"):
        await client._exchange(InFlight(client, T, b"", _request("r1", 60_000), None))


@pytest.mark.parametrize("hedge_answered", [True, False])
async def test_a_first_copy_stuck_in_the_producer_neither_holds_a_hedges_answer_nor_fails_on_its_refusal(
    hedge_answered: bool, offline: Offline) -> None:
    """The first copy's partition has its producer buffer full (its leader gone): the hedge goes
    elsewhere. Answered there, the caller has the answer at once; refused there, the call waits on
    (the stuck copy may still be taken) and ends at the deadline, not taken."""
    client = offline(reply_grace_ms=0,
                    hedging=HedgePolicy(min_samples=1, max_hedges=1))
    client._hedger.observe("m", 0.001)  # the hedge delay is its floor, 20 ms
    client._partitions = lambda topic: [0, 1]  # type: ignore[method-assign]
    stuck, hedged = asyncio.Event(), asyncio.Event()

    async def hand(topic: str, data: bytes, request: Request, headers: object, partition: int | None
                   ) -> asyncio.Future[None]:
        if not stuck.is_set():
            stuck.set()  # the first copy: from now on stuck
            await asyncio.Event().wait()
        hedged.set()
        delivery = asyncio.get_running_loop().create_future()
        if hedge_answered:
            delivery.set_result(None)
        else:
            delivery.set_exception(Unavailable("hedge refused"))
        return delivery

    client._hand = hand  # type: ignore[method-assign]
    copies = InFlight(client, T, b"", _request("r1", 60_000 if hedge_answered else 300), None)
    exchange = asyncio.create_task(client._exchange(copies))
    await asyncio.wait_for(hedged.wait(), 10)
    if hedge_answered:
        copies.waiter.set_result(Result("r1", "m", Status.OK))
        assert (await asyncio.wait_for(exchange, 10)).ok
    else:
        with pytest.raises(DeadlineExceeded) as raised:
            await asyncio.wait_for(exchange, 10)
        assert not raised.value.accepted and copies.refusal is not None


def test_a_grown_bucket_is_for_the_stranded_the_tail_spends_only_the_floors_top() -> None:
    """What a busy client's bucket holds beyond its floor pays only for requests stranded on a suspect
    partition: a slow answer elsewhere (an overload's tail) may spend what it could from the floor alone."""
    policy = HedgePolicy(budget=0.02, burst=50, burst_s=1.0)
    budget = HedgeBudget(policy.budget, policy.burst, policy.burst_s)
    now = 0.0
    for _ in range(200 * 60):
        now += 1 / 200
        budget.earn(now)
    keep_for_stranded = budget.burst - policy.tail_burst  # as Client._hedge keeps for a slow answer
    assert sum(budget.spend(keep_for_stranded) for _ in range(1_000)) == int(policy.tail_burst) == 25
    assert sum(budget.spend() for _ in range(1_000)) == int(budget.burst) - 25  # the stranded: the rest
