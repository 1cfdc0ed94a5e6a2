"""``kinfer stack``: start, reuse, status, and a stop that leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kinfer.ops.localstack.stack import LocalStack, alive

pytestmark = pytest.mark.integration


def kinfer(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KINFER_BOOTSTRAP", "KINFER_REDIS_URL")}
    return subprocess.run(
        [sys.executable, "-m", "kinfer.ops.cli", "stack", *args, "--home", str(home)],
        capture_output=True, text=True, env=env, timeout=180, check=False,
    )


def test_up_reuses_a_running_stack_and_down_leaves_nothing(tmp_path: Path) -> None:
    first = kinfer(tmp_path, "up")
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("started")
    info = LocalStack(tmp_path).load()
    assert info is not None
    try:
        second = kinfer(tmp_path, "up")
        assert second.returncode == 0 and second.stdout.startswith("reusing"), second.stdout + second.stderr
        assert f"KINFER_BOOTSTRAP={info.bootstrap}" in second.stdout
        status = kinfer(tmp_path, "status")
        assert status.returncode == 0 and '"state": "up"' in status.stdout
        # One part dies: `up` restarts that part alone, on the same port; the other keeps running.
        for dead, kept in (("redis", "kafka"), ("kafka", "redis")):
            before = LocalStack(tmp_path).load()
            assert before is not None
            pid = before.redis_pid if dead == "redis" else before.kafka_pid
            os.kill(pid, signal.SIGKILL)
            again = kinfer(tmp_path, "up")
            assert again.returncode == 0 and again.stdout.startswith(f"restarted {dead}"), again.stdout + again.stderr
            after = LocalStack(tmp_path).load()
            assert after is not None and (after.bootstrap, after.redis_url) == (info.bootstrap, info.redis_url)
            assert getattr(after, f"{kept}_pid") == getattr(before, f"{kept}_pid")
            assert getattr(after, f"{dead}_pid") != pid
        info = LocalStack(tmp_path).load() or info
    finally:
        down = kinfer(tmp_path, "down")
    assert down.returncode == 0 and "stopped" in down.stdout
    assert not alive(info.kafka_pid, "kafka.Kafka")
    assert not alive(info.redis_pid, "redis-server")
    assert kinfer(tmp_path, "status").returncode == 3
    assert "nothing was running" in kinfer(tmp_path, "down").stdout
