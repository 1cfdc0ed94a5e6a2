"""The Batch API's engine: files and batches in Kafka (``topics.batches``), and the runner that turns a
batch into background requests and their results into an output file.

``BatchStore`` is every gateway's view of ``kinfer.files`` and ``kinfer.batches``: read from the
beginning at start, then followed, so any gateway answers for any batch; writes go to Kafka first
(``acks=all``) and into the view once acknowledged. ``BatchRunner`` drives the batches: of all the
gateways, the one that holds the single partition of ``kinfer.batches`` in the group
``kinfer.batch-runner`` (a gateway that dies hands it over within the group's session timeout). For
each batch it does, in order, what the batch's state says is left:

    validating   read the input file, check every line (a file with a bad line fails the batch, as
                 OpenAI's does), create the batch's reply topic, then record ``in_progress``
    in_progress  read the reply topic from its start; hand every line without a result to the runner's
                 share of the background tier (``batcher.share``), which publishes lines as background
                 requests (p3, deadline = the end of the completion window, replies sealed with the
                 batch's key) a window at a time, fairly between tenants; count results into the state
                 now and then until every line has one. Past the window, or asked to cancel, stop there:
                 the lines not yet published never are
    finalizing   write the output file (ok lines) and the error file (the rest), record the end
                 state, delete the reply topic

Every step can be done again: a new owner that finds ``validating`` checks again, and one that finds
``in_progress`` collects from the start of the reply topic and publishes again what has no result yet
(a request id answered twice is one line: the first result counts). Lines are parsed by the OpenAI
routes' own decoders, and answered in their shapes (``producers.openai_api``).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from msgspec.structs import replace

from kinfer.batcher.share import BackgroundShare
from kinfer.producers.batchstate import cancelled, ending, merge
from kinfer.producers.client import Client
from kinfer.producers.http import MAX_BODY_BYTES
from kinfer.producers.openai_api import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    EMBEDDINGS,
    EmbeddingsBody,
    Generation,
    embeddings_answer,
)
from kinfer.topics import InvalidRequest, Priority, Request, Result, Status, now_ms
from kinfer.topics.admin import TopicSpec, batch_topic_specs, delete_topics, ensure_topics
from kinfer.topics.batches import (
    BATCH_RUNNER_GROUP,
    BATCHES_TOPIC,
    CHUNK_BYTES,
    COMPLETION_WINDOW_MS,
    FILES_TOPIC,
    MAX_BATCH_LINES,
    MAX_FILE_BYTES,
    BatchError,
    BatchObject,
    FileObject,
    RequestCounts,
    batch_reply_topic,
    chunk_key,
    file_key,
)
from kinfer.topics.connect import kafka_options
from kinfer.topics.envelope import ReplyRefused, ReplyRoute, decode_replies
from kinfer.topics.errors import MalformedRecord
from kinfer.topics.readers import Supervised

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 2.0  # how often a running batch's counts are written back
# Chunks without a file record this old are an upload that never finished: a 64 MiB upload at the slowest
# rate a body may come (64 KiB/s) takes 17 minutes.
ORPHANS_AFTER_MS = 3_600_000
SWEEP_EVERY_S = 600.0
REPLY_PARTITIONS = 3  # of a batch's reply topic: what workers write to at once
REPLY_CONFIGS = {"retention.ms": str(8 * 86_400_000)}  # past the window: deleted once the output is written
# What an answer's status is over HTTP: the gateway's own mapping (invalid 400, model error 502, shed 503,
# deadline 504).
_HTTP_STATUS = {Status.INVALID: 400, Status.ERROR: 502, Status.SHED: 503, Status.EXPIRED: 504}


def new_id(prefix: str) -> str:
    return f"{prefix}{os.urandom(12).hex()}"


# -- lines ------------------------------------------------------------------------------------------


class InputLine(msgspec.Struct):
    """One line of a batch input file (OpenAI's format)."""

    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


@dataclass(frozen=True, slots=True)
class Line:
    """A checked input line: what to send, and how its result becomes the line's response body."""

    number: int  # 1-based
    custom_id: str
    model: str
    inputs: tuple[str, ...]
    params: dict[str, Any]
    messages: tuple[Any, ...]
    answer: Callable[[Result], dict[str, Any]]


class LineRefused(Exception):
    def __init__(self, number: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.number = number
        self.param = param


_line_decoder = msgspec.json.Decoder(InputLine)
_DECODERS: dict[str, Callable[[bytes], object]] = {
    "/v1/embeddings": EMBEDDINGS.decode, "/v1/completions": COMPLETIONS.decode,
    "/v1/chat/completions": CHAT_COMPLETIONS.decode,
}


def parse_line(endpoint: str, raw: bytes, number: int) -> Line:
    """One input line, checked as its endpoint's route checks a body; ``LineRefused`` naming what is wrong."""
    if len(raw) > MAX_BODY_BYTES:
        raise LineRefused(number, f"the line is over {MAX_BODY_BYTES} bytes (what the route takes as a body)")
    try:
        line = _line_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise LineRefused(number, f"not a batch request line: {exc}"[:500]) from None
    if not line.custom_id or len(line.custom_id) > 512:
        raise LineRefused(number, "custom_id must be 1-512 characters", "custom_id")
    if line.method != "POST":
        raise LineRefused(number, f"method must be POST, got {line.method[:32]!r}", "method")
    if line.url != endpoint:
        raise LineRefused(number, f"url must be the batch's endpoint {endpoint}, got {line.url[:64]!r}", "url")
    try:
        body = _DECODERS[endpoint](bytes(line.body))
    except InvalidRequest as exc:
        raise LineRefused(number, f"body: {exc}", exc.field) from None
    except Exception as exc:  # the route's decoder refuses with its own errors (BadBody): still this line's
        raise LineRefused(number, f"body: {exc}"[:500], getattr(exc, "field", None)) from None
    if not isinstance(body, Generation | EmbeddingsBody):
        raise LineRefused(number, "the endpoint has no decoder", "url")
    if isinstance(body, Generation):
        if body.body.stream:
            raise LineRefused(number, "stream is not supported in a batch", "stream")
        inputs = () if body.prompt is None else (body.prompt,)
        return Line(number, line.custom_id, body.body.model, inputs, body.body.params(body.max_tokens),
                    tuple(body.turns), body.form.answer)
    return Line(number, line.custom_id, body.model, tuple(body.texts()), {}, (), partial(embeddings_answer, body))


def parse_file(endpoint: str, data: bytes) -> tuple[list[Line], list[BatchError]]:
    """Every line of an input file, or the errors that fail the batch (at most 100 of them)."""
    lines: list[Line] = []
    errors: list[BatchError] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        if len(lines) >= MAX_BATCH_LINES:
            errors.append(BatchError.of("too_many_requests", f"a batch holds at most {MAX_BATCH_LINES} requests"))
            break
        try:
            line = parse_line(endpoint, raw, number)
        except LineRefused as exc:
            errors.append(BatchError.of("invalid_request", str(exc), exc.number, exc.param))
            if len(errors) >= 100:
                break
            continue
        if line.custom_id in seen:
            errors.append(BatchError.of("duplicate_custom_id", f"custom_id {line.custom_id[:64]!r} appears twice",
                                     number, "custom_id"))
            continue
        seen.add(line.custom_id)
        lines.append(line)
    if not lines and not errors:
        errors.append(BatchError.of("empty_file", "the input file holds no requests"))
    return lines, errors


def output_line(batch_id: str, line: Line, result: Result) -> tuple[bool, bytes]:
    """(ok, the JSONL line) for a line's result: OpenAI's output or error file shape."""
    request_id = f"{batch_id}-{line.number}"
    code, body = 200, None
    if result.status is Status.OK:
        try:
            body = line.answer(result)
        except InvalidRequest as exc:
            code, body = 400, {"error": {"type": "InvalidRequest", "message": str(exc), "param": exc.field,
                                         "code": None}}
    else:
        code = _HTTP_STATUS.get(result.status, 500)
        body = {"error": {"type": result.status.value, "message": result.error or result.status.value,
                          "param": None, "code": None}}
    out = {"id": f"batch_req_{request_id}", "custom_id": line.custom_id,
           "response": {"status_code": code, "request_id": request_id, "body": body}, "error": None}
    return code == 200, msgspec.json.encode(out) + b"\n"


# -- the store --------------------------------------------------------------------------------------


@dataclass
class _View:
    files: dict[str, FileObject] = field(default_factory=dict)
    chunks: dict[tuple[str, int], int] = field(default_factory=dict)  # (file, n) → offset in kinfer.files
    first_chunk_ms: dict[str, int] = field(default_factory=dict)  # file → when its first chunk was written
    batches: dict[str, BatchObject] = field(default_factory=dict)


class BatchStore:
    """Files and batches: written to Kafka, read from a view every gateway keeps of both topics."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.view = _View()
        self.ready = asyncio.Event()  # the view has caught up with both topics once
        self._producer: AIOKafkaProducer | None = None
        self._tail: asyncio.Task[None] | None = None
        self._reader: AIOKafkaConsumer | None = None  # reads a file's chunks by offset
        self._reading = asyncio.Lock()

    async def start(self) -> None:
        self._producer = AIOKafkaProducer(**kafka_options(self.bootstrap), acks="all",
                                          max_request_size=2 * CHUNK_BYTES)
        await self._producer.start()
        self._reader = AIOKafkaConsumer(**kafka_options(self.bootstrap), enable_auto_commit=False,
                                        max_partition_fetch_bytes=2 * CHUNK_BYTES)
        await self._reader.start()
        self._tail = asyncio.get_running_loop().create_task(Supervised("batch-store", self._follow).run(),
                                                            name="batch-store")

    async def close(self) -> None:
        if self._tail is not None:
            self._tail.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._tail
        for part in (self._producer, self._reader):
            if part is not None:
                await part.stop()

    async def _follow(self) -> None:
        """Both topics from the beginning, for ever: the view (``Supervised``: restarted whenever it fails).
        A record that does not read is skipped. The topics are made first where `kinfer topics` did not
        make them; until they exist (a principal that may not create them waits for the operator), the
        Batch API answers 503."""
        await ensure_topics(self.bootstrap, batch_topic_specs())
        consumer = AIOKafkaConsumer(**kafka_options(self.bootstrap), enable_auto_commit=False,
                                    auto_offset_reset="earliest", max_partition_fetch_bytes=2 * CHUNK_BYTES)
        try:
            await consumer.start()
            tps = [TopicPartition(FILES_TOPIC, 0), TopicPartition(BATCHES_TOPIC, 0)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            ends = await consumer.end_offsets(tps)
            while True:
                data = await consumer.getmany(timeout_ms=500)
                for tp, records in data.items():
                    for record in records:
                        self._apply(tp.topic, record.key, record.value, record.offset, record.timestamp)
                if not self.ready.is_set():
                    positions = [await consumer.position(tp) for tp in tps]
                    if all(p >= ends[tp] for p, tp in zip(positions, tps, strict=True)):
                        self.ready.set()
        finally:
            await consumer.stop()

    def _apply(self, topic: str, key: bytes | None, value: bytes | None, offset: int, timestamp_ms: int = 0) -> None:
        if key is None:
            return
        text = key.decode("ascii", "replace")
        try:
            if topic == BATCHES_TOPIC:
                if value is None:
                    self.view.batches.pop(text, None)
                    return
                batch = BatchObject.unpack(value)
                if batch.id == text:
                    self.view.batches[text] = merge(self.view.batches.get(text), batch)
            elif text.startswith("c:"):
                file_id, _, n = text[2:].rpartition(":")
                if value is None:
                    self.view.chunks.pop((file_id, int(n)), None)
                else:
                    self.view.chunks[(file_id, int(n))] = offset
                    self.view.first_chunk_ms.setdefault(file_id, timestamp_ms)
            elif text.startswith("f:"):
                if value is None:
                    self.view.files.pop(text[2:], None)
                else:
                    found = FileObject.unpack(value)
                    if found.id == text[2:]:
                        self.view.files[found.id] = found
        except (MalformedRecord, ValueError) as exc:
            log.warning("skipping a record of %s (key %r): %s", topic, text[:80], exc)
        except Exception:  # a defect of ours: the record is skipped all the same (a restart would meet it again)
            log.exception("skipping a record of %s (key %r)", topic, text[:80])

    @property
    def producer(self) -> AIOKafkaProducer:
        assert self._producer is not None, "the store is not started"
        return self._producer

    async def put_file(self, tenant: str, purpose: str, filename: str, data: bytes) -> FileObject:
        writer = self.writer(tenant, purpose, limit=MAX_FILE_BYTES * 4)  # a batch's output may be larger
        try:
            await writer.write(data)
            return await writer.finish(filename)
        except BaseException:
            await writer.discard()
            raise

    def writer(self, tenant: str, purpose: str, limit: int = MAX_FILE_BYTES) -> FileWriter:
        """A new file of ``tenant``'s, written as its bytes come (``FileWriter``)."""
        return FileWriter(self, tenant, purpose, limit)

    async def read_file(self, meta: FileObject) -> bytes:
        """A file's content, whole (a batch's input, to validate it)."""
        return b"".join([chunk async for chunk in self.chunks(meta)])

    def readable(self, meta: FileObject) -> bool:
        """Every chunk of the file is known to the view."""
        return all((meta.id, n) in self.view.chunks for n in range(meta.chunks))

    async def chunks(self, meta: FileObject) -> AsyncIterator[bytes]:
        """A file's content chunk by chunk (``CHUNK_BYTES``), from the offsets the view holds. The store's one
        reader is taken for a chunk at a time: a download that is read slowly (or not at all) holds one
        chunk, and holds nobody else up."""
        assert self._reader is not None, "the store is not started"
        tp = TopicPartition(FILES_TOPIC, 0)
        offsets = [self.view.chunks.get((meta.id, n)) for n in range(meta.chunks)]
        if None in offsets:
            raise KeyError(f"{meta.id}: chunk {offsets.index(None)} is missing")
        for n, offset in enumerate(offsets):
            assert offset is not None
            async with self._reading:
                if self._reader.assignment() != {tp}:
                    self._reader.assign([tp])
                self._reader.seek(tp, offset)
                record = await asyncio.wait_for(self._reader.getone(tp), 30.0)
            if record.key != chunk_key(meta.id, n) or record.value is None:
                raise KeyError(f"{meta.id}: chunk {n} is not at offset {offset}")
            yield record.value

    async def sweep(self, now_ms: int, older_than_ms: int = ORPHANS_AFTER_MS) -> int:
        """Tombstones for the chunks of files that never got their record (an upload whose gateway died
        half-way), once their first chunk is older than any upload can take. Returns how many files."""
        orphans = {f for (f, _) in self.view.chunks if f not in self.view.files
                   and now_ms - self.view.first_chunk_ms.get(f, now_ms) > older_than_ms}
        for file_id in orphans:
            chunks = [n for (f, n) in self.view.chunks if f == file_id]
            for n in chunks:
                await self.producer.send_and_wait(FILES_TOPIC, None, key=chunk_key(file_id, n))
                self.view.chunks.pop((file_id, n), None)
            self.view.first_chunk_ms.pop(file_id, None)
        return len(orphans)

    async def delete_file(self, meta: FileObject) -> None:
        """Tombstones for the file and its chunks: compaction removes them from ``kinfer.files``."""
        await self.producer.send_and_wait(FILES_TOPIC, None, key=file_key(meta.id))
        for n in range(meta.chunks):
            await self.producer.send_and_wait(FILES_TOPIC, None, key=chunk_key(meta.id, n))
        self.view.files.pop(meta.id, None)
        for n in range(meta.chunks):
            self.view.chunks.pop((meta.id, n), None)

    async def put_batch(self, batch: BatchObject) -> BatchObject:
        """Write ``batch`` joined with what the view knows of it (``producers.batchstate``: a stale write
        never undoes a cancel or an end); returns what the view holds once it is acknowledged."""
        batch = merge(self.view.batches.get(batch.id), batch)
        await self.producer.send_and_wait(BATCHES_TOPIC, batch.pack(), key=batch.id.encode())
        held = self.view.batches[batch.id] = merge(self.view.batches.get(batch.id), batch)
        return held

    async def cancel(self, batch: BatchObject) -> BatchObject:
        """Ask ``batch`` to cancel: recorded at once, kept by every later write (the runner stops it)."""
        return await self.put_batch(cancelled(batch, int(time.time())))


class FileTooLarge(ValueError):
    """A file written past its writer's limit."""


class FileWriter:
    """One file written as its bytes come: a chunk to ``kinfer.files`` each time ``CHUNK_BYTES`` have come,
    the file's record last (``finish``). Until then no reader knows the file; ``discard`` tombstones the
    chunks written so far (an upload refused or cut off half-way), and compaction removes them. What a
    writer holds in memory is less than a chunk and the last piece given."""

    def __init__(self, store: BatchStore, tenant: str, purpose: str, limit: int) -> None:
        self.store, self.tenant, self.purpose, self.limit = store, tenant, purpose, limit
        self.id = new_id("file-")
        self.size = 0
        self._buffer = bytearray()
        self._offsets: list[int] = []
        self._done = False

    async def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limit:
            raise FileTooLarge(f"the file is over {self.limit} bytes")
        self._buffer += data
        while len(self._buffer) >= CHUNK_BYTES:
            await self._send(CHUNK_BYTES)

    async def finish(self, filename: str) -> FileObject:
        """The rest of the file, then its record: from then on it exists, for every gateway."""
        meta = FileObject(self.id, self.tenant, self.purpose, filename[:512], self.size, int(time.time()),
                          -(-self.size // CHUNK_BYTES))
        packed = meta.pack()  # a field out of its bounds fails here, before the record is written
        if self._buffer:
            await self._send(len(self._buffer))
        await self.store.producer.send_and_wait(FILES_TOPIC, packed, key=file_key(self.id))
        self._done = True
        for n, offset in enumerate(self._offsets):
            self.store.view.chunks[(self.id, n)] = offset
        self.store.view.files[self.id] = meta
        return meta

    async def discard(self) -> None:
        """Tombstones for every chunk written, and for the one that may have been in flight; shielded from
        the caller's cancellation (a client that hangs up cancels its request's task)."""
        if self._done:
            return
        self._done = True
        count = len(self._offsets) + 1
        sends = asyncio.ensure_future(asyncio.gather(*(
            self.store.producer.send_and_wait(FILES_TOPIC, None, key=chunk_key(self.id, n)) for n in range(count))))
        _DISCARDS.add(sends)
        sends.add_done_callback(_DISCARDS.discard)
        try:
            await asyncio.shield(sends)
        except Exception:
            log.warning("file %s: the chunks of a discarded upload could not be tombstoned", self.id)

    async def _send(self, size: int) -> None:
        chunk = bytes(self._buffer[:size])
        del self._buffer[:size]
        sent = await self.store.producer.send_and_wait(FILES_TOPIC, chunk, key=chunk_key(self.id, len(self._offsets)))
        self._offsets.append(sent.offset)


_DISCARDS: set[asyncio.Future[Any]] = set()  # tombstones being written for discarded uploads (kept referenced)


# -- the runner -------------------------------------------------------------------------------------


class BatchRunner:
    """Drives every unfinished batch while this gateway owns ``kinfer.batches`` in the runner group."""

    def __init__(self, store: BatchStore, client: Client, session_timeout_ms: int = 10_000) -> None:
        self.store = store
        self.client = client
        self.session_timeout_ms = session_timeout_ms
        self._task: asyncio.Task[None] | None = None
        self._driving: dict[str, asyncio.Task[None]] = {}
        self.owner = False
        self.share: BackgroundShare[Line] = BackgroundShare()  # what goes to the background tier next
        self._wake = asyncio.Event()  # the share has changed: something may be published

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(Supervised("batch-runner", self._run).run(),
                                                            name="batch-runner")

    async def close(self) -> None:
        for task in [self._task, *self._driving.values()]:
            if task is not None:
                task.cancel()
        for task in [self._task, *self._driving.values()]:
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _run(self) -> None:
        """Member of the runner group (``Supervised``: joined again whenever it fails); drives every batch
        while it holds ``kinfer.batches``."""
        consumer = AIOKafkaConsumer(**kafka_options(self.store.bootstrap), group_id=BATCH_RUNNER_GROUP,
                                    enable_auto_commit=False, session_timeout_ms=self.session_timeout_ms,
                                    heartbeat_interval_ms=max(100, self.session_timeout_ms // 5))
        pump = asyncio.get_running_loop().create_task(self._pump(), name="batch-pump")
        try:
            await consumer.start()
            consumer.subscribe([BATCHES_TOPIC])
            await self.store.ready.wait()
            swept = time.monotonic() - SWEEP_EVERY_S  # first at once
            while True:
                await consumer.getmany(timeout_ms=500)  # records come through the store's view
                self.owner = bool(consumer.assignment())
                if self.owner:
                    self._drive_all()
                    if time.monotonic() - swept >= SWEEP_EVERY_S:
                        swept = time.monotonic()
                        if found := await self.store.sweep(now_ms()):
                            log.info("tombstoned the chunks of %d uploads that never finished", found)
                else:
                    self._stop_all()
        finally:
            self.owner = False
            self._stop_all()
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
            await consumer.stop()

    def _drive_all(self) -> None:
        for batch in list(self.store.view.batches.values()):
            task = self._driving.get(batch.id)
            if batch.terminal or (task is not None and not task.done()):
                continue
            self._driving[batch.id] = asyncio.get_running_loop().create_task(self._drive(batch.id))

    def _stop_all(self) -> None:
        for task in self._driving.values():
            task.cancel()
        self._driving.clear()

    def _state(self, batch_id: str) -> BatchObject:
        return self.store.view.batches[batch_id]

    async def _drive(self, batch_id: str) -> None:
        try:
            batch = self._state(batch_id)
            lines: list[Line] = []
            if batch.status in ("validating", "in_progress", "cancelling"):
                meta = self.store.view.files.get(batch.input_file_id)
                if meta is None:
                    await self._fail(batch, "missing_file", f"input file {batch.input_file_id} not found")
                    return
                lines, errors = parse_file(batch.endpoint, await self.store.read_file(meta))
                if errors:
                    await self._fail(batch, errors=errors)
                    return
            if batch.status == "validating":
                served = set(await self.client.models())
                unknown = [BatchError.of("model_not_found", f"model {line.model!r} is not served", line.number, "model")
                           for line in lines if line.model not in served]
                if unknown:
                    await self._fail(batch, errors=unknown)
                    return
                await self._reply_topic(batch.id)
                await self.store.put_batch(replace(self._state(batch.id), status="in_progress", published=True,
                                                   in_progress_at=int(time.time()),
                                                   request_counts=RequestCounts(total=len(lines))))
            await self._collect(batch_id, lines)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch %s: driving it failed; it is tried again", batch_id)
            await asyncio.sleep(5.0)

    async def _fail(self, batch: BatchObject, code: str = "", message: str = "",
                    errors: list[BatchError] | None = None) -> None:
        errors = errors or [BatchError.of(code, message)]
        await self.store.put_batch(replace(batch, status="failed", failed_at=int(time.time()), errors=errors[:100]))

    async def _pump(self) -> None:
        """Publishes what the share gives, whenever it changes (a batch's lines come, a line ends, a batch
        leaves), and at least once a second, so a window follows its model's rate."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)
            self._wake.clear()
            taken = self.share.take(time.monotonic())
            for start in range(0, len(taken), 256):
                await asyncio.gather(*(self._send(*line) for line in taken[start:start + 256]))

    async def _send(self, batch_id: str, request_id: str, line: Line) -> None:
        """One line of a batch as a background request; one that cannot be published goes back to the share."""
        batch = self.store.view.batches.get(batch_id)
        if batch is None or batch.status != "in_progress":
            self.share.ended(batch_id, request_id, time.monotonic())  # its batch is leaving the share
            return
        request = Request(id=request_id, model=line.model, priority=Priority.P3, tenant=batch.tenant,
                          created_ms=now_ms(), deadline_ms=batch.created_at * 1000 + COMPLETION_WINDOW_MS,
                          inputs=line.inputs, reply=ReplyRoute.topic(batch_reply_topic(batch_id)),
                          params=line.params, messages=line.messages, batch_reply=True, reply_key=batch.reply_key)
        try:
            await self.client.submit(request)
        except Exception as exc:  # the broker (or a check): tried again when the share is next taken from
            log.warning("batch %s: line %s not published (%s); it is tried again", batch_id, line.number, exc)
            self.share.failed(batch_id, request_id, line, time.monotonic())

    async def _reply_topic(self, batch_id: str) -> list[TopicPartition]:
        """The batch's reply topic (created when missing: a new owner's first look), by partition."""
        topic = batch_reply_topic(batch_id)
        counts = await ensure_topics(self.store.bootstrap, [TopicSpec(topic, REPLY_PARTITIONS, 0, REPLY_CONFIGS)])
        return [TopicPartition(topic, p) for p in range(counts[topic])]

    async def _collect(self, batch_id: str, lines: list[Line]) -> None:
        """The batch's results from the start of its reply topic; once read up to where it ended, every line
        without one goes to the share, to be published. Then results until each line has one (or the batch
        is cancelled or its window has passed): the batch leaves the share, and its output is written. A
        line ends once: when its result comes, it becomes its output or error line, and counts as
        completed or failed from then on."""
        by_id = {f"{batch_id}-{line.number}": line for line in lines}
        ended: dict[str, tuple[bool, bytes]] = {}
        consumer = AIOKafkaConsumer(**kafka_options(self.store.bootstrap), enable_auto_commit=False,
                                    auto_offset_reset="earliest")
        await consumer.start()
        try:
            tps = await self._reply_topic(batch_id)
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            key = self._state(batch_id).reply_key
            caught_up = await consumer.end_offsets(tps)  # what a previous owner's lines were answered
            while [tp for tp in tps if await consumer.position(tp) < caught_up[tp]]:
                for records in (await consumer.getmany(timeout_ms=500)).values():
                    for record in records:
                        self._take(record.value, batch_id, key, by_id, ended)
            if self._state(batch_id).status == "in_progress":
                self.share.add(batch_id, self._state(batch_id).tenant,
                               ((rid, line.model, len(line.inputs), line) for rid, line in by_id.items()
                                if rid not in ended))
                self._wake.set()
            written = time.monotonic()
            while len(ended) < len(by_id):
                batch = self._state(batch_id)
                if batch.status != "in_progress" or time.time() > batch.expires_at:
                    break  # cancelling (or past its window): what was answered is its output
                for records in (await consumer.getmany(timeout_ms=500)).values():
                    for record in records:
                        for rid in self._take(record.value, batch_id, key, by_id, ended):
                            self.share.ended(batch_id, rid, time.monotonic())
                            self._wake.set()
                if time.monotonic() - written >= PROGRESS_EVERY_S:
                    written = time.monotonic()
                    counts = request_counts_of(len(by_id), ended)
                    if counts != self._state(batch_id).request_counts:
                        await self.store.put_batch(replace(self._state(batch_id), request_counts=counts))
        finally:
            dropped = self.share.withdraw(batch_id, time.monotonic())  # its unpublished lines never will be
            self._wake.set()
            if dropped:
                log.info("batch %s: %d lines withdrawn before they were published", batch_id, dropped)
            await consumer.stop()
        await self._finish(batch_id, lines, ended)

    @staticmethod
    def _take(value: bytes | None, batch_id: str, key: bytes, by_id: dict[str, Line],
              ended: dict[str, tuple[bool, bytes]]) -> list[str]:
        """One record of the reply topic: the results in it that are this batch's, sealed with its key, each
        line's first one made its output line (ok or not). Returns the ids of the lines it ended."""
        if value is None:
            return []
        try:
            opened = decode_replies(value, key)
        except ReplyRefused:
            return []  # not sealed with the batch's key: not a worker's answer to this batch
        except Exception:  # a defect of ours: this record is skipped, the collection goes on
            log.exception("a record of a batch's reply topic could not be read")
            return []
        new = []
        for reply in opened.replies:
            if isinstance(reply, Result) and reply.id in by_id and reply.id not in ended:
                ended[reply.id] = output_line(batch_id, by_id[reply.id], reply)
                new.append(reply.id)
        return new

    async def _finish(self, batch_id: str, lines: list[Line], ended: dict[str, tuple[bool, bytes]]) -> None:
        batch = await self.store.put_batch(replace(self._state(batch_id), status="finalizing",
                                                   finalizing_at=int(time.time())))
        output, errors = io.BytesIO(), io.BytesIO()
        for line in lines:
            done = ended.get(f"{batch.id}-{line.number}")
            if done is not None:
                (output if done[0] else errors).write(done[1])
        out_meta = err_meta = None
        if output.tell():
            out_meta = await self.store.put_file(batch.tenant, "batch_output", f"{batch.id}_output.jsonl",
                                                 output.getvalue())
        if errors.tell():
            err_meta = await self.store.put_file(batch.tenant, "batch_output", f"{batch.id}_error.jsonl",
                                                 errors.getvalue())
        batch = self._state(batch_id)  # a cancel that came meanwhile decides how it ends
        status = ending(batch, len(ended), len(lines))
        counts = request_counts_of(len(lines), ended)
        await self.store.put_batch(replace(batch, status=status, request_counts=counts,
                                           **{f"{status}_at": int(time.time())},
                                           output_file_id=out_meta.id if out_meta else None,
                                           error_file_id=err_meta.id if err_meta else None))
        await delete_topics(self.store.bootstrap, [batch_reply_topic(batch.id)])  # else its retention removes it


def request_counts_of(total: int, ended: dict[str, tuple[bool, bytes]]) -> RequestCounts:
    """A batch's counts: ``total`` lines, of which ``ended`` (by id: answered ok or not) have ended."""
    ok = sum(1 for good, _ in ended.values() if good)
    return RequestCounts(total, ok, len(ended) - ok)
