"""The versioned msgpack envelope: requests, results, stream chunks, and their limits.

Each record is a ``msgspec.Struct``: the class *is* the contract. Its fields (with their types and
``Meta`` constraints) say what a valid record holds, and the one codec below encodes and decodes
every record from them, validating in C while it decodes — no hand-written ``to_wire``/``unpack``
pairs to drift apart. Wire data becomes these objects once, here, and nowhere else.
``WIRE_FORMAT.md`` beside this file describes the same format for teams that never import kinfer.
"""

from __future__ import annotations

import enum
import math
import os
import re
import time
from dataclasses import dataclass
from itertools import count
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, NamedTuple, TypeVar

import msgpack
import msgspec

from kinfer.topics.auth import open_box, reply_authentic, seal_box
from kinfer.topics.errors import DeadlineExceeded, InvalidRequest, KinferError, MalformedRecord, ModelError, Shed
from kinfer.topics.names import (
    KAFKA_ROUTE_PATTERN,
    MODEL_PATTERN,
    REDIS_ROUTE_PATTERN,
    TENANT_PATTERN,
    Priority,
    exact,
)

ENVELOPE_VERSION: Final = 1

ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"

RequestId = Annotated[str, msgspec.Meta(pattern=exact(ID_PATTERN))]
ModelName = Annotated[str, msgspec.Meta(pattern=exact(MODEL_PATTERN))]
TenantName = Annotated[str, msgspec.Meta(pattern=exact(TENANT_PATTERN))]
RedisRoute = Annotated[str, msgspec.Meta(pattern=exact(REDIS_ROUTE_PATTERN))]  # kinfer:reply:...
KafkaRoute = Annotated[str, msgspec.Meta(pattern=exact(KAFKA_ROUTE_PATTERN))]  # replies....
# Wall-clock milliseconds since the epoch: positive, and exact in a float64 (any JSON reader's number).
EpochMs = Annotated[int, msgspec.Meta(gt=0, lt=2**53)]
Version = Literal[1]  # a reader of version 1 refuses any other (a missing ``v`` reads as 1)
Scalar = str | int | float | bool | None
ReplyKey = Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]


@dataclass(frozen=True, slots=True)
class Limits:
    """Upper bounds a request must respect; the worker enforces them before any allocation."""

    # The whole encoded request, checked before unpacking. Kafka's default limit (~1 MiB) counts the
    # batch and record overhead too, so a 1 MiB value is refused by the producer and the broker;
    # 1,000,000 bytes fits both with room for headers, and librdkafka's default as well.
    max_message_bytes: int = 1_000_000
    max_inputs: int = 256  # texts in one request
    max_text_chars: int = 16_384  # characters in one text
    max_params: int = 32  # keys in ``params``
    max_param_chars: int = 1_024  # length of one string-valued parameter, and of a parameter's name
    # The longest a request may ask to be worked on: ``deadline_ms - created_ms``. A record whose
    # deadline is far away would stay a live request (redelivered, retried, holding its partition's
    # commits) for as long; an hour covers any interactive call, a long generation included.
    max_deadline_span_ms: int = 3_600_000
    # The same for background requests (p3), whose deadline is a completion window: a day, as batch
    # APIs give. Such a record holds its partition's commits only while it is fetched, never longer
    # than one slice, because a worker fetches background work only when it can run it at once.
    max_background_span_ms: int = 86_400_000

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_inputs", "max_text_chars", "max_params", "max_param_chars",
                     "max_deadline_span_ms", "max_background_span_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Limits.{name} must be positive, got {getattr(self, name)}")


DEFAULT_LIMITS = Limits()


class Status(enum.StrEnum):
    """Terminal state of a request, carried by its result."""

    OK = "ok"  # outputs are valid
    ERROR = "error"  # the model failed on it
    EXPIRED = "expired"  # its deadline passed (or would pass) before compute
    SHED = "shed"  # dropped under overload
    INVALID = "invalid"  # it broke the contract (the worker could still read its id and route)


class RouteKind(enum.StrEnum):
    REDIS = "redis"  # Redis pub/sub channel: lowest latency, at-most-once
    KAFKA = "kafka"  # Kafka topic: durable, read by the client's reply consumer


class ReplyRoute(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Where the worker publishes the result: a Redis channel (with a Kafka fallback topic), or a topic."""

    # Each is held to its documented prefix, so a request can never make a worker publish anywhere
    # else (a health or demand channel, a request, stats or dead-letter topic, a changelog).
    redis: RedisRoute | None = None  # Redis pub/sub channel ``kinfer:reply:...``; ``kafka`` is its fallback
    kafka: KafkaRoute | None = None  # Kafka reply topic ``replies....``

    def __post_init__(self) -> None:
        if self.redis is None and self.kafka is None:
            raise ValueError("reply must name a 'redis' channel and/or a 'kafka' topic")

    @classmethod
    def channel(cls, name: str, fallback_topic: str | None = None) -> ReplyRoute:
        return cls(redis=name, kafka=fallback_topic)

    @classmethod
    def topic(cls, name: str) -> ReplyRoute:
        return cls(kafka=name)

    @property
    def kind(self) -> RouteKind:
        return RouteKind.REDIS if self.redis is not None else RouteKind.KAFKA

    @property
    def name(self) -> str:
        """The channel (REDIS) or topic (KAFKA) replies go to first."""
        return self.redis if self.redis is not None else self.kafka  # type: ignore[return-value]

    @property
    def fallback_topic(self) -> str | None:
        """With REDIS: the Kafka topic to use when Redis cannot deliver."""
        return self.kafka if self.redis is not None else None


class Turn(msgspec.Struct, frozen=True):
    """One message of a chat: the worker renders a request's turns with the model's chat template."""

    role: Literal["system", "user", "assistant"]
    content: str


class Request(msgspec.Struct, frozen=True, tag="req", tag_field="t"):
    """One inference request, as published to ``infer.<model>.<priority>``."""

    id: RequestId  # unique per request; the correlation key and the idempotency key
    model: ModelName  # served model name
    priority: Priority  # p0 interactive .. p2 batch; p3 background
    tenant: TenantName  # who asked; quotas and metrics are per tenant
    created_ms: EpochMs  # wall-clock ms when the client created it
    deadline_ms: EpochMs  # wall-clock ms after which a result is useless
    inputs: tuple[str, ...]  # texts to run; each yields one output (empty for a chat)
    reply: ReplyRoute  # where the result goes
    params: dict[str, Scalar] = {}  # model-specific knobs (scalars only)
    stream: bool = False  # whether the client wants stream chunks (generation)
    # The client reads ``t = "batch"`` replies: the worker may send several results for the same
    # reply channel in one message. Off by default, so a reader that predates batches never sees one.
    batch_reply: bool = False
    v: Version = ENVELOPE_VERSION
    # A key the client chose (random, per client): the worker seals every reply with it
    # (``t = "sealed"``), so the client can tell a worker's reply from a forged one. Absent: no seal.
    reply_key: ReplyKey | None = None
    # A chat (generative models): its turns in order, rendered by the worker with the model's own chat
    # template; ``inputs`` is then empty and the one output answers the last turn.
    messages: tuple[Turn, ...] = ()


class Timings(msgspec.Struct, frozen=True):
    """Where a request's time went inside the worker, in milliseconds."""

    queue_ms: float = 0.0  # from the Kafka record timestamp to being fetched by the worker
    batch_wait_ms: float = 0.0  # from fetched to its batch starting compute
    compute_ms: float = 0.0  # the batch's forward pass
    batch_size: int = 0  # inputs in the batch it ran in


_STATUS_ERRORS: dict[Status, type[KinferError]] = {
    Status.ERROR: ModelError,
    Status.EXPIRED: DeadlineExceeded,
    Status.SHED: Shed,
    Status.INVALID: InvalidRequest,
}


# One output of a model: a scalar, or containers of them at most three deep (an embedding is a list
# of floats; a classifier's output a map whose ``labels`` is a list of maps). The decoder holds a
# reply to this shape, so it never follows a structure deeper than a reply can be. To the type
# checker an output is ``Any``: which of these shapes it has depends on the model.
if TYPE_CHECKING:
    Output = Any
else:
    _Leaf = str | int | float | bool | None
    _Output1 = _Leaf | list[_Leaf] | dict[str, _Leaf]
    _Output2 = _Leaf | list[_Output1] | dict[str, _Output1]
    Output = _Leaf | list[_Output2] | dict[str, _Output2]


class Result(msgspec.Struct, frozen=True, tag="res", tag_field="t"):
    """The terminal reply to one request."""

    id: str  # the request's id
    model: str  # the model that answered
    status: Status  # terminal state
    outputs: list[Output] = []  # one per input when status is OK
    error: str | None = None  # human-readable reason when status is not OK
    timings: Timings = Timings()
    worker: str = ""  # which worker instance answered (for debugging redeliveries)
    v: Version = ENVELOPE_VERSION
    # Tokens the model's tokenizer made of the inputs (special tokens and truncation included), for
    # usage accounting; 0 where the model does not count them. Absent in older results: 0.
    tokens: int = 0
    field: str | None = None  # with ``invalid``: the part of the request at fault, when known
    # W3C traceparent of the worker's span that sent this reply, when the request was traced
    # (``topics.tracing``); the client's ``receive`` span hangs from it. A value that is not one is ignored.
    trace: Annotated[str, msgspec.Meta(max_length=512)] | None = None

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    def raise_for_status(self) -> Result:
        """Return self when ok; otherwise raise the typed error that matches the status."""
        if self.status is Status.OK:
            return self
        text = f"{self.model}/{self.id}: {self.status.value}: {self.error or 'no detail'}"
        if self.status is Status.INVALID:
            raise InvalidRequest(text, self.field)
        raise _STATUS_ERRORS[self.status](text)


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Chunk(msgspec.Struct, frozen=True, tag="chunk", tag_field="t"):
    """One piece of a streamed result (generation): sent in order of ``seq``, the last one ``final``."""

    id: str  # the request's id
    model: str
    seq: int  # 0, 1, 2, ... per request; a client reorders by it and drops repeats
    text: str = ""  # text that became final with this chunk
    tokens: list[int] = []  # token ids in this chunk
    final: bool = False  # the last chunk of the stream
    status: Status | None = None  # on the final chunk: how the stream ended
    finish: str | None = None  # on the final chunk: eos, length, stop, deadline, cancelled, ...
    usage: Usage = Usage()  # on the final chunk
    error: str | None = None
    worker: str = ""
    v: Version = ENVELOPE_VERSION
    trace: Annotated[str, msgspec.Meta(max_length=512)] | None = None  # as in a result, on a stream's final chunk

    @property
    def prompt_tokens(self) -> int:
        return self.usage.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return self.usage.completion_tokens

    def raise_for_status(self) -> Chunk:
        if self.status is None or self.status is Status.OK:
            return self
        error = _STATUS_ERRORS[self.status]
        raise error(f"{self.model}/{self.id}: {self.status.value}: {self.error or self.finish or 'no detail'}")


class ReplyBatch(msgspec.Struct, frozen=True, tag="batch", tag_field="t"):
    """Several replies for one reply channel in one message (only to requests with ``batch_reply``)."""

    replies: list[Result | Chunk]  # in the order the worker produced them
    v: Version = ENVELOPE_VERSION


SEAL_VERSION: Final = 2


class Sealed(msgspec.Struct, frozen=True, tag="sealed", tag_field="t"):
    """A reply message (result, chunk or batch), packed, then encrypted and authenticated under the
    request's ``reply_key`` (sent only to requests that carry one; ``auth.seal_box``)."""

    salt: bytes  # 16 random bytes: the reply's own key is derived from the reply key and this
    box: bytes  # ChaCha20-Poly1305 ciphertext of the packed message, then its 16-byte tag
    v: Literal[2] = SEAL_VERSION


Reply = Result | Chunk
Message = Request | Result | Chunk | ReplyBatch | Sealed


def now_ms() -> int:
    return time.time_ns() // 1_000_000


_ID_SEQ = count()


def _id_prefix() -> None:
    """A random prefix and the pid, drawn again in a forked child (which would otherwise repeat its
    parent's ids)."""
    global _ID_PREFIX
    _ID_PREFIX = f"{os.urandom(6).hex()}{os.getpid() & 0xFFFF:04x}"


_ID_PREFIX = ""
_id_prefix()
os.register_at_fork(after_in_child=_id_prefix)


def new_request_id() -> str:
    """Unique without a syscall: a random per-process prefix with the pid, and a counter (28 characters)."""
    return f"{_ID_PREFIX}{next(_ID_SEQ):012x}"


# ---------------------------------------------------------------------------------------------
# The codec: one encoder and one decoder per record type, all driven by the Structs above.

_encoder = msgspec.msgpack.Encoder()
_float32 = msgpack.Packer(use_bin_type=True, use_single_float=True, autoreset=True)
_PATH_RE = re.compile(r"at `\$\.(\w+)")
_MISSING_RE = re.compile(r"missing required field `(\w+)`")

M = TypeVar("M")


def pack(message: Message) -> bytes:
    """Encode for the wire; raises ``InvalidRequest`` for what msgpack cannot carry.

    Replies send floats as float32 (embeddings need no more, and halve in size); requests keep
    float64, so a parameter is never rounded or overflowed on its way.
    """
    try:
        if isinstance(message, Request):
            return _encoder.encode(message)
        data: bytes = _float32.pack(msgspec.to_builtins(message))
        return data
    except (ValueError, TypeError, OverflowError, UnicodeEncodeError, msgspec.EncodeError) as exc:
        raise InvalidRequest(f"cannot encode the message: {exc}", "message") from exc


def _field_of(exc: msgspec.MsgspecError) -> str:
    """The top-level field a validation error is about ("message" when it is the record itself)."""
    text = str(exc)
    match = _PATH_RE.search(text) or _MISSING_RE.search(text)
    return match.group(1) if match else "message"


def _decode(decoder: msgspec.msgpack.Decoder[M], data: bytes, max_bytes: int) -> M:
    """Decode with the record's own validation; ``InvalidRequest`` names the offending field.

    Total: whatever the bytes, a value or ``InvalidRequest``. The size is checked before anything is
    read; msgspec skips unknown keys without building them, but it recurses to do so, and nesting
    past the interpreter's recursion limit (~1,000 levels) raises ``RecursionError``: a refusal here.
    """
    if len(data) > max_bytes:
        raise InvalidRequest(f"message is {len(data)} bytes, over the limit of {max_bytes}", "message")
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        field = _field_of(exc)
        text = f"not a valid msgpack envelope: {exc}" if field == "message" else str(exc)
        raise InvalidRequest(text, field) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"not a valid msgpack envelope: {exc}", "message") from exc
    except RecursionError as exc:
        raise InvalidRequest("not a valid msgpack envelope: nested too deeply", "message") from exc


_requests = msgspec.msgpack.Decoder(Request)


def decode_request(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Request:
    """Decode and validate a request; raises ``InvalidRequest`` naming the offending field.

    Types, patterns and the version are checked by the decoder as it reads; the configurable
    ``limits`` right after (the record is already bounded by ``max_message_bytes``).
    """
    request = _decode(_requests, data, limits.max_message_bytes)
    if request.deadline_ms <= request.created_ms:
        raise InvalidRequest("need 0 < created_ms < deadline_ms", "deadline_ms")
    longest = limits.max_background_span_ms if request.priority is Priority.P3 else limits.max_deadline_span_ms
    if (span := request.deadline_ms - request.created_ms) > longest:
        raise InvalidRequest(f"deadline_ms is {span} ms after created_ms, over the limit of {longest}", "deadline_ms")
    if request.messages:
        if request.inputs:
            raise InvalidRequest("a chat carries its turns in messages, and no inputs", "inputs")
        contents = [m.content for m in request.messages]
        _check_texts(contents, "messages", limits)
        if (total := sum(map(len, contents))) > limits.max_text_chars:  # a chat becomes one prompt
            raise InvalidRequest(
                f"messages hold {total} characters together, over the limit of {limits.max_text_chars}", "messages"
            )
    else:
        _check_texts(request.inputs, "inputs", limits)
    params = request.params
    if params:
        if len(params) > limits.max_params:
            raise InvalidRequest(f"params must be a map of at most {limits.max_params} entries", "params")
        for key, value in params.items():
            if len(key) > limits.max_param_chars:
                raise InvalidRequest(f"a params name is longer than {limits.max_param_chars}", "params")
            if isinstance(value, str) and len(value) > limits.max_param_chars:
                raise InvalidRequest(f"params[{key!r}] is longer than {limits.max_param_chars}", "params")
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidRequest(f"params[{key!r}] must be a finite number, got {value}", "params")
    return request


def _check_texts(texts: tuple[str, ...] | list[str], field: str, limits: Limits) -> None:
    """1 to ``max_inputs`` texts (inputs, or a chat's turns), each within ``max_text_chars``."""
    if not texts:
        raise InvalidRequest(f"{field} must hold 1 to {limits.max_inputs} texts, got none", field)
    if len(texts) > limits.max_inputs:
        raise InvalidRequest(f"too many {field}: {len(texts)}, over the limit of {limits.max_inputs}", field)
    for i, text in enumerate(texts):
        if len(text) > limits.max_text_chars:
            raise InvalidRequest(
                f"{field}[{i}] has {len(text)} characters, over the limit of {limits.max_text_chars}", field
            )


class _Salvage(msgspec.Struct):
    id: RequestId
    reply: ReplyRoute
    reply_key: ReplyKey | None = None


_salvage = msgspec.msgpack.Decoder(_Salvage)


def salvage_route(data: bytes, limits: Limits = DEFAULT_LIMITS) -> tuple[str, ReplyRoute, bytes | None] | None:
    """Id, reply route and reply key of an invalid request, when the first two can still be read;
    never raises.

    Lets a worker tell the caller *why* its request was refused instead of leaving it to time out.
    """
    if len(data) > limits.max_message_bytes:
        return None
    try:
        found = _salvage.decode(data)
    except (msgspec.MsgspecError, RecursionError):
        return None
    return found.id, found.reply, found.reply_key


# ---------------------------------------------------------------------------------------------
# Reading replies: one total function for every reply message a reader takes in.

# A sealed message: nothing inside it is decoded before it opens, so this bounds bytes only (the
# ciphertext is read in place; what it opens to is no longer).
MAX_REPLY_BYTES = 64 * 1_048_576
# A plain message, which nothing authenticates (read only by a reader that holds no key): its
# structure is decoded as it comes, so it gets a request's bound.
MAX_PLAIN_REPLY_BYTES = 1_000_000

REFUSALS: Final = ("oversize", "malformed", "unsealed", "unopened")


class ReplyRefused(MalformedRecord):
    """A reply message a reader will not take; ``reason`` (one of ``REFUSALS``) says why:

    ``oversize``   over ``MAX_REPLY_BYTES`` (``MAX_PLAIN_REPLY_BYTES`` for one nothing authenticates)
    ``malformed``  not a reply message: not msgpack, the wrong shape or types, nested deeper than a
                   reply can be, a seal of an unknown version; or a seal that opened around one
    ``unsealed``   a plain reply, to a reader that holds a key (forged, or another client's)
    ``unopened``   a seal that does not open with the reader's key (another client's reply on a
                   shared topic; or forged, cut short or changed on its way)
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(f"reply refused ({reason}): {message}", "reply")
        self.reason = reason


class Opened(NamedTuple):
    """What one reply message held."""

    replies: list[Reply]  # in the order the worker produced them
    seal: int  # 2: encrypted; 1: the older HMAC seal (still read, never sent); 0: plain (reader without a key)


class _Envelope(msgspec.Struct):
    """A reply message's outer map, read without following anything inside it: a seal's fields are
    views into the message, and every other key (a plain reply's whole body) is skipped."""

    t: str = ""
    v: int = 1
    salt: memoryview | None = None  # seal v2
    box: memoryview | None = None
    mac: memoryview | None = None  # seal v1
    body: memoryview | None = None


_envelopes = msgspec.msgpack.Decoder(_Envelope)
_bodies = msgspec.msgpack.Decoder(Result | Chunk | ReplyBatch)
_PLAIN_TYPES = frozenset({"res", "chunk", "batch"})


def _total(decoder: msgspec.msgpack.Decoder[M], data: bytes | memoryview) -> M:
    """Decode, or refuse as ``malformed``: no other exception, whatever the bytes (msgspec follows
    nesting by recursion, so a deep enough message raises ``RecursionError``, caught here too)."""
    try:
        return decoder.decode(data)
    except (msgspec.MsgspecError, RecursionError, MemoryError) as exc:
        raise ReplyRefused(f"{type(exc).__name__}: {str(exc)[:200]}", "malformed") from exc


def seal(message: Result | Chunk | ReplyBatch, reply_key: bytes) -> bytes:
    """The message packed, then encrypted and authenticated for the holder of ``reply_key``."""
    salt, box = seal_box(reply_key, pack(message))
    return _encoder.encode(Sealed(salt, box))


def decode_replies(data: bytes, reply_key: bytes | None = None) -> Opened:
    """One reply message → the replies it holds; total: returns, or raises ``ReplyRefused`` (a
    ``MalformedRecord``), whatever ``data`` is.

    With ``reply_key`` (kinfer's client always has one) only a seal that opens with it is taken, in
    this order: the size, the outer map (a seal's fields, read in place; nothing else followed), the
    seal opened (authenticated and decrypted), and only then its body decoded against the reply
    types. Another client's reply on a shared topic is ``unopened``: a reader cannot tell it from a
    forgery, and cannot read it. Without a key (a reader that asked for plain replies), a plain
    message of at most ``MAX_PLAIN_REPLY_BYTES`` is decoded; a seal cannot be opened.
    """
    if reply_key is None:
        if len(data) > MAX_PLAIN_REPLY_BYTES:
            raise ReplyRefused(f"{len(data)} bytes, over {MAX_PLAIN_REPLY_BYTES} for a plain reply", "oversize")
        return Opened(_replies_of(_total(_bodies, data)), 0)
    if len(data) > MAX_REPLY_BYTES:
        raise ReplyRefused(f"{len(data)} bytes, over {MAX_REPLY_BYTES}", "oversize")
    envelope = _total(_envelopes, data)
    if envelope.t != "sealed":
        reason = "unsealed" if envelope.t in _PLAIN_TYPES else "malformed"
        raise ReplyRefused(f"a message of type {envelope.t[:16]!r}, not sealed", reason)
    body: bytes | memoryview | None
    if envelope.v == SEAL_VERSION and envelope.salt is not None and envelope.box is not None:
        body = open_box(reply_key, envelope.salt, envelope.box)
        version = SEAL_VERSION
    elif envelope.v == 1 and envelope.mac is not None and envelope.body is not None:
        body = envelope.body if reply_authentic(reply_key, envelope.body, envelope.mac) else None
        version = 1
    else:
        raise ReplyRefused(f"not a seal this reader knows (version {envelope.v})", "malformed")
    if body is None:
        raise ReplyRefused("sealed, but not with this reader's key", "unopened")
    return Opened(_replies_of(_total(_bodies, body)), version)


def _replies_of(message: Result | Chunk | ReplyBatch) -> list[Reply]:
    return message.replies if isinstance(message, ReplyBatch) else [message]


def decode_reply(data: bytes, reply_key: bytes | None = None) -> Reply:
    """Exactly one result or stream chunk (sealed with ``reply_key``, when given)."""
    replies = decode_replies(data, reply_key).replies
    if len(replies) != 1:
        raise ReplyRefused(f"expected one reply, got a batch of {len(replies)}", "malformed")
    return replies[0]


def decode_result(data: bytes, reply_key: bytes | None = None) -> Result:
    reply = decode_reply(data, reply_key)
    if not isinstance(reply, Result):
        raise ReplyRefused("expected a result, got a stream chunk", "malformed")
    return reply
