"""``kinfer bench model``: the model alone, in this process, no transport: sequences/s by batch size."""

from __future__ import annotations

import time
from typing import Any, cast

from kinfer.consumers.runners import BatchRunner, build_runner, resolve_model
from kinfer.ops.bench import drawing as draw
from kinfer.ops.bench.texts import make_texts


def bench_model(
    model: str, batch_sizes: list[int], seconds: float = 5.0, options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Sequences/s of the bare runner at each batch size, on the same 5-120 word texts as the demo."""
    runner = cast(BatchRunner, build_runner(resolve_model(model, options=options)))
    runner.load()
    runner.warmup()
    texts = make_texts(2048, seed=3)
    out: dict[str, Any] = {"model": model, "device": runner.device, "batch": {}}
    for size in batch_sizes:
        done, i, start = 0, 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            runner.run([texts[(i + k) % len(texts)] for k in range(size)])
            done += size
            i += size
        elapsed = time.perf_counter() - start
        out["batch"][str(size)] = {
            "seq_per_s": round(done / elapsed, 1),
            "ms_per_batch": round(elapsed / (done / size) * 1000, 2),
        }
    return out


# -- the picture ----------------------------------------------------------------------------------------


def plot_model(report: dict[str, Any], path: str) -> str:
    """Sequences/s by batch size."""
    plt = draw.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = sorted(report["batch"].items(), key=lambda kv: int(kv[0]))
    ax.bar([f"batch {k}" for k, _ in sizes], [v.get("seq_per_s") or 0.0 for _, v in sizes], color="#1f77b4")
    for x, (_, v) in enumerate(sizes):
        ax.annotate(f"{draw.num(v.get('seq_per_s'))} seq/s\n{draw.num(v.get('ms_per_batch'))} ms a batch",
                    (x, v.get("seq_per_s") or 0.0), xytext=(0, 3), textcoords="offset points", ha="center",
                    fontsize=8)
    ax.set_ylim(0, max([v.get("seq_per_s") or 0.0 for _, v in sizes] + [1.0]) * 1.25)
    ax.set_ylabel("sequences/s")
    ax.grid(axis="y", alpha=0.3)
    draw.title(fig, f"kinfer bench model: {report.get('model', '?')} ({report.get('device', '?')}), in process")
    return draw.save(fig, path)
