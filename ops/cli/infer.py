"""``kinfer infer``: send one request and print its result."""

from __future__ import annotations

import argparse
import asyncio
import json

from kinfer.ops.cli.common import Command
from kinfer.ops.cli.endpoints import endpoints


def add_arguments(i: argparse.ArgumentParser) -> None:
    i.add_argument("--model", required=True)
    i.add_argument("--priority", type=int, default=1)
    i.add_argument("--deadline-ms", type=int, default=10_000)
    i.add_argument("--tenant", default="cli")
    i.add_argument("text", nargs="+")


def run(args: argparse.Namespace) -> int:
    import msgspec

    from kinfer.producers import Client

    bootstrap, redis_url = endpoints()

    async def main() -> None:
        async with Client(bootstrap, redis_url, tenant=args.tenant) as client:
            result = await client.infer(args.model, args.text, priority=args.priority, deadline_ms=args.deadline_ms)
            print(json.dumps({"id": result.id, "status": result.status, "outputs": result.outputs,
                              "timings": msgspec.to_builtins(result.timings), "worker": result.worker}))

    asyncio.run(main())
    return 0


COMMAND = Command("infer", "send one request and print its result", add_arguments, run, principal="admin")
