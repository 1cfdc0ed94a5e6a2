"""Where each hosted model's weights are, and moving them: residency under a memory budget.

Every model a worker is given is registered; under ``memory_budget`` only those that fit are resident.
The decisions are a pure policy (``batcher.residency``); here the worker tells it what waits where and
makes the moves it gets back, one at a time:

    place           at start: the device, then host RAM, filled in order; the rest stays on disk
    residency loop  (under ``memory_budget``) each model's lag → the policy → swaps: drain, commit, leave
                    the group, offload; or load, warm up, join. A feed has a consumer only while its
                    model is warm
    demand loop     (under ``memory_budget``) producers' notes that a cold model was wanted
    report loop     where each model's weights are, to ``kinfer:residency`` every 2 s

Each feed's lifecycle (``consumers.feed``) says where it is; joining and leaving its group are
``consumers.membership``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from kinfer.batcher.residency import Demand, Move, Residency, ResidencyPolicy, Tier
from kinfer.consumers.feed import Feed, FeedState, Signals
from kinfer.consumers.membership import Membership
from kinfer.consumers.observer import Observer
from kinfer.consumers.replies import reply_redis
from kinfer.consumers.runners.base import bring_in
from kinfer.consumers.runners.registry import GIB, estimate_footprint
from kinfer.consumers.settings import WorkerSettings
from kinfer.topics import MalformedRecord, now_ms
from kinfer.topics.admin import group_members, offset_clients, read_offsets_many
from kinfer.topics.names import consumer_group
from kinfer.topics.readers import refused, subscribed
from kinfer.topics.record import MAX_DURATION_MS
from kinfer.topics.residency import DEMAND_CHANNEL, RESIDENCY_KEY, ModelResidency, WorkerResidency
from kinfer.topics.residency import Demand as DemandNote

log = logging.getLogger(__name__)

# A model whose swap failed (weights that do not load, a join the broker refused) is not tried again
# before this long: the worker goes on serving the others.
SWAP_RETRY_S = 30.0
T = TypeVar("T")
REPORT_S = 2.0  # how often a worker says where its weights are (well inside RESIDENCY_FRESH_MS)


async def reporting(redis_url: str, work: Awaitable[T], report: Callable[[aioredis.Redis], Awaitable[None]]) -> T:
    """``work``'s result, with ``report`` published every ``REPORT_S`` until it is done.

    Reports go out between waits on ``work``, on a client of their own with short timeouts: a Redis
    that does not answer delays nothing, and no Redis call is cancelled halfway (with a publishing task
    cancelled when the work ended, one start in four of two workers side by side hung before joining its
    group). Stopped meanwhile, ``work`` is cancelled too."""
    redis = reply_redis(redis_url)
    working = asyncio.ensure_future(work)
    try:
        await asyncio.sleep(0)  # ``work`` starts first: the first report says what it began (a load)
        while not working.done():
            with contextlib.suppress(RedisError, OSError):
                await report(redis)
            await asyncio.wait({working}, timeout=REPORT_S)
        return await working  # its outcome: an exception is raised here
    finally:
        if not working.done():
            working.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await working
        await redis.aclose()


async def announcing(settings: WorkerSettings, building: Awaitable[T]) -> T:
    """``building``'s result (the worker's runners: torch and a model's code take seconds to import),
    with this worker's models reported ``loading`` meanwhile: a request already waiting for them is a
    cold start to the lag monitor from the worker's first second, not a stall that raises the level.
    ``Swapper.place_reporting`` says where they are from then on."""
    async def loading(redis: aioredis.Redis) -> None:
        report = WorkerResidency(settings.worker_id, now_ms(), int((settings.memory_budget or 0) * GIB),
                                 [ModelResidency(spec.name, "loading", 0, {}) for spec in settings.models])
        await redis.hset(RESIDENCY_KEY, settings.worker_id, report.pack())

    return await reporting(settings.redis_url, building, loading)


class Swapper:
    """Brings the weights of one worker's models in and out of the device, as its residency policy says."""

    def __init__(self, settings: WorkerSettings, feeds: dict[str, Feed], signals: Signals, observer: Observer,
                 membership: Membership) -> None:
        self.settings = settings
        self.feeds = feeds
        self.signals = signals
        self.observer = observer
        self.membership = membership
        self.residency: Residency | None = None  # None: no budget, every model resident
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

    def close(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)

    async def place(self) -> None:
        """At start, before any group is joined: every model on the device without a budget; under one,
        the device, then host RAM (weights read and warmed up once), filled in order."""
        if self.residency is None:
            for feed in self.feeds.values():
                await self.swap_in(feed, Tier.DISK, join=False)
            return
        for move in self.residency.initial(time.monotonic()):
            feed = self.feeds[move.model]
            if move.to == Tier.DEVICE:
                await self.swap_in(feed, Tier.DISK, join=False)
            else:  # weights in host RAM, warmed up once, ready to be copied in when wanted
                feed.lifecycle.load()
                await self._load(feed, functools.partial(bring_in, feed.core.runner, False))
                feed.lifecycle.warm()
                await self._load(feed, feed.core.runner.offload)
                feed.lifecycle.offload()
        cold = [name for name, feed in self.feeds.items() if feed.tier != Tier.DEVICE]
        log.info("memory budget %.2f GiB: resident %s; registered, not resident: %s", self.settings.memory_budget,
                 ", ".join(n for n in self.feeds if n not in cold) or "none", ", ".join(cold) or "none")

    # -- swaps -------------------------------------------------------------------------------

    async def swap_in(self, feed: Feed, source: Tier, join: bool = True) -> None:
        """Weights to the device (from host RAM or disk), warm-up passes, then join the group: no record
        of the model is fetched before it can be served. The time to the first assignment is reported."""
        started = time.monotonic()
        feed.lifecycle.load()
        log.info("%s: loading from %s (%s)", feed.name, source.name.lower(), feed.core.spec.family)
        await self._load(feed, functools.partial(bring_in, feed.core.runner, source == Tier.HOST))
        if self.residency is not None:
            declared = int(self.settings.footprints.get(feed.name, 0.0) * GIB)
            self.residency.resize(feed.name, max(declared, feed.core.runner.footprint_bytes()))
        if join and not self.signals.stopping.is_set():  # stopping: joining would only move partitions twice
            await self.membership.join(feed, wait_s=self.settings.session_timeout_ms / 1000.0 * 2)
        else:
            feed.lifecycle.warm()
        took_ms = 1000.0 * (time.monotonic() - started)
        feed.swap_in_ms[source.name.lower()] = round(min(took_ms, MAX_DURATION_MS), 1)  # what a report may say
        self.observer.swapped_in(feed.name, source.name.lower(), took_ms / 1000.0)
        log.info("%s: warm in %.0f ms from %s", feed.name, took_ms, source.name.lower())

    async def swap_out(self, feed: Feed, to: Tier) -> None:
        if feed.tier == Tier.DEVICE:
            if feed.lifecycle.state is not FeedState.WARM:  # in its group
                await self.membership.leave(feed)
            if self.signals.stopping.is_set():  # the drain ended it: the weights go with the process
                return
            log.info("%s: swapped out to %s", feed.name, to.name.lower())
        runner = feed.core.runner
        await self._load(feed, runner.offload if to == Tier.HOST else runner.unload)
        if to == Tier.HOST:
            feed.lifecycle.offload()
        else:
            feed.lifecycle.unload()

    async def _load(self, feed: Feed, call: Callable[[], None]) -> None:
        await asyncio.get_running_loop().run_in_executor(self._loader, call)

    # -- the policy's plans ------------------------------------------------------------------

    async def residency_loop(self) -> None:
        """Under a budget: every ``residency_interval_s``, what waits where → the policy → swaps, one at a time."""
        assert self.residency is not None
        s = self.settings
        stopping = self.signals.stopping
        async with offset_clients(s.bootstrap) as (admin, consumer):
            while not stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), s.residency_interval_s)
                if stopping.is_set():
                    break
                try:
                    seen = await self._demand(admin, consumer)
                except (KafkaError, OSError) as exc:
                    log.warning("residency: reading lag failed, retrying: %s", exc)
                    continue
                plan = self.residency.swaps(time.monotonic(), seen)
                self._drain(plan.drain)
                for name in plan.unservable - self._unservable:
                    log.warning("%s: larger than the memory budget, cannot be served here", name)
                self._unservable = set(plan.unservable)
                await self._make(plan.moves)

    def _drain(self, drain: frozenset[str]) -> None:
        """Resident models whose place is wanted fetch nothing more; those no longer drained fetch again."""
        for name, feed in self.feeds.items():
            state = feed.lifecycle.state
            if name in drain and state is FeedState.SERVING:
                log.info("%s: draining (held the device a quantum; another model waits)", name)
                feed.lifecycle.drain()
            elif name not in drain and state is FeedState.DRAINING:
                feed.lifecycle.undrain()

    async def _make(self, moves: list[Move]) -> None:
        """The plan's moves, in order. One that fails (weights that do not load, a broker that refuses the
        join) puts the model back on disk and out of the plans for ``SWAP_RETRY_S``; the moves after it
        are not made, and the policy is told where everything really is. The worker goes on serving."""
        for i, move in enumerate(moves):
            feed = self.feeds[move.model]
            if self.signals.stopping.is_set():
                self._unplan(moves[i:])
                return
            try:
                if move.to == Tier.DEVICE:
                    await self.swap_in(feed, move.source)
                else:
                    await self.swap_out(feed, move.to)
            except Exception:
                log.exception("%s: swap to %s failed; it stays on disk for %.0f s", feed.name,
                              move.to.name.lower(), SWAP_RETRY_S)
                await self._failed(feed)
                self._unplan(moves[i + 1:])
                return

    async def _failed(self, feed: Feed) -> None:
        """A swap that failed: the model goes back to disk, out of its group, not tried for ``SWAP_RETRY_S``."""
        assert self.residency is not None
        feed.lifecycle.fail()
        await self.membership.stop(feed)
        with contextlib.suppress(Exception):
            await self._load(feed, feed.core.runner.unload)
        feed.retry_at = time.monotonic() + SWAP_RETRY_S
        self.residency.place(feed.name, Tier.DISK, time.monotonic())

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

    # -- what goes in and out of Redis -------------------------------------------------------

    async def demand_loop(self, redis: aioredis.Redis) -> None:
        """Producers that refused a request for a cold model say so here: a reason to swap it in."""
        hold_s = self.settings.swap_quantum_s + 2 * self.settings.residency_interval_s
        async for data in subscribed(redis, DEMAND_CHANNEL, self.signals.drained):
            try:
                model = DemandNote.unpack(data).model
            except MalformedRecord as exc:
                refused("worker-demand", exc)
                continue
            if model in self.feeds and self.feeds[model].tier != Tier.DEVICE:
                self._demanded[model] = time.monotonic() + hold_s

    async def report_loop(self, redis: aioredis.Redis) -> None:
        """Where this worker's weights are, every ``REPORT_S`` (``kinfer:residency``), for the lag
        monitor's cold-start estimates and ``kinfer status``."""
        drained = self.signals.drained
        while not drained.is_set():
            with contextlib.suppress(RedisError, OSError):
                await self._report(redis)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(drained.wait(), REPORT_S)
        with contextlib.suppress(RedisError, OSError):
            await redis.hdel(RESIDENCY_KEY, self.settings.worker_id)

    async def place_reporting(self) -> None:
        """``place`` with this worker's report published meanwhile: its models show ``loading`` while
        they load, so a request that waits for them is the lag monitor's cold start, not a stall (no
        worker warm and nothing said, a waiting request read as a stuck worker raised the level to
        REJECTING, and its hysteresis held it seconds after the model came)."""
        await reporting(self.settings.redis_url, self.place(), self._report)

    async def _report(self, redis: aioredis.Redis) -> None:
        models = []
        for name, feed in self.feeds.items():
            footprint = self.residency.footprint(name) if self.residency else feed.core.runner.footprint_bytes()
            models.append(ModelResidency(name, feed.lifecycle.shown, footprint, dict(feed.swap_in_ms)))
            self.observer.resident(name, feed.tier.name.lower(), footprint)
        report = WorkerResidency(self.settings.worker_id, now_ms(), int((self.settings.memory_budget or 0) * GIB),
                                 models)
        await redis.hset(RESIDENCY_KEY, self.settings.worker_id, report.pack())
