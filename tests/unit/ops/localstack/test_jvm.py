"""The local stack's brokers take extra JVM options from ``KAFKA_OPTS``, after their own, as Kafka's scripts do."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from kinfer.ops.localstack import stack
from kinfer.ops.localstack.stack import KafkaNode, LocalStack, StackInfo


def _command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    started: list[list[str]] = []

    def spawn(cmd: list[str], log: Path) -> int:
        started.append(cmd)
        return 4242

    def run(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 0, "", "")  # storage format: nothing to do here

    monkeypatch.setattr(stack, "_spawn", spawn)
    monkeypatch.setattr(stack.subprocess, "run", run)
    node = KafkaNode(1, 9092, 9093)
    info = StackInfo(str(tmp_path), "127.0.0.1:9092", "redis://127.0.0.1:6379/0", brokers=[node])
    LocalStack(tmp_path)._start_kafka("java", tmp_path, node, info)
    assert len(started) == 1
    return started[0]


def test_kafka_opts_follow_the_stacks_own_and_precede_the_main_class(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFKA_OPTS", "-XX:TieredStopAtLevel=1  -Dkinfer.test='a b'")
    cmd = _command(tmp_path, monkeypatch)
    main = cmd.index("kafka.Kafka")
    assert cmd.index("-XX:+UseG1GC") < cmd.index("-XX:TieredStopAtLevel=1") < main
    assert "-Dkinfer.test=a b" in cmd[:main]  # quoted as a shell would


def test_without_kafka_opts_the_command_is_the_stacks_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KAFKA_OPTS", raising=False)
    cmd = _command(tmp_path, monkeypatch)
    assert not any("Tiered" in part for part in cmd) and "" not in cmd
