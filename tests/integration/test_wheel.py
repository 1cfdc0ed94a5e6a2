"""The installed package, not the checkout: a wheel built from this tree, installed into a folder of its
own, runs its ``kinfer`` command from another directory — topics, a worker, ``infer`` — on the real
stack, and writes nothing beside its installed code.

The wheel's interpreter starts without ``site`` (``-S``), so the checkout's editable install (a
``.pth`` file) is never seen: ``kinfer`` can only come from the wheel, its dependencies from this
environment's site-packages on ``PYTHONPATH``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import sysconfig
import time
import uuid
from pathlib import Path

import pytest

from kinfer.ops.localstack.stack import StackInfo
from tests import ROOT
from tests.integration.conftest import delete_model_topics

pytestmark = pytest.mark.integration



@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from the checkout and installed (no dependencies) into a folder of its own."""
    out = tmp_path_factory.mktemp("wheel")
    uv = [sys.executable, "-m", "uv"]  # the environment's own installer (it holds no pip: see uv.lock)
    subprocess.run([*uv, "build", "--quiet", "--wheel", "--no-build-isolation", "--python", sys.executable,
                    "--out-dir", str(out / "dist"), str(ROOT)], check=True, capture_output=True)
    wheel = next((out / "dist").glob("kinfer-*.whl"))
    target = out / "site"
    subprocess.run([*uv, "pip", "install", "--quiet", "--no-deps", "--python", sys.executable, "--target",
                    str(target), str(wheel)], check=True, capture_output=True)
    (target / ".lock").unlink(missing_ok=True)  # uv's own lock on the folder: not the wheel's
    return target


def files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if "__pycache__" not in p.parts}


def test_an_installed_wheel_serves_from_another_directory(installed: Path, stack: StackInfo, tmp_path: Path) -> None:
    # Only kinfer at the top: no generic names (ops, topics, ...) in anyone's site-packages.
    assert {p.name for p in installed.iterdir() if not p.name.endswith((".dist-info", "bin"))} == {"kinfer"}
    before = files(installed)
    home = tmp_path / "home"
    env = {**os.environ, **stack.env(), "PYTHONPATH": f"{installed}{os.pathsep}{sysconfig.get_paths()['purelib']}",
           "KINFER_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("KINFER_CACHE", None)  # the default: under KINFER_HOME, never beside the code
    kinfer = [sys.executable, "-S", str(installed / "bin" / "kinfer")]  # the wheel's console script

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*kinfer, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)

    where = subprocess.run([sys.executable, "-S", "-c", "import kinfer.ops.cli as c; print(c.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(installed)), where
    assert run("--version").stdout.startswith("kinfer ")
    model = f"wheel-{uuid.uuid4().hex[:8]}"
    assert run("topics", "--model", model, "--partitions", "1").returncode == 0
    worker = subprocess.Popen([*kinfer, "worker", "--model", model, "--family", "noop"], cwd=tmp_path, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            answer = run("infer", "--model", model, "--deadline-ms", "5000", "from the wheel")
            if answer.returncode == 0:
                break
            assert worker.poll() is None and time.monotonic() < deadline, answer.stderr
            time.sleep(1.0)
        assert '"status": "ok"' in answer.stdout, answer.stdout
    finally:
        worker.send_signal(signal.SIGTERM)
        stopped = worker.wait(60)
        asyncio.run(delete_model_topics(stack.bootstrap, model))  # a later fuzzer must not find it unserved
    assert stopped == 0
    assert files(installed) == before  # state and caches went to KINFER_HOME, not into the installed code
