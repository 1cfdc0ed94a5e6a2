"""``kinfer lagmon``: consumer lag → a health state per model, published for producers to obey.

Every ``interval_s``: for each model, the log-end offsets of its request topics and the committed
offsets of its consumer group give the lag (records waiting, per priority) and, over time, arrival
and drain rates. A partition's committed offset is raised to what its workers report answered
(``kinfer:answered:<model>``, ``topics.progress``): commits stall while a group's coordinator moves,
answers do not. ``HealthEstimator`` turns the lag into a level with smoothing and hysteresis, and the
telemetry stream's summary adds the model's service time. The state goes to a Redis key
(``kinfer:health:<model>``), a pub/sub notification (``kinfer:health``) and the compacted topic
``kinfer.health`` keyed by model; every level change is also kept in ``kinfer:decisions``.

What it reads from Redis (the telemetry summaries, the workers' residency and answered reports) is
taken one record at a time: one that does not decode, or is dated ahead of this clock, is counted
(``kinfer_malformed_records_total{reader="lagmon-stats"|"lagmon-residency"|"lagmon-answered"}``) and
left out; a report that is unreadable, dated ahead or long stale is removed from its hash. At most
``MAX_MODELS`` models are tracked (states, estimators, metric labels; a model whose topics went is
forgotten), and ``MAX_WORKERS`` residency reports and answered reports a model are read per poll.
The polling loop restarts with backoff after any failure (``kinfer_reader_up{reader="lagmon"}`` is 0
meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from prometheus_client import Counter, Gauge
from redis.exceptions import RedisError

from kinfer.ops.control.estimator import HealthEstimator, HealthPolicy, PartitionProgress, clamp_ms
from kinfer.topics import now_ms
from kinfer.topics.admin import TopicSpec, ensure_topics, group_members, offset_clients, read_offsets_many
from kinfer.topics.connect import kafka_options
from kinfer.topics.health import (
    DECISIONS_KEPT,
    DECISIONS_KEY,
    HEALTH_CHANNEL,
    HEALTH_TOPIC,
    HealthState,
    Level,
    LevelChange,
    health_key,
)
from kinfer.topics.names import consumer_group, request_topic, served_models
from kinfer.topics.progress import ANSWERED_FORGET_MS, ANSWERED_FRESH_MS, Answered, answered_key
from kinfer.topics.readers import Supervised, read
from kinfer.topics.record import MAX_SKEW_MS, R
from kinfer.topics.residency import RESIDENCY_FRESH_MS, RESIDENCY_KEY, WorkerResidency
from kinfer.topics.stats import ModelStats, stats_key

log = logging.getLogger(__name__)

LAG = Gauge("kinfer_lag_records", "Records waiting in a model's request topics (p0-p2)", ["model"])
BACKGROUND_LAG = Gauge("kinfer_background_lag_records", "Records waiting in a model's background topic (p3)", ["model"])
LEVEL = Gauge("kinfer_health_level", "0 ok, 1 degraded, 2 shedding, 3 rejecting", ["model"])
LEVEL_CHANGES = Counter("kinfer_health_level_changes_total", "Level changes", ["model", "to"])
PREDICTED_WAIT = Gauge("kinfer_predicted_wait_seconds", "Queueing a new request should expect now (what admission "
                       "judges deadlines by)", ["model"])
ARRIVAL = Gauge("kinfer_arrival_rps", "Records/s written to a model's request topics (smoothed)", ["model"])
DRAIN = Gauge("kinfer_drain_rps", "Records/s committed by a model's workers (smoothed)", ["model"])
CAPACITY = Gauge("kinfer_capacity_rps", "Records/s a model's workers drain while busy (0: not measured)", ["model"])
WARM = Gauge("kinfer_warm_replicas", "Members of a model's consumer group: workers with it warm (-1: unknown)",
             ["model"])
COLD_START = Gauge("kinfer_cold_start_seconds", "While a model is cold: expected time until a worker has it warm",
                   ["model"])


STATS_FRESH_MS = 5_000  # a telemetry summary older than this is no evidence (the processor may be down)
RESIDENCY_FORGET_MS = 600_000  # a residency report this old is a dead worker's: removed
COLD_GRACE_S = 5.0  # at least this long a cold model's waiting records are its cold start, not a stall
MAX_MODELS = 1_024  # models tracked (states, estimators, metric labels); more are left out, named in the log
MAX_WORKERS = 1_024  # residency reports read per poll (the hash is scanned; the rest wait for their turn)


def health_topic_spec() -> TopicSpec:
    return TopicSpec(HEALTH_TOPIC, 1, 1, {"cleanup.policy": "compact"})


@dataclass
class LagMonitor:
    bootstrap: str
    redis_url: str
    models: list[str] | None = None  # None: every model with request topics
    interval_s: float = 0.5
    # A poll and its publishing that take longer than this are given up and started again. In a broker kill
    # one poll hung 14 s (requests to a broker that just died wait for its partitions' new leaders, or
    # longer), and the state published before it, read mid-failover (a lag of 737; 23 at the next reading),
    # stood meanwhile: producers refused everything by deadline for 7 s.
    poll_timeout_s: float = 2.0
    policy: HealthPolicy = field(default_factory=HealthPolicy)
    name: str = "lagmon"  # the reader names its metrics carry (the autoscaler runs one of its own)
    states: dict[str, HealthState] = field(default_factory=dict)
    partitions: dict[str, int] = field(default_factory=dict)  # per request topic (the fewest of the three)
    stats: dict[str, ModelStats] = field(default_factory=dict)  # fresh telemetry summaries only
    estimators: dict[str, HealthEstimator] = field(default_factory=dict)  # by model
    _changes: list[LevelChange] = field(default_factory=list)  # not yet recorded in Redis
    _cold_since: dict[str, float] = field(default_factory=dict)  # cold models with records waiting, since
    _committed: dict[TopicPartition, int] = field(default_factory=dict)  # each partition's last committed offset
    _progress: dict[str, PartitionProgress[TopicPartition]] = field(default_factory=dict)  # by model
    _left_out: int = 0  # models beyond MAX_MODELS at the last poll (logged when it changes)
    # Count each partition's queue from the workers' answered positions too (``kinfer:answered:<model>``),
    # not from committed offsets alone: commits stall with a group coordinator's broker, answers do not.
    answered: bool = True

    async def _telemetry(self, redis: aioredis.Redis | None, model: str) -> ModelStats | None:
        """The model's summary from the telemetry stream (None when it is not running)."""
        if redis is None:
            return None
        try:
            data = await redis.get(stats_key(model))
        except (RedisError, OSError):
            return None
        return read_stats(data, now_ms(), f"{self.name}-stats") if data is not None else None

    def _cold(self, model: str, warm: int, lag: int, cold_start_ms: float | None, loading: bool) -> bool:
        """Cold, and believed to be coming: no worker has it warm, one has it registered (it swaps it in
        when records wait), and either one is loading it or its records have waited less than twice the
        cold start (at least ``COLD_GRACE_S``). Its queue not moving is then the cold start, told as
        such, not a stuck worker. Past that nobody is coming (the model is larger than any budget, its
        swaps fail, or it starves): the stall counts again, and the level refuses explicitly. A group
        that cannot be read (``warm`` -1: a fresh cluster has no group coordinator for its first
        seconds) is cold only while a worker says it is loading the model."""
        if warm > 0 or cold_start_ms is None or (warm < 0 and not loading):
            self._cold_since.pop(model, None)
            return False
        if lag == 0:
            self._cold_since.pop(model, None)
            return True
        since = self._cold_since.setdefault(model, time.monotonic())
        return loading or time.monotonic() - since < max(COLD_GRACE_S, 2 * cold_start_ms / 1000.0)

    async def _residency(self, redis: aioredis.Redis | None) -> list[WorkerResidency]:
        """The workers' residency reports (``kinfer:residency``), at most ``MAX_WORKERS``; entries that
        are unreadable, dated ahead or long stale are removed."""
        if redis is None:
            return []
        raw: dict[bytes, object] = {}
        cursor = 0
        try:
            while True:
                cursor, page = await redis.hscan(RESIDENCY_KEY, cursor, count=256)
                if isinstance(page, dict):
                    raw.update((k, v) for k, v in page.items() if isinstance(k, bytes))
                if not cursor or len(raw) >= MAX_WORKERS:
                    break
        except (RedisError, OSError):
            return []
        reports, gone = read_residency(raw, now_ms(), f"{self.name}-residency")
        if gone:
            with contextlib.suppress(RedisError, OSError):
                await redis.hdel(RESIDENCY_KEY, *gone)
        return reports

    async def _answered(self, redis: aioredis.Redis | None, models: list[str]) -> dict[TopicPartition, int]:
        """The workers' freshest answered position of each partition of ``models`` (``kinfer:answered:<model>``,
        at most ``MAX_WORKERS`` reports a model); reports that are unreadable, dated ahead or long stale
        are removed."""
        if redis is None or not self.answered or not models:
            return {}
        try:
            async with redis.pipeline(transaction=False) as pipe:
                for model in models:
                    pipe.hscan(answered_key(model), 0, count=MAX_WORKERS)
                pages = await pipe.execute()
        except (RedisError, OSError):
            return {}
        out: dict[TopicPartition, int] = {}
        now = now_ms()
        for model, (_, page) in zip(models, pages, strict=True):
            raw = {k: v for k, v in page.items() if isinstance(k, bytes)} if isinstance(page, dict) else {}
            positions, gone = read_answered(raw, now, f"{self.name}-answered")
            for (priority, partition), position in positions.items():
                out[TopicPartition(request_topic(model, priority), partition)] = position
            if gone:
                with contextlib.suppress(RedisError, OSError):
                    await redis.hdel(answered_key(model), *gone)
        return out

    async def run(self, stop: asyncio.Event) -> None:
        await ensure_topics(self.bootstrap, [health_topic_spec()])
        await Supervised(self.name, lambda: self._run(stop)).run(stop)

    async def _run(self, stop: asyncio.Event) -> None:
        producer = AIOKafkaProducer(**kafka_options(self.bootstrap), acks="all")
        redis = aioredis.Redis.from_url(self.redis_url)
        try:
            await producer.start()
            async with offset_clients(self.bootstrap) as (admin, consumer):
                while not stop.is_set():
                    await self._poll_once(admin, consumer, producer, redis)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), self.interval_s)
        finally:
            await producer.stop()
            await redis.aclose()

    async def _poll_once(self, admin: AIOKafkaAdminClient, consumer: AIOKafkaConsumer, producer: AIOKafkaProducer,
                         redis: aioredis.Redis) -> bool:
        """One poll and the states it publishes, given up after ``poll_timeout_s``: True when it went through."""
        try:
            async with asyncio.timeout(self.poll_timeout_s):
                for state in await self.poll(admin, consumer, redis):
                    await self._publish(state, producer, redis)
            return True
        except (KafkaError, RedisError, OSError) as exc:
            log.warning("lag poll failed, retrying: %s", exc)
        except TimeoutError:
            log.warning("lag poll took over %.1f s (a broker failing over?), reading again", self.poll_timeout_s)
        return False

    def _tracked(self, models: list[str]) -> list[str]:
        """At most ``MAX_MODELS`` of ``models``; what was tracked of any other is forgotten."""
        if len(models) > MAX_MODELS:
            if len(models) - MAX_MODELS != self._left_out:
                log.warning("%d models, tracking the first %d (by name): %s ... left out", len(models), MAX_MODELS,
                            ", ".join(sorted(models)[MAX_MODELS:][:5]))
            self._left_out = len(models) - MAX_MODELS
            models = sorted(models)[:MAX_MODELS]
        keep = set(models)
        for model in [m for m in self.estimators if m not in keep]:
            for table in (self.estimators, self.states, self.stats, self.partitions, self._cold_since,
                          self._progress):
                table.pop(model, None)
            _unexport(model)
        return models

    async def poll(
        self, admin: AIOKafkaAdminClient, consumer: AIOKafkaConsumer, redis: aioredis.Redis | None = None
    ) -> list[HealthState]:
        models = self._tracked(self.models or served_models(await admin.list_topics()))
        members = await group_members(admin, [consumer_group(model) for model in models])
        reports = await self._residency(redis)
        cold_starts = cold_start_estimates(reports, now_ms())
        loading = loading_models(reports, now_ms())
        states = []
        measured = now_ms()  # before the offsets: producers count their sends from here
        # What the workers answered is done, committed or not: it raises the floor the committed offsets
        # are read against (never past the log's end).
        for tp, position in (await self._answered(redis, models)).items():
            self._committed[tp] = max(self._committed.get(tp, 0), position)
        read = await read_offsets_many(admin, consumer, models, self._committed)
        for model in models:
            offsets = read.get(model)
            if offsets is None:
                continue
            # Records on partitions stuck on their own (owner or leader gone) are not a queue new requests join.
            stuck = self._progress.setdefault(model, PartitionProgress()).stuck_lag(offsets.by_partition,
                                                                                 time.monotonic())
            lag = sum(offsets.lag) - stuck
            stats = await self._telemetry(redis, model)
            estimator = self.estimators.setdefault(model, HealthEstimator(self.policy))
            fresh = stats is not None and -MAX_SKEW_MS <= now_ms() - stats.updated_ms < STATS_FRESH_MS
            self.partitions[model] = offsets.partitions
            if stats is not None and fresh:
                self.stats[model] = stats
            else:
                self.stats.pop(model, None)
            warm = members.get(consumer_group(model), -1)
            cold = self._cold(model, warm, lag, cold_starts.get(model), model in loading)
            level = estimator.observe(
                time.monotonic(), lag, sum(offsets.log_end), offsets.committed_total, offsets.log_end,
                capacity_rps=stats.capacity_rps if stats is not None and fresh else None,
                progressing=stats is not None and fresh and stats.batches_rps > 0, cold=cold,
            )
            state = estimator.state(model, measured, lag_by_priority=offsets.lag,
                                    service_ms=stats.service_ms if stats else 0.0, warm_replicas=warm,
                                    cold_start_ms=cold_starts[model] if cold else 0.0,
                                    background_lag=offsets.background)
            previous = self.states.get(model)
            if previous is None or previous.level != level:
                LEVEL_CHANGES.labels(model, level.name.lower()).inc()
                log.info("%s: %s (lag %d, predicted wait %.0f ms)", model, level.name, lag, estimator.wait_ms)
                self._changes.append(LevelChange(state.updated_ms, model, previous.level if previous else None,
                                                 level, state.lag, clamp_ms(estimator.wait_ms)))
            self.states[model] = state
            export_state(state)
            states.append(state)
        return states

    async def _publish(self, state: HealthState, producer: AIOKafkaProducer, redis: aioredis.Redis) -> None:
        data = state.pack()
        changes = [c for c in self._changes if c.model == state.model]
        async with redis.pipeline(transaction=False) as pipe:
            pipe.set(health_key(state.model), data, px=max(5_000, int(self.interval_s * 10_000)))
            pipe.publish(HEALTH_CHANNEL, data)
            for change in changes:
                pipe.lpush(DECISIONS_KEY, change.pack())
            if changes:
                pipe.ltrim(DECISIONS_KEY, 0, DECISIONS_KEPT - 1)
            await pipe.execute()
        self._changes = [c for c in self._changes if c.model != state.model]
        await producer.send(HEALTH_TOPIC, data, key=state.model.encode())


def export_state(state: HealthState) -> None:
    """The state as Prometheus gauges (the dashboard's lag, level, predicted wait, rates, cold starts)."""
    model = state.model
    LAG.labels(model).set(state.lag)
    BACKGROUND_LAG.labels(model).set(state.background_lag)
    LEVEL.labels(model).set(int(state.level))
    PREDICTED_WAIT.labels(model).set(state.predicted_wait_ms / 1000.0)
    ARRIVAL.labels(model).set(state.arrival_rps)
    DRAIN.labels(model).set(state.drain_rps)
    CAPACITY.labels(model).set(state.capacity_rps)
    WARM.labels(model).set(state.warm_replicas)
    COLD_START.labels(model).set(state.cold_start_ms / 1000.0)


def _unexport(model: str) -> None:
    """A model no longer tracked leaves no series behind."""
    for gauge in (LAG, BACKGROUND_LAG, LEVEL, PREDICTED_WAIT, ARRIVAL, DRAIN, CAPACITY, WARM, COLD_START):
        with contextlib.suppress(KeyError):
            gauge.remove(model)
    for level in Level:
        with contextlib.suppress(KeyError):
            LEVEL_CHANGES.remove(model, level.name.lower())


def read_stats(data: object, now: int, reader: str = "lagmon-stats") -> ModelStats | None:
    """A telemetry summary off Redis, or None (counted) when it does not decode or is dated ahead."""
    return read(ModelStats, data, reader, now)


def read_reports(kind: type[R], raw: Mapping[bytes, object], now: int, reader: str,
                 forget_ms: int) -> tuple[list[R], list[bytes]]:
    """The workers' reports in ``raw`` (field -> value of a hash of them) that can be used, and the
    fields to remove: unreadable (counted), dated ahead of ``now`` (counted: a report from the future
    would never go stale), or dated (``kind.dated_by``) more than ``forget_ms`` ago (a worker killed
    without saying goodbye)."""
    reports, gone = [], []
    for worker, data in raw.items():
        report = read(kind, data, reader, now)
        if report is None or now - getattr(report, kind.dated_by or "") > forget_ms:
            gone.append(worker)
        else:
            reports.append(report)
    return reports, gone


def read_residency(raw: Mapping[bytes, object], now: int,
                   reader: str = "lagmon-residency") -> tuple[list[WorkerResidency], list[bytes]]:
    """The residency reports in ``raw`` (``kinfer:residency``), and the fields to remove (``read_reports``)."""
    return read_reports(WorkerResidency, raw, now, reader, RESIDENCY_FORGET_MS)


def read_answered(raw: Mapping[bytes, object], now: int,
                  reader: str = "lagmon-answered") -> tuple[dict[tuple[int, int], int], list[bytes]]:
    """Of ``raw`` (one model's ``kinfer:answered:<model>``): the highest answered position per (priority,
    partition) among fresh reports (``ANSWERED_FRESH_MS``), and the fields to remove (``read_reports``)."""
    reports, gone = read_reports(Answered, raw, now, reader, ANSWERED_FORGET_MS)
    best: dict[tuple[int, int], int] = {}
    for report in reports:
        if now - report.updated_ms <= ANSWERED_FRESH_MS:
            for p in report.positions:
                best[(p.priority, p.partition)] = max(best.get((p.priority, p.partition), 0), p.position)
    return best, gone


def loading_models(reports: list[WorkerResidency], now: int) -> set[str]:
    """Models some worker is swapping in now (fresh reports)."""
    return {m.model for r in reports if now - r.updated_ms <= RESIDENCY_FRESH_MS for m in r.models
            if m.tier == "loading"}


def cold_start_estimates(reports: list[WorkerResidency], now: int) -> dict[str, float]:
    """Per model some worker could swap in (it is registered there, off the device): how soon one should
    have it warm — the fastest, among fresh reports, of each such worker's last measured swap-in from the
    tier its weights are in now (one loading it counts its slowest measured tier); 0.0: never measured."""
    best: dict[str, float] = {}
    for report in reports:
        if now - report.updated_ms > RESIDENCY_FRESH_MS:
            continue
        for m in report.models:
            if m.tier == "device":
                continue
            # One being loaded counts its slowest measured tier.
            measured = max(m.swap_in_ms.values(), default=0.0) if m.tier == "loading" else m.swap_in_ms.get(m.tier, 0.0)
            known = best.get(m.model)
            if known is None or (measured > 0 and (known == 0 or measured < known)):
                best[m.model] = measured
    return best


__all__ = ["LagMonitor", "Level", "health_topic_spec"]
