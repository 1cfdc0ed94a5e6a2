"""A recorded PID may be reused: the stack signals only a process that is its own part, not any broker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kinfer.ops.localstack.stack import KafkaNode, LocalStack, StackInfo, process_alive


def _stand_in(*argv: str) -> subprocess.Popen[bytes]:
    """A process whose command line holds ``argv`` (as another stack's broker or Redis would)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *argv])


def test_another_stacks_broker_and_redis_under_recorded_pids_are_neither_counted_nor_stopped(tmp_path: Path) -> None:
    other = tmp_path / "other"
    broker = _stand_in("kafka.Kafka", str(other / "kafka.properties"))
    redis = _stand_in("redis-server 127.0.0.1:1")  # a Redis's process title: its own port
    try:
        local = LocalStack(tmp_path / "mine")
        local.home.mkdir()
        info = StackInfo(str(local.home), "127.0.0.1:2", "redis://127.0.0.1:3/0", redis_pid=redis.pid,
                         brokers=[KafkaNode(1, 2, 4, pid=broker.pid)])
        local._record(info)
        assert process_alive(broker.pid, "kafka.Kafka") and process_alive(redis.pid, "redis-server")
        status = local.status()
        assert status["kafka_running"] == 0 and status["redis_running"] is False and status["state"] == "down"
        assert local.down() is False  # nothing of this stack was running, and nothing was signalled
        assert broker.poll() is None and redis.poll() is None
        # The same processes, recorded by the stack they belong to, are its own.
        own = LocalStack(other)
        other.mkdir()
        info.home, info.redis_url = str(other), "redis://127.0.0.1:1/0"
        own._record(info)
        assert own.status()["kafka_running"] == 1 and own.status()["redis_running"] is True
    finally:
        for proc in (broker, redis):
            proc.kill()
            proc.wait()
