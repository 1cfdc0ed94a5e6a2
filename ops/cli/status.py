"""``kinfer status``: per model, lag, rates, level, throughput and sheds; the recent level changes."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from kinfer.ops.cli.common import Command
from kinfer.ops.cli.endpoints import endpoints


def add_arguments(st: argparse.ArgumentParser) -> None:
    st.add_argument("--decisions", type=int, default=10, help="how many level changes to show")
    st.add_argument("--json", action="store_true", help="one JSON object")


def run(args: argparse.Namespace) -> int:
    import redis.asyncio as aioredis

    from kinfer.ops.control.status import render, snapshot

    _, redis_url = endpoints()

    async def main() -> Any:
        redis = aioredis.Redis.from_url(redis_url)
        try:
            return await snapshot(redis, args.decisions)
        finally:
            await redis.aclose()

    snap = asyncio.run(main())
    print(json.dumps(snap.to_json()) if args.json else render(snap))
    return 0


# Connects as admin (endpoints() takes admin's credentials from a secure local stack).
COMMAND = Command("status", "per model: lag, rates, level, throughput, sheds; recent decisions", add_arguments, run)
