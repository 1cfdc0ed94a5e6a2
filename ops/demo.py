"""``make demo``: the whole pipeline on a real broker and Redis, started and stopped here.

Besides the worker, the lag monitor and the telemetry stream run as their own processes, as they
would be deployed; the demo ends with what ``kinfer status`` shows, then the latency summary.
"""

from __future__ import annotations

import asyncio
import os
import signal

import redis.asyncio as aioredis

from kinfer.ops.bench.harness import local_stack
from kinfer.ops.bench.load import LoadReport, open_loop
from kinfer.ops.bench.texts import make_texts
from kinfer.ops.control.status import render, snapshot
from kinfer.ops.localstack.procs import spawn, spawn_worker, stop_process, wait_until_served
from kinfer.ops.localstack.stack import StackInfo
from kinfer.producers import Client
from kinfer.topics.admin import ensure_topics, model_topic_specs, shared_topic_specs


def print_report(report: LoadReport) -> None:
    ok = [o for o in report.ok if o.result]
    print(f"\nstatuses: {dict(report.statuses())}")
    if ok:
        def mean(xs: list[float]) -> float:
            return sum(xs) / len(xs)

        print(
            "inside the worker (mean ms): "
            f"queue {mean([o.result.timings.queue_ms for o in ok if o.result]):.1f}, "
            f"batch wait {mean([o.result.timings.batch_wait_ms for o in ok if o.result]):.1f}, "
            f"compute {mean([o.result.timings.compute_ms for o in ok if o.result]):.1f}"
        )
        sizes = sorted({o.result.timings.batch_size for o in ok if o.result})
        print(f"batch sizes seen: {sizes}")
    s = report.summary()
    print(
        f"requests={s['requests']} ok={s['ok']} p50_ms={s['p50_ms']} p95_ms={s['p95_ms']} "
        f"p99_ms={s['p99_ms']} rps={s['rps']}"
    )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_demo(requests: int, rate: float, model: str, partitions: int) -> int:
    signal.signal(signal.SIGTERM, _interrupt)  # a killed demo still stops what it started
    with local_stack(say=print) as info:
        procs = []
        try:
            asyncio.run(ensure_topics(info.bootstrap, [*shared_topic_specs(), *model_topic_specs(model, partitions)]))
            log_path = os.path.join(info.home, f"demo-worker-{model}.log")
            procs.append(spawn_worker(info, model, log_path=log_path))
            print(f"worker for {model} starting (log: {log_path})")
            procs.append(spawn(info, "lagmon", "--model", model, log_path=os.path.join(info.home, "demo-lagmon.log")))
            procs.append(spawn(info, "telemetry", "--app-id", "kinfer-telemetry-demo",
                               log_path=os.path.join(info.home, "demo-telemetry.log")))
            print("lag monitor and telemetry stream starting")
            report = asyncio.run(_drive(info, model, requests, rate))
            print("\nkinfer status:")
            print(asyncio.run(_status(info)))
            print_report(report)
            # Success is every request answered: on a busy machine a few may be shed, and say so.
            return 0 if len(report.outcomes) == requests else 1
        finally:
            for proc in procs:
                stop_process(proc)


async def _status(info: StackInfo) -> str:
    redis = aioredis.Redis.from_url(info.redis_url)
    try:
        return render(await snapshot(redis))
    finally:
        await redis.aclose()


async def _drive(info: StackInfo, model: str, requests: int, rate: float) -> LoadReport:
    async with Client(info.bootstrap, info.redis_url, tenant="demo") as client:
        await wait_until_served(client, model)
        print(f"sending {requests} requests of 5-120 words at {rate:g}/s")
        report = await open_loop(client, model, make_texts(requests), rate)
        await asyncio.sleep(2.0)  # the telemetry stream publishes its summary every second
        return report
