"""Stream reassembly: in order, each chunk once, whatever the network did."""

from __future__ import annotations

import asyncio

import pytest

from kinfer.producers.streams import MAX_STREAM_CHUNKS, StreamBuffer
from kinfer.topics import Chunk, DeadlineExceeded


def chunk(seq: int, final: bool = False) -> Chunk:
    return Chunk(id="r", model="m", seq=seq, text=f"<{seq}>", final=final)


async def drain(buffer: StreamBuffer) -> list[int]:
    out = []
    while True:
        c = await buffer.next(1.0)
        out.append(c.seq)
        if c.final:
            return out


async def test_out_of_order_and_repeated_chunks_come_out_once_in_order() -> None:
    b = StreamBuffer()
    for seq in [2, 0, 0, 1, 3, 1]:
        b.push(chunk(seq))
    b.push(chunk(4, final=True))
    b.push(chunk(2))
    assert await drain(b) == [0, 1, 2, 3, 4]
    assert b.duplicates == 3 and b.finished


async def test_a_gap_waits_and_an_error_surfaces() -> None:
    b = StreamBuffer()
    b.push(chunk(1))
    with pytest.raises(TimeoutError):
        await b.next(0.05)  # seq 0 has not arrived: nothing may be handed out
    b.fail(DeadlineExceeded("gone"))
    with pytest.raises(DeadlineExceeded):
        await b.next(1.0)


async def test_a_waiting_reader_wakes_on_push() -> None:
    b = StreamBuffer()
    reader = asyncio.create_task(b.next(5.0))
    await asyncio.sleep(0.01)
    b.push(chunk(0))
    assert (await reader).seq == 0


async def test_a_chunk_numbered_past_any_streams_end_is_dropped_and_counted() -> None:
    b = StreamBuffer()
    for seq in (MAX_STREAM_CHUNKS, 2**62, MAX_STREAM_CHUNKS + 1):
        b.push(chunk(seq))
    assert b.out_of_range == 3
    b.push(chunk(0))
    b.push(chunk(MAX_STREAM_CHUNKS - 1, final=True))  # the last chunk a stream can have is kept
    assert await b.next(1.0) == chunk(0)
    with pytest.raises(TimeoutError):
        await b.next(0.01)  # the gap before it is still open
