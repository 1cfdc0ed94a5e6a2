"""Each hosted model's place in its consumer group, and what it fetches there. Kafka is the queue.

    join        a warm model's consumer subscribes to its topics (the consumer of its last residency
                is reused: its connections and metadata) and its fetch loop starts
    assigned    partitions come: the marks their last owner left (``consumers.poison``) are read before
                anything is fetched from them, and ours are left
    fetch loop  (per feed) getmany() → decode (bad records → DLQ + ``invalid``) → core.admit; pauses a
                priority's partitions when the buffer reaches its share (flow control)
    revoked     partitions go: what is done is committed with the mark that hands them over; the rest
                is their new owner's
    leave       a swap-out's first half: fetch nothing more, answer what is here, commit, leave the group

The worker around it (``consumers.worker``) owns the tasks, the commits and the model calls; it hands
``Membership`` what it needs of them as callables.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata

from kinfer.batcher.residency import Tier
from kinfer.consumers.cores import Job
from kinfer.consumers.feed import Feed, Signals
from kinfer.consumers.intake import read_record
from kinfer.consumers.observer import Observer
from kinfer.consumers.offsets import OffsetTracker
from kinfer.consumers.poison import CarefulToken, Verdict
from kinfer.consumers.replies import Delivery, ReplySink
from kinfer.consumers.settings import WorkerSettings
from kinfer.topics import InvalidRequest, Priority, Result, Status, Unavailable, now_ms, tracing
from kinfer.topics.auth import verifier_from_env
from kinfer.topics.backoff import Backoff
from kinfer.topics.connect import kafka_options
from kinfer.topics.envelope import salvage_route
from kinfer.topics.names import consumer_group, request_topics

log = logging.getLogger(__name__)

# How long a call beside the hot path may take: a refused record's dead letter, then its courtesy reply
# (the record is done without them after that: its partition's commits wait meanwhile), reading and
# writing the partitions' marks.
SIDE_CALL_TIMEOUT_S = 5.0

# The share of the in-process buffer each priority may fill before its partitions pause.
_BUFFER_SHARE = {Priority.P0: 1.0, Priority.P1: 0.75, Priority.P2: 0.5}

def leave_on_stop(consumer: AIOKafkaConsumer) -> None:
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


class Membership:
    """Joins, leaves and fetches for every feed of one worker; ``start`` before the first join."""

    def __init__(
        self,
        settings: WorkerSettings,
        feeds: dict[str, Feed],
        signals: Signals,
        observer: Observer,
        careful: CarefulToken,
        *,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
        spawn_tracked: Callable[[Coroutine[Any, Any, None]], None],
        commit: Callable[[Feed, bool], Awaitable[None]],
        computing: Callable[[], bool],
    ) -> None:
        """``spawn``: a task the worker keeps; ``spawn_tracked``: one its drain waits for; ``commit``:
        commit what a feed has done (``True``: with the mark that hands its partitions over);
        ``computing``: whether a model call is running."""
        self.settings = settings
        self.feeds = feeds
        self.signals = signals
        self.observer = observer
        self.careful = careful  # one careful record in flight in the whole worker, and it runs alone
        self._spawn = spawn
        self._spawn_tracked = spawn_tracked
        self._commit = commit
        self._computing = computing
        self._verifier = verifier_from_env(settings.tenants)
        self._sink: ReplySink | None = None
        self._admin: AIOKafkaAdminClient | None = None  # reads the marks of partitions it is assigned
        self._ready_logged = False
        self._tracing = False  # whether fetched records are traced (an SDK tracer provider is installed)

    async def start(self, sink: ReplySink) -> None:
        """Ready to join: ``sink`` takes dead letters and refusals."""
        self._sink = sink
        self._tracing = tracing.tracer() is not None
        self._admin = AIOKafkaAdminClient(**kafka_options(self.settings.bootstrap))
        await self._admin.start()

    async def close(self) -> None:
        """Every feed leaves its group; the admin client closes."""
        for feed in self.feeds.values():
            await self.stop(feed)
        if self._admin is not None:
            await self._admin.close()

    # -- joining and leaving -----------------------------------------------------------------

    async def join(self, feed: Feed, wait_s: float | None = None) -> None:
        """Become a member of the model's consumer group (the model is warm) and start fetching; with
        ``wait_s``, wait that long at most for the first partitions. The consumer of an earlier residency
        is reused (its connections and metadata): a swap-in is a join."""
        feed.lifecycle.join()
        consumer, feed.parked = feed.parked, None
        if consumer is None:
            consumer = await self._new_consumer(feed)
        feed.assigned.clear()
        consumer.subscribe(request_topics(feed.name), listener=_Rebalance(self, feed))
        feed.consumer = consumer
        feed.fetching = self._spawn(self._fetch_loop(feed))
        if wait_s is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(feed.assigned.wait(), wait_s)
        feed.lifecycle.joined()

    async def _new_consumer(self, feed: Feed) -> AIOKafkaConsumer:
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

    async def leave(self, feed: Feed) -> None:
        """Swap-out's first half: fetch nothing more, finish and answer what is here, commit, leave the
        group (the consumer is kept, out of the group, for the model's next swap-in)."""
        feed.lifecycle.leave()
        if feed.fetching is not None:
            await feed.fetching
        self.signals.wake.set()
        while feed.busy() and not self.signals.drained.is_set():
            self.signals.settled.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.signals.settled.wait(), 1.0)
        await self._commit(feed, True)
        consumer, feed.consumer = feed.consumer, None
        if consumer is not None and not self.signals.stopping.is_set():
            leave_on_stop(consumer)  # a static member would not send LeaveGroup
            consumer.unsubscribe()  # leaves the group: its partitions move at once
            feed.parked = consumer
        elif consumer is not None:
            feed.consumer = consumer  # stopping: the shutdown stops it
        feed.tracker = OffsetTracker()
        feed.guard.clear()
        feed.held, feed.fetching = set(), None
        feed.lifecycle.left()

    async def stop(self, feed: Feed) -> None:
        """Stop the feed's consumers, in the group or parked: the group's partitions move at once."""
        for consumer in (feed.consumer, feed.parked):
            if consumer is not None:
                with contextlib.suppress(KafkaError):
                    leave_on_stop(consumer)
                    await consumer.stop()  # leaves the group, so partitions move at once
        feed.consumer = feed.parked = None

    # -- rebalance ---------------------------------------------------------------------------

    async def on_assigned(self, feed: Feed, assigned: set[TopicPartition]) -> None:
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
        self.signals.wake.set()

    async def on_revoked(self, feed: Feed, revoked: set[TopicPartition]) -> None:
        await self._commit(feed, True)
        gone = feed.core.revoke(revoked)
        feed.tracker.forget(revoked)
        feed.guard.forget(revoked)
        if gone:
            log.info("%s: revoked %d partitions; %d requests left for the new owner", feed.name, len(revoked), gone)

    # -- fetch -------------------------------------------------------------------------------

    async def _fetch_loop(self, feed: Feed) -> None:
        consumer = feed.consumer
        assert consumer is not None
        backoff = Backoff()
        cap = self.settings.max_buffered_inputs
        while not self.signals.stopping.is_set() and not feed.lifecycle.leaving:
            self._flow_control(feed, consumer)
            # No more than the buffer has room for: a burst fetched whole would overshoot the bound by a
            # whole fetch, and a model asked to give up the device would first have to finish all of it.
            room = max(1, min(cap - feed.core.buffered(), self.settings.fetch_max_records))
            try:
                # A careful stretch waits on every record's commit with every partition paused: poll
                # often then, so the next record is fetched as soon as the token is free.
                poll_ms = 5 if feed.guard.careful_any() or self.careful.busy else 100
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
                self._take(feed, consumer, tp, records, now, wall)
            self.observer.buffered(feed.name, feed.core.buffered())
            self.signals.wake.set()

    def _take(self, feed: Feed, consumer: AIOKafkaConsumer, tp: TopicPartition,
              records: list[ConsumerRecord[bytes, bytes]], now: float, wall: int) -> None:
        """One partition's fetched records, in order, as the poison guard says (``consumers.poison``)."""
        priority = feed.priority(tp)
        background_room = feed.core.background_room() if priority.background else 0
        for record in records:
            if priority.background and feed.core.background_buffered() >= background_room:
                consumer.seek(tp, record.offset)  # held for its slices is enough: the rest stays on the broker
                break
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

    def _log_ready(self) -> None:
        warm = [feed for feed in self.feeds.values() if feed.tier == Tier.DEVICE]
        if all(feed.consumer and feed.consumer.assignment() for feed in warm):
            self._ready_logged = True
            log.info("worker %s ready: %s", self.settings.worker_id, ", ".join(self.feeds))

    def _intake(self, feed: Feed, tp: TopicPartition, priority: Priority, record: ConsumerRecord[bytes, bytes],
                now: float, wall: int) -> None:
        """A fetched record becomes a job in its core, or a dead letter (``consumers.intake``: total)."""
        value = record.value
        sink = self._sink
        try:
            request = read_record(value, record.headers, feed.name, priority, limits=self.settings.limits,
                                  verifier=self._verifier, topic_missing=sink.topics.known_missing if sink else None)
            queue_ms = max(0.0, wall - record.timestamp)
            traced = tracing.incoming(record.headers, tp.topic, tp.partition, record.offset, request.id,
                                      record.timestamp, time.time_ns()) if self._tracing else None
            job = Job(request, tp, record.offset, queue_ms, now, now + (request.deadline_ms - wall) / 1000.0, traced)
            self.observer.fetched(feed.name, request.priority, queue_ms / 1000.0)
            try:
                admitted = feed.core.admit(job, now)
            except InvalidRequest:
                raise
            except Exception as exc:  # a defect of the core or the runner: this record's refusal, not the end
                log.exception("%s: admitting %s@%d failed", feed.name, tp.topic, record.offset,
                              extra={"request_id": request.id, **tracing.log_ids(traced)})
                raise InvalidRequest(f"the model could not take it ({type(exc).__name__})", "message") from exc
            if not admitted:
                feed.tracker.done(tp, record.offset)  # a copy of a request in progress: that one answers
                self.signals.commit.set()
        except InvalidRequest as exc:
            self._spawn_tracked(self._reject(feed, tp, record.offset, value, exc))

    async def _marked_intake(self, feed: Feed, tp: TopicPartition, priority: Priority,
                             record: ConsumerRecord[bytes, bytes]) -> None:
        """A careful partition's record runs alone: once everything else in the worker is done (nothing
        is fetched meanwhile), its offset is committed with the IN_FLIGHT mark, then it is taken in. Should
        it stop this worker, the next owner finds the mark on it and dead-letters it unread."""
        while self._computing() or any(f.core.has_work() for f in self.feeds.values()):
            self.signals.settled.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.signals.settled.wait(), 0.5)
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
            self.signals.wake.set()

    def ran(self, feed: Feed) -> None:
        """Work of ``feed`` ended: a priority held back may have drained below its mark, resume it at
        once (the fetch loop may be waiting out its poll). Work ending only drains, so with nothing held
        there is nothing to do."""
        if feed.held and feed.consumer is not None and feed.fetching is not None and not feed.fetching.done():
            self._flow_control(feed, feed.consumer)

    def _flow_control(self, feed: Feed, consumer: AIOKafkaConsumer) -> None:
        """Kafka is the queue: the in-process buffer is bounded, with room kept for urgent work.

        Each priority may fetch until the buffer holds its share of ``max_buffered_inputs`` (p2
        half, p1 three quarters, p0 all of it), then its partitions pause until the buffer drains
        an eighth below that. So a flood of batch traffic never locks out an interactive request,
        and lower priorities stay visible to the batcher (which can refuse them explicitly) for as
        long as there is room.

        Background work (p3) is fetched while the core holds less than its ``background_room`` (what
        its next slices need), again once it has run down to half of that: fetching it never waits on
        the interactive load (the core runs it only from spare capacity), and the room bounds what a
        worker holds of it, records beyond it are left on the broker (``_take``).
        """
        cap = self.settings.max_buffered_inputs
        background = feed.core.background_buffered()
        buffered = feed.core.buffered() - background
        held = set(feed.held)
        draining = feed.lifecycle.draining  # its place on the device is wanted: everything pauses
        for prio, share in _BUFFER_SHARE.items():
            if buffered >= share * cap or draining:
                held.add(prio)
            elif buffered <= share * cap - cap / 8:
                held.discard(prio)
        room = feed.core.background_room()
        if draining or background >= room:
            held.add(Priority.P3)
        elif background <= room // 2:
            held.discard(Priority.P3)
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
        self, feed: Feed, tp: TopicPartition, offset: int, value: bytes | None, exc: InvalidRequest
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
        self.signals.commit.set()
        self.signals.settled.set()


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, membership: Membership, feed: Feed) -> None:
        self._membership = membership
        self._feed = feed

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._membership.on_revoked(self._feed, revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        log.info("%s: assigned %d partitions", self._feed.name, len(assigned))
        await self._membership.on_assigned(self._feed, assigned)
        self._feed.assigned.set()
