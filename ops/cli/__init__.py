"""The ``kinfer`` command line: a registry of commands, one module each.

Each module (``stack``, ``topics``, ``worker``, ...) defines one ``Command`` (``common.py``): its name and
help, its flags, its handler, the principal it acts as on a secure local stack, and whether it is a
long-running service. ``build_parser`` and ``main`` read everything from ``COMMANDS``; handlers import
what they run when they run it, so the command line starts without loading models, clients or servers.
``docs/cli.md`` is rendered from the same parser (``python -m kinfer.ops.cli.reference``).
"""

from __future__ import annotations

import argparse
import os

from kinfer.ops.cli import (
    autoscale,
    bench,
    demo,
    gateway,
    infer,
    lagmon,
    place,
    plan,
    simulate,
    stack,
    status,
    telemetry,
    tenant_key,
    topics,
    worker,
)
from kinfer.ops.cli.common import Command, one_line, show_defaults
from kinfer.ops.cli.endpoints import take_principal
from kinfer.ops.cli.observability import configure_logging, configure_tracing

# In the order ``kinfer --help`` lists them.
COMMANDS: dict[str, Command] = {module.COMMAND.name: module.COMMAND for module in (
    stack, topics, worker, infer, gateway, tenant_key, plan, place, lagmon, autoscale, simulate, telemetry, status,
    demo, bench,
)}


def _version() -> str:
    from kinfer import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kinfer", description="Kafka-driven asynchronous inference")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--debug", action="store_true", help="a failure shows its traceback (also: KINFER_DEBUG=1)")
    p.add_argument("--version", action="version", version=f"kinfer {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_arguments(sub.add_parser(command.name, help=command.help, epilog=command.epilog))
    show_defaults(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = COMMANDS[args.command]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models load from local folders only
    try:
        configure_logging(args.verbose)  # KINFER_LOG_FORMAT: text or json
        if command.service:
            configure_tracing(command.name)  # off unless OTEL_TRACES_EXPORTER names an exporter
        # A secure local stack: each component connects as its own principal, unless told otherwise
        # (``--emit`` only prints: it connects to nothing).
        if command.principal and not getattr(args, "emit", None):
            take_principal(command.principal)
        return int(command.run(args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        # Mistakes a user can fix end in one line that says what to do, not a traceback; --debug (or
        # KINFER_DEBUG=1) shows it.
        if args.debug or os.environ.get("KINFER_DEBUG"):
            raise
        return one_line(command, exc)
