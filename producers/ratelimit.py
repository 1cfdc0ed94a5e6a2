"""Tenant rate limits shared by every gateway on one Redis: one token bucket per tenant, in Redis.

Each gateway process used to keep its own bucket per tenant, so N gateways admitted N times a
tenant's rate. Here the bucket lives in Redis under ``kinfer:ratelimit:<tenant>`` (a hash: ``tokens``
and ``at``, the last refill in microseconds of the Redis server's clock), and one Lua script refills
and spends it atomically, so gateways' requests for one tenant are serialised by Redis and together
admit at most ``burst + rate_per_s * elapsed``. The script reads the time with ``TIME`` on the server:
the gateways' clocks play no part. A key expires (``PEXPIRE``) when its bucket would be full again, so
an idle tenant costs nothing, and a missing key means a full bucket.

Exactly what a gateway sends to Redis for this, and so what its Redis user needs (ACL):

* ``EVALSHA <sha1> 1 kinfer:ratelimit:<tenant> <rate_per_s> <burst> <count>``: one per request, or,
  under load, one per tenant per batch (pipelined, no MULTI), ``count`` the tenant's requests in it;
* ``SCRIPT LOAD <script>`` when Redis answers ``NOSCRIPT`` (first use, after a restart or failover);
* inside the script, on that one key: ``TIME``, ``HMGET``, ``HSET``, ``PEXPIRE`` (Redis checks a
  script's commands against the caller's ACL too), e.g.
  ``ACL SETUSER gateway ... ~kinfer:ratelimit:* +evalsha +script|load +time +hmget +hset +pexpire``;
* on (re)connecting, what redis-py sends: ``HELLO 3`` (with ``AUTH`` when the URL has a user), and
  ``SELECT`` for a database other than 0.

At most one round trip per request (fewer under load: requests that come while one is in flight
share the next, see ``RedisRateLimiter``), on one connection of its own with short timeouts. A
Redis that does not answer within ``timeout_s`` (or errs) fails open to the tenant's local
``TokenBucket`` in this process (the old per-process limit) for ``retry_s``, counted in
``kinfer_gateway_ratelimit_local_total`` and logged once per outage (and once when it is back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import Counter
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError

from kinfer.producers.tenants import Tenant

log = logging.getLogger(__name__)

KEY_PREFIX = "kinfer:ratelimit:"

LOCAL_DECISIONS = Counter(
    "kinfer_gateway_ratelimit_local_total",
    "Rate-limit decisions taken by this gateway's own bucket because Redis did not answer (fail open)",
)

# KEYS[1]: the tenant's bucket. ARGV: rate per second, burst, tokens wanted (>= 1).
# Returns {granted, wait_us}: granted (<= wanted) tokens spent now, and, when fewer than wanted were
# there, the microseconds until the next whole token.
# Numbers cross into Redis commands as strings with 14 significant digits unless formatted: the
# clock (16 digits of microseconds) and the tokens are formatted here, exactly.
SCRIPT = """
if redis.replicate_commands then redis.replicate_commands() end
local rate, burst, wanted = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens, at = tonumber(state[1]), tonumber(state[2])
if tokens == nil or at == nil then
  tokens = burst
elseif now > at then
  tokens = math.min(burst, tokens + (now - at) * rate / 1000000)
end
local granted = math.min(wanted, math.floor(tokens))
local wait_us = 0
if granted < wanted then
  wait_us = math.ceil((1 - (tokens - granted)) / rate * 1000000)
end
if granted > 0 then
  tokens = tokens - granted
  redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', tokens), 'at', string.format('%d', now))
  redis.call('PEXPIRE', KEYS[1], string.format('%d', math.ceil((burst - tokens) / rate * 1000) + 1))
end
return {granted, wait_us}
"""


class RedisRateLimiter:
    """``take(tenant)``: 0.0 when a request of ``tenant`` may go now, else the seconds until one may.

    Shared through Redis by every process using the same Redis; the tenant's own ``bucket`` decides
    while Redis is unreachable. One call to Redis is in flight at a time, on one connection kept for
    it: requests arriving meanwhile wait for it, then go together in one round trip, one ``EVALSHA``
    per tenant asking for as many tokens as it has requests waiting (granted in arrival order). An
    idle gateway pays one round trip per request; a busy one far less (a batch holds what came during
    the last round trip), and no token is taken that a request does not spend.

    The connection is driven directly (``pack_commands``, ``send_packed_command``, ``read_response``):
    the client's command machinery (pool, retries, instrumentation, a task per write for
    ``socket_timeout``) was about a third of the CPU of a call.
    """

    def __init__(self, redis: aioredis.Redis, *, timeout_s: float = 0.2, retry_s: float = 1.0,
                 owns_redis: bool = False) -> None:
        self._redis = redis
        self._script = redis.register_script(SCRIPT)  # its SHA-1; loaded on the first NOSCRIPT
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._owns_redis = owns_redis
        self._conn: Connection | None = None
        self._local_until = 0.0  # monotonic time until which Redis is not asked (it just failed)
        self._outage = False  # logged once per outage
        self._busy = False  # a call to Redis is in flight
        self._waiting: dict[str, tuple[Tenant, list[asyncio.Future[float]]]] = {}  # by tenant, for the next call
        self._drain: asyncio.Task[None] | None = None
        self.round_trips = 0  # calls to Redis (requests / round_trips: the batching)

    @classmethod
    def from_url(cls, redis_url: str, *, timeout_s: float = 0.2, retry_s: float = 1.0) -> RedisRateLimiter:
        """A limiter with a connection of its own and short timeouts: a Redis that hangs costs a request
        ``timeout_s`` at most, and only the first of an outage. (The round trip's timeout is the
        limiter's own: redis-py's ``socket_timeout`` would cost a task per write.)"""
        redis = aioredis.Redis.from_url(redis_url, socket_timeout=None, socket_connect_timeout=timeout_s,
                                        health_check_interval=0)
        return cls(redis, timeout_s=timeout_s, retry_s=retry_s, owns_redis=True)

    async def take(self, tenant: Tenant) -> float:
        if time.monotonic() < self._local_until:
            return self._local(tenant)
        if self._busy:  # go with the next call, beside the others that come meanwhile
            waiter: asyncio.Future[float] = asyncio.get_running_loop().create_future()
            entry = self._waiting.get(tenant.name)
            if entry is None:
                entry = self._waiting[tenant.name] = (tenant, [])
            entry[1].append(waiter)
            return await waiter
        self._busy = True
        try:
            return (await self._ask([(tenant, 1)]))[0][0]
        finally:
            if self._waiting:
                self._drain = asyncio.create_task(self._drain_waiting())  # busy until it has answered them all
            else:
                self._busy = False

    async def _drain_waiting(self) -> None:
        batch: list[tuple[Tenant, list[asyncio.Future[float]]]] = []
        try:
            while self._waiting:
                batch, self._waiting = list(self._waiting.values()), {}
                answers = await self._ask([(tenant, len(waiters)) for tenant, waiters in batch])
                for (_, waiters), waits in zip(batch, answers, strict=True):
                    for waiter, wait in zip(waiters, waits, strict=True):
                        if not waiter.done():  # a caller that gave up: its token, if any, is spent anyway
                            waiter.set_result(wait)
        except BaseException as exc:  # cancelled at close, or a bug: no caller is left waiting forever
            for _, waiters in batch + list(self._waiting.values()):
                for waiter in waiters:
                    if waiter.done():
                        continue
                    if isinstance(exc, Exception):
                        waiter.set_exception(exc)
                    else:
                        waiter.cancel()
            self._waiting = {}
            raise
        finally:
            self._busy = False

    async def _ask(self, wanted: list[tuple[Tenant, int]]) -> list[list[float]]:
        """Per (tenant, count): each request's answer, in order; Redis's, or the local bucket's if it fails."""
        if time.monotonic() >= self._local_until:
            self.round_trips += 1
            try:
                replies = await self._call([(KEY_PREFIX + t.name, repr(float(t.rate_per_s)), repr(float(t.burst)), n)
                                            for t, n in wanted])
                answers = []
                for (_, count), reply in zip(wanted, replies, strict=True):
                    granted, refused = int(reply[0]), max(int(reply[1]), 1) / 1e6
                    answers.append([0.0 if i < granted else refused for i in range(count)])
            except (RedisError, OSError, TimeoutError, IndexError, TypeError, ValueError) as exc:
                self._failed(exc)
            else:
                if self._outage:
                    self._outage = False
                    log.warning("rate limits: Redis answers again; tenants' limits are shared across gateways again")
                return answers
        return [[self._local(tenant) for _ in range(count)] for tenant, count in wanted]

    async def _call(self, calls: list[tuple[str, str, str, int]]) -> list[Any]:
        """The script's replies for (key, rate, burst, count) each, in one round trip (two on NOSCRIPT)."""
        conn = self._conn
        if conn is None:
            conn = self._conn = await self._redis.connection_pool.get_connection()  # type: ignore[no-untyped-call]
        evalshas = [("EVALSHA", self._script.sha, 1, *call) for call in calls]
        try:
            async with asyncio.timeout(self._timeout_s):
                try:
                    replies = await _round_trip(conn, evalshas)
                except RedisConnectionError:  # e.g. Redis closed the connection while idle: once more, anew
                    await conn.disconnect()
                    replies = await _round_trip(conn, evalshas)
                if any(isinstance(r, NoScriptError) for r in replies):  # then none ran: Redis does not have it
                    loaded, *replies = await _round_trip(conn, [("SCRIPT", "LOAD", SCRIPT), *evalshas])
                    if isinstance(loaded, Exception):
                        raise loaded
        except BaseException:
            await conn.disconnect()  # a reply half read must not become the next call's answer
            raise
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    def _local(self, tenant: Tenant) -> float:
        LOCAL_DECISIONS.inc()
        return tenant.bucket.take(time.monotonic())

    def _failed(self, exc: BaseException) -> None:
        self._local_until = time.monotonic() + self._retry_s
        if not self._outage:
            self._outage = True
            log.warning("rate limits: Redis did not answer (%s: %s); each gateway limits tenants on its own "
                        "(fail open) until it does", type(exc).__name__, exc)

    async def close(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.cancel()
            await asyncio.gather(self._drain, return_exceptions=True)
        with contextlib.suppress(RedisError, OSError):
            if self._conn is not None:
                await self._redis.connection_pool.release(self._conn)
                self._conn = None
            if self._owns_redis:
                await self._redis.aclose()


async def _round_trip(conn: Connection, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Send ``commands`` at once (redis-py packs them), then read each reply (an error reply is returned,
    not raised)."""
    await conn.send_packed_command(conn.pack_commands(commands), check_health=False)
    replies: list[Any] = []
    for _ in commands:
        try:
            replies.append(await conn.read_response())
        except ResponseError as exc:  # read in full: the connection is still in step
            replies.append(exc)
    return replies
