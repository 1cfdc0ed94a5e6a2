"""``python -m kinfer.ops.healthcheck``: is this container's kinfer process serving? (the image's HEALTHCHECK)

One image runs every role; the check reads the role from the container's main process (PID 1, the
``kinfer ...`` command the entrypoint ``exec``s) and asks what that role offers: the gateway its
``/healthz``; a worker, the lag monitor, the telemetry processor or the autoscaler its metrics port
when it serves one (a worker opens it once its model is loaded and warm). A role that offers
neither is healthy while it runs. Exit 0 healthy, 1 not (Docker's convention).
"""

from __future__ import annotations

import contextlib
import io
import socket
import sys
import urllib.request
from pathlib import Path
from typing import Any

TIMEOUT_S = 3.0


def probe(argv: list[str]) -> tuple[str, int] | None:
    """What to ask for the command ``argv`` (``kinfer ROLE ...``): ("http", port) for the gateway's
    /healthz, ("tcp", port) for a metrics port; None when there is nothing to ask."""
    if not argv or Path(argv[0]).name != "kinfer":
        return None
    from kinfer.ops.cli import build_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args: Any = build_parser().parse_args(argv[1:])
    except SystemExit:
        return None  # not a command this kinfer knows: nothing to ask it
    if getattr(args, "command", None) == "gateway":
        return ("http", args.port)
    port = getattr(args, "metrics_port", None)
    return ("tcp", port) if port else None


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
