"""``kinfer lagmon``: consumer lag -> health state per model, published for producers to obey."""

from __future__ import annotations

import argparse
import asyncio
import signal

from kinfer.consumers.worker import WorkerSettings
from kinfer.ops.cli.common import Command, add_metrics_args, serve_metrics, settings_default
from kinfer.ops.cli.endpoints import endpoints


def add_arguments(m: argparse.ArgumentParser) -> None:
    m.add_argument("--model", action="append", default=[], help="models to watch (default: all)")
    m.add_argument("--interval-s", type=float, default=0.5)
    m.add_argument("--commit-interval-ms", type=float, default=settings_default(WorkerSettings, "commit_interval_ms"),
                   help="the workers' --commit-interval-ms: that much answered traffic is lag, not queue [%(default)s]")
    m.add_argument("--no-answered", action="store_true",
                   help="count queues from committed offsets alone, not also from the positions workers report "
                        "answered (a commit stall then reads as a stopped model)")
    add_metrics_args(m)


def run(args: argparse.Namespace) -> int:
    from kinfer.ops.control.estimator import HealthPolicy
    from kinfer.ops.control.lagmon import LagMonitor

    bootstrap, redis_url = endpoints()
    monitor = LagMonitor(bootstrap, redis_url, models=args.model or None, interval_s=args.interval_s,
                         policy=HealthPolicy(commit_interval_ms=args.commit_interval_ms), answered=not args.no_answered)
    serve_metrics(args)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await monitor.run(stop)

    asyncio.run(main())
    return 0


COMMAND = Command("lagmon", "consumer lag → health state per model, published for producers to obey", add_arguments,
                  run, principal="kinfer-lagmon", service=True)
