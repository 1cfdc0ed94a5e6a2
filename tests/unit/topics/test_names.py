from __future__ import annotations

import pytest

from kinfer.topics.admin import replication_for
from kinfer.topics.names import (
    Priority,
    consumer_group,
    parse_request_topic,
    redis_reply_channel,
    request_topic,
    request_topics,
)


def test_request_topics_are_per_model_and_priority() -> None:
    assert request_topic("minilm", Priority.P0) == "infer.minilm.p0"
    assert request_topics("m-1") == ["infer.m-1.p0", "infer.m-1.p1", "infer.m-1.p2", "infer.m-1.p3"]
    assert parse_request_topic("infer.m-1.p2") == ("m-1", Priority.P2)
    assert consumer_group("minilm") == "kinfer.worker.minilm"
    assert redis_reply_channel("search", "abc") == "kinfer:reply:search:abc"


@pytest.mark.parametrize("name", ["", "Upper", "dot.ted", "x" * 64, "-lead", "sp ace"])
def test_bad_model_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError):
        request_topic(name, Priority.P1)


@pytest.mark.parametrize("topic", ["infer.dlq", "infer.m.p9", "replies.x", "infer.M.p0", "infer.m.p0.extra"])
def test_parse_rejects_other_topics(topic: str) -> None:
    with pytest.raises(ValueError):
        parse_request_topic(topic)


def test_priority_parse() -> None:
    assert Priority.parse("p2") is Priority.P2
    assert Priority.parse(0) is Priority.P0
    with pytest.raises(ValueError):
        Priority.parse("high")


def test_replication_follows_the_cluster_unless_given() -> None:
    assert replication_for(1) == (1, 1)  # one broker: one copy, one outage
    assert replication_for(2) == (2, 1)
    assert replication_for(3) == (3, 2)  # one broker may die without losing or refusing a write
    assert replication_for(5) == (3, 2)
    assert replication_for(5, replication=5, min_insync=3) == (5, 3)
    with pytest.raises(ValueError, match="needs at least 3 brokers"):
        replication_for(2, replication=3)
    with pytest.raises(ValueError, match=r"min\.insync\.replicas"):
        replication_for(3, min_insync=4)


def test_served_models_are_read_from_a_topic_list() -> None:
    from kinfer.topics.names import served_models

    topics = ["infer.b.p0", "infer.b.p1", "infer.a.p2", "infer.dlq", "replies.default", "infer.Bad.p0", "kinfer.stats"]
    assert served_models(topics) == ["a", "b"]
