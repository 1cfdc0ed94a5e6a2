"""Reassembling a stream: chunks may arrive late, out of order, or twice (after a redelivery)."""

from __future__ import annotations

import asyncio
from collections import deque

from kinfer.topics import Chunk, KinferError

# A stream has at most this many chunks: a worker sends one per token, at most 65,536 tokens
# (``max_new_tokens``' limit, WIRE_FORMAT.md), and a final one. A chunk numbered beyond is no chunk of it.
MAX_STREAM_CHUNKS = 65_537


class StreamBuffer:
    """Hands out a request's chunks in ``seq`` order, each exactly once.

    Owned by the client's reply reader (``push``/``fail``) and read by the caller (``next``).
    Bounded by the stream itself: a worker sends at most ``max_new_tokens`` + 1 chunks, and a
    chunk whose ``seq`` no stream reaches (``MAX_STREAM_CHUNKS``) is dropped and counted.
    """

    def __init__(self) -> None:
        self.duplicates = 0
        self.out_of_range = 0  # chunks numbered past any stream's end: dropped
        self._next = 0  # the seq the caller gets next
        self._early: dict[int, Chunk] = {}  # arrived before their turn
        self._ready: deque[Chunk] = deque()
        self._error: KinferError | None = None
        self._changed = asyncio.Event()
        self.finished = False

    def push(self, chunk: Chunk) -> None:
        if chunk.seq >= MAX_STREAM_CHUNKS:
            self.out_of_range += 1
            return
        if chunk.seq < self._next or chunk.seq in self._early or self.finished:
            self.duplicates += 1
            return
        self._early[chunk.seq] = chunk
        while self._next in self._early:
            ready = self._early.pop(self._next)
            self._ready.append(ready)
            self._next += 1
            if ready.final:
                self.finished = True
                self._early.clear()
                break
        self._changed.set()

    def fail(self, error: KinferError) -> None:
        """The stream ended without chunks (refused, expired) or its channel broke."""
        if not self.finished:
            self._error = error
            self._changed.set()

    async def next(self, timeout_s: float) -> Chunk:
        """The next chunk in order; raises the stream's error, or TimeoutError."""
        while not self._ready:
            if self._error is not None:
                raise self._error
            self._changed.clear()
            await asyncio.wait_for(self._changed.wait(), max(0.0, timeout_s))
        return self._ready.popleft()
