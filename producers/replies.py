"""Reply correlation: one Redis pub/sub subscription per client, futures keyed by request id."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from producers.streams import StreamBuffer
from topics import Chunk, InvalidRequest, KinferError, Result, Unavailable, decode_reply

log = logging.getLogger(__name__)


class ReplyMux:
    """Owns the client's reply channel and hands each result to the caller waiting for it.

    A result whose id nobody waits for is dropped, so a caller sees exactly one result per request.
    Recently finished ids are remembered (bounded) to tell the two kinds of stray reply apart:
    ``duplicates`` are second copies of an answered request (a worker redelivery after a crash);
    ``late`` are replies to requests whose caller had already given up.
    """

    RECENT = 50_000  # finished request ids remembered for the counters above

    def __init__(self, redis: aioredis.Redis, channel: str) -> None:
        self.channel = channel
        self.duplicates = 0
        self.late = 0
        self.unknown = 0
        self._recent: OrderedDict[str, bool] = OrderedDict()  # id → answered (False: abandoned)
        self._redis = redis
        self._pubsub = redis.pubsub(ignore_subscribe_messages=False)
        self._waiters: dict[str, asyncio.Future[Result]] = {}
        self._streams: dict[str, StreamBuffer] = {}
        self._reader: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None

    async def start(self) -> None:
        try:
            await self._pubsub.subscribe(self.channel)
            # Wait for the subscription to be confirmed, so no reply can be published before it.
            while (msg := await self._pubsub.get_message(timeout=1.0)) is None or msg["type"] != "subscribe":
                if msg is None and not self._pubsub.subscribed:
                    raise Unavailable(f"could not subscribe to {self.channel}")
        except RedisError as exc:
            raise Unavailable(f"Redis subscription to {self.channel} failed: {exc}") from exc
        self._pubsub.ignore_subscribe_messages = True
        self._reader = asyncio.create_task(self._read(), name=f"kinfer-replies-{self.channel}")
        self._reader.add_done_callback(self._reader_done)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        with contextlib.suppress(RedisError):
            await self._pubsub.aclose()  # type: ignore[no-untyped-call]
        self._fail_all(Unavailable("client closed"))

    def expect(self, request_id: str) -> asyncio.Future[Result]:
        """Register interest before publishing the request (a fast reply must find its waiter)."""
        if self._failure is not None:
            raise Unavailable(f"reply channel is down: {self._failure}") from self._failure
        fut: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = fut
        return fut

    def open_stream(self, request_id: str) -> StreamBuffer:
        """Register a streaming request before publishing it."""
        if self._failure is not None:
            raise Unavailable(f"reply channel is down: {self._failure}") from self._failure
        buffer = self._streams[request_id] = StreamBuffer()
        return buffer

    def forget(self, request_id: str) -> None:
        """The caller is done with ``request_id`` (answered or not)."""
        fut = self._waiters.pop(request_id, None)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self.duplicates += stream.duplicates
            self._remember(request_id, answered=stream.finished)
            return
        self._remember(request_id, answered=fut is None or (fut.done() and not fut.cancelled()))

    def _remember(self, request_id: str, answered: bool) -> None:
        self._recent[request_id] = answered
        self._recent.move_to_end(request_id)
        while len(self._recent) > self.RECENT:
            self._recent.popitem(last=False)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def _read(self) -> None:
        while True:
            msg = await self._pubsub.get_message(timeout=1.0)
            if msg is None or msg["type"] != "message":
                continue
            try:
                reply = decode_reply(msg["data"])
            except InvalidRequest as exc:
                log.warning("dropping an unreadable reply on %s: %s", self.channel, exc)
                continue
            self._deliver(reply)

    def _deliver(self, reply: Result | Chunk) -> None:
        stream = self._streams.get(reply.id)
        if stream is not None:
            if isinstance(reply, Chunk):
                stream.push(reply)
            else:  # refused before it could stream (expired, shed, invalid)
                try:
                    reply.raise_for_status()
                except KinferError as exc:
                    stream.fail(exc)
            return
        fut = self._waiters.pop(reply.id, None)
        if fut is not None and not fut.done() and isinstance(reply, Result):
            fut.set_result(reply)
            self._remember(reply.id, answered=True)
            return
        answered = self._recent.get(reply.id)
        if answered is None:
            self.unknown += 1
        elif answered:
            self.duplicates += 1
        else:
            self.late += 1

    def _reader_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            # A dead reader must not leave callers waiting for their timeouts: fail them now.
            log.error("reply reader on %s died: %r", self.channel, exc)
            self._failure = exc
            self._fail_all(Unavailable(f"reply channel {self.channel} failed: {exc}"))

    def _fail_all(self, exc: BaseException) -> None:
        waiters, self._waiters = self._waiters, {}
        for fut in waiters.values():
            if not fut.done():
                fut.set_exception(exc)
        error = exc if isinstance(exc, KinferError) else Unavailable(str(exc))
        for stream in self._streams.values():
            stream.fail(error)
