"""``kinfer bench overload``: a surge of 3× a worker's capacity, with the health signal and without.

One worker serves a simulated accelerator whose cost is ``per_input_ms`` per input (batching buys
nothing, so capacity is one number). The benchmark measures that capacity closed loop, then runs the
same open-loop schedule twice: ``factor`` × capacity for ``surge_s`` seconds, then half the
capacity for ``normal_s``; priorities mixed p0 20 %, p1 50 %, p2 30 %, every request with the same
deadline. Once with the lag monitor running and clients obeying it, once with both switched off
(the workers' own deadline shedding and CoDel stay on in both runs). Per run:

- ``accepted`` / ``rejected``: enqueued, or refused by admission before enqueueing (``Overloaded``);
- ``lost``: accepted and never answered at all (a reply that came after its caller gave up counts
  as answered);
- ``accepted_p95_ms`` / ``accepted_p99_ms``: scheduled send to the final answer of every accepted
  request, whatever that answer was (served, shed, expired, or the client's own timeout);
- ``served_p99_ms``: the same, over the accepted requests that were served;
- ``deadline_misses``: accepted requests not served by their deadline;
- ``reject_p99_ms``: how long a refused caller waited to be told;
- ``recovery_s``: from the end of the surge until the lag is down to what the worker clears in
  100 ms; ``lag_zero_s``: until it is first zero (sampled every 100 ms);
- ``timeline``: per half second from the start of the surge, what was offered, refused, served in
  time and missed, and the lag (``plot_overload``, below, draws it).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kinfer.ops.bench import drawing as draw
from kinfer.ops.bench.harness import local_stack, log
from kinfer.ops.bench.load import fire
from kinfer.ops.capacity.sla import SLA_P95_MS, SLA_P99_MS, percentile, percentile_ms
from kinfer.ops.localstack.procs import spawn, spawn_worker, stop_process, wait_until_served
from kinfer.ops.localstack.stack import StackInfo
from kinfer.producers import Client
from kinfer.topics import DeadlineExceeded, KinferError, Overloaded, Priority, Shed
from kinfer.topics.admin import ensure_topics, model_topic_specs, offset_clients, read_offsets, shared_topic_specs
from kinfer.topics.health import Level

MODEL = "bench-overload"
NEIGHBOURS = ("bench-busy", "bench-quiet")  # co-located on one worker for the spike run
PRIORITY_MIX = ((Priority.P0, 0.2), (Priority.P1, 0.5), (Priority.P2, 0.3))


@dataclass(slots=True)
class Outcome:
    phase: str  # "surge" or "normal"
    priority: Priority
    kind: str  # ok, rejected, shed, expired, unanswered, or an error class name
    latency_ms: float  # from the scheduled send
    call_ms: float  # from the actual call (what a refused caller waited)
    at_s: float = 0.0  # the scheduled send, seconds from the start of the surge


def bench_overload(
    surge_s: float = 30.0, normal_s: float = 10.0, factor: float = 3.0, per_input_ms: float = 20.0,
    deadline_ms: int = 250, interval_s: float = 0.25, seed: int = 5, info: StackInfo | None = None,
    neighbour_s: float = 15.0,
) -> dict[str, Any]:
    """Runs on ``info`` when given (the caller's Kafka and Redis), else on the local stack."""
    with local_stack(info) as info:
        asyncio.run(ensure_topics(info.bootstrap, [*shared_topic_specs(), *model_topic_specs(MODEL, 3)]))
        # The telemetry stream tells the lag monitor the workers' capacity and service time.
        procs = [
            spawn(info, "telemetry", "--app-id", "kinfer-telemetry-bench", "--window-s", "5", "--publish-s", "0.5",
                  log_path=os.path.join(info.home, "bench-overload-telemetry.log")),
        ]
        try:
            procs.append(spawn_worker(info, MODEL, "--family", "noop", "--option", f"per_input_ms={per_input_ms}",
                                      log_path=os.path.join(info.home, "bench-overload.log")))
            return asyncio.run(_bench(info, surge_s, normal_s, factor, per_input_ms, deadline_ms, interval_s, seed,
                                      neighbour_s))
        finally:
            for proc in procs:
                stop_process(proc)


async def _bench(
    info: StackInfo, surge_s: float, normal_s: float, factor: float, per_input_ms: float, deadline_ms: int,
    interval_s: float, seed: int, neighbour_s: float,
) -> dict[str, Any]:
    async with Client(info.bootstrap, info.redis_url, tenant="bench", admission=False) as probe:
        await wait_until_served(probe, MODEL)
        capacity = await _capacity(probe, seconds=8.0)
    log(f"capacity {capacity:.1f}/s; surge {factor * capacity:.0f}/s for {surge_s:.0f} s, "
         f"then {capacity / 2:.0f}/s for {normal_s:.0f} s")
    report: dict[str, Any] = {
        "model": f"simulated accelerator, {per_input_ms:g} ms per input (batching buys nothing)",
        "capacity_rps": round(capacity, 1), "surge_rps": round(factor * capacity, 1), "surge_s": surge_s,
        "normal_rps": round(capacity / 2, 1), "normal_s": normal_s, "deadline_ms": deadline_ms,
        "priority_mix": {p.label: share for p, share in PRIORITY_MIX}, "lagmon_interval_s": interval_s,
    }
    for name, backpressure in (("with_backpressure", True), ("without_backpressure", False)):
        await _wait_drained(info)
        log(name)
        report[name] = await _run(info, backpressure, capacity, factor, surge_s, normal_s, deadline_ms,
                                  interval_s, seed)
        log(f"  {report[name]}")
    if neighbour_s > 0:
        log("neighbours: a 10x spike on one of two co-located models")
        report["neighbours"] = await _neighbour(info, neighbour_s, 10.0, per_input_ms)
    return report


async def _neighbour(info: StackInfo, seconds: float, spike: float, per_input_ms: float) -> dict[str, Any]:
    """Two models co-located on one worker: the quiet one's latency while the other spikes ``spike``×.

    Each model normally gets a fifth of the worker's capacity; then, for the same length of time,
    the busy one is offered ``spike`` times that (twice the whole worker). Admission is on.
    """
    await ensure_topics(info.bootstrap, [*model_topic_specs(NEIGHBOURS[0], 3), *model_topic_specs(NEIGHBOURS[1], 3)])
    proc = spawn_worker(info, NEIGHBOURS[0], "--model", NEIGHBOURS[1], "--family", "noop",
                        "--option", f"per_input_ms={per_input_ms}",
                        log_path=os.path.join(info.home, "bench-overload-neighbours.log"))
    busy, quiet = NEIGHBOURS
    normal = 1000.0 / per_input_ms / 5
    monitor = _spawn_lagmon(info, NEIGHBOURS, 0.25)
    try:
        async with Client(info.bootstrap, info.redis_url, tenant="bench") as client:
            await wait_until_served(client, busy)
            await wait_until_served(client, quiet)
            # Starting the worker stalled the queue for a moment; start once the monitor says so.
            await _until(lambda: all((h := client.health(m)) is not None and h.level == Level.OK
                                     for m in NEIGHBOURS), timeout_s=60.0)
            phases: dict[str, dict[str, Any]] = {}
            for phase, busy_rate in (("baseline", normal), ("spike", spike * normal)):
                latencies: dict[str, list[float]] = {busy: [], quiet: []}
                refused = {busy: 0, quiet: 0}

                async def one(model: str, scheduled: float, into: dict[str, list[float]] = latencies,
                              refusals: dict[str, int] = refused) -> None:
                    try:
                        await client.infer(model, ["neighbour"], priority=Priority.P1, deadline_ms=1_000)
                        into[model].append((time.monotonic() - scheduled) * 1000.0)
                    except KinferError:
                        refusals[model] += 1

                rng = random.Random(len(phases))
                t0 = time.monotonic() + 0.1
                plan = sorted([(at, busy) for at, _, _ in _schedule(rng, busy_rate, seconds, t0, phase)]
                              + [(at, quiet) for at, _, _ in _schedule(rng, normal, seconds, t0, phase)])
                await fire(plan, one)
                phases[phase] = {
                    "busy_offered_rps": round(busy_rate, 1), "quiet_offered_rps": round(normal, 1),
                    "quiet_p95_ms": round(percentile(latencies[quiet], 95), 1),
                    "quiet_p99_ms": round(percentile(latencies[quiet], 99), 1),
                    "quiet_refused": refused[quiet], "busy_served": len(latencies[busy]), "busy_refused": refused[busy],
                }
                log(f"  {phase}: {phases[phase]}")
                await _wait_drained(info, busy)
    finally:
        stop_process(monitor)
        stop_process(proc)
    return {"spike_factor": spike, **phases}


async def _capacity(client: Client, seconds: float, concurrency: int = 16) -> float:
    """Requests/s served with ``concurrency`` callers always waiting: the worker never idles."""
    done = 0
    end = time.monotonic() + seconds

    async def caller() -> None:
        nonlocal done
        while time.monotonic() < end:
            with contextlib.suppress(KinferError):
                await client.infer(MODEL, ["capacity probe"], deadline_ms=30_000)
                done += 1

    start = time.monotonic()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return done / (time.monotonic() - start)


def _schedule(
    rng: random.Random, rate: float, seconds: float, start: float, phase: str
) -> list[tuple[float, str, Priority]]:
    out: list[tuple[float, str, Priority]] = []
    at = start
    while True:
        at += rng.expovariate(rate)
        if at >= start + seconds:
            return out
        priority = rng.choices([p for p, _ in PRIORITY_MIX], weights=[w for _, w in PRIORITY_MIX])[0]
        out.append((at, phase, priority))


async def _run(
    info: StackInfo, backpressure: bool, capacity: float, factor: float, surge_s: float, normal_s: float,
    deadline_ms: int, interval_s: float, seed: int,
) -> dict[str, Any]:
    stop = asyncio.Event()
    monitor = _spawn_lagmon(info, (MODEL,), interval_s) if backpressure else None  # its own process, as deployed
    lags: list[tuple[float, int]] = []
    sampler = asyncio.create_task(_sample_lag(info, lags, stop))
    outcomes: list[Outcome] = []
    try:
        async with Client(info.bootstrap, info.redis_url, tenant="bench", admission=backpressure) as client:
            if backpressure:  # the client obeys a signal from its first request
                await _until(lambda: client.health(MODEL) is not None, timeout_s=30.0)

            async def one(item: tuple[str, Priority], scheduled: float) -> None:
                phase, priority = item
                called = time.monotonic()
                try:
                    await client.infer(MODEL, [f"{phase} request"], priority=priority, deadline_ms=deadline_ms)
                    kind = "ok"
                except Overloaded:
                    kind = "rejected"
                except Shed:
                    kind = "shed"
                except DeadlineExceeded as exc:
                    kind = "expired" if exc.answered else "unanswered"
                except KinferError as exc:
                    kind = type(exc).__name__
                end = time.monotonic()
                outcomes.append(Outcome(phase, priority, kind, (end - scheduled) * 1000.0, (end - called) * 1000.0,
                                        scheduled - t0))

            rng = random.Random(seed)
            t0 = time.monotonic() + 0.2
            plan = _schedule(rng, factor * capacity, surge_s, t0, "surge")
            plan += _schedule(rng, capacity / 2, normal_s, t0 + surge_s, "normal")
            await fire([(at, (phase, priority)) for at, phase, priority in plan], one)
            await _wait_drained(info)
            await asyncio.sleep(1.0)  # replies that come after their caller gave up are counted as late
            late = client.late_replies
    finally:
        stop.set()
        await sampler
        if monitor is not None:
            stop_process(monitor)
    summary = _summarize(outcomes, lags, t0 + surge_s, late, deadline_ms, capacity)
    summary["timeline"] = timeline(outcomes, [(t - t0, lag) for t, lag in lags], deadline_ms)
    return summary


def timeline(outcomes: list[Outcome], lags: list[tuple[float, int]], deadline_ms: int,
              bucket_s: float = 0.5) -> dict[str, Any]:
    """Per ``bucket_s`` of scheduled sends from the start of the surge: requests offered, refused at
    admission, served in time, and accepted but missed (the three add up to offered); the highest
    lag sampled in the bucket (``lags`` in seconds from the same start). ``plot_overload`` draws it."""
    end = max([o.at_s for o in outcomes] + [t for t, _ in lags] + [0.0])
    n = math.floor(end / bucket_s) + 1
    columns: dict[str, list[int]] = {k: [0] * n for k in ("offered", "rejected", "served_in_time", "missed", "lag")}
    for o in outcomes:
        i = min(n - 1, max(0, math.floor(o.at_s / bucket_s)))
        columns["offered"][i] += 1
        if o.kind == "rejected":
            columns["rejected"][i] += 1
        elif o.kind != "ok" or o.latency_ms > deadline_ms:  # as _summarize counts a deadline miss
            columns["missed"][i] += 1
        else:
            columns["served_in_time"][i] += 1
    for t, lag in lags:
        if t >= 0:
            i = min(n - 1, math.floor(t / bucket_s))
            columns["lag"][i] = max(columns["lag"][i], lag)
    return {"bucket_s": bucket_s, "t_s": [round(i * bucket_s, 3) for i in range(n)], **columns}


def _summarize(
    outcomes: list[Outcome], lags: list[tuple[float, int]], surge_end: float, late: int, deadline_ms: int,
    capacity: float,
) -> dict[str, Any]:
    accepted = [o for o in outcomes if o.kind != "rejected"]
    rejected = [o for o in outcomes if o.kind == "rejected"]
    unanswered = sum(o.kind == "unanswered" for o in accepted)
    def missed(o: Outcome) -> bool:
        return o.kind != "ok" or o.latency_ms > deadline_ms

    misses = [o for o in accepted if missed(o)]
    settled = max(1, round(capacity * 0.1))  # what the worker clears in 100 ms
    recovered = next((t for t, lag in lags if t >= surge_end and lag <= settled), None)
    emptied = next((t for t, lag in lags if t >= surge_end and lag == 0), None)

    by_priority = {
        p.label: {
            "offered": sum(o.priority == p for o in outcomes),
            "accepted": sum(o.priority == p for o in accepted),
            "served_in_time": sum(o.priority == p and not missed(o) for o in accepted),
            "deadline_misses": sum(o.priority == p for o in misses),
        }
        for p, _ in PRIORITY_MIX
    }
    return {
        "offered": len(outcomes),
        "accepted": len(accepted),
        "rejected": len(rejected),
        "lost": max(0, unanswered - late),
        "accepted_p95_ms": percentile_ms([o.latency_ms for o in accepted], 95),
        "accepted_p99_ms": percentile_ms([o.latency_ms for o in accepted], 99),
        "served_p99_ms": percentile_ms([o.latency_ms for o in accepted if o.kind == "ok"], 99),
        "deadline_misses": len(misses),
        "reject_p99_ms": percentile_ms([o.call_ms for o in rejected], 99),
        "recovery_s": round(recovered - surge_end, 2) if recovered is not None else None,
        "lag_zero_s": round(emptied - surge_end, 2) if emptied is not None else None,
        "served_in_time": len(accepted) - len(misses),
        "peak_lag": max((lag for _, lag in lags), default=0),
        # The load generator's own lateness (actual call - scheduled send): latencies above count from
        # the schedule, so a generator that falls behind is charged, not hidden.
        "send_lag_p99_ms": percentile_ms([o.latency_ms - o.call_ms for o in outcomes], 99),
        "outcomes": dict(sorted({k: sum(o.kind == k for o in outcomes) for k in {o.kind for o in outcomes}}.items())),
        "by_priority": by_priority,
    }


async def _sample_lag(info: StackInfo, into: list[tuple[float, int]], stop: asyncio.Event, model: str = MODEL) -> None:
    async with offset_clients(info.bootstrap) as (admin, consumer):
        while not stop.is_set():
            offsets = await read_offsets(admin, consumer, model)
            if offsets is not None:
                into.append((time.monotonic(), sum(offsets.lag)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)


async def _wait_drained(info: StackInfo, model: str = MODEL, timeout_s: float = 120.0) -> None:
    """Until the model's lag is zero (what a run left behind must not leak into the next)."""
    lags: list[tuple[float, int]] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_lag(info, lags, stop, model))
    try:
        await _until(lambda: bool(lags) and lags[-1][1] == 0, timeout_s)
    finally:
        stop.set()
        await sampler


def _spawn_lagmon(info: StackInfo, models: tuple[str, ...], interval_s: float) -> subprocess.Popen[bytes]:
    args = [a for m in models for a in ("--model", m)]
    return spawn(info, "lagmon", *args, "--interval-s", str(interval_s),
                 log_path=os.path.join(info.home, "bench-overload-lagmon.log"))


async def _until(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout_s:.0f} s")
        await asyncio.sleep(0.05)


# -- the picture ----------------------------------------------------------------------------------------


# The two runs of a report, as the picture names them.
RUNS = (("with_backpressure", "with backpressure"), ("without_backpressure", "without"))


def plot_overload(report: dict[str, Any], path: str) -> str:
    """The surge with and without backpressure (over time where the report has a timeline), outcomes,
    latencies against the deadline, each priority, the co-located neighbours."""
    plt = draw.pyplot()
    runs = [(key, label) for key, label in RUNS if isinstance(report.get(key), dict)]
    timelines = [(key, label) for key, label in runs if isinstance(report[key].get("timeline"), dict)]
    rows = (2 if timelines else 0) + 2
    fig = plt.figure(figsize=(13, 4.2 * rows))
    grid = fig.add_gridspec(rows, 2)
    row = 0
    if timelines:
        shared = None
        for col, (key, label) in enumerate(timelines):
            ax = fig.add_subplot(grid[0, col], sharey=shared)
            shared = shared or ax
            _draw_timeline(ax, report, report[key]["timeline"], label)
        lag = fig.add_subplot(grid[1, :])
        for i, (key, label) in enumerate(timelines):
            line = report[key]["timeline"]
            lag.plot(line["t_s"], line["lag"], label=label, color=draw.SERIES_COLOURS[i])
        _surge_span(lag, report)
        lag.set_ylabel("lag (records waiting)")
        lag.set_xlabel("seconds from the start of the surge")
        lag.legend(loc="upper right")
        lag.grid(alpha=0.3)
        row = 2
    _draw_outcomes(fig.add_subplot(grid[row, 0]), report, runs)
    _draw_latency(fig.add_subplot(grid[row, 1]), report, runs)
    _draw_priorities(fig.add_subplot(grid[row + 1, 0]), report, runs)
    _draw_neighbours(fig.add_subplot(grid[row + 1, 1]), report)
    draw.title(fig, f"kinfer bench overload: {report.get('model', '?')}; "
                     f"capacity {draw.num(report.get('capacity_rps'))}/s, "
                     f"surge {draw.num(report.get('surge_rps'))}/s for {draw.num(report.get('surge_s'))} s, then "
                     f"{draw.num(report.get('normal_rps'))}/s for {draw.num(report.get('normal_s'))} s; deadline "
                     f"{report.get('deadline_ms', '?')} ms")
    return draw.save(fig, path)


def _draw_timeline(ax: Any, report: dict[str, Any], line: dict[str, Any], label: str) -> None:
    bucket_s = float(line.get("bucket_s") or 1.0)
    per_s = [[n / bucket_s for n in line[k]] for k in ("served_in_time", "missed", "rejected")]
    ax.stackplot(line["t_s"], *per_s, step="post", colors=("#2ca02c", "#d62728", "#c7c7c7"),
                 labels=("served in time", "accepted, missed its deadline", "refused at admission"))
    _surge_span(ax, report)
    ax.set_title(f"{label}: requests by scheduled send (stacked: what was offered)")
    ax.set_ylabel("requests/s")
    ax.set_xlabel("seconds from the start of the surge")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)


def _surge_span(ax: Any, report: dict[str, Any]) -> None:
    if isinstance(report.get("surge_s"), int | float):
        ax.axvspan(0, report["surge_s"], color="orange", alpha=0.08, lw=0)
        ax.axvline(report["surge_s"], color="orange", ls="--", lw=1)


def _draw_outcomes(ax: Any, report: dict[str, Any], runs: list[tuple[str, str]]) -> None:
    labels = [label for _, label in runs]
    parts = (("served_in_time", "served in time", "#2ca02c"), ("deadline_misses", "accepted, missed", "#d62728"),
             ("rejected", "refused at admission", "#c7c7c7"))
    bottom = [0.0] * len(runs)
    for key, name, colour in parts:
        values = [float(report[r].get(key) or 0) for r, _ in runs]
        ax.bar(labels, values, bottom=bottom, label=name, color=colour)
        for x, (v, b) in enumerate(zip(values, bottom, strict=True)):
            if v:
                ax.annotate(f"{v:,.0f}", (x, b + v / 2), ha="center", va="center", fontsize=8)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, (r, _) in enumerate(runs):
        ax.annotate(f"lost {report[r].get('lost', '?')}, peak lag {report[r].get('peak_lag', '?')}",
                    (x, bottom[x]), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8)
    ax.set_ylim(0, max([*bottom, 1.0]) * 1.3)
    ax.set_ylabel("requests")
    ax.set_title("every request offered, by outcome")
    ax.legend(loc="upper center", fontsize=8, ncols=3)


def _draw_latency(ax: Any, report: dict[str, Any], runs: list[tuple[str, str]]) -> None:
    metrics = (("accepted_p95_ms", "accepted p95"), ("accepted_p99_ms", "accepted p99"),
               ("reject_p99_ms", "refusal told, p99"))
    width = 0.8 / max(1, len(runs))
    for i, (key, label) in enumerate(runs):
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(metrics))]
        ax.bar(xs, [report[key].get(k) or 0.0 for k, _ in metrics], width, label=label, color=draw.SERIES_COLOURS[i])
    draw.label_bars(ax, fmt="{:.1f}")
    if isinstance(report.get("deadline_ms"), int | float):
        ax.axhline(report["deadline_ms"], color="black", ls="--", lw=1, label=f"deadline {report['deadline_ms']} ms")
    ax.set_xticks(range(len(metrics)), [label for _, label in metrics])
    ax.set_ylabel("ms from the scheduled send")
    ax.set_title("latency of accepted requests; how fast a refusal is told")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def _draw_priorities(ax: Any, report: dict[str, Any], runs: list[tuple[str, str]]) -> None:
    priorities = sorted({p for r, _ in runs for p in report[r].get("by_priority", {})})
    width = 0.8 / max(1, len(runs))
    for i, (key, label) in enumerate(runs):
        by = report[key].get("by_priority", {})
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(priorities))]
        shares = [by.get(p, {}).get("served_in_time", 0) / max(1, by.get(p, {}).get("offered", 0)) for p in priorities]
        ax.bar(xs, shares, width, label=label, color=draw.SERIES_COLOURS[i])
        for x, p, share in zip(xs, priorities, shares, strict=True):
            row = by.get(p, {})
            ax.annotate(f"{row.get('served_in_time', 0)}/{row.get('offered', 0)}", (x, share), xytext=(0, 2),
                        textcoords="offset points", ha="center", fontsize=7)
    mix = report.get("priority_mix", {})
    ax.set_xticks(range(len(priorities)), [f"{p} ({mix[p]:.0%} of offered)" if p in mix else p for p in priorities])
    ax.set_ylim(0, 1.15)
    ax.set_ylabel("served in time / offered")
    ax.set_title("each priority: share served within its deadline")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def _draw_neighbours(ax: Any, report: dict[str, Any]) -> None:
    phases = report.get("neighbours")
    if not isinstance(phases, dict):
        ax.text(0.5, 0.5, "no neighbour run in this report", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    names = [p for p in ("baseline", "spike") if isinstance(phases.get(p), dict)]
    for i, (key, label) in enumerate((("quiet_p95_ms", "p95"), ("quiet_p99_ms", "p99"))):
        xs = [j + (i - 0.5) * 0.38 for j in range(len(names))]
        ax.bar(xs, [phases[n].get(key) or 0.0 for n in names], 0.38, label=f"quiet model {label}",
               color=draw.SERIES_COLOURS[i])
    draw.label_bars(ax, fmt="{:.0f}")
    draw.sla_lines(ax, (SLA_P95_MS, SLA_P99_MS))
    ticks = []
    for n in names:
        ph = phases[n]
        ticks.append(f"{n}: neighbour offered {draw.num(ph.get('busy_offered_rps'))}/s\n"
                     f"(refused {ph.get('busy_refused', '?')}; quiet refused {ph.get('quiet_refused', '?')})")
    ax.set_xticks(range(len(names)), ticks, fontsize=8)
    ax.set_ylabel("ms")
    ax.set_title(f"co-located: the quiet model while its neighbour spikes {draw.num(phases.get('spike_factor'))}x")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
