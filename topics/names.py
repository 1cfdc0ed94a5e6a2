"""Topic and channel names: the one place that spells them.

    infer.<model>.p0 | p1 | p2     requests, by priority (p0 interactive, p1 standard, p2 batch)
    infer.<model>.p3               background requests: served only from spare capacity, within a
                                   completion window instead of a deadline
    infer.dlq                      dead letters: records that failed validation, with a reason header
    replies.<name>                 durable reply topics, one per client group
    kinfer:reply:<tenant>:<id>     Redis pub/sub reply channels, one per client instance
    kinfer:cancel                  Redis pub/sub: cancel notes: streams, answered hedges (best effort)
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable

DLQ_TOPIC = "infer.dlq"
DEFAULT_REPLY_TOPIC = "replies.default"  # the durable reply topic clients fall back to
REQUEST_PREFIX = "infer."
REPLY_TOPIC_PREFIX = "replies."
WORKER_GROUP_PREFIX = "kinfer.worker."
REDIS_REPLY_PREFIX = "kinfer:reply:"
CANCEL_CHANNEL = "kinfer:cancel"  # Redis pub/sub: {"id", "model", "mac"} of requests whose sender needs no answer

# Model names end up inside topic names, so they use a conservative subset of Kafka's alphabet
# (no '.', which separates the parts of a topic name).
MODEL_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
TENANT_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"  # who is asking: quotas, metrics and keys are per tenant
# Where a request may ask a worker to publish its reply: under the documented prefixes only, in at
# most 128 characters (a Kafka topic name has no ':').
REDIS_ROUTE_PATTERN = r"^kinfer:reply:[A-Za-z0-9_.:-]{1,115}$"
KAFKA_ROUTE_PATTERN = r"^replies\.[A-Za-z0-9_.-]{1,120}$"
# A worker's id (hostname-pid, or an instance id): in replies, residency reports and statistics.
WORKER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"


def exact(pattern: str) -> str:
    """``pattern`` for Python's ``re`` (msgspec's constraints): ``$`` there also matches before a final
    newline, so ``"minilm\\n"`` would pass; ``\\Z`` does not. The ``$`` form stays for JSON Schema and
    pydantic, whose engines lack ``\\Z`` and whose ``$`` is exact."""
    return pattern.removesuffix("$") + r"\Z"


_MODEL_RE = re.compile(exact(MODEL_PATTERN))


class Priority(enum.IntEnum):
    """Lower value is served first."""

    P0 = 0  # interactive
    P1 = 1  # standard
    P2 = 2  # batch
    P3 = 3  # background: served only from capacity the others leave idle; never shed for load

    @property
    def label(self) -> str:
        return f"p{self.value}"

    @property
    def background(self) -> bool:
        return self is Priority.P3

    @classmethod
    def parse(cls, value: int | str) -> Priority:
        if isinstance(value, str):
            text = value.lower().removeprefix("p")
            if not text.isdigit():
                raise ValueError(f"priority must be p0, p1, p2 or p3, got {value!r}")
            value = int(text)
        return cls(value)


def valid_model_name(model: str) -> bool:
    return bool(_MODEL_RE.match(model))


def check_model_name(model: str) -> str:
    if not valid_model_name(model):
        raise ValueError(
            f"model name {model!r} must match {_MODEL_RE.pattern} (lowercase letters, digits, '_' and '-')"
        )
    return model


def request_topic(model: str, priority: Priority | int) -> str:
    return f"{REQUEST_PREFIX}{check_model_name(model)}.{Priority(priority).label}"


def request_topics(model: str) -> list[str]:
    """All request topics of one model, highest priority first (the background topic last)."""
    return [request_topic(model, p) for p in Priority]


def parse_request_topic(topic: str) -> tuple[str, Priority]:
    """Inverse of ``request_topic``; raises ValueError for any other topic."""
    parts = topic.split(".")
    if len(parts) != 3 or parts[0] + "." != REQUEST_PREFIX or not valid_model_name(parts[1]):
        raise ValueError(f"{topic!r} is not a request topic")
    return parts[1], Priority.parse(parts[2])


def served_models(topics: Iterable[str]) -> list[str]:
    """The models whose request topics are among ``topics`` (a broker's topic list), sorted."""
    found = set()
    for topic in topics:
        try:
            found.add(parse_request_topic(topic)[0])
        except ValueError:
            continue
    return sorted(found)


def reply_topic(name: str) -> str:
    return f"{REPLY_TOPIC_PREFIX}{name}"


def redis_reply_channel(tenant: str, client_id: str) -> str:
    """``kinfer:reply:<tenant>:<client-id>``: a tenant's channels share a prefix, so a Redis ACL can
    let each tenant subscribe to its own channels and no one else's."""
    return f"{REDIS_REPLY_PREFIX}{tenant}:{client_id}"


def consumer_group(model: str) -> str:
    """Every worker serving ``model`` joins this group, so partitions are shared among them."""
    return f"{WORKER_GROUP_PREFIX}{check_model_name(model)}"
