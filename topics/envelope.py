"""The versioned msgpack envelope: requests, results, and their limits.

Wire data becomes these dataclasses once, here, and nowhere else. ``WIRE_FORMAT.md`` beside this
file describes the same format for teams that never import kinfer; keep the two in step.
"""

from __future__ import annotations

import enum
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgpack

from topics.errors import DeadlineExceeded, InvalidRequest, KinferError, ModelError, Shed
from topics.names import Priority, valid_model_name, valid_route_name

ENVELOPE_VERSION = 1

_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_TENANT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True, slots=True)
class Limits:
    """Upper bounds a request must respect; the worker enforces them before any allocation."""

    max_message_bytes: int = 1_048_576  # whole encoded request, checked before unpacking
    max_inputs: int = 256  # texts in one request
    max_text_chars: int = 16_384  # characters in one text
    max_params: int = 32  # keys in ``params``
    max_param_chars: int = 1_024  # length of one string-valued parameter

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_inputs", "max_text_chars", "max_params", "max_param_chars"):
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


@dataclass(frozen=True, slots=True)
class ReplyRoute:
    """Where the worker publishes the result."""

    kind: RouteKind
    name: str  # channel name for REDIS, topic name for KAFKA
    fallback_topic: str | None = None  # with REDIS: the Kafka topic to use when Redis is unreachable

    def to_wire(self) -> dict[str, str]:
        wire = {self.kind.value: self.name}
        if self.fallback_topic is not None:
            wire["kafka"] = self.fallback_topic
        return wire

    @classmethod
    def from_wire(cls, value: Any) -> ReplyRoute:
        if not isinstance(value, dict) or not 1 <= len(value) <= 2 or not set(value) <= {"redis", "kafka"}:
            raise InvalidRequest("reply must be a map of 'redis' and/or 'kafka'", "reply")
        for name in value.values():
            if not isinstance(name, str) or not valid_route_name(name):
                raise InvalidRequest("reply names must be 1-128 characters of [A-Za-z0-9_.:-]", "reply")
        if "redis" in value:
            return cls(RouteKind.REDIS, value["redis"], value.get("kafka"))
        return cls(RouteKind.KAFKA, value["kafka"])


@dataclass(frozen=True, slots=True)
class Request:
    """One inference request, as published to ``infer.<model>.<priority>``."""

    id: str  # unique per request; the correlation key and the idempotency key
    model: str  # served model name
    priority: Priority  # p0 interactive .. p2 batch
    tenant: str  # who asked; quotas and metrics are per tenant
    created_ms: int  # wall-clock ms when the client created it
    deadline_ms: int  # wall-clock ms after which a result is useless
    inputs: tuple[str, ...]  # texts to run; each yields one output
    reply: ReplyRoute  # where the result goes
    params: dict[str, Any] = field(default_factory=dict)  # model-specific knobs (scalars only)
    stream: bool = False  # whether the client wants stream chunks (generation)

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": ENVELOPE_VERSION,
            "t": "req",
            "id": self.id,
            "model": self.model,
            "priority": int(self.priority),
            "tenant": self.tenant,
            "created_ms": self.created_ms,
            "deadline_ms": self.deadline_ms,
            "inputs": list(self.inputs),
            "params": self.params,
            "stream": self.stream,
            "reply": self.reply.to_wire(),
        }


@dataclass(frozen=True, slots=True)
class Timings:
    """Where a request's time went inside the worker, in milliseconds."""

    queue_ms: float = 0.0  # from the Kafka record timestamp to being fetched by the worker
    batch_wait_ms: float = 0.0  # from fetched to its batch starting compute
    compute_ms: float = 0.0  # the batch's forward pass
    batch_size: int = 0  # inputs in the batch it ran in

    def to_wire(self) -> dict[str, Any]:
        return {
            "queue_ms": self.queue_ms,
            "batch_wait_ms": self.batch_wait_ms,
            "compute_ms": self.compute_ms,
            "batch_size": self.batch_size,
        }


@dataclass(frozen=True, slots=True)
class Result:
    """The terminal reply to one request."""

    id: str  # the request's id
    model: str  # the model that answered
    status: Status  # terminal state
    outputs: list[Any] = field(default_factory=list)  # one per input when status is OK
    error: str | None = None  # human-readable reason when status is not OK
    timings: Timings = field(default_factory=Timings)
    worker: str = ""  # which worker instance answered (for debugging redeliveries)

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    def raise_for_status(self) -> Result:
        """Return self when ok; otherwise raise the typed error that matches the status."""
        if self.status is Status.OK:
            return self
        error: type[KinferError] = _STATUS_ERRORS[self.status]
        raise error(f"{self.model}/{self.id}: {self.status.value}: {self.error or 'no detail'}")

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": ENVELOPE_VERSION,
            "t": "res",
            "id": self.id,
            "model": self.model,
            "status": self.status.value,
            "outputs": self.outputs,
            "error": self.error,
            "timings": self.timings.to_wire(),
            "worker": self.worker,
        }


_STATUS_ERRORS: dict[Status, type[KinferError]] = {
    Status.ERROR: ModelError,
    Status.EXPIRED: DeadlineExceeded,
    Status.SHED: Shed,
    Status.INVALID: InvalidRequest,
}


@dataclass(frozen=True, slots=True)
class Chunk:
    """One piece of a streamed result (generation): sent in order of ``seq``, the last one ``final``."""

    id: str  # the request's id
    model: str
    seq: int  # 0, 1, 2, ... per request; a client reorders by it and drops repeats
    text: str = ""  # text that became final with this chunk
    tokens: list[int] = field(default_factory=list)  # token ids in this chunk
    final: bool = False  # the last chunk of the stream
    status: Status | None = None  # on the final chunk: how the stream ended
    finish: str | None = None  # on the final chunk: eos, length, stop, deadline, cancelled, ...
    prompt_tokens: int = 0  # usage, on the final chunk
    completion_tokens: int = 0
    error: str | None = None
    worker: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": ENVELOPE_VERSION,
            "t": "chunk",
            "id": self.id,
            "model": self.model,
            "seq": self.seq,
            "text": self.text,
            "tokens": self.tokens,
            "final": self.final,
            "status": self.status.value if self.status is not None else None,
            "finish": self.finish,
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens},
            "error": self.error,
            "worker": self.worker,
        }

    def raise_for_status(self) -> Chunk:
        if self.status is None or self.status is Status.OK:
            return self
        error: type[KinferError] = _STATUS_ERRORS[self.status]
        raise error(f"{self.model}/{self.id}: {self.status.value}: {self.error or self.finish or 'no detail'}")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def new_request_id() -> str:
    return uuid.uuid4().hex


# ---------------------------------------------------------------------------------------------
# Encoding and decoding


def pack(message: Request | Result | Chunk) -> bytes:
    """Encode for the wire; raises ``InvalidRequest`` for what msgpack cannot carry.

    Results and chunks send floats as float32 (embeddings need no more, and halve in size);
    requests keep float64, so a parameter is never rounded or overflowed on its way.
    """
    try:
        data: bytes = msgpack.packb(
            message.to_wire(), use_bin_type=True, use_single_float=not isinstance(message, Request)
        )
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. a lone UTF-16 surrogate in a string
        raise InvalidRequest(f"cannot encode the message: {exc}", "message") from exc
    return data


def _unpack(data: bytes, limits: Limits, *, max_array: int) -> Any:
    if len(data) > limits.max_message_bytes:
        raise InvalidRequest(
            f"message is {len(data)} bytes, over the limit of {limits.max_message_bytes}", "message"
        )
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=limits.max_text_chars * 4,  # UTF-8 needs at most 4 bytes a character
            max_bin_len=limits.max_message_bytes,
            max_array_len=max_array,
            max_map_len=max(limits.max_params, 16),
            max_ext_len=0,
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        text = str(exc)
        if "max_array_len" in text:  # the only array in a request is ``inputs``
            raise InvalidRequest(f"too many inputs: over the limit of {max_array} ({text})", "inputs") from exc
        if "max_str_len" in text:
            raise InvalidRequest(
                f"a string is over the limit of {limits.max_text_chars} characters ({text})", "inputs"
            ) from exc
        raise InvalidRequest(f"not a valid msgpack envelope: {text}", "message") from exc


def _header(obj: Any, kind: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise InvalidRequest("envelope must be a msgpack map", "message")
    if obj.get("v") != ENVELOPE_VERSION:
        raise InvalidRequest(f"unsupported envelope version {obj.get('v')!r}", "v")
    if obj.get("t") != kind:
        raise InvalidRequest(f"expected envelope type {kind!r}, got {obj.get('t')!r}", "t")
    return obj


def _field(obj: dict[str, Any], name: str, typ: type | tuple[type, ...]) -> Any:
    if name not in obj:
        raise InvalidRequest(f"missing field {name!r}", name)
    value = obj[name]
    # bool is an int in Python; never accept it where a number is meant.
    if not isinstance(value, typ) or (isinstance(value, bool) and typ is int):
        raise InvalidRequest(f"field {name!r} has the wrong type {type(value).__name__}", name)
    return value


def salvage_route(data: bytes, limits: Limits = DEFAULT_LIMITS) -> tuple[str, ReplyRoute] | None:
    """Id and reply route of an invalid request, when both can still be read; never raises.

    Lets a worker tell the caller *why* its request was refused instead of leaving it to time out.
    """
    if len(data) > limits.max_message_bytes:
        return None
    try:
        obj = msgpack.unpackb(
            data, raw=False, max_str_len=limits.max_text_chars * 4, max_array_len=limits.max_inputs * 4,
            max_map_len=64, max_ext_len=0,
        )
        rid, route = obj["id"], ReplyRoute.from_wire(obj["reply"])
    except Exception:
        return None
    return (rid, route) if isinstance(rid, str) and _ID_RE.match(rid) else None


def decode_request(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Request:
    """Unpack and validate a request; raises ``InvalidRequest`` naming the offending field."""
    obj = _header(_unpack(data, limits, max_array=limits.max_inputs), "req")
    rid = _field(obj, "id", str)
    if not _ID_RE.match(rid):
        raise InvalidRequest("id must be 1-64 characters of [A-Za-z0-9_-]", "id")
    model = _field(obj, "model", str)
    if not valid_model_name(model):
        raise InvalidRequest(f"invalid model name {model!r}", "model")
    try:
        priority = Priority(_field(obj, "priority", int))
    except ValueError as exc:
        raise InvalidRequest("priority must be 0, 1 or 2", "priority") from exc
    tenant = _field(obj, "tenant", str)
    if not _TENANT_RE.match(tenant):
        raise InvalidRequest("tenant must be 1-64 characters of [A-Za-z0-9_.-]", "tenant")
    created_ms = _field(obj, "created_ms", int)
    deadline_ms = _field(obj, "deadline_ms", int)
    if created_ms <= 0 or deadline_ms <= created_ms:
        raise InvalidRequest("need 0 < created_ms < deadline_ms", "deadline_ms")
    inputs = _field(obj, "inputs", list)
    if not 1 <= len(inputs) <= limits.max_inputs:
        raise InvalidRequest(f"inputs must hold 1 to {limits.max_inputs} texts, got {len(inputs)}", "inputs")
    for i, text in enumerate(inputs):
        if not isinstance(text, str):
            raise InvalidRequest(f"inputs[{i}] must be a string", "inputs")
        if len(text) > limits.max_text_chars:
            raise InvalidRequest(
                f"inputs[{i}] has {len(text)} characters, over the limit of {limits.max_text_chars}", "inputs"
            )
    params = obj.get("params", {})
    if not isinstance(params, dict) or len(params) > limits.max_params:
        raise InvalidRequest(f"params must be a map of at most {limits.max_params} entries", "params")
    for key, value in params.items():
        if not isinstance(value, str | int | float | bool) and value is not None:
            raise InvalidRequest(f"params[{key!r}] must be a scalar", "params")
        if isinstance(value, str) and len(value) > limits.max_param_chars:
            raise InvalidRequest(f"params[{key!r}] is longer than {limits.max_param_chars}", "params")
    stream = obj.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("stream must be a boolean", "stream")
    return Request(
        id=rid,
        model=model,
        priority=priority,
        tenant=tenant,
        created_ms=created_ms,
        deadline_ms=deadline_ms,
        inputs=tuple(inputs),
        reply=ReplyRoute.from_wire(_field(obj, "reply", dict)),
        params=params,
        stream=stream,
    )


# Results come from our own workers, but a client still bounds what it unpacks.
RESULT_LIMITS = Limits(max_message_bytes=64 * 1_048_576, max_text_chars=1_048_576)


def decode_result(data: bytes, limits: Limits = RESULT_LIMITS) -> Result:
    return _result_from(_unpack(data, limits, max_array=1_048_576))


def _result_from(obj: Any) -> Result:
    obj = _header(obj, "res")
    status_text = _field(obj, "status", str)
    try:
        status = Status(status_text)
    except ValueError as exc:
        raise InvalidRequest(f"unknown result status {status_text!r}", "status") from exc
    t = obj.get("timings") or {}
    timings = Timings(
        queue_ms=float(t.get("queue_ms", 0.0)),
        batch_wait_ms=float(t.get("batch_wait_ms", 0.0)),
        compute_ms=float(t.get("compute_ms", 0.0)),
        batch_size=int(t.get("batch_size", 0)),
    )
    return Result(
        id=_field(obj, "id", str),
        model=_field(obj, "model", str),
        status=status,
        outputs=list(obj.get("outputs") or []),
        error=obj.get("error"),
        timings=timings,
        worker=str(obj.get("worker", "")),
    )


def decode_chunk(obj: dict[str, Any]) -> Chunk:
    status = obj.get("status")
    usage = obj.get("usage") or {}
    try:
        return Chunk(
            id=_field(obj, "id", str),
            model=_field(obj, "model", str),
            seq=_field(obj, "seq", int),
            text=str(obj.get("text") or ""),
            tokens=[int(t) for t in obj.get("tokens") or []],
            final=bool(obj.get("final", False)),
            status=Status(status) if status is not None else None,
            finish=obj.get("finish"),
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", 0)),
            error=obj.get("error"),
            worker=str(obj.get("worker", "")),
        )
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"malformed stream chunk: {exc}", "chunk") from exc


def decode_reply(data: bytes, limits: Limits = RESULT_LIMITS) -> Result | Chunk:
    """A reply is a result or a stream chunk; tell them apart by ``t``."""
    obj = _unpack(data, limits, max_array=1_048_576)
    if isinstance(obj, dict) and obj.get("t") == "chunk":
        return decode_chunk(_header(obj, "chunk"))
    return _result_from(obj)
