"""Open-loop load: requests go out on a schedule, whatever the system does with them.

Latency is measured from each request's *scheduled* send time, so a system that falls behind is
charged for the queueing it causes (no coordinated omission).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kinfer.ops.capacity.sla import percentile
from kinfer.producers import Client
from kinfer.topics import KinferError, Priority, Result

T = TypeVar("T")

@dataclass(slots=True)
class Outcome:
    latency_ms: float  # scheduled send → result (or error)
    status: str  # result status, or the error class name
    result: Result | None = None


@dataclass(slots=True)
class LoadReport:
    outcomes: list[Outcome] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "ok"]

    def summary(self) -> dict[str, float | int]:
        lat = [o.latency_ms for o in self.ok]
        batch = [o.result.timings.batch_size for o in self.ok if o.result]
        return {
            "requests": len(self.outcomes),
            "ok": len(lat),
            "p50_ms": round(percentile(lat, 50), 1),
            "p95_ms": round(percentile(lat, 95), 1),
            "p99_ms": round(percentile(lat, 99), 1),
            "max_ms": round(max(lat, default=math.nan), 1),
            "rps": round(len(lat) / self.elapsed_s, 1) if self.elapsed_s else 0.0,
            "mean_batch": round(sum(batch) / len(batch), 2) if batch else 0.0,
        }

    def statuses(self) -> Counter[str]:
        return Counter(o.status for o in self.outcomes)


async def fire(schedule: Sequence[tuple[float, T]], one: Callable[[T, float], Awaitable[None]]) -> None:
    """Start ``one(item, at)`` at each ``(at, item)`` of ``schedule`` (``time.monotonic()``, in
    order), without waiting for earlier ones; return when all have finished."""
    tasks: list[asyncio.Task[None]] = []
    for at, item in schedule:
        delay = at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(item, at)))  # type: ignore[arg-type]
    await asyncio.gather(*tasks)


async def paced(
    items: Sequence[T], rate: float, one: Callable[[T, float], Awaitable[None]], *, poisson: bool = False,
    seed: int = 11,
) -> float:
    """Start ``one(item, scheduled_at)`` for each item on schedule (evenly spaced, or Poisson arrivals
    at ``rate``), without waiting for earlier ones; returns the seconds until all have finished.
    ``scheduled_at`` is on ``time.monotonic()``: measure latency from it."""
    rng = random.Random(seed)
    start = at = time.monotonic()
    schedule = []
    for item in items:
        schedule.append((at, item))
        at += rng.expovariate(rate) if poisson else 1.0 / rate
    await fire(schedule, one)
    return time.monotonic() - start


async def open_loop(
    client: Client,
    model: str,
    texts: Sequence[str],
    rate: float,
    *,
    poisson: bool = False,
    priority: Priority = Priority.P1,
    deadline_ms: int = 10_000,
    seed: int = 11,
) -> LoadReport:
    """Send one request per text through the client library, on schedule."""
    report = LoadReport()

    async def one(text: str, scheduled: float) -> None:
        try:
            result = await client.infer(model, [text], priority=priority, deadline_ms=deadline_ms)
            outcome = Outcome(0.0, result.status.value, result)
        except KinferError as exc:
            outcome = Outcome(0.0, type(exc).__name__)
        outcome.latency_ms = (time.monotonic() - scheduled) * 1000.0
        report.outcomes.append(outcome)

    report.elapsed_s = await paced(texts, rate, one, poisson=poisson, seed=seed)
    return report
