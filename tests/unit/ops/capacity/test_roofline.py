"""``kinfer plan``: the two worked examples of docs/capacity.md, and the properties the math must keep."""

from __future__ import annotations

import pytest

from kinfer.ops.capacity.roofline import Workload, plan


def test_the_readme_7b_decoder_example() -> None:
    r = plan(Workload(7e9, "fp16", prompt_tokens=512, output_tokens=128, qps=5000, gpu="h100"))
    assert r["shape"] == {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 32}
    assert r["kv_bytes_per_token"] == 2 * 32 * 4096 * 2  # K and V, 32 layers, 4096 wide, 2 bytes: 512 KiB
    assert r["prefill_flops_per_request"] == pytest.approx(2 * 7e9 * 512 + 4 * 32 * 4096 * 512**2)  # 7.31e12
    assert r["prefill_bound"] == "compute" and r["decode_bound"] == "bandwidth"
    assert r["ridge_flops_per_byte"] == pytest.approx(989e12 / 3.35e12)  # 295
    assert r["decode_batch"] == 188  # (72 GiB - 14 GB) / (640 tokens x 512 KiB)
    assert r["decode_step_ms"] == pytest.approx(30.2, abs=0.05)  # 70.8 GB a step at 70 % of 3.35 TB/s
    assert (r["prefill_gpus"], r["decode_gpus"], r["total_gpus"]) == (106, 147, 254)


def test_the_readme_500m_embedding_example() -> None:
    r = plan(Workload(5e8, "fp16", prompt_tokens=512, output_tokens=0, qps=5000, gpu="h100"))
    assert r["prefill_flops_per_request"] == pytest.approx(2 * 5e8 * 512 + 4 * 24 * 1280 * 512**2)  # 5.44e11
    assert (r["prefill_gpus"], r["decode_gpus"], r["total_gpus"]) == (8, 0, 9)
    assert plan(Workload(5e8, output_tokens=0, gpu="l4"))["total_gpus"] == 66


def test_gqa_and_smaller_dtypes_shrink_the_fleet() -> None:
    full = plan(Workload(7e9))
    gqa = plan(Workload(7e9, kv_heads=8))
    fp8 = plan(Workload(7e9, dtype="fp8"))
    assert gqa["kv_bytes_per_token"] == full["kv_bytes_per_token"] / 4
    assert gqa["decode_batch"] > 3 * full["decode_batch"] and gqa["decode_gpus"] < full["decode_gpus"]
    assert fp8["weights_gib"] == pytest.approx(full["weights_gib"] / 2)
    assert fp8["total_gpus"] < full["total_gpus"]


def test_more_traffic_never_needs_fewer_gpus() -> None:
    counts = [plan(Workload(7e9, qps=q))["total_gpus"] for q in (10, 100, 1000, 5000, 20000)]
    assert counts == sorted(counts) and counts[0] >= 2  # one to serve, one spare


@pytest.mark.parametrize(("workload", "message"), [
    (Workload(70e9, gpu="l4"), "do not fit"),
    (Workload(7e9, gpu="tpu"), "unknown GPU"),
    (Workload(7e9, dtype="fp8", gpu="a100"), "no fp8"),
    (Workload(7e9, kv_heads=5), "must split"),
])
def test_impossible_plans_say_why(workload: Workload, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan(workload)
