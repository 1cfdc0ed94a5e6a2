"""What every ``kinfer`` command shares: the command object, flags generated from settings classes,
``--help`` that shows each default, the metrics endpoint, and the one-line error a failure ends in."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import sys
import typing
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Command:
    """One ``kinfer NAME``: everything about it lives in its module, in one of these."""

    name: str  # what follows ``kinfer``
    help: str  # its line in ``kinfer --help``
    add_arguments: Callable[[argparse.ArgumentParser], None]  # its flags, on its own subparser
    run: Callable[[argparse.Namespace], int]  # the handler: the exit code
    # Whose credentials it takes from a secure local stack before it runs (``ops.localstack.stack.
    # apply_stack_env``); None: none taken up front (a command that connects resolves as admin).
    principal: str | None = None
    # Long-running: an unexpected failure is logged with its traceback too (its output is a log).
    service: bool = False
    epilog: str | None = None  # under its flags in ``kinfer NAME --help``


def add_settings_args(p: argparse.ArgumentParser, cls: type, flags: dict[str, str]) -> None:
    """One ``--flag`` per field named in ``flags``: type, choices and default from the settings class
    (the class holds each default, one source; ``flags`` the help)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name, text in flags.items():
        field = fields[name]
        default = None if field.default is dataclasses.MISSING else field.default
        kind, choices = _flag_type(hints[name])
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, choices=choices, default=default,
                       help=f"{text} [%(default)s]")


def _flag_type(hint: Any) -> tuple[Any, list[str] | None]:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return str, [str(a) for a in typing.get_args(hint)]
    if args and typing.get_origin(hint) is not typing.Literal:  # X | None
        return _flag_type(args[0])
    return hint, None


def settings_default(cls: type, name: str) -> Any:
    """A settings class's default for one field: a flag that mirrors it says the same."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def settings_from_args(args: argparse.Namespace, flags: dict[str, str]) -> dict[str, Any]:
    return {name: getattr(args, name) for name in flags}


_SAYS = re.compile(r"\[[^\]]*\]\s*$")  # a help that ends in "[value]" shows its default already


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option's default in its help, as ``[default]``, where the help does not say it already."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                show_defaults(child)
            continue
        default = action.default
        if not action.option_strings or default in (None, False, argparse.SUPPRESS) or default == []:
            continue
        text = action.help or ""
        if text == argparse.SUPPRESS or "%(default)" in text or "default" in text.lower() or _SAYS.search(text):
            continue
        action.help = f"{text} [%(default)s]".strip()


def add_metrics_args(p: argparse.ArgumentParser) -> None:
    """``--metrics-port`` and ``--metrics-host`` of a service (``serve_metrics`` reads them)."""
    p.add_argument("--metrics-port", type=int)
    p.add_argument("--metrics-host", default="127.0.0.1", help="address the metrics endpoint binds")


def serve_metrics(args: argparse.Namespace) -> None:
    """Prometheus metrics on ``--metrics-port`` (at ``--metrics-host``), when asked for."""
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_host)


def one_line(command: Command, exc: Exception) -> int:
    """A failure ends in one line on stderr that says what to do, not a traceback: exit 2 for mistakes a
    user can fix (a model that is not served, a bad flag or file, a dead broker), 1 for anything else
    (named by its type, with the hint that ``--debug`` shows where). A service's unexpected failure is
    logged with its traceback too."""
    from kinfer.ops.deploy.secure import SetupError
    from kinfer.topics.errors import KinferError

    while isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:  # a task group's one failure
        inner = exc.exceptions[0]
        if not isinstance(inner, Exception):
            break
        exc = inner
    expected = isinstance(exc, SetupError | KinferError | ValueError | OSError)
    if not expected and command.service:
        # A service that crashed: its log keeps where (one line on the terminal is for commands).
        logging.getLogger(__name__).error("kinfer %s failed", command.name, exc_info=exc)
    what = str(exc) if expected else f"{type(exc).__name__}: {exc}"
    hint = "" if expected else f" (kinfer --debug {command.name} ... shows where)"
    print(f"kinfer {command.name}: {what or type(exc).__name__}{hint}", file=sys.stderr)
    return 2 if expected else 1
