"""The autoscaler's outputs outside this machine: the Kubernetes scale subresource and the KEDA object."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from kinfer.ops.cli import main
from kinfer.ops.control.autoscaler import KubernetesPool, keda_scaled_object
from kinfer.ops.control.scaling import ScalePolicy

SCALE = "/apis/apps/v1/namespaces/ml/deployments/kinfer-worker-emb/scale"


class FakeApiServer(BaseHTTPRequestHandler):
    """The two calls of the ``scale`` subresource the pool makes, with what a real API server answers."""

    replicas = 2
    seen: ClassVar[list[tuple[str, str, dict[str, str], Any]]] = []

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _scale(self) -> dict[str, Any]:
        return {"kind": "Scale", "apiVersion": "autoscaling/v1", "spec": {"replicas": FakeApiServer.replicas},
                "status": {"replicas": FakeApiServer.replicas}}

    def do_GET(self) -> None:
        FakeApiServer.seen.append(("GET", self.path, dict(self.headers), None))
        if self.path != SCALE:
            return self._answer(404, {"kind": "Status", "reason": "NotFound"})
        self._answer(200, self._scale())

    def do_PATCH(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeApiServer.seen.append(("PATCH", self.path, dict(self.headers), body))
        if self.headers["Content-Type"] != "application/merge-patch+json":
            return self._answer(415, {"kind": "Status", "reason": "UnsupportedMediaType"})
        FakeApiServer.replicas = body["spec"]["replicas"]
        self._answer(200, self._scale())

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def api() -> Iterator[str]:
    FakeApiServer.replicas, FakeApiServer.seen = 2, []
    server = HTTPServer(("127.0.0.1", 0), FakeApiServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def test_kubernetes_pool_reads_and_patches_the_scale_subresource(api: str, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    pool = KubernetesPool("kinfer-worker-emb", "ml", api=api, token_file=str(token), ca_file=None)

    async def scenario() -> tuple[int, int]:
        before = await pool.replicas()
        await pool.scale(5)
        return before, await pool.replicas()

    assert asyncio.run(scenario()) == (2, 5)
    methods = [(m, p) for m, p, _, _ in FakeApiServer.seen]
    assert methods == [("GET", SCALE), ("PATCH", SCALE), ("GET", SCALE)]
    _, _, headers, body = FakeApiServer.seen[1]
    assert body == {"spec": {"replicas": 5}}
    assert headers["Authorization"] == "Bearer s3cret"


def test_kubernetes_pool_outside_a_cluster_says_what_to_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ValueError, match="--kube-api"):
        KubernetesPool("kinfer-worker-emb")


def test_keda_object_sizes_lag_per_replica_from_capacity_and_the_wait_budget() -> None:
    policy = ScalePolicy(min_replicas=0, max_replicas=6, replica_rps=200.0, down_window_s=120.0)
    obj = keda_scaled_object("emb", "kafka:9092", policy, deployment="kinfer-worker-emb", namespace="ml")
    assert obj["kind"] == "ScaledObject" and obj["spec"]["scaleTargetRef"] == {"name": "kinfer-worker-emb"}
    assert (obj["spec"]["minReplicaCount"], obj["spec"]["maxReplicaCount"]) == (0, 6)
    trigger = obj["spec"]["triggers"][0]
    assert trigger["type"] == "kafka"
    assert trigger["metadata"]["consumerGroup"] == "kinfer.worker.emb"  # the workers' group
    assert trigger["metadata"]["topic"] == "infer.emb.p0"
    assert trigger["metadata"]["lagThreshold"] == "14"  # 200/s x 0.7 x 100 ms
    assert trigger["metadata"]["allowIdleConsumers"] == "false"  # never more replicas than partitions
    # One trigger a topic (the HPA takes the largest): background lag keeps one replica and adds none,
    # unless told to drain it within a window (200/s x 0.7 x 600 s a replica).
    topics = {t["metadata"]["topic"]: t["metadata"]["lagThreshold"] for t in obj["spec"]["triggers"]}
    assert topics == {"infer.emb.p0": "14", "infer.emb.p1": "14", "infer.emb.p2": "14", "infer.emb.p3": "2147483647"}
    told = keda_scaled_object("emb", "kafka:9092", ScalePolicy(replica_rps=200.0, background_within_s=600.0),
                              deployment="d", namespace="ml")
    assert told["spec"]["triggers"][-1]["metadata"]["lagThreshold"] == "84000"
    down = obj["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert down["stabilizationWindowSeconds"] == 120
    with pytest.raises(ValueError, match="--replica-rps"):
        keda_scaled_object("emb", "kafka:9092", ScalePolicy(), deployment="d", namespace="ml")


def test_emit_keda_prints_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["autoscale", "--model", "emb", "--max", "4", "--replica-rps", "100", "--emit", "keda",
                 "--namespace", "ml"]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["metadata"]["namespace"] == "ml"
    assert doc["spec"]["triggers"][0]["metadata"]["lagThreshold"] == "7"
