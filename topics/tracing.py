"""Trace context across Kafka and Redis: W3C ``traceparent`` in record headers and in replies.

Off unless the process has an OpenTelemetry SDK tracer provider (the command line installs one when
``OTEL_TRACES_EXPORTER`` names an exporter, ``ops.cli.observability``; a library user installs their
own). Off, every function here returns at its first line: no span, no header, no allocation.

On, a request's hops are spans of one trace (``docs/operations.md``, Traces):

    client     ``infer <model>`` (or the gateway's ``POST <route>`` above it), and one ``send <topic>``
               per copy published; the copy's record carries ``traceparent`` (and ``tracestate``)
    worker     ``queue <topic>`` from the record's timestamp to its fetch, ``batch wait``, ``compute``
               (its batch's size and tokens, linked to the batch's span), ``reply``; the reply carries
               the ``reply`` span's ``traceparent`` in its ``trace`` field
               one ``batch <model>`` span per batch with a traced request, linked to each of them
    client     ``receive <route>`` when the reply reaches the caller

The sender decides: a record whose ``traceparent`` says "not sampled" costs the worker one header
scan; one without the header is sampled by the worker's own sampler, from the worker on. A sender
can ask for every request to be traced, so a worker traces at most ``max_per_s`` requests a second
(``KINFER_TRACE_MAX_PER_S``, default 200); above that a request is served untraced.

The W3C codec (``parse_traceparent``, ``format_traceparent``) is pure and total: any bytes in, a
context or None out.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, TraceFlags, TraceState

log = logging.getLogger(__name__)
REQUEST_ID: ContextVar[str | None] = ContextVar("kinfer_request_id", default=None)  # the request being handled
# The traceparent (flags 00) of the request being handled when it is not traced (``_Scope``).
_NOT_SAMPLED: ContextVar[bytes | None] = ContextVar("kinfer_not_sampled", default=None)
TRACEPARENT = "traceparent"  # W3C Trace Context, as a Kafka record header (ASCII) and in a reply's ``trace``
TRACESTATE = "tracestate"
MAX_TRACESTATE_BYTES = 512  # W3C's limit for a tracestate a vendor must propagate
DEFAULT_MAX_PER_S = 200.0

# version 00: exactly 55 characters; a later version may append "-..." fields, which are skipped.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.ASCII | re.DOTALL)
_INVALID_TRACE = "0" * 32
_INVALID_SPAN = "0" * 16


@dataclass(frozen=True, slots=True)
class Parent:
    """A remote span's identity, as ``traceparent`` carries it."""

    trace_id: int  # 128 bits, never 0
    span_id: int  # 64 bits, never 0
    flags: int  # bit 0: sampled

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 1)


def parse_traceparent(raw: bytes | str | None) -> Parent | None:
    """A ``traceparent`` value → its ``Parent``, or None when it is not one (W3C Trace Context §3.2.2:
    version ``ff`` and all-zero ids are invalid; version 00 has exactly four fields)."""
    if raw is None or len(raw) > 512:
        return None
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("ascii")
        except UnicodeDecodeError:
            return None
    m = _TRACEPARENT.fullmatch(raw)
    if m is None:
        return None
    version, trace_hex, span_hex, flags_hex, rest = m.groups()
    if version == "ff" or (version == "00" and rest is not None) or trace_hex == _INVALID_TRACE \
            or span_hex == _INVALID_SPAN:
        return None
    return Parent(int(trace_hex, 16), int(span_hex, 16), int(flags_hex, 16))


def format_traceparent(context: SpanContext) -> str:
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags) & 0xFF:02x}"


def _header(headers: Sequence[tuple[str, bytes | None]], name: str) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


# -- the process's tracer ---------------------------------------------------------------------------


class _Budget:
    """At most ``rate`` traced requests a second, in bursts of one second's worth (a token bucket)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.tokens = rate
        self.at = time.monotonic()
        self.refused = 0

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        self.refused += 1
        return False


_tracer: trace.Tracer | None = None
_budget: _Budget | None = None


_off_until = 0.0  # tracing was found off; looked for again after this (monotonic seconds)


def tracer() -> trace.Tracer | None:
    """kinfer's tracer, or None while no SDK tracer provider is installed (tracing off; looked for
    again once a second, so a provider an application installs later is found)."""
    global _off_until
    if _tracer is None:
        now = time.monotonic()
        if now < _off_until:
            return None
        _off_until = now + 1.0
        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
            return None
        use(provider)
    return _tracer


def use(provider: trace.TracerProvider) -> None:
    """kinfer's spans from ``provider`` (the global one once installed; or an embedding application's
    own, or a test's with an in-memory exporter)."""
    global _tracer, _budget
    from kinfer import __version__

    raw = os.environ.get("KINFER_TRACE_MAX_PER_S", str(DEFAULT_MAX_PER_S))
    try:
        rate = float(raw)
    except ValueError:
        rate = math.nan
    if not 0 <= rate < math.inf:
        raise ValueError(f"KINFER_TRACE_MAX_PER_S must be a finite number of requests a second >= 0, not {raw!r}")
    _tracer = provider.get_tracer("kinfer", __version__)
    _budget = _Budget(rate)


def reset() -> None:
    """Forget the tracer looked up (tests that install a provider after kinfer looked)."""
    global _tracer, _budget, _off_until
    _tracer = _budget = None
    _off_until = 0.0


def wall_ns(monotonic_s: float, now_mono: float | None = None, now_wall_ns: int | None = None) -> int:
    """A ``time.monotonic()`` instant as epoch nanoseconds (span times are wall clock)."""
    mono = time.monotonic() if now_mono is None else now_mono
    wall = time.time_ns() if now_wall_ns is None else now_wall_ns
    return wall - int((mono - monotonic_s) * 1e9)


def context_of(span_context: SpanContext) -> Context:
    return trace.set_span_in_context(NonRecordingSpan(span_context))


# -- the client's side ------------------------------------------------------------------------------


class _Scope:
    """A span current for a block, or the decision not to trace it.

    Each request is decided once, where it enters: an unsampled one records nothing and attaches
    nothing; ``_NOT_SAMPLED`` holds its ``traceparent`` (flags 00) for the spans nested in it, which
    are then skipped, and for the record's headers, so the worker skips it too. The classes below are
    plain context managers (no generator), so a request that is not traced costs a few microseconds.
    """

    __slots__ = ("_attached", "_unsampled", "span")

    def __init__(self) -> None:
        self.span: trace.Span | None = None
        self._attached: object = None
        self._unsampled: Token[bytes | None] | None = None

    def _start(self, t: trace.Tracer, name: str, kind: SpanKind, parent: Context | None = None) -> bool:
        """Start ``name``: current if sampled (True), else only the decision kept."""
        span = t.start_span(name, parent, kind=kind)
        if span.is_recording():
            self.span = span
            self._attached = otel_context.attach(trace.set_span_in_context(span))
            return True
        self._unsampled = _NOT_SAMPLED.set(format_traceparent(span.get_span_context()).encode())
        return False

    def _end(self, exc: BaseException | None) -> None:
        if self.span is not None:
            if exc is not None:
                self.span.record_exception(exc)
                self.span.set_status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}")
            self.span.end()
            otel_context.detach(self._attached)  # type: ignore[arg-type]
        elif self._unsampled is not None:
            _NOT_SAMPLED.reset(self._unsampled)


class request_span(_Scope):
    """The caller's span for one request (current while it runs; ``span`` None when it is not traced).
    Either way ``REQUEST_ID`` names the request meanwhile (log lines carry it)."""

    __slots__ = ("_named", "model", "priority", "request_id")

    def __init__(self, model: str, request_id: str, priority: int) -> None:
        super().__init__()
        self.model, self.request_id, self.priority = model, request_id, priority

    def __enter__(self) -> trace.Span | None:
        self._named = REQUEST_ID.set(self.request_id)
        t = _tracer if _tracer is not None else tracer()
        if t is not None and _NOT_SAMPLED.get() is None and \
                self._start(t, f"infer {self.model}", SpanKind.CLIENT):
            assert self.span is not None
            self.span.set_attributes({"kinfer.model": self.model, "kinfer.request_id": self.request_id,
                                      "kinfer.priority": self.priority})
        return self.span

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        self._end(exc)
        REQUEST_ID.reset(self._named)


def current_ids() -> tuple[str, str] | None:
    """The current span's trace and span ids in hex (for log lines), None outside a recorded span."""
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


def log_ids(context: Context | None) -> dict[str, str]:
    """A traced request's trace id as a log line's ``extra`` (a line about one record, outside its span)."""
    if context is None:
        return {}
    span_context = trace.get_current_span(context).get_span_context()
    return {"trace_id": f"{span_context.trace_id:032x}"} if span_context.is_valid else {}


class server_span(_Scope):
    """A gateway's span for one HTTP request (current while it runs), continuing the caller's trace
    when its headers carry one (``OTEL_PROPAGATORS``, W3C Trace Context by default)."""

    __slots__ = ("headers", "method", "path", "route")

    def __init__(self, route: str, method: str, path: str, headers: Mapping[str, str]) -> None:
        super().__init__()
        self.route, self.method, self.path, self.headers = route, method, path, headers

    def __enter__(self) -> trace.Span | None:
        t = _tracer if _tracer is not None else tracer()
        if t is None:
            return None
        raw = self.headers.get(TRACEPARENT)
        parent = parse_traceparent(raw) if raw is not None else None
        if parent is not None and not parent.sampled:  # the caller decided: nothing recorded, passed on
            self._unsampled = _NOT_SAMPLED.set(f"00-{parent.trace_id:032x}-{parent.span_id:016x}-00".encode())
            return None
        context = propagate.extract(self.headers) if raw is not None else None
        if self._start(t, f"{self.method} {self.route}", SpanKind.SERVER, context):
            assert self.span is not None
            self.span.set_attributes({"http.request.method": self.method, "http.route": self.route,
                                      "url.path": self.path})
        return self.span

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if self.span is not None and exc is None:
            self.span.set_attribute("http.response.status_code", 200)
        self._end(exc)


class send_span(_Scope):
    """One copy's publish: ``with send_span(...) as carried`` gives the headers to send it with,
    ``traceparent`` added (the same headers when tracing is off)."""

    __slots__ = ("headers", "partition", "request_id", "topic")

    def __init__(self, topic: str, request_id: str, partition: int | None,
                 headers: list[tuple[str, bytes]] | None) -> None:
        super().__init__()
        self.topic, self.request_id, self.partition, self.headers = topic, request_id, partition, headers

    def __enter__(self) -> list[tuple[str, bytes]] | None:
        t = _tracer if _tracer is not None else tracer()
        if t is None:
            return self.headers
        carried = _NOT_SAMPLED.get()
        if carried is None:
            if self._start(t, f"send {self.topic}", SpanKind.PRODUCER):
                assert self.span is not None
                context = self.span.get_span_context()
                attributes: dict[str, Any] = {
                    "messaging.system": "kafka", "messaging.operation.type": "send",
                    "messaging.destination.name": self.topic, "messaging.message.id": self.request_id}
                if self.partition is not None:
                    attributes["messaging.destination.partition.id"] = str(self.partition)
                self.span.set_attributes(attributes)
                headers = [*(self.headers or ()), (TRACEPARENT, format_traceparent(context).encode())]
                if context.trace_state:
                    headers.append((TRACESTATE, context.trace_state.to_header().encode()))
                return headers
            carried = _NOT_SAMPLED.get()
        return [*(self.headers or ()), (TRACEPARENT, carried)] if carried is not None else self.headers

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        self._end(exc)


def received(route: str, request_id: str, carried: str | None) -> None:
    """A reply reached its caller over ``route`` (``redis`` or ``kafka``): a ``receive`` span under the
    worker's ``reply`` span that ``carried`` names."""
    if carried is None:
        return
    t = tracer()
    parent = parse_traceparent(carried)
    if t is None or parent is None or not parent.sampled:
        return
    remote = SpanContext(parent.trace_id, parent.span_id, is_remote=True, trace_flags=TraceFlags(parent.flags))
    t.start_span(f"receive {route}", context_of(remote), kind=SpanKind.CONSUMER, attributes={
        "messaging.system": route, "messaging.operation.type": "receive", "messaging.message.id": request_id,
    }).end()


# -- the worker's side ------------------------------------------------------------------------------


def incoming(headers: Sequence[tuple[str, bytes | None]], topic: str, partition: int, offset: int,
             request_id: str, timestamp_ms: int, fetched_wall_ns: int) -> Context | None:
    """A fetched request's trace: its ``queue`` span (record timestamp → fetched) is recorded, and the
    context its other spans hang from is returned. None: off, not sampled, over the budget, or tracing
    failed (logged): a record is served whatever its trace headers or the tracing SDK do."""
    t = tracer()
    if t is None:
        return None
    try:
        return _incoming(t, headers, topic, partition, offset, request_id, timestamp_ms, fetched_wall_ns)
    except Exception:
        log.exception("tracing %s@%d failed; served untraced", topic, offset)
        return None


def _incoming(t: trace.Tracer, headers: Sequence[tuple[str, bytes | None]], topic: str, partition: int,
              offset: int, request_id: str, timestamp_ms: int, fetched_wall_ns: int) -> Context | None:
    parent = parse_traceparent(_header(headers, TRACEPARENT))
    if parent is not None and not parent.sampled:
        return None
    assert _budget is not None
    if not _budget.take():
        return None
    if parent is None:  # a sender without trace context: traced from here, as the sampler says
        context = None
    else:
        state = _header(headers, TRACESTATE)
        trace_state = None
        if state is not None and len(state) <= MAX_TRACESTATE_BYTES:
            try:
                trace_state = TraceState.from_header([state.decode("ascii")])
            except (UnicodeDecodeError, ValueError):
                trace_state = None
        context = context_of(SpanContext(parent.trace_id, parent.span_id, is_remote=True,
                                         trace_flags=TraceFlags(parent.flags), trace_state=trace_state))
    span = t.start_span(f"queue {topic}", context, kind=SpanKind.CONSUMER, start_time=timestamp_ms * 1_000_000,
                        attributes={"messaging.system": "kafka", "messaging.operation.type": "receive",
                                    "messaging.destination.name": topic, "messaging.message.id": request_id,
                                    "messaging.destination.partition.id": str(partition),
                                    "messaging.kafka.offset": offset})
    if not span.is_recording():
        return None
    span.end(fetched_wall_ns)
    return context if context is not None else context_of(span.get_span_context())


@dataclass(frozen=True, slots=True)
class Ran:
    """One traced request's part in a batch, in epoch nanoseconds."""

    context: Context  # what ``incoming`` returned
    request_id: str
    fetched_ns: int
    started_ns: int  # its batch started
    ended_ns: int  # its batch ended
    batch_size: int  # inputs in the batch
    tokens: int  # its own inputs' tokens


def batch(model: str, ran: Sequence[Ran]) -> None:
    """The spans of one batch's traced requests: each one's ``batch wait`` and ``compute``, and one
    ``batch <model>`` span linked to every one of them (in the first one's trace)."""
    t = tracer()
    if t is None or not ran:
        return
    first = ran[0]
    links = [Link(trace.get_current_span(r.context).get_span_context(), {"kinfer.request_id": r.request_id})
             for r in ran]
    whole = t.start_span(f"batch {model}", first.context, start_time=first.started_ns, links=links, attributes={
        "kinfer.model": model, "kinfer.batch.size": first.batch_size, "kinfer.batch.requests": len(ran)})
    whole.end(first.ended_ns)
    to_batch = [Link(whole.get_span_context())]
    for r in ran:
        t.start_span("batch wait", r.context, start_time=r.fetched_ns).end(r.started_ns)
        t.start_span("compute", r.context, start_time=r.started_ns, links=to_batch, attributes={
            "kinfer.model": model, "kinfer.batch.size": r.batch_size, "kinfer.tokens": r.tokens,
        }).end(r.ended_ns)


def reply_span(context: Context, request_id: str, status: str) -> trace.Span | None:
    """A traced request's reply, started now: its ``traceparent`` goes in the reply; end it once out."""
    t = tracer()
    if t is None:
        return None
    return t.start_span("reply", context, kind=SpanKind.PRODUCER, attributes={
        "messaging.operation.type": "send", "messaging.message.id": request_id, "kinfer.status": status})


__all__ = [
    "REQUEST_ID",
    "TRACEPARENT",
    "TRACESTATE",
    "Parent",
    "Ran",
    "batch",
    "current_ids",
    "format_traceparent",
    "incoming",
    "parse_traceparent",
    "received",
    "reply_span",
    "request_span",
    "send_span",
    "server_span",
    "tracer",
]
