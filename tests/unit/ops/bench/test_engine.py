"""``kinfer bench engine`` at the smallest sizes on a CPU: every figure of the report is there, the
open loop completes every request, and the bench imports no transport."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kinfer.ops.bench.engine import EngineSizes, bench_engine
from kinfer.ops.bench.plots import plot_report

pytestmark = pytest.mark.models

TINY = EngineSizes(
    encoder_batches=(1, 4), decoder_batches=(1, 4),
    decoder={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2},
    decode_steps=3, prompt_words=12, open_requests=6, open_rate=50.0, open_max_running=4, open_max_new=6,
    seconds=0.05, shape_probes=2,
)


def test_the_report_has_every_figure(tmp_path: Path) -> None:
    report = bench_engine("cpu", TINY)
    encoder, decoder, open_loop = report["encoder"], report["decoder"], report["open_loop"]
    for side in ("kinfer", "reference"):
        assert set(encoder[side]) == {"1", "4"}
        assert all(v["seq_per_s"] > 0 and v["ms_per_batch"] > 0 for v in encoder[side].values())
        assert set(decoder[side]) == {"1", "4"}
        assert all(v["ms_per_step"] > 0 and v["tokens_per_s"] > 0 for v in decoder[side].values())
    split = encoder["split"]
    stages = split["tokenize_ms"] + split["device_ms"] + split["to_host_ms"]
    assert split["batch"] == 4 and split["device_ms"] > 0
    assert abs(split["total_ms"] - stages) <= 0.03  # one batch's stages, each rounded to 0.01 ms
    assert 0 < encoder["busy_fraction"] <= 1 and encoder["new_shape_worst_ms"] > 0
    assert decoder["roofline_ms_per_step"] > 0 and decoder["weight_bytes"] > 0
    assert open_loop["requests"] == open_loop["completed"] == 6
    assert open_loop["ttft_p95_ms"] >= open_loop["ttft_p50_ms"] > 0
    path = plot_report(report, str(tmp_path / "engine.png"))
    assert path.endswith("engine.png")


def test_the_bench_imports_the_engine_alone() -> None:
    """It runs where there is an accelerator and no network: no client, no gateway, no Kafka client."""
    code = ("import sys, kinfer.ops.bench.engine, kinfer.consumers.runners.embedding, "
            "kinfer.consumers.runners.generator; "
            "print(sorted(m for m in ('aiokafka', 'redis', 'kinfer.producers', 'starlette') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
