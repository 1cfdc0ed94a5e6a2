"""``kinfer topics``: create or grow models' request topics, and the shared ones (replies, the DLQ)."""

from __future__ import annotations

import argparse
import asyncio

from kinfer.ops.cli.common import Command
from kinfer.ops.cli.endpoints import endpoints


def add_arguments(t: argparse.ArgumentParser) -> None:
    t.add_argument("--model", action="append", required=True)
    t.add_argument("--partitions", type=int, default=3)
    t.add_argument("--replication-factor", type=int, default=0,
                   help="copies of each partition (default: 3, or the brokers there are if fewer)")
    t.add_argument("--min-insync-replicas", type=int, default=0,
                   help="copies that must have a write before it is acknowledged (default: the factor less one, >= 1)")


def run(args: argparse.Namespace) -> int:
    from kinfer.ops.localstack.stack import tenant_acls_after_topics
    from kinfer.topics.admin import ensure_topics, model_topic_specs, shared_topic_specs

    bootstrap, _ = endpoints()
    copies = {"replication": args.replication_factor, "min_insync": args.min_insync_replicas}
    specs = [*shared_topic_specs(**copies)]
    for model in args.model:
        specs += model_topic_specs(model, args.partitions, **copies)
    for name, count in sorted(asyncio.run(ensure_topics(bootstrap, specs)).items()):
        print(f"{name}\t{count} partitions")
    tenant_acls_after_topics(bootstrap, args.model)  # a secure local stack: its tenants' ACLs on the new topics
    return 0


# Connects as admin (endpoints() takes admin's credentials from a secure local stack).
COMMAND = Command("topics", "create or grow the request topics of models, and the DLQ", add_arguments, run)
