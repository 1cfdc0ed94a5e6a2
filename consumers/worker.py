"""The worker: consume a model's request topics, batch, run the model off the loop, reply, commit.

Three tasks share one event loop and the state below; none of them awaits in the middle of
changing it, so no locks are needed:

    fetch loop     getmany() → validate → batcher.add()      (pauses partitions when buffered work
                   bad records → DLQ (+ an ``invalid`` reply)  reaches ``max_buffered_inputs``)
    dispatch loop  expire → batcher.next_batch() when the executor is free → executor thread →
                   results → publish task
    commit loop    commits the highest offsets whose replies are out (``OffsetTracker``)

At-least-once: an offset is committed only after the reply for it (and for everything before it
in its partition) has been published. A worker that dies loses nothing; its partitions go to
another member of the group, which answers again. Replies are idempotent by request id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata
from prometheus_client import start_http_server

from batcher import Batch, BatchPolicy, DynamicBatcher
from consumers import metrics
from consumers.offsets import OffsetTracker
from consumers.replies import ReplySink
from consumers.runners import ModelSpec, Runner, build_runner
from topics import (
    DEFAULT_LIMITS,
    InvalidRequest,
    Limits,
    Request,
    Result,
    Status,
    Timings,
    Unavailable,
    decode_request,
    now_ms,
)
from topics.envelope import salvage_route
from topics.names import consumer_group, request_topics

log = logging.getLogger(__name__)

# How long past a request's deadline a worker keeps retrying to publish its reply. After that the
# caller has already given up with DeadlineExceeded, which is its terminal state.
PUBLISH_GRACE_MS = 5_000


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    model: ModelSpec
    bootstrap: str  # Kafka bootstrap servers, "host:port[,host:port]"
    redis_url: str  # redis://host:port/db
    policy: BatchPolicy = field(default_factory=BatchPolicy)
    limits: Limits = DEFAULT_LIMITS
    device: str = "auto"  # "auto" picks CUDA when available
    max_buffered_inputs: int = 1024  # fetched inputs held in memory before partitions are paused
    fetch_max_records: int = 500  # records per getmany()
    session_timeout_ms: int = 10_000  # group liveness; a killed worker's partitions move after this
    heartbeat_interval_ms: int = 1_000
    max_poll_interval_ms: int = 300_000  # must exceed the slowest batch
    instance_id: str | None = None  # static group membership: a restart with the same id rejoins at once
    metrics_port: int | None = None  # serve Prometheus metrics here
    drain_timeout_s: float = 30.0  # on SIGTERM, finish buffered work for at most this long
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")

    def __post_init__(self) -> None:
        if self.max_buffered_inputs < self.policy.max_batch_size:
            raise ValueError(
                f"max_buffered_inputs ({self.max_buffered_inputs}) must be >= "
                f"policy.max_batch_size ({self.policy.max_batch_size})"
            )


@dataclass(slots=True)
class Job:
    """A fetched, valid request and where it came from."""

    request: Request
    tp: TopicPartition
    offset: int
    queue_ms: float  # Kafka record timestamp → fetched
    fetched: float  # monotonic seconds


class Worker:
    def __init__(self, settings: WorkerSettings, runner: Runner | None = None) -> None:
        self.settings = settings
        self.model = settings.model.name
        self.runner = runner or build_runner(settings.model, settings.device)
        self._batcher: DynamicBatcher[Job] = DynamicBatcher(settings.policy)
        self._tracker: OffsetTracker[TopicPartition] = OffsetTracker()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"kinfer-{self.model}")
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()  # something changed for the dispatch loop
        self._commit_wake = asyncio.Event()  # some reply went out
        self._drained = asyncio.Event()  # dispatch and publishing are over; final commit
        self.ready = asyncio.Event()  # model loaded and partitions assigned
        self._computing: asyncio.Task[None] | None = None
        self._publishing: set[asyncio.Task[None]] = set()
        self._tg: asyncio.TaskGroup | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._sink: ReplySink | None = None

    def stop(self) -> None:
        """Graceful stop: stop fetching, finish buffered work, reply, commit, leave the group."""
        self._stopping.set()
        self._wake.set()

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        s = self.settings
        loop = asyncio.get_running_loop()
        log.info("loading model %s (%s) on %s", self.model, s.model.family, self.runner.device)
        await loop.run_in_executor(self._executor, self.runner.load)
        await loop.run_in_executor(self._executor, self.runner.warmup)
        if s.metrics_port is not None:
            start_http_server(s.metrics_port, addr="127.0.0.1")

        producer = AIOKafkaProducer(
            bootstrap_servers=s.bootstrap, acks="all", enable_idempotence=True, linger_ms=1
        )
        redis = aioredis.Redis.from_url(s.redis_url)
        consumer = AIOKafkaConsumer(
            bootstrap_servers=s.bootstrap,
            group_id=consumer_group(self.model),
            group_instance_id=s.instance_id,
            client_id=f"kinfer-worker-{s.worker_id}",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=s.session_timeout_ms,
            heartbeat_interval_ms=s.heartbeat_interval_ms,
            max_poll_interval_ms=s.max_poll_interval_ms,
            fetch_max_wait_ms=50,
        )
        self._consumer = consumer
        try:
            await producer.start()
            await consumer.start()
            consumer.subscribe(request_topics(self.model), listener=_Rebalance(self))
            self._sink = ReplySink(producer, redis)
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                tg.create_task(self._fetch_loop(consumer))
                tg.create_task(self._dispatch_loop())
                tg.create_task(self._commit_loop(consumer))
        finally:
            with contextlib.suppress(KafkaError):
                await consumer.stop()  # leaves the group, so partitions move at once
            await producer.stop()
            await redis.aclose()
            self._executor.shutdown(wait=False, cancel_futures=True)
            log.info("worker %s stopped", s.worker_id)

    # -- fetch -------------------------------------------------------------------------------

    async def _fetch_loop(self, consumer: AIOKafkaConsumer) -> None:
        while not self._stopping.is_set():
            self._flow_control(consumer)
            try:
                data = await consumer.getmany(timeout_ms=100, max_records=self.settings.fetch_max_records)
            except KafkaError as exc:
                log.warning("fetch failed, retrying: %s", exc)
                await asyncio.sleep(0.5)
                continue
            if consumer.assignment() and not self.ready.is_set():
                self.ready.set()
                log.info("worker %s ready: %s", self.settings.worker_id, sorted(map(str, consumer.assignment())))
            if not data:
                continue
            now, wall = time.monotonic(), now_ms()
            for tp, records in data.items():
                for record in records:
                    self._tracker.track(tp, record.offset)
                    await self._admit(tp, record, now, wall)
            metrics.BUFFERED.labels(self.model).set(self._batcher.pending_inputs)
            self._wake.set()

    def _flow_control(self, consumer: AIOKafkaConsumer) -> None:
        """Kafka is the queue: stop fetching while the in-process buffer is full."""
        buffered, limit = self._batcher.pending_inputs, self.settings.max_buffered_inputs
        if buffered >= limit and not consumer.paused():
            consumer.pause(*consumer.assignment())
            metrics.PAUSED.labels(self.model).set(1)
        elif buffered <= limit // 2 and consumer.paused():
            consumer.resume(*consumer.paused())
            metrics.PAUSED.labels(self.model).set(0)

    async def _admit(self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes], now: float, wall: int) -> None:
        value = record.value or b""
        try:
            request = decode_request(value, self.settings.limits)
            if request.model != self.model:
                raise InvalidRequest(f"model {request.model!r} sent to a topic of {self.model!r}", "model")
        except InvalidRequest as exc:
            await self._reject(tp, record.offset, value, exc)
            return
        job = Job(request, tp, record.offset, max(0.0, wall - record.timestamp), now)
        metrics.QUEUE_WAIT.labels(self.model, request.priority.label).observe(job.queue_ms / 1000.0)
        self._batcher.add(
            job,
            priority=int(request.priority),
            size=len(request.inputs),
            longest=max(self.runner.count_tokens(t) for t in request.inputs),
            deadline=now + (request.deadline_ms - wall) / 1000.0,
            now=now,
        )

    async def _reject(self, tp: TopicPartition, offset: int, value: bytes, exc: InvalidRequest) -> None:
        assert self._sink is not None
        source = f"{tp.topic}/{tp.partition}@{offset}"
        log.warning("dead-lettering %s: %s", source, exc)
        await self._sink.dead_letter(value, str(exc), exc.field, source)
        metrics.DEAD_LETTERS.labels(self.model, exc.field or "").inc()
        salvaged = salvage_route(value, self.settings.limits)
        if salvaged is not None:
            rid, route = salvaged
            result = Result(rid, self.model, Status.INVALID, error=str(exc), worker=self.settings.worker_id)
            with contextlib.suppress(Unavailable):  # the DLQ has it; the reply is a courtesy
                await self._sink.publish([(route, result)])
        self._tracker.done(tp, offset)
        self._commit_wake.set()

    # -- dispatch ----------------------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        drain_until: float | None = None
        while True:
            self._wake.clear()
            now = time.monotonic()
            expired = self._batcher.expire(now)
            if expired:
                self._reply(
                    [(p.payload, self._result(p.payload, Status.EXPIRED, error="deadline passed in queue"))
                     for p in expired]
                )
            if self._computing is None:
                # One executor: a batch forms at the moment it can start, so everything that
                # arrived during the previous forward pass rides along (up to the size and
                # token caps). Nothing sits in a sealed batch that later arrivals cannot join.
                batch = self._batcher.next_batch(now, idle=True)
                if batch is not None:
                    self._computing = self._spawn(self._compute(batch))
            metrics.BUFFERED.labels(self.model).set(self._batcher.pending_inputs)

            if self._stopping.is_set():
                drain_until = drain_until or now + self.settings.drain_timeout_s
                idle = self._computing is None and not self._batcher
                if idle or now >= drain_until:
                    if not idle:
                        log.warning("drain timeout: %d requests left for redelivery", len(self._batcher))
                    break
            timeout = None if drain_until is None else max(0.0, drain_until - now)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
        if self._computing is not None:
            await self._computing
        while self._publishing:
            await asyncio.gather(*list(self._publishing))
        self._drained.set()
        self._commit_wake.set()

    async def _compute(self, batch: Batch[Job]) -> None:
        jobs = batch.payloads
        texts = [t for job in jobs for t in job.request.inputs]
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            outputs = await loop.run_in_executor(self._executor, self.runner.run, texts)
            error = None
        except Exception as exc:  # the model failed: every request in the batch gets an error reply
            log.exception("batch of %d failed", len(texts))
            outputs, error = [], f"{type(exc).__name__}: {exc}"
        compute_ms = (time.monotonic() - started) * 1000.0
        self._observe(batch, started, compute_ms)
        replies, i = [], 0
        for job in jobs:
            n = len(job.request.inputs)
            timings = Timings(job.queue_ms, (started - job.fetched) * 1000.0, compute_ms, len(texts))
            if error is None:
                result = self._result(job, Status.OK, outputs=outputs[i : i + n], timings=timings)
            else:
                result = self._result(job, Status.ERROR, error=error, timings=timings)
            replies.append((job, result))
            i += n
        self._computing = None
        self._wake.set()
        self._reply(replies)

    def _observe(self, batch: Batch[Job], started: float, compute_ms: float) -> None:
        metrics.COMPUTE.labels(self.model).observe(compute_ms / 1000.0)
        metrics.BATCH_SIZE.labels(self.model).observe(batch.size)
        metrics.PADDING.labels(self.model).observe(batch.padded_tokens / max(1, batch.real_tokens_upper))
        for p in batch.items:
            metrics.BATCH_WAIT.labels(self.model, p.payload.request.priority.label).observe(started - p.arrival)

    def _result(
        self, job: Job, status: Status, *, outputs: list[object] | None = None, error: str | None = None,
        timings: Timings | None = None,
    ) -> Result:
        return Result(
            id=job.request.id, model=self.model, status=status, outputs=list(outputs or []), error=error,
            timings=timings or Timings(queue_ms=job.queue_ms), worker=self.settings.worker_id,
        )

    # -- replies and commits -----------------------------------------------------------------

    def _reply(self, replies: list[tuple[Job, Result]]) -> None:
        self._publishing.add(task := self._spawn(self._publish(replies)))
        task.add_done_callback(self._publishing.discard)

    async def _publish(self, replies: list[tuple[Job, Result]]) -> None:
        assert self._sink is not None
        give_up_ms = max(job.request.deadline_ms for job, _ in replies) + PUBLISH_GRACE_MS
        delay = 0.05
        while True:
            try:
                await self._sink.publish([(job.request.reply, result) for job, result in replies])
                break
            except Unavailable as exc:
                if now_ms() > give_up_ms:
                    log.error("giving up on %d replies past their deadlines: %s", len(replies), exc)
                    break
                log.warning("reply publish failed, retrying in %.2fs: %s", delay, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        for job, result in replies:
            self._tracker.done(job.tp, job.offset)
            metrics.RESULTS.labels(self.model, job.request.priority.label, result.status.value).inc()
        self._commit_wake.set()

    async def _commit_loop(self, consumer: AIOKafkaConsumer) -> None:
        while True:
            await self._commit_wake.wait()
            self._commit_wake.clear()
            await self._commit(consumer)
            if self._drained.is_set():
                return

    async def _commit(self, consumer: AIOKafkaConsumer) -> None:
        positions = self._tracker.committable(consumer.assignment())
        if not positions:
            return
        try:
            await consumer.commit({tp: OffsetAndMetadata(pos, "") for tp, pos in positions.items()})
            self._tracker.mark_committed(positions)
        except (CommitFailedError, KafkaError) as exc:
            # A rebalance took the partitions away; their new owner re-answers from the last commit.
            log.warning("commit of %s failed: %s", positions, exc)

    def _spawn(self, coro: object) -> asyncio.Task[None]:
        assert self._tg is not None
        return self._tg.create_task(coro)  # type: ignore[arg-type]

    # -- rebalance ---------------------------------------------------------------------------

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        if self._consumer is not None:
            await self._commit(self._consumer)
        gone = self._batcher.remove(lambda p: p.payload.tp in revoked)
        self._tracker.forget(revoked)
        if gone:
            log.info("revoked %s: %d queued requests left for the new owner", sorted(map(str, revoked)), len(gone))


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._worker._on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        log.info("assigned %s", sorted(map(str, assigned)))


__all__ = ["Job", "Worker", "WorkerSettings"]
