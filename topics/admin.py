"""Topic administration: create the contract's topics, or check that they are as configured."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewPartitions, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError

from kinfer.topics.batches import BATCHES_TOPIC, CHUNK_BYTES, FILES_TOPIC
from kinfer.topics.connect import kafka_options
from kinfer.topics.errors import Unavailable
from kinfer.topics.names import DEFAULT_REPLY_TOPIC, DLQ_TOPIC, consumer_group, parse_request_topic, request_topics
from kinfer.topics.stats import STATS_TOPIC

log = logging.getLogger(__name__)

_TOPIC_ALREADY_EXISTS = 36


@dataclass(frozen=True, slots=True)
class TopicSpec:
    name: str
    partitions: int
    replication: int = 0  # 0: follow the cluster (see ``replication_for``)
    configs: dict[str, str] = field(default_factory=dict)
    min_insync: int = 0  # min.insync.replicas; 0: follow the replication factor


def replication_for(brokers: int, replication: int = 0, min_insync: int = 0) -> tuple[int, int]:
    """(replication factor, min.insync.replicas) for a cluster of ``brokers``.

    Unless given: three copies where there are three brokers (fewer on a smaller cluster), and a
    write acknowledged by all but one of them. With ``acks=all`` that loses nothing when one broker
    dies and keeps accepting writes while one is down; a single broker is one copy and one outage.
    """
    factor = replication or min(3, max(1, brokers))
    insync = min_insync or max(1, factor - 1)
    if factor > brokers:
        raise ValueError(f"replication factor {factor} needs at least {factor} brokers; the cluster has {brokers}")
    if not 1 <= insync <= factor:
        raise ValueError(f"min.insync.replicas must be within 1..{factor}, got {insync}")
    return factor, insync


def model_topic_specs(model: str, partitions: int, replication: int = 0, min_insync: int = 0) -> list[TopicSpec]:
    """The request topics of one model. Requests are short-lived: keep a day, delete, not compact."""
    configs = {"retention.ms": str(24 * 3600 * 1000), "cleanup.policy": "delete"}
    return [TopicSpec(t, partitions, replication, configs, min_insync) for t in request_topics(model)]


def shared_topic_specs(replication: int = 0, reply_partitions: int = 3, min_insync: int = 0) -> list[TopicSpec]:
    """The topics every deployment needs: the dead-letter topic, the default reply topic, telemetry, and
    the Batch API's files and batches."""
    return [
        TopicSpec(DLQ_TOPIC, 1, replication, {"retention.ms": str(7 * 24 * 3600 * 1000)}, min_insync),
        # Replies matter for seconds: keep an hour, so a reconnecting client cannot drown in them.
        TopicSpec(DEFAULT_REPLY_TOPIC, reply_partitions, replication, {"retention.ms": str(3600 * 1000)}, min_insync),
        # Batch statistics feed windowed tables; a day is plenty to rebuild them. One partition: one
        # telemetry processor sees every model (its tables are small).
        TopicSpec(STATS_TOPIC, 1, replication, {"retention.ms": str(24 * 3600 * 1000)}, min_insync),
        *batch_topic_specs(replication, min_insync),
    ]


def batch_topic_specs(replication: int = 0, min_insync: int = 0) -> list[TopicSpec]:
    """The Batch API's files and batches: compacted (each key's latest record stays), one partition each."""
    compacted = {"cleanup.policy": "compact", "max.message.bytes": str(2 * CHUNK_BYTES)}
    return [TopicSpec(FILES_TOPIC, 1, replication, compacted, min_insync),
            TopicSpec(BATCHES_TOPIC, 1, replication, compacted, min_insync)]


async def ensure_topics(bootstrap: str, specs: Iterable[TopicSpec]) -> dict[str, int]:
    """Create missing topics; grow existing ones that have fewer partitions than specified.

    Returns the partition count of every topic afterwards. A topic with *more* partitions than
    specified is left alone (Kafka cannot shrink a topic) and logged.
    """
    specs = list(specs)
    admin = AIOKafkaAdminClient(**kafka_options(bootstrap, request_timeout_ms=15_000))
    try:
        await admin.start()
        existing = await _partition_counts(admin, [s.name for s in specs])
        missing = [s for s in specs if s.name not in existing]
        if missing:
            brokers = len((await admin.describe_cluster())["brokers"])
            new = []
            for s in missing:
                factor, insync = replication_for(brokers, s.replication, s.min_insync)
                configs = {**s.configs, "min.insync.replicas": str(insync)}
                new.append(NewTopic(s.name, s.partitions, factor, topic_configs=configs))
            resp = await admin.create_topics(new)
            for topic, code, *rest in resp.topic_errors:
                if code not in (0, _TOPIC_ALREADY_EXISTS):
                    raise Unavailable(f"could not create topic {topic}: error {code} {rest}")
        grow = {
            s.name: NewPartitions(s.partitions)
            for s in specs
            if s.name in existing and existing[s.name] < s.partitions
        }
        if grow:
            await admin.create_partitions(grow)
        for s in specs:
            if existing.get(s.name, 0) > s.partitions:
                log.info("topic %s has %d partitions (> %d asked); kept", s.name, existing[s.name], s.partitions)
        return await _partition_counts(admin, [s.name for s in specs], expect_all=True)
    except KafkaError as exc:
        raise Unavailable(f"topic administration on {bootstrap} failed: {exc}") from exc
    finally:
        await admin.close()


async def delete_topics(bootstrap: str, names: list[str]) -> bool:
    """Delete ``names`` (what a benchmark's models or a finished batch leave behind); False, logged, when the
    cluster refuses or cannot be reached: the topics stay, harming nothing but listings."""
    admin = AIOKafkaAdminClient(**kafka_options(bootstrap, request_timeout_ms=15_000))
    try:
        await admin.start()
        await admin.delete_topics(names)
        return True
    except KafkaError as exc:
        log.warning("deleting %s failed: %s", ", ".join(names[:5]), exc)
        return False
    finally:
        await admin.close()


_DYNAMIC_TOPIC_CONFIG = 1  # DescribeConfigs v1+: the config was set on the topic itself


def _set_on_topic(entry: tuple[Any, ...]) -> bool:
    """A DescribeConfigs entry (name, value, read only, v0: is default / v1+: source, ...) the topic was given."""
    marker = entry[3]
    return not marker if isinstance(marker, bool) else bool(marker == _DYNAMIC_TOPIC_CONFIG)


async def set_topic_configs(bootstrap: str, wanted: dict[str, dict[str, str]]) -> list[str]:
    """Give the existing ones of these topics these configs, keeping the others set on them (AlterConfigs
    replaces a topic's whole set, so it is read first). A topic that does not exist yet is left alone: it
    gets them when it is created. Returns the topics changed; [] (logged) when the cluster refuses."""
    admin = AIOKafkaAdminClient(**kafka_options(bootstrap, request_timeout_ms=15_000))
    try:
        await admin.start()
        names = sorted(set(wanted) & set(await admin.list_topics()))
        if not names:
            return []
        changes = []
        for response in await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n) for n in names]):
            for error, _message, _kind, name, entries in response.resources:
                own = {e[0]: e[1] for e in entries if _set_on_topic(e)}
                if error == 0 and name in wanted and any(own.get(k) != v for k, v in wanted[name].items()):
                    changes.append(ConfigResource(ConfigResourceType.TOPIC, name, configs={**own, **wanted[name]}))
        changed = []
        for response in await admin.alter_configs(changes) if changes else []:
            for error, message, _kind, name in response.resources:
                if error:
                    log.warning("configs of %s not changed: %s (error %d)", name, message, error)
                else:
                    changed.append(name)
        return changed
    except KafkaError as exc:
        log.warning("topic configs not changed: %s", exc)
        return []
    finally:
        await admin.close()


async def missing_topics(bootstrap: str, names: list[str]) -> list[str]:
    """Which of ``names`` the cluster does not have."""
    admin = AIOKafkaAdminClient(**kafka_options(bootstrap, request_timeout_ms=15_000))
    try:
        await admin.start()
        existing = await _partition_counts(admin, names)
    except KafkaError as exc:
        raise Unavailable(f"Kafka at {bootstrap} is unavailable: {exc}") from exc
    finally:
        await admin.close()
    return [n for n in names if n not in existing]


async def _partition_counts(
    admin: AIOKafkaAdminClient, names: list[str], expect_all: bool = False
) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _ in range(50):
        counts = {
            t["topic"]: len(t["partitions"])
            for t in await admin.describe_topics(names)
            if t["error_code"] == 0 and t["partitions"]
        }
        if not expect_all or len(counts) == len(names):
            return counts
        # Freshly created topics take a moment to show up in metadata.
        await asyncio.sleep(0.1)
    return counts
@contextlib.asynccontextmanager
async def offset_clients(bootstrap: str) -> AsyncIterator[tuple[AIOKafkaAdminClient, AIOKafkaConsumer]]:
    """What reading a model's lag takes: an admin client (committed offsets) and a consumer (log ends)."""
    admin = AIOKafkaAdminClient(**kafka_options(bootstrap))
    try:
        await admin.start()
        consumer = AIOKafkaConsumer(**kafka_options(bootstrap), enable_auto_commit=False)
        try:  # one that failed to start is stopped too (else it is left unclosed, and says so)
            await consumer.start()
            yield admin, consumer
        finally:
            await consumer.stop()
    finally:
        await admin.close()


@dataclass(frozen=True, slots=True)
class Offsets:
    lag: tuple[int, int, int]  # records waiting, per priority (p0, p1, p2)
    log_end: tuple[int, int, int]  # records ever written, per priority
    committed_total: int  # records done, p0-p2
    partitions: int = 0  # of each request topic (the fewest, should they differ)
    by_partition: dict[TopicPartition, tuple[int, int]] = field(default_factory=dict)  # (log end, committed)
    background: int = 0  # records waiting in the background topic (p3): not in ``lag``, nor ``by_partition``


async def read_offsets(admin: AIOKafkaAdminClient, consumer: AIOKafkaConsumer, model: str) -> Offsets | None:
    """The model's offsets by priority; None when it has no request topics."""
    return (await read_offsets_many(admin, consumer, [model])).get(model)


async def read_offsets_many(admin: AIOKafkaAdminClient, consumer: AIOKafkaConsumer,
                            models: list[str], floor: dict[TopicPartition, int] | None = None) -> dict[str, Offsets]:
    """Offsets by priority of each model that has request topics: one metadata request and one
    ListOffsets for all of them, then each group's committed offsets (a request per group).

    ``floor``, kept by a caller that reads again and again: the committed offset each partition was
    last read at. A group's committed offsets only move forward, so a partition the broker answers
    without one (its group coordinator moving, a broker down) counts as where it was, not as nothing
    committed (its whole log as lag, a queue of tens of thousands that is not there)."""
    described = await admin.describe_topics([t for model in models for t in request_topics(model)])
    parts = [TopicPartition(t["topic"], p["partition"]) for t in described if t["error_code"] == 0
             for p in t["partitions"]]
    if not parts:
        return {}
    ends = await consumer.end_offsets(parts)
    by_model: dict[str, list[TopicPartition]] = {}
    for tp in parts:
        by_model.setdefault(parse_request_topic(tp.topic)[0], []).append(tp)
    counts: dict[str, list[int]] = {}
    for t in described:
        if t["error_code"] == 0:
            counts.setdefault(parse_request_topic(t["topic"])[0], []).append(len(t["partitions"]))
    out = {}
    for model, mine in by_model.items():
        committed = await admin.list_consumer_group_offsets(consumer_group(model), partitions=mine)
        done = {tp: max(0, committed[tp].offset) if tp in committed else 0 for tp in mine}
        if floor is not None:
            for tp in mine:  # never past the log's end: a topic deleted and created again starts over
                done[tp] = floor[tp] = min(max(done[tp], floor.get(tp, 0)), ends[tp])
        lag, end = [0, 0, 0, 0], [0, 0, 0, 0]
        for tp in mine:
            p = int(parse_request_topic(tp.topic)[1])
            lag[p] += max(0, ends[tp] - done[tp])
            end[p] += ends[tp]
        interactive = {tp: (ends[tp], done[tp]) for tp in mine if not parse_request_topic(tp.topic)[1].background}
        out[model] = Offsets((lag[0], lag[1], lag[2]), (end[0], end[1], end[2]),
                             sum(done[tp] for tp in interactive), min(counts[model]), interactive, lag[3])
    return out


async def cluster_replication(bootstrap: str) -> int:
    """The replication factor this cluster's topics get by default (``replication_for`` its brokers)."""
    admin = AIOKafkaAdminClient(**kafka_options(bootstrap))
    await admin.start()
    try:
        brokers = len((await admin.describe_cluster())["brokers"])
    finally:
        await admin.close()
    return replication_for(brokers)[0]


async def group_members(admin: AIOKafkaAdminClient, groups: list[str]) -> dict[str, int]:
    """Members of each consumer group now (0: nobody consumes; a model with none has no warm replica;
    -1: not known, e.g. the broker has no group coordinator yet).

    One DescribeGroups request per group: aiokafka 0.14 reads a v3 response with the v2 schema, which
    misses each group's trailing ``authorized_operations`` — harmless for the last group of a response,
    a garbled read ("Buffer underrun") and a dropped connection for any group before it.
    """

    async def members(group: str) -> int:
        try:
            responses = await admin.describe_consumer_groups([group])
        except KafkaError:
            return -1
        for response in responses:
            for g in response.groups:  # (error, group id, state, protocol type, protocol, members, ...)
                if g[1] == group:
                    return len(g[5]) if g[0] == 0 else -1
        return 0

    counts = await asyncio.gather(*(members(group) for group in groups))
    return dict(zip(groups, counts, strict=True))


