"""One request's trace across processes: a gateway, a worker and a lag monitor run as ``kinfer``
processes exporting OTLP/HTTP (``OTEL_TRACES_EXPORTER=otlp``) to a receiver in this test. The request
carries the caller's own ``traceparent``; its trace must hold every hop, in order and parented as
documented, with the batch's span linked to it. The same processes log JSON lines: each one parses,
the request's lines name it and its trace, and no API key or signing secret is in any of them."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kinfer.ops.bench.otlp_sink import OtlpSink, ReceivedSpan
from kinfer.ops.localstack.procs import spawn, stop_process
from kinfer.ops.localstack.stack import StackInfo, free_port
from kinfer.producers.tenants import hash_key
from tests.integration.conftest import WorkerProcess

pytestmark = pytest.mark.integration

KEY = "trace-test-" + secrets.token_hex(16)  # the tenant's API key: in no log line
SECRET = secrets.token_hex(32)  # the signing secret: in no log line


def by_name(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{name}: {[s.name for s in spans]}"
    return found[0]


async def test_one_request_is_one_trace_across_gateway_kafka_worker_and_redis(
    stack: StackInfo, topics: str, spawn_worker: Callable[..., WorkerProcess], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": [{"name": "tracer", "key_sha256": hash_key(KEY), "max_priority": 0}]}))
    with OtlpSink() as sink:
        for name, value in {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint,
                            "OTEL_BSP_SCHEDULE_DELAY": "100", "KINFER_LOG_FORMAT": "json",
                            "KINFER_SIGNING_SECRET": SECRET}.items():
            monkeypatch.setenv(name, value)
        worker = spawn_worker(topics, "--family", "noop", "--tenants", str(tenants))
        port = free_port()
        logs = {"gateway": tmp_path / "gateway.log", "lagmon": tmp_path / "lagmon.log"}
        gateway = spawn(stack, "gateway", "--port", str(port), "--tenants", str(tenants), log_path=str(logs["gateway"]))
        lagmon = spawn(stack, "lagmon", "--model", topics, log_path=str(logs["lagmon"]))
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30,
                                         headers={"Authorization": f"Bearer {KEY}"}) as http:
                for _ in range(600):  # the gateway up, the worker serving
                    try:
                        if (await http.post(f"/v1/models/{topics}/infer", json={"inputs": ["x"]})).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await asyncio.sleep(0.3)
                else:
                    pytest.fail(f"never served:\n{worker.log()[-3000:]}")
                for _ in range(100):  # the lag monitor may still hold the queue from before the worker joined
                    trace_id, caller = os.urandom(16).hex(), os.urandom(8).hex()
                    r = await http.post(f"/v1/models/{topics}/infer", json={"inputs": ["traced"]},
                                        headers={"traceparent": f"00-{trace_id}-{caller}-01"})
                    if r.status_code != 429:
                        break
                    await asyncio.sleep(0.2)
                assert r.status_code == 200, r.text

            hops = ["POST infer", f"infer {topics}", f"send infer.{topics}.p1", f"queue infer.{topics}.p1",
                    "batch wait", "compute", "reply", "receive redis"]
            spans: list[ReceivedSpan] = []
            for _ in range(100):  # exported every 100 ms by each process
                spans = sink.trace(trace_id)
                if {s.name for s in spans} >= {*hops, f"batch {topics}"}:
                    break
                await asyncio.sleep(0.1)
            names = [s.name for s in spans]
            assert {*hops, f"batch {topics}"} <= set(names), names

            # every hop, in the order a request takes them (to the millisecond: a record's timestamp has no finer)
            got = {name: by_name(spans, name) for name in hops}
            for earlier, later in itertools.pairwise(hops):
                assert got[earlier].start_ns // 1_000_000 <= got[later].start_ns // 1_000_000, (earlier, later)
                assert got[later].start_ns <= got[later].end_ns
            server, call, send, queue = (got[n] for n in hops[:4])
            assert server.parent_id == caller and server.service == "kinfer-gateway"  # the caller's trace goes on
            assert call.parent_id == server.span_id and send.parent_id == call.span_id
            for name in ("queue", "batch wait", "compute", "reply"):  # the worker's hang from the record's send
                span = next(s for s in spans if s.name.startswith(name))
                assert span.parent_id == send.span_id and span.service == "kinfer-worker", span
            assert got["receive redis"].parent_id == got["reply"].span_id  # through Redis, in the reply
            assert queue.attributes["messaging.destination.name"] == f"infer.{topics}.p1"
            assert got["compute"].attributes["kinfer.batch.size"] >= 1
            batch = by_name(spans, f"batch {topics}")
            assert (trace_id, send.span_id) in batch.links  # the batch's span links to the request
            assert (trace_id, batch.span_id) in got["compute"].links
        finally:
            stop_process(gateway)
            stop_process(lagmon)
            worker.stop()

    # The processes' logs: JSON lines, no secret in any of them.
    texts = {**{name: path.read_text(errors="replace") for name, path in logs.items()}, "worker": worker.log()}
    for name, text in texts.items():
        assert KEY not in text and SECRET not in text, name
        for line in filter(str.strip, text.splitlines()):
            entry = json.loads(line)
            assert {"ts", "level", "logger", "message"} <= entry.keys(), line
