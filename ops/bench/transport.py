"""``kinfer bench transport``: what the pipeline itself costs, per request and per process.

A no-op model (no compute), so everything measured is kinfer's own work: the client (the load
generator's process), the worker, the Kafka broker, Redis and, on the HTTP path, the gateway. Each
runs in its own process, and each one's CPU time is read from ``/proc/<pid>/stat`` before and after
every step. The rate is swept upward (open loop, Poisson) until a step misses the SLA:
P95 < 150 ms, P99 < 250 ms and at least 99.9 % answered ok.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from kinfer.ops.bench.harness import SLA_P95_MS, SLA_P99_MS, local_stack, log, wait_http, wait_served
from kinfer.ops.bench.loadgen import LoadGen, sweep
from kinfer.ops.localstack.procs import spawn, spawn_worker, stop_process
from kinfer.ops.localstack.stack import free_port
from kinfer.topics.admin import ensure_topics, model_topic_specs, shared_topic_specs

SLA_MIN_OK = 0.999
MODEL = "bench-transport"
LIBRARY_RATES = (500.0, 1000.0, 2000.0, 3000.0, 4000.0, 5000.0, 6000.0, 8000.0)
HTTP_RATES = (500.0, 1000.0, 1500.0, 2000.0, 2500.0, 3000.0, 4000.0)


def bench_transport(
    seconds: float = 10.0, library_rates: tuple[float, ...] = LIBRARY_RATES,
    http_rates: tuple[float, ...] = HTTP_RATES, paths: tuple[str, ...] = ("library", "http"),
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
