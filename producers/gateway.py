"""The HTTP gateway: a thin shell over the client library.

    POST /v1/models/{model}/infer     one result, synchronous JSON
    POST /v1/models/{model}/stream    generation as Server-Sent Events
    WS   /v1/models/{model}/ws        requests in, results and stream chunks out, on one socket
    GET  /v1/models                   models with request topics
    POST /v1/embeddings               OpenAI-compatible
    POST /v1/completions              OpenAI-compatible (``stream: true`` for SSE)
    GET  /healthz  /readyz  /metrics  /openapi.json

Every request goes through the same ``Client`` (same validation, same typed errors), under the
tenant its API key names (``Authorization: Bearer <key>`` or ``X-API-Key``), after that tenant's
token bucket, at no better than its priority ceiling. Errors map to status codes in one place
(``_STATUS``): invalid → 400 (422 for a body that does not parse), unknown model → 404, rate
limit or overload → 429 / shed → 503 with ``Retry-After``, deadline → 504, Kafka/Redis down → 503.
A client deadline travels from ``X-Request-Timeout-Ms`` or the body's ``timeout_ms``.
"""

from __future__ import annotations

import base64
import gc
import json
import struct
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from fastapi import Depends, FastAPI, Header, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from producers import metrics
from producers.client import Client
from producers.tenants import Tenant, Tenants
from topics import (
    Chunk,
    DeadlineExceeded,
    InvalidRequest,
    KinferError,
    ModelError,
    Overloaded,
    Priority,
    Result,
    Shed,
    Unavailable,
    UnknownModel,
)

DEFAULT_TIMEOUT_MS = 30_000
MIN_TIMEOUT_MS = 1_000  # below this an HTTP round trip plus a forward pass is not a fair promise
MAX_TIMEOUT_MS = 600_000

REQUESTS = Counter("kinfer_gateway_requests_total", "Gateway requests", ["tenant", "route", "code"])
LATENCY = Histogram(
    "kinfer_gateway_seconds", "Gateway request latency", ["tenant", "route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)

# One table from typed errors to HTTP: (status, retry-after seconds or None).
_STATUS: list[tuple[type[KinferError], int]] = [
    (UnknownModel, 404),
    (InvalidRequest, 400),
    (Overloaded, 429),
    (Shed, 503),
    (DeadlineExceeded, 504),
    (Unavailable, 503),
    (ModelError, 502),
]


class RateLimited(Overloaded):
    """The tenant's token bucket is empty."""


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    bootstrap: str
    redis_url: str
    tenants: Tenants | None = None  # None: no authentication (local use only)


# -- request bodies ---------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


PriorityField = Annotated[int, Field(ge=0, le=2, description="0 interactive, 1 standard, 2 batch")]
TimeoutField = Annotated[int, Field(ge=MIN_TIMEOUT_MS, le=MAX_TIMEOUT_MS, description="deadline, ms from now")]
Scalar = str | int | float | bool | None


class InferBody(_Body):
    inputs: str | list[Annotated[str, Field(max_length=16_384)]] = Field(description="one text or a list")
    priority: PriorityField = 1
    timeout_ms: TimeoutField | None = None
    params: dict[str, Scalar] = Field(default_factory=dict, max_length=32)


class StreamBody(_Body):
    prompt: str = Field(max_length=16_384)
    priority: PriorityField = 1
    timeout_ms: TimeoutField | None = None
    params: dict[str, Scalar] = Field(default_factory=dict, max_length=32)


class EmbeddingsBody(BaseModel):
    model: str = Field(max_length=63)
    input: str | list[Annotated[str, Field(max_length=16_384)]]
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None


class CompletionsBody(BaseModel):
    model: str = Field(max_length=63)
    prompt: str = Field(max_length=16_384)
    max_tokens: int = Field(default=16, ge=1, le=4096)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**62)
    stream: bool = False
    user: str | None = None


# -- the app ----------------------------------------------------------------------------------


def create_app(settings: GatewaySettings) -> FastAPI:
    state: dict[str, Client] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = Client(settings.bootstrap, settings.redis_url, tenant="gateway")
        await client.start()
        state["client"] = client
        gc.collect()
        gc.freeze()  # the app's long-lived objects leave the cyclic GC's scans (~37 ms a full collection)
        try:
            yield
        finally:
            await client.close()

    app = FastAPI(title="kinfer gateway", version="1", lifespan=lifespan)
    app.state.tenants = settings.tenants

    def client() -> Client:
        return state["client"]

    @app.exception_handler(_Unauthorized)
    async def _unauthorized(request: Request, exc: _Unauthorized) -> JSONResponse:
        return JSONResponse({"error": {"type": "unauthorized", "message": "missing or unknown API key"}}, 401,
                            headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(KinferError)
    async def _kinfer_error(request: Request, exc: KinferError) -> JSONResponse:
        return error_response(exc)

    def admit(who: Tenant | None, route: str) -> str:
        """Rate limit; returns the tenant name for metrics and the envelope."""
        if who is None:
            return "anonymous"
        wait = who.bucket.take(time.monotonic())
        if wait > 0:
            REQUESTS.labels(who.name, route, "429").inc()
            raise RateLimited(f"tenant {who.name!r} is over its rate of {who.rate_per_s}/s", retry_after_s=wait)
        return who.name

    def priority_for(who: Tenant | None, asked: int) -> Priority:
        p = Priority(asked)
        return who.clamp(p) if who is not None else p

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        status = await client().ping()
        models = await client().models() if status["kafka"] else []
        ready = status["kafka"] and status["redis"] and bool(models)
        return JSONResponse({**status, "models": models, "ready": ready}, 200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(who: Who) -> dict[str, Any]:
        names = await client().models()
        return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "kinfer"} for m in names]}

    @app.post("/v1/models/{model}/infer")
    async def infer(model: str, body: InferBody, who: Who, timeout_ms: TimeoutHeader = None) -> dict[str, Any]:
        name = admit(who, "infer")
        with LATENCY.labels(name, "infer").time():
            result = await client().infer(
                model, body.inputs, priority=priority_for(who, body.priority),
                deadline_ms=timeout_ms or body.timeout_ms or DEFAULT_TIMEOUT_MS, params=body.params, tenant=name,
            )
        REQUESTS.labels(name, "infer", "200").inc()
        return result_json(result)

    @app.post("/v1/models/{model}/stream")
    async def stream(model: str, body: StreamBody, who: Who, timeout_ms: TimeoutHeader = None) -> StreamingResponse:
        name = admit(who, "stream")
        chunks = client().stream(
            model, body.prompt, priority=priority_for(who, body.priority),
            deadline_ms=timeout_ms or body.timeout_ms or DEFAULT_TIMEOUT_MS, params=body.params, tenant=name,
        )
        first = await _first(chunks)  # errors before the first chunk still get a status code
        REQUESTS.labels(name, "stream", "200").inc()
        return StreamingResponse(_sse(first, chunks, chunk_json), media_type="text/event-stream")

    @app.websocket("/v1/models/{model}/ws")
    async def websocket(ws: WebSocket, model: str) -> None:
        await ws.accept()
        key = ws.headers.get("x-api-key") or ws.headers.get("authorization", "").removeprefix("Bearer ").strip()
        who = settings.tenants.authenticate(key) if settings.tenants is not None else None
        if settings.tenants is not None and who is None:
            await ws.close(code=4401, reason="missing or unknown API key")
            return
        try:
            while True:
                message = await ws.receive_json()
                await _ws_request(ws, model, message, who)
        except WebSocketDisconnect:
            return

    async def _ws_request(ws: WebSocket, model: str, message: Any, who: Tenant | None) -> None:
        rid = str(message.get("id") or uuid.uuid4().hex) if isinstance(message, dict) else uuid.uuid4().hex
        try:
            name = admit(who, "ws")
            if not isinstance(message, dict):
                raise InvalidRequest("each message must be a JSON object", "message")
            streaming = bool(message.get("stream", False))
            body = (StreamBody if streaming else InferBody).model_validate(
                {k: v for k, v in message.items() if k not in ("id", "stream")}
            )
            deadline = body.timeout_ms or DEFAULT_TIMEOUT_MS
            if isinstance(body, StreamBody):
                async for chunk in client().stream(model, body.prompt, priority=priority_for(who, body.priority),
                                                   deadline_ms=deadline, params=body.params, tenant=name):
                    await ws.send_json({**chunk_json(chunk), "id": rid, "request_id": chunk.id})
            else:
                result = await client().infer(model, body.inputs, priority=priority_for(who, body.priority),
                                              deadline_ms=deadline, params=body.params, tenant=name)
                await ws.send_json({**result_json(result), "id": rid, "request_id": result.id})
        except KinferError as exc:
            code, payload, _ = error_payload(exc)
            await ws.send_json({"id": rid, "code": code, **payload})
        except ValueError as exc:  # pydantic's ValidationError is one
            await ws.send_json({"id": rid, "code": 422, "error": {"type": "invalid", "message": str(exc)[:2000]}})

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingsBody, who: Who, timeout_ms: TimeoutHeader = None) -> dict[str, Any]:
        name = admit(who, "embeddings")
        inputs = [body.input] if isinstance(body.input, str) else body.input
        with LATENCY.labels(name, "embeddings").time():
            result = await client().infer(body.model, inputs, deadline_ms=timeout_ms or DEFAULT_TIMEOUT_MS,
                                          priority=priority_for(who, 1), tenant=name)
        if not all(isinstance(v, list) for v in result.outputs):
            raise InvalidRequest(f"model {body.model!r} does not produce embeddings", "model")
        REQUESTS.labels(name, "embeddings", "200").inc()
        tokens = sum(len(t.split()) for t in inputs)
        def encode(vector: list[float]) -> list[float] | str:
            if body.encoding_format == "base64":  # what the openai package asks for: float32, little-endian
                return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            return vector

        return {
            "object": "list", "model": body.model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(result.outputs)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    @app.post("/v1/completions", response_model=None)
    async def completions(
        body: CompletionsBody, who: Who, timeout_ms: TimeoutHeader = None
    ) -> dict[str, Any] | StreamingResponse:
        name = admit(who, "completions")
        stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        params: dict[str, Any] = {"max_new_tokens": body.max_tokens, "temperature": body.temperature,
                                  "top_p": body.top_p, "seed": body.seed}
        if stop:
            params["stop"] = "\x1f".join(s for s in stop if s)
        deadline = timeout_ms or DEFAULT_TIMEOUT_MS
        created = int(time.time())
        cid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            chunks = client().stream(body.model, body.prompt, priority=priority_for(who, 1), deadline_ms=deadline,
                                     params=params, tenant=name)
            first = await _first(chunks)
            REQUESTS.labels(name, "completions", "200").inc()

            def openai_chunk(c: Chunk) -> dict[str, Any]:
                return {"id": cid, "object": "text_completion", "created": created, "model": body.model,
                        "choices": [{"text": c.text, "index": 0, "logprobs": None,
                                     "finish_reason": _finish(c.finish) if c.final else None}]}

            return StreamingResponse(_sse(first, chunks, openai_chunk), media_type="text/event-stream")
        with LATENCY.labels(name, "completions").time():
            result = await client().infer(body.model, [body.prompt], priority=priority_for(who, 1),
                                          deadline_ms=deadline, params=params, tenant=name)
        out = result.outputs[0] if result.outputs else None
        if not isinstance(out, dict) or "text" not in out:
            raise InvalidRequest(f"model {body.model!r} is not a generative model", "model")
        REQUESTS.labels(name, "completions", "200").inc()
        return {
            "id": cid, "object": "text_completion", "created": created, "model": body.model,
            "choices": [{"text": out["text"], "index": 0, "logprobs": None, "finish_reason": _finish(out["finish"])}],
            "usage": {"prompt_tokens": out["prompt_tokens"], "completion_tokens": out["completion_tokens"],
                      "total_tokens": out["prompt_tokens"] + out["completion_tokens"]},
        }

    return app


class _Unauthorized(Exception):
    pass


async def _tenant(
    request: Request,
    authorization: Annotated[str | None, Header()] = None,
    x_api_key: Annotated[str | None, Header()] = None,
) -> Tenant | None:
    """The caller's tenant from its API key; None when the gateway runs without tenants."""
    tenants: Tenants | None = request.app.state.tenants
    if tenants is None:
        return None
    key = x_api_key or (authorization.removeprefix("Bearer ").strip() if authorization else None)
    found = tenants.authenticate(key)
    if found is None:
        raise _Unauthorized()
    return found


Who = Annotated[Tenant | None, Depends(_tenant)]
TimeoutHeader = Annotated[int | None, Header(alias="X-Request-Timeout-Ms", ge=MIN_TIMEOUT_MS, le=MAX_TIMEOUT_MS)]


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def result_json(result: Result) -> dict[str, Any]:
    return {"id": result.id, "model": result.model, "status": result.status.value, "outputs": result.outputs,
            "timings": msgspec.to_builtins(result.timings), "worker": result.worker}


def chunk_json(chunk: Chunk) -> dict[str, Any]:
    return {"id": chunk.id, "model": chunk.model, "seq": chunk.seq, "text": chunk.text, "tokens": chunk.tokens,
            "final": chunk.final, "status": chunk.status, "finish": chunk.finish,
            "usage": msgspec.to_builtins(chunk.usage)}


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
    error: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
    field = getattr(exc, "field", None)
    if field:
        error["field"] = field
    return code, {"error": error}, headers


def error_response(exc: KinferError) -> JSONResponse:
    code, payload, headers = error_payload(exc)
    return JSONResponse(payload, code, headers=headers)


async def _first(chunks: AsyncIterator[Chunk]) -> Chunk:
    try:
        return await chunks.__anext__()
    except StopAsyncIteration as exc:
        raise Unavailable("the stream ended before its first chunk") from exc


async def _sse(first: Chunk, rest: AsyncIterator[Chunk], render: Any) -> AsyncIterator[bytes]:
    try:
        yield f"data: {json.dumps(render(first))}\n\n".encode()
        if not first.final:
            async for chunk in rest:
                yield f"data: {json.dumps(render(chunk))}\n\n".encode()
        yield b"data: [DONE]\n\n"
    except KinferError as exc:  # after the first byte the status is sent: report in-band
        _, payload, _ = error_payload(exc)
        yield f"event: error\ndata: {json.dumps(payload)}\n\n".encode()
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
