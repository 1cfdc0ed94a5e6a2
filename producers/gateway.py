"""The HTTP gateway: a thin shell over the client library.

    POST /v1/models/{model}/infer     one result, synchronous JSON
    POST /v1/models/{model}/stream    generation as Server-Sent Events
    WS   /v1/models/{model}/ws        requests in, results and stream chunks out, on one socket
    GET  /v1/models                   models with request topics
    POST /v1/embeddings               OpenAI-compatible
    POST /v1/completions              OpenAI-compatible (``stream: true`` for SSE)
    POST /v1/chat/completions         OpenAI-compatible chat (``stream: true`` for SSE)
    GET  /healthz  /readyz  /metrics  /openapi.json  /docs

Every request goes through the same ``Client`` (same validation, same typed errors), under the
tenant its API key names (``Authorization: Bearer <key>`` or ``X-API-Key``), after that tenant's
token bucket (in Redis, shared by all gateways: ``producers.ratelimit``), at no better than its
priority ceiling. Errors map to status codes in one place
(``_STATUS``): invalid → 400 (422 for a body that does not parse or match its schema, 413 over
``MAX_BODY_BYTES``), unknown model → 404, rate limit or overload → 429 / shed → 503 with
``Retry-After``, deadline → 504, Kafka/Redis down → 503; every error body is
``{"error": {"type", "message", "param", "code"}}`` (OpenAI's). A client deadline travels from ``X-Request-Timeout-Ms``
or the body's ``timeout_ms``.

Starlette routes and msgspec bodies (``producers.http``): the OpenAPI document is generated from the
route table below, so what is documented is what is served.

Every body, frame and header is read by one bounded decode: its size first (``MAX_BODY_BYTES``,
``MAX_FRAME_BYTES``), then msgspec against a schema in which every field has a type and a bound (the
envelope's ``Limits`` for texts, inputs and params; no ``Any``) and nesting is bounded; a header's
number is ASCII digits within its range. Bad input is a 4xx naming the field, never a 500.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import logging
import struct
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from kinfer.producers import metrics
from kinfer.producers.client import Client
from kinfer.producers.http import (
    MAX_FRAME_BYTES,
    BadBody,
    Doc,
    ascii_int,
    decode,
    docs_page,
    error_body,
    json_response,
    openapi,
    read_body,
)
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
)
from kinfer.topics.auth import Signer, signing_secrets
from kinfer.topics.envelope import DEFAULT_LIMITS

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_MS = 30_000
MIN_TIMEOUT_MS = 1_000  # below this an HTTP round trip plus a forward pass is not a fair promise
MAX_TIMEOUT_MS = 600_000
WS_IN_FLIGHT = 64  # requests one WebSocket may have outstanding; more wait for a slot
MAX_NAME_CHARS = 256  # a params key, OpenAI's user, a message's name, a tool's or format's type
MAX_OPENAI_STOPS = 4  # OpenAI's stop: at most four sequences ...
MAX_OPENAI_STOP_CHARS = 255  # ... of 255 characters: joined by U+001F they fit one parameter (1,024 characters)
MAX_TOOLS = 128  # OpenAI's tools (refused unless empty; counted before that)
MAX_LOGIT_BIAS = 1_024  # OpenAI's logit_bias entries (refused unless empty)
# The workers' sampling ranges (WIRE_FORMAT.md), checked here too so that an OpenAI body is refused
# naming its field, before it is sent: temperature 0 or within [MIN_TEMPERATURE, 2] (OpenAI's top),
# top_p within [MIN_TOP_P, 1].
MIN_TEMPERATURE = 1e-4
MIN_TOP_P = 1e-6

REQUESTS = Counter("kinfer_gateway_requests_total", "Gateway requests", ["tenant", "route", "code"])
LATENCY = Histogram(
    "kinfer_gateway_seconds", "Gateway request latency", ["tenant", "route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)

# One table from typed errors to HTTP: (status, retry-after seconds or None).
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


class _Unauthorized(Exception):
    pass


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    bootstrap: str
    redis_url: str
    tenants: Tenants | None = None  # None: no authentication (local use only)


# -- request bodies (validated by msgspec while parsing) -------------------------------------

# Every field is bounded here, as the envelope bounds a request (``topics.envelope.Limits``): a body is
# refused while it is parsed, before the client builds a request from it. No field is ``Any``.
Text = Annotated[str, Meta(max_length=DEFAULT_LIMITS.max_text_chars)]
Texts = Annotated[Text | Annotated[list[Text], Meta(max_length=DEFAULT_LIMITS.max_inputs)],
                  Meta(description="one text or a list")]
PriorityField = Annotated[int, Meta(ge=0, le=2, description="0 interactive, 1 standard, 2 batch")]
TimeoutField = Annotated[int, Meta(ge=MIN_TIMEOUT_MS, le=MAX_TIMEOUT_MS, description="deadline, ms from now")]
ParamKey = Annotated[str, Meta(max_length=MAX_NAME_CHARS)]
ParamValue = Annotated[str, Meta(max_length=DEFAULT_LIMITS.max_param_chars)] | int | float | bool | None
Params = Annotated[dict[ParamKey, ParamValue], Meta(max_length=DEFAULT_LIMITS.max_params)]
ModelName = Annotated[str, Meta(min_length=1, max_length=63)]
Name = Annotated[str, Meta(max_length=MAX_NAME_CHARS)]  # OpenAI's user, name, types and the like


class InferBody(msgspec.Struct, forbid_unknown_fields=True):
    inputs: Texts
    priority: PriorityField = 1
    timeout_ms: TimeoutField | None = None
    params: Params = {}


class StreamBody(msgspec.Struct, forbid_unknown_fields=True):
    prompt: Text
    priority: PriorityField = 1
    timeout_ms: TimeoutField | None = None
    params: Params = {}


class WsMessage(msgspec.Struct, forbid_unknown_fields=True):
    """One request on the WebSocket: an ``InferBody`` or (``stream: true``) a ``StreamBody``, and an ``id``."""

    id: Annotated[str, Meta(max_length=128)] | Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    stream: bool = False
    inputs: Texts | None = None
    prompt: Text | None = None
    priority: PriorityField = 1
    timeout_ms: TimeoutField | None = None
    params: Params = {}


# OpenAI's bodies: fields they do not define are skipped, not refused (OpenAI's clients send fields
# newer than this server). msgspec skips an unknown value without building it; its nesting is bounded
# like the rest of the document (``producers.http.decode``), and its size by ``MAX_BODY_BYTES``.


class EmbeddingsBody(msgspec.Struct):
    model: ModelName
    input: Texts
    encoding_format: Literal["float", "base64"] = "float"
    user: Name | None = None
    dimensions: int | None = None  # refused: the model's vectors have the size they have


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ToolFunction(msgspec.Struct):
    name: Name  # its description and JSON-schema parameters are skipped: tools are refused anyway


class Tool(msgspec.Struct):
    type: Name
    function: ToolFunction | None = None


class ToolChoice(msgspec.Struct):
    type: Name
    function: ToolFunction | None = None


class ResponseFormat(msgspec.Struct):
    type: Name  # its json_schema is skipped: any type but "text" is refused


Stop = Annotated[str, Meta(max_length=MAX_OPENAI_STOP_CHARS)]


class _Generation(msgspec.Struct, kw_only=True):
    """What OpenAI's completion and chat bodies share: sampling, streaming, and options kinfer refuses."""

    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0  # and 0 or >= MIN_TEMPERATURE
    top_p: Annotated[float, Meta(ge=MIN_TOP_P, le=1.0)] = 1.0
    stop: Stop | Annotated[list[Stop], Meta(max_length=MAX_OPENAI_STOPS)] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**62)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    # OpenAI fields kinfer does not implement: refused with a 400 when they ask for anything but the default.
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Annotated[dict[Name, float], Meta(max_length=MAX_LOGIT_BIAS)] | None = None

    def _asked(self) -> dict[str, bool]:
        """Each unimplemented field, and whether the body asks for more than its default."""
        return {"n": self.n != 1, "presence_penalty": self.presence_penalty != 0,
                "frequency_penalty": self.frequency_penalty != 0, "logit_bias": bool(self.logit_bias),
                "stream_options": self.stream_options is not None and not self.stream}

    def unsupported(self) -> str | None:
        """The first field asking for something kinfer does not do (never silently ignored)."""
        return next((name for name, wanted in self._asked().items() if wanted), None)

    def params(self, max_tokens: int) -> dict[str, str | int | float | None]:
        """The request's generation ``params`` (WIRE_FORMAT.md)."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        params: dict[str, str | int | float | None] = {"max_new_tokens": max_tokens, "temperature": self.temperature,
                                                       "top_p": self.top_p, "seed": self.seed}
        if joined := "\x1f".join(s for s in stops if s):
            params["stop"] = joined
        return params

    def out_of_range(self) -> InvalidRequest | None:
        """What the schema cannot say: a temperature between 0 and the workers' least."""
        if 0 < self.temperature < MIN_TEMPERATURE:
            return InvalidRequest(f"temperature must be 0 (greedy) or within [{MIN_TEMPERATURE}, 2], "
                                  f"got {self.temperature!r}", "temperature")
        return None


class CompletionsBody(_Generation, kw_only=True):
    model: ModelName
    prompt: Text
    max_tokens: Annotated[int, Meta(ge=1, le=4096)] = 16
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def _asked(self) -> dict[str, bool]:
        return {**super()._asked(), "best_of": self.best_of not in (None, 1), "logprobs": self.logprobs is not None,
                "echo": self.echo, "suffix": self.suffix is not None}


class ChatMessage(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text
    name: Name | None = None


class ChatCompletionsBody(_Generation, kw_only=True):
    model: ModelName
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=256)]
    max_tokens: Annotated[int, Meta(ge=1, le=4096)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1, le=4096)] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Name | ToolChoice | None = None
    response_format: ResponseFormat | None = None

    def _asked(self) -> dict[str, bool]:
        return {**super()._asked(), "logprobs": self.logprobs, "top_logprobs": self.top_logprobs is not None,
                "tools": bool(self.tools), "tool_choice": self.tool_choice not in (None, "none"),
                "response_format": self.response_format is not None and self.response_format.type != "text"}


T = TypeVar("T")

# What OpenAI's API takes in these fields and kinfer does not: said so, not a schema error.
_UNSUPPORTED_SHAPES = {
    "prompt": "prompt must be one string: a list of prompts (use n requests) and token ids are not supported",
    "input": "input must be a string or a list of strings: token ids are not supported",
}


def openai_decode(data: bytes, kind: type[T]) -> T:
    """``decode`` for the OpenAI routes: a body that does not match is OpenAI's 400
    (``invalid_request_error`` naming ``param``), and the input shapes OpenAI takes that kinfer does
    not are named as such."""
    try:
        return decode(data, kind)
    except BadBody as exc:
        if exc.status != 422:
            raise
        text = str(exc)
        if exc.field in _UNSUPPORTED_SHAPES and "got `" in text:  # a type mismatch, not a length
            text = f"{_UNSUPPORTED_SHAPES[exc.field]} ({text})"
        raise InvalidRequest(text, exc.field or "body") from None


# -- the app ----------------------------------------------------------------------------------


class _Gateway:
    """The endpoints, over one ``Client`` started with the app."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self._client: Client | None = None
        # Tenants' buckets in Redis, shared by every gateway (their own bucket while Redis does not answer).
        self.limiter = RedisRateLimiter.from_url(settings.redis_url) if settings.tenants is not None else None

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
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

    @property
    def client(self) -> Client:
        if self._client is None:
            raise Unavailable("the gateway is starting")
        return self._client

    # -- who, how often, how urgent --

    def authenticate(self, headers: Any) -> Tenant | None:
        """The caller's tenant from its API key; None when the gateway runs without tenants."""
        tenants = self.settings.tenants
        if tenants is None:
            return None
        key = headers.get("x-api-key") or headers.get("authorization", "").removeprefix("Bearer ").strip()
        found = tenants.authenticate(key)
        if found is None:
            raise _Unauthorized()
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

    @staticmethod
    def priority_for(who: Tenant | None, asked: int) -> Priority:
        p = Priority(asked)
        return who.clamp(p) if who is not None else p

    @staticmethod
    def timeout_header(request: Request) -> int | None:
        raw = request.headers.get("x-request-timeout-ms")
        if raw is None:
            return None
        value = ascii_int(raw, MIN_TIMEOUT_MS, MAX_TIMEOUT_MS)
        if value is None:
            raise BadBody(f"X-Request-Timeout-Ms must be an integer in [{MIN_TIMEOUT_MS}, {MAX_TIMEOUT_MS}]",
                          "X-Request-Timeout-Ms")
        return value

    # -- probes --

    async def healthz(self, request: Request) -> Response:
        return json_response({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        status = await self.client.ping()
        models = await self.client.models() if status["kafka"] else []
        # Ready only with every reader running: reply readers, and the health watch admission obeys.
        ready = status["kafka"] and status["redis"] and status["replies"] and status["health"] and bool(models)
        return json_response({**status, "models": models, "ready": ready}, 200 if ready else 503)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        self.authenticate(request.headers)
        names = await self.client.models()
        return json_response(
            {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "kinfer"} for m in names]}
        )

    async def model(self, request: Request) -> Response:
        self.authenticate(request.headers)
        name = request.path_params["model"]
        if name not in await self.client.models():
            raise UnknownModel(f"model {name!r} is not served", "model")
        return json_response({"id": name, "object": "model", "created": 0, "owned_by": "kinfer"})

    # -- the native API --

    async def infer(self, request: Request) -> Response:
        who = self.authenticate(request.headers)
        body = decode(await read_body(request), InferBody)
        timeout_ms = self.timeout_header(request)
        name = await self.admit(who, "infer")
        started = time.perf_counter()
        result = await self.client.infer(
            request.path_params["model"], body.inputs, priority=self.priority_for(who, body.priority),
            deadline_ms=timeout_ms or body.timeout_ms or DEFAULT_TIMEOUT_MS, params=body.params, tenant=name,
        )
        LATENCY.labels(name, "infer").observe(time.perf_counter() - started)
        REQUESTS.labels(name, "infer", "200").inc()
        return json_response(result_json(result))

    async def stream(self, request: Request) -> Response:
        who = self.authenticate(request.headers)
        body = decode(await read_body(request), StreamBody)
        timeout_ms = self.timeout_header(request)
        name = await self.admit(who, "stream")
        chunks = self.client.stream(
            request.path_params["model"], body.prompt, priority=self.priority_for(who, body.priority),
            deadline_ms=timeout_ms or body.timeout_ms or DEFAULT_TIMEOUT_MS, params=body.params, tenant=name,
        )
        first = await _first(chunks)  # errors before the first chunk still get a status code
        REQUESTS.labels(name, "stream", "200").inc()
        return _sse_response(_sse(first, chunks, lambda c: [chunk_json(c)]))

    async def websocket(self, ws: WebSocket) -> None:
        """Requests in, results and chunks out; several requests in flight at once, answers as they finish.

        A text frame that is not a request gets an error message (the socket stays open); a binary frame
        closes the socket with 1003 (unsupported data).
        """
        await ws.accept()
        try:
            who = self.authenticate(ws.headers)
        except _Unauthorized:
            await ws.close(code=4401, reason="missing or unknown API key")
            return
        model = ws.path_params["model"]
        sending = asyncio.Lock()
        slots = asyncio.Semaphore(WS_IN_FLIGHT)
        tasks: set[asyncio.Task[None]] = set()

        async def send(payload: dict[str, Any]) -> None:
            async with sending:
                await ws.send_text(json_text(payload))

        async def serve(message: WsMessage) -> None:
            try:
                await self._ws_request(model, message, who, send)
            except (WebSocketDisconnect, RuntimeError):  # the caller left before its answer: nobody to tell
                pass
            except Exception:  # a fault of ours: said on the socket (as a 500 would be), which stays open
                log.exception("unexpected error on a WebSocket request to %s", model)
                with contextlib.suppress(WebSocketDisconnect, RuntimeError):
                    await send({"id": message.id, "code": 500, **error_body("internal", "internal error")})
            finally:
                slots.release()

        try:
            while True:
                frame = await ws.receive()
                if frame["type"] == "websocket.disconnect":
                    break
                text = frame.get("text")
                if text is None:
                    await ws.close(code=1003, reason="send requests as JSON text frames")
                    break
                try:
                    if len(text) > MAX_FRAME_BYTES:  # a server without ws_max_size=MAX_FRAME_BYTES let it in
                        raise BadBody(f"the frame is over {MAX_FRAME_BYTES} characters", status=413)
                    message = decode(text, WsMessage)
                except BadBody as exc:
                    await send({"id": None, "code": exc.status, **error_body("invalid", str(exc)[:2000], exc.field)})
                    continue
                await slots.acquire()
                task = asyncio.create_task(serve(message))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except WebSocketDisconnect:
            pass
        finally:
            for task in list(tasks):
                task.cancel()

    async def _ws_request(self, model: str, message: WsMessage, who: Tenant | None, send: Any) -> None:
        rid = str(message.id) if message.id is not None else uuid.uuid4().hex
        try:
            name = await self.admit(who, "ws")
            deadline = message.timeout_ms or DEFAULT_TIMEOUT_MS
            priority = self.priority_for(who, message.priority)
            if message.stream:
                if message.prompt is None:
                    raise BadBody("a stream request needs a prompt", "prompt")
                async for chunk in self.client.stream(model, message.prompt, priority=priority, deadline_ms=deadline,
                                                      params=message.params, tenant=name):
                    await send({**chunk_json(chunk), "id": rid, "request_id": chunk.id})
            else:
                if message.inputs is None:
                    raise BadBody("a request needs inputs", "inputs")
                result = await self.client.infer(model, message.inputs, priority=priority, deadline_ms=deadline,
                                                 params=message.params, tenant=name)
                await send({**result_json(result), "id": rid, "request_id": result.id})
        except KinferError as exc:
            code, payload, _ = error_payload(exc)
            await send({"id": rid, "code": code, **payload})
        except BadBody as exc:
            await send({"id": rid, "code": 422, **error_body("invalid", str(exc), exc.field)})

    # -- OpenAI-compatible --

    async def embeddings(self, request: Request) -> Response:
        who = self.authenticate(request.headers)
        body = openai_decode(await read_body(request), EmbeddingsBody)
        if body.dimensions is not None:
            raise InvalidRequest("dimensions is not supported: the model's vectors have a fixed size", "dimensions")
        timeout_ms = self.timeout_header(request)
        name = await self.admit(who, "embeddings")
        inputs = [body.input] if isinstance(body.input, str) else body.input
        started = time.perf_counter()
        result = await self.client.infer(body.model, inputs, deadline_ms=timeout_ms or DEFAULT_TIMEOUT_MS,
                                         priority=self.priority_for(who, 1), tenant=name)
        LATENCY.labels(name, "embeddings").observe(time.perf_counter() - started)
        if not all(isinstance(v, list) for v in result.outputs):
            raise InvalidRequest(f"model {body.model!r} does not produce embeddings", "model")
        REQUESTS.labels(name, "embeddings", "200").inc()
        # The tokenizer's count where the model reports it; else words, the nearest thing without one.
        tokens = result.tokens or sum(len(t.split()) for t in inputs)

        def encode(vector: list[float]) -> list[float] | str:
            if body.encoding_format == "base64":  # what the openai package asks for: float32, little-endian
                return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            return vector

        return json_response({
            "object": "list", "model": body.model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(result.outputs)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        })

    async def completions(self, request: Request) -> Response:
        who = self.authenticate(request.headers)
        body = openai_decode(await read_body(request), CompletionsBody)
        return await self._generate(request, who, body, body.prompt, [], body.max_tokens, "text_completion")

    async def chat_completions(self, request: Request) -> Response:
        who = self.authenticate(request.headers)
        body = openai_decode(await read_body(request), ChatCompletionsBody)
        max_tokens = body.max_completion_tokens or body.max_tokens or 16
        # The worker renders the turns with the model's own chat template (developer is OpenAI's new
        # name for system).
        turns = [Turn("system" if m.role == "developer" else m.role, m.content) for m in body.messages]
        return await self._generate(request, who, body, None, turns, max_tokens, "chat.completion")

    async def _generate(self, request: Request, who: Tenant | None, body: CompletionsBody | ChatCompletionsBody,
                        prompt: str | None, turns: list[Turn], max_tokens: int, kind: str) -> Response:
        """One generation from ``prompt`` or a chat's ``turns``, as an OpenAI text or chat completion
        (``kind``), whole or streamed."""
        if (field := body.unsupported()) is not None:
            raise InvalidRequest(f"{field} is not supported by this server (use its default)", field)
        if (refused := body.out_of_range()) is not None:
            raise refused
        timeout_ms = self.timeout_header(request)
        route = "completions" if kind == "text_completion" else "chat"
        name = await self.admit(who, route)
        params = body.params(max_tokens)
        deadline = timeout_ms or DEFAULT_TIMEOUT_MS
        created = int(time.time())
        cid = f"{'cmpl' if kind == 'text_completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        head = {"id": cid, "object": kind, "created": created, "model": body.model}
        if body.stream:
            chunks = self.client.stream(body.model, prompt, messages=turns, priority=self.priority_for(who, 1),
                                        deadline_ms=deadline, params=params, tenant=name)
            first = await _first(chunks)
            REQUESTS.labels(name, route, "200").inc()
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            chunk_head = {**head, "object": "chat.completion.chunk"} if kind != "text_completion" else head

            def openai_chunk(c: Chunk) -> list[dict[str, Any]]:
                finish = _finish(c.finish) if c.final else None
                if kind == "text_completion":
                    choice: dict[str, Any] = {"text": c.text, "index": 0, "logprobs": None, "finish_reason": finish}
                else:
                    delta = {"role": "assistant", "content": c.text} if c.seq == 0 else {"content": c.text}
                    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                events = [{**chunk_head, "choices": [choice]}]
                if include_usage:  # OpenAI's convention: usage null on every chunk, then a last one with it
                    events[0]["usage"] = None
                    if c.final:
                        usage = _usage(c.usage.prompt_tokens, c.usage.completion_tokens)
                        events.append({**chunk_head, "choices": [], "usage": usage})
                return events

            return _sse_response(_sse(first, chunks, openai_chunk))
        started = time.perf_counter()
        result = await self.client.infer(body.model, () if prompt is None else [prompt], messages=turns,
                                         priority=self.priority_for(who, 1),
                                         deadline_ms=deadline, params=params, tenant=name)
        LATENCY.labels(name, route).observe(time.perf_counter() - started)
        out = result.outputs[0] if result.outputs else None
        if not isinstance(out, dict) or "text" not in out:
            raise InvalidRequest(f"model {body.model!r} is not a generative model", "model")
        REQUESTS.labels(name, route, "200").inc()
        finish = _finish(out["finish"])
        if kind == "text_completion":
            choice = {"text": out["text"], "index": 0, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": out["text"]}, "logprobs": None,
                      "finish_reason": finish}
        return json_response({**head, "choices": [choice],
                              "usage": _usage(out["prompt_tokens"], out["completion_tokens"])})


def create_app(settings: GatewaySettings) -> Starlette:
    gw = _Gateway(settings)
    table: list[tuple[str, str, Any, Doc]] = [
        ("GET", "/healthz", gw.healthz, Doc("liveness", auth=False)),
        ("GET", "/readyz", gw.readyz, Doc("readiness: Kafka, Redis and at least one model",
                                          responses={503: "not ready"}, auth=False)),
        ("GET", "/metrics", gw.metrics, Doc("Prometheus metrics", auth=False)),
        ("GET", "/v1/models", gw.models, Doc("models with request topics")),
        ("GET", "/v1/models/{model}", gw.model,
         Doc("one model (OpenAI's models.retrieve)", responses={404: "not served"})),
        ("POST", "/v1/models/{model}/infer", gw.infer, Doc("one result", InferBody, _ERRORS, timeout_header=True)),
        ("POST", "/v1/models/{model}/stream", gw.stream,
         Doc("generation as Server-Sent Events", StreamBody, _ERRORS, stream=True, timeout_header=True)),
        ("POST", "/v1/embeddings", gw.embeddings,
         Doc("OpenAI-compatible embeddings", EmbeddingsBody, _ERRORS, timeout_header=True)),
        ("POST", "/v1/completions", gw.completions,
         Doc("OpenAI-compatible completions (stream: true for SSE)", CompletionsBody, _ERRORS, timeout_header=True)),
        ("POST", "/v1/chat/completions", gw.chat_completions,
         Doc("OpenAI-compatible chat completions (stream: true for SSE)", ChatCompletionsBody, _ERRORS,
             timeout_header=True)),
    ]
    document = openapi("kinfer gateway", "1", [(m, p, d) for m, p, _, d in table], (MIN_TIMEOUT_MS, MAX_TIMEOUT_MS))

    async def openapi_json(request: Request) -> Response:
        return json_response(document)

    async def docs(request: Request) -> Response:
        return docs_page("kinfer gateway")

    routes: list[Any] = [Route(path, endpoint, methods=[method]) for method, path, endpoint, _ in table]
    routes += [Route("/openapi.json", openapi_json, methods=["GET"]), Route("/docs", docs, methods=["GET"]),
               WebSocketRoute("/v1/models/{model}/ws", gw.websocket)]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            async with gw.lifespan(app):
                yield
        finally:
            if gw.limiter is not None:
                await gw.limiter.close()

    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        KinferError: _kinfer_error, BadBody: _bad_body, _Unauthorized: _unauthorized, HTTPException: _http_error,
        Exception: _internal,
    })


_ERRORS = {400: "invalid request", 404: "unknown model", 429: "rate limited or overloaded (Retry-After)",
           502: "the model failed", 503: "shed or unavailable (Retry-After)", 504: "deadline exceeded"}


async def _kinfer_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, KinferError)
    code, payload, headers = error_payload(exc)
    return json_response(payload, code, headers)


async def _bad_body(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, BadBody)
    metrics.GATEWAY_ERRORS.labels(str(exc.status), "BadBody").inc()
    return json_response(error_body("invalid", str(exc)[:2000], exc.field), exc.status)


async def _http_error(request: Request, exc: Exception) -> Response:
    """No such route (404) or method (405): the same error shape as every other answer."""
    assert isinstance(exc, HTTPException)
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return json_response(error_body(kind, message), exc.status_code, dict(exc.headers or {}))


async def _unauthorized(request: Request, exc: Exception) -> Response:
    return json_response(error_body("unauthorized", "missing or unknown API key"), 401,
                         {"WWW-Authenticate": "Bearer"})


async def _internal(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    metrics.GATEWAY_ERRORS.labels("500", type(exc).__name__).inc()
    return json_response(error_body("internal", "internal error"), 500)


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def result_json(result: Result) -> dict[str, Any]:
    return {"id": result.id, "model": result.model, "status": result.status.value, "outputs": result.outputs,
            "timings": result.timings, "worker": result.worker}


def chunk_json(chunk: Chunk) -> dict[str, Any]:
    return {"id": chunk.id, "model": chunk.model, "seq": chunk.seq, "text": chunk.text, "tokens": chunk.tokens,
            "final": chunk.final, "status": chunk.status, "finish": chunk.finish, "usage": chunk.usage}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def json_text(payload: Any) -> str:
    return msgspec.json.encode(payload).decode()


def error_payload(exc: KinferError) -> tuple[int, dict[str, Any], dict[str, str]]:
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


async def _first(chunks: AsyncIterator[Chunk]) -> Chunk:
    try:
        return await chunks.__anext__()
    except StopAsyncIteration as exc:
        raise Unavailable("the stream ended before its first chunk") from exc


def _sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _sse(first: Chunk, rest: AsyncIterator[Chunk], render: Any) -> AsyncIterator[bytes]:
    """Server-Sent Events: ``render`` turns a chunk into the events it stands for."""
    try:
        for event in render(first):
            yield b"data: " + msgspec.json.encode(event) + b"\n\n"
        if not first.final:
            async for chunk in rest:
                for event in render(chunk):
                    yield b"data: " + msgspec.json.encode(event) + b"\n\n"
        yield b"data: [DONE]\n\n"
    except KinferError as exc:  # after the first byte the status is sent: report in-band
        _, payload, _ = error_payload(exc)
        yield b"event: error\ndata: " + msgspec.json.encode(payload) + b"\n\n"
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
