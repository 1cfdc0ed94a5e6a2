"""``kinfer plan``: the capacity math for serving a transformer at a given rate (pure: no I/O).

A roofline model. Each phase is bound by compute or by memory bandwidth, whichever takes longer:

- **Prefill** (the prompt, all tokens at once; an encoder's whole job): ``2 · params`` FLOPs per
  token for the weights, plus attention ``4 · layers · hidden · tokens²`` per sequence (QKᵀ and AV).
  The weights are read once for a batch of thousands of tokens, so it is compute-bound on every
  GPU here.
- **Decode** (one token per sequence per step): ``2 · params`` FLOPs per token plus attention over
  the context ``4 · layers · hidden · context``; every step reads all the weights once, and each
  sequence's KV cache. At the batch that fits in memory its arithmetic intensity is far below the
  ridge point: bandwidth-bound.

GPU counts come from the time each phase needs per second of traffic at the assumed efficiency
(``mfu`` of peak FLOPs, ``mbu`` of peak bandwidth), divided by the utilisation that keeps the P99
in bounds (``max_utilisation``), rounded up, plus one spare (N+1). The two worked examples in
docs/capacity.md are this module's output, checked by ``tests/unit/ops/capacity/test_roofline.py``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}


@dataclass(frozen=True, slots=True)
class Gpu:
    name: str
    dense_tflops: dict[str, float]  # peak dense tensor throughput by dtype (no sparsity)
    bandwidth_gbs: float  # HBM / GDDR bandwidth, GB/s
    memory_gib: float
    source: str


# Datasheet figures (dense, i.e. without the 2:4 sparsity the headline numbers assume).
GPUS = {
    "a100": Gpu("A100 SXM 80GB", {"fp16": 312, "bf16": 312, "int8": 624, "fp32": 19.5}, 2039, 80,
                "NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOPS FP16/BF16 dense, 2,039 GB/s HBM2e"),
    "h100": Gpu("H100 SXM 80GB", {"fp16": 989, "bf16": 989, "fp8": 1979, "int8": 1979, "fp32": 67}, 3350, 80,
                "NVIDIA H100 Tensor Core GPU datasheet (2023): 989 TFLOPS FP16/BF16 dense, 3.35 TB/s HBM3"),
    "h200": Gpu("H200 SXM 141GB", {"fp16": 989, "bf16": 989, "fp8": 1979, "int8": 1979, "fp32": 67}, 4800, 141,
                "NVIDIA H200 Tensor Core GPU datasheet (2024): 989 TFLOPS FP16/BF16 dense, 4.8 TB/s HBM3e"),
    "l4": Gpu("L4 24GB", {"fp16": 121, "bf16": 121, "fp8": 242.5, "int8": 242.5, "fp32": 30.3}, 300, 24,
              "NVIDIA L4 Tensor Core GPU datasheet (2023): 121 TFLOPS FP16/BF16 dense, 300 GB/s GDDR6"),
}


@dataclass(frozen=True, slots=True)
class Workload:
    params: float
    dtype: str = "fp16"
    prompt_tokens: int = 512
    output_tokens: int = 128
    qps: float = 5000.0
    gpu: str = "h100"
    layers: int | None = None  # default: 32 from 3B parameters up, else 24
    hidden: int | None = None  # default: sqrt(params / (12 · layers)), to a multiple of 1024 (256 below 3072)
    heads: int | None = None  # default: hidden / 128
    kv_heads: int | None = None  # default: heads (no GQA); fewer shrinks the KV cache
    mfu: float = 0.5  # share of peak FLOPs a real prefill reaches
    mbu: float = 0.7  # share of peak bandwidth a real decode step reaches
    max_utilisation: float = 0.7  # busy share that keeps queueing (the P99) in bounds
    memory_reserve: float = 0.1  # of GPU memory kept for activations, allocator slack, CUDA context
    spare_gpus: int = 1  # N+1

    def shape(self) -> tuple[int, int, int, int]:
        layers = self.layers or (32 if self.params >= 3e9 else 24)
        raw = math.sqrt(self.params / (12 * layers))  # a transformer block holds ~12 · hidden² weights
        step = 1024 if raw >= 3072 else 256
        hidden = self.hidden or max(256, round(raw / step) * step)
        heads = self.heads or max(1, hidden // 128)
        kv_heads = self.kv_heads or heads
        if hidden % heads or heads % kv_heads:
            raise ValueError(f"hidden ({hidden}) must split into heads ({heads}), heads into kv_heads ({kv_heads})")
        return layers, hidden, heads, kv_heads


def plan(w: Workload) -> dict[str, Any]:
    if w.dtype not in BYTES:
        raise ValueError(f"unknown dtype {w.dtype!r}; known: {sorted(BYTES)}")
    if w.gpu not in GPUS:
        raise ValueError(f"unknown GPU {w.gpu!r}; known: {sorted(GPUS)}")
    gpu = GPUS[w.gpu]
    if w.dtype not in gpu.dense_tflops:
        raise ValueError(f"{gpu.name} has no {w.dtype} tensor throughput")
    layers, hidden, heads, kv_heads = w.shape()
    b = BYTES[w.dtype]
    peak = gpu.dense_tflops[w.dtype] * 1e12
    bandwidth = gpu.bandwidth_gbs * 1e9
    ridge = peak / bandwidth  # FLOPs per byte where compute and bandwidth take equally long
    weights = w.params * b
    kv_per_token = 2 * layers * hidden * (kv_heads / heads) * b  # K and V, every layer
    context = w.prompt_tokens + w.output_tokens

    # Prefill: every prompt token through the weights, plus attention among the prompt's tokens.
    prefill_flops = 2 * w.params * w.prompt_tokens + 4 * layers * hidden * w.prompt_tokens**2
    prefill_tokens_per_pass = 8192  # a prefill batch; the weights are read once for all of them
    prefill_intensity = (prefill_flops / w.prompt_tokens * prefill_tokens_per_pass) / (
        weights + prefill_tokens_per_pass * kv_per_token)
    prefill_s = prefill_flops * w.qps / (peak * w.mfu)  # GPU-seconds per second of traffic
    prefill_bound = "compute" if prefill_intensity >= ridge else "bandwidth"

    # Decode: one token per running sequence per step; each step reads the weights and every KV cache.
    usable = gpu.memory_gib * 2**30 * (1 - w.memory_reserve)
    kv_per_sequence = context * kv_per_token
    decode_batch = int((usable - weights) // kv_per_sequence) if w.output_tokens and usable > weights else 0
    out: dict[str, Any] = {
        "gpu": gpu.name, "gpu_source": gpu.source, "dtype": w.dtype,
        "shape": {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads},
        "assumptions": {k: v for k, v in asdict(w).items() if k in ("mfu", "mbu", "max_utilisation",
                                                                     "memory_reserve", "spare_gpus")},
        "weights_gib": weights / 2**30,
        "kv_bytes_per_token": kv_per_token,
        "ridge_flops_per_byte": ridge,
        "prefill_flops_per_request": prefill_flops,
        "prefill_flops_per_s": prefill_flops * w.qps,
        "prefill_intensity": prefill_intensity,
        "prefill_bound": prefill_bound,
        "prefill_gpus": math.ceil(prefill_s / w.max_utilisation) if prefill_s else 0,
    }
    if weights > usable:
        raise ValueError(f"the weights ({weights / 2**30:.1f} GiB) do not fit one {gpu.name}: shard them first")
    if w.output_tokens == 0:  # an encoder (or a prompt-only request): prefill is all there is
        out.update({"decode_flops_per_request": 0.0, "decode_flops_per_s": 0.0, "decode_bound": None,
                    "decode_batch": 0, "decode_bytes_per_step": 0.0, "decode_intensity": None,
                    "vram_gib": {"weights": weights / 2**30, "kv_cache": 0.0}, "decode_gpus": 0})
    else:
        if decode_batch < 1:
            raise ValueError(f"no sequence of {context} tokens fits beside the weights on one {gpu.name}")
        mean_context = w.prompt_tokens + w.output_tokens / 2  # a sequence's KV grows as it decodes
        flops_per_token = 2 * w.params + 4 * layers * hidden * mean_context
        step_bytes = weights + decode_batch * mean_context * kv_per_token
        step_flops = decode_batch * flops_per_token
        decode_intensity = step_flops / step_bytes
        step_s = max(step_bytes / (bandwidth * w.mbu), step_flops / (peak * w.mfu))
        tokens_per_gpu_s = decode_batch / step_s
        decode_s = w.qps * w.output_tokens / tokens_per_gpu_s
        out.update({
            "decode_flops_per_request": flops_per_token * w.output_tokens,
            "decode_flops_per_s": flops_per_token * w.output_tokens * w.qps,
            "decode_batch": decode_batch,
            "decode_bytes_per_step": step_bytes,
            "decode_intensity": decode_intensity,
            "decode_bound": "compute" if decode_intensity >= ridge else "bandwidth",
            "decode_step_ms": step_s * 1000,
            "decode_tokens_per_gpu_s": tokens_per_gpu_s,
            "vram_gib": {"weights": weights / 2**30, "kv_cache": decode_batch * kv_per_sequence / 2**30},
            "decode_gpus": math.ceil(decode_s / w.max_utilisation),
        })
    out["total_gpus"] = out["prefill_gpus"] + out["decode_gpus"] + w.spare_gpus
    return out
