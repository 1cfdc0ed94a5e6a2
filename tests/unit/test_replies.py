"""Reply correlation without a broker: batched replies reach each caller once; bad replies are dropped."""

from __future__ import annotations

import msgpack
import redis.asyncio as aioredis

from producers.replies import ReplyMux
from topics import Chunk, ReplyBatch, Result, Status, Usage, pack


def result(rid: str, output: int = 1) -> Result:
    return Result(rid, "m", Status.OK, outputs=[output])


async def test_a_batch_of_replies_reaches_each_caller_exactly_once() -> None:
    mux = ReplyMux(aioredis.Redis(), "kinfer:reply:test")
    waiters = {rid: mux.expect(rid) for rid in ("a", "b", "c")}
    stream = mux.open_stream("s")
    mux._receive(pack(ReplyBatch([result("a", 1), Chunk("s", "m", 0, text="x"), result("b", 2), result("a", 9)])),
                 "redis")
    assert waiters["a"].result().outputs == [1]  # the first answer wins; the repeat is a duplicate
    assert waiters["b"].result().outputs == [2]
    assert not waiters["c"].done()
    assert mux.duplicates == 1
    mux._receive(pack(ReplyBatch([result("c", 3), Chunk("s", "m", 1, final=True, status=Status.OK,
                                                         usage=Usage(2, 2))])), "kafka")
    assert waiters["c"].result().outputs == [3]
    assert [c.seq for c in (await stream.next(1.0), await stream.next(1.0))] == [0, 1]
    assert mux.received == {"redis": 3, "kafka": 2}
    for rid in ("a", "b", "c", "s"):
        mux.forget(rid)


async def test_malformed_replies_are_counted_and_dropped_and_the_reader_lives_on() -> None:
    mux = ReplyMux(aioredis.Redis(), "kinfer:reply:test")
    waiter = mux.expect("r")
    for bad in (
        b"\xc1",
        msgpack.packb({"v": 1, "t": "res", "id": "r", "model": "m", "status": "ok", "timings": [1]}),
        msgpack.packb({"v": 1, "t": "res", "id": "r", "model": "m", "status": "maybe"}),
        msgpack.packb({"v": 1, "t": "batch", "replies": [{"t": "req"}]}),
        msgpack.packb({"v": 2, "t": "res", "id": "r", "model": "m", "status": "ok"}),
    ):
        mux._receive(bad, "redis")
    assert mux.malformed == 5 and not waiter.done()
    mux._receive(pack(result("r")), "redis")
    assert waiter.result().ok
    mux.forget("r")
