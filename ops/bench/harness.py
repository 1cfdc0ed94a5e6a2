"""What every benchmark shares: the stack it runs on, waiting until what it started answers, the CPU
a process spent, and its progress log. The service level it judges by is ``ops.capacity.sla``'s."""

from __future__ import annotations

import contextlib
import os
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from kinfer.ops.localstack.procs import wait_until_served
from kinfer.ops.localstack.stack import LocalStack, StackInfo
from kinfer.producers import Client


def log(text: str) -> None:
    """A benchmark's progress line: on stderr, so that stdout stays the report."""
    print(text, file=sys.stderr, flush=True)


# -- the stack ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def local_stack(info: StackInfo | None = None, stack: LocalStack | None = None, *, timeout_s: float = 90.0,
                say: Callable[[str], None] | None = None) -> Iterator[StackInfo]:
    """The stack a benchmark runs on: ``info`` when given (the caller's Kafka and Redis, left as they
    are); else ``stack`` (by default the local stack of ``kinfer stack up``), reused if it runs, else
    started here and then stopped on the way out, whatever happened inside. A stack that was already
    running is left running: someone else may be using it. ``say``, when given, is told which stack
    it is and when it stopped."""
    if info is not None:
        yield info
        return
    stack = stack or LocalStack()
    info, started = stack.up(timeout_s=timeout_s)
    if say is not None:
        say(f"{'started' if started else 'reusing'} Kafka at {info.bootstrap}, Redis at {info.redis_url}")
    try:
        yield info
    finally:
        if started:
            stack.down()
            if say is not None:
                say("stack stopped")


# -- waiting until what a benchmark started answers ----------------------------------------------------


async def wait_served(info: StackInfo, model: str) -> None:
    """Until ``model`` answers on the stack ``info`` (its workers loaded, in their group, with partitions)."""
    async with Client(info.bootstrap, info.redis_url, tenant="bench") as client:
        await wait_until_served(client, model)


def wait_http(url: str, timeout_s: float = 60.0, path: str = "/healthz",
              alive: Callable[[], bool] = lambda: True) -> None:
    """Until the server at ``url`` (by default kinfer's gateway) answers ``path`` with 200; a server
    that is no longer ``alive`` is not waited for."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not alive():
            raise RuntimeError(f"{url} stopped before it answered {path}")
        try:
            with urllib.request.urlopen(f"{url}{path}", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


# -- CPU ------------------------------------------------------------------------------------------------


_TICK_S = os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """The PIDs of ``pid``'s children, their children and so on (from /proc; those alive now)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo += children.get(child, [])
    return sorted(found)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (all its threads), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK_S  # utime, stime (fields 14 and 15 of stat)
