"""``kinfer bench fill``: a day of interactive traffic and one large batch, with the background tier and
without it, on a simulated accelerator.

Workers serve a simulated accelerator (``noop``: ``compute_ms`` a batch plus ``per_input_ms`` an input,
as a GPU's large fixed cost per forward pass). Interactive traffic (p1, every request with a
``deadline_ms`` deadline) follows a compressed day: Poisson arrivals whose rate goes from the valley
up to the peak and back, ``valley + (peak - valley) sin²(π t / T)`` of the fleet's capacity. Three
runs of the same schedule, each on fresh workers and topics, one after the other:

- ``no_batch``: the interactive traffic alone (what the fleet idles);
- ``without_tier``: plus one batch of ``batch`` requests submitted at the start as ordinary p2
  traffic (what a deployment without a background tier does);
- ``with_tier``: the same batch as background work (p3, a day's window).

Per run: the fleet's ``busy_fraction`` (model time over wall time, per worker, averaged, over the
interactive schedule), interactive ``p50/p95/p99`` from each request's scheduled send and its
``deadline_misses`` (not ok, or later than its deadline), the batch's ``batch_done_s`` (from the start
to its last answer; null when some were refused or never came) with its ``batch_ok`` and
``batch_throughput_rps``, ``idle_used`` (of the capacity ``no_batch`` left idle, the share the batch
took: ``(busy - busy_no_batch) / (1 - busy_no_batch)``) and ``max_wait_behind_background_ms`` (the
workers' longest wait of an interactive request for a background slice). ``timeline``: per
``bucket_s``, busy fraction and interactive p99.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

from aiokafka import TopicPartition

from kinfer.ops.bench import drawing as draw
from kinfer.ops.bench.harness import local_stack, log
from kinfer.ops.bench.load import fire
from kinfer.ops.capacity.sla import SLA_P95_MS, SLA_P99_MS, meets_sla, percentile_ms
from kinfer.ops.localstack.procs import scrape, spawn_worker, stop_process, wait_until_served
from kinfer.ops.localstack.stack import StackInfo, free_port
from kinfer.producers import Client
from kinfer.topics import KinferError, Priority
from kinfer.topics.admin import delete_topics, ensure_topics, model_topic_specs, offset_clients, shared_topic_specs
from kinfer.topics.names import request_topic, request_topics

RUNS = (("no_batch", "no batch"), ("without_tier", "batch as p2"), ("with_tier", "batch as background"))


@dataclass(frozen=True, slots=True)
class FillSetup:
    seconds: float = 120.0  # the compressed day
    valley: float = 0.1  # interactive rate at the valleys, of the fleet's capacity
    peak: float = 0.6  # and at the peak
    batch: int = 0  # requests in the batch (0: 80 % of what the day leaves idle)
    workers: int = 2
    compute_ms: float = 10.0  # the simulated accelerator: a forward pass's fixed cost
    per_input_ms: float = 4.0  # and its cost per input
    max_batch: int = 16
    slice_ms: float = 40.0  # --background-slice-ms: a full batch fits one slice
    deadline_ms: int = 1_000
    bucket_s: float = 5.0
    seed: int = 7

    @property
    def capacity_rps(self) -> float:
        """The fleet's requests/s at full batches."""
        return self.workers * self.max_batch / ((self.compute_ms + self.per_input_ms * self.max_batch) / 1000.0)

    def rate(self, t: float) -> float:
        return self.capacity_rps * (self.valley + (self.peak - self.valley) * math.sin(math.pi * t / self.seconds) ** 2)

    def batch_size(self) -> int:
        if self.batch:
            return self.batch
        idle = self.capacity_rps * self.seconds * (1.0 - (self.valley + self.peak) / 2.0)
        return int(0.8 * idle)

    def schedule(self, start: float) -> list[float]:
        """Poisson arrivals at ``rate(t)`` (thinning a process at the peak rate)."""
        rng, top = random.Random(self.seed), self.rate(self.seconds / 2.0)
        out: list[float] = []
        t = 0.0
        while True:
            t += rng.expovariate(top)
            if t >= self.seconds:
                return out
            if rng.random() * top <= self.rate(t):
                out.append(start + t)


def bench_fill(setup: FillSetup | None = None, info: StackInfo | None = None) -> dict[str, Any]:
    setup = setup or FillSetup()
    with local_stack(info) as info:
        asyncio.run(ensure_topics(info.bootstrap, shared_topic_specs()))
        report: dict[str, Any] = {
            "kind": "fill",
            "model": f"simulated accelerator: {setup.compute_ms:g} ms a batch + {setup.per_input_ms:g} ms an input, "
                     f"batches of {setup.max_batch}",
            "workers": setup.workers, "capacity_rps": round(setup.capacity_rps, 1), "seconds": setup.seconds,
            "interactive": {"valley_rps": round(setup.rate(0.0), 1), "priority": "p1",
                            "peak_rps": round(setup.rate(setup.seconds / 2), 1), "deadline_ms": setup.deadline_ms},
            "batch_requests": setup.batch_size(), "background_slice_ms": setup.slice_ms,
        }
        for key, label in RUNS:
            log(f"{label}: {setup.seconds:.0f} s")
            report[key] = asyncio.run(_run(info, setup, key))
            log(f"  {({k: v for k, v in report[key].items() if k != 'timeline'})}")
        busy = report["no_batch"]["busy_fraction"]
        for key in ("without_tier", "with_tier"):
            run = report[key]
            run["idle_used"] = round((run["busy_fraction"] - busy) / (1.0 - busy), 3) if busy < 1 else None
        return report


async def _run(info: StackInfo, setup: FillSetup, key: str) -> dict[str, Any]:
    model = f"bench-fill-{key.replace('_', '-')}-{uuid.uuid4().hex[:6]}"
    await ensure_topics(info.bootstrap, model_topic_specs(model, 2 * setup.workers))
    ports = [free_port() for _ in range(setup.workers)]
    workers = [
        spawn_worker(info, model, "--family", "noop", "--option", f"compute_ms={setup.compute_ms}",
                     "--option", f"per_input_ms={setup.per_input_ms}", "--max-batch-size", str(setup.max_batch),
                     "--background-slice-ms", str(setup.slice_ms), "--metrics-port", str(port),
                     log_path=os.path.join(info.home, f"bench-fill-{key}-{i}.log"))
        for i, port in enumerate(ports)
    ]
    try:
        async with Client(info.bootstrap, info.redis_url, tenant="bench", admission=False) as client:
            await wait_until_served(client, model)
            return await _measure(client, setup, key, model, ports)
    finally:
        for proc in workers:
            stop_process(proc)
        await delete_topics(info.bootstrap, request_topics(model))  # nobody serves it any more


async def _measure(client: Client, setup: FillSetup, key: str, model: str, ports: list[int]) -> dict[str, Any]:
    await asyncio.sleep(2.0)  # every worker has its partitions (the probe saw one)
    interactive: list[tuple[float, str, float]] = []  # (scheduled, outcome, latency ms)
    batch_done: list[tuple[str, float]] = []  # (outcome, seconds from the start)
    samples: list[tuple[float, float]] = []  # (monotonic, model seconds of the fleet so far)
    stop = asyncio.Event()
    start = submitted = time.monotonic()

    async def sample() -> None:
        while not stop.is_set():
            samples.append((time.monotonic(), _compute_s(ports)))
            await asyncio.sleep(0.5)

    async def one(_: None, scheduled: float) -> None:
        try:
            result = await client.infer(model, ["interactive request"], priority=Priority.P1,
                                        deadline_ms=setup.deadline_ms)
            outcome = "ok" if result.ok else result.status.value
        except KinferError as exc:
            outcome = type(exc).__name__
        interactive.append((scheduled, outcome, (time.monotonic() - scheduled) * 1000.0))

    async def batch_one(i: int, priority: Priority, deadline_ms: int) -> None:
        try:
            result = await client.infer(model, [f"batch line {i}"], priority=priority, deadline_ms=deadline_ms)
            outcome = "ok" if result.ok else result.status.value
        except KinferError as exc:
            outcome = type(exc).__name__
        batch_done.append((outcome, time.monotonic() - submitted))

    batch: list[asyncio.Task[None]] = []
    submitted = time.monotonic()
    if key != "no_batch":  # the whole batch on the broker before the day starts: the bench's own sends
        priority, deadline = ((Priority.P3, 86_400_000) if key == "with_tier" else (Priority.P2, 3_600_000))
        before = await _written(client, model, 2 * setup.workers)
        batch = [asyncio.create_task(batch_one(i, priority, deadline)) for i in range(setup.batch_size())]
        await _published(client, model, 2 * setup.workers, before + len(batch))
        # Tens of thousands of callers waiting: out of the cyclic collector's full scans, which would
        # otherwise stall this process (and charge the stall to interactive latency) now and then.
        gc.collect()
        gc.freeze()
    start = time.monotonic() + 0.5
    sampler = asyncio.create_task(sample())
    await fire([(at, None) for at in setup.schedule(start)], one)
    end = time.monotonic()
    with contextlib.suppress(TimeoutError):  # the batch's last answers, a while past the day at most
        await asyncio.wait_for(asyncio.gather(*batch), timeout=max(30.0, setup.seconds))
    stop.set()
    await sampler
    gc.unfreeze()
    return _summary(setup, start, end, interactive, batch_done, len(batch), samples, ports, key)


async def _written(client: Client, model: str, partitions: int) -> int:
    """Records ever written to the model's request topics."""
    parts = [TopicPartition(request_topic(model, p), i) for p in Priority for i in range(partitions)]
    async with offset_clients(client.settings.bootstrap) as (_, consumer):
        return sum((await consumer.end_offsets(parts)).values())


async def _published(client: Client, model: str, partitions: int, n: int) -> None:
    """Until the model's topics hold ``n`` records (every batch request sent)."""
    for _ in range(300):
        if await _written(client, model, partitions) >= n:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{model}: the batch never reached the broker")


def _compute_s(ports: list[int]) -> float:
    return sum(scrape(port).get("kinfer_compute_seconds_sum", 0.0) for port in ports)


def _busy(samples: list[tuple[float, float]], t0: float, t1: float, workers: int) -> float | None:
    inside = [(t, c) for t, c in samples if t0 <= t <= t1]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return (inside[-1][1] - inside[0][1]) / ((inside[-1][0] - inside[0][0]) * workers)


def _summary(setup: FillSetup, start: float, end: float, interactive: list[tuple[float, str, float]],
             batch_done: list[tuple[str, float]], batch_size: int, samples: list[tuple[float, float]],
             ports: list[int], key: str) -> dict[str, Any]:
    latencies = [ms for _, outcome, ms in interactive if outcome == "ok"]
    misses = sum(1 for _, outcome, ms in interactive if outcome != "ok" or ms > setup.deadline_ms)
    busy = _busy(samples, start, end, setup.workers)
    batch_ok = sum(1 for outcome, _ in batch_done if outcome == "ok")
    done_s = max((t for _, t in batch_done), default=None) if batch_size and batch_ok == batch_size else None
    longest = max((scrape(port).get("kinfer_background_wait_max_seconds", 0.0) for port in ports), default=0.0)
    timeline: dict[str, list[Any]] = {"t_s": [], "busy_fraction": [], "interactive_p99_ms": [],
                                      "interactive_rps": []}
    t = 0.0
    while t < setup.seconds:
        window = [ms for at, outcome, ms in interactive if t <= at - start < t + setup.bucket_s and outcome == "ok"]
        timeline["t_s"].append(round(t, 1))
        b = _busy(samples, start + t, start + t + setup.bucket_s, setup.workers)
        timeline["busy_fraction"].append(round(b, 3) if b is not None else None)
        timeline["interactive_p99_ms"].append(percentile_ms(window, 99) if window else None)
        timeline["interactive_rps"].append(round(len(window) / setup.bucket_s, 1))
        t += setup.bucket_s
    p95, p99 = percentile_ms(latencies, 95), percentile_ms(latencies, 99)
    return {
        "busy_fraction": round(busy, 3) if busy is not None else None,
        "interactive_offered": len(interactive),
        "interactive_p50_ms": percentile_ms(latencies, 50), "interactive_p95_ms": p95, "interactive_p99_ms": p99,
        "interactive_meets_sla": meets_sla(len(latencies) / max(1, len(interactive)), p95, p99),
        "deadline_misses": misses,
        "batch_requests": batch_size, "batch_ok": batch_ok,
        "batch_refused": dict(sorted(Counter(o for o, _ in batch_done if o != "ok").items())),
        "batch_done_s": round(done_s, 1) if done_s is not None else None,
        "batch_throughput_rps": round(batch_ok / done_s, 1) if done_s else None,
        "max_wait_behind_background_ms": round(longest * 1000.0, 1) if key == "with_tier" else None,
        "timeline": timeline,
    }


def plot_fill(report: dict[str, Any], path: str) -> str:
    """Busy fraction and interactive p99 over the day, one line per run."""
    plt = draw.pyplot()
    fig, (busy, p99) = plt.subplots(2, 1, figsize=(12, 8), sharex=True)
    for i, (key, label) in enumerate(RUNS):
        run = report.get(key)
        if not isinstance(run, dict):
            continue
        line = run["timeline"]
        busy.plot(line["t_s"], line["busy_fraction"], label=f"{label} (busy {draw.num(run['busy_fraction'])})",
                  color=draw.SERIES_COLOURS[i])
        p99.plot(line["t_s"], line["interactive_p99_ms"], color=draw.SERIES_COLOURS[i],
                 label=f"{label} (p99 {draw.num(run['interactive_p99_ms'])} ms)")
    busy.set_ylabel("busy fraction (model time / wall, per worker)")
    busy.set_ylim(0, 1.05)
    p99.set_ylabel("interactive p99 (ms)")
    p99.set_yscale("log")
    draw.sla_lines(p99, (SLA_P95_MS, SLA_P99_MS))
    p99.set_xlabel("seconds into the compressed day")
    for ax in (busy, p99):
        ax.legend(loc="upper right")
        ax.grid(alpha=0.3)
    draw.title(fig, f"kinfer bench fill: {report.get('model', '?')}; {report.get('workers')} workers, capacity "
                    f"{draw.num(report.get('capacity_rps'))}/s; batch of {draw.num(report.get('batch_requests'))}")
    return draw.save(fig, path)
