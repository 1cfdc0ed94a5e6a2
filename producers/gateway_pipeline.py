"""The one path every HTTP request for a model takes: authenticate → decode → admit → call → render.

A route states only what is particular to it, as a ``Route``: its metrics label, how its body is
decoded (and refused), what it asks the client once the caller is admitted, and how the answer is
rendered. ``Gateway.serve`` does the rest, in the same order for every route:

    authenticate   the tenant its API key names (401 without one, when the gateway has tenants)
    decode         the body, bounded (``producers.http.decode``), then X-Request-Timeout-Ms
    admit          the tenant's token bucket (429 with Retry-After when empty)
    call           the client, under the tenant, at no better than its priority ceiling
    render         the answer; then the request is counted as served

The WebSocket (``native_api.WebSocketAPI``) takes the same steps for each request on it, answering on
the socket; the probes and the model list call no model and are neither admitted nor counted.

Errors map to status codes in one place (``_STATUS``, read by ``error_payload``), whether they are
answered as a status code, inside an event stream that has started, or on a WebSocket.
"""

from __future__ import annotations

import gc
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Generic, TypeVar

import msgspec
from msgspec import Meta
from prometheus_client import Counter, Histogram
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kinfer.producers import metrics
from kinfer.producers.client import Client
from kinfer.producers.http import BadBody, Endpoint, ascii_int, error_body, read_body
from kinfer.producers.ratelimit import RedisRateLimiter
from kinfer.producers.tenants import Tenant, Tenants
from kinfer.topics import (
    Chunk,
    ColdStart,
    DeadlineExceeded,
    InvalidRequest,
    KinferError,
    ModelError,
    Overloaded,
    Priority,
    Result,
    Shed,
    Turn,
    Unavailable,
    UnknownModel,
    tracing,
)
from kinfer.topics.auth import Signer, signing_secrets
from kinfer.topics.envelope import DEFAULT_LIMITS

if TYPE_CHECKING:  # the store's module imports the OpenAI routes, which import this one
    from kinfer.producers.batches import BatchStore

DEFAULT_TIMEOUT_MS = 30_000
MIN_TIMEOUT_MS = 1_000  # below this an HTTP round trip plus a forward pass is not a fair promise
MAX_TIMEOUT_MS = 600_000
MAX_NAME_CHARS = 256  # a params key, OpenAI's user, a message's name, a tool's or format's type

# What both surfaces' bodies hold: every field is bounded, as the envelope bounds a request
# (``topics.envelope.Limits``), so a body is refused while it is parsed, before the client builds a
# request from it. No field is ``Any``.
Text = Annotated[str, Meta(max_length=DEFAULT_LIMITS.max_text_chars)]
Texts = Annotated[Text | Annotated[list[Text], Meta(max_length=DEFAULT_LIMITS.max_inputs)],
                  Meta(description="one text or a list")]

REQUESTS = Counter("kinfer_gateway_requests_total", "Gateway requests", ["tenant", "route", "code"])
LATENCY = Histogram(
    "kinfer_gateway_seconds", "Gateway request latency", ["tenant", "route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)

# One table from typed errors to HTTP status codes (the first class that matches wins).
_STATUS: list[tuple[type[KinferError], int]] = [
    (UnknownModel, 404),
    (InvalidRequest, 400),
    (ColdStart, 503),  # before Overloaded, its parent: not the caller's rate, the model's state
    (Overloaded, 429),
    (Shed, 503),
    (DeadlineExceeded, 504),
    (Unavailable, 503),
    (ModelError, 502),
]


class RateLimited(Overloaded):
    """The tenant's token bucket is empty."""


class Unauthorized(Exception):
    """No API key, or one no tenant holds: 401 (a WebSocket is closed with 4401)."""


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    bootstrap: str
    redis_url: str
    tenants: Tenants | None = None  # None: no authentication (local use only)


def error_payload(exc: KinferError) -> tuple[int, dict[str, Any], dict[str, str]]:
    """A typed error as an answer: its status code, its error body and its headers (counted once here)."""
    code = next((c for t, c in _STATUS if isinstance(exc, t)), 500)
    metrics.GATEWAY_ERRORS.labels(str(code), type(exc).__name__).inc()
    headers: dict[str, str] = {}
    retry = getattr(exc, "retry_after_s", None)
    if retry is None and code in (429, 503):
        retry = 1.0
    if retry is not None:
        headers["Retry-After"] = str(max(1, round(retry + 0.4999)))
    level = getattr(exc, "level", None)
    if level:
        headers["X-Kinfer-Degradation"] = level  # the model's health level that refused the request
    return code, error_body(type(exc).__name__, str(exc), getattr(exc, "field", None)), headers


def priority_for(who: Tenant | None, asked: int) -> Priority:
    """The priority asked for, at no better than the tenant's ceiling."""
    p = Priority(asked)
    return who.clamp(p) if who is not None else p


def _timeout_header(request: Request) -> int | None:
    raw = request.headers.get("x-request-timeout-ms")
    if raw is None:
        return None
    value = ascii_int(raw, MIN_TIMEOUT_MS, MAX_TIMEOUT_MS)
    if value is None:
        raise BadBody(f"X-Request-Timeout-Ms must be an integer in [{MIN_TIMEOUT_MS}, {MAX_TIMEOUT_MS}]",
                      "X-Request-Timeout-Ms")
    return value


# -- streams --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Streamed:
    """A stream whose first chunk has come: errors before it are still answered with a status code."""

    first: Chunk
    rest: AsyncIterator[Chunk]


async def _first_chunk(chunks: AsyncIterator[Chunk]) -> Streamed:
    try:
        return Streamed(await chunks.__anext__(), chunks)
    except StopAsyncIteration as exc:
        raise Unavailable("the stream ended before its first chunk") from exc


def sse_response(stream: Streamed, render: Callable[[Chunk], Iterable[Any]]) -> StreamingResponse:
    """The stream as Server-Sent Events: ``render`` turns a chunk into the events it stands for."""
    return StreamingResponse(_sse(stream, render), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _sse(stream: Streamed, render: Callable[[Chunk], Iterable[Any]]) -> AsyncIterator[bytes]:
    try:
        for event in render(stream.first):
            yield b"data: " + msgspec.json.encode(event) + b"\n\n"
        if not stream.first.final:
            async for chunk in stream.rest:
                for event in render(chunk):
                    yield b"data: " + msgspec.json.encode(event) + b"\n\n"
        yield b"data: [DONE]\n\n"
    except KinferError as exc:  # after the first byte the status is sent: report in-band
        _, payload, _ = error_payload(exc)
        yield b"event: error\ndata: " + msgspec.json.encode(payload) + b"\n\n"
    finally:
        await stream.rest.aclose()  # type: ignore[attr-defined]


# -- the pipeline ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admitted:
    """One request past authentication, decoding and the rate limit: what its route's call may use."""

    client: Client
    request: Request
    who: Tenant | None  # None when the gateway runs without tenants
    tenant: str  # the name in metrics and in the envelope ("anonymous" without tenants)
    route: str  # the route's metrics label
    timeout_ms: int | None  # X-Request-Timeout-Ms, which wins over the body's timeout_ms

    def priority(self, asked: int) -> Priority:
        return priority_for(self.who, asked)

    def deadline_ms(self, asked_ms: int | None = None) -> int:
        return self.timeout_ms or asked_ms or DEFAULT_TIMEOUT_MS

    async def infer(self, model: str, inputs: str | Sequence[str], *, priority: Priority, deadline_ms: int,
                    messages: Sequence[Turn] = (), params: dict[str, Any] | None = None) -> Result:
        """``Client.infer`` for this tenant, its latency observed."""
        started = time.perf_counter()
        result = await self.client.infer(model, inputs, messages=messages, priority=priority, deadline_ms=deadline_ms,
                                         params=params, tenant=self.tenant)
        LATENCY.labels(self.tenant, self.route).observe(time.perf_counter() - started)
        return result

    async def stream(self, model: str, prompt: str | None, *, priority: Priority, deadline_ms: int,
                     messages: Sequence[Turn] = (), params: dict[str, Any] | None = None) -> Streamed:
        """``Client.stream`` for this tenant, once its first chunk has come."""
        chunks = self.client.stream(model, prompt, messages=messages, priority=priority, deadline_ms=deadline_ms,
                                    params=params, tenant=self.tenant)
        return await _first_chunk(chunks)


B = TypeVar("B")  # a route's decoded body
A = TypeVar("A")  # what its call answers


@dataclass(frozen=True, slots=True)
class Route(Generic[B, A]):
    """What one route states; ``Gateway.serve`` does the rest alike for every route."""

    name: str  # its label in kinfer_gateway_requests_total and kinfer_gateway_seconds
    decode: Callable[[bytes], B]  # the body's bounded decode, and any refusal that needs the body alone
    call: Callable[[Admitted, B], Awaitable[A]]  # the work, once the caller is admitted
    render: Callable[[B, A], Response]  # the answer (it may still refuse one the model cannot give)


class Gateway:
    """What every route shares: one ``Client`` started with the app, the tenants and their rate limits."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self._client: Client | None = None
        self.batches: BatchStore | None = None  # the Batch API's files and batches, once started
        # Tenants' buckets in Redis, shared by every gateway (their own bucket while Redis does not answer).
        self.limiter = RedisRateLimiter.from_url(settings.redis_url) if settings.tenants is not None else None

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        try:
            # With KINFER_SIGNING_SECRET the gateway signs each request for the tenant it authenticated
            # (workers holding the secret refuse unsigned ones); the tenant's key version from the file.
            secrets = signing_secrets()
            tenants = self.settings.tenants
            signer = Signer(secret=secrets[0], versions=tenants.key_versions if tenants else None) if secrets else None
            self._client = Client(self.settings.bootstrap, self.settings.redis_url, tenant="gateway", signer=signer)
            await self._client.start()
            gc.collect()
            gc.freeze()  # the app's long-lived objects leave the cyclic GC's scans (~37 ms a full collection)
            try:
                yield
            finally:
                await self._client.close()
        finally:
            if self.limiter is not None:
                await self.limiter.close()

    @property
    def client(self) -> Client:
        if self._client is None:
            raise Unavailable("the gateway is starting")
        return self._client

    def authenticate(self, headers: Any) -> Tenant | None:
        """The caller's tenant from its API key; None when the gateway runs without tenants."""
        tenants = self.settings.tenants
        if tenants is None:
            return None
        key = headers.get("x-api-key") or headers.get("authorization", "").removeprefix("Bearer ").strip()
        found = tenants.authenticate(key)
        if found is None:
            raise Unauthorized()
        return found

    async def admit(self, who: Tenant | None, route: str) -> str:
        """Rate limit (at most one Redis round trip); returns the tenant name for metrics and the envelope."""
        if who is None:
            return "anonymous"
        wait = await self.limiter.take(who) if self.limiter is not None else who.bucket.take(time.monotonic())
        if wait > 0:
            REQUESTS.labels(who.name, route, "429").inc()
            raise RateLimited(f"tenant {who.name!r} is over its rate of {who.rate_per_s}/s", retry_after_s=wait)
        return who.name

    async def serve(self, request: Request, route: Route[B, A]) -> Response:
        """authenticate → decode → admit → call → render. An error on the way is raised for the app's
        handlers to answer: the request is not counted as served, and a refused body or header spends
        none of the tenant's rate."""
        with tracing.server_span(route.name, request.method, request.url.path, request.headers):
            who = self.authenticate(request.headers)
            body = route.decode(await read_body(request))
            timeout_ms = _timeout_header(request)
            tenant = await self.admit(who, route.name)
            admitted = Admitted(self.client, request, who, tenant, route.name, timeout_ms)
            response = route.render(body, await route.call(admitted, body))
        REQUESTS.labels(tenant, route.name, "200").inc()
        return response

    def endpoint(self, route: Route[B, A]) -> Endpoint:
        """The route as a Starlette endpoint."""

        async def endpoint(request: Request) -> Response:
            return await self.serve(request, route)

        return endpoint
