"""``kinfer telemetry``: the telemetry stream processor (faust), windowed per-model tables."""

from __future__ import annotations

import argparse

from kinfer.ops.cli.common import Command, add_metrics_args, serve_metrics
from kinfer.ops.cli.endpoints import endpoints


def add_arguments(tl: argparse.ArgumentParser) -> None:
    tl.add_argument("--window-s", type=int, default=10, help="tumbling window length, whole seconds")
    tl.add_argument("--publish-s", type=float, default=1.0, help="how often summaries go to Redis")
    tl.add_argument("--app-id", default="kinfer-telemetry", help="consumer group and changelog topic prefix")
    add_metrics_args(tl)


def run(args: argparse.Namespace) -> int:
    from kinfer.ops.control.telemetry import run as run_processor

    bootstrap, redis_url = endpoints()
    serve_metrics(args)
    run_processor(bootstrap, redis_url, window_s=args.window_s, publish_s=args.publish_s, app_id=args.app_id,
                  loglevel="debug" if args.verbose else "warning")
    return 0


COMMAND = Command("telemetry", "the telemetry stream processor (faust): windowed per-model tables", add_arguments,
                  run, principal="kinfer-telemetry", service=True)
