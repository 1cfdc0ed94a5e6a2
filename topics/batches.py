"""The Batch API's records: files and batches, kept in two compacted Kafka topics.

    kinfer.files     key ``f:<file id>``: a ``FileObject``; key ``c:<file id>:<n>``: the file's n-th
                     chunk (raw bytes, at most ``CHUNK_BYTES``). One partition, so a file's chunks and
                     its object are in order; the object is written last, so a file is whole once seen.
    kinfer.batches   key ``<batch id>``: a ``BatchObject``, its latest state (the topic is compacted).
                     One partition: its owner in the group ``kinfer.batch-runner`` drives every batch.
    replies.batch-<batch id>
                     a batch's results, sealed with the batch's reply key (workers write them as for
                     any Kafka reply route); deleted once the batch's output file is written.

Any gateway serves the API from its own view of both topics (read from the beginning, then followed);
the input and the results live in Kafka, so a batch survives any gateway, worker or broker restarting.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

from kinfer.topics.record import Count, Record

FILES_TOPIC = "kinfer.files"
BATCHES_TOPIC = "kinfer.batches"
BATCH_RUNNER_GROUP = "kinfer.batch-runner"
BATCH_REPLY_PREFIX = "replies.batch-"
CHUNK_BYTES = 512 * 1024  # of a file, per record (Kafka's default message limit is about 1 MiB)
MAX_FILE_BYTES = 64 * 1024 * 1024  # an uploaded batch input file
MAX_BATCH_LINES = 50_000  # requests in one batch (OpenAI's limit)
COMPLETION_WINDOW_MS = 86_400_000  # "24h", the only window OpenAI offers, and the background tier's longest
ENDPOINTS = ("/v1/embeddings", "/v1/completions", "/v1/chat/completions")

# Ids: a prefix and 24 hex digits, like OpenAI's; they name Kafka keys and (for batches) a topic.
FILE_ID_PATTERN = r"^file-[0-9a-f]{24}\Z"
BATCH_ID_PATTERN = r"^batch_[0-9a-f]{24}\Z"
_FILE_ID = re.compile(FILE_ID_PATTERN)
_BATCH_ID = re.compile(BATCH_ID_PATTERN)

FileId = Annotated[str, msgspec.Meta(pattern=FILE_ID_PATTERN)]
BatchId = Annotated[str, msgspec.Meta(pattern=BATCH_ID_PATTERN)]
Tenant = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}\Z")]
Short = Annotated[str, msgspec.Meta(max_length=512)]
Epoch = Annotated[int, msgspec.Meta(ge=0, le=4_102_444_800)]  # seconds, as OpenAI's objects carry them

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
STATUSES = ("validating", "in_progress", "finalizing", "cancelling", *sorted(TERMINAL))


def valid_file_id(text: str) -> bool:
    return bool(_FILE_ID.match(text))


def valid_batch_id(text: str) -> bool:
    return bool(_BATCH_ID.match(text))


def batch_reply_topic(batch_id: str) -> str:
    return f"{BATCH_REPLY_PREFIX}{batch_id}"


def file_key(file_id: str) -> bytes:
    return f"f:{file_id}".encode()


def chunk_key(file_id: str, n: int) -> bytes:
    return f"c:{file_id}:{n}".encode()


class FileObject(Record, frozen=True):
    """An uploaded or produced file (OpenAI's file object, plus its owner and its chunks)."""

    max_bytes = 4_096

    id: FileId
    tenant: Tenant
    purpose: Annotated[str, msgspec.Meta(pattern=r"^(batch|batch_output)\Z")]
    filename: Short
    bytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_FILE_BYTES * 4)]
    created_at: Epoch
    chunks: Annotated[int, msgspec.Meta(ge=0, le=4_096)]

    def to_openai(self) -> dict[str, object]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed"}


class RequestCounts(msgspec.Struct, frozen=True):
    total: Count = 0
    completed: Count = 0
    failed: Count = 0


class BatchError(msgspec.Struct, frozen=True):
    code: Short
    message: Annotated[str, msgspec.Meta(max_length=1_000)]
    line: Annotated[int, msgspec.Meta(ge=1)] | None = None
    param: Short | None = None

    @classmethod
    def of(cls, code: str, message: str, line: int | None = None, param: str | None = None) -> BatchError:
        """One, cut to its fields' bounds (a state that broke them would not read back)."""
        return cls(code[:512], message[:1_000], line, param[:512] if param is not None else None)


class BatchObject(Record, frozen=True):
    """One batch's state: OpenAI's batch object, plus its owner, the reply key its results are sealed
    with, and whether its lines were checked and handed to the runner (``published``)."""

    max_bytes = 262_144

    id: BatchId
    tenant: Tenant
    endpoint: Annotated[str, msgspec.Meta(pattern=r"^/v1/(embeddings|completions|chat/completions)\Z")]
    input_file_id: FileId
    created_at: Epoch
    expires_at: Epoch
    status: Annotated[str, msgspec.Meta(pattern="^(" + "|".join(STATUSES) + r")\Z")]
    reply_key: Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]
    completion_window: Annotated[str, msgspec.Meta(pattern=r"^24h\Z")] = "24h"
    published: bool = False  # its lines are checked and its reply topic is made: the runner paces them out
    request_counts: RequestCounts = RequestCounts()
    errors: Annotated[list[BatchError], msgspec.Meta(max_length=100)] = msgspec.field(default_factory=list)
    output_file_id: FileId | None = None
    error_file_id: FileId | None = None
    in_progress_at: Epoch | None = None
    finalizing_at: Epoch | None = None
    completed_at: Epoch | None = None
    failed_at: Epoch | None = None
    expired_at: Epoch | None = None
    cancelling_at: Epoch | None = None
    cancelled_at: Epoch | None = None
    metadata: Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)], Short],
                        msgspec.Meta(max_length=16)] | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    def to_openai(self) -> dict[str, object]:
        wire = self.to_wire()
        for private in ("tenant", "reply_key", "published"):
            wire.pop(private)
        errors = wire.pop("errors")
        wire["errors"] = {"object": "list", "data": errors} if errors else None
        return {**wire, "object": "batch"}


__all__ = [
    "BATCHES_TOPIC",
    "BATCH_REPLY_PREFIX",
    "BATCH_RUNNER_GROUP",
    "CHUNK_BYTES",
    "COMPLETION_WINDOW_MS",
    "ENDPOINTS",
    "FILES_TOPIC",
    "MAX_BATCH_LINES",
    "MAX_FILE_BYTES",
    "BatchError",
    "BatchObject",
    "FileObject",
    "RequestCounts",
]
