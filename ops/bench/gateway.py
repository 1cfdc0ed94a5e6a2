"""``kinfer bench serve``: does kinfer hand the model the machine, or keep the cores for itself?

Two measurements in one run, on the same texts (5–60 words):

1. **The model alone**, in process, no transport: for each layout (processes × torch threads ×
   batch size) the sequences per second the runner does back to back; the best layout is what the
   hardware can give this model.
2. **kinfer through the HTTP gateway**: workers laid out like the best layout, the gateway, the
   broker and Redis, all on the same machine, open-loop Poisson load swept upward; the highest rate
   meeting P95 < 150 ms, P99 < 250 ms with at most 1 % errors.

``ratio`` = (2) / (1): the share of the model's own capacity kinfer delivers as a service.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from typing import Any

from kinfer.ops.bench import drawing as draw
from kinfer.ops.bench.harness import local_stack, log, wait_http, wait_served
from kinfer.ops.bench.loadgen import LoadGen, sweep
from kinfer.ops.bench.texts import make_texts
from kinfer.ops.capacity.sla import SLA_MIN_OK, SLA_P95_MS, SLA_P99_MS
from kinfer.ops.localstack.procs import spawn, spawn_worker, stop_process
from kinfer.ops.localstack.stack import StackInfo, free_port
from kinfer.topics.admin import ensure_topics, model_topic_specs, shared_topic_specs

# (processes, threads each, batch size) × runtime: the layouts the model alone is tried in.
LAYOUTS = ((1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, 8))
RUNTIMES = ("torch", "onnx")
TEXT_WORDS = (5, 60)


def _alone_process(model: str, runtime: str, threads: int, batch: int, seconds: float) -> None:
    """One process of the model-alone measurement: loads, says so, waits for "go", prints seq/s."""
    from kinfer.consumers.runners import BatchRunner, build_runner, resolve_model
    from kinfer.consumers.runners.base import set_threads

    runner: BatchRunner = build_runner(resolve_model(model, options={"runtime": runtime}))  # type: ignore[assignment]
    set_threads(threads)
    runner.load()
    runner.warmup()
    texts = make_texts(1024, *TEXT_WORDS, seed=os.getpid())
    print(json.dumps({"ready": getattr(runner, "runtime", "torch")}), flush=True)
    sys.stdin.readline()  # every process of a layout starts together
    done, i, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        runner.run([texts[(i + k) % len(texts)] for k in range(batch)])
        done += batch
        i += batch
    print(json.dumps({"seq_per_s": done / (time.perf_counter() - t0)}), flush=True)


def model_alone(model: str, seconds: float) -> dict[str, float]:
    """Sequences/s of each layout (all its processes together), by runtime."""
    out: dict[str, float] = {}
    for runtime in RUNTIMES:
        for procs, threads, batch in LAYOUTS:
            cmd = [sys.executable, "-m", "kinfer.ops.bench.gateway", "alone", model, runtime, str(threads), str(batch),
                   str(seconds)]
            children = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                        for _ in range(procs)]
            served = {json.loads(c.stdout.readline())["ready"] for c in children}  # type: ignore[union-attr]
            for child in children:
                child.stdin.write("go\n")  # type: ignore[union-attr]
                child.stdin.flush()  # type: ignore[union-attr]
            rates = [json.loads(child.communicate()[0])["seq_per_s"] for child in children]
            name = f"{runtime}:{procs}x{threads}t-b{batch}"
            out[name] = round(sum(rates), 1)
            log(f"  alone {name}: {out[name]} seq/s (served by {', '.join(sorted(served))})")
    return out


def bench_serve(model: str = "minilm", alone_seconds: float = 8.0, seconds_per_step: float = 10.0,
                fractions: tuple[float, ...] = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0),
                partitions: int = 6) -> dict[str, Any]:
    """``partitions`` per request topic: a multiple of the worker count, or the group splits unevenly
    (3 partitions over 2 workers: one serves twice the other's load).

    Through the gateway, up to three worker layouts are tried: the model's best layout alone, its best
    single-process layout (which leaves cores to the transport), and, when the best layout is several
    processes, one worker with as many executors (``-eN``: one queue for all of them, where N workers
    split the traffic by partition into N queues); the best one counts.
    """
    log("the model alone")
    alone = model_alone(model, alone_seconds)
    best = max(alone, key=lambda k: alone[k])
    single = max((k for k in alone if k.split(":")[1].startswith("1x")), key=lambda k: alone[k])
    report: dict[str, Any] = {
        "model": model, "texts": f"{TEXT_WORDS[0]}-{TEXT_WORDS[1]} words, Poisson arrivals", "cpus": os.cpu_count(),
        "sla": {"p95_ms": SLA_P95_MS, "p99_ms": SLA_P99_MS, "min_ok": SLA_MIN_OK}, "partitions": partitions,
        "model_alone_seq_per_s": alone, "model_alone_best_rps": alone[best], "model_alone_config": best,
        "through_gateway": {},
    }
    with local_stack() as info:
        runtime, shape = best.split(":")
        procs = int(shape.split("x")[0])
        shared = [f"{runtime}:1x{shape.split('x', 1)[1]}-e{procs}"] if procs > 1 else []
        for layout in dict.fromkeys([best, single, *shared]):
            rate, steps = _through_gateway(info, model, layout, alone[best], fractions, seconds_per_step, partitions)
            report["through_gateway"][layout] = {"max_rps_at_sla": rate, "steps": steps}
    chosen = max(report["through_gateway"], key=lambda k: report["through_gateway"][k]["max_rps_at_sla"])
    report["gateway_config"] = chosen
    report["gateway_max_rps_at_sla"] = report["through_gateway"][chosen]["max_rps_at_sla"]
    report["ratio"] = round(report["gateway_max_rps_at_sla"] / alone[best], 3)
    return report


def _through_gateway(info: StackInfo, model: str, layout: str, alone_best: float, fractions: tuple[float, ...],
                     seconds: float, partitions: int) -> tuple[float, list[dict[str, Any]]]:
    """Workers in ``layout`` (e.g. ``onnx:2x1t-b1``), a gateway, and the open-loop sweep through it."""
    runtime, shape = layout.split(":")
    procs, threads = int(shape.split("x")[0]), int(shape.split("x")[1].split("t")[0])
    executors = int(shape.split("-e")[1]) if "-e" in shape else 1
    log(f"through the gateway: {layout} ({procs} worker(s) x {executors} executor(s) x {threads} thread(s))")
    swept = sweep_gateway(info, model, ["--threads", str(threads), "--workers-per-host", str(procs),
                                        "--runtime", runtime, "--executors", str(executors)],
                          procs, tuple(round(alone_best * f, 1) for f in fractions), seconds, partitions,
                          warmup_rps=alone_best * 0.2)
    return float(swept["max_rps_at_sla"]), swept["steps"]


def sweep_gateway(info: StackInfo, model: str, worker_flags: list[str], workers: int, rates: tuple[float, ...],
                  seconds: float, partitions: int, *, warmup_rps: float, warmup_s: float = 5.0) -> dict[str, Any]:
    """``workers`` workers of ``model`` started with ``worker_flags`` (none: the defaults a user gets),
    a gateway, and ``sweep`` through it over HTTP on 5-60-word texts after a warm-up."""
    import asyncio

    from kinfer.consumers.runners import resolve_model

    served = f"bench-serve-{model}"
    asyncio.run(ensure_topics(info.bootstrap, [*shared_topic_specs(), *model_topic_specs(served, partitions)]))
    spec = resolve_model(model)
    flags = ["--family", spec.family, *(["--path", spec.path] if spec.path else []), *worker_flags]
    procs = [spawn_worker(info, served, *flags, log_path=os.path.join(info.home, f"bench-serve-worker{i}.log"))
             for i in range(workers)]
    gateway = None
    try:
        asyncio.run(wait_served(info, served))
        port = free_port()
        gateway = spawn(info, "gateway", "--port", str(port), log_path=os.path.join(info.home, "bench-serve-gw.log"))
        url = f"http://127.0.0.1:{port}"
        wait_http(url)
        gen = LoadGen(info, "http", served, os.path.join(info.home, "bench-serve-loadgen.log"), url=url,
                      extra=["--texts", f"{TEXT_WORDS[0]},{TEXT_WORDS[1]}"])
        pids = {"client": gen.proc.pid, "gateway": gateway.pid, "broker": info.kafka_pid, "redis": info.redis_pid,
                **{f"worker{i}": w.pid for i, w in enumerate(procs)}}
        try:
            gen.step(warmup_rps, warmup_s, seed=99)  # warm-up, not counted
            return sweep(gen, pids, rates, seconds, min_ok=SLA_MIN_OK)
        finally:
            gen.close()
    finally:
        for proc in [gateway, *procs]:
            if proc is not None:
                stop_process(proc)


# -- the picture ----------------------------------------------------------------------------------------


def plot_serve(report: dict[str, Any], path: str) -> str:
    """The model alone in each layout next to kinfer through the gateway (max rate at the SLA), and
    latency against rate per gateway layout."""
    plt = draw.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5), width_ratios=(1, 1.2))
    alone = sorted(report.get("model_alone_seq_per_s", {}).items(), key=lambda kv: kv[1])
    gateway = sorted(((k, v.get("max_rps_at_sla") or 0.0) for k, v in report.get("through_gateway", {}).items()),
                     key=lambda kv: kv[1])
    labels = [f"alone: {_layout(k)}" for k, _ in alone] + [f"gateway: {_layout(k)}" for k, _ in gateway]
    values = [v for _, v in alone] + [v for _, v in gateway]
    colours = ["#1f77b4" if k.startswith("torch") else "#17becf" for k, _ in alone] + ["#ff7f0e"] * len(gateway)
    left.barh(range(len(values)), values, color=colours)
    left.set_yticks(range(len(values)), labels, fontsize=8)
    for y, v in enumerate(values):
        left.annotate(f"{v:g}", (v, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    left.set_xlim(0, max([*values, 1.0]) * 1.12)
    left.set_xlabel("the model alone: sequences/s; through the gateway: max requests/s at the SLA")
    left.grid(axis="x", alpha=0.3)
    steps = {f"{_layout(k)} ({draw.at_sla(v.get('max_rps_at_sla'))})": v.get("steps", [])
             for k, v in report.get("through_gateway", {}).items()}
    draw.latency_vs_rate(right, steps, draw.report_sla(report),
                         maxima=[v.get("max_rps_at_sla") for v in report.get("through_gateway", {}).values()])
    right.set_title("through the gateway: latency against offered rate")
    ratio = report.get("ratio")
    draw.title(fig, f"kinfer bench serve: {report.get('model', '?')} on {report.get('cpus', '?')} CPUs: through "
                     f"the gateway {draw.num(report.get('gateway_max_rps_at_sla'))} req/s = {draw.num(ratio)} of the "
                     f"model alone ({draw.num(report.get('model_alone_best_rps'))} seq/s)")
    return draw.save(fig, path)


def _layout(name: str) -> str:
    """``onnx:2x1t-b1-e2`` -> ``onnx 2 proc x 1 thread, batch 1, 2 executors`` (else the name as it is)."""
    m = re.fullmatch(r"(\w+):(\d+)x(\d+)t-b(\d+)(?:-e(\d+))?", name)
    if m is None:
        return name
    runtime, procs, threads, batch, executors = m.groups()
    text = f"{runtime} {procs} proc x {threads} thread{'s' if threads != '1' else ''}, batch {batch}"
    return text + (f", {executors} executors" if executors else "")


if __name__ == "__main__" and len(sys.argv) == 7 and sys.argv[1] == "alone":
    _alone_process(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]))
