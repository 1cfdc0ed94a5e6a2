"""``kinfer stack``: start, reuse, status, and a stop that leaves no process behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ops.stack import LocalStack, _alive

pytestmark = pytest.mark.integration


def kinfer(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KINFER_BOOTSTRAP", "KINFER_REDIS_URL")}
    return subprocess.run(
        [sys.executable, "-m", "ops.cli", "stack", *args, "--home", str(home)],
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
    finally:
        down = kinfer(tmp_path, "down")
    assert down.returncode == 0 and "stopped" in down.stdout
    assert not _alive(info.kafka_pid, "kafka.Kafka")
    assert not _alive(info.redis_pid, "redis-server")
    assert kinfer(tmp_path, "status").returncode == 3
    assert "nothing was running" in kinfer(tmp_path, "down").stdout
