"""The ``kinfer`` command line."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import re
import signal
import sys
import typing
from pathlib import Path
from typing import Any

from kinfer.batcher import BatchPolicy
from kinfer.consumers.runners.registry import BUILTIN, FAMILIES
from kinfer.consumers.worker import WorkerSettings
from kinfer.ops.capacity.simulate import SimConfig
from kinfer.ops.control.scaling import ScalePolicy
from kinfer.ops.deploy.secure import SetupError
from kinfer.ops.localstack.stack import LocalStack, StackError, apply_stack_env, fetch_kafka, resolve_endpoints
from kinfer.topics.errors import KinferError


def _options(pairs: list[str]) -> dict[str, Any]:
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


def _floats(value: str) -> list[float]:
    return [float(x) for x in value.split(",")]


def cmd_stack(args: argparse.Namespace) -> int:
    import shlex

    from kinfer.ops.localstack.stack import apply_acls

    stack = LocalStack(Path(args.home) if args.home else None, args.kafka_port, args.redis_port, args.brokers,
                       secure=args.secure)
    if args.action == "fetch":
        print(fetch_kafka())
    elif args.action == "up":
        info, started = stack.up()
        what = "started" if started else f"restarted {'+'.join(stack.restarted)} in" if stack.restarted else "reusing"
        print(f"{what} {'secure ' if info.secure else ''}stack in {info.home}")
        print(f"KINFER_BOOTSTRAP={info.bootstrap}\nKINFER_REDIS_URL={info.redis_url}")
        if info.secure:
            print("Kafka: SASL_SSL (SCRAM-SHA-512) with ACLs; Redis: ACL users. Principals: "
                  f"{', '.join(info.secrets().principals)}\n"
                  "each one's environment: kinfer stack env --principal P (secrets in "
                  f"{info.secure_files.root}); kinfer components take their own by themselves")
    elif args.action == "down":
        print("stopped" if stack.down() else "nothing was running")
    elif args.action == "status":
        status = stack.status()
        print(json.dumps(status, indent=2))
        return 0 if status["state"] == "up" else 3
    elif args.action == "env":
        recorded = stack.load()
        if recorded is None:
            raise StackError("no stack: run `kinfer stack up`")
        for key, value in recorded.env(args.principal).items():
            print(f"export {key}={shlex.quote(value)}")
    elif args.action == "acls":
        recorded = stack.load()
        if recorded is None or not recorded.secure:
            raise StackError("no secure stack: run `kinfer stack up --secure`")
        print(f"{asyncio.run(apply_acls(recorded))} ACLs applied (tenants: on every model's topics now listed)")
    return 0


def cmd_topics(args: argparse.Namespace) -> int:
    from kinfer.topics.admin import ensure_topics, model_topic_specs, shared_topic_specs

    bootstrap, _ = resolve_endpoints()
    copies = {"replication": args.replication_factor, "min_insync": args.min_insync_replicas}
    specs = [*shared_topic_specs(**copies)]
    for model in args.model:
        specs += model_topic_specs(model, args.partitions, **copies)
    for name, count in sorted(asyncio.run(ensure_topics(bootstrap, specs)).items()):
        print(f"{name}\t{count} partitions")
    from kinfer.ops.localstack.stack import tenant_acls_after_topics

    tenant_acls_after_topics(bootstrap, args.model)  # a secure local stack: its tenants' ACLs on the new topics
    return 0


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


def add_settings_args(p: argparse.ArgumentParser, cls: type, flags: dict[str, str]) -> None:
    """One ``--flag`` per field named in ``flags``: type, choices and default from the settings class."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name, text in flags.items():
        field = fields[name]
        default = None if field.default is dataclasses.MISSING else field.default
        kind, choices = _flag_type(hints[name])
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, choices=choices, default=default,
                       help=f"{text} [%(default)s]")


def _flag_type(hint: Any) -> tuple[Any, list[str] | None]:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return str, [str(a) for a in typing.get_args(hint)]
    if args and typing.get_origin(hint) is not typing.Literal:  # X | None
        return _flag_type(args[0])
    return hint, None


def _default(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def settings_from_args(args: argparse.Namespace, flags: dict[str, str]) -> dict[str, Any]:
    return {name: getattr(args, name) for name in flags}


def cmd_worker(args: argparse.Namespace) -> int:
    from kinfer.consumers.runners import resolve_model
    from kinfer.consumers.worker import Worker
    from kinfer.topics.admin import ensure_topics, missing_topics, model_topic_specs, shared_topic_specs
    from kinfer.topics.names import request_topics

    bootstrap, redis_url = resolve_endpoints()
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
            if missing:
                names = " ".join(f"--model {spec.name}" for spec in specs)
                raise ValueError(f"no topics {', '.join(missing)}: create them with `kinfer topics {names}` "
                                 "or start the worker with --create-topics")
        worker = Worker(settings)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.stop)
        await worker.run()

    asyncio.run(main())
    return 0


def cmd_tenant_key(args: argparse.Namespace) -> int:
    from kinfer.topics.auth import TenantCredential, signing_secrets
    from kinfer.topics.names import TENANT_PATTERN

    secrets = signing_secrets()
    if not secrets:
        raise ValueError("KINFER_SIGNING_SECRET is not set (the deployment's signing secret, hex; "
                         "`kinfer stack env --principal kinfer-gateway` shows a secure local stack's)")
    if not re.match(TENANT_PATTERN, args.tenant):
        raise ValueError(f"--tenant must match {TENANT_PATTERN}")
    print(TenantCredential.derive(secrets[0], args.tenant, args.key_version))
    return 0


def cmd_infer(args: argparse.Namespace) -> int:
    import msgspec

    from kinfer.producers import Client

    bootstrap, redis_url = resolve_endpoints()

    async def main() -> None:
        async with Client(bootstrap, redis_url, tenant=args.tenant) as client:
            result = await client.infer(args.model, args.text, priority=args.priority, deadline_ms=args.deadline_ms)
            print(json.dumps({"id": result.id, "status": result.status, "outputs": result.outputs,
                              "timings": msgspec.to_builtins(result.timings), "worker": result.worker}))

    asyncio.run(main())
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    from kinfer.producers.tenants import Tenants, hash_key, is_loopback

    if args.hash_key:
        print(hash_key(args.hash_key))
        return 0
    if not args.tenants and not args.allow_anonymous and not is_loopback(args.host):
        raise ValueError(f"--host {args.host} can be reached from other machines: pass --tenants FILE (hashed "
                         "API keys: see ops/deploy/tenants.example.json and --hash-key), or --allow-anonymous to serve "
                         "every caller")
    import uvicorn

    from kinfer.producers.gateway import GatewaySettings, create_app
    from kinfer.producers.http import MAX_FRAME_BYTES, guarded_protocol

    bootstrap, redis_url = resolve_endpoints()
    tenants = Tenants.from_file(args.tenants) if args.tenants else None
    if tenants is None:
        logging.getLogger(__name__).warning("no --tenants file: the gateway accepts every caller%s",
                                            "" if is_loopback(args.host) else f" on {args.host} (--allow-anonymous)")
    asyncio.run(_reachable(bootstrap, redis_url))  # a dead broker or Redis: one line now, not a traceback later
    app = create_app(GatewaySettings(bootstrap, redis_url, tenants))
    loop = os.environ.get("KINFER_GATEWAY_LOOP", "asyncio")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", loop=loop,
                http=guarded_protocol(args.header_timeout_s), limit_concurrency=args.max_connections,
                timeout_keep_alive=args.keep_alive_s, ws_max_size=MAX_FRAME_BYTES)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from kinfer.ops.capacity.roofline import Workload, plan

    workload = Workload(
        params=args.params, dtype=args.dtype, prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
        qps=args.qps, gpu=args.gpu, layers=args.layers, hidden=args.hidden, heads=args.heads,
        kv_heads=args.kv_heads, mfu=args.mfu, mbu=args.mbu, max_utilisation=args.max_utilisation,
        spare_gpus=args.spare_gpus,
    )
    try:
        report = plan(workload)
    except ValueError as exc:
        print(f"kinfer plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
        return 0
    s = report["shape"]
    print(f"{args.params:.3g} parameters ({s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads, "
          f"{s['kv_heads']} KV heads), {args.dtype}, on {report['gpu']}")
    print(f"  weights {report['weights_gib']:.1f} GiB; KV cache {report['kv_bytes_per_token'] / 1024:.0f} KiB a token; "
          f"ridge point {report['ridge_flops_per_byte']:.0f} FLOP/byte")
    print(f"  prefill: {report['prefill_flops_per_request']:.3g} FLOP a request, {report['prefill_flops_per_s']:.3g} "
          f"FLOP/s; {report['prefill_bound']}-bound; {report['prefill_gpus']} GPUs")
    if report["decode_gpus"]:
        print(f"  decode: {report['decode_flops_per_request']:.3g} FLOP a request; batch {report['decode_batch']} "
              f"fits ({report['vram_gib']['kv_cache']:.1f} GiB of KV); {report['decode_bytes_per_step'] / 1e9:.1f} GB "
              f"a step, intensity {report['decode_intensity']:.0f} FLOP/byte: {report['decode_bound']}-bound; "
              f"{report['decode_step_ms']:.1f} ms a step; {report['decode_gpus']} GPUs")
    busy, spare = args.max_utilisation, args.spare_gpus
    print(f"  total: {report['total_gpus']} GPUs (at most {busy:.0%} busy, plus {spare} spare)")
    return 0


def cmd_place(args: argparse.Namespace) -> int:
    from kinfer.ops.capacity.placement import Fleet, load_models, place, render_k8s, render_table

    fleet = Fleet(gpus=args.gpus, gpu_memory_gib=args.gpu_memory, target_utilisation=args.target_utilisation,
                  dedicated_threshold=args.dedicated_threshold, keep_warm=args.keep_warm,
                  memory_headroom=args.memory_headroom, spare_replicas=args.spare_replicas)
    placement = place(load_models(args.models), fleet)  # a bad file or setting: ValueError, exit 2 in main
    if args.json:
        print(json.dumps(placement.to_dict()))
    elif not placement.feasible:
        print(f"kinfer place: {render_table(placement)}", file=sys.stderr)
    elif args.emit == "k8s":
        print(render_k8s(placement), end="")
    else:
        print(render_table(placement))
    return 0 if placement.feasible else 1


async def _reachable(bootstrap: str, redis_url: str) -> None:
    from kinfer.producers import Client

    async with Client(bootstrap, redis_url, admission=False, tenant="gateway"):
        pass


def cmd_lagmon(args: argparse.Namespace) -> int:
    from kinfer.ops.control.estimator import HealthPolicy
    from kinfer.ops.control.lagmon import LagMonitor

    bootstrap, redis_url = resolve_endpoints()
    monitor = LagMonitor(bootstrap, redis_url, models=args.model or None, interval_s=args.interval_s,
                         policy=HealthPolicy(commit_interval_ms=args.commit_interval_ms))
    _serve_metrics(args)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await monitor.run(stop)

    asyncio.run(main())
    return 0


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
}


def cmd_autoscale(args: argparse.Namespace) -> int:
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
    bootstrap, redis_url = resolve_endpoints()
    pool: Any
    if args.mode == "kubernetes":
        pool = KubernetesPool(deployment, args.namespace, api=args.kube_api, token_file=args.kube_token_file,
                              ca_file=args.kube_ca_file)
    else:
        pool = LocalPool(StackInfo.external(bootstrap, redis_url), args.model, worker_args,
                         Path(args.log_dir) if args.log_dir else None)
    _serve_metrics(args)
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


def cmd_simulate(args: argparse.Namespace) -> int:
    from kinfer.ops.capacity.simulate import SimConfig, load_models, size_fleet

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


def _serve_metrics(args: argparse.Namespace) -> None:
    """Prometheus metrics on ``--metrics-port`` (at ``--metrics-host``), when asked for."""
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_host)


def cmd_telemetry(args: argparse.Namespace) -> int:
    from kinfer.ops.control.telemetry import run

    bootstrap, redis_url = resolve_endpoints()
    _serve_metrics(args)
    run(bootstrap, redis_url, window_s=args.window_s, publish_s=args.publish_s, app_id=args.app_id,
        loglevel="debug" if args.verbose else "warning")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import redis.asyncio as aioredis

    from kinfer.ops.control.status import render, snapshot

    _, redis_url = resolve_endpoints()

    async def main() -> Any:
        redis = aioredis.Redis.from_url(redis_url)
        try:
            return await snapshot(redis, args.decisions)
        finally:
            await redis.aclose()

    snap = asyncio.run(main())
    print(json.dumps(snap.to_json()) if args.json else render(snap))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kinfer.ops.demo import run_demo

    return run_demo(requests=args.requests, rate=args.rate, model=args.model, partitions=args.partitions)


def cmd_bench(args: argparse.Namespace) -> int:
    from kinfer.ops.bench.batching import bench_batching, bench_generation, bench_model

    if args.bench == "model":
        report = bench_model(args.model, batch_sizes=args.batch_sizes, seconds=args.seconds)
    elif args.bench == "generation":
        report = bench_generation(requests=args.requests, rate=args.rate, max_running=args.max_running)
    elif args.bench == "serve":
        from kinfer.ops.bench.gateway import bench_serve

        report = bench_serve(model=args.model, alone_seconds=args.alone_seconds, seconds_per_step=args.seconds,
                             partitions=args.partitions)
    elif args.bench == "transport":
        from kinfer.ops.bench.transport import bench_transport

        rates = {k: tuple(v) for k, v in (("library_rates", args.library_rates), ("http_rates", args.http_rates)) if v}
        report = bench_transport(seconds=args.seconds, paths=tuple(args.path or ("library", "http")),
                                 partitions=args.partitions, **rates)
    elif args.bench == "faults":
        from kinfer.ops.bench.faults import bench_faults

        report = bench_faults(rate=args.rate, before_s=args.before_s, after_s=args.after_s,
                              deadline_ms=args.deadline_ms, only=tuple(args.scenario or ()))
    elif args.bench == "autoscale":
        from kinfer.ops.bench.autoscale import Trace, bench_autoscale

        trace = Trace(quiet_rps=args.quiet_rps, step=args.step, quiet_s=args.quiet_s, peak_s=args.peak_s,
                      ramp_s=args.ramp_s, tail_s=args.tail_s)
        report = bench_autoscale(trace, per_input_ms=args.per_input_ms)
    elif args.bench == "placement":
        from kinfer.ops.bench.placement import bench_placement

        report = bench_placement(models=args.models, resident=args.resident, rate=args.rate, seconds=args.seconds,
                                 zipf_s=args.zipf_s, deadline_ms=args.deadline_ms)
    elif args.bench == "overload":
        from kinfer.ops.bench.overload import bench_overload

        report = bench_overload(surge_s=args.surge_s, normal_s=args.normal_s, factor=args.factor,
                                per_input_ms=args.per_input_ms, deadline_ms=args.deadline_ms,
                                neighbour_s=args.neighbour_s)
    else:
        report = bench_batching(
            seconds_per_step=args.seconds_per_step, steps=args.steps, policies=args.policy, model=args.model,
            hi_rps=args.max_rps,
        )
    drawn = _plot_report(report, args.plot, args.bench) if args.plot is not None else True
    print(json.dumps(report, indent=None if args.json else 2, allow_nan=False))
    return 0 if drawn else 2


def _plot_report(report: dict[str, Any], path: str, name: str) -> bool:
    """``--plot [PNG]``: draws the report (``report["plot"]`` says where); a picture that fails is
    told on stderr, and the report is printed all the same (it cost minutes to measure)."""
    from kinfer.ops.bench.plots import default_plot_path, plot_report

    try:
        report["plot"] = plot_report(report, path or default_plot_path(None, name))
    except Exception as exc:
        print(f"kinfer bench {name}: the plot failed ({type(exc).__name__}: {exc}); the report follows",
              file=sys.stderr)
        return False
    return True


def cmd_bench_plot(args: argparse.Namespace) -> int:
    """``kinfer bench plot REPORT.json [--out PNG]``: draws a saved report, of any benchmark."""
    from kinfer.ops.bench.plots import UnknownReport, default_plot_path, plot_report

    path = Path(args.report)
    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from exc
    try:
        print(plot_report(report, args.out or default_plot_path(path, "")))
    except UnknownReport as exc:
        raise ValueError(f"{path}: {exc}") from exc
    return 0


def _version() -> str:
    from kinfer import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kinfer", description="Kafka-driven asynchronous inference")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--debug", action="store_true", help="a failure shows its traceback (also: KINFER_DEBUG=1)")
    p.add_argument("--version", action="version", version=f"kinfer {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("stack", help="the local Kafka + Redis stack")
    s.add_argument("action", choices=["up", "down", "status", "env", "fetch", "acls"],
                   help="acls: apply the secure stack's ACL table again (after new models' topics)")
    s.add_argument("--home", help="stack folder (default: $KINFER_HOME, else ~/.local/state/kinfer)")
    s.add_argument("--kafka-port", type=int, help="default: a free port")
    s.add_argument("--redis-port", type=int, help="default: a free port")
    s.add_argument("--brokers", type=int, default=1, help="KRaft nodes in the local cluster (one machine) [1]")
    s.add_argument("--secure", action=argparse.BooleanOptionalAction, default=None,
                   help="up: Kafka over SASL_SSL (SCRAM-SHA-512) with ACLs, Redis with ACL users "
                        "(default: as the stack in --home was; a new one is not secure)")
    s.add_argument("--principal", default="admin",
                   help="env: whose credentials, on a secure stack (admin, kinfer-worker, ..., tenant-demo) [admin]")
    s.set_defaults(func=cmd_stack)

    t = sub.add_parser("topics", help="create or grow the request topics of models, and the DLQ")
    t.add_argument("--model", action="append", required=True)
    t.add_argument("--partitions", type=int, default=3)
    t.add_argument("--replication-factor", type=int, default=0,
                   help="copies of each partition (default: 3, or the brokers there are if fewer)")
    t.add_argument("--min-insync-replicas", type=int, default=0,
                   help="copies that must have a write before it is acknowledged (default: the factor less one, >= 1)")
    t.set_defaults(func=cmd_topics)

    w = sub.add_parser("worker", help="serve one or more models from their request topics")
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
    w.add_argument("--runtime", choices=["auto", "torch", "onnx"],
                   help="encoder models on CPU: auto = ONNX Runtime when installed (1.5-1.9x torch at batch 1 here)")
    w.add_argument("--worker-id", help="name in replies and logs (default: host-pid)")
    w.add_argument("--create-topics", action="store_true", help="create the models' topics first")
    w.add_argument("--partitions", type=int, default=3, help="with --create-topics")
    w.set_defaults(func=cmd_worker)

    i = sub.add_parser("infer", help="send one request and print its result")
    i.add_argument("--model", required=True)
    i.add_argument("--priority", type=int, default=1)
    i.add_argument("--deadline-ms", type=int, default=10_000)
    i.add_argument("--tenant", default="cli")
    i.add_argument("text", nargs="+")
    i.set_defaults(func=cmd_infer)

    g = sub.add_parser("gateway", help="the HTTP / SSE / WebSocket gateway (OpenAI-compatible endpoints too)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--tenants", help="JSON file of tenants with hashed API keys (see ops/deploy/tenants.example.json); "
                                     "required on a --host other than loopback")
    g.add_argument("--allow-anonymous", action="store_true",
                   help="serve every caller, unauthenticated and unlimited, on a non-loopback --host without --tenants")
    g.add_argument("--hash-key", metavar="KEY", help="print the SHA-256 of an API key for the tenants file, and exit")
    g.add_argument("--header-timeout-s", type=float, default=10.0,
                   help="close a connection that has not sent a request's headers within this [10]")
    g.add_argument("--keep-alive-s", type=int, default=5, help="close a keep-alive connection idle this long [5]")
    g.add_argument("--max-connections", type=int, default=4096,
                   help="connections served at once; more are answered 503 [4096]")
    g.set_defaults(func=cmd_gateway)

    tk = sub.add_parser("tenant-key", help="print a tenant's request-signing key (from KINFER_SIGNING_SECRET), "
                                           "for its KINFER_TENANT_KEY")
    tk.add_argument("--tenant", required=True, help="the tenant's name, as in the tenants file")
    tk.add_argument("--key-version", type=int, default=1,
                    help="the tenant's key_version in the tenants file [%(default)s]")
    tk.set_defaults(func=cmd_tenant_key)

    pl = sub.add_parser("plan", help="capacity math: FLOPs, bytes, roofline bounds, VRAM and GPUs for a rate")
    pl.add_argument("--params", type=float, required=True, help="parameters, e.g. 7e9")
    pl.add_argument("--dtype", default="fp16", help="fp32, fp16, bf16, fp8, int8, int4 [fp16]")
    pl.add_argument("--prompt-tokens", type=int, default=512)
    pl.add_argument("--output-tokens", type=int, default=128, help="0 for an encoder (embeddings)")
    pl.add_argument("--qps", type=float, default=5000.0)
    pl.add_argument("--gpu", default="h100", help="a100, h100, h200, l4 [h100]")
    pl.add_argument("--layers", type=int, help="default: 32 from 3B parameters, else 24")
    pl.add_argument("--hidden", type=int, help="default: sqrt(params / (12 x layers)), rounded")
    pl.add_argument("--heads", type=int, help="default: hidden / 128")
    pl.add_argument("--kv-heads", type=int, help="fewer than heads for GQA/MQA (default: heads)")
    pl.add_argument("--mfu", type=float, default=0.5, help="share of peak FLOPs reached [0.5]")
    pl.add_argument("--mbu", type=float, default=0.7, help="share of peak memory bandwidth reached [0.7]")
    pl.add_argument("--max-utilisation", type=float, default=0.7, help="busy share that keeps the P99 in bounds [0.7]")
    pl.add_argument("--spare-gpus", type=int, default=1, help="N+1 [1]")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_plan)

    from kinfer.ops.capacity.placement import Fleet

    pc = sub.add_parser("place", help="placement: dedicated pools for hot models, the long tail co-located on the rest")
    pc.add_argument("--models", required=True,
                    help="JSON/YAML: [{name, footprint_gib, replica_rps, expected_rps, family?, path?, keep_warm?}] "
                         "(see ops/deploy/models.example.yaml)")
    pc.add_argument("--gpus", type=int, required=True, help="GPUs to place on")
    pc.add_argument("--gpu-memory", type=float, required=True, metavar="GIB", help="device memory of one GPU")
    pc.add_argument("--target-utilisation", "--max-utilisation", type=float,
                    default=_default(Fleet, "target_utilisation"),
                    help="busy share per GPU that keeps the P99 in bounds [%(default)s]")
    pc.add_argument("--dedicated-threshold", type=float, default=_default(Fleet, "dedicated_threshold"),
                    help="GPUs of compute (at the target utilisation) from which a model gets its own pool "
                         "[%(default)s]")
    pc.add_argument("--keep-warm", type=int, default=_default(Fleet, "keep_warm"),
                    help="warm replicas of every model at least (a model's keep_warm overrides) [%(default)s]")
    pc.add_argument("--memory-headroom", type=float, default=_default(Fleet, "memory_headroom"),
                    help="share of GPU memory left free (context, allocator, activations) [%(default)s]")
    pc.add_argument("--spare-replicas", type=int, default=_default(Fleet, "spare_replicas"),
                    help="extra replicas per dedicated pool (1: N+1) [%(default)s]")
    pc_out = pc.add_mutually_exclusive_group()
    pc_out.add_argument("--json", action="store_true", help="one JSON object")
    pc_out.add_argument("--emit", choices=["k8s"], help="print Kubernetes Deployments for the pools")
    pc.set_defaults(func=cmd_place)

    m = sub.add_parser("lagmon", help="consumer lag → health state per model, published for producers to obey")
    m.add_argument("--model", action="append", default=[], help="models to watch (default: all)")
    m.add_argument("--interval-s", type=float, default=0.5)
    m.add_argument("--commit-interval-ms", type=float, default=_default(WorkerSettings, "commit_interval_ms"),
                   help="the workers' --commit-interval-ms: that much answered traffic is lag, not queue [%(default)s]")
    m.add_argument("--metrics-port", type=int)
    m.add_argument("--metrics-host", default="127.0.0.1", help="address the metrics endpoint binds")
    m.set_defaults(func=cmd_lagmon)

    a = sub.add_parser("autoscale", help="a model's workers follow its load (consumer lag, arrival rate, capacity)",
                       epilog="Arguments after -- go to every local worker, e.g. -- --family noop")
    a.add_argument("--model", required=True)
    a.add_argument("--min", dest="min_replicas", type=int, default=_default(ScalePolicy, "min_replicas"),
                   help="fewest workers (0: scale to zero when idle) [%(default)s]")
    a.add_argument("--max", dest="max_replicas", type=int, default=_default(ScalePolicy, "max_replicas"),
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
    a.add_argument("--commit-interval-ms", type=float, default=_default(WorkerSettings, "commit_interval_ms"),
                   help="the workers' --commit-interval-ms [%(default)s]")
    a.add_argument("--log-dir", help="local: each worker's log goes here (default: discarded)")
    a.add_argument("--metrics-port", type=int)
    a.add_argument("--metrics-host", default="127.0.0.1", help="address the metrics endpoint binds")
    add_settings_args(a, ScalePolicy, SCALE_FLAGS)
    a.add_argument("worker_args", nargs=argparse.REMAINDER, help="-- then flags for each local worker")
    a.set_defaults(func=cmd_autoscale)

    sm = sub.add_parser("simulate", help="discrete-event simulation: the smallest fleet meeting the SLA at a rate")
    sm.add_argument("--qps", type=float, default=25_000.0)
    sm.add_argument("--models", help="JSON/YAML: [{name, share, batch_ms | kind: generate, ...}] "
                                     "(default: embeddings 60 %%, classifier 30 %%, a small generator 10 %%)")
    sm.add_argument("--seconds", type=float, default=10.0, help="simulated seconds per run [%(default)s]")
    sm.add_argument("--transport-ms", type=float, default=_default(SimConfig, "transport_ms"),
                    help="send -> fetched by a worker [%(default)s]")
    sm.add_argument("--worker-cpu-ms", type=float, default=_default(SimConfig, "worker_cpu_ms"),
                    help="the worker's own CPU per request (kinfer bench transport) [%(default)s]")
    sm.add_argument("--brokers", type=int, default=_default(SimConfig, "brokers"))
    sm.add_argument("--broker-failover-s", type=float, default=_default(SimConfig, "broker_failover_s"))
    sm.add_argument("--session-timeout-s", type=float, default=_default(SimConfig, "session_timeout_s"))
    sm.add_argument("--no-admission", action="store_true", help="producers ignore the health signal")
    sm.add_argument("--seed", type=int, default=1)
    sm.add_argument("--json", action="store_true")
    sm.set_defaults(func=cmd_simulate)

    tl = sub.add_parser("telemetry", help="the telemetry stream processor (faust): windowed per-model tables")
    tl.add_argument("--window-s", type=int, default=10, help="tumbling window length, whole seconds")
    tl.add_argument("--publish-s", type=float, default=1.0, help="how often summaries go to Redis")
    tl.add_argument("--app-id", default="kinfer-telemetry", help="consumer group and changelog topic prefix")
    tl.add_argument("--metrics-port", type=int)
    tl.add_argument("--metrics-host", default="127.0.0.1", help="address the metrics endpoint binds")
    tl.set_defaults(func=cmd_telemetry)

    st = sub.add_parser("status", help="per model: lag, rates, level, throughput, sheds; recent decisions")
    st.add_argument("--decisions", type=int, default=10, help="how many level changes to show")
    st.add_argument("--json", action="store_true", help="one JSON object")
    st.set_defaults(func=cmd_status)

    d = sub.add_parser("demo", help="start everything, send a steady stream of requests, report latency, stop")
    d.add_argument("--requests", type=int, default=300)
    d.add_argument("--rate", type=float, default=30.0, help="requests per second (open loop)")
    d.add_argument("--model", default="minilm")
    d.add_argument("--partitions", type=int, default=3)
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="benchmarks")
    bs = b.add_subparsers(dest="bench", required=True)
    bm = bs.add_parser("model", help="the model alone, in process: sequences/s by batch size")
    bm.add_argument("--model", default="minilm")
    bm.add_argument("--batch-sizes", type=lambda v: [int(x) for x in v.split(",")], default=[1, 32])
    bm.add_argument("--seconds", type=float, default=5.0)
    bm.add_argument("--json", action="store_true", help="one line of JSON")
    bm.set_defaults(func=cmd_bench)
    bb = bs.add_parser("batching", help="max rate meeting P95<150/P99<250 ms per batching policy, end to end")
    bb.add_argument("--json", action="store_true", help="one line of JSON (progress goes to stderr)")
    bb.add_argument("--seconds-per-step", type=float, default=8.0)
    bb.add_argument("--steps", type=int, default=6, help="bisection steps per policy")
    bb.add_argument("--policy", action="append", choices=["batch1", "window100", "kinfer"])
    bb.add_argument("--model", choices=["minilm", "sim"], default="minilm",
                    help="sim: a simulated accelerator (15 ms a batch + 0.5 ms an input)")
    bb.add_argument("--max-rps", type=float, default=256.0, help="upper end of the rate search")
    bb.set_defaults(func=cmd_bench)
    bg = bs.add_parser("generation", help="continuous vs static batching on a mixed generation workload")
    bg.add_argument("--json", action="store_true", help="one line of JSON (progress goes to stderr)")
    bg.add_argument("--requests", type=int, default=96)
    bg.add_argument("--rate", type=float, default=40.0, help="arrivals per second (Poisson; above capacity)")
    bg.add_argument("--max-running", type=int, default=16)
    bg.set_defaults(func=cmd_bench)
    bv = bs.add_parser("serve", help="the model alone (best layout) vs kinfer through the gateway, same machine")
    bv.add_argument("--json", action="store_true", help="one line of JSON (progress goes to stderr)")
    bv.add_argument("--model", default="minilm")
    bv.add_argument("--alone-seconds", type=float, default=8.0, help="per layout of the model alone")
    bv.add_argument("--seconds", type=float, default=10.0, help="per rate step through the gateway")
    bv.add_argument("--partitions", type=int, default=6, help="per request topic (a multiple of the workers)")
    bv.set_defaults(func=cmd_bench)
    bt = bs.add_parser("transport", help="the pipeline's own cost: max rate at the SLA and CPU per request per process")
    bt.add_argument("--json", action="store_true", help="one line of JSON (progress goes to stderr)")
    bt.add_argument("--seconds", type=float, default=10.0, help="per rate step")
    bt.add_argument("--path", action="append", choices=["library", "http"], help="default: both")
    bt.add_argument("--library-rates", type=_floats, help="requests/s, comma-separated (default: ops.transport's)")
    bt.add_argument("--http-rates", type=_floats, help="requests/s, comma-separated (default: ops.transport's)")
    bt.add_argument("--partitions", type=int, default=3, help="per request topic")
    bt.set_defaults(func=cmd_bench)
    bf = bs.add_parser("faults", help="faults injected under a steady load: offered, ok, error, lost, recovery")
    bf.add_argument("--json", action="store_true", help="one line of JSON (progress goes to stderr)")
    bf.add_argument("--rate", type=float, default=40.0, help="requests/s through the client library")
    bf.add_argument("--before-s", type=float, default=3.0, help="load before the fault")
    bf.add_argument("--after-s", type=float, default=15.0, help="load from the fault on")
    bf.add_argument("--deadline-ms", type=int, default=30_000, help="longer than any recovery: unanswered = lost")
    bf.add_argument("--scenario", action="append", help="run only these (default: all)")
    bf.set_defaults(func=cmd_bench)
    ba = bs.add_parser("autoscale", help="a 5x traffic step: the autoscaler vs static peak provisioning")
    ba.add_argument("--json", action="store_true", help="one line of JSON (progress goes to stderr)")
    ba.add_argument("--quiet-rps", type=float, default=30.0)
    ba.add_argument("--step", type=float, default=5.0, help="peak rate / quiet rate")
    ba.add_argument("--quiet-s", type=float, default=90.0, help="quiet before the step")
    ba.add_argument("--peak-s", type=float, default=40.0)
    ba.add_argument("--ramp-s", type=float, default=40.0, help="linear ramp from the peak back to quiet")
    ba.add_argument("--tail-s", type=float, default=90.0, help="quiet after the ramp")
    ba.add_argument("--per-input-ms", type=float, default=10.0, help="the simulated accelerator's cost per input")
    ba.set_defaults(func=cmd_bench)
    bo = bs.add_parser("overload", help="a 3x capacity surge with and without the health signal, side by side")
    bo.add_argument("--json", action="store_true", help="one line of JSON (progress goes to stderr)")
    bo.add_argument("--surge-s", type=float, default=30.0)
    bo.add_argument("--normal-s", type=float, default=10.0)
    bo.add_argument("--factor", type=float, default=3.0, help="surge rate / measured capacity")
    bo.add_argument("--per-input-ms", type=float, default=20.0, help="the simulated model's cost per input")
    bo.add_argument("--deadline-ms", type=int, default=250)
    bo.add_argument("--neighbour-s", type=float, default=15.0,
                    help="per phase of the co-located 10x spike run (0: skip it)")
    bo.set_defaults(func=cmd_bench)
    bl = bs.add_parser("placement", help="swap-in times, and more models than the memory budget under a Zipf mix")
    bl.add_argument("--json", action="store_true", help="one line of JSON (progress goes to stderr)")
    bl.add_argument("--models", type=int, default=6, help="copies of all-MiniLM-L6-v2 under different names [6]")
    bl.add_argument("--resident", type=int, default=3, help="how many of them the device budget holds [3]")
    bl.add_argument("--rate", type=float, default=10.0, help="requests/s over all models (Poisson) [10]")
    bl.add_argument("--seconds", type=float, default=60.0, help="length of the mixed load [60]")
    bl.add_argument("--zipf-s", type=float, default=1.5, help="the traffic's Zipf exponent over the models [1.5]")
    bl.add_argument("--deadline-ms", type=int, default=5_000, help="every request's deadline [5000]")
    bl.set_defaults(func=cmd_bench)
    for name, parser in (("model", bm), ("batching", bb), ("generation", bg), ("serve", bv), ("transport", bt),
                         ("faults", bf), ("autoscale", ba), ("overload", bo), ("placement", bl)):
        parser.add_argument("--plot", nargs="?", const="", metavar="PNG",
                            help=f"also draw the report as a PNG (default: bench-{name}.png here; "
                                 "'kinfer bench plot' draws a saved report)")
    bp = bs.add_parser("plot", help="draw a saved report (the JSON a bench printed) as a PNG")
    bp.add_argument("report", help="the report's JSON file (any kinfer bench)")
    bp.add_argument("--out", metavar="PNG", help="default: the report's path with .png")
    bp.set_defaults(func=cmd_bench_plot)
    _show_defaults(p)
    return p


_SAYS = re.compile(r"\[[^\]]*\]\s*$")  # a help that ends in "[value]" shows its default already


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option's default in its help, as ``[default]``, where the help does not say it already."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _show_defaults(child)
            continue
        default = action.default
        if not action.option_strings or default in (None, False, argparse.SUPPRESS) or default == []:
            continue
        text = action.help or ""
        if text == argparse.SUPPRESS or "%(default)" in text or "default" in text.lower() or _SAYS.search(text):
            continue
        action.help = f"{text} [%(default)s]".strip()


# Whose credentials a component takes from a secure local stack (ops.stack.apply_stack_env); other
# commands that connect (topics, status, ...) act as admin (resolve_endpoints).
COMPONENT_PRINCIPALS = {
    "worker": "kinfer-worker", "lagmon": "kinfer-lagmon", "telemetry": "kinfer-telemetry",
    "autoscale": "kinfer-autoscaler", "gateway": "kinfer-gateway", "infer": "admin", "bench": "admin",
    "demo": "admin",
}


# Long-running commands: an unexpected failure is logged with its traceback (their output is a log).
SERVICES = frozenset({"worker", "gateway", "lagmon", "telemetry", "autoscale"})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiokafka").setLevel(logging.WARNING if not args.verbose else logging.DEBUG)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models load from local folders only
    try:
        # A secure local stack: each component connects as its own principal, unless told otherwise.
        if (principal := COMPONENT_PRINCIPALS.get(args.command)) and not getattr(args, "emit", None):
            apply_stack_env(principal)
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        # Mistakes a user can fix (a model that is not served, a bad flag or file, a dead broker) end in
        # one line that says what to do, not a traceback; --debug (or KINFER_DEBUG=1) shows it.
        if args.debug or os.environ.get("KINFER_DEBUG"):
            raise
        while isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:  # a task group's one failure
            inner = exc.exceptions[0]
            if not isinstance(inner, Exception):
                break
            exc = inner
        expected = isinstance(exc, SetupError | KinferError | ValueError | OSError)
        if not expected and args.command in SERVICES:
            # A service that crashed: its log keeps where (one line on the terminal is for commands).
            logging.getLogger(__name__).error("kinfer %s failed", args.command, exc_info=exc)
        what = str(exc) if expected else f"{type(exc).__name__}: {exc}"
        hint = "" if expected else f" (kinfer --debug {args.command} ... shows where)"
        print(f"kinfer {args.command}: {what or type(exc).__name__}{hint}", file=sys.stderr)
        return 2 if expected else 1
