"""``kinfer demo``: start everything, send a steady stream of requests, report latency, stop."""

from __future__ import annotations

import argparse

from kinfer.ops.cli.common import Command


def add_arguments(d: argparse.ArgumentParser) -> None:
    d.add_argument("--requests", type=int, default=300)
    d.add_argument("--rate", type=float, default=30.0, help="requests per second (open loop)")
    d.add_argument("--model", default="minilm")
    d.add_argument("--partitions", type=int, default=3)


def run(args: argparse.Namespace) -> int:
    from kinfer.ops.demo import run_demo

    return run_demo(requests=args.requests, rate=args.rate, model=args.model, partitions=args.partitions)


COMMAND = Command("demo", "start everything, send a steady stream of requests, report latency, stop", add_arguments,
                  run, principal="admin")
