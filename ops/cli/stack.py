"""``kinfer stack``: the local Kafka + Redis stack (up, down, status, a principal's environment)."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
from pathlib import Path

from kinfer.ops.cli.common import Command


def add_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("action", choices=["up", "down", "status", "env", "fetch", "acls"],
                   help="acls: apply the secure stack's ACL table again (after new models' topics)")
    s.add_argument("--home", help="stack folder (default: $KINFER_HOME, else ~/.local/state/kinfer)")
    s.add_argument("--kafka-port", type=int, help="default: a free port")
    s.add_argument("--redis-port", type=int, help="default: a free port")
    s.add_argument("--brokers", type=int, default=1, help="Kafka brokers in the local cluster (one machine) [1]")
    s.add_argument("--controllers", type=int, default=0,
                   help="KRaft controllers of their own, as production runs them (0: every broker is a "
                        "controller voter too) [0]")
    s.add_argument("--secure", action=argparse.BooleanOptionalAction, default=None,
                   help="up: Kafka over SASL_SSL (SCRAM-SHA-512) with ACLs, Redis with ACL users "
                        "(default: as the stack in --home was; a new one is not secure)")
    s.add_argument("--principal", default="admin",
                   help="env: whose credentials, on a secure stack (admin, kinfer-worker, ..., tenant-demo) [admin]")


def run(args: argparse.Namespace) -> int:
    from kinfer.ops.localstack.stack import LocalStack, StackError, apply_acls, fetch_kafka

    stack = LocalStack(Path(args.home) if args.home else None, args.kafka_port, args.redis_port, args.brokers,
                       secure=args.secure, controllers=args.controllers)
    if args.action == "fetch":
        print(fetch_kafka())
    elif args.action == "up":
        info, started = stack.up()
        what = "started" if started else f"restarted {'+'.join(stack.restarted)} in" if stack.restarted else "reusing"
        print(f"{what} {'secure ' if info.secure else ''}stack in {info.home}")
        print(f"KINFER_BOOTSTRAP={info.bootstrap}\nKINFER_REDIS_URL={info.redis_url}")
        if info.secure:
            print("Kafka: SASL_SSL (SCRAM-SHA-512) with ACLs; Redis: ACL users. Principals: "
                  f"{', '.join(info.secrets().principals)}\n"
                  "each one's environment: kinfer stack env --principal P (secrets in "
                  f"{info.secure_files.root}); kinfer components take their own by themselves")
    elif args.action == "down":
        print("stopped" if stack.down() else "nothing was running")
    elif args.action == "status":
        status = stack.status()
        print(json.dumps(status, indent=2))
        return 0 if status["state"] == "up" else 3
    elif args.action == "env":
        recorded = stack.load()
        if recorded is None:
            raise StackError("no stack: run `kinfer stack up`")
        for key, value in recorded.env(args.principal).items():
            print(f"export {key}={shlex.quote(value)}")
    elif args.action == "acls":
        recorded = stack.load()
        if recorded is None or not recorded.secure:
            raise StackError("no secure stack: run `kinfer stack up --secure`")
        print(f"{asyncio.run(apply_acls(recorded))} ACLs applied (tenants: on every model's topics now listed)")
    return 0


COMMAND = Command("stack", "the local Kafka + Redis stack", add_arguments, run)
