"""A cluster's metadata quorum: on the brokers themselves (combined mode) or on controllers of its own."""

from __future__ import annotations

import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from kinfer.ops.localstack import stack
from kinfer.ops.localstack.stack import LocalStack, StackInfo


def _start_all(local: LocalStack, info: StackInfo, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Start every node of ``info`` with nothing run: each node's properties, and its command by file name."""
    commands: dict[str, list[str]] = {}

    def spawn(cmd: list[str], log: Path) -> int:
        commands[Path(cmd[-1]).stem] = cmd
        return 4242

    def run(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 0, "", "")  # storage format: nothing to do here

    monkeypatch.setattr(stack, "_spawn", spawn)
    monkeypatch.setattr(stack.subprocess, "run", run)
    local.home.mkdir(parents=True, exist_ok=True)
    for node in info.nodes:
        local._start_kafka("java", local.home, node, info)
    return commands


def _properties(local: LocalStack, name: str) -> dict[str, str]:
    lines = (local.home / f"{name}.properties").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line)


def test_controllers_of_its_own_hold_the_quorum_and_the_brokers_only_serve(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    local = LocalStack(tmp_path / "stack", brokers=3, controllers=3)
    info = local._new(secure=False)
    commands = _start_all(local, info, monkeypatch)
    assert sorted(commands) == ["controller-1", "controller-2", "controller-3", "kafka-1", "kafka-2", "kafka-3"]
    voters = ",".join(f"{100 + i}@127.0.0.1:{c.controller_port}" for i, c in enumerate(info.controllers, 1))
    for i, controller in enumerate(info.controllers, 1):
        p = _properties(local, f"controller-{i}")
        assert p["process.roles"] == "controller" and p["node.id"] == str(100 + i)
        assert p["listeners"] == f"CONTROLLER://127.0.0.1:{controller.controller_port}"
        assert "advertised.listeners" not in p  # a controller serves no client
        assert p["controller.quorum.voters"] == voters
        assert p["broker.session.timeout.ms"] == "3000"  # the controllers fence a silent broker
        assert "-Xmx256m" in commands[f"controller-{i}"]
    for broker in info.brokers:
        p = _properties(local, f"kafka-{broker.node_id}")
        assert p["process.roles"] == "broker" and p["controller.quorum.voters"] == voters
        assert p["listeners"] == p["advertised.listeners"] == f"PLAINTEXT://127.0.0.1:{broker.port}"
        assert p["default.replication.factor"] == "3" and p["min.insync.replicas"] == "2"
        assert "-Xmx512m" in commands[f"kafka-{broker.node_id}"]
    assert info.bootstrap == ",".join(f"127.0.0.1:{b.port}" for b in info.brokers)  # clients reach brokers only
    assert len({local._kafka(n, info) for n in info.nodes}) == 6  # each process known by its own config


def test_without_controllers_every_broker_is_a_voter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = LocalStack(tmp_path / "stack", brokers=3)
    info = local._new(secure=False)
    commands = _start_all(local, info, monkeypatch)
    assert sorted(commands) == ["kafka-1", "kafka-2", "kafka-3"] and not info.controllers
    voters = ",".join(f"{b.node_id}@127.0.0.1:{b.controller_port}" for b in info.brokers)
    for broker in info.brokers:
        p = _properties(local, f"kafka-{broker.node_id}")
        assert p["process.roles"] == "broker,controller" and p["controller.quorum.voters"] == voters
        assert p["listeners"] == (f"PLAINTEXT://127.0.0.1:{broker.port},"
                                  f"CONTROLLER://127.0.0.1:{broker.controller_port}")


def test_the_record_keeps_the_quorum_and_an_older_one_reads_as_combined(tmp_path: Path) -> None:
    info = LocalStack(tmp_path, brokers=3, controllers=3)._new(secure=False)
    again = StackInfo.from_json(asdict(info))
    assert again == info and [n.roles for n in again.nodes] == ["controller"] * 3 + ["broker"] * 3
    older = {"home": str(tmp_path), "bootstrap": "127.0.0.1:2", "redis_url": "redis://127.0.0.1:3/0",
             "brokers": [{"node_id": 1, "port": 2, "controller_port": 4, "pid": 0, "log": ""}]}
    read = StackInfo.from_json(older)
    assert read is not None and read.controllers == [] and read.brokers[0].roles == "broker,controller"
    assert read.voters == "1@127.0.0.1:4"


def test_a_quorum_size_out_of_range_is_refused(tmp_path: Path) -> None:
    with pytest.raises(stack.StackError, match="controllers"):
        LocalStack(tmp_path, brokers=3, controllers=10)
