"""The local process supervisor: ``kinfer worker`` processes for one model on this machine.

Each worker runs with a static group instance id of its own slot. Scale-down is SIGTERM to the
newest: the worker stops fetching, finishes and answers what it holds, commits and leaves the group
(nothing lost). A worker that dies is started again in its slot (same instance id: it rejoins
without a rebalance), after a growing pause. ``kinfer autoscale --mode local`` drives it through
``ops.control.autoscaler.AutoscaleLoop`` like any other ``Pool``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from kinfer.ops.control.autoscaler import RESTARTS
from kinfer.ops.localstack.procs import spawn_worker
from kinfer.ops.localstack.stack import StackInfo
from kinfer.topics.names import consumer_group

log = logging.getLogger(__name__)


@dataclass
class LocalPool:
    """``kinfer worker`` processes for one model on this machine, one per slot."""

    info: StackInfo
    model: str
    worker_args: list[str] = field(default_factory=list)  # passed to each worker (--family, --option, ...)
    log_dir: Path | None = None
    drain_timeout_s: float = 30.0
    mode: str = field(default="local", init=False)
    slots: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    stopping: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)  # SIGTERMed, draining
    restarts: int = 0
    started: int = 0
    # A worker that keeps dying (a bad flag, a missing model) is started again after 1, 2, 4 ... 60 s.
    _backoff: dict[int, tuple[float, float]] = field(default_factory=dict)  # slot -> (next start, delay)

    async def replicas(self) -> int:
        for slot, proc in list(self.stopping.items()):
            if proc.poll() is not None:
                del self.stopping[slot]
        now = time.monotonic()
        for slot, proc in list(self.slots.items()):
            if proc.poll() is None:
                continue
            # Died: the same slot again (its instance id rejoins at once), after a growing pause.
            at, delay = self._backoff.get(slot, (0.0, 0.5))
            if now < at:
                continue
            delay = min(60.0, delay * 2)
            self._backoff[slot] = (now + delay, delay)
            log.warning("%s worker %d exited with %s: starting it again (next time no sooner than in %.0f s)",
                        self.model, slot, proc.returncode, delay)
            self.restarts += 1
            RESTARTS.labels(self.model).inc()
            self.slots[slot] = self._spawn(slot)
        return len(self.slots)

    async def scale(self, n: int) -> None:
        while len(self.slots) < n:
            slot = next(i for i in range(len(self.slots) + len(self.stopping) + 1)
                        if i not in self.slots and i not in self.stopping)  # a draining one keeps its id
            self.slots[slot] = self._spawn(slot)
        while len(self.slots) > n:
            slot = max(self.slots)  # the newest slot goes first
            proc = self.slots.pop(slot)
            proc.send_signal(signal.SIGTERM)  # it drains: finishes what it holds, commits, leaves the group
            self.stopping[slot] = proc

    async def close(self) -> None:
        """Stop every worker (each drains) and wait for them."""
        await self.scale(0)
        deadline = time.monotonic() + self.drain_timeout_s + 15.0
        while self.stopping and time.monotonic() < deadline:
            await self.replicas()
            await asyncio.sleep(0.1)
        for proc in self.stopping.values():
            proc.kill()
            proc.wait()
        self.stopping.clear()

    def pids(self) -> list[int]:
        return [p.pid for p in self.slots.values()]

    def _spawn(self, slot: int) -> subprocess.Popen[bytes]:
        self.started += 1
        instance = f"{consumer_group(self.model)}-{slot}"
        log_path = str(self.log_dir / f"autoscale-{self.model}-{slot}.log") if self.log_dir else None
        return spawn_worker(self.info, self.model, "--instance-id", instance, "--worker-id", instance,
                            "--drain-timeout-s", str(self.drain_timeout_s), *self.worker_args, log_path=log_path)
