"""``kinfer autoscale``: a model's workers follow its load (the decisions are ``ops.control.scaling``'s).

Every ``interval_s`` the loop reads the model's offsets and telemetry the way the lag monitor does
(the same code: arrival rate, the records really waiting, the capacity of the serving workers),
asks ``Autoscaler`` how many replicas to run and tells a ``Pool``:

- ``LocalPool`` (``ops/localstack/pool.py``) starts and stops ``kinfer worker`` processes on this
  machine: the local stack's pool, for the demo, the benchmarks and a single box.
- ``KubernetesPool`` patches the ``scale`` subresource of a Deployment through the API server
  (in-cluster service account by default); the Deployment's pods are the replicas.

Each change is logged, counted (``kinfer_autoscale_*`` metrics), kept in Redis
(``kinfer:autoscale:decisions``, newest first) with the loop's latest state
(``kinfer:autoscale:state:<model>``) for ``kinfer status``. ``keda_scaled_object`` writes the equivalent
KEDA ScaledObject for those who prefer KEDA's Kafka scaler.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import ssl
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from prometheus_client import Counter, Gauge
from redis.exceptions import RedisError

from kinfer.ops.control.estimator import HealthPolicy
from kinfer.ops.control.lagmon import LagMonitor
from kinfer.ops.control.scaling import (
    SCALE_DECISIONS_KEPT,
    SCALE_DECISIONS_KEY,
    Autoscaler,
    Observation,
    ScaleDecision,
    ScalePolicy,
    ScaleState,
    scale_state_key,
)
from kinfer.topics import Priority, now_ms
from kinfer.topics.admin import offset_clients
from kinfer.topics.names import consumer_group, request_topic
from kinfer.topics.readers import Supervised

log = logging.getLogger(__name__)

REPLICAS = Gauge("kinfer_autoscale_replicas", "Workers the autoscaler runs for the model", ["model"])
RECOMMENDED = Gauge("kinfer_autoscale_recommended_replicas", "What the load asks for, before cooldowns", ["model"])
LOAD = Gauge("kinfer_autoscale_load_rps", "Arrivals plus backlog drain the replicas are sized for", ["model"])
REPLICA_RPS = Gauge("kinfer_autoscale_replica_rps", "Records/s one replica drains while busy", ["model"])
CHANGES = Counter("kinfer_autoscale_changes_total", "Replica count changes", ["model", "reason"])
RESTARTS = Counter("kinfer_autoscale_restarts_total", "Local workers that died and were started again", ["model"])


class Pool(Protocol):
    mode: str  # "local" or "kubernetes", for kinfer status
    restarts: int  # workers that died and were started again by the pool

    async def replicas(self) -> int: ...

    async def scale(self, n: int) -> None: ...

    async def close(self) -> None: ...


@dataclass
class KubernetesPool:
    """A Deployment's replicas, through the ``scale`` subresource of the Kubernetes API."""

    deployment: str
    namespace: str = "default"
    api: str | None = None  # default: the in-cluster API server
    token_file: str | None = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    ca_file: str | None = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    mode: str = field(default="kubernetes", init=False)
    restarts: int = field(default=0, init=False)  # the Deployment's controller restarts pods, not us

    def __post_init__(self) -> None:
        if self.api is None:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise ValueError("not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST): pass --kube-api URL")
            self.api = f"https://{host}:{port}"

    @property
    def url(self) -> str:
        return f"{self.api}/apis/apps/v1/namespaces/{self.namespace}/deployments/{self.deployment}/scale"

    async def replicas(self) -> int:
        scale = await asyncio.to_thread(self._call, "GET", None)
        return int(scale.get("spec", {}).get("replicas", 0))

    async def scale(self, n: int) -> None:
        await asyncio.to_thread(self._call, "PATCH", {"spec": {"replicas": n}})

    async def close(self) -> None:
        pass  # the Deployment keeps its last size

    def _call(self, method: str, body: dict[str, Any] | None) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/merge-patch+json"
        if self.token_file and Path(self.token_file).exists():
            headers["Authorization"] = f"Bearer {Path(self.token_file).read_text().strip()}"
        context = None
        if self.url.startswith("https:"):
            context = ssl.create_default_context(cafile=self.ca_file if self.ca_file and Path(self.ca_file).exists()
                                                 else None)
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url, data=data, method=method, headers=headers)
        with urllib.request.urlopen(request, timeout=10, context=context) as resp:
            answer: dict[str, Any] = json.loads(resp.read())
            return answer


@dataclass
class AutoscaleLoop:
    bootstrap: str
    redis_url: str
    model: str
    pool: Pool
    policy: ScalePolicy = field(default_factory=ScalePolicy)
    interval_s: float = 1.0
    commit_interval_ms: float = 100.0  # the workers' (the lag monitor discounts it)
    scaler: Autoscaler = field(init=False)

    def __post_init__(self) -> None:
        self.scaler = Autoscaler(self.policy)

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop``; the loop restarts with backoff after any failure (a bad record it reads is
        counted and skipped inside it), ``kinfer_reader_up{reader="autoscale"}`` 0 meanwhile."""
        monitor = LagMonitor(self.bootstrap, self.redis_url, models=[self.model], interval_s=self.interval_s,
                             policy=HealthPolicy(commit_interval_ms=self.commit_interval_ms), name="autoscale")
        await Supervised("autoscale", lambda: self._run(monitor, stop)).run(stop)

    async def _run(self, monitor: LagMonitor, stop: asyncio.Event) -> None:
        redis = aioredis.Redis.from_url(self.redis_url)
        try:
            async with offset_clients(self.bootstrap) as (admin, consumer):
                await self.pool.scale(max(self.policy.min_replicas, await self.pool.replicas()))
                while not stop.is_set():
                    try:
                        await self.step(monitor, admin, consumer, redis)
                    except (KafkaError, RedisError, OSError) as exc:
                        log.warning("autoscale poll failed, retrying: %s", exc)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), self.interval_s)
        finally:
            await redis.aclose()

    async def step(self, monitor: LagMonitor, admin: AIOKafkaAdminClient, consumer: AIOKafkaConsumer,
                   redis: aioredis.Redis) -> None:
        states = await monitor.poll(admin, consumer, redis)
        if not states:
            log.warning("%s has no request topics: nothing to scale", self.model)
            return
        state, estimator = states[0], monitor.estimators[self.model]
        stats = monitor.stats.get(self.model)
        replicas = await self.pool.replicas()
        obs = Observation(time.monotonic(), state.arrival_rps, estimator.queued(), state.lag, replicas,
                          monitor.partitions[self.model], capacity_rps=state.capacity_rps,
                          serving=stats.workers if stats is not None else 0, background=state.background_lag)
        rec = self.scaler.observe(obs)
        REPLICAS.labels(self.model).set(rec.replicas)
        RECOMMENDED.labels(self.model).set(rec.raw)
        LOAD.labels(self.model).set(rec.load_rps)
        REPLICA_RPS.labels(self.model).set(rec.replica_rps)
        pipe = redis.pipeline(transaction=False)
        if rec.replicas != replicas:
            await self.pool.scale(rec.replicas)
            CHANGES.labels(self.model, rec.reason.value).inc()
            log.info("%s: %d -> %d replicas (%s: load %.1f/s, %.1f/s per replica, queued %.0f, wait %.0f ms)",
                     self.model, replicas, rec.replicas, rec.reason.value, rec.load_rps, rec.replica_rps,
                     obs.queued, rec.wait_ms)
            decision = ScaleDecision(now_ms(), self.model, replicas, rec.replicas, rec.reason.value, rec.load_rps,
                                     rec.replica_rps, round(obs.queued, 1), rec.wait_ms)
            pipe.lpush(SCALE_DECISIONS_KEY, decision.pack())
            pipe.ltrim(SCALE_DECISIONS_KEY, 0, SCALE_DECISIONS_KEPT - 1)
        current = ScaleState(self.model, self.pool.mode, rec.replicas, rec.raw, self.policy.min_replicas,
                             min(self.policy.max_replicas, obs.partitions), rec.load_rps, rec.replica_rps,
                             now_ms(), restarts=self.pool.restarts)
        pipe.set(scale_state_key(self.model), current.pack(), px=max(10_000, int(self.interval_s * 10_000)))
        await pipe.execute()


KEDA_NO_SCALE_UP = 2**31 - 1  # a lag threshold no backlog reaches: one replica while any waits, never more


def keda_scaled_object(model: str, bootstrap: str, policy: ScalePolicy, *, deployment: str, namespace: str,
                       target_wait_ms: float = 100.0, polling_s: int = 5) -> dict[str, Any]:
    """The KEDA ScaledObject closest to ``kinfer autoscale``: KEDA's Kafka scaler asks for
    ``lag / lagThreshold`` replicas, so the threshold is the lag one replica clears within
    ``target_wait_ms`` at the target utilisation (which needs ``policy.replica_rps``: KEDA cannot
    measure it). One trigger per interactive topic (the HPA takes the largest); the background topic's
    lag keeps one replica and adds none, unless ``background_within_s`` asks for its records to be
    drained within that long. Cooldowns and the down window become the HPA's behaviour."""
    if policy.replica_rps <= 0:
        raise ValueError("--emit keda needs --replica-rps (what one worker drains while busy): "
                         "KEDA sizes by lag per replica and cannot measure it")
    per_s = policy.replica_rps * policy.target_utilisation
    threshold = max(1, math.floor(per_s * target_wait_ms / 1000.0))
    background = (max(1, math.floor(per_s * policy.background_within_s)) if policy.background_within_s > 0
                  else KEDA_NO_SCALE_UP)

    def trigger(priority: Priority, lag_threshold: int) -> dict[str, Any]:
        return {"type": "kafka", "metadata": {
            "bootstrapServers": bootstrap,
            "consumerGroup": consumer_group(model),
            "topic": request_topic(model, priority),
            "lagThreshold": str(lag_threshold),
            "activationLagThreshold": "0",
            "offsetResetPolicy": "earliest",
            "allowIdleConsumers": "false",  # never more replicas than partitions
            "excludePersistentLag": "false",
        }}

    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": f"{deployment}-lag", "namespace": namespace,
                     "labels": {"app.kubernetes.io/part-of": "kinfer", "kinfer.model": model}},
        "spec": {
            "scaleTargetRef": {"name": deployment},
            "pollingInterval": polling_s,
            "cooldownPeriod": int(policy.down_window_s),  # before scaling to zero
            "minReplicaCount": policy.min_replicas,
            "maxReplicaCount": policy.max_replicas,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
                "scaleUp": {"stabilizationWindowSeconds": 0,
                            "policies": [{"type": "Percent", "value": 100,
                                          "periodSeconds": int(policy.up_cooldown_s)}]},
                "scaleDown": {"stabilizationWindowSeconds": int(policy.down_window_s),
                              "policies": [{"type": "Percent", "value": 100,
                                            "periodSeconds": int(policy.down_cooldown_s)}]},
            }}},
            "triggers": [trigger(p, background if p.background else threshold) for p in Priority],
        },
    }
