"""``kinfer plan``: capacity math for one model at a rate (FLOPs, bytes, roofline bounds, VRAM, GPUs)."""

from __future__ import annotations

import argparse
import json
import sys

from kinfer.ops.cli.common import Command


def add_arguments(pl: argparse.ArgumentParser) -> None:
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


def run(args: argparse.Namespace) -> int:
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


COMMAND = Command("plan", "capacity math: FLOPs, bytes, roofline bounds, VRAM and GPUs for a rate", add_arguments,
                  run)
