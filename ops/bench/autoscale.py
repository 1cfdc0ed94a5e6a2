"""``kinfer bench autoscale``: a traffic step served by the autoscaler, against static peak provisioning.

The model is a simulated accelerator (``noop`` with ``per_input_ms`` per input: batching buys
nothing, so one replica's capacity is one number, ~1000/per_input_ms records/s). The trace is open
loop, Poisson, with a time-varying rate: quiet, a step to ``step`` × quiet, a linear ramp back down,
quiet again. It is served twice on the same machine, one after the other:

- ``autoscaled``: ``kinfer autoscale``'s loop in local mode (real ``kinfer worker`` processes
  started and SIGTERMed), from ``min_replicas``;
- ``static_peak``: as many workers, all the time, as the same sizing rule gives for the peak rate
  at the per-replica capacity the autoscaler measured.

Per run: ``worker_seconds`` (worker processes alive, integrated over the trace; a draining worker
counts until it exits), ``p95_ms``/``p99_ms`` of every request answered ok (from its scheduled
send), ``sla_ok_fraction`` (requests outside the first scale-up answered ok within 250 ms: the P99
bound), ``lost`` (no answer at all by the deadline), ``scale_up_s`` (from the step until the
replicas reached the episode's peak and the predicted wait was back under 100 ms; the requests
of that span are the ones ``sla_ok_fraction`` leaves out); ``timeline``: the lag monitor's view
every half second (arrivals, lag, predicted wait) and the workers alive, as columns.
``plot_autoscale`` (below) draws them, both runs, from the report (``--plot``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kinfer.ops.bench import drawing as draw
from kinfer.ops.bench.harness import local_stack, log
from kinfer.ops.bench.load import fire
from kinfer.ops.capacity.sla import percentile_ms
from kinfer.ops.control.autoscaler import AutoscaleLoop
from kinfer.ops.control.lagmon import LagMonitor
from kinfer.ops.control.scaling import ScalePolicy
from kinfer.ops.localstack.pool import LocalPool
from kinfer.ops.localstack.procs import spawn, spawn_worker, stop_process, wait_until_served
from kinfer.ops.localstack.stack import StackInfo
from kinfer.producers import Client
from kinfer.topics import DeadlineExceeded, KinferError
from kinfer.topics.admin import delete_topics, ensure_topics, model_topic_specs, offset_clients, shared_topic_specs
from kinfer.topics.names import request_topics

SLA_MS = 250.0  # per request: the P99 bound
RECOVERED_WAIT_MS = 100.0


@dataclass(frozen=True, slots=True)
class Trace:
    quiet_rps: float = 30.0
    step: float = 5.0  # peak = step x quiet
    quiet_s: float = 90.0
    peak_s: float = 40.0
    ramp_s: float = 40.0  # linear, peak back to quiet
    tail_s: float = 90.0

    @property
    def duration_s(self) -> float:
        return self.quiet_s + self.peak_s + self.ramp_s + self.tail_s

    @property
    def peak_rps(self) -> float:
        return self.quiet_rps * self.step

    def rate_at(self, t: float) -> float:
        if t < self.quiet_s or t >= self.duration_s - self.tail_s:
            return self.quiet_rps
        if t < self.quiet_s + self.peak_s:
            return self.peak_rps
        done = (t - self.quiet_s - self.peak_s) / self.ramp_s
        return self.peak_rps + done * (self.quiet_rps - self.peak_rps)

    def arrivals(self, seed: int) -> list[float]:
        """Poisson arrivals at the time-varying rate (thinning), seconds from the start."""
        rng, t = random.Random(seed), 0.0
        out: list[float] = []
        top = max(self.quiet_rps, self.peak_rps)
        while True:
            t += rng.expovariate(top)
            if t >= self.duration_s:
                return out
            if rng.random() * top <= self.rate_at(t):
                out.append(t)


@dataclass(slots=True)
class Call:
    at: float  # scheduled, seconds from the trace's start
    kind: str  # ok, lost, or the error class name
    latency_ms: float


@dataclass
class Run:
    calls: list[Call] = field(default_factory=list)
    samples: list[dict[str, float]] = field(default_factory=list)  # t, arrival_rps, lag, wait_ms, replicas


def bench_autoscale(trace: Trace | None = None, per_input_ms: float = 10.0, policy: ScalePolicy | None = None,
                    deadline_ms: int = 30_000, seed: int = 7, compare: bool = True, plot: str | None = None,
                    info: StackInfo | None = None, partitions: int = 4) -> dict[str, Any]:
    """Runs on ``info`` when given (the caller's Kafka and Redis), else on the local stack; with
    ``plot``, draws the report into that PNG (``report["plot"]``)."""
    trace = trace or Trace()
    policy = policy or ScalePolicy(min_replicas=1, max_replicas=partitions, up_cooldown_s=5.0, down_cooldown_s=10.0,
                                   down_window_s=20.0, drain_s=5.0)
    tag = f"{os.getpid()}"
    models = (f"bench-autoscale-{tag}", f"bench-static-{tag}")
    with local_stack(info) as info:
        asyncio.run(ensure_topics(info.bootstrap, [*shared_topic_specs(),
                                                   *(s for m in models for s in model_topic_specs(m, partitions))]))
        telemetry = spawn(info, "telemetry", "--app-id", f"kinfer-telemetry-autoscale-{tag}", "--window-s", "5",
                          "--publish-s", "0.5", log_path=os.path.join(info.home, "bench-autoscale-telemetry.log"))
        try:
            worker_args = ["--family", "noop", "--option", f"per_input_ms={per_input_ms}"]
            report: dict[str, Any] = {
                "model": f"simulated accelerator, {per_input_ms:g} ms per input (batching buys nothing)",
                "trace": asdict(trace), "policy": asdict(policy), "deadline_ms": deadline_ms, "sla_ms": SLA_MS,
            }
            log_dir = Path(info.home) if Path(info.home).is_dir() else None  # an external stack has none
            _, auto, loop = asyncio.run(_autoscaled(info, models[0], trace, policy, worker_args, deadline_ms,
                                                    seed, log_dir))
            report["autoscaled"] = auto
            per = loop.scaler.replica_rps or 1000.0 / per_input_ms
            report["replica_rps_measured"] = round(per, 1)
            if compare:
                static_n = min(partitions, math.ceil(trace.peak_rps / (per * policy.target_utilisation)))
                _, static = asyncio.run(_static(info, models[1], trace, static_n, worker_args,
                                                deadline_ms, seed))
                report["static_peak"] = {**static, "replicas": static_n}
                report["worker_seconds_ratio"] = round(auto["worker_seconds"] / static["worker_seconds"], 3)
            if plot:
                report["plot"] = plot_autoscale(report, plot)
            return report
        finally:
            stop_process(telemetry)
            # The benchmark's models go with it: nobody serves them any more (a listing must not offer them).
            asyncio.run(delete_topics(info.bootstrap, [t for m in models for t in request_topics(m)]))


async def _autoscaled(info: StackInfo, model: str, trace: Trace, policy: ScalePolicy, worker_args: list[str],
                      deadline_ms: int, seed: int, log_dir: Path | None) -> tuple[Run, dict[str, Any], AutoscaleLoop]:
    pool = LocalPool(info, model, worker_args, log_dir)
    loop = AutoscaleLoop(info.bootstrap, info.redis_url, model, pool, policy, interval_s=0.5)
    stop = asyncio.Event()
    task = asyncio.create_task(loop.run(stop))
    try:
        run = await _serve(info, model, trace, deadline_ms, seed, lambda: len(pool.slots) + len(pool.stopping))
    finally:
        stop.set()
        await task
        await pool.close()
    summary = _summarize(run, trace, scale_up=True)
    summary["restarts"] = pool.restarts
    summary["workers_started"] = pool.started
    return run, summary, loop


async def _static(info: StackInfo, model: str, trace: Trace, n: int, worker_args: list[str], deadline_ms: int,
                  seed: int) -> tuple[Run, dict[str, Any]]:
    procs = [spawn_worker(info, model, *worker_args, log_path=os.path.join(info.home, f"bench-static-{i}.log"))
             for i in range(n)]
    try:
        run = await _serve(info, model, trace, deadline_ms, seed, lambda: sum(p.poll() is None for p in procs))
    finally:
        for proc in procs:
            stop_process(proc)
    return run, _summarize(run, trace, scale_up=False)


async def _serve(info: StackInfo, model: str, trace: Trace, deadline_ms: int, seed: int,
                 replicas: Callable[[], int]) -> Run:
    run = Run()
    async with Client(info.bootstrap, info.redis_url, tenant="bench", admission=False) as client:
        await wait_until_served(client, model)
        await asyncio.sleep(3.0)  # every worker of the static run in the group, the probe's lag gone
        stop = asyncio.Event()
        t0 = time.monotonic() + 0.5
        sampler = asyncio.create_task(_sample(info, model, t0, replicas, run.samples, stop))

        async def one(at: float, scheduled: float) -> None:
            try:
                await client.infer(model, ["autoscale"], deadline_ms=deadline_ms)
                kind = "ok"
            except DeadlineExceeded as exc:
                kind = "DeadlineExceeded" if exc.answered else "lost"
            except KinferError as exc:
                kind = type(exc).__name__
            run.calls.append(Call(at, kind, (time.monotonic() - scheduled) * 1000.0))

        log(f"{model}: {trace.duration_s:.0f} s of traffic")
        await fire([(t0 + at, at) for at in trace.arrivals(seed)], one)
        stop.set()
        await sampler
    return run


async def _sample(info: StackInfo, model: str, t0: float, replicas: Callable[[], int], into: list[dict[str, float]],
                  stop: asyncio.Event, interval_s: float = 0.5) -> None:
    """The lag monitor's view of the model, and the workers alive, every ``interval_s``."""
    monitor = LagMonitor(info.bootstrap, info.redis_url, models=[model], interval_s=interval_s)
    async with offset_clients(info.bootstrap) as (admin, consumer):
        while not stop.is_set():
            states = await monitor.poll(admin, consumer)
            if states:
                s = states[0]
                into.append({"t": round(time.monotonic() - t0, 3), "arrival_rps": s.arrival_rps, "lag": s.lag,
                             "wait_ms": s.predicted_wait_ms, "replicas": replicas()})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)


def _summarize(run: Run, trace: Trace, scale_up: bool) -> dict[str, Any]:
    samples = [s for s in run.samples if 0.0 <= s["t"] <= trace.duration_s]
    worker_s = sum(a["replicas"] * (b["t"] - a["t"]) for a, b in itertools.pairwise(samples))
    ok = [c.latency_ms for c in run.calls if c.kind == "ok"]
    end = _scale_up_end(samples, trace) if scale_up else trace.quiet_s
    outside = [c for c in run.calls if not trace.quiet_s <= c.at <= end] if end is not None else run.calls
    kinds: dict[str, int] = {}
    for c in run.calls:
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
    return {
        "offered": len(run.calls),
        "outcomes": dict(sorted(kinds.items())),
        "worker_seconds": round(worker_s, 1),
        "mean_replicas": round(worker_s / trace.duration_s, 2),
        "peak_replicas": max((s["replicas"] for s in samples), default=0),
        # [seconds into the trace, workers alive] at each change: 1 -> 3 -> 1 reads [[0, 1], [61.5, 2], ...]
        "replicas_over_time": [[s["t"], s["replicas"]] for i, s in enumerate(samples)
                               if i == 0 or s["replicas"] != samples[i - 1]["replicas"]],
        "p95_ms": percentile_ms(ok, 95), "p99_ms": percentile_ms(ok, 99),
        "sla_ok_fraction": round(sum(c.kind == "ok" and c.latency_ms <= SLA_MS for c in outside) / len(outside), 5)
        if outside else None,
        "lost": kinds.get("lost", 0),
        "scale_up_s": round(end - trace.quiet_s, 1) if scale_up and end is not None else None,
        "peak_lag": max((s["lag"] for s in samples), default=0),
        "timeline": timeline(run.samples),
    }


def timeline(samples: list[dict[str, float]]) -> dict[str, list[float | None]]:
    """The samples as columns (half the size of a list of objects), rounded; what ``plot_autoscale`` draws."""
    digits = {"t": 2, "arrival_rps": 1, "lag": 0, "wait_ms": 1, "replicas": 0}
    return {key: [_round(s[key], n) for s in samples] for key, n in digits.items()}


def _round(value: float, digits: int) -> float | None:
    if not math.isfinite(value):
        return None  # the report is strict JSON
    return int(value) if digits == 0 else round(value, digits)


def _scale_up_end(samples: list[dict[str, float]], trace: Trace) -> float | None:
    """After the step: when the replicas had reached the episode's peak and the wait was back in bounds."""
    episode = [s for s in samples if trace.quiet_s <= s["t"] < trace.quiet_s + trace.peak_s]
    if not episode:
        return None
    peak = max(s["replicas"] for s in episode)
    reached = next((s["t"] for s in episode if s["replicas"] >= peak), None)
    if reached is None:
        return None
    return next((s["t"] for s in episode if s["t"] >= reached and s["wait_ms"] <= RECOVERED_WAIT_MS), None)


# -- the picture ----------------------------------------------------------------------------------------


# The two runs of a report, as the picture names them.
RUNS = (("autoscaled", "autoscaled"), ("static_peak", "static peak"))


def plot_autoscale(report: dict[str, Any], path: str) -> str:
    """From each run's ``timeline`` (arrivals, lag, predicted wait, workers every half second) when
    the report has one; older reports have only ``replicas_over_time``: workers against the trace."""
    plt = draw.pyplot()
    from matplotlib.ticker import MaxNLocator

    trace = Trace(**report["trace"])
    runs = [(key, label) for key, label in RUNS if isinstance(report.get(key), dict)]
    full = all(isinstance(report[key].get("timeline"), dict) for key, _ in runs)
    panels = (("arrival_rps", "arrivals /s"), ("lag", "lag (records)"), ("wait_ms", "predicted wait (ms)"),
              ("replicas", "workers alive")) if full else (("arrival_rps", "offered /s"), ("replicas", "workers alive"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 2.5 * len(panels) + 0.5), sharex=True)
    grid = [i * 0.5 for i in range(int(trace.duration_s * 2) + 1)]
    axes[0].plot(grid, [trace.rate_at(x) for x in grid], "k:", label="offered (trace)")
    for i, (key, label) in enumerate(runs):
        run, colour = report[key], draw.SERIES_COLOURS[i]
        legend = (f"{label}: {draw.num(run.get('worker_seconds'))} worker-s, p95 {draw.num(run.get('p95_ms'))} / "
                  f"p99 {draw.num(run.get('p99_ms'))} ms")
        if full:
            line = run["timeline"]
            for ax, (column, _) in zip(axes, panels, strict=True):
                if column == "replicas":
                    ax.step(line["t"], line[column], where="post", label=legend, color=colour)
                else:
                    ax.plot(line["t"], line[column], label=label, color=colour)
        else:
            changes = run.get("replicas_over_time") or [[0.0, run.get("replicas", 0)]]
            ts = [float(t) for t, _ in changes] + [trace.duration_s]
            ns = [n for _, n in changes] + [changes[-1][1]]
            axes[-1].step(ts, ns, where="post", label=legend, color=colour)
    for ax, (_, label) in zip(axes, panels, strict=True):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    axes[-1].yaxis.set_major_locator(MaxNLocator(integer=True))
    if full:
        axes[2].set_yscale("symlog", linthresh=100)
    axes[-1].set_xlabel("seconds into the trace")
    ratio = report.get("worker_seconds_ratio")
    draw.title(fig, "kinfer bench autoscale: lag-driven autoscaling vs static peak provisioning"
                     + (f" (worker-seconds {ratio} of static)" if ratio is not None else ""))
    return draw.save(fig, path)
