"""A load generator in a process of its own, driven over stdin/stdout (``python -m kinfer.ops.bench.loadgen``).

The transport benchmark runs it beside the worker, the broker, Redis and the gateway, so that each
process's CPU can be read from /proc and charged to the right side. It starts its client once,
then answers one JSON line per JSON command line::

    → {"rate": 2000, "seconds": 10, "seed": 3}
    ← {"offered": 20000, "ok": 19998, "errors": {"DeadlineExceeded": 2}, "p50_ms": …, "p95_ms": …, …}

Open loop with Poisson arrivals: requests start on schedule whatever the system does, and latency
counts from each request's *scheduled* time. Requests go out in ticks (all that are due), so the
generator's own cost per request stays small next to what it measures.

``--mode library`` sends through ``producers.Client``; ``--mode http`` posts JSON to a gateway over
a small pool of keep-alive HTTP/1.1 connections (a raw asyncio protocol: an HTTP client library
would cost more CPU per request than the gateway it measures).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from typing import Any

from kinfer.ops.bench.load import make_texts, percentile
from kinfer.producers import Client
from kinfer.topics import DeadlineExceeded, KinferError

SENTENCE = "kafka is fast when it is used in batches"


async def run_open_loop(rate: float, seconds: float, seed: int, one: Callable[[], Awaitable[str]]) -> dict[str, Any]:
    """Start ``one()`` on a Poisson schedule for ``seconds``; ``one`` returns an outcome name."""
    rng = random.Random(seed)
    latencies: list[float] = []
    outcomes: Counter[str] = Counter()
    tasks: set[asyncio.Task[None]] = set()

    async def timed(scheduled: float) -> None:
        try:
            outcome = await one()
        except KinferError as exc:
            outcome = type(exc).__name__
            if isinstance(exc, DeadlineExceeded) and not exc.answered:
                outcome = "lost"  # no reply at all by the deadline (+ grace)
        except Exception as exc:  # transport errors of the HTTP client
            outcome = type(exc).__name__
        outcomes[outcome] += 1
        if outcome == "ok":
            latencies.append((time.monotonic() - scheduled) * 1000.0)

    start = time.monotonic()
    at, end, offered = start, start + seconds, 0
    cpu0 = time.process_time()
    while at < end:
        now = time.monotonic()
        while at <= now and at < end:
            task = asyncio.create_task(timed(at))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            offered += 1
            at += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, at - time.monotonic()))
    while tasks:
        await asyncio.wait(set(tasks))
    elapsed = time.monotonic() - start
    ok = outcomes.pop("ok", 0)
    return {
        "rate": rate, "seconds": seconds, "offered": offered, "ok": ok, "errors": dict(outcomes),
        "ok_fraction": round(ok / offered, 5) if offered else 0.0,
        "p50_ms": _ms(percentile(latencies, 50)), "p95_ms": _ms(percentile(latencies, 95)),
        "p99_ms": _ms(percentile(latencies, 99)), "max_ms": _ms(max(latencies, default=float("nan"))),
        "elapsed_s": round(elapsed, 2), "generator_cpu_s": round(time.process_time() - cpu0, 3),
    }


def _ms(value: float) -> float | None:
    return None if value != value else round(value, 1)  # NaN → null (strict JSON)


# -- HTTP/1.1 keep-alive client -------------------------------------------------------------------


class _HttpConnection(asyncio.Protocol):
    """One keep-alive connection, one request at a time; enough HTTP for a JSON API."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.alive = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.alive = False
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ConnectionError(f"connection closed: {exc}"))

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        waiter = self._waiter
        if waiter is None:
            return
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self._buffer[:end]).lower()
        at = head.find(b"content-length:")
        length = int(head[at + 15 : head.find(b"\r\n", at) if head.find(b"\r\n", at) > 0 else None]) if at >= 0 else 0
        if len(self._buffer) < end + 4 + length:
            return
        body = bytes(self._buffer[end + 4 : end + 4 + length])
        del self._buffer[: end + 4 + length]
        self._waiter = None
        if not waiter.done():
            waiter.set_result((int(head[9:12]), body))

    def request(self, data: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self._waiter


class HttpPool:
    """At most ``max_connections`` keep-alive connections; a caller with none free waits its turn."""

    def __init__(self, host: str, port: int, max_connections: int) -> None:
        self.host, self.port, self.max = host, port, max_connections
        self._idle: list[_HttpConnection] = []
        self._open = 0
        self._waiting: deque[asyncio.Future[_HttpConnection | None]] = deque()

    async def _get(self) -> _HttpConnection:
        while True:
            while self._idle:
                conn = self._idle.pop()
                if conn.alive:
                    return conn
                self._open -= 1
            if self._open < self.max:
                self._open += 1
                try:
                    _, conn = await asyncio.get_running_loop().create_connection(
                        _HttpConnection, self.host, self.port)
                except OSError:
                    self._open -= 1
                    raise
                return conn
            turn: asyncio.Future[_HttpConnection | None] = asyncio.get_running_loop().create_future()
            self._waiting.append(turn)
            handed = await turn  # a connection, or None: one closed, so there is room to open one
            if handed is not None:
                return handed

    def _put(self, conn: _HttpConnection) -> None:
        if not conn.alive:
            self._open -= 1
        while self._waiting:  # someone waits: hand it over (or tell it there is room)
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(conn if conn.alive else None)
                return
        if conn.alive:
            self._idle.append(conn)

    async def post(self, data: bytes) -> tuple[int, bytes]:
        conn = await self._get()
        try:
            return await conn.request(data)
        finally:
            self._put(conn)

    def close(self) -> None:
        for conn in self._idle:
            if conn.transport is not None:
                conn.transport.close()


def http_request(path: str, body: dict[str, Any]) -> bytes:
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n")
    return head.encode() + payload


# -- the process ----------------------------------------------------------------------------------


async def serve(args: argparse.Namespace) -> None:
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    if args.texts:
        low, high = (int(n) for n in args.texts.split(","))
        texts = make_texts(2048, min_words=low, max_words=high, seed=13)
    else:
        texts = [SENTENCE]
    if args.mode == "library":
        async with Client(args.bootstrap, args.redis_url, tenant="bench") as client:

            turns = iter(range(1 << 62))

            async def one() -> str:
                text = texts[next(turns) % len(texts)]
                result = await client.infer(args.model, [text], deadline_ms=args.deadline_ms)
                return result.status.value

            await _commands(reader, one, lambda: {"duplicates": client.duplicate_replies,
                                                       "replies_by_source": client.replies_received})
    else:
        host, port = args.url.removeprefix("http://").rsplit(":", 1)
        pool = HttpPool(host, int(port), args.connections)
        bodies = [http_request(f"/v1/models/{args.model}/infer", {"inputs": [text], "timeout_ms": args.deadline_ms})
                  for text in texts]
        turn = iter(range(1 << 62))

        async def one_http() -> str:
            status, body = await pool.post(bodies[next(turn) % len(bodies)])
            return "ok" if status == 200 and b'"status":"ok"' in body else f"http_{status}"

        try:
            await _commands(reader, one_http, dict)
        finally:
            pool.close()


async def _commands(reader: asyncio.StreamReader, one: Callable[[], Awaitable[str]],
                    extra: Callable[[], dict[str, Any]]) -> None:
    gc.collect()
    gc.freeze()  # as the worker and the gateway do: the generator's own GC pauses stay out of what it measures
    print(json.dumps({"ready": True}), flush=True)
    while line := await reader.readline():
        cmd = json.loads(line)
        report = await run_open_loop(float(cmd["rate"]), float(cmd["seconds"]), int(cmd.get("seed", 1)), one)
        print(json.dumps({**report, **extra()}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kinfer.ops.bench.loadgen", description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["library", "http"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--bootstrap", default="")
    p.add_argument("--redis-url", default="")
    p.add_argument("--url", default="", help="the gateway, http://host:port (--mode http)")
    p.add_argument("--connections", type=int, default=256, help="keep-alive connections at most (--mode http)")
    p.add_argument("--deadline-ms", type=int, default=5_000)
    p.add_argument("--texts", help="MIN,MAX: texts of that many words (default: one short sentence)")
    args = p.parse_args(argv)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
