"""``python -m kinfer.ops.deploy.healthcheck``: is this container's kinfer process serving? (the image's HEALTHCHECK)

One image runs every role; the check reads the role from the container's main process (PID 1, the
``kinfer ...`` command the entrypoint ``exec``s — started through its ``#!`` interpreter, so
``/proc/1/cmdline`` reads ``python .../bin/kinfer worker ...``) and asks what that role offers: the
gateway its ``/healthz``; a worker, the lag monitor, the telemetry processor or the autoscaler its
metrics port when it serves one (a worker opens it once its model is loaded and warm). A role that
offers neither is healthy while it runs. Exit 0 healthy, 1 not (Docker's convention).

It reads the command line by hand, importing nothing of kinfer: it runs every few seconds beside a
busy worker, under Docker's timeout.
"""

from __future__ import annotations

import socket
import sys
import urllib.request
from pathlib import Path

TIMEOUT_S = 3.0
GATEWAY_PORT = 8000  # ``kinfer gateway``'s default --port


def probe(argv: list[str]) -> tuple[str, int] | None:
    """What to ask for the process ``argv``: ("http", port) for the gateway's /healthz, ("tcp", port)
    for a metrics port; None when it is not a kinfer command or offers nothing to ask."""
    args = _kinfer_args(argv)
    if not args:
        return None
    role = next((a for a in args if not a.startswith("-")), None)
    if role == "gateway":
        return ("http", _option(args, "--port") or GATEWAY_PORT)
    port = _option(args, "--metrics-port")
    return ("tcp", port) if port else None


def _kinfer_args(argv: list[str]) -> list[str] | None:
    """The arguments after the ``kinfer`` script (run as ``kinfer``, ``python .../kinfer`` or
    ``python -m kinfer.ops.cli``), else None."""
    for i, arg in enumerate(argv):
        if Path(arg).name == "kinfer":
            return argv[i + 1:]
        if arg == "-m" and argv[i + 1:i + 2] == ["kinfer.ops.cli"]:
            return argv[i + 2:]
    return None


def _option(args: list[str], name: str) -> int | None:
    """The integer value of ``--name N`` or ``--name=N``."""
    for arg, following in zip(args, [*args[1:], ""], strict=True):
        _, eq, inline = arg.partition("=")
        value = inline if eq and arg.startswith(f"{name}=") else following if arg == name else None
        if value is not None:
            return int(value) if value.isdigit() else None
    return None


def healthy(target: tuple[str, int] | None, host: str = "127.0.0.1") -> bool:
    if target is None:
        return True
    kind, port = target
    try:
        if kind == "http":
            with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=TIMEOUT_S) as resp:
                return bool(resp.status == 200)
        socket.create_connection((host, port), TIMEOUT_S).close()
        return True
    except OSError:
        return False


def main_command(pid: int = 1) -> list[str]:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


if __name__ == "__main__":
    sys.exit(0 if healthy(probe(main_command())) else 1)
