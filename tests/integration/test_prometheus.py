"""A real Prometheus (Debian's, unpacked by ``make deps``) scrapes a live fleet under load with the
shipped scrape configuration and rules: every dashboard query and every service-level recording
returns data through its HTTP API (the error and slow-request ratios, the percentiles, the request
rate, per model), and every metric the alert rules read is exported."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
import yaml
from aiokafka import AIOKafkaProducer
from prometheus_client.parser import text_string_to_metric_families

from kinfer.consumers.runners.tinylm import build_tiny_lm
from kinfer.ops.localstack.procs import prometheus_binary, spawn, stop_process
from kinfer.ops.localstack.stack import StackInfo, free_port
from kinfer.producers.client import Client
from kinfer.topics import Priority, ReplyRoute, Request, now_ms, pack
from kinfer.topics.admin import ensure_topics, model_topic_specs
from kinfer.topics.health import HEALTH_CHANNEL
from tests.integration.conftest import WorkerProcess, delete_model_topics

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "ops" / "deploy" / "prometheus"


def start_prometheus(binary: str, config: Path, tmp: Path, port: int) -> subprocess.Popen[bytes]:
    with open(tmp / "prometheus.log", "wb") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)


async def query(http: httpx.AsyncClient, expr: str) -> list[dict[str, Any]]:
    answer = (await http.get("/api/v1/query", params={"query": expr})).json()
    assert answer["status"] == "success", answer
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


async def levels(http: httpx.AsyncClient, port: int, name: str) -> dict[str, float]:
    """A process's ``name`` gauge by model, from its metrics endpoint."""
    text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    return {s.labels["model"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name}


DASHBOARD = ROOT / "ops" / "deploy" / "grafana" / "dashboards" / "kinfer.json"


def dashboard_expressions() -> list[str]:
    """Every query of the shipped dashboard, with its variables as Grafana fills them for "All"."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                found.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(DASHBOARD.read_text()))
    return [e.replace("$model", ".*").replace("$__rate_interval", "1m") for e in found]


def fleet_config(tmp: Path, targets: dict[str, list[str]]) -> Path:
    """The shipped configuration, each job's targets pointed at this test's processes (same job names),
    scraped and evaluated every second; the shipped rules, their group interval likewise."""
    config = yaml.safe_load((SHIPPED / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    jobs = []
    for job in config["scrape_configs"]:
        if job["job_name"] in targets:
            job.pop("dns_sd_configs", None)
            job["static_configs"] = [{"targets": targets[job["job_name"]]}]
            jobs.append(job)
    assert {j["job_name"] for j in jobs} == set(targets)
    config["scrape_configs"] = jobs
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


async def test_every_recording_and_dashboard_expression_returns_data_from_a_live_fleet(
    stack: StackInfo, topics: str, spawn_worker: Callable[..., WorkerProcess], tmp_path: Path,
    client: Client,
) -> None:
    """A gateway, a batching worker, a generation worker and the lag monitor, scraped by a real
    Prometheus with the shipped job names and rules; traffic through the gateway (one-shot and
    generation), a record that is dead-lettered and one that expires in its partition. Then every one
    of the dashboard's queries returns a series, every metric the alert rules read is exported, and
    the service level's recordings return data per model: the error ratio, the percentiles, the rate."""
    binary = prometheus_binary()
    if binary is None:
        pytest.fail("prometheus is missing: `make deps` unpacks Debian's prometheus package into the cache")
    lm = f"{topics}-lm"
    await ensure_topics(stack.bootstrap, model_topic_specs(lm, 1))
    lm_dir = build_tiny_lm(tmp_path / "lm", eos=False)
    batching = spawn_worker(topics, "--family", "noop")
    generating = spawn_worker(lm, "--family", "generator", "--path", str(lm_dir))
    gateway_port, lagmon_port, prom_port = free_port(), free_port(), free_port()
    gateway = spawn(stack, "gateway", "--port", str(gateway_port), log_path=str(tmp_path / "gateway.log"))
    lagmon = spawn(stack, "lagmon", "--metrics-port", str(lagmon_port), log_path=str(tmp_path / "lagmon.log"))
    targets = {"kinfer-gateway": [f"127.0.0.1:{gateway_port}"], "kinfer-lagmon": [f"127.0.0.1:{lagmon_port}"],
               "kinfer-worker": [f"127.0.0.1:{w.metrics_port}" for w in (batching, generating)]}
    prometheus = start_prometheus(binary, fleet_config(tmp_path, targets), tmp_path, prom_port)
    producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap)
    await producer.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway_port}", timeout=30) as http, \
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{prom_port}", timeout=10) as prom:
            # Ready before any request reaches the gateway: the error ratio counts every gateway request,
            # and one sent while a worker still starts would expire. The workers are waited on through
            # this process's own client (not scraped), the gateway through its readiness probe.
            await client.infer(topics, ["x"], deadline_ms=120_000)
            await client.infer(lm, "a", params={"max_new_tokens": 3}, deadline_ms=120_000)
            for _ in range(240):
                try:
                    if (await http.get("/readyz")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.5)
            else:
                pytest.fail(f"gateway never ready:\n{(tmp_path / 'gateway.log').read_text()[-2000:]}")
            # A queue that waited on a starting worker raised the models' health level: admission refuses
            # by it until the level has come down, a level a poll at a time. Traffic starts at ok.
            for _ in range(240):
                monitor = await levels(http, lagmon_port, "kinfer_health_level")
                seen = await levels(http, gateway_port, "kinfer_client_health_level")
                if all(monitor.get(m) == 0 and seen.get(m, 0) == 0 for m in (topics, lm)):
                    break
                await asyncio.sleep(0.5)
            else:
                pytest.fail(f"the health level never came down: monitor {monitor}, gateway {seen}")
            # What the dashboard shows besides answers: a dead letter and a request expired in its partition.
            await producer.send_and_wait(f"infer.{topics}.p1", b"\xc1 not an envelope")
            now = now_ms()
            expired = Request(id=uuid.uuid4().hex, model=topics, priority=Priority.P1, tenant="tests",
                              created_ms=now - 5_000, deadline_ms=now - 4_000, inputs=("late",),
                              reply=ReplyRoute(redis="kinfer:reply:tests:nobody"))
            await producer.send_and_wait(f"infer.{topics}.p1", pack(expired))
            await batching.wait_metric("kinfer_dead_letters_total", 1)
            await batching.wait_metric("kinfer_shed_total", 1, reason="expired")
            # ... and what the alerts watch for: a forged health state, a reply not sealed for its client.
            redis = aioredis.Redis.from_url(stack.redis_url)
            try:
                await redis.publish(HEALTH_CHANNEL, b"\xc1 forged")
                channels = await redis.pubsub_channels("kinfer:reply:*")
                assert channels, "the gateway's reply channel"
                for channel in channels:
                    await redis.publish(channel, b"\xc1 forged")
            finally:
                await redis.aclose()

            expressions = dashboard_expressions()
            empty: list[str] = expressions
            answers: list[httpx.Response] = []
            for _ in range(90):  # traffic for a few scrapes: every rate over 1m has two samples
                for _ in range(10):
                    answers.append(await http.post(f"/v1/models/{topics}/infer", json={"inputs": ["x", "yy"]}))
                answers.append(await http.post("/v1/completions", json={"model": lm, "prompt": "a", "max_tokens": 3}))
                empty = [e for e in expressions if not await query(prom, e)]
                if not empty:
                    break
                await asyncio.sleep(0.5)
            assert empty == [], "dashboard queries with no data"
            refused = [(a.status_code, a.text[:200]) for a in answers if a.status_code != 200]
            assert not refused, f"{len(refused)} of {len(answers)}: {refused}"

            rules = yaml.safe_load((SHIPPED / "rules" / "kinfer.yml").read_text())
            read = {name for group in rules["groups"] for rule in group["rules"]
                    for name in re.findall(r"(?<![:\w])(kinfer_[a-z_]+?)(?:_bucket|_count|_sum)?\b", rule["expr"])}
            assert "kinfer_client_requests_total" in read
            missing = [name for name in sorted(read)
                       if not await query(prom, f'count({{__name__=~"{name}(_total|_bucket|_count|_sum)?"}})')]
            assert missing == [], "metrics the alert rules read that no process exports"

            recorded: dict[str, list[dict[str, Any]]] = {}
            names = [r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r]
            for _ in range(60):  # scraped every second, recorded every second: within seconds
                recorded = {name: await query(prom, f'{name}{{model="{topics}"}}') for name in names}
                if all(recorded.values()):
                    break
                await asyncio.sleep(1)
            assert {n for n, r in recorded.items() if not r} == set(), "recordings with no data"
            # Every request through the gateway ended ok (the dead letter and the expired record went
            # to Kafka directly): no error ratio, no availability alert.
            assert float(recorded["model:kinfer_errors:ratio_rate5m"][0]["value"][1]) == 0.0
            assert float(recorded["model:kinfer_requests:rate5m"][0]["value"][1]) > 0
            assert 0 < float(recorded["model:kinfer_request_seconds:p99_rate5m"][0]["value"][1]) <= 30
            firing = await query(prom, f'ALERTS{{alertstate="firing",model="{topics}",slo="errors"}}')
            assert firing == []
    finally:
        await producer.stop()
        prometheus.terminate()
        prometheus.wait(30)
        stop_process(gateway)
        stop_process(lagmon)
        await delete_model_topics(stack.bootstrap, lm)
