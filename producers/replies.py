"""Reply correlation: one Redis pub/sub subscription per client, futures keyed by request id."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from topics import InvalidRequest, Result, Unavailable, decode_result

log = logging.getLogger(__name__)


class ReplyMux:
    """Owns the client's reply channel and hands each result to the caller waiting for it.

    A result whose id nobody waits for — a second copy after a worker redelivery, or one that
    arrived after its caller gave up — is counted in ``duplicates`` and dropped: a caller sees
    exactly one result per request.
    """

    def __init__(self, redis: aioredis.Redis, channel: str) -> None:
        self.channel = channel
        self.duplicates = 0
        self._redis = redis
        self._pubsub = redis.pubsub(ignore_subscribe_messages=False)
        self._waiters: dict[str, asyncio.Future[Result]] = {}
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
            await self._pubsub.aclose()
        self._fail_all(Unavailable("client closed"))

    def expect(self, request_id: str) -> asyncio.Future[Result]:
        """Register interest before publishing the request (a fast reply must find its waiter)."""
        if self._failure is not None:
            raise Unavailable(f"reply channel is down: {self._failure}") from self._failure
        fut: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = fut
        return fut

    def forget(self, request_id: str) -> None:
        self._waiters.pop(request_id, None)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def _read(self) -> None:
        while True:
            msg = await self._pubsub.get_message(timeout=1.0)
            if msg is None or msg["type"] != "message":
                continue
            try:
                result = decode_result(msg["data"])
            except InvalidRequest as exc:
                log.warning("dropping an unreadable reply on %s: %s", self.channel, exc)
                continue
            fut = self._waiters.pop(result.id, None)
            if fut is None or fut.done():
                self.duplicates += 1
                continue
            fut.set_result(result)

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
