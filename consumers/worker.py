"""The worker: host one or more models, batch their requests, run them off the loop, reply, commit.

Each hosted model is a *lane*: its runner, its Kafka consumer (in the model's consumer group), its
``DynamicBatcher`` and its ``OffsetTracker``. The lanes share one executor thread, a producer (for
the DLQ and Kafka replies) and a Redis connection. Tasks on one event loop, none of which awaits
in the middle of changing shared state, so no locks are needed:

    fetch loop (per lane)   getmany() → validate → batcher.add()   bad records → DLQ (+ ``invalid``)
                            pauses a priority's partitions when the buffer reaches its share
                            (lower priorities stop first, keeping room for urgent work)
    dispatch loop           shed (expired / cannot make it / CoDel) → replies
                            when the executor is free: DeficitRoundRobin picks a lane → its
                            batcher's next batch → executor thread → results → publish task
    commit loop             commits the highest offsets whose replies are out

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
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import msgpack
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata
from prometheus_client import start_http_server

from batcher import Batch, BatchPolicy, DeficitRoundRobin, DynamicBatcher, GenPolicy, Reason, StepPlan
from consumers import metrics
from consumers.lanes import BatchLane, GenLane, Job, Lane
from consumers.replies import ReplySink
from consumers.runners import BatchRunner, ModelSpec, Runner, build_runner
from consumers.runners.generator import GeneratorRunner
from consumers.telemetry import StatsReporter
from topics import (
    DEFAULT_LIMITS,
    Chunk,
    InvalidRequest,
    Limits,
    Priority,
    Result,
    Status,
    Timings,
    Unavailable,
    decode_request,
    now_ms,
)
from topics.envelope import salvage_route
from topics.names import CANCEL_CHANNEL, consumer_group, parse_request_topic, request_topics

log = logging.getLogger(__name__)

# How long past a request's deadline a worker keeps retrying to publish its reply. After that the
# caller has already given up with DeadlineExceeded, which is its terminal state.
PUBLISH_GRACE_MS = 5_000

# The share of the in-process buffer each priority may fill before its partitions pause.
_BUFFER_SHARE = {Priority.P0: 1.0, Priority.P1: 0.75, Priority.P2: 0.5}

_SHED_STATUS = {Reason.EXPIRED: Status.EXPIRED, Reason.DEADLINE: Status.EXPIRED, Reason.CODEL: Status.SHED}
_SHED_TEXT = {
    Reason.EXPIRED: "deadline passed while queued",
    Reason.DEADLINE: "cannot finish by its deadline (predicted queue + compute)",
    Reason.CODEL: "shed under overload (standing queue), lowest priority first",
}


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    models: tuple[ModelSpec, ...]  # one lane each; co-located models share the executor fairly
    bootstrap: str  # Kafka bootstrap servers, "host:port[,host:port]"
    redis_url: str  # redis://host:port/db
    policy: BatchPolicy = field(default_factory=BatchPolicy)
    gen_policy: GenPolicy = field(default_factory=GenPolicy)  # for generator models
    weights: dict[str, float] = field(default_factory=dict)  # fair-share weight by model (default 1)
    fair_quantum_ms: float = 50.0  # compute a lane may use per turn; co-located, also the longest batch
    limits: Limits = DEFAULT_LIMITS
    device: str = "auto"  # "auto" picks CUDA when available
    max_buffered_inputs: int = 512  # fetched inputs held in memory per model before its partitions pause
    fetch_max_records: int = 500  # records per getmany()
    session_timeout_ms: int = 10_000  # group liveness; a killed worker's partitions move after this
    heartbeat_interval_ms: int = 1_000
    max_poll_interval_ms: int = 300_000  # must exceed the slowest batch
    instance_id: str | None = None  # static group membership: a restart with the same id rejoins at once
    metrics_port: int | None = None  # serve Prometheus metrics here
    metrics_host: str = "127.0.0.1"  # 0.0.0.0 in a container, for a scraper outside it
    drain_timeout_s: float = 30.0  # on SIGTERM, finish buffered work for at most this long
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("a worker needs at least one model")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        if self.max_buffered_inputs < self.policy.max_batch_size:
            raise ValueError(
                f"max_buffered_inputs ({self.max_buffered_inputs}) must be >= "
                f"policy.max_batch_size ({self.policy.max_batch_size})"
            )
        unknown = set(self.weights) - set(names)
        if unknown:
            raise ValueError(f"weights for models this worker does not host: {sorted(unknown)}")


class Worker:
    def __init__(self, settings: WorkerSettings, runners: dict[str, Runner] | None = None) -> None:
        self.settings = settings
        self.lanes: dict[str, Lane] = {
            spec.name: self._lane(spec, (runners or {}).get(spec.name) or build_runner(spec, settings.device))
            for spec in settings.models
        }
        self._fair: DeficitRoundRobin[str] = DeficitRoundRobin(settings.fair_quantum_ms / 1000.0)
        self._max_batch_s = settings.fair_quantum_ms / 1000.0 if len(self.lanes) > 1 else None
        for name in self.lanes:
            self._fair.add(name, settings.weights.get(name, 1.0))
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kinfer-model")
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()  # something changed for the dispatch loop
        self._commit_wake = asyncio.Event()  # some reply went out
        self._drained = asyncio.Event()  # dispatch and publishing are over; final commit
        self._ready_logged = False
        self._computing: asyncio.Task[None] | None = None
        self._free_at = 0.0  # when the running batch is predicted to end
        self._publishing: set[asyncio.Task[None]] = set()
        self._tg: asyncio.TaskGroup | None = None
        self._sink: ReplySink | None = None
        self.stats = StatsReporter(settings.worker_id)

    def _lane(self, spec: ModelSpec, runner: Runner) -> Lane:
        if isinstance(runner, GeneratorRunner):
            return GenLane.create(spec, runner, self.settings.gen_policy, self.settings.worker_id)
        return BatchLane(spec=spec, runner=cast(BatchRunner, runner), batcher=DynamicBatcher(self.settings.policy))

    def stop(self) -> None:
        """Graceful stop: stop fetching, finish buffered work, reply, commit, leave the groups."""
        self._stopping.set()
        self._wake.set()

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        s = self.settings
        loop = asyncio.get_running_loop()
        for lane in self.lanes.values():
            runner = lane.model_runner
            log.info("loading model %s (%s) on %s", lane.name, lane.spec.family, runner.device)
            await loop.run_in_executor(self._executor, runner.load)
            await loop.run_in_executor(self._executor, runner.warmup)
        if s.metrics_port is not None:
            start_http_server(s.metrics_port, addr=s.metrics_host)

        producer = AIOKafkaProducer(bootstrap_servers=s.bootstrap, acks="all", enable_idempotence=True, linger_ms=1)
        redis = aioredis.Redis.from_url(s.redis_url)
        for lane in self.lanes.values():
            lane.consumer = AIOKafkaConsumer(
                bootstrap_servers=s.bootstrap,
                group_id=consumer_group(lane.name),
                group_instance_id=s.instance_id,
                client_id=f"kinfer-worker-{s.worker_id}",
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                session_timeout_ms=s.session_timeout_ms,
                heartbeat_interval_ms=s.heartbeat_interval_ms,
                max_poll_interval_ms=s.max_poll_interval_ms,
                fetch_max_wait_ms=50,
            )
        try:
            await producer.start()
            for lane in self.lanes.values():
                assert lane.consumer is not None
                await lane.consumer.start()
                lane.consumer.subscribe(request_topics(lane.name), listener=_Rebalance(self, lane))
            self._sink = ReplySink(producer, redis)
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                for lane in self.lanes.values():
                    tg.create_task(self._fetch_loop(lane))
                tg.create_task(self._dispatch_loop())
                tg.create_task(self._commit_loop())
                tg.create_task(self.stats.run(producer, self._drained))
                if any(isinstance(lane, GenLane) for lane in self.lanes.values()):
                    tg.create_task(self._cancel_loop(redis))
        finally:
            for lane in self.lanes.values():
                if lane.consumer is not None:
                    with contextlib.suppress(KafkaError):
                        await lane.consumer.stop()  # leaves the group, so partitions move at once
            await producer.stop()
            await redis.aclose()
            self._executor.shutdown(wait=False, cancel_futures=True)
            log.info("worker %s stopped", s.worker_id)

    # -- fetch -------------------------------------------------------------------------------

    async def _fetch_loop(self, lane: Lane) -> None:
        consumer = lane.consumer
        assert consumer is not None
        lanes = list(self.lanes.values())
        while not self._stopping.is_set():
            self._flow_control(lane, consumer)
            try:
                data = await consumer.getmany(timeout_ms=100, max_records=self.settings.fetch_max_records)
            except KafkaError as exc:
                log.warning("%s: fetch failed, retrying: %s", lane.name, exc)
                await asyncio.sleep(0.5)
                continue
            if not self._ready_logged and all(other.consumer and other.consumer.assignment() for other in lanes):
                self._ready_logged = True
                log.info("worker %s ready: %s", self.settings.worker_id, ", ".join(self.lanes))
            if not data:
                continue
            now, wall = time.monotonic(), now_ms()
            for tp, records in data.items():
                for record in records:
                    lane.tracker.track(tp, record.offset)
                    await self._admit(lane, tp, record, now, wall)
            metrics.BUFFERED.labels(lane.name).set(lane.buffered())
            self._wake.set()

    def _flow_control(self, lane: Lane, consumer: AIOKafkaConsumer) -> None:
        """Kafka is the queue: the in-process buffer is bounded, with room kept for urgent work.

        Each priority may fetch until the buffer holds its share of ``max_buffered_inputs`` (p2
        half, p1 three quarters, p0 all of it), then its partitions pause until the buffer drains
        an eighth below that. So a flood of batch traffic never locks out an interactive request,
        and lower priorities stay visible to the batcher (which can refuse them explicitly) for as
        long as there is room.
        """
        cap = self.settings.max_buffered_inputs
        buffered = lane.buffered()
        for prio, share in _BUFFER_SHARE.items():
            if buffered >= share * cap:
                lane.held.add(prio)
            elif buffered <= share * cap - cap / 8:
                lane.held.discard(prio)
        want = {tp for tp in consumer.assignment() if parse_request_topic(tp.topic)[1] in lane.held}
        paused = consumer.paused()
        if want == paused:
            return
        if want - paused:
            consumer.pause(*(want - paused))
        if paused - want:
            consumer.resume(*(paused - want))
        for prio in Priority:
            metrics.PAUSED.labels(lane.name, prio.label).set(int(prio in lane.held))

    async def _admit(
        self, lane: Lane, tp: TopicPartition, record: ConsumerRecord[bytes, bytes], now: float, wall: int
    ) -> None:
        value = record.value or b""
        try:
            request = decode_request(value, self.settings.limits)
            if request.model != lane.name:
                raise InvalidRequest(f"model {request.model!r} sent to a topic of {lane.name!r}", "model")
        except InvalidRequest as exc:
            await self._reject(lane, tp, record.offset, value, exc)
            return
        queue_ms = max(0.0, wall - record.timestamp)
        job = Job(request, tp, record.offset, queue_ms, now)
        metrics.QUEUE_WAIT.labels(lane.name, request.priority.label).observe(queue_ms / 1000.0)
        deadline = now + (request.deadline_ms - wall) / 1000.0
        if isinstance(lane, GenLane):
            try:
                lane.admit(job, now, deadline)
            except InvalidRequest as exc:
                await self._reject(lane, tp, record.offset, value, exc)
            return
        assert isinstance(lane, BatchLane)
        if request.stream:
            refusal = InvalidRequest(f"model {lane.name!r} ({lane.spec.family}) does not stream", "stream")
            await self._reject(lane, tp, record.offset, value, refusal)
            return
        lane.batcher.add(
            job,
            priority=int(request.priority),
            size=len(request.inputs),
            longest=max(lane.runner.count_tokens(t) for t in request.inputs),
            deadline=deadline,
            now=now,
            enqueued=now - queue_ms / 1000.0,
        )

    async def _reject(self, lane: Lane, tp: TopicPartition, offset: int, value: bytes, exc: InvalidRequest) -> None:
        assert self._sink is not None
        source = f"{tp.topic}/{tp.partition}@{offset}"
        log.warning("dead-lettering %s: %s", source, exc)
        await self._sink.dead_letter(value, str(exc), exc.field, source)
        metrics.DEAD_LETTERS.labels(lane.name, exc.field or "").inc()
        salvaged = salvage_route(value, self.settings.limits)
        if salvaged is not None:
            rid, route = salvaged
            result = Result(rid, lane.name, Status.INVALID, error=str(exc), worker=self.settings.worker_id)
            with contextlib.suppress(Unavailable):  # the DLQ has it; the reply is a courtesy
                await self._sink.publish([(route, result)])
        lane.tracker.done(tp, offset)
        self._commit_wake.set()

    # -- dispatch ----------------------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        drain_until: float | None = None
        while True:
            self._wake.clear()
            now = time.monotonic()
            idle = self._computing is None
            for lane in self.lanes.values():
                if isinstance(lane, BatchLane):
                    self._shed(lane, now, free_at=now if idle else max(now, self._free_at))
                    metrics.CODEL_DROPPING.labels(lane.name).set(int(lane.batcher.shedding))
            if idle:
                self._start_next(now)
            for lane in self.lanes.values():
                metrics.BUFFERED.labels(lane.name).set(lane.buffered())

            queued = sum(lane.buffered() for lane in self.lanes.values())
            if self._stopping.is_set():
                drain_until = drain_until or now + self.settings.drain_timeout_s
                busy = self._computing is not None or any(lane.has_work() for lane in self.lanes.values())
                if not busy or now >= drain_until:
                    if queued:
                        log.warning("drain timeout: %d requests left for redelivery", queued)
                    break
            idle = self._computing is None
            wakes = [
                w for lane in self.lanes.values()
                if isinstance(lane, BatchLane) and (w := lane.batcher.wake_at(now, idle=idle)) is not None
            ]
            if drain_until is not None:
                wakes.append(drain_until)
            timeout = max(0.0, min(wakes) - now) if wakes else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
        if self._computing is not None:
            await self._computing
        while self._publishing:
            await asyncio.gather(*list(self._publishing))
        self._drained.set()
        self._commit_wake.set()

    def _start_next(self, now: float) -> None:
        """One executor: pick a lane fairly and start its next batch or generation step, if any."""
        ready = {name for name, lane in self.lanes.items() if lane.has_work()}
        while ready:
            name = self._fair.pick(ready)
            assert name is not None
            lane = self.lanes[name]
            if isinstance(lane, GenLane):
                plan, ended = lane.plan(now)
                if ended:
                    self._reply(lane, ended)
                    self._gen_gauges(lane)
                if lane.runnable(plan):
                    self._free_at = now + lane.step_s
                    self._computing = self._spawn(self._generate(lane, plan))
                    return
            else:
                assert isinstance(lane, BatchLane)
                # Co-located, a batch may not outlast the fair-share quantum: a neighbour's request that
                # comes while it runs waits for it whole, whatever the fair share says.
                batch = lane.batcher.next_batch(now, idle=True, max_batch_s=self._max_batch_s)
                if batch is not None:
                    self._free_at = now + batch.predicted_s
                    self._computing = self._spawn(self._compute(lane, batch))
                    return
            ready.discard(name)  # nothing to start (a naive window holding back, or only evictions)

    def _shed(self, lane: BatchLane, now: float, free_at: float) -> None:
        dropped = lane.batcher.shed(now, free_at=free_at)
        if not dropped:
            return
        replies = []
        for d in dropped:
            job = d.pending.payload
            metrics.SHED.labels(lane.name, job.request.priority.label, d.reason.value).inc()
            self.stats.shed(lane.name, d.reason.value)
            error = _SHED_TEXT[d.reason]
            replies.append((job, self._result(lane, job, _SHED_STATUS[d.reason], error=error)))
        self._reply(lane, replies)

    async def _generate(self, lane: GenLane, plan: StepPlan) -> None:
        """One continuous-batching step: drop, decode, prefill; then stream what it produced."""
        admit, drop = lane.step_inputs(plan)
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            events = await loop.run_in_executor(self._executor, lane.runner.step, admit, drop)
        except Exception:
            log.exception("%s: generation step failed; failing its sequences", lane.name)
            raise  # the runner's batch is in an unknown state: let the worker die and redeliver
        took = time.monotonic() - started
        # When the next step's co-located work can start (the first step measured sets it).
        lane.step_s = took if lane.step_s == 0 else lane.step_s + 0.2 * (took - lane.step_s)
        self._fair.charge(lane.name, took)
        metrics.GEN_STEP.labels(lane.name).observe(took)
        metrics.SPEC_PROPOSED.labels(lane.name).inc(lane.runner.spec_proposed - lane.spec_seen[0])
        metrics.SPEC_ACCEPTED.labels(lane.name).inc(lane.runner.spec_accepted - lane.spec_seen[1])
        lane.spec_seen = (lane.runner.spec_proposed, lane.runner.spec_accepted)
        metrics.GEN_TOKENS.labels(lane.name).inc(len(events))
        self.stats.batch(lane.name, len(lane.scheduler.running), len(admit), len(events), took, step=True)
        batch = lane.runner.batch
        if batch is not None and batch.cache_tokens:
            metrics.KV_PADDING.labels(lane.name).observe(1.0 - batch.real_tokens / batch.cache_tokens)
        replies, _ = lane.apply(events)
        self._gen_gauges(lane)
        self._computing = None
        self._wake.set()
        if replies:
            self._reply(lane, replies)

    @staticmethod
    def _gen_gauges(lane: GenLane) -> None:
        metrics.GEN_RUNNING.labels(lane.name).set(len(lane.scheduler.running))
        metrics.KV_RESERVED.labels(lane.name).set(lane.scheduler.kv_reserved)

    async def _compute(self, lane: BatchLane, batch: Batch[Job]) -> None:
        jobs = batch.payloads
        texts = [t for job in jobs for t in job.request.inputs]
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            outputs = await loop.run_in_executor(self._executor, lane.runner.run, texts)
            error = None
        except Exception as exc:  # the model failed: every request in the batch gets an error reply
            log.exception("%s: batch of %d failed", lane.name, len(texts))
            outputs, error = [], f"{type(exc).__name__}: {exc}"
        took = time.monotonic() - started
        lane.batcher.observe(batch, took)
        self._fair.charge(lane.name, took)
        self._observe(lane, batch, started, took)
        self.stats.batch(lane.name, len(texts), len(jobs), batch.real_tokens, took, batch.predicted_s,
                         errors=len(jobs) if error is not None else 0)
        replies, i = [], 0
        for job in jobs:
            n = len(job.request.inputs)
            timings = Timings(job.queue_ms, (started - job.fetched) * 1000.0, took * 1000.0, len(texts))
            if error is None:
                result = self._result(lane, job, Status.OK, outputs=outputs[i : i + n], timings=timings)
            else:
                result = self._result(lane, job, Status.ERROR, error=error, timings=timings)
            replies.append((job, result))
            i += n
        self._computing = None
        self._wake.set()
        self._reply(lane, replies)

    def _observe(self, lane: BatchLane, batch: Batch[Job], started: float, took: float) -> None:
        metrics.COMPUTE.labels(lane.name).observe(took)
        metrics.PREDICTED.labels(lane.name).observe(batch.predicted_s)
        metrics.BATCH_SIZE.labels(lane.name).observe(batch.size)
        metrics.PADDING.labels(lane.name).observe(batch.padding_ratio)
        for p in batch.items:
            metrics.BATCH_WAIT.labels(lane.name, p.payload.request.priority.label).observe(started - p.arrival)

    def _result(
        self, lane: Lane, job: Job, status: Status, *, outputs: list[Any] | None = None, error: str | None = None,
        timings: Timings | None = None,
    ) -> Result:
        return Result(
            id=job.request.id, model=lane.name, status=status, outputs=list(outputs or []), error=error,
            timings=timings or Timings(queue_ms=job.queue_ms), worker=self.settings.worker_id,
        )

    # -- replies and commits -----------------------------------------------------------------

    def _reply(self, lane: Lane, replies: list[tuple[Job, Result]] | list[tuple[Job, Result | Chunk]]) -> None:
        if isinstance(lane, GenLane):  # a batch lane reports its sheds where it decides them (_shed)
            for _, reply in replies:
                if isinstance(reply, Result) and reply.status is Status.EXPIRED:
                    self.stats.shed(lane.name, Reason.DEADLINE.value)
        self._publishing.add(task := self._spawn(self._publish(lane, replies)))
        task.add_done_callback(self._publishing.discard)

    async def _publish(self, lane: Lane, replies: list[tuple[Job, Result]] | list[tuple[Job, Result | Chunk]]) -> None:
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
        for job, reply in replies:
            if isinstance(reply, Chunk) and not reply.final:
                continue  # a stream's offset is done with its last chunk
            lane.tracker.done(job.tp, job.offset)
            status = reply.status.value if reply.status is not None else "ok"
            metrics.RESULTS.labels(lane.name, job.request.priority.label, status).inc()
        self._commit_wake.set()

    async def _cancel_loop(self, redis: aioredis.Redis) -> None:
        """Streams whose client went away: free their slot at the next step (best effort)."""
        pubsub = redis.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(CANCEL_CHANNEL)
        try:
            while not self._drained.is_set():
                msg = await pubsub.get_message(timeout=0.5)
                if msg is None or msg.get("type") != "message":
                    continue
                try:
                    note = msgpack.unpackb(msg["data"], raw=False, max_str_len=256, max_map_len=4)
                    lane = self.lanes.get(note["model"])
                    rid = note["id"]
                except (ValueError, KeyError, TypeError, msgpack.ExtraData, msgpack.FormatError):
                    continue
                if isinstance(lane, GenLane) and lane.scheduler.cancel(rid):
                    metrics.GEN_CANCELLED.labels(lane.name).inc()
                    self._wake.set()
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def _commit_loop(self) -> None:
        while True:
            await self._commit_wake.wait()
            self._commit_wake.clear()
            for lane in self.lanes.values():
                await self._commit(lane)
            if self._drained.is_set():
                return

    async def _commit(self, lane: Lane) -> None:
        consumer = lane.consumer
        if consumer is None:
            return
        positions = lane.tracker.committable(consumer.assignment())
        if not positions:
            return
        try:
            await consumer.commit({tp: OffsetAndMetadata(pos, "") for tp, pos in positions.items()})
            lane.tracker.mark_committed(positions)
        except (CommitFailedError, KafkaError) as exc:
            # A rebalance took the partitions away; their new owner re-answers from the last commit.
            log.warning("%s: commit of %s failed: %s", lane.name, positions, exc)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        assert self._tg is not None
        return self._tg.create_task(coro)

    # -- rebalance ---------------------------------------------------------------------------

    async def on_revoked(self, lane: Lane, revoked: set[TopicPartition]) -> None:
        await self._commit(lane)
        gone = lane.batcher.remove(lambda p: p.payload.tp in revoked) if isinstance(lane, BatchLane) else []
        lane.tracker.forget(revoked)
        if gone:
            log.info("%s: revoked %d partitions; %d queued requests left for the new owner",
                     lane.name, len(revoked), len(gone))


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, worker: Worker, lane: Lane) -> None:
        self._worker = worker
        self._lane = lane

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._worker.on_revoked(self._lane, revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        log.info("%s: assigned %d partitions", self._lane.name, len(assigned))


__all__ = ["Worker", "WorkerSettings"]
