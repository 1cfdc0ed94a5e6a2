"""``kinfer bench placement``: what weight swapping costs, and whether hot models keep their SLA while
cold ones come and go.

1. **Swap-in of each built-in model**, in process (no transport): from disk (``load`` + warm-up
   passes) and from host RAM (``offload`` then ``restore`` + warm-up), the median of a few tries,
   and the footprint the runner measures (``consumers.runners.base.bring_in``, as the worker does).
   On a CPU the weights are in host RAM either way and nothing moves, so a swap-in "from RAM" costs
   about nothing here; on a GPU it is a pinned copy over PCIe and the warm-up.
2. **More models than the budget holds**, end to end on the local stack: one worker registers
   ``models`` copies of all-MiniLM-L6-v2 under different names with a device budget of ``resident``
   of them and host RAM for the rest; the lag monitor and the telemetry stream run (cold state,
   capacity), clients obey them; an open-loop Poisson load spreads over the models by a Zipf law (a
   few hot, a long cold tail). Per
   request: ok (latency from its scheduled send), refused as cold (``ColdStart``), refused otherwise,
   expired, or timed out (no answer by its deadline); lost = timed out and never answered, even late.
   Hot = the models that carry most of the traffic. The same load first runs with a budget that
   holds every model (``all_resident``): the control, on the same machine, minutes apart.

The report: ``{"swap_in_ms": {"ram": …, "disk": …}, "cold_start_ms": …, "hot_p95_ms": …,
"hot_p99_ms": …, "cold_requests_served": …, "lost": …, …}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import statistics
import time
from collections import Counter
from typing import Any

from kinfer.ops.bench import drawing as draw
from kinfer.ops.bench.harness import local_stack, log
from kinfer.ops.bench.texts import make_texts
from kinfer.ops.capacity.sla import SLA_P95_MS, SLA_P99_MS, meets_sla, percentile_ms
from kinfer.ops.control.lagmon import LagMonitor
from kinfer.ops.localstack.procs import spawn, spawn_worker, stop_process
from kinfer.ops.localstack.stack import StackInfo, free_port
from kinfer.producers import Client
from kinfer.topics import ColdStart, DeadlineExceeded, KinferError, Overloaded
from kinfer.topics.admin import ensure_topics, model_topic_specs, shared_topic_specs

BUILTIN = ("minilm", "tiny-lm")


def swap_in_times(model: str, tries: int = 3) -> dict[str, Any]:
    """Disk → serving and host RAM → serving for one built-in model, in this process (ms, medians)."""
    from kinfer.consumers.runners import build_runner, resolve_model
    from kinfer.consumers.runners.base import bring_in, set_threads

    set_threads(1)
    runner = build_runner(resolve_model(model))
    disk, ram = [], []
    for _ in range(tries):
        t0 = time.perf_counter()
        bring_in(runner, from_host=False)
        disk.append(1000 * (time.perf_counter() - t0))
        runner.offload()
        t0 = time.perf_counter()
        bring_in(runner, from_host=True)
        ram.append(1000 * (time.perf_counter() - t0))
        footprint = runner.footprint_bytes()
        runner.unload()
    return {"disk": round(statistics.median(disk), 1), "ram": round(statistics.median(ram), 1),
            "footprint_mb": round(footprint / (1 << 20), 1), "device": runner.device,
            "runtime": getattr(runner, "runtime", "torch")}


def zipf_weights(n: int, s: float) -> list[float]:
    raw = [1.0 / (rank ** s) for rank in range(1, n + 1)]
    return [w / sum(raw) for w in raw]


def bench_placement(models: int = 6, resident: int = 3, hot: int = 2, rate: float = 10.0, seconds: float = 60.0,
                    zipf_s: float = 1.5, deadline_ms: int = 5_000, quantum_s: float = 10.0,
                    seed: int = 13) -> dict[str, Any]:
    log("swap-in of each built-in model, in process")
    per_model = {name: swap_in_times(name) for name in BUILTIN}
    for name, t in per_model.items():
        log(f"  {name}: disk {t['disk']:.0f} ms, ram {t['ram']:.0f} ms, {t['footprint_mb']} MiB ({t['runtime']})")
    from kinfer.consumers.runners.registry import estimate_footprint, resolve_model

    footprint_gib = max(estimate_footprint(resolve_model("minilm")), per_model["minilm"]["footprint_mb"] * (1 << 20))
    footprint_gib /= 1 << 30
    budget = round(footprint_gib * (resident + 0.5), 4)  # room for ``resident``, not for one more
    host = round(footprint_gib * (models + 0.5), 4)  # host RAM is plentiful beside device memory: all of them
    names = [f"bench-place-{i}" for i in range(models)]
    weights = zipf_weights(models, zipf_s)
    report: dict[str, Any] = {
        "swap_in_ms": {"ram": per_model["minilm"]["ram"], "disk": per_model["minilm"]["disk"]},
        "swap_in_ms_by_model": per_model,
        "setup": {"models": models, "resident": resident, "hot": hot, "memory_budget_gib": budget,
                  "host_memory_budget_gib": host, "rate_rps": rate, "seconds": seconds, "zipf_s": zipf_s,
                  "shares": {n: round(w, 3) for n, w in zip(names, weights, strict=True)},
                  "deadline_ms": deadline_ms, "swap_quantum_s": quantum_s,
                  "model": "all-MiniLM-L6-v2 under each name", "cpus": os.cpu_count()},
    }
    with local_stack() as info:
        asyncio.run(ensure_topics(info.bootstrap, [*shared_topic_specs(),
                                                   *(t for n in names for t in model_topic_specs(n, 3))]))
        # The control first: the same load with a budget that holds every model (nothing swaps).
        everything = round(footprint_gib * (models + 0.5), 4)
        log("control: a budget for every model")
        control = _one_run(info, names, weights, hot, everything, 0.0, quantum_s, rate, seconds, deadline_ms, seed)
        report["all_resident"] = {k: control[k] for k in ("hot_p50_ms", "hot_p95_ms", "hot_p99_ms", "hot_ok_fraction",
                                                          "hot_tail", "cold_p50_ms", "outcomes", "refused_by",
                                                          "worker_swap_ins")}
        log(f"budget for {resident} of {models}")
        report.update(_one_run(info, names, weights, hot, budget, host, quantum_s, rate, seconds, deadline_ms, seed))
    return report


def _one_run(info: StackInfo, names: list[str], weights: list[float], hot: int, budget: float, host: float,
             quantum_s: float, rate: float, seconds: float, deadline_ms: int, seed: int) -> dict[str, Any]:
    """One worker registering every model under ``budget`` GiB, the Zipf load through it, its swap-ins."""
    from kinfer.consumers.runners.registry import resolve_model

    port = free_port()
    flags = [a for n in names[1:] for a in ("--model", n)]
    worker = spawn_worker(info, names[0], *flags, "--family", "embedding", "--path", str(resolve_model("minilm").path),
                          "--memory-budget", str(budget), "--host-memory-budget", str(host),
                          "--swap-quantum-s", str(quantum_s), "--metrics-port", str(port),
                          log_path=os.path.join(info.home, f"bench-placement-worker-{budget:g}.log"))
    # The telemetry stream beside it, as deployed: it tells the lag monitor each model's service time, so
    # a rarely used model's capacity is known without a queue to measure it by.
    telemetry = spawn(info, "telemetry", "--app-id", f"kinfer-telemetry-placement-{os.getpid()}-{budget:g}",
                      "--window-s", "5", "--publish-s", "0.5",
                      log_path=os.path.join(info.home, "bench-placement-telemetry.log"))
    try:
        run = asyncio.run(_mixed_load(info.bootstrap, info.redis_url, names, weights, hot, rate, seconds,
                                      deadline_ms, seed, worker))
        run["worker_swap_ins"] = _swap_ins(port)
    finally:
        stop_process(worker)
        stop_process(telemetry)
    return run


def _swap_ins(port: int) -> dict[str, dict[str, float]]:
    """The worker's swap-ins to serving during the run, by source tier: how many, and their mean."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    sums: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("kinfer_swap_in_seconds_count", "kinfer_swap_in_seconds_sum"):
                key = (sample.name.rsplit("_", 1)[1], sample.labels["source"])
                sums[key] = sums.get(key, 0.0) + sample.value
    return {source: {"count": int(sums[("count", source)]),
                     "mean_ms": round(1000 * sums[("sum", source)] / sums[("count", source)], 1)}
            for (kind, source) in sorted(sums) if kind == "count" and sums[("count", source)]}


def _where(outcomes: list[dict[str, Any]]) -> dict[str, float] | None:
    """Mean worker timings of ``outcomes`` and the rest of their latency (outside the worker)."""
    if not outcomes:
        return None
    parts = {"queue_ms": [o["timings"].queue_ms for o in outcomes],
             "batch_wait_ms": [o["timings"].batch_wait_ms for o in outcomes],
             "compute_ms": [o["timings"].compute_ms for o in outcomes]}
    means = {k: round(statistics.fmean(v), 1) for k, v in parts.items()}
    inside = [sum(vals) for vals in zip(*parts.values(), strict=True)]
    outside = [o["latency_ms"] - t for o, t in zip(outcomes, inside, strict=True)]
    return {"requests": len(outcomes), **means, "outside_ms": round(statistics.fmean(outside), 1),
            "latency_ms": round(statistics.fmean(o["latency_ms"] for o in outcomes), 1)}


async def _mixed_load(bootstrap: str, redis_url: str, names: list[str], weights: list[float], hot: int, rate: float,
                      seconds: float, deadline_ms: int, seed: int, worker: Any) -> dict[str, Any]:
    monitor = LagMonitor(bootstrap, redis_url, models=names)
    stop = asyncio.Event()
    watching = asyncio.create_task(monitor.run(stop))
    try:
        async with Client(bootstrap, redis_url, tenant="bench") as client:
            await _until_resident(client, names, worker)
            rng = random.Random(seed)
            texts = make_texts(512, 5, 60, seed=seed)
            outcomes: list[dict[str, Any]] = []

            async def one(model: str, scheduled: float, text: str) -> None:
                state = client.health(model)
                cold = state is not None and state.warm_replicas == 0
                timings, why = None, None
                try:
                    result = await client.infer(model, [text], deadline_ms=deadline_ms)
                    kind = "ok" if result.status.value == "ok" else result.status.value
                    timings = result.timings
                except ColdStart:
                    kind = "refused_cold"
                except Overloaded as exc:
                    kind, why = "refused", exc.cause  # level, deadline or throttle
                except DeadlineExceeded as exc:
                    kind = "expired" if exc.answered else "timed_out"
                except KinferError as exc:
                    kind = type(exc).__name__
                outcomes.append({"model": model, "kind": kind, "cold_at_send": cold,
                                 "latency_ms": 1000.0 * (time.monotonic() - scheduled), "timings": timings,
                                 "why": why})

            log(f"mixed load: {rate}/s for {seconds:.0f} s over {len(names)} models (Zipf)")
            tasks = []
            at = start = time.monotonic()
            while at - start < seconds:
                delay = at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                model = rng.choices(names, weights)[0]
                tasks.append(asyncio.create_task(one(model, at, rng.choice(texts))))
                at += rng.expovariate(rate)
            await asyncio.gather(*tasks)
            # A caller that timed out was answered later (expired, typically) unless the request was lost:
            # give stragglers a moment, then count the replies that came for callers already gone.
            await asyncio.sleep(5.0)
            late = client.late_replies
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await watching
    return summarise(outcomes, names[:hot], late)


async def _until_resident(client: Client, names: list[str], worker: Any, timeout_s: float = 300.0) -> None:
    """The worker has loaded what it keeps (resident and in host RAM) and serves its first model."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert worker.poll() is None, "the worker exited: see bench-placement-worker-<budget>.log in the stack home"
        try:
            await client.infer(names[0], ["ready?"], deadline_ms=10_000)
            return
        except KinferError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)


def summarise(outcomes: list[dict[str, Any]], hot: list[str], late_replies: int = 0) -> dict[str, Any]:
    """What one run's outcomes add up to: the ``hot`` models' latency (and where their slowest answers
    spent it), the others' cold starts and refusals, and what was lost (``late_replies``: callers that
    gave up and were answered after)."""
    # "cold_requests*": requests to the models beyond the hot ones (the tail, swapped in and out);
    # "cold_start_ms": only those sent while their model had no warm replica, to their result.
    hot_ok = [o["latency_ms"] for o in outcomes if o["model"] in hot and o["kind"] == "ok"]
    hot_all = [o for o in outcomes if o["model"] in hot]
    cold = [o for o in outcomes if o["model"] not in hot]
    by_model: dict[str, Counter[str]] = {}
    for o in outcomes:
        by_model.setdefault(o["model"], Counter())[o["kind"]] += 1
    served_cold = [o["latency_ms"] for o in outcomes if o["cold_at_send"] and o["kind"] == "ok"]
    hot_p95, hot_p99 = percentile_ms(hot_ok, 95), percentile_ms(hot_ok, 99)
    tail = [o for o in outcomes if o["model"] in hot and o["kind"] == "ok" and hot_p95 is not None
            and o["latency_ms"] >= hot_p95 and o.get("timings") is not None]
    return {
        "requests": len(outcomes),
        "outcomes": dict(Counter(o["kind"] for o in outcomes)),
        "by_model": {m: dict(c) for m, c in sorted(by_model.items())},
        "hot_models": hot,
        "hot_p50_ms": percentile_ms(hot_ok, 50),
        "hot_p95_ms": hot_p95,
        "hot_p99_ms": hot_p99,
        "hot_ok_fraction": round(len(hot_ok) / len(hot_all), 4) if hot_all else None,
        # Where the slowest 5 % of the hot models' answers spent their time (means, ms): in Kafka before
        # a worker fetched them, fetched and waiting for a batch, computing, and the rest (publish, reply).
        "hot_tail": _where(tail),
        "hot_meets_sla": meets_sla(len(hot_ok) / len(hot_all) if hot_all else 0.0, hot_p95, hot_p99, min_ok=0.99),
        "cold_requests": len(cold),
        "cold_requests_served": sum(1 for o in cold if o["kind"] == "ok"),
        "cold_requests_refused_cold": sum(1 for o in cold if o["kind"] == "refused_cold"),
        # Refused otherwise (Overloaded), by why, and whether the model had no warm replica at the send.
        "refused_by": dict(Counter(f"{o['why']}{' (cold)' if o['cold_at_send'] else ''}"
                                   for o in outcomes if o["kind"] == "refused")),
        "cold_p50_ms": percentile_ms([o["latency_ms"] for o in cold if o["kind"] == "ok"], 50),
        # A request sent while its model had no warm replica, to its result: the cold start as a caller sees it.
        "cold_start_ms": round(statistics.median(served_cold), 1) if served_cold else None,
        "cold_start_requests": len(served_cold),
        # No answer by the deadline (the caller gave up), and, of those, never answered at all.
        "timed_out": sum(1 for o in outcomes if o["kind"] == "timed_out"),
        "late_replies": late_replies,
        "lost": max(0, sum(1 for o in outcomes if o["kind"] == "timed_out") - late_replies),
        "sla": {"p95_ms": SLA_P95_MS, "p99_ms": SLA_P99_MS},
    }


# -- the picture ----------------------------------------------------------------------------------------


def plot_placement(report: dict[str, Any], path: str) -> str:
    """Swap-in per model and tier; the mixed run's outcomes per model (hot first)."""
    plt = draw.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1, 2]})
    models = report.get("swap_in_ms_by_model", {})
    names = list(models)
    for i, tier in enumerate(("disk", "ram")):
        ax1.bar([x + i * 0.38 for x in range(len(names))], [models[n].get(tier) or 0.0 for n in names], 0.38,
                label=f"from {tier}", color=draw.SERIES_COLOURS[i])
    ax1.set_xticks([x + 0.19 for x in range(len(names))], names)
    ax1.set_ylabel("swap-in to serving, ms (in process)")
    ax1.legend(fontsize=8)
    ax1.grid(axis="y", alpha=0.3)
    by_model = report.get("by_model", {})
    kinds = sorted({k for counts in by_model.values() for k in counts}, key=lambda k: (k != "ok", k))
    order = list(by_model)
    bottom = [0.0] * len(order)
    for i, kind in enumerate(kinds):
        values = [float(by_model[m].get(kind, 0)) for m in order]
        colour = draw.SERIES_COLOURS[i % len(draw.SERIES_COLOURS)]
        ax2.bar(range(len(order)), values, bottom=bottom, label=kind, color=colour)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    hot = set(report.get("hot_models", []))
    ax2.set_xticks(range(len(order)), [f"{m.rsplit('-', 1)[-1]}{' (hot)' if m in hot else ''}" for m in order])
    ax2.set_ylabel("requests")
    ax2.legend(fontsize=8)
    ax2.grid(axis="y", alpha=0.3)
    setup = report.get("setup", {})
    draw.title(fig, f"kinfer bench placement: {setup.get('models', '?')} models, "
                     f"budget for {setup.get('resident', '?')}, {setup.get('rate_rps', '?')}/s "
                     f"Zipf({setup.get('zipf_s', '?')}); hot p95/p99 "
                     f"{draw.num(report.get('hot_p95_ms'))}/{draw.num(report.get('hot_p99_ms'))} ms, cold start "
                     f"{draw.num(report.get('cold_start_ms'))} ms, lost {report.get('lost', '?')}")
    return draw.save(fig, path)
