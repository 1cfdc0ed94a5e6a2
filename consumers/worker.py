"""The worker: an I/O shell around engine cores. Fetch → cores → executor → publish → commit.

Each hosted model has an engine core (``consumers.cores``: every decision about its requests, as
values) and a *feed* (``consumers.feed``): its Kafka consumer in the model's group, its offset tracker,
its paused priorities, where it is in its lifecycle. The feeds share one executor thread, a producer
(DLQ, Kafka replies, stats) and a Redis connection. Three parts, tasks on one event loop, none of
which awaits while changing shared state, so no locks:

    membership (``consumers.membership``)
        fetch loop (per feed)   getmany() → decode (bad records → DLQ + ``invalid``) → core.admit
                                pauses a priority's partitions when the buffer reaches its share
                                (background: the core's room, resumed at half as its work ends)
        rebalances              partitions taken with their last owner's mark read, given up committed
    swapping (``consumers.swapping``)
        report loop             where each model's weights are, to ``kinfer:residency`` every 2 s
        residency loop          (under ``memory_budget``) each model's lag → ``batcher.residency`` →
                                swaps, one at a time: drain, commit, leave the group, offload; or load,
                                warm up, join. A feed has a consumer only while its model is warm
        demand loop             (under ``memory_budget``) producers' notes that a cold model was wanted
    this module, the shell that ties them together
        dispatch loop           core.shed → replies; when the executor is free, DeficitRoundRobin
                                picks a core → core.next → executor → core.complete → replies
                                (a call that ends starts the next at once, before its replies go)
        publish tasks           replies out (one Redis pipeline per batch), then their offsets are done
        commit loop             commits, at most every ``commit_interval_ms``, the highest offsets
                                whose replies are out
        answered loop           the same positions, committed or not, to ``kinfer:answered:<model>``
                                (``consumers.progress``): the lag monitor's view while commits stall
        cancel loop             cancel notes: streams whose client went away, copies of hedged
                                requests answered elsewhere (left unrun, offsets done)

At-least-once: an offset is committed only after the reply for it (and for everything before it
in its partition) has been published (``consumers.offsets`` states the invariant and why it holds
across rebalances). Commits are coalesced: a worker that dies loses nothing, and
its partitions' new owner answers again what was answered since the last commit (at most
``commit_interval_ms`` of traffic, plus what was in flight). Replies are idempotent by request id.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import logging
import time
from collections import Counter
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import OffsetAndMetadata
from opentelemetry.trace import Span
from prometheus_client import start_http_server

from kinfer.batcher import DeficitRoundRobin
from kinfer.batcher.residency import Residency, Tier
from kinfer.consumers.cores import Outcome, Outgoing, Work, build_core
from kinfer.consumers.feed import Feed, Signals
from kinfer.consumers.membership import Membership
from kinfer.consumers.observer import Observers
from kinfer.consumers.poison import CarefulToken, DeliveryGuard
from kinfer.consumers.progress import AnsweredReporter
from kinfer.consumers.replies import Delivery, ReplySink, reply_redis
from kinfer.consumers.runners import Runner, build_runner
from kinfer.consumers.runners.base import default_executors, set_threads
from kinfer.consumers.settings import WorkerSettings
from kinfer.consumers.sinks import PrometheusSink, ShedLog, StatsSink
from kinfer.consumers.stats_reporter import StatsReporter
from kinfer.consumers.swapping import Swapper
from kinfer.topics import MalformedRecord, Priority, Result, Status, Unavailable, now_ms, tracing
from kinfer.topics.backoff import Backoff
from kinfer.topics.cancel import CancelNote
from kinfer.topics.connect import kafka_options
from kinfer.topics.names import CANCEL_CHANNEL
from kinfer.topics.readers import Supervised, refused, subscribed

log = logging.getLogger(__name__)

# How long past a request's deadline a worker keeps retrying to publish its reply. After that the
# caller has already given up with DeadlineExceeded, which is its terminal state.
PUBLISH_GRACE_MS = 5_000
COMMIT_RETRY_S = 0.5  # a failed commit is tried again this soon, new replies or not


class Worker:
    """One worker process: its models' feeds (``Membership``) and weights (``Swapper``), and the dispatch,
    replies and commits that tie them together. ``run()`` until ``stop()``."""

    def __init__(self, settings: WorkerSettings, runners: dict[str, Runner] | None = None) -> None:
        self.settings = settings
        self.stats = StatsReporter(settings.worker_id)
        self.observer = Observers([PrometheusSink(), StatsSink(self.stats), ShedLog()])
        self.feeds: dict[str, Feed] = {}
        careful = CarefulToken()  # one careful record in flight in the whole worker, and it runs alone
        for spec in settings.models:
            runner = (runners or {}).get(spec.name) or build_runner(spec, settings.device)
            core = build_core(spec, runner, policy=settings.policy, gen_policy=settings.gen_policy,
                              worker_id=settings.worker_id, observer=self.observer)
            self.feeds[spec.name] = Feed(core, guard=DeliveryGuard(settings.careful_records, careful))
            self.observer.hosted(spec.name, generative=core.runner.family == "generator")
        self._fair: DeficitRoundRobin[str] = DeficitRoundRobin(settings.fair_quantum_ms / 1000.0)
        self._max_batch_s = settings.fair_quantum_ms / 1000.0 if len(self.feeds) > 1 else None
        for name in self.feeds:
            self._fair.add(name, settings.weights.get(name, 1.0))
        families = [m.family for m in settings.models]
        self.executors = settings.executors or default_executors(
            families, settings.device, settings.threads, settings.workers_per_host)
        self._executor = ThreadPoolExecutor(self.executors, thread_name_prefix="kinfer-model")
        self._signals = Signals()
        self._computing: dict[asyncio.Task[None], float] = {}  # running work -> when it is predicted to end
        self._dispatching = False  # the dispatch loop runs: work may start
        self._publishing: set[asyncio.Task[None]] = set()
        self._tg: asyncio.TaskGroup | None = None
        self._sink: ReplySink | None = None
        self._tracing = False  # whether an SDK tracer provider is installed (``topics.tracing``)
        self._membership = Membership(settings, self.feeds, self._signals, self.observer, careful,
                                      spawn=self._spawn, spawn_tracked=self._spawn_tracked, commit=self._commit,
                                      computing=lambda: bool(self._computing))
        self._swapper = Swapper(settings, self.feeds, self._signals, self.observer, self._membership)
        self._answered = AnsweredReporter(settings.worker_id, self.feeds)

    @property
    def residency(self) -> Residency | None:
        """The residency policy (under ``memory_budget``), told where every model is."""
        return self._swapper.residency

    def stop(self) -> None:
        """Graceful stop: stop fetching, finish buffered work, reply, commit, leave the groups."""
        self._signals.stopping.set()
        self._signals.wake.set()

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        s = self.settings
        threads = set_threads(s.threads, s.workers_per_host)
        if threads is not None:
            log.info("torch uses %d intra-op thread(s) a call, %d call(s) at once", threads, self.executors)
        await self._swapper.place_reporting()
        if s.metrics_port is not None:
            start_http_server(s.metrics_port, addr=s.metrics_host)
        # Everything loaded so far (torch, the model, the tokenizer: ~200k objects) lives as long as
        # the process. Frozen, the cyclic GC stops rescanning it: a full collection went from ~130 ms
        # (a pause every few seconds under load, straight into p99) to the few objects of the hot path.
        gc.collect()
        gc.freeze()

        producer = AIOKafkaProducer(**kafka_options(s.bootstrap), acks="all", enable_idempotence=True, linger_ms=1)
        redis = aioredis.Redis.from_url(s.redis_url)
        replies_redis = reply_redis(s.redis_url)  # short timeouts: a stalled Redis sends replies to their fallback
        drained = self._signals.drained
        try:
            await producer.start()
            self._sink = ReplySink(producer, replies_redis)
            self._tracing = tracing.tracer() is not None
            await self._membership.start(self._sink)
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                for feed in self.feeds.values():
                    if feed.tier == Tier.DEVICE:
                        await self._membership.join(feed)
                tg.create_task(self._dispatch_loop())
                tg.create_task(self._commit_loop())
                tg.create_task(self.stats.run(producer, drained))
                # Side readers: one that fails for an unforeseen reason restarts with backoff, the worker serves on.
                tg.create_task(Supervised("worker-report", functools.partial(self._swapper.report_loop, redis))
                               .run(drained))
                tg.create_task(Supervised("worker-answered", functools.partial(self._answered.run, redis, drained))
                               .run(drained))
                if any(feed.core.cancellable for feed in self.feeds.values()):
                    tg.create_task(Supervised("worker-cancel", functools.partial(self._cancel_loop, redis))
                                   .run(drained))
                if self.residency is not None:
                    tg.create_task(self._swapper.residency_loop())
                    tg.create_task(Supervised("worker-demand", functools.partial(self._swapper.demand_loop, redis))
                                   .run(drained))
        finally:
            await self._membership.close()
            await producer.stop()
            await redis.aclose()
            await replies_redis.aclose()
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._swapper.close()
            log.info("worker %s stopped", s.worker_id)

    # -- dispatch ----------------------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        drain_until: float | None = None
        feeds = list(self.feeds.values())
        self._dispatching = True
        while True:
            self._signals.wake.clear()
            now = time.monotonic()
            self._dispatch(now)
            if self._signals.stopping.is_set():
                drain_until = drain_until or now + self.settings.drain_timeout_s
                busy = bool(self._computing) or any(feed.core.has_work() for feed in feeds)
                if not busy or now >= drain_until:
                    queued = sum(feed.core.buffered() for feed in feeds)
                    if queued:
                        log.warning("drain timeout: %d requests left for redelivery", queued)
                    self._dispatching = False
                    break
            idle = self._slot_free()
            wakes = [w for feed in feeds if (w := feed.core.wake_at(now, idle)) is not None]
            if drain_until is not None:
                wakes.append(drain_until)
            timeout = max(0.0, min(wakes) - now) if wakes else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._signals.wake.wait(), timeout)
        if self._computing:
            await asyncio.gather(*self._computing)
        while self._publishing:
            await asyncio.gather(*list(self._publishing))
        self._signals.drained.set()
        self._signals.commit.set()

    def _dispatch(self, now: float) -> None:
        """Refuse what can no longer be served in time, then start work on every free executor."""
        idle = self._slot_free()
        free_at = now if idle else max(now, min(self._computing.values()))
        for feed in self.feeds.values():
            if shed := feed.core.shed(now, free_at):
                self._reply(feed, shed)
        if idle:
            self._start_next(now)

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
            if plan.work is not None:  # on the executor now; a task awaits it
                started = time.monotonic()
                call = asyncio.get_running_loop().run_in_executor(self._executor, plan.work.call)
                feed.running += 1
                task = self._spawn(self._run(feed, plan.work, call, started))
                self._computing[task] = now + plan.work.predicted_s
                continue
            ready.discard(name)  # nothing to start (a naive window holding back, or only evictions)

    async def _run(self, feed: Feed, work: Work, call: asyncio.Future[Any], started: float) -> None:
        """``work`` runs on the executor since ``started`` (``call``): answer it, and start what is next."""
        try:
            value = await call
            error = None
        except Exception as exc:  # the core answers the requests of the failed work with errors
            log.exception("%s: model call failed", feed.name)
            value, error = None, exc
        finally:
            feed.running -= 1
        took = time.monotonic() - started
        self._fair.charge(feed.name, took)
        replies = feed.core.complete(work, Outcome(value, error, started, took))
        self._membership.ran(feed)
        task = asyncio.current_task()
        if task is not None:
            self._computing.pop(task, None)
        if self._dispatching:  # the executor's next work starts now, before these replies go out
            self._dispatch(time.monotonic())
        self._signals.wake.set()
        if replies:
            self._reply(feed, replies)

    # -- replies and commits -----------------------------------------------------------------

    def _reply(self, feed: Feed, replies: list[Outgoing]) -> None:
        self._spawn_tracked(self._publish(feed, replies))

    def _spawn_tracked(self, coro: Coroutine[Any, Any, None]) -> None:
        """A publishing task: the drain waits for every one of them before the final commit."""
        task = self._spawn(coro)
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def _publish(self, feed: Feed, replies: list[Outgoing]) -> None:
        assert self._sink is not None
        spans: list[Span] = []
        if self._tracing:
            try:
                replies, spans = self._traced(feed, replies)
            except Exception:  # tracing never holds a reply back
                log.exception("%s: tracing %d replies failed; sent untraced", feed.name, len(replies))
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
        for span in spans:
            span.end()
        done: Counter[tuple[Priority, Status]] = Counter()
        tracker = feed.tracker
        for o in replies:
            if o.terminal:  # a stream's offset is done with its last chunk
                tracker.done(o.job.partition, o.job.offset)
                done[o.job.request.priority, o.message.status or Status.OK] += 1
        self.observer.replied(feed.name, done)
        self._signals.commit.set()
        self._signals.settled.set()

    @staticmethod
    def _traced(feed: Feed, replies: list[Outgoing]) -> tuple[list[Outgoing], list[Span]]:
        """The worker's spans of the traced requests among ``replies`` (``topics.tracing``): their batch
        wait and compute, and their batch's, from their timings; and a ``reply`` span each, started now,
        whose ``traceparent`` the reply carries. Returns the replies to send and the spans to end once out."""
        mono, wall = time.monotonic(), time.time_ns()
        ran: list[tracing.Ran] = []
        spans: list[Span] = []
        out: list[Outgoing] = []
        for o in replies:
            job, message = o.job, o.message
            if job.trace is None or not o.terminal:
                out.append(o)
                continue
            if isinstance(message, Result) and message.timings.compute_ms > 0:
                fetched = tracing.wall_ns(job.fetched, mono, wall)
                started = fetched + int(message.timings.batch_wait_ms * 1e6)
                ran.append(tracing.Ran(job.trace, job.request.id, fetched, started,
                                       started + int(message.timings.compute_ms * 1e6),
                                       message.timings.batch_size, message.tokens))
            span = tracing.reply_span(job.trace, job.request.id, (message.status or Status.OK).value)
            if span is None:
                out.append(o)
                continue
            spans.append(span)
            carried = tracing.format_traceparent(span.get_span_context())
            out.append(dataclasses.replace(o, message=msgspec.structs.replace(message, trace=carried)))
        tracing.batch(feed.name, ran)
        return out, spans

    async def _cancel_loop(self, redis: aioredis.Redis) -> None:
        """Cancel notes (best effort): a stream whose client went away frees its slot at the next step; the
        queued copies of a hedged request answered elsewhere leave unrun, their offsets done."""
        async for data in subscribed(redis, CANCEL_CHANNEL, self._signals.drained):
            try:
                note = CancelNote.unpack(data)
            except MalformedRecord as exc:
                refused("worker-cancel", exc)
                continue
            feed = self.feeds.get(note.model)
            if feed is None:
                continue
            dropped = feed.core.cancel(note.id, note.mac, time.monotonic())
            for job in dropped:  # left unrun: nobody waits for their replies
                feed.tracker.done(job.partition, job.offset)
            if dropped:
                self._signals.commit.set()
            self._signals.wake.set()

    async def _commit_loop(self) -> None:
        """Commit what is done, coalesced: at most one round every ``commit_interval_ms``."""
        interval_s = self.settings.commit_interval_ms / 1000.0
        last = 0.0
        while True:
            await self._signals.commit.wait()
            wait_s = last + interval_s - time.monotonic()
            careful = any(feed.guard.awaiting_commit() for feed in self.feeds.values())  # its next record waits
            if wait_s > 0 and not self._signals.drained.is_set() and not careful:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._signals.drained.wait(), wait_s)
            self._signals.commit.clear()
            for feed in self.feeds.values():
                await self._commit(feed, handing=self._signals.drained.is_set())
            last = time.monotonic()
            if self._signals.drained.is_set():
                return

    async def _commit(self, feed: Feed, handing: bool = False) -> None:
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
            # A rebalance took the partitions away (their new owner re-answers from the last commit), or
            # the group's coordinator is moving. Either way, try again soon: with no reply to come, an idle
            # model's answered records would otherwise stay uncommitted (lag, and answered again after a
            # restart) until its next request.
            log.warning("%s: commit of %s failed: %s", feed.name, positions, exc)
            asyncio.get_running_loop().call_later(COMMIT_RETRY_S, self._signals.commit.set)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        assert self._tg is not None
        return self._tg.create_task(coro)



__all__ = ["Worker", "WorkerSettings"]
