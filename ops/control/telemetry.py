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

Each record is taken on its own (``Aggregator.add``): one that does not decode (a tombstone,
nesting, a number out of range), is dated ahead of this clock, or names a model beyond
``MAX_MODELS`` is counted (``kinfer_malformed_records_total{reader="telemetry"}``) and skipped, so
the agent never crashes on a record. Memory is bounded: at most ``MAX_MODELS`` models (one idle for
``MODEL_FORGET_S`` is forgotten, with its metric labels), ``MAX_WORKERS`` (model, worker) pairs
(stale ones pruned), shed reasons only the batcher's own; publishing costs models + workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
from collections import Counter as Tally
from collections.abc import Iterable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import faust
import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge
from redis.exceptions import RedisError

from kinfer.batcher import Reason
from kinfer.topics import now_ms
from kinfer.topics.admin import cluster_replication, set_topic_configs
from kinfer.topics.connect import KafkaAuth
from kinfer.topics.readers import read, refused
from kinfer.topics.record import MAX_COUNT, MAX_DURATION_MS, MAX_RATE_RPS
from kinfer.topics.stats import STATS_TOPIC, BatchStats, ModelStats, size_bucket, stats_key

log = logging.getLogger(__name__)

RECORDS = Counter("kinfer_telemetry_records_total", "Per-batch stats records aggregated", ["model"])
SERVICE = Gauge("kinfer_telemetry_service_seconds", "Mean compute time of a batch, last two windows", ["model"])
SERVED = Gauge("kinfer_telemetry_inputs_rps", "Inputs served per second, last two windows", ["model"])
REPORTING = Gauge("kinfer_telemetry_workers", "Workers that sent stats in the last two windows", ["model"])
PUBLISHED = Gauge("kinfer_telemetry_published_timestamp_seconds", "When summaries last reached Redis")

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
SHED_REASONS = tuple(r.value for r in Reason)

READER = "telemetry"
MAX_MODELS = 1_024  # models the processor keeps tables (and metric labels) for
MAX_WORKERS = 4_096  # (model, worker) pairs it keeps the latest batch time of
MODEL_FORGET_S = 3_600.0  # a model without a record this long is forgotten (its running total too)
# When a model or a worker was last seen is written at most this often: each write is a changelog record
# a restarted processor reads back, and these tables are not windowed away (a second is far finer than
# their readers need: forgetting after an hour, counting the workers of the last two windows).
TOUCH_MS = 1_000
KEEP_WINDOWS = 6  # windows a windowed table keeps before faust expires them


def kept_ms(window_s: float) -> int:
    """How long the windowed tables keep a window."""
    return int(window_s * KEEP_WINDOWS * 1000)


@dataclass
class Aggregator:
    """The agent's work on one record, over the processor's tables (faust tables in the app; any
    mutable mappings with defaults in tests). Never raises: a record it cannot use is counted."""

    window_s: float
    inputs: Any  # model -> inputs served (windowed)
    requests: Any  # model -> requests (records) answered (windowed)
    batches: Any  # model -> one-shot batches (windowed)
    steps: Any  # model -> generation steps (windowed)
    service_n: Any  # "model|bucket" -> batches of that size (windowed)
    service_ms: Any  # "model|bucket" -> compute ms of those batches (windowed)
    shed: Any  # "model|reason" -> requests refused (windowed)
    totals: MutableMapping[str, int]  # model -> inputs since the beginning
    seen: MutableMapping[str, int]  # "model|worker" -> wall ms of its latest batch
    models: MutableMapping[str, int]  # model -> wall ms of its latest record: the models tracked
    max_models: int = MAX_MODELS
    max_workers: int = MAX_WORKERS
    forget_ms: int = int(MODEL_FORGET_S * 1000)
    forgotten: list[str] = field(default_factory=list)  # models forgotten, for the caller's metric labels

    @property
    def keep_ms(self) -> int:
        return kept_ms(self.window_s)

    def add(self, value: object, now: int) -> bool:
        """Count one record of ``kinfer.stats``; False (and counted by reason) when it was skipped."""
        s = read(BatchStats, value, READER, now)
        if s is None:
            return False
        if s.model not in self.models and not self._room_for_model(now):
            refused(READER, "capacity")
            return False
        try:
            self._count(s, now)
        except Exception:  # a table that failed under one record: that record is lost, not the agent
            log.exception("telemetry: a stats record of %s could not be counted", s.model)
            refused(READER, "error")
            return False
        return True

    def _count(self, s: BatchStats, now: int) -> None:
        if s.model not in self.models or now - self.models[s.model] >= TOUCH_MS:
            self.models[s.model] = now
        RECORDS.labels(s.model).inc()
        self.totals[s.model] += s.size
        if s.at_ms < now - self.keep_ms:  # its windows are gone (a backlog read after a long stop): only the
            return  # running total takes it, not six windowed writes that faust would expire at once
        n = max(1, s.batches)  # a record sums this many batches of one size bucket
        if s.size:
            self._seen(f"{s.model}|{s.worker}", s.at_ms)
        if s.size and s.step:
            self.steps[s.model] += n
        elif s.size and not s.errors:  # a failed batch served nothing, and its time says nothing
            key = f"{s.model}|{size_bucket(round(s.size / n))}"
            self.inputs[s.model] += s.size
            self.requests[s.model] += s.requests
            self.batches[s.model] += n
            self.service_n[key] += n
            self.service_ms[key] += s.compute_ms
        for reason, count in s.shed.items():
            if reason in SHED_REASONS:  # the batcher's reasons only: a table key per model and reason
                self.shed[f"{s.model}|{reason}"] += count

    def _seen(self, key: str, at_ms: int) -> None:
        known = key in self.seen  # (not ``get``: a faust table answers a missing key with its default)
        if known and at_ms - self.seen[key] < TOUCH_MS:
            return
        if not known and len(self.seen) >= self.max_workers:
            since = at_ms - self.keep_ms
            for old in [k for k, at in self.seen.items() if at < since]:
                del self.seen[old]
            if len(self.seen) >= self.max_workers:
                return  # the worker's batches count; only its share of ``workers`` is not known
        self.seen[key] = at_ms

    def _room_for_model(self, now: int) -> bool:
        """Below ``max_models``: models idle for ``forget_ms`` are forgotten to make room."""
        if len(self.models) < self.max_models:
            return True
        for model in [m for m, at in self.models.items() if now - at > self.forget_ms]:
            del self.models[model]
            with contextlib.suppress(KeyError):
                del self.totals[model]
            self.forgotten.append(model)
        return len(self.models) < self.max_models


def workers_by_model(seen: Iterable[tuple[str, int]], since_ms: float) -> Tally[str]:
    """Distinct workers per model with a batch at or after ``since_ms``: one pass over ``seen``."""
    counts: Tally[str] = Tally()
    for key, at in seen:
        if at >= since_ms:
            counts[key.partition("|")[0]] += 1
    return counts


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

    def rate(n: float, per: float) -> float:  # within the record's ranges, whatever the tables hold
        return round(min(MAX_RATE_RPS, n / per), 3) if per else 0.0

    return ModelStats(
        model=model, window_s=window_s,
        inputs_rps=rate(windows["inputs"], span), batches_rps=rate(batches, span),
        mean_batch=rate(windows["inputs"], batches),
        service_ms=round(min(MAX_DURATION_MS, sum(windows["service_ms"].values()) / n_total), 3) if n_total else 0.0,
        service_ms_by_size={b: round(min(MAX_DURATION_MS, windows["service_ms"][b] / n), 3)
                            for b, n in windows["service_n"].items() if n},
        shed={r: min(MAX_COUNT, n) for r, n in windows["shed"].items() if n}, inputs_total=min(MAX_COUNT, total),
        updated_ms=int(time.time() * 1000), workers=workers,
        requests_per_batch=rate(windows["requests"], batches),
        steps_rps=rate(windows["steps"], span),
    )


WINDOWED_TABLES = ("inputs", "requests", "batches", "steps", "service-n", "service-ms", "shed")
LATEST_TABLES = ("totals", "workers", "models")  # a key's last value only


def changelog(app_id: str, table: str) -> str:
    """faust's name for a table's changelog topic."""
    return f"{app_id}-{table}-changelog"


def changelog_configs(app_id: str, window_s: float) -> dict[str, dict[str, str]]:
    """Configs of the processor's changelog topics beyond what faust gives them.

    Compaction and retention never touch a topic's open segment, which Kafka rolls after a week by
    default: until then a restart reads back every write. The windowed tables' changelogs roll one as
    often as their windows expire, the others one an hour."""
    rolled = {"segment.ms": str(kept_ms(window_s))}
    hourly = {"segment.ms": str(3_600_000)}
    return {changelog(app_id, t): rolled if t in WINDOWED_TABLES else hourly for t in WINDOWED_TABLES + LATEST_TABLES}


class OnePartitionTable(faust.Table[Any, Any]):
    """A faust table whose changelog a fresh cluster has not shown its consumer yet still takes writes.

    Before a table's first write from a source topic, faust compares the partitions of the source and of
    the changelog in its consumer's metadata. A changelog the processor has just made on a cluster of
    several brokers shows there with 0 partitions (no leader elected yet), and that metadata stays until
    its next refresh, minutes later: every write failed the check and nothing was counted. Here a count
    not known yet passes (the write itself waits for the producer's metadata); a known mismatch is
    still refused, as faust does."""

    def _verify_source_topic_partitions(self, source_topic: str) -> None:
        if not self.app.consumer.topic_partitions(self.changelog_topic_name):
            return
        super()._verify_source_topic_partitions(source_topic)


def _credentials(auth: KafkaAuth) -> Any:
    """This process's Kafka security settings (topics.connect) in faust's terms."""
    context = auth.options().get("ssl_context")
    if auth.sasl:
        return faust.SASLCredentials(username=auth.user, password=auth.password, ssl_context=context,
                                     mechanism=auth.mechanism)
    return faust.SSLCredentials(context) if auth.tls else None


def build_app(bootstrap: str, redis_url: str, *, window_s: float = 10.0, publish_s: float = 1.0,
              app_id: str = "kinfer-telemetry", data_dir: str, replication: int = 1) -> faust.App:
    """``replication``: copies of faust's own topics (changelogs): the cluster's default, or on three
    brokers requiring two in-sync copies, its ``acks=-1`` writes to single-copy topics are refused."""
    if window_s < 1 or window_s != int(window_s):  # faust's windows step in whole seconds
        raise ValueError(f"window_s must be a whole number of seconds >= 1, got {window_s}")
    app = faust.App(
        app_id, broker=f"kafka://{bootstrap}", broker_credentials=_credentials(KafkaAuth.from_env()),
        store="memory://", topic_partitions=1, topic_replication_factor=replication, Table=OnePartitionTable,
        web_enabled=False, datadir=data_dir, producer_acks=-1,
        # A new processor starts at the end of kinfer.stats (its windows are about now); a restarted
        # one resumes from its committed offsets and changelogs.
        consumer_auto_offset_reset="latest",
    )
    source = app.topic(STATS_TOPIC, key_serializer="raw", value_serializer="raw")
    keep = timedelta(milliseconds=kept_ms(window_s))
    configs = changelog_configs(app_id, window_s)

    def windowed(name: str, default: type) -> Any:
        table = app.Table(name, default=default, extra_topic_configs=configs[changelog(app_id, name)])
        return table.tumbling(window_s, expires=keep)

    def latest(name: str) -> Any:
        return app.Table(name, default=int, extra_topic_configs=configs[changelog(app_id, name)])

    tables = Aggregator(
        window_s=window_s,
        inputs=windowed("inputs", int),
        requests=windowed("requests", int),
        batches=windowed("batches", int),
        steps=windowed("steps", int),
        service_n=windowed("service-n", int),
        service_ms=windowed("service-ms", float),
        shed=windowed("shed", int),
        totals=latest("totals"),
        seen=latest("workers"),
        models=latest("models"),
    )
    redis = aioredis.Redis.from_url(redis_url)

    @app.agent(source)
    async def aggregate(stream: Any) -> None:
        async for value in stream:
            tables.add(value, now_ms())
            while tables.forgotten:
                _unlabel(tables.forgotten.pop())

    def both(table: Any, key: str, now: float) -> Any:
        """The current window's value plus the previous one's."""
        window = table.table.window
        return sum(table[key][window.current(t)] for t in (now, now - window_s))

    async def publish() -> None:
        now = time.time()
        elapsed = now - table_start(tables.inputs, now)
        workers = workers_by_model(list(tables.seen.items()), (now - window_s - elapsed) * 1000.0)
        t = tables
        async with redis.pipeline(transaction=False) as pipe:
            for model in list(t.models.keys()):
                try:
                    windows = {
                        "inputs": both(t.inputs, model, now), "requests": both(t.requests, model, now),
                        "batches": both(t.batches, model, now), "steps": both(t.steps, model, now),
                        "service_n": {b: both(t.service_n, f"{model}|{b}", now) for b in BUCKETS},
                        "service_ms": {b: both(t.service_ms, f"{model}|{b}", now) for b in BUCKETS},
                        "shed": {r: both(t.shed, f"{model}|{r}", now) for r in SHED_REASONS},
                    }
                    summary = summarize(model, window_s, elapsed, windows, t.totals[model], workers[model])
                except Exception:  # one model's summary that fails leaves the others'
                    log.exception("telemetry: no summary for %s", model)
                    continue
                SERVICE.labels(model).set(summary.service_ms / 1000.0)
                SERVED.labels(model).set(summary.inputs_rps)
                REPORTING.labels(model).set(summary.workers)
                pipe.set(stats_key(model), summary.pack(), px=int(max(30.0, window_s * 6) * 1000))
            try:
                await pipe.execute()
            except (RedisError, OSError) as exc:
                log.warning("telemetry: Redis unreachable: %s", exc)
                return
        PUBLISHED.set(now)

    app.timer(interval=publish_s)(publish)
    return app


def _unlabel(model: str) -> None:
    """A forgotten model leaves no series behind."""
    for metric in (RECORDS, SERVICE, SERVED, REPORTING):
        with contextlib.suppress(KeyError):
            metric.remove(model)


def table_start(table: Any, now: float) -> float:
    start: float = table.table.window.current(now)[0]
    return start


def run(bootstrap: str, redis_url: str, *, window_s: float = 10.0, publish_s: float = 1.0,
        app_id: str = "kinfer-telemetry", loglevel: str = "warning") -> None:
    """Run the processor until SIGTERM/SIGINT (then it commits and leaves its group)."""
    # Asked on a thread of its own: asyncio.run on this one would leave it without the loop faust expects.
    with ThreadPoolExecutor(1) as pool:
        replication = pool.submit(asyncio.run, cluster_replication(bootstrap)).result()
        # Changelogs made before their configs were: given them now, so the next restart reads back less.
        pool.submit(asyncio.run, set_topic_configs(bootstrap, changelog_configs(app_id, window_s))).result()
    # The tables live in memory and come back from their changelogs: faust's folder holds nothing a
    # restart needs, so it is this process's own, removed when it ends.
    with tempfile.TemporaryDirectory(prefix=f"{app_id}-") as data_dir:
        app = build_app(bootstrap, redis_url, window_s=window_s, publish_s=publish_s, app_id=app_id,
                        data_dir=data_dir, replication=replication)
        worker = faust.Worker(app, loglevel=loglevel, quiet=True)
        # No terminal spinner: to turn it on every log call, faust sets the root logger to DEBUG, and every
        # debug line of faust and aiokafka (several a record) then builds a log record nobody prints.
        worker.spinner = None
        worker.execute_from_commandline()
