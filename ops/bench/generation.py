"""``kinfer bench generation``: continuous against static batching, in process (scheduler + runner)."""

from __future__ import annotations

import random
from typing import Any

from kinfer.ops.bench import drawing as draw
from kinfer.ops.bench.engine import drive_generation
from kinfer.ops.bench.harness import log
from kinfer.ops.bench.texts import make_texts


def bench_generation(requests: int = 96, rate: float = 40.0, max_running: int = 16, seed: int = 5) -> dict[str, Any]:
    """Open-loop mixed workload through scheduler + runner in process, once per batching mode.

    Prompts of 8-256 words, outputs of 4-128 tokens (the model has no EOS, so every output is as
    long as asked), Poisson arrivals at ``rate``. TTFT and latency are measured from each request's
    scheduled arrival. Both modes see the identical workload on the same loaded model.
    """
    from kinfer.batcher import ContinuousScheduler, GenPolicy
    from kinfer.consumers.runners.generator import GeneratorRunner, GenInput, Sampling
    from kinfer.consumers.runners.registry import tiny_lm_path
    from kinfer.consumers.runners.tinylm import build_tiny_lm

    path = build_tiny_lm(tiny_lm_path().with_name("bench-lm"), hidden=256, layers=4, eos=False)
    runner = GeneratorRunner(path, max_prompt_tokens=512)
    runner.load()
    runner.warmup()
    rng = random.Random(seed)
    at, workload = 0.0, []
    for i, prompt in enumerate(make_texts(requests, min_words=8, max_words=256, seed=seed)):
        at += rng.expovariate(rate)
        workload.append((at, GenInput(f"g{i}", prompt, Sampling(max_new_tokens=rng.randint(4, 128)))))
    report: dict[str, Any] = {
        "model": "tiny Llama (hidden 256, 4 layers, random weights)", "device": runner.device,
        "requests": requests, "rate_rps": rate, "max_running": max_running,
        "workload": "prompts 8-256 words, outputs 4-128 tokens, Poisson arrivals",
    }
    for mode in ("continuous", "static"):
        sched = ContinuousScheduler(GenPolicy(mode=mode, max_running=max_running))
        report[mode] = drive_generation(runner, sched, workload)
        log(f"{mode}: {report[mode]}")
    c, st = report["continuous"], report["static"]
    report["tokens_per_s_ratio"] = round(c["tokens_per_s"] / st["tokens_per_s"], 2)
    report["ttft_p95_ratio"] = round(c["ttft_p95_ms"] / st["ttft_p95_ms"], 3)
    return report


# -- the picture ----------------------------------------------------------------------------------------


def plot_generation(report: dict[str, Any], path: str) -> str:
    """Continuous against static batching: tokens/s, time to first token, forward passes."""
    plt = draw.pyplot()
    fig, (tokens, times, passes) = plt.subplots(1, 3, figsize=(13, 4.8), width_ratios=(0.7, 1.4, 0.7))
    modes = [m for m in ("continuous", "static") if isinstance(report.get(m), dict)]
    colours = [draw.SERIES_COLOURS[i] for i in range(len(modes))]
    tokens.bar(modes, [report[m].get("tokens_per_s") or 0.0 for m in modes], color=colours)
    tokens.set_ylabel("tokens/s (higher is better)")
    draw.label_bars(tokens, fmt="{:,.0f}")
    metrics = (("ttft_p50_ms", "TTFT p50"), ("ttft_p95_ms", "TTFT p95"), ("latency_p95_ms", "latency p95"))
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(metrics))]
        times.bar(xs, [(report[mode].get(k) or 0.0) / 1000.0 for k, _ in metrics], width, label=mode,
                  color=colours[i])
    times.set_xticks(range(len(metrics)), [label for _, label in metrics])
    times.set_ylabel("seconds (lower is better)")
    times.legend()
    draw.label_bars(times, fmt="{:.2f}")
    passes.bar(modes, [report[m].get("steps") or 0 for m in modes], color=colours)
    passes.set_ylabel("forward passes")
    draw.label_bars(passes, fmt="{:,.0f}")
    for ax in (tokens, times, passes):
        ax.grid(axis="y", alpha=0.3)
    draw.title(fig, f"kinfer bench generation: {report.get('model', '?')} ({report.get('device', '?')}), "
                     f"{report.get('requests', '?')} requests at {report.get('rate_rps', '?')}/s, max_running "
                     f"{report.get('max_running', '?')}: continuous/static tokens/s "
                     f"{draw.num(report.get('tokens_per_s_ratio'))}x, "
                     f"TTFT p95 {draw.num(report.get('ttft_p95_ratio'))}x")
    return draw.save(fig, path)
