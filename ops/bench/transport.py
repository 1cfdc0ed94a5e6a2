"""``kinfer bench transport``: what the pipeline itself costs, per request and per process.

A no-op model (no compute), so everything measured is kinfer's own work: the client (the load
generator's process), the worker, the Kafka broker, Redis and, on the HTTP path, the gateway. Each
runs in its own process, and each one's CPU time is read from ``/proc/<pid>/stat`` before and after
every step. The rate is swept upward (open loop, Poisson) until a step misses the SLA:
P95 < 150 ms, P99 < 250 ms and at least 99.9 % answered ok.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from typing import Any

from kinfer.ops.bench import drawing as draw
from kinfer.ops.bench.harness import local_stack, log, wait_http, wait_served
from kinfer.ops.bench.loadgen import LoadGen, sweep
from kinfer.ops.bench.otlp_sink import OtlpSink
from kinfer.ops.capacity.sla import SLA_P95_MS, SLA_P99_MS
from kinfer.ops.localstack.procs import spawn, spawn_worker, stop_process
from kinfer.ops.localstack.stack import free_port
from kinfer.topics.admin import ensure_topics, model_topic_specs, shared_topic_specs

SLA_MIN_OK = 0.999
MODEL = "bench-transport"
LIBRARY_RATES = (500.0, 1000.0, 2000.0, 3000.0, 4000.0, 5000.0, 6000.0, 8000.0)
HTTP_RATES = (500.0, 1000.0, 1500.0, 2000.0, 2500.0, 3000.0, 4000.0)
PATHS = ("library", "http")  # through the client library; through the HTTP gateway


def bench_transport(
    seconds: float = 10.0, library_rates: tuple[float, ...] = LIBRARY_RATES,
    http_rates: tuple[float, ...] = HTTP_RATES, paths: tuple[str, ...] = PATHS,
    partitions: int = 3, worker_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    report: dict[str, Any] = {
        "model": "noop (no compute: the pipeline alone)", "seconds_per_step": seconds, "cpus": os.cpu_count(),
        "sla": {"p95_ms": SLA_P95_MS, "p99_ms": SLA_P99_MS, "min_ok": SLA_MIN_OK},
    }
    with local_stack() as info:
        home = info.home
        worker = gateway = None
        try:
            asyncio.run(ensure_topics(info.bootstrap, [*shared_topic_specs(), *model_topic_specs(MODEL, partitions)]))
            metrics_port = free_port()
            worker = spawn_worker(info, MODEL, "--family", "noop", "--metrics-port", str(metrics_port), *worker_args,
                                  log_path=os.path.join(home, "bench-transport-worker.log"))
            asyncio.run(wait_served(info, MODEL))
            base = {"worker": worker.pid, "broker": info.kafka_pid, "redis": info.redis_pid}
            if "library" in paths:
                log("library path")
                gen = LoadGen(info, "library", MODEL, os.path.join(home, "bench-transport-loadgen.log"))
                try:
                    report["library"] = sweep(gen, {"client": gen.proc.pid, **base}, library_rates, seconds,
                                              min_ok=SLA_MIN_OK, metrics_port=metrics_port)
                finally:
                    gen.close()
            if "http" in paths:
                log("http path")
                port = free_port()
                gateway = spawn(info, "gateway", "--port", str(port),
                                log_path=os.path.join(home, "bench-transport-gateway.log"))
                url = f"http://127.0.0.1:{port}"
                wait_http(url)
                gen = LoadGen(info, "http", MODEL, os.path.join(home, "bench-transport-loadgen.log"), url=url)
                try:
                    pids = {"client": gen.proc.pid, "gateway": gateway.pid, **base}
                    report["http"] = sweep(gen, pids, http_rates, seconds, min_ok=SLA_MIN_OK,
                                           metrics_port=metrics_port)
                finally:
                    gen.close()
        finally:
            for proc in (gateway, worker):
                if proc is not None:
                    stop_process(proc)
    return report


# -- tracing's cost ---------------------------------------------------------------------------------------

TRACE_RATES = {"library": 2000.0, "http": 1000.0}  # well inside the SLA on two cores, on and off
TRACE_ENV = ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG")


@contextlib.contextmanager
def _traced_env(ratio: float | None, endpoint: str) -> Iterator[None]:
    """The processes started inside export sampled traces to ``endpoint`` (None: tracing off)."""
    saved = {name: os.environ.pop(name, None) for name in TRACE_ENV}
    if ratio is not None:
        os.environ.update({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                           "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": str(ratio)})
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def compare_tracing(ratio: float, seconds: float = 10.0, paths: tuple[str, ...] = PATHS, rounds: int = 2,
                    partitions: int = 3, rates: dict[str, float] | None = None) -> dict[str, Any]:
    """CPU per request with tracing off and sampled at ``ratio``, side by side in one run: per path, at
    one rate, every process started afresh for each configuration (off, on, off, on, ...: a drift of the
    box shows as a difference between rounds). Spans go over OTLP/HTTP to a receiver in this process
    (a collector's work is not kinfer's, so its CPU is not counted)."""
    rates = {**TRACE_RATES, **(rates or {})}
    report: dict[str, Any] = {"model": "noop (no compute: the pipeline alone)", "trace_ratio": ratio,
                              "seconds_per_step": seconds, "cpus": os.cpu_count(), "rounds": rounds}
    with OtlpSink(keep=False) as sink, local_stack() as info:
        home = info.home
        asyncio.run(ensure_topics(info.bootstrap, [*shared_topic_specs(), *model_topic_specs(MODEL, partitions)]))
        for path in paths:
            runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
            for i in range(rounds):
                for mode in ("off", "on"):
                    before = sink.received
                    with _traced_env(ratio if mode == "on" else None, sink.endpoint):
                        step = _one_step(info, home, path, rates[path], seconds, seed=100 * i)
                    step["spans_received"] = sink.received - before
                    runs[mode].append(step)
                    log(f"  {path} tracing {mode}: cpu/req={step['cpu_ms_per_request']} p95={step['p95_ms']} "
                        f"spans={step['spans_received']}")
            off = _mean_cpu(runs["off"])
            on = _mean_cpu(runs["on"])
            report[path] = {"rate": rates[path], "off": runs["off"], "on": runs["on"],
                            "cpu_ms_per_request_off": off, "cpu_ms_per_request_on": on,
                            "on_over_off": round(on["total"] / off["total"], 4)}
            log(f"{path}: tracing at {ratio:g} costs {100 * (on['total'] / off['total'] - 1):+.1f} % CPU a request")
    return report


def _one_step(info: Any, home: str, path: str, rate: float, seconds: float, seed: int) -> dict[str, Any]:
    """Fresh processes (worker, gateway on the HTTP path, load generator) as the environment says; a
    warm-up step, then one measured step at ``rate``."""
    procs: list[Any] = []
    gen = None
    try:
        metrics_port = free_port()
        worker = spawn_worker(info, MODEL, "--family", "noop", "--metrics-port", str(metrics_port),
                              log_path=os.path.join(home, "bench-transport-worker.log"))
        procs.append(worker)
        asyncio.run(wait_served(info, MODEL))
        pids = {"worker": worker.pid, "broker": info.kafka_pid, "redis": info.redis_pid}
        url = ""
        if path == "http":
            port = free_port()
            gateway = spawn(info, "gateway", "--port", str(port),
                            log_path=os.path.join(home, "bench-transport-gateway.log"))
            procs.append(gateway)
            url = f"http://127.0.0.1:{port}"
            wait_http(url)
            pids["gateway"] = gateway.pid
        gen = LoadGen(info, path, MODEL, os.path.join(home, "bench-transport-loadgen.log"), url=url)
        gen.step(rate, min(3.0, seconds), seed=seed + 1)  # connections, metadata, first batches
        swept = sweep(gen, {"client": gen.proc.pid, **pids}, (rate,), seconds, min_ok=SLA_MIN_OK,
                      metrics_port=metrics_port)
        return dict(swept["steps"][-1])
    finally:
        if gen is not None:
            gen.close()
        for proc in reversed(procs):
            stop_process(proc)


def _mean_cpu(steps: list[dict[str, Any]]) -> dict[str, float]:
    names = {name for step in steps for name in step["cpu_ms_per_request"]}
    return {name: round(sum(s["cpu_ms_per_request"].get(name, 0.0) for s in steps) / len(steps), 4)
            for name in sorted(names)}


# -- the picture ----------------------------------------------------------------------------------------


# One colour per process wherever CPU is stacked; unknown processes (worker0, ...) take the next free.
PROCESS_COLOURS = {"client": "#1f77b4", "gateway": "#9467bd", "worker": "#ff7f0e", "broker": "#2ca02c",
                   "redis": "#d62728"}


def plot_transport(report: dict[str, Any], path: str) -> str:
    """P95 and P99 against the offered rate, per path, with the SLA lines; under it the CPU per
    request of each process (stacked) at each rate step, library and HTTP."""
    plt = draw.pyplot()
    paths = [p for p in PATHS if isinstance(report.get(p), dict)]
    fig = plt.figure(figsize=(12, 8.5))
    grid = fig.add_gridspec(2, len(paths), height_ratios=(1.1, 1))
    ax = fig.add_subplot(grid[0, :])
    series = {f"{p} ({draw.at_sla(report[p].get('max_rps_at_sla'))})": report[p]["steps"] for p in paths}
    draw.latency_vs_rate(ax, series, draw.report_sla(report), maxima=[report[p].get("max_rps_at_sla") for p in paths])
    ax.set_title("latency against offered rate (filled: the step met the SLA; x: an earlier try at that rate)")
    shared = None
    for i, name in enumerate(paths):
        bars = fig.add_subplot(grid[1, i], sharey=shared)
        shared = shared or bars
        _cpu_bars(bars, report[name]["steps"])
        bars.set_title(f"{name}: CPU per request by process (hatched: missed the SLA)")
    draw.title(fig, f"kinfer bench transport: {report.get('model', 'noop')}, "
                     f"{report.get('seconds_per_step', '?')} s a step, {report.get('cpus', '?')} CPUs")
    return draw.save(fig, path)


def plot_tracing(report: dict[str, Any], path: str) -> str:
    """CPU per request by process, tracing off and sampled, each round and path side by side."""
    plt = draw.pyplot()
    paths = [p for p in PATHS if isinstance(report.get(p), dict)]
    fig, axes = plt.subplots(1, len(paths), figsize=(6 * len(paths), 5), squeeze=False, sharey=True)
    for ax, name in zip(axes[0], paths, strict=True):
        runs = report[name]
        steps = [{**step, "rate": f"{mode} {i + 1}", "attempt": 1}
                 for i in range(len(runs["off"])) for mode in ("off", "on") for step in [runs[mode][i]]]
        _cpu_bars(ax, steps)
        ax.set_xlabel("tracing off / on (sampled), round")
        ax.set_title(f"{name} at {runs['rate']:g}/s: on/off = {runs['on_over_off']:.3f}")
    draw.title(fig, f"kinfer bench transport --trace-ratio {report.get('trace_ratio')}: CPU per request "
                    f"({report.get('seconds_per_step', '?')} s a step, {report.get('cpus', '?')} CPUs)")
    return draw.save(fig, path)


def _cpu_bars(ax: Any, steps: list[dict[str, Any]]) -> None:
    """CPU ms per request of each process, stacked, one bar per rate step (retries included)."""
    steps = sorted(steps, key=lambda s: (s["rate"], s.get("attempt", 1)))
    processes: list[str] = []
    for step in steps:
        for name in step.get("cpu_ms_per_request") or {}:
            if name != "total" and name not in processes:
                processes.append(name)
    order = list(PROCESS_COLOURS)
    processes.sort(key=lambda p: (order.index(_base(p)) if _base(p) in order else len(order), p))
    spare = iter(c for c in draw.SERIES_COLOURS[5:] * 4)
    colours = {p: PROCESS_COLOURS.get(p) or next(spare) for p in processes}
    xs = list(range(len(steps)))
    bottom = [0.0] * len(steps)
    for name in processes:
        values = [float((s.get("cpu_ms_per_request") or {}).get(name) or 0.0) for s in steps]
        hatches = ["" if s.get("meets_sla") else "//" for s in steps]
        bars = ax.bar(xs, values, bottom=bottom, color=colours[name], label=name)
        for bar, hatch in zip(bars, hatches, strict=True):
            bar.set_hatch(hatch)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, total in zip(xs, bottom, strict=True):
        ax.annotate(f"{total:.2f}", (x, total), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=7)
    ax.set_xticks(xs, [format(s["rate"], "g" if isinstance(s["rate"], float | int) else "")
                       + (f"\ntry {s['attempt']}" if s.get("attempt", 1) > 1 else "")
                       for s in steps], fontsize=8)
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("CPU ms per request answered")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(axis="y", alpha=0.3)


def _base(process: str) -> str:
    return process.rstrip("0123456789")
