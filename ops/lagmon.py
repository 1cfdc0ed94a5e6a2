"""``kinfer lagmon``: consumer lag → a health state per model, published for producers to obey.

Every ``interval_s``: for each model, the log-end offsets of its request topics and the committed
offsets of its consumer group give the lag (records waiting, per priority) and, over time, arrival
and drain rates; ``HealthEstimator`` turns them into a level with smoothing and hysteresis, and the
telemetry stream's summary adds the model's service time. The state goes to a Redis key
(``kinfer:health:<model>``), a pub/sub notification (``kinfer:health``) and the compacted topic
``kinfer.health`` keyed by model; every level change is also kept in ``kinfer:decisions``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from prometheus_client import Counter, Gauge
from redis.exceptions import RedisError

from ops.health import HealthEstimator, HealthPolicy
from topics import MalformedRecord, now_ms
from topics.admin import TopicSpec, ensure_topics
from topics.connect import kafka_options
from topics.health import (
    DECISIONS_KEPT,
    DECISIONS_KEY,
    HEALTH_CHANNEL,
    HEALTH_TOPIC,
    HealthState,
    Level,
    LevelChange,
    health_key,
)
from topics.names import consumer_group, parse_request_topic, request_topics, served_models
from topics.stats import ModelStats, stats_key

log = logging.getLogger(__name__)

LAG = Gauge("kinfer_lag_records", "Records waiting in a model's request topics", ["model"])
LEVEL = Gauge("kinfer_health_level", "0 ok, 1 degraded, 2 shedding, 3 rejecting", ["model"])
LEVEL_CHANGES = Counter("kinfer_health_level_changes_total", "Level changes", ["model", "to"])


STATS_FRESH_MS = 5_000  # a telemetry summary older than this is no evidence (the processor may be down)


def health_topic_spec() -> TopicSpec:
    return TopicSpec(HEALTH_TOPIC, 1, 1, {"cleanup.policy": "compact"})


@dataclass
class LagMonitor:
    bootstrap: str
    redis_url: str
    models: list[str] | None = None  # None: every model with request topics
    interval_s: float = 0.5
    policy: HealthPolicy = field(default_factory=HealthPolicy)
    states: dict[str, HealthState] = field(default_factory=dict)
    partitions: dict[str, int] = field(default_factory=dict)  # per request topic (the fewest of the three)
    stats: dict[str, ModelStats] = field(default_factory=dict)  # fresh telemetry summaries only
    estimators: dict[str, HealthEstimator] = field(default_factory=dict)  # by model
    _changes: list[LevelChange] = field(default_factory=list)  # not yet recorded in Redis

    @staticmethod
    async def _telemetry(redis: aioredis.Redis | None, model: str) -> ModelStats | None:
        """The model's summary from the telemetry stream (None when it is not running)."""
        if redis is None:
            return None
        try:
            data = await redis.get(stats_key(model))
            return ModelStats.unpack(data) if isinstance(data, bytes) else None
        except (RedisError, OSError, MalformedRecord):
            return None

    async def run(self, stop: asyncio.Event) -> None:
        await ensure_topics(self.bootstrap, [health_topic_spec()])
        producer = AIOKafkaProducer(**kafka_options(self.bootstrap), acks="all")
        redis = aioredis.Redis.from_url(self.redis_url)
        await producer.start()
        try:
            async with offset_clients(self.bootstrap) as (admin, consumer):
                while not stop.is_set():
                    try:
                        for state in await self.poll(admin, consumer, redis):
                            await self._publish(state, producer, redis)
                    except (KafkaError, RedisError, OSError) as exc:
                        log.warning("lag poll failed, retrying: %s", exc)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), self.interval_s)
        finally:
            await producer.stop()
            await redis.aclose()

    async def poll(
        self, admin: AIOKafkaAdminClient, consumer: AIOKafkaConsumer, redis: aioredis.Redis | None = None
    ) -> list[HealthState]:
        models = self.models or served_models(await admin.list_topics())
        states = []
        for model in models:
            measured = now_ms()  # before the offsets: producers count their sends from here
            offsets = await read_offsets(admin, consumer, model)
            if offsets is None:
                continue
            lag = sum(offsets.lag)
            stats = await self._telemetry(redis, model)
            estimator = self.estimators.setdefault(model, HealthEstimator(self.policy))
            fresh = stats is not None and now_ms() - stats.updated_ms < STATS_FRESH_MS
            self.partitions[model] = offsets.partitions
            if stats is not None and fresh:
                self.stats[model] = stats
            else:
                self.stats.pop(model, None)
            level = estimator.observe(
                time.monotonic(), lag, sum(offsets.log_end), offsets.committed_total, offsets.log_end,
                capacity_rps=stats.capacity_rps if stats is not None and fresh else None,
                progressing=stats is not None and fresh and stats.batches_rps > 0,
            )
            state = estimator.state(model, measured, lag_by_priority=offsets.lag,
                                    service_ms=stats.service_ms if stats else 0.0)
            previous = self.states.get(model)
            if previous is None or previous.level != level:
                LEVEL_CHANGES.labels(model, level.name.lower()).inc()
                log.info("%s: %s (lag %d, predicted wait %.0f ms)", model, level.name, lag, estimator.wait_ms)
                self._changes.append(LevelChange(state.updated_ms, model, previous.level if previous else None,
                                                 level, lag, round(estimator.wait_ms, 1)))
            self.states[model] = state
            LAG.labels(model).set(lag)
            LEVEL.labels(model).set(int(level))
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


@contextlib.asynccontextmanager
async def offset_clients(bootstrap: str) -> AsyncIterator[tuple[AIOKafkaAdminClient, AIOKafkaConsumer]]:
    """What reading a model's lag takes: an admin client (committed offsets) and a consumer (log ends)."""
    admin = AIOKafkaAdminClient(**kafka_options(bootstrap))
    consumer = AIOKafkaConsumer(**kafka_options(bootstrap), enable_auto_commit=False)
    await admin.start()
    try:
        await consumer.start()
        try:
            yield admin, consumer
        finally:
            await consumer.stop()
    finally:
        await admin.close()


@dataclass(frozen=True, slots=True)
class Offsets:
    lag: tuple[int, int, int]  # records waiting, per priority (p0, p1, p2)
    log_end: tuple[int, int, int]  # records ever written, per priority
    committed_total: int  # records done, all priorities
    partitions: int = 0  # of each request topic (the fewest, should they differ)


async def read_offsets(admin: AIOKafkaAdminClient, consumer: AIOKafkaConsumer, model: str) -> Offsets | None:
    """The model's offsets by priority; None when it has no request topics."""
    described = await admin.describe_topics(request_topics(model))
    parts = [TopicPartition(t["topic"], p["partition"]) for t in described if t["error_code"] == 0
             for p in t["partitions"]]
    if not parts:
        return None
    ends = await consumer.end_offsets(parts)
    committed = await admin.list_consumer_group_offsets(consumer_group(model), partitions=parts)
    done = {tp: max(0, committed[tp].offset) if tp in committed else 0 for tp in parts}
    lag, end = [0, 0, 0], [0, 0, 0]
    for tp in parts:
        p = int(parse_request_topic(tp.topic)[1])
        lag[p] += max(0, ends[tp] - done[tp])
        end[p] += ends[tp]
    counts = [len(t["partitions"]) for t in described if t["error_code"] == 0]
    return Offsets((lag[0], lag[1], lag[2]), (end[0], end[1], end[2]), sum(done.values()), min(counts))


__all__ = ["LagMonitor", "Level", "health_topic_spec"]
