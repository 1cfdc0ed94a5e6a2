"""``kinfer place``: dedicated pools for hot models, the long tail co-located on the rest."""

from __future__ import annotations

import argparse
import json
import sys

from kinfer.ops.cli.common import Command, settings_default


def add_arguments(pc: argparse.ArgumentParser) -> None:
    from kinfer.ops.capacity.placement import Fleet

    pc.add_argument("--models", required=True,
                    help="JSON/YAML: [{name, footprint_gib, replica_rps, expected_rps, family?, path?, keep_warm?}] "
                         "(see ops/deploy/models.example.yaml)")
    pc.add_argument("--gpus", type=int, required=True, help="GPUs to place on")
    pc.add_argument("--gpu-memory", type=float, required=True, metavar="GIB", help="device memory of one GPU")
    pc.add_argument("--target-utilisation", "--max-utilisation", type=float,
                    default=settings_default(Fleet, "target_utilisation"),
                    help="busy share per GPU that keeps the P99 in bounds [%(default)s]")
    pc.add_argument("--dedicated-threshold", type=float, default=settings_default(Fleet, "dedicated_threshold"),
                    help="GPUs of compute (at the target utilisation) from which a model gets its own pool "
                         "[%(default)s]")
    pc.add_argument("--keep-warm", type=int, default=settings_default(Fleet, "keep_warm"),
                    help="warm replicas of every model at least (a model's keep_warm overrides) [%(default)s]")
    pc.add_argument("--memory-headroom", type=float, default=settings_default(Fleet, "memory_headroom"),
                    help="share of GPU memory left free (context, allocator, activations) [%(default)s]")
    pc.add_argument("--spare-replicas", type=int, default=settings_default(Fleet, "spare_replicas"),
                    help="extra replicas per dedicated pool (1: N+1) [%(default)s]")
    out = pc.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="one JSON object")
    out.add_argument("--emit", choices=["k8s"], help="print Kubernetes Deployments for the pools")


def run(args: argparse.Namespace) -> int:
    from kinfer.ops.capacity.placement import Fleet, load_models, place, render_k8s, render_table

    fleet = Fleet(gpus=args.gpus, gpu_memory_gib=args.gpu_memory, target_utilisation=args.target_utilisation,
                  dedicated_threshold=args.dedicated_threshold, keep_warm=args.keep_warm,
                  memory_headroom=args.memory_headroom, spare_replicas=args.spare_replicas)
    placement = place(load_models(args.models), fleet)  # a bad file or setting: ValueError, exit 2 in main
    if args.json:
        print(json.dumps(placement.to_dict()))
    elif not placement.feasible:
        print(f"kinfer place: {render_table(placement)}", file=sys.stderr)
    elif args.emit == "k8s":
        print(render_k8s(placement), end="")
    else:
        print(render_table(placement))
    return 0 if placement.feasible else 1


COMMAND = Command("place", "placement: dedicated pools for hot models, the long tail co-located on the rest",
                  add_arguments, run)
