"""A load generator in a process of its own, driven over stdin/stdout (``python -m kinfer.ops.bench.loadgen``).

The transport and serve benchmarks run it beside the worker, the broker, Redis and the gateway, so
that each process's CPU can be read from /proc and charged to the right side. It starts its client
once, then answers one JSON line per JSON command line::

    → {"rate": 2000, "seconds": 10, "seed": 3}
    ← {"offered": 20000, "ok": 19998, "errors": {"DeadlineExceeded": 2}, "p50_ms": …, "p95_ms": …, …}

Open loop with Poisson arrivals: requests start on schedule whatever the system does, and latency
counts from each request's *scheduled* time. Requests go out in ticks (all that are due), so the
generator's own cost per request stays small next to what it measures.

``--mode library`` sends through ``producers.Client``; ``--mode http`` posts JSON to a gateway over
a small pool of keep-alive HTTP/1.1 connections (a raw asyncio protocol: an HTTP client library
would cost more CPU per request than the gateway it measures).

The benchmark's side of the protocol is here too: ``LoadGen`` starts the process and sends it steps,
``sweep`` steps the rate up until the SLA is missed, charging each process its CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from typing import IO, Any

from kinfer.ops.bench.harness import cpu_seconds, log
from kinfer.ops.bench.texts import make_texts
from kinfer.ops.capacity.sla import meets_sla, percentile_ms
from kinfer.ops.localstack.procs import scrape
from kinfer.ops.localstack.stack import StackInfo
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
        "p50_ms": percentile_ms(latencies, 50), "p95_ms": percentile_ms(latencies, 95),
        "p99_ms": percentile_ms(latencies, 99), "max_ms": percentile_ms(latencies, 100),
        "elapsed_s": round(elapsed, 2), "generator_cpu_s": round(time.process_time() - cpu0, 3),
    }


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


# The HTTP APIs the generator speaks: kinfer's own, and two others so that the same generator, texts
# and schedule measure another server too (``kinfer bench peers``).
APIS = ("native", "openai", "v2")


def api_request(api: str, model: str, text: str, deadline_ms: int) -> bytes:
    """One embedding request for ``text``: kinfer's native API (with its deadline), OpenAI's
    ``/embeddings``, or the Open Inference Protocol (KServe V2: MLServer, Triton) with one string
    tensor. Only kinfer's carries a deadline; the others are judged by the same SLA from outside."""
    if api == "native":
        return http_request(f"/v1/models/{model}/infer", {"inputs": [text], "timeout_ms": deadline_ms})
    if api == "openai":
        return http_request("/embeddings", {"model": model, "input": [text]})
    if api == "v2":
        return http_request(f"/v2/models/{model}/infer",
                            {"inputs": [{"name": "args", "shape": [1], "datatype": "BYTES", "data": [text]}]})
    raise ValueError(f"unknown API {api!r} (known: {', '.join(APIS)})")


def api_outcome(api: str, status: int, body: bytes) -> str:
    """``ok``, or ``http_<status>``; kinfer's API answers 200 with a status of its own in the body."""
    ok = status == 200 and (api != "native" or b'"status":"ok"' in body)
    return "ok" if ok else f"http_{status}"


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
        bodies = [api_request(args.api, args.model, text, args.deadline_ms) for text in texts]
        turn = iter(range(1 << 62))

        async def one_http() -> str:
            status, body = await pool.post(bodies[next(turn) % len(bodies)])
            return api_outcome(args.api, status, body)

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
    p.add_argument("--api", choices=APIS, default="native", help="the HTTP API spoken (--mode http)")
    p.add_argument("--connections", type=int, default=256, help="keep-alive connections at most (--mode http)")
    p.add_argument("--deadline-ms", type=int, default=5_000)
    p.add_argument("--texts", help="MIN,MAX: texts of that many words (default: one short sentence)")
    args = p.parse_args(argv)
    from kinfer.ops.cli.observability import configure_tracing

    configure_tracing("loadgen")  # the client's spans, when OTEL_TRACES_EXPORTER asks (bench transport --trace-ratio)
    asyncio.run(serve(args))
    return 0


# -- the benchmark's side -------------------------------------------------------------------------


class LoadGen:
    """The load generator process (``python -m kinfer.ops.bench.loadgen``) and its line protocol."""

    def __init__(self, info: StackInfo | None, mode: str, model: str, log_path: str, url: str = "",
                 extra: list[str] | None = None) -> None:
        """``info``: the stack a library client connects to (None: an HTTP server of any kind at ``url``)."""
        env = {**os.environ, **(info.env() if info else {})}
        stack = ["--bootstrap", info.bootstrap, "--redis-url", info.redis_url] if info else []
        cmd = [sys.executable, "-m", "kinfer.ops.bench.loadgen", "--mode", mode, "--model", model, *stack,
               "--url", url, *(extra or [])]
        self._log = open(log_path, "ab")  # noqa: SIM115 — closed in close()
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True)
        ready = self._read()
        if not ready.get("ready"):
            raise RuntimeError(f"load generator did not start: {ready}")

    def _read(self) -> dict[str, Any]:
        stdout: IO[str] = self.proc.stdout  # type: ignore[assignment]
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"load generator exited ({self.proc.poll()}); see {self._log.name}")
        return dict(json.loads(line))

    def step(self, rate: float, seconds: float, seed: int) -> dict[str, Any]:
        """One open-loop step at ``rate`` for ``seconds``: what ``run_open_loop`` reports."""
        stdin: IO[str] = self.proc.stdin  # type: ignore[assignment]
        stdin.write(json.dumps({"rate": rate, "seconds": seconds, "seed": seed}) + "\n")
        stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def worker_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Means over a step from the worker's Prometheus histograms: where a request's time went."""
    def mean(name: str, scale: float = 1.0) -> float | None:
        n = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
        return round(total / n * scale, 2) if n else None

    return {"mean_batch": mean("kinfer_batch_size"), "queue_wait_ms": mean("kinfer_queue_wait_seconds", 1000.0),
            "batch_wait_ms": mean("kinfer_batch_wait_seconds", 1000.0)}


def sweep(gen: LoadGen, pids: dict[str, int], rates: tuple[float, ...], seconds: float, *, min_ok: float,
          metrics_port: int | None = None) -> dict[str, Any]:
    """Open-loop steps at each rate, up to the first that misses the SLA (twice): latency, and the CPU
    each process in ``pids`` spent per request answered; where the worker went, from ``metrics_port``."""
    steps: list[dict[str, Any]] = []
    best: dict[str, Any] | None = None
    # A failing rate is tried once more before the sweep stops: on a shared two-core box one stall
    # of a few hundred milliseconds decides a 10 s step's p99. Both tries are in the report.
    tries = [(i, rate, attempt) for i, rate in enumerate(rates) for attempt in (1, 2)]
    for i, rate, attempt in tries:
        if attempt == 2 and (not steps or steps[-1]["meets_sla"]):
            continue
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        scraped = scrape(metrics_port) if metrics_port else {}
        out = gen.step(rate, seconds, seed=10 * i + attempt)
        spent = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
        if metrics_port:
            out["worker"] = worker_means(scraped, scrape(metrics_port))
        answered = max(1, out["ok"] + sum(n for k, n in out["errors"].items() if k != "lost"))
        cpu = {name: round(s * 1000.0 / answered, 4) for name, s in spent.items()}
        cpu["total"] = round(sum(cpu.values()), 4)
        meets = meets_sla(out["ok_fraction"], out["p95_ms"], out["p99_ms"], min_ok)
        step = {**out, "answered_rps": round(answered / out["elapsed_s"], 1), "cpu_ms_per_request": cpu,
                "meets_sla": meets, "attempt": attempt}
        steps.append(step)
        log(f"  {rate:7.1f}/s ok={out['ok_fraction']:.4f} p50={out['p50_ms']} p95={out['p95_ms']} "
            f"p99={out['p99_ms']} cpu/req={cpu} {'pass' if meets else 'FAIL'} {out.get('worker', '')}")
        time.sleep(1.0)
        if not meets:
            if attempt == 2:
                break
            continue
        best = step
    return {
        "max_rps_at_sla": best["rate"] if best else 0.0,
        "cpu_ms_per_request": best["cpu_ms_per_request"] if best else None,
        "steps": steps,
    }


if __name__ == "__main__":
    sys.exit(main())
