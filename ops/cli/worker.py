"""``kinfer worker``: serve one or more models from their request topics."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
from typing import Any

from kinfer.batcher import BatchPolicy
from kinfer.consumers.runners.registry import BUILTIN, FAMILIES
from kinfer.consumers.worker import WorkerSettings
from kinfer.ops.cli.common import Command, add_settings_args, settings_from_args
from kinfer.ops.cli.endpoints import endpoints

log = logging.getLogger(__name__)

# Flags generated from settings classes: the class holds each default (one source), the CLI the help.
POLICY_FLAGS = {
    "max_batch_size": "inputs per forward pass",
    "max_batch_tokens": "padded tokens per forward pass",
    "max_wait_ms": "--mode window: how long the oldest request waits for its batch (<= 100)",
    "mode": "dynamic: work-conserving, cost-aware; window: the naive fixed window (a baseline)",
    "aging_ms": "a wait that raises a request one priority level",
    "max_padding_ratio": "padded/real tokens a batch may reach (length bucketing)",
    "codel_target_ms": "acceptable standing-queue sojourn (inf: CoDel off)",
    "codel_interval_ms": "how long a standing queue must last before CoDel sheds",
    "background_slice_ms": "background work (p3) runs in batches predicted to take at most this: what an "
                           "interactive request arriving meanwhile may wait for it",
    "background_max_busy": "background work runs only while interactive work keeps the model busy less than this "
                           "share of the time",
}
WORKER_FLAGS = {
    "device": "auto: CUDA when torch sees a GPU, else CPU",
    "threads": "torch intra-op threads (default: CPUs in this process's affinity - 1, / --workers-per-host)",
    "workers_per_host": "workers sharing this host's CPUs",
    "executors": "model calls in flight at once from one queue "
                 "(default: on CPU, embedding/classifier models, the CPUs over --threads; else 1)",
    "max_buffered_inputs": "inputs held in memory per model before its partitions pause",
    "fetch_max_wait_ms": "how long the broker holds a fetch that has no records yet",
    "commit_interval_ms": "commits are coalesced: at most one round this often (a crash replays at most this much)",
    "session_timeout_ms": "group liveness: a killed worker's partitions move after this",
    "instance_id": "static group membership id (a restart rejoins without a rebalance)",
    "fair_quantum_ms": "co-located models: compute per turn, and the longest batch one may run",
    "drain_timeout_s": "on SIGTERM, finish buffered work for at most this long",
    "careful_records": "after a partition's owner stopped without handing it over, its next records are worked "
                       "alone, one at a time, so a record that stops workers is dead-lettered after two (0: off)",
    "metrics_port": "serve Prometheus metrics on this port",
    "metrics_host": "address the metrics endpoint binds (0.0.0.0 in a container)",
    "tenants": "tenants file (the gateway's): refuse requests of unlisted tenants or above their priority "
               "ceiling (needs KINFER_SIGNING_SECRET, with which every request must be signed)",
    "memory_budget": "GiB of device memory for weights: models beyond it are registered, swapped in when their "
                     "records wait (default: every model resident)",
    "host_memory_budget": "GiB of host RAM for weights swapped off the device (0: they go back to disk)",
    "keep_warm": "never swap out a model with this many warm replicas or fewer in the fleet, this worker included",
    "swap_quantum_s": "a model with work keeps the device this long before a waiting one may take its place",
    "prefetch_lag": "records waiting for a model other workers have warm before this one swaps it in too "
                    "(a cold model: the first)",
}


def add_arguments(w: argparse.ArgumentParser) -> None:
    w.add_argument("--model", action="append", required=True,
                   help=f"served name (repeat to co-locate models); built-in: {', '.join(BUILTIN)}")
    w.add_argument("--family", choices=FAMILIES, help="runner family for models that are not built in")
    w.add_argument("--path", help="Hugging Face model directory")
    w.add_argument("--option", action="append", default=[], help="runner option key=value (repeatable)")
    w.add_argument("--weight", action="append", default=[], help="fair-share weight MODEL=W (default 1)")
    w.add_argument("--footprint", action="append", default=[],
                   help="declared device footprint MODEL=GIB for --memory-budget (weights and KV cache; default: "
                        "the weight files' size, then the weights measured once loaded)")
    add_settings_args(w, BatchPolicy, POLICY_FLAGS)
    add_settings_args(w, WorkerSettings, WORKER_FLAGS)
    w.add_argument("--runtime", choices=["auto", "torch", "onnx", "onnx-int8"],
                   help="encoder models on CPU: auto = ONNX Runtime when installed (about 2x torch here); "
                        "onnx-int8 = its weights quantized to int8 (about 2x onnx, vectors within cosine 0.97)")
    w.add_argument("--worker-id", help="name in replies and logs (default: host-pid)")
    w.add_argument("--create-topics", action="store_true", help="create the models' topics first")
    w.add_argument("--partitions", type=int, default=3, help="with --create-topics")


def _options(pairs: list[str]) -> dict[str, Any]:
    """``key=value`` flags as a dict; a value that reads as JSON is that value, else the string."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--option expects key=value, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def run(args: argparse.Namespace) -> int:
    from kinfer.consumers.runners import resolve_model
    from kinfer.consumers.swapping import announcing
    from kinfer.consumers.worker import Worker
    from kinfer.topics.admin import ensure_topics, missing_topics, model_topic_specs, shared_topic_specs
    from kinfer.topics.names import parse_request_topic, request_topics

    bootstrap, redis_url = endpoints()
    options = {**_options(args.option), **({"runtime": args.runtime} if args.runtime else {})}
    specs = tuple(resolve_model(name, args.family, args.path, options) for name in args.model)
    weights = {name: float(w) for name, w in (_options(args.weight) or {}).items()}
    footprints = {name: float(f) for name, f in (_options(args.footprint) or {}).items()}
    settings = WorkerSettings(
        models=specs,
        footprints=footprints,
        bootstrap=bootstrap,
        redis_url=redis_url,
        policy=BatchPolicy(**settings_from_args(args, POLICY_FLAGS)),
        weights=weights,
        **settings_from_args(args, WORKER_FLAGS),
        **({"worker_id": args.worker_id} if args.worker_id else {}),
    )

    async def main() -> None:
        if args.create_topics:
            topics = [*shared_topic_specs()]
            for spec in specs:
                topics += model_topic_specs(spec.name, args.partitions)
            await ensure_topics(bootstrap, topics)
        else:  # a worker without its topics would idle forever with 0 partitions: say so instead
            missing = await missing_topics(bootstrap, [t for spec in specs for t in request_topics(spec.name)])
            names = " ".join(f"--model {spec.name}" for spec in specs)
            # The background topic came later than the others: a deployment may not have it yet. The worker
            # serves the rest meanwhile.
            later = [t for t in missing if parse_request_topic(t)[1].background]
            if missing := [t for t in missing if t not in later]:
                raise ValueError(f"no topics {', '.join(missing)}: create them with `kinfer topics {names}` "
                                 "or start the worker with --create-topics")
            if later:
                log.warning("no background topics %s: create them with `kinfer topics %s`, then restart the worker; "
                            "it serves p0-p2 meanwhile", ", ".join(later), names)
        # The models' runners are built aside (seconds of imports) while the worker says they are loading.
        worker = await announcing(settings, asyncio.to_thread(Worker, settings))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.stop)
        await worker.run()

    asyncio.run(main())
    return 0


COMMAND = Command("worker", "serve one or more models from their request topics", add_arguments, run,
                  principal="kinfer-worker", service=True)
