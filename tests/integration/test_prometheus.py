"""A real Prometheus (Debian's, unpacked by ``make deps``) scrapes a live gateway under load with the
shipped scrape configuration and rules, and the service level's recordings return data through its
HTTP API: the error and slow-request ratios, the percentiles, the request rate, per model."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kinfer.ops.localstack.procs import prometheus_binary, spawn, stop_process
from kinfer.ops.localstack.stack import StackInfo, free_port
from tests.integration.conftest import WorkerProcess

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "ops" / "deploy" / "prometheus"


def local_config(tmp: Path, gateway_port: int) -> Path:
    """The shipped configuration with its gateway job pointed at this test's gateway, scraped and
    evaluated every second; the shipped rules, their group interval likewise."""
    config = yaml.safe_load((SHIPPED / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "kinfer-gateway")
    job["static_configs"] = [{"targets": [f"127.0.0.1:{gateway_port}"]}]
    config["scrape_configs"] = [job]
    (tmp / "rules").mkdir()
    for path in (SHIPPED / "rules").glob("*.yml"):
        rules = yaml.safe_load(path.read_text())
        for group in rules["groups"]:
            group["interval"] = "1s"
        (tmp / "rules" / path.name).write_text(yaml.safe_dump(rules))
    config["rule_files"] = [str(tmp / "rules" / "*.yml")]
    out = tmp / "prometheus.yml"
    out.write_text(yaml.safe_dump(config))
    return out


def start_prometheus(binary: str, config: Path, tmp: Path, port: int) -> subprocess.Popen[bytes]:
    with open(tmp / "prometheus.log", "wb") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)


async def query(http: httpx.AsyncClient, expr: str) -> list[dict[str, Any]]:
    answer = (await http.get("/api/v1/query", params={"query": expr})).json()
    assert answer["status"] == "success", answer
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


async def test_the_service_level_recordings_return_data_from_a_live_gateway(
    stack: StackInfo, topics: str, spawn_worker: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    binary = prometheus_binary()
    if binary is None:
        pytest.fail("prometheus is missing: `make deps` unpacks Debian's prometheus package into the cache")
    spawn_worker(topics, "--family", "noop")
    gateway_port, prom_port = free_port(), free_port()
    gateway = spawn(stack, "gateway", "--port", str(gateway_port), log_path=str(tmp_path / "gateway.log"))
    prometheus = start_prometheus(binary, local_config(tmp_path, gateway_port), tmp_path, prom_port)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway_port}", timeout=30) as http, \
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{prom_port}", timeout=10) as prom:

            async def scraping() -> bool:
                try:
                    up = await query(prom, 'up{job="kinfer-gateway"} == 1')
                except httpx.TransportError:
                    return False
                return bool(up)

            answered = 0
            for _ in range(600):  # Prometheus scraping the gateway, the worker serving: then 150 requests
                try:
                    ok = (await http.post(f"/v1/models/{topics}/infer", json={"inputs": ["x"]})).status_code == 200
                except httpx.TransportError:
                    ok = False
                answered += ok and (answered > 0 or await scraping())
                if answered >= 150:
                    break
                await asyncio.sleep(0.05 if answered else 0.5)
            assert answered >= 150

            recorded: dict[str, list[dict[str, Any]]] = {}
            names = [r["record"] for g in yaml.safe_load((SHIPPED / "rules" / "kinfer.yml").read_text())["groups"]
                     for r in g["rules"] if "record" in r]
            for _ in range(60):  # scraped every second, recorded every second: within seconds
                recorded = {name: await query(prom, f'{name}{{model="{topics}"}}') for name in names}
                if all(recorded.values()):
                    break
                await asyncio.sleep(1)
            assert {n for n, r in recorded.items() if not r} == set(), "recordings with no data"
            assert float(recorded["model:kinfer_errors:ratio_rate5m"][0]["value"][1]) == 0.0  # every one ended ok
            assert float(recorded["model:kinfer_requests:rate5m"][0]["value"][1]) > 0
            assert 0 < float(recorded["model:kinfer_request_seconds:p99_rate5m"][0]["value"][1]) <= 30
            firing = await query(prom, f'ALERTS{{alertstate="firing",model="{topics}",slo="errors"}}')
            assert firing == []  # nothing failed: no availability alert
    finally:
        prometheus.terminate()
        prometheus.wait(30)
        stop_process(gateway)
