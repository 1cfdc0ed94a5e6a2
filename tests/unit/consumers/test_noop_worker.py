"""A worker of the noop family (the simulated accelerator of the benches and the suite) never imports
torch: importing it was 3 s of CPU, most of such a worker's start."""

from __future__ import annotations

import subprocess
import sys

import pytest

CODE = """
import sys
from kinfer.consumers.runners import ModelSpec
from kinfer.consumers.settings import WorkerSettings
from kinfer.consumers.worker import Worker
worker = Worker(WorkerSettings(models=(ModelSpec("m", "noop"),), bootstrap="127.0.0.1:1", redis_url="redis://x"))
print(worker.feeds["m"].core.runner.device, worker.executors, "torch" in sys.modules)
"""


@pytest.mark.parametrize(("env", "expected"), [({}, "cpu 1 False"), ({"KINFER_DEVICE": "cuda:1"}, "cuda:1 1 False")])
def test_a_noop_worker_is_built_without_torch(env: dict[str, str], expected: str) -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", **env}).stdout
    assert out.strip() == expected
