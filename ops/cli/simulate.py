"""``kinfer simulate``: discrete-event simulation, the smallest fleet that meets the SLA at a rate."""

from __future__ import annotations

import argparse
import json
import sys

from kinfer.ops.capacity.simulate import SimConfig
from kinfer.ops.cli.common import Command, settings_default


def add_arguments(sm: argparse.ArgumentParser) -> None:
    sm.add_argument("--qps", type=float, default=25_000.0)
    sm.add_argument("--models", help="JSON/YAML: [{name, share, batch_ms | kind: generate, ...}] "
                                     "(default: embeddings 60 %%, classifier 30 %%, a small generator 10 %%)")
    sm.add_argument("--seconds", type=float, default=10.0, help="simulated seconds per run [%(default)s]")
    sm.add_argument("--transport-ms", type=float, default=settings_default(SimConfig, "transport_ms"),
                    help="send -> fetched by a worker [%(default)s]")
    sm.add_argument("--worker-cpu-ms", type=float, default=settings_default(SimConfig, "worker_cpu_ms"),
                    help="the worker's own CPU per request (kinfer bench transport) [%(default)s]")
    sm.add_argument("--brokers", type=int, default=settings_default(SimConfig, "brokers"))
    sm.add_argument("--broker-failover-s", type=float, default=settings_default(SimConfig, "broker_failover_s"))
    sm.add_argument("--session-timeout-s", type=float, default=settings_default(SimConfig, "session_timeout_s"))
    sm.add_argument("--no-admission", action="store_true", help="producers ignore the health signal")
    sm.add_argument("--seed", type=int, default=1)
    sm.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from kinfer.ops.capacity.simulate import load_models, size_fleet

    models = load_models(args.models)
    cfg = SimConfig(transport_ms=args.transport_ms, worker_cpu_ms=args.worker_cpu_ms, brokers=args.brokers,
                    broker_failover_s=args.broker_failover_s, session_timeout_s=args.session_timeout_s,
                    admission=not args.no_admission)
    report = size_fleet(models, args.qps, cfg, seconds=args.seconds, seed=args.seed,
                        log=lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(report, allow_nan=False))
        return 0
    together = report["together"]
    print(f"{args.qps:,.0f} requests/s: {report['total_workers']} workers "
          f"({', '.join(f'{m} {n}' for m, n in report['fleet'].items())}); "
          f"fleet p95 {together['fleet']['p95_ms']} ms, p99 {together['fleet']['p99_ms']} ms, "
          f"ok {together['fleet']['ok_fraction']:.4%}: {'meets' if report['meets_sla'] else 'MISSES'} the SLA")
    for fail in ("worker", "broker"):
        during = report[f"{fail}_failure"]["during_failure"]
        print(f"  one {fail} lost: requests sent in the next seconds p95 {during['p95_ms']} ms, "
              f"p99 {during['p99_ms']} ms, ok {during['ok_fraction']:.4%}")
    return 0


COMMAND = Command("simulate", "discrete-event simulation: the smallest fleet meeting the SLA at a rate", add_arguments,
                  run)
