"""``kinfer bench model``: the model alone, in this process, no transport: sequences/s by batch size."""

from __future__ import annotations

import time
from typing import Any, cast

from kinfer.consumers.runners import BatchRunner, build_runner, resolve_model
from kinfer.ops.bench.load import make_texts


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
