"""Reading a model's offsets (topics.admin.read_offsets_many) against fake Kafka clients."""

from __future__ import annotations

from typing import Any

from aiokafka import TopicPartition
from aiokafka.structs import OffsetAndMetadata

from kinfer.topics.admin import read_offsets_many


class _Admin:
    def __init__(self, committed: dict[TopicPartition, int]) -> None:
        self.committed = committed

    async def describe_topics(self, topics: list[str]) -> list[dict[str, Any]]:
        return [{"topic": t, "error_code": 0, "partitions": [{"partition": 0}, {"partition": 1}]} for t in topics]

    async def list_consumer_group_offsets(self, group: str, partitions: list[TopicPartition]) -> dict[Any, Any]:
        return {tp: OffsetAndMetadata(self.committed[tp], "") for tp in partitions if tp in self.committed}


class _Consumer:
    def __init__(self, ends: dict[TopicPartition, int]) -> None:
        self.ends = ends

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: self.ends.get(tp, 0) for tp in tps}


A, B = TopicPartition("infer.m.p1", 0), TopicPartition("infer.m.p1", 1)


async def test_a_partition_read_without_a_committed_offset_counts_where_it_was_not_as_its_whole_log() -> None:
    consumer = _Consumer({A: 30_000, B: 30_000})
    floor: dict[TopicPartition, int] = {}
    healthy = _Admin({A: 29_990, B: 29_995})
    first = (await read_offsets_many(healthy, consumer, ["m"], floor))["m"]  # type: ignore[arg-type]
    assert first.lag[1] == 15 and (floor[A], floor[B]) == (29_990, 29_995)
    moving = _Admin({A: 29_998})  # the coordinator moves: B comes back without an offset
    consumer.ends = {A: 30_010, B: 30_010}
    second = (await read_offsets_many(moving, consumer, ["m"], floor))["m"]  # type: ignore[arg-type]
    assert second.lag[1] == 12 + 15  # B where it was, not 30,010 records behind
    blind = (await read_offsets_many(moving, consumer, ["m"]))["m"]  # type: ignore[arg-type]
    assert blind.lag[1] == 12 + 30_010  # what a reader without the floor sees


async def test_the_floor_never_passes_the_log_end_of_a_topic_made_again() -> None:
    floor = {A: 5_000, B: 5_000}
    fresh = (await read_offsets_many(_Admin({}), _Consumer({A: 10, B: 0}), ["m"], floor))["m"]  # type: ignore[arg-type]
    assert fresh.lag[1] == 0 and (floor[A], floor[B]) == (10, 0)
