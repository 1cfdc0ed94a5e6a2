"""Worker processes for the demo and the benchmarks, waiting until a model answers, and where the
local Prometheus tools are."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kinfer.ops.localstack.stack import StackInfo
from kinfer.producers import Client
from kinfer.topics import KinferError


def spawn(info: StackInfo, *args: str, log_path: str | None = None) -> subprocess.Popen[bytes]:
    """A ``kinfer`` subcommand as a child process on the stack ``info``."""
    env = {**os.environ, **info.env(), "HF_HUB_OFFLINE": "1"}
    with open(log_path or os.devnull, "ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "kinfer.ops.cli", *args], env=env, stdout=out,
                                stderr=subprocess.STDOUT)


def spawn_worker(info: StackInfo, model: str, *extra: str, log_path: str | None = None) -> subprocess.Popen[bytes]:
    return spawn(info, "worker", "--model", model, *extra, log_path=log_path)


def scrape(port: int) -> dict[str, float]:
    """A worker's Prometheus metrics, each sample name summed over its labels (empty when unreachable)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 30.0, *, group: bool = False) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``; ``group``: to the process group ``proc`` leads (it was
    started in a session of its own), so the children it forked stop with it."""
    def send(sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig) if group else proc.send_signal(sig)

    if proc.poll() is None:
        send(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            send(signal.SIGKILL)
            proc.wait()


async def wait_until_served(client: Client, model: str, timeout_s: float = 180.0) -> None:
    """Probe until the model answers: the worker loaded, joined its group and got partitions."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await client.infer(model, ["ready?"], deadline_ms=3_000)
            return
        except KinferError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)  # refused or not served yet: ask again, but do not hammer


def helm_binary() -> str | None:
    """Helm, as ``make deps`` builds it into the cache from the Go module proxy, else one on the PATH."""
    return _cached_binary(Path("helm") / "helm", "helm")


def prometheus_binary(name: str = "prometheus") -> str | None:
    """Debian's ``prometheus`` or ``promtool``, as ``make deps`` unpacks it into the cache, else one on the PATH."""
    return _cached_binary(Path("prometheus") / "usr" / "bin" / name, name)


def _cached_binary(relative: Path, name: str) -> str | None:
    """A tool ``make deps`` put in the cache (the checkout's .cache/ under make), else ``name`` on the
    PATH; None when there is neither."""
    from kinfer.topics.paths import cache_dir

    for cache in (cache_dir(), Path(__file__).resolve().parents[2] / ".cache"):
        found = cache / relative
        if found.is_file():
            return str(found)
    return shutil.which(name)
