"""``kinfer telemetry``: the telemetry stream processor (faust-streaming).

Consumes the workers' per-batch records from ``kinfer.stats`` and keeps, per model, tumbling-window
tables of inputs served, batches, compute time by batch size, and sheds by reason, plus a running
total. Every table is backed by a changelog topic, so a restarted processor rebuilds its state from
Kafka and goes on counting where it stopped. Every ``publish_s`` it writes one ``ModelStats``
summary per model to Redis (``kinfer:stats:<model>``) from the current and the previous window;
the lag monitor adds its service time to the health state, and ``kinfer status`` prints it.

Processing is at least once (faust's default): a record that was being processed when the
processor died or its partitions moved can be counted twice. Telemetry tolerates that; requests
never depend on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import faust
import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge
from redis.exceptions import RedisError

from kinfer.batcher import Reason
from kinfer.topics import MalformedRecord
from kinfer.topics.admin import cluster_replication
from kinfer.topics.connect import KafkaAuth
from kinfer.topics.stats import STATS_TOPIC, BatchStats, ModelStats, size_bucket, stats_key

log = logging.getLogger(__name__)

RECORDS = Counter("kinfer_telemetry_records_total", "Per-batch stats records aggregated", ["model"])
MALFORMED = Counter("kinfer_telemetry_malformed_total", "Stats records skipped as unreadable")
SERVICE = Gauge("kinfer_telemetry_service_seconds", "Mean compute time of a batch, last two windows", ["model"])
SERVED = Gauge("kinfer_telemetry_inputs_rps", "Inputs served per second, last two windows", ["model"])
REPORTING = Gauge("kinfer_telemetry_workers", "Workers that sent stats in the last two windows", ["model"])
PUBLISHED = Gauge("kinfer_telemetry_published_timestamp_seconds", "When summaries last reached Redis")

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
SHED_REASONS = tuple(r.value for r in Reason)


def summarize(
    model: str, window_s: float, elapsed_s: float, windows: dict[str, Any], total: int, workers: int = 0
) -> ModelStats:
    """One model's summary from its last two windows (pure).

    ``windows`` maps each measure to the sum of the current and the previous window: "inputs",
    "requests", "batches", "steps", "service_n" and "service_ms" (dicts by size bucket), "shed"
    (dict by reason). One-shot batches that did not fail count as served; generation steps only
    as steps (progress), their cost per request being the tokens it asks for.
    ``elapsed_s`` is how far the current window has run, so the span covered is ``window_s +
    elapsed_s``.
    """
    span = window_s + elapsed_s
    batches = windows["batches"]
    n_total = sum(windows["service_n"].values())
    return ModelStats(
        model=model, window_s=window_s,
        inputs_rps=round(windows["inputs"] / span, 3), batches_rps=round(batches / span, 3),
        mean_batch=round(windows["inputs"] / batches, 3) if batches else 0.0,
        service_ms=round(sum(windows["service_ms"].values()) / n_total, 3) if n_total else 0.0,
        service_ms_by_size={b: round(windows["service_ms"][b] / n, 3)
                            for b, n in windows["service_n"].items() if n},
        shed={r: n for r, n in windows["shed"].items() if n}, inputs_total=total,
        updated_ms=int(time.time() * 1000), workers=workers,
        requests_per_batch=round(windows["requests"] / batches, 3) if batches else 0.0,
        steps_rps=round(windows["steps"] / span, 3),
    )


def _credentials(auth: KafkaAuth) -> Any:
    """This process's Kafka security settings (topics.connect) in faust's terms."""
    context = auth.options().get("ssl_context")
    if auth.sasl:
        return faust.SASLCredentials(username=auth.user, password=auth.password, ssl_context=context,
                                     mechanism=auth.mechanism)
    return faust.SSLCredentials(context) if auth.tls else None


def build_app(bootstrap: str, redis_url: str, *, window_s: float = 10.0, publish_s: float = 1.0,
              app_id: str = "kinfer-telemetry", data_dir: str | None = None, replication: int = 1) -> faust.App:
    """``replication``: copies of faust's own topics (changelogs): the cluster's default, or on three
    brokers requiring two in-sync copies, its ``acks=-1`` writes to single-copy topics are refused."""
    if window_s < 1 or window_s != int(window_s):  # faust's windows step in whole seconds
        raise ValueError(f"window_s must be a whole number of seconds >= 1, got {window_s}")
    app = faust.App(
        app_id, broker=f"kafka://{bootstrap}", broker_credentials=_credentials(KafkaAuth.from_env()),
        store="memory://", topic_partitions=1, topic_replication_factor=replication,
        web_enabled=False, datadir=data_dir or f"/tmp/{app_id}-data", producer_acks=-1,
        # A new processor starts at the end of kinfer.stats (its windows are about now); a restarted
        # one resumes from its committed offsets and changelogs.
        consumer_auto_offset_reset="latest",
    )
    source = app.topic(STATS_TOPIC, key_serializer="raw", value_serializer="raw")
    keep = timedelta(seconds=window_s * 6)

    def windowed(name: str, default: type) -> Any:
        return app.Table(name, default=default).tumbling(window_s, expires=keep)

    inputs = windowed("inputs", int)  # model -> inputs served
    requests = windowed("requests", int)  # model -> requests (records) answered
    batches = windowed("batches", int)  # model -> one-shot batches
    steps = windowed("steps", int)  # model -> generation steps
    service_n = windowed("service-n", int)  # "model|bucket" -> batches of that size
    service_ms = windowed("service-ms", float)  # "model|bucket" -> compute ms of those batches
    shed = windowed("shed", int)  # "model|reason" -> requests refused
    totals = app.Table("totals", default=int)  # model -> inputs since the beginning (and the set of models)
    seen = app.Table("workers", default=int)  # "model|worker" -> wall ms of its latest batch
    redis = aioredis.Redis.from_url(redis_url)

    @app.agent(source)
    async def aggregate(stream: Any) -> None:
        async for value in stream:
            try:
                s = BatchStats.unpack(value)
            except MalformedRecord as exc:
                log.warning("skipping a malformed stats record: %s", exc)
                MALFORMED.inc()
                continue
            RECORDS.labels(s.model).inc()
            n = max(1, s.batches)  # a record sums this many batches of one size bucket
            if s.size:
                seen[f"{s.model}|{s.worker}"] = s.at_ms
            if s.size and s.step:
                steps[s.model] += n
            elif s.size and not s.errors:  # a failed batch served nothing, and its time says nothing
                key = f"{s.model}|{size_bucket(round(s.size / n))}"
                inputs[s.model] += s.size
                requests[s.model] += s.requests
                batches[s.model] += n
                service_n[key] += n
                service_ms[key] += s.compute_ms
            for reason, n in s.shed.items():
                shed[f"{s.model}|{reason}"] += n
            totals[s.model] += s.size

    def both(table: Any, key: str, now: float) -> Any:
        """The current window's value plus the previous one's."""
        window = table.table.window
        return sum(table[key][window.current(t)] for t in (now, now - window_s))

    async def publish() -> None:
        now = time.time()
        elapsed = now - table_start(inputs, now)
        for model in list(totals.keys()):
            windows = {
                "inputs": both(inputs, model, now), "requests": both(requests, model, now),
                "batches": both(batches, model, now), "steps": both(steps, model, now),
                "service_n": {b: both(service_n, f"{model}|{b}", now) for b in BUCKETS},
                "service_ms": {b: both(service_ms, f"{model}|{b}", now) for b in BUCKETS},
                "shed": {r: both(shed, f"{model}|{r}", now) for r in SHED_REASONS},
            }
            since = (now - window_s - elapsed) * 1000.0
            workers = sum(1 for key, at in seen.items() if key.startswith(f"{model}|") and at >= since)
            summary = summarize(model, window_s, elapsed, windows, totals[model], workers)
            SERVICE.labels(model).set(summary.service_ms / 1000.0)
            SERVED.labels(model).set(summary.inputs_rps)
            REPORTING.labels(model).set(workers)
            try:
                await redis.set(stats_key(model), summary.pack(), px=int(max(30.0, window_s * 6) * 1000))
            except (RedisError, OSError) as exc:
                log.warning("telemetry: Redis unreachable: %s", exc)
                return
        PUBLISHED.set(now)

    app.timer(interval=publish_s)(publish)
    return app


def table_start(table: Any, now: float) -> float:
    start: float = table.table.window.current(now)[0]
    return start


def run(bootstrap: str, redis_url: str, *, window_s: float = 10.0, publish_s: float = 1.0,
        app_id: str = "kinfer-telemetry", loglevel: str = "warning") -> None:
    """Run the processor until SIGTERM/SIGINT (then it commits and leaves its group)."""
    # Asked on a thread of its own: asyncio.run on this one would leave it without the loop faust expects.
    with ThreadPoolExecutor(1) as pool:
        replication = pool.submit(asyncio.run, cluster_replication(bootstrap)).result()
    app = build_app(bootstrap, redis_url, window_s=window_s, publish_s=publish_s, app_id=app_id,
                    replication=replication)
    faust.Worker(app, loglevel=loglevel, quiet=True).execute_from_commandline()
