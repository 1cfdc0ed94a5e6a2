"""``kinfer bench batching``: batching policies end to end on the local stack, each one's highest
open-loop rate at the SLA, next to what the model does alone in process (``model.bench_model``)."""

from __future__ import annotations

import asyncio
import math
import os
import time
from typing import Any

from kinfer.consumers.runners.registry import minilm_path
from kinfer.ops.bench import drawing as draw
from kinfer.ops.bench.harness import local_stack, log
from kinfer.ops.bench.load import open_loop
from kinfer.ops.bench.model import bench_model
from kinfer.ops.bench.texts import make_texts
from kinfer.ops.capacity.sla import SLA_MIN_OK, SLA_P95_MS, SLA_P99_MS, meets_sla, percentile, percentile_ms
from kinfer.ops.localstack.procs import scrape, spawn_worker, stop_process, wait_until_served
from kinfer.ops.localstack.stack import StackInfo, free_port
from kinfer.producers import Client
from kinfer.topics.admin import ensure_topics, model_topic_specs, shared_topic_specs

# Worker flags per policy. CoDel is off and deadlines are long in every run, so what is measured
# is batching alone: throughput at a latency target, not how gracefully overload is refused.
POLICIES: dict[str, list[str]] = {
    "batch1": ["--max-batch-size", "1"],
    "window100": ["--mode", "window", "--max-wait-ms", "100", "--max-padding-ratio", "1000"],
    "kinfer": [],
}


# What the batching benchmark serves: the real model, or a simulated accelerator whose batch
# costs a fixed 15 ms plus 0.5 ms per input (the shape of a GPU forward pass: batching is nearly
# free), to show the scheduler where batching pays, which this machine's CPU cannot.
BENCH_MODELS: dict[str, tuple[str, dict[str, Any], list[str]]] = {
    "minilm": ("minilm", {}, ["--family", "embedding", "--path", "MINILM"]),
    "sim": ("noop", {"compute_ms": 15.0, "per_input_ms": 0.5},
            ["--family", "noop", "--option", "compute_ms=15", "--option", "per_input_ms=0.5"]),
}


def bench_batching(
    seconds_per_step: float = 8.0, steps: int = 6, lo_rps: float = 10.0, hi_rps: float = 256.0,
    policies: list[str] | None = None, model: str = "minilm",
) -> dict[str, Any]:
    """For each policy: the highest open-loop rate meeting P95 < 150 ms and P99 < 250 ms."""
    started_at = time.monotonic()
    runner_model, options, flags = BENCH_MODELS[model]
    flags = [str(minilm_path()) if f == "MINILM" else f for f in flags]
    alone = bench_model(runner_model, [1, 32], seconds=4.0, options=options)
    report: dict[str, Any] = {
        "model": "all-MiniLM-L6-v2" if model == "minilm" else "simulated accelerator: 15 ms + 0.5 ms/input",
        "device": alone["device"], "texts": "5-120 words, Poisson arrivals",
        "sla": {"p95_ms": SLA_P95_MS, "p99_ms": SLA_P99_MS, "min_ok": SLA_MIN_OK},
        "in_process_seq_per_s": {k: v["seq_per_s"] for k, v in alone["batch"].items()},
    }
    with local_stack() as info:
        for name in policies or list(POLICIES):
            log(f"policy {name}")
            report[name] = _bench_policy(info, name, flags, seconds_per_step, steps, lo_rps, hi_rps)
    kinfer, window = report.get("kinfer", {}), report.get("window100", {})
    if kinfer and window and window["max_sla_rps"]:
        report["kinfer_vs_window100"] = round(kinfer["max_sla_rps"] / window["max_sla_rps"], 2)
    if kinfer:
        report["kinfer_vs_in_process_batch32"] = round(
            kinfer["max_sla_rps"] / report["in_process_seq_per_s"]["32"], 2
        )
    report["elapsed_s"] = round(time.monotonic() - started_at, 1)
    return report


def _bench_policy(
    info: StackInfo, policy: str, model_flags: list[str], seconds_per_step: float, steps: int, lo: float, hi: float
) -> dict[str, Any]:
    served = f"bench-{policy}"
    asyncio.run(ensure_topics(info.bootstrap, [*shared_topic_specs(), *model_topic_specs(served, 3)]))
    port = free_port()
    log_path = os.path.join(info.home, f"bench-{policy}.log")
    proc = spawn_worker(
        info, served, *model_flags, "--metrics-port", str(port), "--codel-target-ms", "inf", *POLICIES[policy],
        log_path=log_path,
    )
    try:
        return asyncio.run(_search(info, served, port, seconds_per_step, steps, lo, hi))
    finally:
        stop_process(proc)


async def _search(
    info: StackInfo, model: str, port: int, seconds: float, steps: int, lo: float, hi: float
) -> dict[str, Any]:
    """Geometric bisection between lo (assumed to pass) and hi (assumed to fail)."""
    async with Client(info.bootstrap, info.redis_url, tenant="bench") as client:
        await wait_until_served(client, model)
        await open_loop(client, model, make_texts(30, seed=99), lo, deadline_ms=3_000)  # warm-up, not counted
        best: dict[str, Any] | None = None
        tried = []
        first = await _step(client, model, port, lo, seconds, seed=1)
        tried.append(first)
        if first["meets_sla"]:
            best = first
            for i in range(steps):
                rate = math.sqrt(lo * hi)
                stats = await _step(client, model, port, rate, seconds, seed=2 + i)
                tried.append(stats)
                if stats["meets_sla"]:
                    lo, best = rate, stats
                else:
                    hi = rate
    # No rate met the SLA: say so with nulls (strict JSON has no NaN).
    chosen = best or {"rate": 0.0, "p95_ms": None, "p99_ms": None, "padding_ratio": None, "mean_batch": None}
    return {
        "max_sla_rps": round(chosen["rate"], 1),
        "p95_ms": chosen["p95_ms"],
        "p99_ms": chosen["p99_ms"],
        "padding_ratio": chosen["padding_ratio"],
        "mean_batch": chosen["mean_batch"],
        "steps": [{k: s[k] for k in ("rate", "ok_fraction", "p95_ms", "p99_ms", "meets_sla")} for s in tried],
    }


# Fewer requests than this make a p99 the luck of one sample (this machine is shared and noisy).
MIN_REQUESTS_PER_STEP = 150


async def _step(client: Client, model: str, port: int, rate: float, seconds: float, seed: int) -> dict[str, Any]:
    before = scrape(port)
    texts = make_texts(max(MIN_REQUESTS_PER_STEP, int(rate * seconds)), seed=100 + seed)
    report = await open_loop(client, model, texts, rate, poisson=True, deadline_ms=3_000, seed=seed)
    after = scrape(port)
    lat = [o.latency_ms for o in report.ok]
    ok_fraction = len(lat) / len(report.outcomes)
    p95, p99 = (percentile(lat, 95), percentile(lat, 99)) if lat else (math.inf, math.inf)
    pad_n = after.get("kinfer_padding_ratio_count", 0) - before.get("kinfer_padding_ratio_count", 0)
    pad_s = after.get("kinfer_padding_ratio_sum", 0) - before.get("kinfer_padding_ratio_sum", 0)
    stats = {
        "rate": rate,
        "ok_fraction": round(ok_fraction, 3),
        "p95_ms": percentile_ms(lat, 95),
        "p99_ms": percentile_ms(lat, 99),
        "padding_ratio": round(pad_s / pad_n, 3) if pad_n else None,
        "mean_batch": report.summary()["mean_batch"],
        "meets_sla": meets_sla(ok_fraction, p95, p99),
    }
    verdict = "pass" if stats["meets_sla"] else "fail"
    log(f"  {rate:7.1f}/s ok={ok_fraction:.3f} p95={p95:.0f}ms p99={p99:.0f}ms {verdict}")
    return stats


# -- the picture ----------------------------------------------------------------------------------------


def plot_batching(report: dict[str, Any], path: str) -> str:
    """The max rate at the SLA per policy, and latency against rate per policy."""
    plt = draw.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5), width_ratios=(0.8, 1.2))
    policies = [p for p in POLICIES if isinstance(report.get(p), dict)]
    maxima = [report[p].get("max_sla_rps") or 0.0 for p in policies]
    left.bar(policies, maxima, color=[draw.SERIES_COLOURS[i] for i in range(len(policies))])
    for x, (name, value) in enumerate(zip(policies, maxima, strict=True)):
        run = report[name]
        text = (f"{value:,.1f}/s\nbatch {draw.num(run.get('mean_batch'))}, "
                f"padding {draw.num(run.get('padding_ratio'))}" if value else "never meets\nthe SLA")
        left.annotate(text, (x, value), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8)
    alone = sorted(report.get("in_process_seq_per_s", {}).items(), key=lambda kv: int(kv[0]))
    for (size, seq_s), style in zip(alone, (":", "--", "-."), strict=False):
        left.axhline(seq_s, color="grey", ls=style, lw=1, label=f"the model alone, batch {size}: {seq_s:g} seq/s")
    if alone:
        left.legend(fontsize=8, loc="upper left")
    left.set_ylabel("max requests/s at the SLA")
    left.set_ylim(0, max([*maxima, *report.get("in_process_seq_per_s", {}).values(), 1.0]) * 1.25)
    left.grid(axis="y", alpha=0.3)
    draw.latency_vs_rate(right, {p: report[p].get("steps", []) for p in policies}, draw.report_sla(report),
                         maxima=maxima)
    right.set_title("latency against offered rate (every step of the search)")
    draw.title(fig, f"kinfer bench batching: {report.get('model', '?')} ({report.get('device', '?')}), "
                     f"{report.get('texts', '')}")
    return draw.save(fig, path)
