"""Benchmarks that need no stack: the model alone, in process."""

from __future__ import annotations

import time
from typing import Any

from consumers.runners import build_runner, resolve_model
from ops.load import make_texts


def bench_model(model: str, batch_sizes: list[int], seconds: float = 5.0) -> dict[str, Any]:
    """Sequences/s of the bare runner at each batch size, on the same 5-120 word texts as the demo."""
    runner = build_runner(resolve_model(model))
    runner.load()
    runner.warmup()
    texts = make_texts(2048, seed=3)
    out: dict[str, Any] = {"model": model, "device": runner.device, "batch": {}}
    for size in batch_sizes:
        done, i, start = 0, 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            batch = [texts[(i + k) % len(texts)] for k in range(size)]
            runner.run(batch)
            done += size
            i += size
        elapsed = time.perf_counter() - start
        out["batch"][str(size)] = {
            "seq_per_s": round(done / elapsed, 1),
            "ms_per_batch": round(elapsed / (done / size) * 1000, 2),
        }
    return out
