"""``kinfer gateway``: the HTTP / SSE / WebSocket gateway over the client library."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from kinfer.ops.cli.common import Command
from kinfer.ops.cli.endpoints import endpoints


def add_arguments(g: argparse.ArgumentParser) -> None:
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--tenants", help="JSON file of tenants with hashed API keys (see ops/deploy/tenants.example.json); "
                                     "required on a --host other than loopback")
    g.add_argument("--allow-anonymous", action="store_true",
                   help="serve every caller, unauthenticated and unlimited, on a non-loopback --host without --tenants")
    g.add_argument("--hash-key", metavar="KEY", help="print the SHA-256 of an API key for the tenants file, and exit")
    g.add_argument("--header-timeout-s", type=float, default=10.0,
                   help="close a connection that has not sent a request's headers within this [10]")
    g.add_argument("--keep-alive-s", type=int, default=5, help="close a keep-alive connection idle this long [5]")
    g.add_argument("--max-connections", type=int, default=4096,
                   help="connections served at once; more are answered 503 [4096]")


async def _reachable(bootstrap: str, redis_url: str) -> None:
    """Connects to Kafka and Redis once: a dead broker or Redis fails here, in one line, not later."""
    from kinfer.producers import Client

    async with Client(bootstrap, redis_url, admission=False, tenant="gateway"):
        pass


def run(args: argparse.Namespace) -> int:
    from kinfer.producers.tenants import Tenants, hash_key, is_loopback

    if args.hash_key:
        print(hash_key(args.hash_key))
        return 0
    if not args.tenants and not args.allow_anonymous and not is_loopback(args.host):
        raise ValueError(f"--host {args.host} can be reached from other machines: pass --tenants FILE (hashed "
                         "API keys: see ops/deploy/tenants.example.json and --hash-key), or --allow-anonymous to serve "
                         "every caller")
    import uvicorn

    from kinfer.producers.gateway import GatewaySettings, create_app
    from kinfer.producers.http import MAX_FRAME_BYTES, guarded_protocol, return_freed_buffers

    bootstrap, redis_url = endpoints()
    tenants = Tenants.from_file(args.tenants) if args.tenants else None
    if tenants is None:
        logging.getLogger(__name__).warning("no --tenants file: the gateway accepts every caller%s",
                                            "" if is_loopback(args.host) else f" on {args.host} (--allow-anonymous)")
    return_freed_buffers()  # uploads and downloads pass 0.5 MiB chunks
    asyncio.run(_reachable(bootstrap, redis_url))  # a dead broker or Redis: one line now, not a traceback later
    app = create_app(GatewaySettings(bootstrap, redis_url, tenants))
    loop = os.environ.get("KINFER_GATEWAY_LOOP", "asyncio")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", loop=loop,
                http=guarded_protocol(args.header_timeout_s), limit_concurrency=args.max_connections,
                timeout_keep_alive=args.keep_alive_s, ws_max_size=MAX_FRAME_BYTES)
    return 0


COMMAND = Command("gateway", "the HTTP / SSE / WebSocket gateway (OpenAI-compatible endpoints too)", add_arguments,
                  run, principal="kinfer-gateway", service=True)
