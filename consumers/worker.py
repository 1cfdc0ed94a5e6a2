"""The worker: an I/O shell around engine cores. Fetch → cores → executor → publish → commit.

Each hosted model has an engine core (``consumers.cores``: every decision about its requests, as
values) and a *feed* here: its Kafka consumer in the model's group, its offset tracker, its paused
priorities. The feeds share one executor thread, a producer (DLQ, Kafka replies, stats) and a Redis
connection. Tasks on one event loop, none of which awaits while changing shared state, so no locks:

    fetch loop (per feed)   getmany() → decode (bad records → DLQ + ``invalid``) → core.admit
                            pauses a priority's partitions when the buffer reaches its share
    dispatch loop           core.shed → replies; when the executor is free, DeficitRoundRobin
                            picks a core → core.next → executor → core.complete → replies
    publish tasks           replies out (one Redis pipeline per batch), then their offsets are done
    commit loop             commits, at most every ``commit_interval_ms``, the highest offsets
                            whose replies are out
    report loop             where each model's weights are, to ``kinfer:residency`` every 2 s
    residency loop          (under ``memory_budget``) each model's lag → ``batcher.residency`` →
                            swaps, one at a time: drain, commit, leave the group, offload; or load,
                            warm up, join. A feed has a consumer only while its model is warm
    demand loop             (under ``memory_budget``) producers' notes that a cold model was wanted

At-least-once: an offset is committed only after the reply for it (and for everything before it
in its partition) has been published (``consumers.offsets`` states the invariant and why it holds
across rebalances). Commits are coalesced: a worker that dies loses nothing, and
its partitions' new owner answers again what was answered since the last commit (at most
``commit_interval_ms`` of traffic, plus what was in flight). Replies are idempotent by request id.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata
from prometheus_client import start_http_server
from redis.exceptions import RedisError

from kinfer.batcher import BatchPolicy, DeficitRoundRobin, GenPolicy
from kinfer.batcher.residency import Demand, Move, Residency, ResidencyPolicy, Tier
from kinfer.consumers.cores import EngineCore, Job, Outcome, Outgoing, Work, build_core
from kinfer.consumers.intake import read_record
from kinfer.consumers.observer import Observers
from kinfer.consumers.offsets import OffsetTracker
from kinfer.consumers.poison import CAREFUL_RECORDS, CarefulToken, DeliveryGuard, Verdict
from kinfer.consumers.replies import Delivery, ReplySink
from kinfer.consumers.runners import ModelSpec, Runner, build_runner
from kinfer.consumers.runners.base import bring_in, default_executors, pick_device, set_threads
from kinfer.consumers.runners.registry import GIB, estimate_footprint
from kinfer.consumers.sinks import PrometheusSink, StatsSink
from kinfer.consumers.telemetry import StatsReporter
from kinfer.topics import (
    DEFAULT_LIMITS,
    InvalidRequest,
    Limits,
    MalformedRecord,
    Priority,
    Result,
    Status,
    Unavailable,
    now_ms,
)
from kinfer.topics.admin import group_members, offset_clients, read_offsets_many
from kinfer.topics.auth import verifier_from_env
from kinfer.topics.backoff import Backoff
from kinfer.topics.cancel import CancelNote
from kinfer.topics.connect import kafka_options
from kinfer.topics.envelope import salvage_route
from kinfer.topics.names import CANCEL_CHANNEL, consumer_group, parse_request_topic, request_topics
from kinfer.topics.readers import Supervised, refused
from kinfer.topics.record import MAX_DURATION_MS
from kinfer.topics.residency import DEMAND_CHANNEL, RESIDENCY_KEY, ModelResidency, WorkerResidency
from kinfer.topics.residency import Demand as DemandNote

log = logging.getLogger(__name__)

# How long past a request's deadline a worker keeps retrying to publish its reply. After that the
# caller has already given up with DeadlineExceeded, which is its terminal state.
PUBLISH_GRACE_MS = 5_000

# How long a call beside the hot path may take: a refused record's dead letter, then its courtesy reply
# (the record is done without them after that: its partition's commits wait meanwhile), reading and
# writing the partitions' marks.
SIDE_CALL_TIMEOUT_S = 5.0

# A model whose swap failed (weights that do not load, a join the broker refused) is not tried again
# before this long: the worker goes on serving the others.
SWAP_RETRY_S = 30.0

# The share of the in-process buffer each priority may fill before its partitions pause.
_BUFFER_SHARE = {Priority.P0: 1.0, Priority.P1: 0.75, Priority.P2: 0.5}


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    models: tuple[ModelSpec, ...]  # one core each; co-located models share the executor fairly
    bootstrap: str  # Kafka bootstrap servers, "host:port[,host:port]"
    redis_url: str  # redis://host:port/db
    policy: BatchPolicy = field(default_factory=BatchPolicy)
    gen_policy: GenPolicy = field(default_factory=GenPolicy)  # for generator models
    weights: dict[str, float] = field(default_factory=dict)  # fair-share weight by model (default 1)
    # Declared device footprint by model, GiB (weights and the KV cache it reserves: what a placement
    # planned with); the residency budget counts the larger of it and the weights measured once loaded.
    footprints: dict[str, float] = field(default_factory=dict)
    fair_quantum_ms: float = 50.0  # compute a model may use per turn; co-located, also the longest batch
    limits: Limits = DEFAULT_LIMITS
    device: str = "auto"  # "auto" picks CUDA when available
    # Torch intra-op threads. None: the CPUs this process may run on (its affinity), less one for
    # the worker's own event loop, shared by the ``workers_per_host`` workers on them.
    threads: int | None = None
    workers_per_host: int = 1
    # Model calls in flight at once (one-shot families only): one worker with N executors serves one
    # queue on N cores (M/M/N), where N single-executor workers split the traffic by partition into N
    # queues that cannot help each other. Each call uses ``threads`` intra-op threads. None: on CPU, for
    # embedding and classifier models, the worker's share of the CPUs over ``threads`` (two cores, one
    # worker: two single-thread calls); else one.
    executors: int | None = None
    max_buffered_inputs: int = 512  # fetched inputs held in memory per model before its partitions pause
    fetch_max_records: int = 500  # records per getmany()
    fetch_max_wait_ms: int = 50  # how long the broker holds a fetch that has no records yet
    commit_interval_ms: int = 100  # commits are coalesced: at most one round of them this often
    # Group liveness: a killed worker's partitions move after this. 6 s is the broker's default floor
    # (group.min.session.timeout.ms); a graceful stop leaves the group at once and does not wait for it.
    session_timeout_ms: int = 6_000
    heartbeat_interval_ms: int = 1_000
    max_poll_interval_ms: int = 300_000  # must exceed the slowest batch
    instance_id: str | None = None  # static group membership: a restart with the same id rejoins at once
    metrics_port: int | None = None  # serve Prometheus metrics here
    metrics_host: str = "127.0.0.1"  # 0.0.0.0 in a container, for a scraper outside it
    drain_timeout_s: float = 30.0  # on SIGTERM, finish buffered work for at most this long
    # After an owner of a partition stopped without handing it over, its next owner works this many
    # records alone, one at a time, so that a record that stops workers is pinned down and dead-lettered
    # (``consumers.poison``). 0: off.
    careful_records: int = CAREFUL_RECORDS
    # The tenant registry (the gateway's tenants file): with it, a request's tenant must be listed and
    # may not ask for better than its ceiling. Requests must be signed whenever the process has
    # signing secrets (KINFER_SIGNING_SECRET); a registry without them is refused at start.
    tenants: str | None = None
    # Residency (``batcher.residency``): with a budget, the models that do not fit are registered, not
    # resident — swapped in when their records wait, the least valuable idle one out to make room.
    memory_budget: float | None = None  # GiB of device memory for weights; None: every model resident
    host_memory_budget: float = 0.0  # GiB of host RAM for weights swapped off the device (0: to disk)
    keep_warm: int = 0  # never swap out a model that has this many warm replicas or fewer, this one included
    swap_quantum_s: float = 10.0  # a model with work keeps the device this long before a waiting one may take it
    prefetch_lag: int = 100  # records waiting for a model others have warm before this worker swaps it in too
    residency_interval_s: float = 0.5  # how often the worker looks at its cold models' lag
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
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.workers_per_host < 1:
            raise ValueError(f"workers_per_host must be >= 1, got {self.workers_per_host}")
        if self.executors is not None and self.executors < 1:
            raise ValueError(f"executors must be >= 1, got {self.executors}")
        if (self.executors or 1) > 1 and any(m.family == "generator" for m in self.models):
            raise ValueError("executors > 1 is for one-shot models: a generator's running batch is one")
        if self.commit_interval_ms < 0:
            raise ValueError(f"commit_interval_ms must be >= 0, got {self.commit_interval_ms}")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(f"memory_budget must be > 0 GiB, got {self.memory_budget}")
        if self.host_memory_budget < 0 or self.keep_warm < 0 or self.swap_quantum_s < 0:
            raise ValueError("host_memory_budget, keep_warm and swap_quantum_s must be >= 0")
        for what, table in (("weights", self.weights), ("footprints", self.footprints)):
            unknown = set(table) - set(names)
            if unknown:
                raise ValueError(f"{what} for models this worker does not host: {sorted(unknown)}")


def _leave_on_stop(consumer: AIOKafkaConsumer) -> None:
    """Make a static member (``instance_id``) leave its group when it stops, as a dynamic one does.

    aiokafka never sends LeaveGroup for a static member, so a graceful restart left its partitions
    idle for the whole session timeout. The broker removes a static member by its member id like any
    other (LeaveGroup v0/v1, what aiokafka speaks), so the instance id is cleared before ``stop()``.
    A crash still keeps the static identity: a restart within the session timeout takes its
    partitions back without a rebalance.
    """
    coordinator = getattr(consumer, "_coordinator", None)
    if coordinator is not None and hasattr(coordinator, "_group_instance_id"):
        coordinator._group_instance_id = None


@dataclass(eq=False)
class _Feed:
    """The I/O side of one hosted model: where its requests come from and how far they are done."""

    core: EngineCore
    consumer: AIOKafkaConsumer | None = None  # set while the worker is a member of the model's group
    parked: AIOKafkaConsumer | None = None  # started, out of the group: kept for the next swap-in
    tracker: OffsetTracker[TopicPartition] = field(default_factory=OffsetTracker)
    guard: DeliveryGuard[TopicPartition] = field(default_factory=DeliveryGuard)  # records that stop workers
    held: set[Priority] = field(default_factory=set)  # priorities whose partitions are paused
    priority_of: dict[TopicPartition, Priority] = field(default_factory=dict)
    tier: Tier = Tier.DISK  # where its weights are; only a DEVICE model is in its group
    loading: bool = False  # a swap-in is running
    draining: bool = False  # fetch nothing more: its place on the device is wanted
    leaving: bool = False  # the fetch loop ends: swap-out under way
    fetching: asyncio.Task[None] | None = None
    assigned: asyncio.Event = field(default_factory=asyncio.Event)  # partitions came with the last join
    swap_in_ms: dict[str, float] = field(default_factory=dict)  # last measured, by source tier
    retry_at: float = 0.0  # a failed swap: not tried again before this (monotonic)
    running: int = 0  # model calls of it in the executor now

    def busy(self) -> bool:
        """Requests of it in this process: buffered, running, or replies not yet out (a running call
        counts by itself: a rebalance may have dropped its offsets from the tracker)."""
        return self.running > 0 or self.core.has_work() or self.core.buffered() > 0 or self.tracker.in_flight() > 0

    @property
    def name(self) -> str:
        return self.core.name

    def priority(self, tp: TopicPartition) -> Priority:
        found = self.priority_of.get(tp)
        if found is None:
            found = self.priority_of[tp] = parse_request_topic(tp.topic)[1]
        return found


class Worker:
    def __init__(self, settings: WorkerSettings, runners: dict[str, Runner] | None = None) -> None:
        self.settings = settings
        self.stats = StatsReporter(settings.worker_id)
        self.observer = Observers([PrometheusSink(), StatsSink(self.stats)])
        self.feeds: dict[str, _Feed] = {}
        self._careful = CarefulToken()  # one careful record in flight in the whole worker, and it runs alone
        for spec in settings.models:
            runner = (runners or {}).get(spec.name) or build_runner(spec, settings.device)
            core = build_core(spec, runner, policy=settings.policy, gen_policy=settings.gen_policy,
                              worker_id=settings.worker_id, observer=self.observer)
            self.feeds[spec.name] = _Feed(core, guard=DeliveryGuard(settings.careful_records, self._careful))
        self._fair: DeficitRoundRobin[str] = DeficitRoundRobin(settings.fair_quantum_ms / 1000.0)
        self._max_batch_s = settings.fair_quantum_ms / 1000.0 if len(self.feeds) > 1 else None
        for name in self.feeds:
            self._fair.add(name, settings.weights.get(name, 1.0))
        families = [m.family for m in settings.models]
        self.executors = settings.executors or default_executors(
            families, pick_device(settings.device), settings.threads, settings.workers_per_host)
        self._executor = ThreadPoolExecutor(self.executors, thread_name_prefix="kinfer-model")
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()  # something changed for the dispatch loop
        self._commit_wake = asyncio.Event()  # some reply went out
        self._settled = asyncio.Event()  # some request is done (replied): a draining model may be idle now
        self._drained = asyncio.Event()  # dispatch and publishing are over; final commit
        self._ready_logged = False
        self._computing: dict[asyncio.Task[None], float] = {}  # running work -> when it is predicted to end
        self._publishing: set[asyncio.Task[None]] = set()
        self._tg: asyncio.TaskGroup | None = None
        self._verifier = verifier_from_env(settings.tenants)
        self._sink: ReplySink | None = None
        self._admin: AIOKafkaAdminClient | None = None  # reads the marks of partitions it is assigned
        self.residency: Residency | None = None
        if settings.memory_budget is not None:
            self.residency = Residency(ResidencyPolicy(
                device_budget=int(settings.memory_budget * GIB), host_budget=int(settings.host_memory_budget * GIB),
                quantum_s=settings.swap_quantum_s, keep_warm=settings.keep_warm, prefetch_lag=settings.prefetch_lag))
            for spec in settings.models:
                declared = settings.footprints.get(spec.name)
                footprint = int(declared * GIB) if declared is not None else estimate_footprint(spec)
                self.residency.register(spec.name, footprint, settings.weights.get(spec.name, 1.0))
        # Swaps load weights on a thread of their own: the model calls of the other models go on meanwhile
        # (on a GPU the copy shares the default stream with their kernels; it does not overlap them).
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kinfer-load")
        # Cold models producers asked for (kinfer:demand), wanted until then: notes come at most once a
        # second, and a model must stay wanted for a quantum before it may take a busy model's place.
        self._demanded: dict[str, float] = {}
        self._unservable: set[str] = set()

    def stop(self) -> None:
        """Graceful stop: stop fetching, finish buffered work, reply, commit, leave the groups."""
        self._stopping.set()
        self._wake.set()

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        s = self.settings
        threads = set_threads(s.threads, s.workers_per_host)
        if threads is not None:
            log.info("torch uses %d intra-op thread(s) a call, %d call(s) at once", threads, self.executors)
        if self.residency is None:
            for feed in self.feeds.values():
                await self._swap_in(feed, Tier.DISK, join=False)
        else:
            for move in self.residency.initial(time.monotonic()):
                feed = self.feeds[move.model]
                if move.to == Tier.DEVICE:
                    await self._swap_in(feed, Tier.DISK, join=False)
                else:  # weights in host RAM, warmed up once, ready to be copied in when wanted
                    await self._load(feed, functools.partial(bring_in, feed.core.runner, False))
                    await self._load(feed, feed.core.runner.offload)
                    feed.tier = Tier.HOST
            cold = [name for name, feed in self.feeds.items() if feed.tier != Tier.DEVICE]
            log.info("memory budget %.2f GiB: resident %s; registered, not resident: %s", s.memory_budget,
                     ", ".join(n for n in self.feeds if n not in cold) or "none", ", ".join(cold) or "none")
        if s.metrics_port is not None:
            start_http_server(s.metrics_port, addr=s.metrics_host)
        # Everything loaded so far (torch, the model, the tokenizer: ~200k objects) lives as long as
        # the process. Frozen, the cyclic GC stops rescanning it: a full collection went from ~130 ms
        # (a pause every few seconds under load, straight into p99) to the few objects of the hot path.
        gc.collect()
        gc.freeze()

        producer = AIOKafkaProducer(**kafka_options(s.bootstrap), acks="all", enable_idempotence=True, linger_ms=1)
        redis = aioredis.Redis.from_url(s.redis_url)
        self._admin = AIOKafkaAdminClient(**kafka_options(s.bootstrap))
        try:
            await producer.start()
            await self._admin.start()
            self._sink = ReplySink(producer, redis)
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                for feed in self.feeds.values():
                    if feed.tier == Tier.DEVICE:
                        await self._join(feed)
                tg.create_task(self._dispatch_loop())
                tg.create_task(self._commit_loop())
                tg.create_task(self.stats.run(producer, self._drained))
                # Side readers: one that fails for an unforeseen reason restarts with backoff, the worker serves on.
                tg.create_task(Supervised("worker-report", functools.partial(self._report_loop, redis))
                               .run(self._drained))
                if any(feed.core.cancellable for feed in self.feeds.values()):
                    tg.create_task(Supervised("worker-cancel", functools.partial(self._cancel_loop, redis))
                                   .run(self._drained))
                if self.residency is not None:
                    tg.create_task(self._residency_loop())
                    tg.create_task(Supervised("worker-demand", functools.partial(self._demand_loop, redis))
                                   .run(self._drained))
        finally:
            for feed in self.feeds.values():
                await self._stop_consumer(feed)
            await producer.stop()
            await self._admin.close()
            await redis.aclose()
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._loader.shutdown(wait=False, cancel_futures=True)
            log.info("worker %s stopped", s.worker_id)

    # -- residency: joining and leaving a model's group ------------------------------------

    async def _join(self, feed: _Feed) -> None:
        """Become a member of the model's consumer group (the model is warm) and start fetching. The
        consumer of an earlier residency is reused (its connections and metadata): a swap-in is a join."""
        consumer, feed.parked = feed.parked, None
        if consumer is None:
            consumer = await self._new_consumer(feed)
        feed.assigned.clear()
        consumer.subscribe(request_topics(feed.name), listener=_Rebalance(self, feed))
        feed.consumer = consumer
        feed.fetching = self._spawn(self._fetch_loop(feed))

    async def _new_consumer(self, feed: _Feed) -> AIOKafkaConsumer:
        s = self.settings
        consumer = AIOKafkaConsumer(
            **kafka_options(s.bootstrap),
            group_id=consumer_group(feed.name),
            group_instance_id=s.instance_id,
            client_id=f"kinfer-worker-{s.worker_id}",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=s.session_timeout_ms,
            heartbeat_interval_ms=s.heartbeat_interval_ms,
            max_poll_interval_ms=s.max_poll_interval_ms,
            fetch_max_wait_ms=s.fetch_max_wait_ms,
        )
        try:
            await consumer.start()
        except BaseException:
            with contextlib.suppress(KafkaError):
                await consumer.stop()
            raise
        return consumer

    async def _leave(self, feed: _Feed) -> None:
        """Swap-out's first half: fetch nothing more, finish and answer what is here, commit, leave the
        group (the consumer is kept, out of the group, for the model's next swap-in)."""
        feed.draining = feed.leaving = True
        if feed.fetching is not None:
            await feed.fetching
        self._wake.set()
        while feed.busy() and not self._drained.is_set():
            self._settled.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._settled.wait(), 1.0)
        await self._commit(feed, handing=True)
        consumer, feed.consumer = feed.consumer, None
        if consumer is not None and not self._stopping.is_set():
            _leave_on_stop(consumer)  # a static member would not send LeaveGroup
            consumer.unsubscribe()  # leaves the group: its partitions move at once
            feed.parked = consumer
        elif consumer is not None:
            feed.consumer = consumer  # stopping: the shutdown stops it
        feed.tracker = OffsetTracker()
        feed.guard.clear()
        feed.held, feed.draining, feed.leaving, feed.fetching = set(), False, False, None

    async def _stop_consumer(self, feed: _Feed) -> None:
        for consumer in (feed.consumer, feed.parked):
            if consumer is not None:
                with contextlib.suppress(KafkaError):
                    _leave_on_stop(consumer)
                    await consumer.stop()  # leaves the group, so partitions move at once
        feed.consumer = feed.parked = None

    async def _swap_in(self, feed: _Feed, source: Tier, join: bool = True) -> None:
        """Weights to the device (from host RAM or disk), warm-up passes, then join the group: no record
        of the model is fetched before it can be served. The time to the first assignment is reported."""
        started = time.monotonic()
        feed.loading = True
        try:
            log.info("%s: loading from %s (%s)", feed.name, source.name.lower(), feed.core.spec.family)
            await self._load(feed, functools.partial(bring_in, feed.core.runner, source == Tier.HOST))
            if self.residency is not None:
                declared = int(self.settings.footprints.get(feed.name, 0.0) * GIB)
                self.residency.resize(feed.name, max(declared, feed.core.runner.footprint_bytes()))
            feed.tier = Tier.DEVICE
            if join and not self._stopping.is_set():  # stopping: joining would only move partitions twice
                await self._join(feed)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(feed.assigned.wait(), self.settings.session_timeout_ms / 1000.0 * 2)
        finally:
            feed.loading = False
        took_ms = 1000.0 * (time.monotonic() - started)
        feed.swap_in_ms[source.name.lower()] = round(min(took_ms, MAX_DURATION_MS), 1)  # what a report may say
        self.observer.swapped_in(feed.name, source.name.lower(), took_ms / 1000.0)
        log.info("%s: warm in %.0f ms from %s", feed.name, took_ms, source.name.lower())

    async def _swap_out(self, feed: _Feed, to: Tier) -> None:
        if feed.tier == Tier.DEVICE:
            await self._leave(feed)
            if self._stopping.is_set():  # the drain ended it: the weights go with the process
                return
            log.info("%s: swapped out to %s", feed.name, to.name.lower())
        runner = feed.core.runner
        await self._load(feed, runner.offload if to == Tier.HOST else runner.unload)
        feed.tier = to

    async def _load(self, feed: _Feed, call: Callable[[], None]) -> None:
        await asyncio.get_running_loop().run_in_executor(self._loader, call)

    async def _residency_loop(self) -> None:
        """Under a budget: every ``residency_interval_s``, what waits where → the policy → swaps, one at a time."""
        assert self.residency is not None
        s = self.settings
        async with offset_clients(s.bootstrap) as (admin, consumer):
            while not self._stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), s.residency_interval_s)
                if self._stopping.is_set():
                    break
                try:
                    seen = await self._demand(admin, consumer)
                except (KafkaError, OSError) as exc:
                    log.warning("residency: reading lag failed, retrying: %s", exc)
                    continue
                plan = self.residency.plan(time.monotonic(), seen)
                for name, feed in self.feeds.items():
                    if name in plan.drain and not feed.draining:
                        log.info("%s: draining (held the device a quantum; another model waits)", name)
                    feed.draining = name in plan.drain or feed.leaving
                for name in plan.unservable - self._unservable:
                    log.warning("%s: larger than the memory budget, cannot be served here", name)
                self._unservable = set(plan.unservable)
                await self._make(plan.moves)

    async def _make(self, moves: list[Move]) -> None:
        """The plan's moves, in order. One that fails (weights that do not load, a broker that refuses the
        join) puts the model back on disk and out of the plans for ``SWAP_RETRY_S``; the moves after it
        are not made, and the policy is told where everything really is. The worker goes on serving."""
        assert self.residency is not None
        for i, move in enumerate(moves):
            feed = self.feeds[move.model]
            if self._stopping.is_set():
                self._unplan(moves[i:])
                return
            try:
                if move.to == Tier.DEVICE:
                    await self._swap_in(feed, move.source)
                else:
                    await self._swap_out(feed, move.to)
            except Exception:
                log.exception("%s: swap to %s failed; it stays on disk for %.0f s", feed.name,
                              move.to.name.lower(), SWAP_RETRY_S)
                await self._stop_consumer(feed)
                with contextlib.suppress(Exception):
                    await self._load(feed, feed.core.runner.unload)
                feed.tier, feed.loading, feed.retry_at = Tier.DISK, False, time.monotonic() + SWAP_RETRY_S
                self.residency.place(feed.name, Tier.DISK, time.monotonic())
                self._unplan(moves[i + 1:])
                return

    def _unplan(self, moves: list[Move]) -> None:
        """Moves planned but not made: the policy learns that their models stayed where they were."""
        assert self.residency is not None
        for move in reversed(moves):
            self.residency.place(move.model, move.source, time.monotonic())

    async def _demand(self, admin: AIOKafkaAdminClient, consumer: AIOKafkaConsumer) -> dict[str, Demand]:
        """Per model: its records waiting in Kafka, whether this process holds any, its warm replicas
        (asked only where they decide something: ``keep_warm``, or a model off the device that has
        records waiting — a cold one is wanted at once, one warm elsewhere past ``prefetch_lag``).
        The records written to its topics since the last look are its demand, resident or not."""
        assert self.residency is not None
        offsets = await read_offsets_many(admin, consumer, list(self.feeds))
        now = time.monotonic()
        for name, found in offsets.items():
            self.residency.written(name, now, found.log_end)
        self._demanded = {name: until for name, until in self._demanded.items() if until > now}
        waiting = {name: sum(offsets[name].lag) if name in offsets else 0 for name in self.feeds}
        for name in self._demanded:
            waiting[name] = max(waiting[name], 1)
        for name, feed in self.feeds.items():
            if feed.retry_at > now:  # its last swap failed: not wanted until it may be tried again
                waiting[name] = 0
        asked = [name for name, feed in self.feeds.items()
                 if self.settings.keep_warm or (feed.tier != Tier.DEVICE and waiting[name] > 0)]
        members = await group_members(admin, [consumer_group(name) for name in asked])
        return {name: Demand(waiting[name], feed.busy(), members.get(consumer_group(name), -1))
                for name, feed in self.feeds.items()}

    async def _demand_loop(self, redis: aioredis.Redis) -> None:
        """Producers that refused a request for a cold model say so here: a reason to swap it in."""
        hold_s = self.settings.swap_quantum_s + 2 * self.settings.residency_interval_s
        async for data in self._subscribed(redis, DEMAND_CHANNEL):
            try:
                model = DemandNote.unpack(data).model
            except MalformedRecord as exc:
                refused("worker-demand", exc)
                continue
            if model in self.feeds and self.feeds[model].tier != Tier.DEVICE:
                self._demanded[model] = time.monotonic() + hold_s

    async def _subscribed(self, redis: aioredis.Redis, channel: str) -> AsyncIterator[bytes]:
        """Messages on ``channel`` until the worker has drained; through Redis outages (it resubscribes:
        these notes are best effort, and a worker must not die of a Redis restart)."""
        backoff = Backoff()
        while not self._drained.is_set():
            pubsub = redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                backoff.reset()
                while not self._drained.is_set():
                    msg = await pubsub.get_message(timeout=0.5)
                    if msg is not None and msg.get("type") == "message" and isinstance(msg["data"], bytes):
                        yield msg["data"]
            except (RedisError, OSError) as exc:
                log.warning("%s: Redis unavailable, resubscribing: %s", channel, exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._drained.wait(), backoff.next_delay())
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def _report_loop(self, redis: aioredis.Redis) -> None:
        """Where this worker's weights are, every couple of seconds (``kinfer:residency``), for the lag
        monitor's cold-start estimates and ``kinfer status``."""
        budget = int((self.settings.memory_budget or 0) * GIB)
        while not self._drained.is_set():
            models = []
            for name, feed in self.feeds.items():
                tier = feed.tier.name.lower()
                footprint = self.residency.footprint(name) if self.residency else feed.core.runner.footprint_bytes()
                shown = "loading" if feed.loading else tier
                models.append(ModelResidency(name, shown, footprint, dict(feed.swap_in_ms)))
                self.observer.resident(name, tier, footprint)
            report = WorkerResidency(self.settings.worker_id, now_ms(), budget, models)
            with contextlib.suppress(RedisError, OSError):
                await redis.hset(RESIDENCY_KEY, self.settings.worker_id, report.pack())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), 2.0)
        with contextlib.suppress(RedisError, OSError):
            await redis.hdel(RESIDENCY_KEY, self.settings.worker_id)

    # -- fetch -------------------------------------------------------------------------------

    async def _fetch_loop(self, feed: _Feed) -> None:
        consumer = feed.consumer
        assert consumer is not None
        backoff = Backoff()
        cap = self.settings.max_buffered_inputs
        while not self._stopping.is_set() and not feed.leaving:
            self._flow_control(feed, consumer)
            # No more than the buffer has room for: a burst fetched whole would overshoot the bound by a
            # whole fetch, and a model asked to give up the device would first have to finish all of it.
            room = max(1, min(cap - feed.core.buffered(), self.settings.fetch_max_records))
            try:
                # A careful stretch waits on every record's commit with every partition paused: poll
                # often then, so the next record is fetched as soon as the token is free.
                poll_ms = 5 if feed.guard.careful_any() or self._careful.busy else 100
                data = await consumer.getmany(timeout_ms=poll_ms, max_records=room)
                backoff.reset()
            except KafkaError as exc:
                log.warning("%s: fetch failed, retrying: %s", feed.name, exc)
                await asyncio.sleep(backoff.next_delay())
                continue
            if not self._ready_logged:
                self._log_ready()
            if not data:
                continue
            now, wall = time.monotonic(), now_ms()
            for tp, records in data.items():
                priority = feed.priority(tp)
                for record in records:
                    verdict = feed.guard.verdict(tp, record.offset)
                    if verdict is Verdict.DEFER:  # careful: one record at a time, the rest fetched again
                        consumer.seek(tp, feed.guard.refetch_from(tp, record.offset))
                        break
                    feed.tracker.track(tp, record.offset)
                    if verdict is Verdict.MARK:  # careful: it runs once its in-flight mark is committed
                        self._spawn_tracked(self._marked_intake(feed, tp, priority, record))
                        continue
                    if verdict is Verdict.POISON:
                        crashes = feed.guard.crashes(tp)
                        log.error("%s: %s@%d stopped %d workers while in flight: dead-lettered, not run again",
                                  feed.name, tp.topic, record.offset, crashes)
                        refusal = InvalidRequest(f"the record stopped {crashes} workers while in flight", "message")
                        self._spawn_tracked(self._reject(feed, tp, record.offset, record.value, refusal))
                        continue
                    self._intake(feed, tp, priority, record, now, wall)
            self.observer.buffered(feed.name, feed.core.buffered())
            self._wake.set()

    def _log_ready(self) -> None:
        warm = [feed for feed in self.feeds.values() if feed.tier == Tier.DEVICE]
        if all(feed.consumer and feed.consumer.assignment() for feed in warm):
            self._ready_logged = True
            log.info("worker %s ready: %s", self.settings.worker_id, ", ".join(self.feeds))

    def _intake(self, feed: _Feed, tp: TopicPartition, priority: Priority, record: ConsumerRecord[bytes, bytes],
                now: float, wall: int) -> None:
        """A fetched record becomes a job in its core, or a dead letter (``consumers.intake``: total)."""
        value = record.value
        sink = self._sink
        try:
            request = read_record(value, record.headers, feed.name, priority, limits=self.settings.limits,
                                  verifier=self._verifier, topic_missing=sink.topics.known_missing if sink else None)
            queue_ms = max(0.0, wall - record.timestamp)
            job = Job(request, tp, record.offset, queue_ms, now, now + (request.deadline_ms - wall) / 1000.0)
            self.observer.fetched(feed.name, request.priority, queue_ms / 1000.0)
            try:
                admitted = feed.core.admit(job, now)
            except InvalidRequest:
                raise
            except Exception as exc:  # a defect of the core or the runner: this record's refusal, not the end
                log.exception("%s: admitting %s@%d failed", feed.name, tp.topic, record.offset)
                raise InvalidRequest(f"the model could not take it ({type(exc).__name__})", "message") from exc
            if not admitted:
                feed.tracker.done(tp, record.offset)  # a copy of a request in progress: that one answers
                self._commit_wake.set()
        except InvalidRequest as exc:
            self._spawn_tracked(self._reject(feed, tp, record.offset, value, exc))

    async def _marked_intake(self, feed: _Feed, tp: TopicPartition, priority: Priority,
                             record: ConsumerRecord[bytes, bytes]) -> None:
        """A careful partition's record runs alone: once everything else in the worker is done (nothing
        is fetched meanwhile), its offset is committed with the IN_FLIGHT mark, then it is taken in. Should
        it stop this worker, the next owner finds the mark on it and dead-letters it unread."""
        while self._computing or any(f.core.has_work() for f in self.feeds.values()):
            self._settled.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._settled.wait(), 0.5)
        consumer = feed.consumer
        if consumer is None or tp not in consumer.assignment() or feed.guard.in_flight(tp) != record.offset:
            return  # revoked meanwhile: its next owner fetches it again
        try:
            mark = OffsetAndMetadata(record.offset, feed.guard.in_flight_mark(tp))
            await asyncio.wait_for(consumer.commit({tp: mark}), SIDE_CALL_TIMEOUT_S)
            feed.tracker.mark_committed({tp: record.offset})
        except (CommitFailedError, KafkaError, TimeoutError) as exc:
            log.warning("%s: in-flight mark of %s@%d failed: %s", feed.name, tp.topic, record.offset, exc)
        if tp in consumer.assignment() and feed.guard.in_flight(tp) == record.offset:
            self._intake(feed, tp, priority, record, time.monotonic(), now_ms())
            self._wake.set()

    def _flow_control(self, feed: _Feed, consumer: AIOKafkaConsumer) -> None:
        """Kafka is the queue: the in-process buffer is bounded, with room kept for urgent work.

        Each priority may fetch until the buffer holds its share of ``max_buffered_inputs`` (p2
        half, p1 three quarters, p0 all of it), then its partitions pause until the buffer drains
        an eighth below that. So a flood of batch traffic never locks out an interactive request,
        and lower priorities stay visible to the batcher (which can refuse them explicitly) for as
        long as there is room.
        """
        cap = self.settings.max_buffered_inputs
        buffered = feed.core.buffered()
        held = set(feed.held)
        for prio, share in _BUFFER_SHARE.items():
            if buffered >= share * cap or feed.draining:  # draining: its place on the device is wanted
                held.add(prio)
            elif buffered <= share * cap - cap / 8:
                held.discard(prio)
        # Marks not read yet, careful partitions while a careful record is in flight; and while one is,
        # nothing else at all: it runs alone.
        guarded = set(consumer.assignment()) if feed.guard.quiet else feed.guard.held()
        if held == feed.held and not held and not guarded and not consumer.paused():
            return
        changed, feed.held = held != feed.held, held
        want = {tp for tp in consumer.assignment() if feed.priority(tp) in held or tp in guarded}
        paused = consumer.paused()
        if want == paused:
            return
        if want - paused:
            consumer.pause(*(want - paused))
        if paused - want:
            consumer.resume(*(paused - want))
        if changed:
            self.observer.paused(feed.name, held)

    async def _reject(
        self, feed: _Feed, tp: TopicPartition, offset: int, value: bytes | None, exc: InvalidRequest
    ) -> None:
        """Dead-letter a record, tell its sender why when its id and route can be read, then let it commit.

        Bounded and total: the dead letter and the courtesy reply each get ``SIDE_CALL_TIMEOUT_S``, and
        whatever goes wrong with them, the record is done — a record that could not even be refused
        must not hold its partition, nor end the worker."""
        assert self._sink is not None
        source = f"{tp.topic}/{tp.partition}@{offset}"
        log.warning("dead-lettering %s: %s", source, exc)
        try:
            await asyncio.wait_for(self._sink.dead_letter(value, str(exc), exc.field, source), SIDE_CALL_TIMEOUT_S)
        except (Unavailable, TimeoutError) as error:  # dropped, not retried forever: it would pin its partition
            log.error("dead letter of %s not sent: %s", source, error or "timed out")
        except Exception:
            log.exception("dead letter of %s not sent", source)
        self.observer.dead_letter(feed.name, exc.field or "")
        salvaged = salvage_route(value, self.settings.limits) if value is not None else None
        if salvaged is not None:
            rid, route, key = salvaged
            result = Result(rid, feed.name, Status.INVALID, error=str(exc), worker=self.settings.worker_id,
                            field=exc.field)
            try:  # the DLQ has it; the reply is a courtesy
                await asyncio.wait_for(self._sink.publish([Delivery(route, result, key=key)]), SIDE_CALL_TIMEOUT_S)
            except (Unavailable, TimeoutError):
                pass
            except Exception:
                log.exception("the refusal of %s could not be sent", source)
        feed.tracker.done(tp, offset)
        self._commit_wake.set()
        self._settled.set()

    # -- dispatch ----------------------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        drain_until: float | None = None
        feeds = list(self.feeds.values())
        while True:
            self._wake.clear()
            now = time.monotonic()
            idle = self._slot_free()
            free_at = now if idle else max(now, min(self._computing.values()))
            for feed in feeds:
                if shed := feed.core.shed(now, free_at):
                    self._reply(feed, shed)
            if idle:
                self._start_next(now)
            if self._stopping.is_set():
                drain_until = drain_until or now + self.settings.drain_timeout_s
                busy = bool(self._computing) or any(feed.core.has_work() for feed in feeds)
                if not busy or now >= drain_until:
                    queued = sum(feed.core.buffered() for feed in feeds)
                    if queued:
                        log.warning("drain timeout: %d requests left for redelivery", queued)
                    break
            idle = self._slot_free()
            wakes = [w for feed in feeds if (w := feed.core.wake_at(now, idle)) is not None]
            if drain_until is not None:
                wakes.append(drain_until)
            timeout = max(0.0, min(wakes) - now) if wakes else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
        if self._computing:
            await asyncio.gather(*self._computing)
        while self._publishing:
            await asyncio.gather(*list(self._publishing))
        self._drained.set()
        self._commit_wake.set()

    def _slot_free(self) -> bool:
        return len(self._computing) < self.executors

    def _start_next(self, now: float) -> None:
        """While an executor is free: pick a core fairly and start its next work, if any."""
        ready = {name for name, feed in self.feeds.items() if feed.core.has_work()}
        while ready and self._slot_free():
            name = self._fair.pick(ready)
            assert name is not None
            feed = self.feeds[name]
            # Co-located, work may not outlast the fair-share quantum: a neighbour's request that
            # comes while it runs waits for it whole, whatever the fair share says.
            plan = feed.core.next(now, self._max_batch_s)
            if plan.replies:
                self._reply(feed, plan.replies)
            if plan.work is not None:
                task = self._spawn(self._run(feed, plan.work))
                self._computing[task] = now + plan.work.predicted_s
                continue
            ready.discard(name)  # nothing to start (a naive window holding back, or only evictions)

    async def _run(self, feed: _Feed, work: Work) -> None:
        started = time.monotonic()
        feed.running += 1
        try:
            value = await asyncio.get_running_loop().run_in_executor(self._executor, work.call)
            error = None
        except Exception as exc:  # the core answers the requests of the failed work with errors
            log.exception("%s: model call failed", feed.name)
            value, error = None, exc
        finally:
            feed.running -= 1
        took = time.monotonic() - started
        self._fair.charge(feed.name, took)
        replies = feed.core.complete(work, Outcome(value, error, started, took))
        task = asyncio.current_task()
        if task is not None:
            self._computing.pop(task, None)
        self._wake.set()
        if replies:
            self._reply(feed, replies)

    # -- replies and commits -----------------------------------------------------------------

    def _reply(self, feed: _Feed, replies: list[Outgoing]) -> None:
        self._spawn_tracked(self._publish(feed, replies))

    def _spawn_tracked(self, coro: Coroutine[Any, Any, None]) -> None:
        """A publishing task: the drain waits for every one of them before the final commit."""
        task = self._spawn(coro)
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def _publish(self, feed: _Feed, replies: list[Outgoing]) -> None:
        assert self._sink is not None
        deliveries = [Delivery(o.job.request.reply, o.message, o.job.request.batch_reply, o.job.request.reply_key)
                      for o in replies]
        give_up_ms = max(o.job.request.deadline_ms for o in replies) + PUBLISH_GRACE_MS
        backoff = Backoff()
        while True:
            try:
                if undelivered := await self._sink.publish(deliveries):
                    self.observer.undelivered(feed.name, undelivered)
                break
            except Unavailable as exc:
                if now_ms() > give_up_ms:
                    log.error("giving up on %d replies past their deadlines: %s", len(replies), exc)
                    break
                delay = backoff.next_delay()
                log.warning("reply publish failed, retrying in %.2fs: %s", delay, exc)
                await asyncio.sleep(delay)
        done: Counter[tuple[Priority, Status]] = Counter()
        tracker = feed.tracker
        for o in replies:
            if o.terminal:  # a stream's offset is done with its last chunk
                tracker.done(o.job.partition, o.job.offset)
                done[o.job.request.priority, o.message.status or Status.OK] += 1
        self.observer.replied(feed.name, done)
        self._commit_wake.set()
        self._settled.set()

    async def _cancel_loop(self, redis: aioredis.Redis) -> None:
        """Streams whose client went away: free their slot at the next step (best effort)."""
        async for data in self._subscribed(redis, CANCEL_CHANNEL):
            try:
                note = CancelNote.unpack(data)
            except MalformedRecord as exc:
                refused("worker-cancel", exc)
                continue
            feed = self.feeds.get(note.model)
            if feed is not None and feed.core.cancel(note.id, note.mac):
                self._wake.set()

    async def _commit_loop(self) -> None:
        """Commit what is done, coalesced: at most one round every ``commit_interval_ms``."""
        interval_s = self.settings.commit_interval_ms / 1000.0
        last = 0.0
        while True:
            await self._commit_wake.wait()
            wait_s = last + interval_s - time.monotonic()
            careful = any(feed.guard.awaiting_commit() for feed in self.feeds.values())  # its next record waits
            if wait_s > 0 and not self._drained.is_set() and not careful:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._drained.wait(), wait_s)
            self._commit_wake.clear()
            for feed in self.feeds.values():
                await self._commit(feed, handing=self._drained.is_set())
            last = time.monotonic()
            if self._drained.is_set():
                return

    async def _commit(self, feed: _Feed, handing: bool = False) -> None:
        """Commit what is done. ``handing``: this worker gives the partitions up (revoked, leaving,
        stopping), so every position is committed with the mark that says so, moved or not."""
        consumer = feed.consumer
        if consumer is None:
            return
        assigned = consumer.assignment()
        positions = ({**feed.guard.taken(assigned), **feed.tracker.positions(assigned)} if handing
                     else feed.tracker.committable(assigned))
        if not positions:
            return
        mark = feed.guard.handing if handing else feed.guard.metadata
        try:
            await consumer.commit({tp: OffsetAndMetadata(pos, mark(tp, pos)) for tp, pos in positions.items()})
            feed.tracker.mark_committed(positions)
            for tp, pos in positions.items():
                feed.guard.committed(tp, pos)
        except (CommitFailedError, KafkaError) as exc:
            # A rebalance took the partitions away; their new owner re-answers from the last commit.
            log.warning("%s: commit of %s failed: %s", feed.name, positions, exc)
            if feed.guard.awaiting_commit():  # a careful record waits for this commit: try again soon
                asyncio.get_running_loop().call_later(0.5, self._commit_wake.set)

    async def on_assigned(self, feed: _Feed, assigned: set[TopicPartition]) -> None:
        """Take the partitions: read the mark their last owner left (``consumers.poison``), fetching nothing
        meanwhile, and leave ours."""
        consumer = feed.consumer
        feed.guard.assigning(assigned)
        if consumer is None or not assigned:
            feed.guard.forget(assigned)
            return
        consumer.pause(*assigned)  # until the marks are read; flow control resumes them
        marks: dict[TopicPartition, tuple[int, str | None]] = {tp: (-1, None) for tp in assigned}
        try:
            assert self._admin is not None
            found = await asyncio.wait_for(self._admin.list_consumer_group_offsets(
                consumer_group(feed.name), partitions=list(assigned)), SIDE_CALL_TIMEOUT_S)
            marks.update({tp: (meta.offset, meta.metadata) for tp, meta in found.items() if tp in assigned})
            if fresh := [tp for tp, (position, _) in marks.items() if position < 0]:  # never committed: the
                starts = await asyncio.wait_for(consumer.beginning_offsets(fresh), SIDE_CALL_TIMEOUT_S)  # log's start
                marks.update({tp: (starts[tp], None) for tp in fresh if tp in starts})
        except (KafkaError, TimeoutError, OSError) as exc:
            log.warning("%s: reading the partitions' marks failed, taking them unmarked: %s", feed.name, exc)
        taken = feed.guard.assigned(marks)
        careful = [tp for tp in assigned if feed.guard.careful(tp)]
        if careful:
            log.warning("%s: %d partitions' last owner stopped without handing them over: working their next "
                        "%d records alone", feed.name, len(careful), self.settings.careful_records)
        if taken:
            try:
                await consumer.commit({tp: OffsetAndMetadata(pos, meta) for tp, (pos, meta) in taken.items()})
                feed.tracker.mark_committed({tp: pos for tp, (pos, _) in taken.items()})
            except (CommitFailedError, KafkaError) as exc:
                log.warning("%s: marking the partitions taken failed: %s", feed.name, exc)
        self._wake.set()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        assert self._tg is not None
        return self._tg.create_task(coro)

    # -- rebalance ---------------------------------------------------------------------------

    async def on_revoked(self, feed: _Feed, revoked: set[TopicPartition]) -> None:
        await self._commit(feed, handing=True)
        gone = feed.core.revoke(revoked)
        feed.tracker.forget(revoked)
        feed.guard.forget(revoked)
        if gone:
            log.info("%s: revoked %d partitions; %d requests left for the new owner", feed.name, len(revoked), gone)


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, worker: Worker, feed: _Feed) -> None:
        self._worker = worker
        self._feed = feed

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._worker.on_revoked(self._feed, revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        log.info("%s: assigned %d partitions", self._feed.name, len(assigned))
        await self._worker.on_assigned(self._feed, assigned)
        self._feed.assigned.set()


__all__ = ["Worker", "WorkerSettings"]
