"""``kinfer autoscale``: a model's workers follow its load, as local processes or a Deployment's replicas."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from pathlib import Path
from typing import Any

from kinfer.consumers.worker import WorkerSettings
from kinfer.ops.cli.common import (
    Command,
    add_metrics_args,
    add_settings_args,
    serve_metrics,
    settings_default,
    settings_from_args,
)
from kinfer.ops.cli.endpoints import endpoints
from kinfer.ops.control.scaling import ScalePolicy

SCALE_FLAGS = {
    "target_utilisation": "busy share a replica is sized for (the headroom for the tail)",
    "drain_s": "a backlog is cleared within this long, beside the arrivals",
    "max_wait_ms": "a queue that clears within this long is batching, not a backlog",
    "tolerance": "a load within this share of what the replicas carry at the target changes nothing",
    "up_cooldown_s": "at least this long between two scale-ups",
    "down_cooldown_s": "at least this long between any change and a scale-down",
    "down_window_s": "scale down only to the highest recommendation over this window (and to zero after it idle)",
    "smoothing_s": "time constant of the arrival rate's smoothing as it falls (it rises at once)",
    "replica_rps": "records/s one worker drains while busy, if known (0: measured from telemetry and offsets)",
    "background_within_s": "drain background (p3) records within this long, beside the arrivals (0: they never "
                           "scale a model up, only keep one worker)",
}


def add_arguments(a: argparse.ArgumentParser) -> None:
    a.add_argument("--model", required=True)
    a.add_argument("--min", dest="min_replicas", type=int, default=settings_default(ScalePolicy, "min_replicas"),
                   help="fewest workers (0: scale to zero when idle) [%(default)s]")
    a.add_argument("--max", dest="max_replicas", type=int, default=settings_default(ScalePolicy, "max_replicas"),
                   help="most workers (never more than a request topic's partitions) [%(default)s]")
    a.add_argument("--mode", choices=["local", "kubernetes"], default="local",
                   help="local: kinfer worker processes here; kubernetes: a Deployment's replicas [%(default)s]")
    a.add_argument("--emit", choices=["keda"], help="print the equivalent KEDA ScaledObject and exit")
    a.add_argument("--deployment", help="kubernetes: the workers' Deployment (default: kinfer-worker-MODEL)")
    a.add_argument("--namespace", default="default")
    a.add_argument("--kube-api", help="API server URL (default: in-cluster)")
    a.add_argument("--kube-token-file", default="/var/run/secrets/kubernetes.io/serviceaccount/token")
    a.add_argument("--kube-ca-file", default="/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")
    a.add_argument("--interval-s", type=float, default=1.0, help="one decision this often [%(default)s]")
    a.add_argument("--commit-interval-ms", type=float, default=settings_default(WorkerSettings, "commit_interval_ms"),
                   help="the workers' --commit-interval-ms [%(default)s]")
    a.add_argument("--log-dir", help="local: each worker's log goes here (default: discarded)")
    add_metrics_args(a)
    add_settings_args(a, ScalePolicy, SCALE_FLAGS)
    a.add_argument("worker_args", nargs=argparse.REMAINDER, help="-- then flags for each local worker")


def run(args: argparse.Namespace) -> int:
    from kinfer.ops.control.autoscaler import AutoscaleLoop, KubernetesPool, keda_scaled_object
    from kinfer.ops.localstack.pool import LocalPool
    from kinfer.ops.localstack.stack import StackInfo

    policy = ScalePolicy(min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                         **settings_from_args(args, SCALE_FLAGS))
    deployment = args.deployment or f"kinfer-worker-{args.model}"
    worker_args = args.worker_args[1:] if args.worker_args[:1] == ["--"] else args.worker_args
    if args.emit == "keda":
        import yaml

        bootstrap = os.environ.get("KINFER_BOOTSTRAP", "kafka:9092")
        print(yaml.safe_dump(keda_scaled_object(args.model, bootstrap, policy, deployment=deployment,
                                                namespace=args.namespace), sort_keys=False), end="")
        return 0
    bootstrap, redis_url = endpoints()
    pool: Any
    if args.mode == "kubernetes":
        pool = KubernetesPool(deployment, args.namespace, api=args.kube_api, token_file=args.kube_token_file,
                              ca_file=args.kube_ca_file)
    else:
        pool = LocalPool(StackInfo.external(bootstrap, redis_url), args.model, worker_args,
                         Path(args.log_dir) if args.log_dir else None)
    serve_metrics(args)
    loop = AutoscaleLoop(bootstrap, redis_url, args.model, pool, policy, interval_s=args.interval_s,
                         commit_interval_ms=args.commit_interval_ms)

    async def main() -> None:
        stop = asyncio.Event()
        running = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            running.add_signal_handler(sig, stop.set)
        try:
            await loop.run(stop)
        finally:
            await pool.close()  # local: every worker drains and stops; kubernetes: the Deployment stays

    asyncio.run(main())
    return 0


# With --emit it only prints (and takes no principal: main() skips a command's principal under --emit).
COMMAND = Command("autoscale", "a model's workers follow its load (consumer lag, arrival rate, capacity)",
                  add_arguments, run, principal="kinfer-autoscaler", service=True,
                  epilog="Arguments after -- go to every local worker, e.g. -- --family noop")
