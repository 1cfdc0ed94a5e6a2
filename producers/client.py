"""The client library: publish a request to Kafka, await its result over Redis pub/sub.

    async with Client(bootstrap="127.0.0.1:9092", redis_url="redis://127.0.0.1:6379/0") as client:
        result = await client.infer("minilm", ["a sentence"], priority=Priority.P0, deadline_ms=500)
        vector = result.outputs[0]

``infer`` returns a ``Result`` with status ok, or raises a typed ``KinferError`` (see
``topics.errors``): ``InvalidRequest``/``UnknownModel`` before anything is sent,
``Unavailable`` when Kafka refuses the request, ``DeadlineExceeded`` when no result came in time,
and the error matching a non-ok result status otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import TracebackType
from typing import Any, Literal

import msgspec
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from kinfer.producers import metrics
from kinfer.producers.admission import AdaptiveThrottle, SendLog, health_decision, wait_with_sends
from kinfer.producers.health import HealthWatch
from kinfer.producers.hedging import HedgePolicy, Hedger
from kinfer.producers.replies import ReplyMux
from kinfer.topics import (
    DEFAULT_LIMITS,
    Chunk,
    ColdStart,
    DeadlineExceeded,
    InvalidRequest,
    KinferError,
    Limits,
    Overloaded,
    Priority,
    Request,
    Result,
    Status,
    Turn,
    Unavailable,
    UnknownModel,
    decode_request,
    new_request_id,
    now_ms,
    pack,
    tracing,
)
from kinfer.topics.auth import Signer, cancel_mac, signer_from_env
from kinfer.topics.cancel import CancelNote
from kinfer.topics.connect import KafkaAuth
from kinfer.topics.health import HealthState
from kinfer.topics.names import CANCEL_CHANNEL, DEFAULT_REPLY_TOPIC, redis_reply_channel, request_topic, served_models
from kinfer.topics.residency import DEMAND_CHANNEL
from kinfer.topics.residency import Demand as DemandNote

log = logging.getLogger(__name__)

# A model found missing is answered from memory this long: a caller retrying an unknown model (or
# a fuzzer) costs one metadata round trip per second, not one per request.
MISSING_TOPIC_TTL_S = 1.0
NOTE_TIMEOUT_S = 1.0  # a cancel note Redis has not taken by then is given up on


@dataclass(frozen=True, slots=True)
class ClientSettings:
    bootstrap: str  # Kafka bootstrap servers
    redis_url: str  # where replies arrive
    tenant: str = "default"  # who this client acts for
    default_deadline_ms: int = 30_000  # relative deadline when a call gives none
    reply_grace_ms: int = 250  # how long past the deadline to wait for an ``expired`` reply
    # Producer batching delay: a few milliseconds of latency buy one produce request for many
    # records instead of one each (the broker's cost is per request, not per record).
    linger_ms: int = 5
    reply_topic: str | None = DEFAULT_REPLY_TOPIC  # durable fallback when Redis is down (None: Redis only)
    reply_via: Literal["redis", "kafka"] = "redis"  # kafka: every reply over the reply topic (durable, slower)
    admission: bool = True  # obey the health signal and throttle adaptively before enqueueing
    limits: Limits = DEFAULT_LIMITS
    # A request unanswered at the model's recent p99 goes once more to another partition; partitions
    # that stopped answering are skipped (``producers.hedging``). ``HedgePolicy(enabled=False)``: never.
    hedging: HedgePolicy = field(default_factory=HedgePolicy)
    # Signs each request for its tenant (a deployment whose workers check signatures refuses
    # unsigned ones). Default: from the environment (KINFER_TENANT_KEY, or KINFER_SIGNING_SECRET).
    signer: Signer | None = None

    def __repr__(self) -> str:  # never print credentials embedded in a URL
        redis = self.redis_url.split("@")[-1]
        return f"ClientSettings(bootstrap={self.bootstrap!r}, redis=...{redis!r}, tenant={self.tenant!r})"


def _turn(message: Turn | Mapping[str, str]) -> Turn:
    if isinstance(message, Turn):
        return message
    try:
        return msgspec.convert(message, Turn)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"not a chat message (role: system, user or assistant; content): {exc}",
                             "messages") from exc


def _retrieve(task: asyncio.Future[Any]) -> None:
    """A send task's outcome is read by whoever waits for it, or by nobody (a hedge that lost): never
    "exception never retrieved"."""
    if not task.cancelled():
        task.exception()


def _unavailable(topic: str, error: KafkaError) -> Unavailable:
    return Unavailable(f"publishing to {topic} failed: {error}")


class InFlight:
    """One request in flight: its copies on the broker and its one timer, driven by callbacks
    (``Client._exchange``).

    The timer is the request's clock: it fires at the hedge delay after the last copy (or, put off,
    twice as long each time) and asks the client for another copy, and at the deadline it ends the
    wait, whichever comes first; a request that is answered before its hedge delay costs one timer,
    armed once and cancelled once. Each copy's delivery (the broker's acknowledgement) is a callback:
    when every copy sent was refused and none taken, the refusal fails the reply's future, which is
    the answer. The first copy is handed to the producer by the caller itself (``Client._exchange``;
    no task); a hedge's copy by a task of its own, called off when the request ends. A hedgeable
    request is listed under the partition its last copy waits on (``Client._waiting``), so that the
    partition turning suspect hurries it. Each copy's delivery also tells the partition board that the
    broker took (or dropped) a write there.
    """

    __slots__ = ("_acked_at", "_client", "_deadline", "_delay", "_hedge_at", "_loop", "_on", "_partitions",
                 "_put_off", "_timer", "_wait", "accepted", "called_off", "data", "expired", "handing", "headers",
                 "refusal", "request", "sends", "sent", "taken", "topic", "waiter")

    def __init__(self, client: Client, topic: str, data: bytes, request: Request,
                 headers: list[tuple[str, bytes]] | None) -> None:
        self._client, self.topic, self.data, self.request, self.headers = client, topic, data, request, headers
        self._loop = asyncio.get_running_loop()
        self._deadline = self._loop.time() + max(0.0, client._remaining_s(request))  # on the loop's clock
        self._partitions: list[int] | None = None
        self._delay: float | None = None  # the hedge delay (None: not hedged)
        self._wait: float | None = None  # until the next look for a hedge (doubles while put off)
        self._hedge_at: float | None = None  # when that is, on the loop's clock
        self._put_off = False  # a hedge was due with nowhere better to go
        self._acked_at: float | None = None  # when the broker last took a copy (the loop's clock)
        self._timer: asyncio.Handle | None = None
        self._on: tuple[str, int] | None = None  # where it is listed in the client's ``_waiting``
        self.waiter: asyncio.Future[Result] = client._replies.expect(
            request.id, self.ask_again if request.reply.redis is not None else None)
        self.sends: set[asyncio.Future[Any]] = set()  # copies the broker has not answered yet
        self.sent: list[tuple[int | None, float]] = []  # where each copy went, and when
        self.accepted = False  # the broker took a copy
        self.taken = 0  # the partitions where it took one, a bit each
        self.expired = False  # the deadline passed unanswered
        self.handing: asyncio.Task[Any] | None = None  # the caller, while it hands the first copy over
        self.called_off = False  # that hand-over was cancelled from here (the deadline, or answered meanwhile)
        self.refusal: BaseException | None = None  # the first copy the broker refused

    def hedge_with(self, partitions: list[int], delay: float | None) -> None:
        """Hedge this request over ``partitions``, a copy after ``delay`` unanswered (None: not hedged)."""
        self._partitions, self._delay, self._wait = partitions, delay, delay

    def sending(self, partition: int | None, now: float) -> None:
        """One more copy goes to ``partition`` now: the clock set for its hedge (and the deadline)."""
        self.sent.append((partition, now))
        if self._wait is not None:
            self._hedge_at = self._loop.time() + self._wait
            if partition is not None:
                self._list((self.topic, partition))
        self._arm()

    def track(self, delivery: asyncio.Future[Any], partition: int | None) -> None:
        """A copy handed over for ``partition``: its delivery, or the task still handing it over, told to
        ``_done`` (and the partition board told it waits on the broker)."""
        self.sends.add(delivery)
        if partition is not None:
            self._client._hedger.board.handed(self.topic, partition, time.monotonic())
        delivery.add_done_callback(partial(self._done, partition))

    def refused(self, error: BaseException) -> None:
        """A copy the producer would not take (or the broker refused)."""
        if isinstance(error, KafkaError):
            error = _unavailable(self.topic, error)
        self.refusal = self.refusal or error
        if not self.sends and self.handing is None and not self.accepted and not self.waiter.done():
            self.waiter.set_exception(self.refusal)  # a KinferError: raised to the caller as it is

    def ask_again(self) -> None:
        """Publish the request once more, byte for byte: its Redis reply channel was lost before it was
        answered (``ReplyMux``)."""
        self._client._send_again(self.topic, self.data, self.request, self.headers)

    def _list(self, on: tuple[str, int] | None) -> None:
        waiting = self._client._waiting
        if self._on is not None:
            was = waiting[self._on]
            was.discard(self)
            if not was:
                del waiting[self._on]
        self._on = on
        if on is not None:
            now = waiting.get(on)
            if now is None:
                now = waiting[on] = set()
            now.add(self)

    def hurry(self) -> None:
        """Its partition was found stalled by another request: look for a hedge now, not at the delay (and
        not a delay after the broker took its copy: that partition's consumer has had its chance)."""
        if self._timer is not None and self._wait is not None and not self.waiter.done():
            self._timer.cancel()
            self._hedge_at = self._loop.time()
            self._timer = self._loop.call_soon(self._due, True)

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        at = self._deadline if self._hedge_at is None else min(self._hedge_at, self._deadline)
        self._timer = self._loop.call_at(at, self._due)

    def _done(self, partition: int | None, delivery: asyncio.Future[Any]) -> None:
        self.sends.discard(delivery)
        cancelled = delivery.cancelled()
        error = None if cancelled else delivery.exception()
        taken = not cancelled and error is None
        now = time.monotonic()  # the loop's clock (``BaseEventLoop.time``)
        if partition is not None:
            self._client._hedger.board.acknowledged(self.topic, partition, now, taken)
        if taken:
            self.accepted = True
            self._acked_at = now
            if partition is not None:
                self.taken |= 1 << partition
        elif error is not None:
            self.refused(error)

    def _due(self, hurried: bool = False) -> None:
        """The deadline passed, or the last copy went unanswered for the hedge delay (its partition is
        suspect: a copy elsewhere), or another request found its partition stalled (``hurried``)."""
        self._timer = None
        if self.waiter.done():
            return
        now = self._loop.time()
        if now >= self._deadline:
            self.expired = True
            if self.handing is not None:  # still handing the first copy over: the broker did not take it
                self._call_off()
            else:
                self.waiter.set_exception(TimeoutError())
            return
        if self._hedge_at is not None and now >= self._hedge_at:
            assert self._delay is not None and self._wait is not None and self._partitions
            if not hurried and self._acked_at is not None and now < self._acked_at + self._delay:
                # The broker took a copy less than a hedge delay ago (it held it: a stall at the broker, or a
                # put-off look): its worker gets the hedge delay to answer it, as any copy does, before its
                # partition is suspected and another copy paid for.
                self._hedge_at = self._acked_at + self._delay
                self._arm()
                return
            waited, self._wait = self._wait, self._delay  # a copy sent now sets the clock at the delay
            hedged = self._client._hedge(self.topic, self.request, self._partitions, self)
            if hedged:
                if self.handing is not None and len(self.sent) == 2:  # the first copy is stuck in the producer
                    self.waiter.add_done_callback(self._over_while_handing)
                return  # the copy's ``sending`` set the clock
            if hedged is False:  # nowhere to go yet: look again, less often
                self._client._hedger.nowhere += not self._put_off  # once a request
                self._put_off, self._wait = True, waited * 2
                self._hedge_at = now + self._wait
            else:  # no more hedging for it; the deadline stands
                self._hedge_at = None
        self._arm()

    def _over_while_handing(self, waiter: asyncio.Future[Result]) -> None:
        """Answered through a hedge (or failed) while the first copy is still stuck in the producer: the
        caller stops handing it over and takes the answer."""
        if self.handing is not None:
            self._call_off()

    def _call_off(self) -> None:
        assert self.handing is not None
        self.called_off = True
        self.handing.cancel()

    def deadline_error(self) -> DeadlineExceeded:
        request = self.request
        if not self.accepted:
            return DeadlineExceeded(f"{request.model}/{request.id}: the broker did not take the request by its "
                                    "deadline", answered=False, accepted=False)
        return DeadlineExceeded(f"{request.model}/{request.id}: no reply by the deadline", answered=False)

    def close(self) -> None:
        """The request is over: no more hedges; copies still being handed to the broker are called off."""
        if self._timer is not None:
            self._timer.cancel()
        self._wait = self._hedge_at = None
        self._list(None)
        for send in self.sends:
            if isinstance(send, asyncio.Task):  # a delivery future is the producer's: it is sent anyway
                send.cancel()


class Client:
    def __init__(self, bootstrap: str, redis_url: str, **options: Any) -> None:
        if "signer" not in options:
            options["signer"] = signer_from_env()
        if "tenant" not in options and options["signer"] is not None:
            options["tenant"] = options["signer"].default_tenant or "default"
        self.settings = ClientSettings(bootstrap=bootstrap, redis_url=redis_url, **options)
        self.client_id = uuid.uuid4().hex[:16]
        auth = KafkaAuth.from_env()
        self._acl_hides_topics = auth.sasl  # a principal may not see the topics it may not use
        self._producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap,
            **auth.options(),
            acks="all",  # an acknowledged request is on every in-sync replica
            enable_idempotence=True,
            linger_ms=self.settings.linger_ms,
            max_batch_size=256 * 1024,
            client_id=f"kinfer-client-{self.client_id}",
        )
        self._redis = aioredis.Redis.from_url(redis_url)
        self._replies = ReplyMux(
            self._redis, redis_reply_channel(self.settings.tenant, self.client_id), self.settings.reply_topic,
            bootstrap,
            prefer_kafka=self.settings.reply_via == "kafka",
        )
        self._known_topics: set[str] = set()
        self._missing_topics: dict[str, float] = {}  # topic -> until when "unknown" is answered from memory
        self._looking_up: asyncio.Future[Any] | None = None  # the metadata round trip in progress, shared
        self._health = HealthWatch(self._redis)
        self._throttles: dict[str, AdaptiveThrottle] = {}
        self._sent: dict[str, SendLog] = {}
        self._answered: dict[str, SendLog] = {}  # per model: when this client's requests were answered
        self._service_ms: dict[str, float] = {}  # per model: compute time of the batches that served us
        self._admitted: dict[tuple[str, Priority], Any] = {}  # Prometheus children, resolved once
        self._outcomes = metrics.Outcomes()  # how requests ended, and how long the answered ones took
        self._demand_at: dict[str, float] = {}  # per cold model: when we last said it was wanted
        self._hedger = Hedger(self.settings.hedging)
        self._waiting: dict[tuple[str, int], set[InFlight]] = {}  # hedgeable requests by their last copy's partition
        self._background: set[asyncio.Task[None]] = set()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            try:
                await self._producer.start()
            except KafkaError as exc:
                raise Unavailable(f"Kafka at {self.settings.bootstrap} unreachable: {exc}") from exc
            await self._replies.start(await self._reply_partitions())
        except BaseException:
            with contextlib.suppress(Exception):  # a client that did not start leaves nothing open
                await self._producer.stop()
            raise
        if self.settings.admission:
            self._health.start()

    async def _reply_partitions(self) -> set[int] | None:
        topic = self.settings.reply_topic
        if topic is None:
            return None
        try:
            cluster = await self._producer.client.fetch_all_metadata()
        except KafkaError as exc:
            raise Unavailable(f"Kafka metadata unavailable: {exc}") from exc
        partitions = cluster.partitions_for_topic(topic) if topic in cluster.topics() else None
        if not partitions:
            log.warning("reply topic %s does not exist (kinfer topics creates it): replies over Redis only", topic)
        return partitions

    async def close(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._health.close()
        await self._replies.close()
        await self._producer.stop()
        with contextlib.suppress(RedisError):
            await self._redis.aclose()

    async def __aenter__(self) -> Client:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @property
    def duplicate_replies(self) -> int:
        """Replies dropped because their request was already answered (redelivery after a crash)."""
        return self._replies.duplicates

    @property
    def reply_channel(self) -> str:
        """The Redis channel this client's replies arrive on (``kinfer:reply:<tenant>:<client-id>``)."""
        return self._replies.channel

    @property
    def asked_again(self) -> int:
        """Requests published again because the Redis reply channel was lost and subscribed anew before
        they were answered (a reply published meanwhile may have reached nobody)."""
        return self._replies.asked_again

    @property
    def forged_replies(self) -> int:
        """Messages on this client's own Redis channel not sealed with its key: forged, dropped."""
        return self._replies.forged

    @property
    def refused_replies(self) -> dict[tuple[str, str], int]:
        """Messages the reply readers dropped, by (reader, reason): see ``topics.envelope.ReplyRefused``."""
        return dict(self._replies.refused)

    @property
    def redis_healthy(self) -> bool:
        """False while replies come over the Kafka reply topic because Redis is unreachable."""
        return self._replies.redis_healthy

    @property
    def replies_received(self) -> dict[str, int]:
        """Replies handed to callers, by the source they came from ("redis", "kafka")."""
        return dict(self._replies.received)

    def health(self, model: str) -> HealthState | None:
        """The model's latest health state as this client sees it (None: no fresh signal)."""
        return self._health.get(model)

    @property
    def unknown_replies(self) -> int:
        """Replies for request ids this client never sent, and other clients' sealed replies on a shared
        reply topic (not ours to open), dropped."""
        return self._replies.unknown

    @property
    def hedges(self) -> dict[str, float]:
        """Requests sent, hedges sent, refused for want of budget, requests whose hedge was put off because
        every other partition was suspect too (a stall of the whole topic: a broker everyone waits on; or
        one slow batch of the only live one), and hedges per request sent."""
        h = self._hedger
        return {"sent": h.sent, "hedged": h.budget.spent, "unpaid": h.budget.refused, "nowhere": h.nowhere,
                "fraction": h.fraction}

    @property
    def late_replies(self) -> int:
        """Replies dropped because their caller had already given up (deadline passed)."""
        return self._replies.late

    @property
    def late_reply_ids(self) -> set[str]:
        """The requests those late replies answered (the most recent 50,000): answered, too late."""
        return set(self._replies.late_ids)

    # -- calls -------------------------------------------------------------------------------

    async def infer(
        self,
        model: str,
        inputs: str | Sequence[str] = (),
        *,
        messages: Sequence[Turn | Mapping[str, str]] = (),
        priority: Priority | int = Priority.P1,
        deadline_ms: int | None = None,
        params: dict[str, Any] | None = None,
        request_id: str | None = None,
        tenant: str | None = None,
    ) -> Result:
        """Run ``inputs`` through ``model``; ``deadline_ms`` is relative to now.

        A generative model also takes a chat instead: ``messages``, each a ``Turn`` or a mapping with
        ``role`` (system, user, assistant) and ``content``, rendered by the worker with the model's
        own chat template; the one output answers the last turn.
        """
        started = time.monotonic()
        request, data, topic, headers = await self._prepare(
            model, inputs, priority, deadline_ms, params, request_id, False, tenant, messages
        )
        try:
            with tracing.request_span(request.model, request.id, request.priority):
                result = await self._call(request, data, topic, headers)
        except KinferError as exc:
            self._outcomes.failed(request.model, request.priority.label, exc)
            raise
        self._outcomes.ok(request.model, request.priority.label, time.monotonic() - started)
        return result

    async def _call(self, request: Request, data: bytes, topic: str, headers: list[tuple[str, bytes]] | None) -> Result:
        """Admit, publish and wait for one prepared request: its result, or the error it ended in."""
        model = request.model
        self._admit(request)
        try:
            result = await self._exchange(InFlight(self, topic, data, request, headers))
        finally:
            self._replies.forget(request.id)
        refused = result.status in (Status.SHED, Status.EXPIRED)
        self._throttle(model).record(time.monotonic(), accepted=not refused)
        if self.settings.admission:
            self._answered.setdefault(model, SendLog()).record(now_ms())
        if result.status is Status.OK and result.timings.compute_ms > 0:
            seen = self._service_ms.get(model, result.timings.compute_ms)
            self._service_ms[model] = seen + 0.1 * (result.timings.compute_ms - seen)
        return result.raise_for_status()

    async def infer_many(
        self,
        model: str,
        batch: Sequence[str | Sequence[str]],
        *,
        max_in_flight: int = 64,
        **options: Any,
    ) -> list[Result | KinferError]:
        """Pipelined ``infer`` over many requests, at most ``max_in_flight`` outstanding.

        Returns one outcome per request, in order: its ``Result``, or the ``KinferError`` it ended in
        (so one refusal does not hide the other answers).
        """
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        gate = asyncio.Semaphore(max_in_flight)

        async def one(inputs: str | Sequence[str]) -> Result | KinferError:
            async with gate:
                try:
                    return await self.infer(model, inputs, **options)
                except KinferError as exc:
                    return exc

        return list(await asyncio.gather(*(one(inputs) for inputs in batch)))

    async def stream(
        self,
        model: str,
        prompt: str | None = None,
        *,
        messages: Sequence[Turn | Mapping[str, str]] = (),
        priority: Priority | int = Priority.P1,
        deadline_ms: int | None = None,
        params: dict[str, Any] | None = None,
        request_id: str | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[Chunk]:
        """Generate from ``prompt`` (or a chat: ``messages``, as for ``infer``), yielding chunks in
        order, each once, the last one ``final``.

        Leaving the loop early cancels the generation (best effort, over Redis): the worker frees
        the sequence's slot and KV memory at its next step. Use ``contextlib.aclosing`` to make
        that happen at once rather than when the generator is collected.
        A stream that ends badly (deadline, refusal) raises the matching ``KinferError``.
        """
        request, data, topic, headers = await self._prepare(
            model, () if prompt is None else [prompt], priority, deadline_ms, params, request_id, True, tenant,
            messages,
        )
        self._admit(request)
        ask_again = partial(self._send_again, topic, data, request, headers) if request.reply.redis else None
        buffer = self._replies.open_stream(request.id, ask_again)
        try:
            await self._publish(topic, data, request, headers)
            while True:
                try:
                    chunk = await buffer.next(self._remaining_s(request))
                except TimeoutError as exc:
                    raise DeadlineExceeded(
                        f"{model}/{request.id}: stream stalled past the deadline", answered=False
                    ) from exc
                if chunk.seq == 0:
                    self._throttle(model).record(time.monotonic(), accepted=True)
                yield chunk.raise_for_status()
                if chunk.final:
                    return
        finally:
            self._replies.forget(request.id)
            if not buffer.finished:
                await self._cancel(model, request.id)

    async def _checked(self, request: Request) -> tuple[bytes, str, list[tuple[str, bytes]] | None]:
        """The request packed and checked as a worker checks it (fail here, not there), its topic (known to
        exist) and its signature headers."""
        data = pack(request)
        decode_request(data, self.settings.limits)
        topic = request_topic(request.model, request.priority)
        headers = self._sign(request, data)
        await self._check_topic(topic, request)
        return data, topic, headers

    def _sign(self, request: Request, data: bytes) -> list[tuple[str, bytes]] | None:
        """The signature headers for ``request`` when this client signs (else None)."""
        if self.settings.signer is None:
            return None
        try:
            return self.settings.signer.headers(request.tenant, data)
        except ValueError as exc:
            raise InvalidRequest(str(exc), "tenant") from exc

    async def submit(self, request: Request) -> None:
        """Publish a request whose reply goes where it says, to someone else (the Batch API's runner reads
        a batch's reply topic): the broker's acknowledgement is the whole answer. Checked as ``infer``
        checks its own; signed for its tenant when this client signs."""
        data, topic, headers = await self._checked(request)
        await self._publish(topic, data, request, headers)

    async def _prepare(
        self, model: str, inputs: str | Sequence[str], priority: Priority | int, deadline_ms: int | None,
        params: dict[str, Any] | None, request_id: str | None, stream: bool, tenant: str | None = None,
        messages: Sequence[Turn | Mapping[str, str]] = (),
    ) -> tuple[Request, bytes, str, list[tuple[str, bytes]] | None]:
        created = now_ms()
        request = Request(
            id=request_id or new_request_id(),
            model=model,
            priority=Priority(priority),
            tenant=tenant or self.settings.tenant,
            created_ms=created,
            deadline_ms=created + (deadline_ms or self.settings.default_deadline_ms),
            inputs=(inputs,) if isinstance(inputs, str) else tuple(inputs),
            reply=self._replies.route(),
            params=params or {},
            stream=stream,
            messages=tuple(map(_turn, messages)) if messages else (),
            batch_reply=True,  # our reply readers take several results in one message
            reply_key=self._replies.key,  # replies come sealed with it: a forged one is dropped
        )
        return (request, *await self._checked(request))

    def _throttle(self, model: str) -> AdaptiveThrottle:
        return self._throttles.setdefault(model, AdaptiveThrottle())

    def _admit(self, request: Request) -> None:
        """Refuse here, before enqueueing, what the system says it cannot serve in time."""
        if not self.settings.admission:
            return
        key = (request.model, request.priority)
        admitted = self._admitted.get(key)
        if admitted is None:  # every cause's series starts at zero: a first refusal shows in rate()
            admitted = self._admitted[key] = metrics.ADMITTED.labels(request.model, request.priority.label)
            for cause in metrics.REFUSAL_CAUSES:
                metrics.REFUSED.labels(request.model, request.priority.label, cause)
        if request.priority.background:  # deferred, never refused for load: it runs when capacity is idle
            admitted.inc()
            return
        health = self._health.get(request.model)
        sent = self._sent.setdefault(request.model, SendLog())
        now = now_ms()
        wait = None
        if health is not None:
            answered = self._answered.get(request.model)
            wait = wait_with_sends(health, request.priority, sent, now,
                                   answered.rate(now) if answered is not None else 0.0)
        decision = health_decision(health, request.priority, request.deadline_ms - now,
                                   service_ms=self._service_ms.get(request.model), wait_ms=wait)
        if decision.admit and request.priority > Priority.P0:  # interactive work is never throttled locally
            decision = self._throttle(request.model).decide(time.monotonic(), random.random())
        if not decision.admit:
            metrics.REFUSED.labels(request.model, request.priority.label, decision.cause).inc()
            if decision.cause == "cold":
                self._demand(request.model)
                raise ColdStart(decision.reason, decision.retry_after_s)
            level = health.level.name.lower() if health is not None else None
            raise Overloaded(f"{request.model}: {decision.reason}", decision.retry_after_s, level, decision.cause)
        admitted.inc()
        sent.record(now)

    async def _exchange(self, copies: InFlight) -> Result:
        """Publish the request and wait for its result, hedging it (``producers.hedging``).

        The request goes to a partition the board trusts. Unanswered at the
        model's recent p99 (counted from when the broker took it, when it took it late), it is published
        again (same id, same bytes) to another trusted partition, paid from the hedge budget, and the
        partition it waited on becomes suspect unless it answered something meanwhile or the broker still
        holds the copy (a stall at the broker, not at its consumer); either way the other requests waiting
        there are then hedged at once; so again, up to ``HedgePolicy.max_hedges`` copies.
        The first result wins; the others are dropped by id. A copy the broker refuses fails the call only
        when no copy was taken.

        The caller hands the first copy to the producer itself and then waits on its reply's future
        alone; the broker's acknowledgements, the hedge's moment and the deadline are callbacks on
        ``copies`` (one timer), so a request that is never hedged costs no task and one timer.
        """
        request, topic, hedger = copies.request, copies.topic, self._hedger
        partitions = self._partitions(topic)
        sent_at = time.monotonic()
        first = hedger.board.pick(topic, partitions, sent_at) if partitions else None
        hedger.sent_one(sent_at)
        # Background work waits for idle capacity by design: a copy would only wait as well.
        if partitions and len(partitions) > 1 and not request.priority.background:
            copies.hedge_with(partitions, hedger.delay_s(request.model, (request.deadline_ms - now_ms()) / 1000.0))
        copies.sending(first, sent_at)
        try:
            await self._hand_first(copies, first)
            result = await copies.waiter
        except TimeoutError as exc:  # the deadline (a refusal is raised as it is)
            raise copies.deadline_error() from exc
        finally:
            copies.close()
        now = time.monotonic()
        if len(copies.sent) == 1:
            if first is not None:
                hedger.board.answered(topic, first, now)
        else:  # hedged: the other copies, wherever they wait, are dropped unrun (a cancel note, best effort)
            self._in_background(self._cancel(request.model, request.id), self._background)
        if result.status is Status.OK and not request.priority.background:
            hedger.observe(request.model, now - sent_at)
        return result

    async def _hand_first(self, copies: InFlight, partition: int | None) -> None:
        """Hand the first copy to the producer in the caller's own task (the producer takes it at once
        unless its buffer for the partition is full, or the topic's metadata is missing); its delivery is
        tracked by ``copies``. The request's deadline, passing meanwhile, cancels the hand-over."""
        task = asyncio.current_task()
        assert task is not None
        copies.handing = task
        try:
            delivery = await self._hand(copies.topic, copies.data, copies.request, copies.headers, partition)
        except asyncio.CancelledError:
            if copies.called_off and task.uncancel() == 0:  # called off by the request, not by the caller
                if copies.expired:
                    raise copies.deadline_error() from None
                return  # answered meanwhile: the reply's future holds it
            raise
        except KafkaError as exc:
            copies.handing = None  # first: a refusal fails the call only when no copy is left
            copies.refused(exc)
            return
        finally:
            copies.handing = None
        copies.track(delivery, partition)

    def _hedge(self, topic: str, request: Request, partitions: list[int], copies: InFlight) -> bool | None:
        """The request's last copy went unanswered for the hedge delay: suspect its partition, and send
        one more copy where it can help and the budget pays. True: a copy was sent; False: every other
        partition is suspect too, and the caller looks again later, each time twice as long after (a
        partition that was only slow, a busy box's long batch, answers meanwhile and is trusted again; a
        whole topic that waits costs a few wake-ups a request); None: no more hedging for it."""
        hedger, now = self._hedger, time.monotonic()
        last, last_at = copies.sent[-1]
        assert last is not None
        taken = bool(copies.taken >> last & 1)  # else the broker still holds the copy
        # Newly suspect, or its writes newly seen stalled: what else waits there, hedge now too.
        if hedger.board.hedged(topic, last, last_at, now, taken=taken):
            for other in list(self._waiting.get((topic, last), ())):
                if other is not copies:
                    other.hurry()
        if len(copies.sent) > hedger.policy.max_hedges:
            return None
        target = hedger.board.trusted(topic, partitions, avoid=[p for p, _ in copies.sent if p is not None],
                                      since=last_at)
        if target is None:  # every other partition has stopped too (a copy would wait as well), or seems to
            return False
        # A request stranded on a suspect partition, or on one whose writes stall, may spend the whole bucket;
        # one that is only slow where others are answered (the tail), only the top of it: the bucket's floor
        # less the reserve kept for the stranded. What the bucket holds beyond its floor (a busy client's
        # second of traffic) is for the stranded alone: spent on the tail, an overload's slow answers drew
        # thousands of hedges at once.
        stranded = hedger.board.suspect(topic, last) or (not taken and hedger.board.stalled(topic, last, last_at))
        keep = 0.0 if stranded else hedger.budget.burst - hedger.policy.tail_burst
        if not hedger.budget.spend(keep):
            metrics.HEDGES_UNPAID.labels(request.model).inc()
            return None
        metrics.HEDGES.labels(request.model).inc()
        copies.sending(target, now)
        copies.track(self._in_background(self._deliver(topic, copies.data, request, copies.headers, target), None),
                     target)
        return True

    def _send_again(self, topic: str, data: bytes, request: Request, headers: list[tuple[str, bytes]] | None) -> None:
        """Publish ``request`` once more, byte for byte: its Redis reply channel was lost before it was
        answered (``ReplyMux``)."""
        self._in_background(self._publish(topic, data, request, headers), self._background)

    def _in_background(self, work: Coroutine[Any, Any, None],
                       keep: set[asyncio.Task[None]] | None) -> asyncio.Task[None]:
        """``work`` in a task of its own, kept in ``keep`` while it runs; its outcome retrieved whoever
        waits for it (never "exception never retrieved")."""
        task = asyncio.get_running_loop().create_task(work)
        task.add_done_callback(_retrieve)
        if keep is not None:
            keep.add(task)
            task.add_done_callback(keep.discard)
        return task

    def _partitions(self, topic: str) -> list[int] | None:
        """The topic's partitions that have a leader now (the producer's metadata), None when unknown."""
        available = self._producer.client.cluster.available_partitions_for_topic(topic)
        return sorted(available) if available else None

    async def _hand(self, topic: str, data: bytes, request: Request, headers: list[tuple[str, bytes]] | None,
                    partition: int | None) -> asyncio.Future[Any]:
        """Hand one copy to the producer: the future of the broker's acknowledgement. A traced copy's send
        span lasts until the broker took it: the acknowledgement is awaited here, within the span."""
        span = tracing.send_span(topic, request.id, partition, headers)
        with span as carried:
            delivery: asyncio.Future[Any] = await self._producer.send(topic, data, headers=carried, partition=partition)
            if span.span is not None:
                await delivery
        return delivery

    async def _deliver(self, topic: str, data: bytes, request: Request, headers: list[tuple[str, bytes]] | None,
                       partition: int | None = None) -> None:
        """One copy handed over and acknowledged by the broker; a broker error is ``Unavailable``."""
        try:
            await (await self._hand(topic, data, request, headers, partition))
        except KafkaError as exc:
            raise _unavailable(topic, exc) from exc

    async def _publish(self, topic: str, data: bytes, request: Request,
                       headers: list[tuple[str, bytes]] | None) -> None:
        """Hand the request to the broker, by its deadline whatever the broker does.

        A broker that is down or slow makes the call fail at the deadline (``DeadlineExceeded``, not
        answered), not at the producer's own 40 s request timeout. The record may still sit in the
        producer's buffer and reach the topic later; a worker then drops it unexecuted (its deadline
        has passed) and the expired reply finds nobody waiting.
        """
        try:
            async with asyncio.timeout(max(0.0, self._remaining_s(request))):
                await self._deliver(topic, data, request, headers)
        except TimeoutError as exc:
            raise DeadlineExceeded(
                f"{request.model}/{request.id}: the broker did not take the request by its deadline",
                answered=False, accepted=False,
            ) from exc

    def _remaining_s(self, request: Request) -> float:
        return (request.deadline_ms - now_ms() + self.settings.reply_grace_ms) / 1000.0

    def _demand(self, model: str) -> None:
        """A request refused because the model is cold never reaches Kafka, where workers look for work:
        say on ``kinfer:demand`` that it was wanted (at most once a second per model), so one swaps it in."""
        now = time.monotonic()
        if now - self._demand_at.get(model, -math.inf) < 1.0:
            return
        self._demand_at[model] = now

        async def publish() -> None:
            with contextlib.suppress(RedisError, OSError):
                await self._redis.publish(DEMAND_CHANNEL, DemandNote(model).pack())

        self._in_background(publish(), self._background)

    async def _cancel(self, model: str, request_id: str) -> None:
        """Tell the workers this request needs no answer any more (``topics.cancel``); a Redis that does
        not take it within a second is given up on: the note only saves work."""
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            mac = cancel_mac(self._replies.key, request_id)  # only the sender of a request may cancel it
            async with asyncio.timeout(NOTE_TIMEOUT_S):
                await self._redis.publish(CANCEL_CHANNEL, CancelNote(request_id, model, mac).pack())

    async def models(self) -> list[str]:
        """Models with request topics on the broker (what a worker could serve)."""
        try:
            cluster = await self._producer.client.fetch_all_metadata()
        except KafkaError as exc:
            raise Unavailable(f"Kafka metadata unavailable: {exc}") from exc
        return served_models(cluster.topics())

    async def ping(self) -> dict[str, bool]:
        """Whether Kafka and Redis answer now, and the reply readers and the health watch run (for
        readiness probes; without the watch, admission runs on adaptive throttling alone)."""
        status = {"kafka": True, "redis": True, "replies": self._replies.reading,
                  "health": self._health.up or not self.settings.admission}
        try:
            await asyncio.wait_for(self._producer.client.fetch_all_metadata(), 2.0)
        except (KafkaError, TimeoutError):
            status["kafka"] = False
        try:
            await asyncio.wait_for(self._redis.ping(), 2.0)
        except (RedisError, OSError, TimeoutError):
            status["redis"] = False
        return status

    def _not_served(self, topic: str, model: str) -> str:
        if self._acl_hides_topics:
            return f"no topic {topic} visible: model {model!r} is not served, or not at this priority for this tenant"
        return f"no topic {topic}: model {model!r} is not served"

    def _metadata(self) -> asyncio.Future[Any]:
        """The cluster's metadata, one round trip for every caller that asks while it is on its way: a
        burst of first requests to a topic (a batch submitted at once) asks the broker once, not once each."""
        if self._looking_up is None or self._looking_up.done():
            self._looking_up = asyncio.ensure_future(self._producer.client.fetch_all_metadata())
            self._looking_up.add_done_callback(_retrieve)
        return self._looking_up

    async def _check_topic(self, topic: str, request: Request) -> None:
        if topic in self._known_topics:  # the hot path: nothing else to do
            return
        model = request.model
        timeout_s = min(5.0, max(0.0, self._remaining_s(request)))  # never past the caller's deadline
        if self._missing_topics.get(topic, 0.0) > time.monotonic():  # asked a moment ago: still unknown
            raise UnknownModel(self._not_served(topic, model), "model")
        try:  # one metadata round trip; the broker never creates request topics by itself
            cluster = await asyncio.wait_for(asyncio.shield(self._metadata()), timeout_s)
        except (KafkaError, TimeoutError) as exc:
            raise Unavailable(f"Kafka metadata unavailable: {exc}") from exc
        if topic not in cluster.topics():
            now = time.monotonic()
            if len(self._missing_topics) >= 1024:  # names from a fuzzer or a typo loop: keep the live ones
                self._missing_topics = {t: until for t, until in self._missing_topics.items() if until > now}
            self._missing_topics[topic] = now + MISSING_TOPIC_TTL_S
            raise UnknownModel(self._not_served(topic, model), "model")
        self._known_topics.add(topic)
        self._missing_topics.pop(topic, None)
