"""The HTTP gateway: a thin shell over the client library.

    POST /v1/models/{model}/infer     one result, synchronous JSON
    POST /v1/models/{model}/stream    generation as Server-Sent Events
    WS   /v1/models/{model}/ws        requests in, results and stream chunks out, on one socket
    GET  /v1/models                   models with request topics
    POST /v1/embeddings               OpenAI-compatible
    POST /v1/completions              OpenAI-compatible (``stream: true`` for SSE)
    POST /v1/chat/completions         OpenAI-compatible chat (``stream: true`` for SSE)
    /v1/files, /v1/batches            OpenAI's Files and Batch API, on the background tier (``batch_api``)
    GET  /healthz  /readyz  /metrics  /openapi.json  /docs

Every request goes through the same ``Client`` (same validation, same typed errors), under the
tenant its API key names (``Authorization: Bearer <key>`` or ``X-API-Key``), after that tenant's
token bucket (in Redis, shared by all gateways: ``producers.ratelimit``), at no better than its
priority ceiling. Errors map to status codes in one place (``producers.gateway_pipeline``): invalid
→ 400 (422 for a body that does not parse or match its schema, 413 over ``MAX_BODY_BYTES``), unknown
model → 404, rate limit or overload → 429 / shed → 503 with ``Retry-After``, deadline → 504,
Kafka/Redis down → 503; every error body is ``{"error": {"type", "message", "param", "code"}}``
(OpenAI's). A client deadline travels from ``X-Request-Timeout-Ms`` or the body's ``timeout_ms``.

Starlette routes and msgspec bodies (``producers.http``): the OpenAPI document is generated from the
route table below, so what is documented is what is served.

Every body, frame and header is read by one bounded decode: its size first (``MAX_BODY_BYTES``,
``MAX_FRAME_BYTES``), then msgspec against a schema in which every field has a type and a bound (the
envelope's ``Limits`` for texts, inputs and params; no ``Any``) and nesting is bounded; a header's
number is ASCII digits within its range. Bad input is a 4xx naming the field, never a 500.

The gateway's modules, by concern:

    gateway.py            the app: its route table, the probes, errors as answers
    gateway_pipeline.py   authenticate → decode → admit → call → render, which every route goes through
    native_api.py         kinfer's own routes: infer, stream, the WebSocket
    openai_api.py         the OpenAI-compatible routes: models, embeddings, completions, chat completions
    batch_api.py          OpenAI's Files and Batch API (``batches.py``: its state in Kafka, and its runner)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute

from kinfer.producers import metrics, native_api, openai_api
from kinfer.producers.batch_api import BatchAPI, CreateBatchBody
from kinfer.producers.batches import BatchRunner, BatchStore
from kinfer.producers.gateway_pipeline import (
    MAX_TIMEOUT_MS,
    MIN_TIMEOUT_MS,
    Gateway,
    GatewaySettings,
    Unauthorized,
    error_payload,
)
from kinfer.producers.http import BadBody, Doc, docs_page, error_body, json_response, openapi
from kinfer.producers.native_api import InferBody, StreamBody, WebSocketAPI
from kinfer.producers.openai_api import ChatCompletionsBody, CompletionsBody, EmbeddingsBody, Models
from kinfer.topics import KinferError

__all__ = ["GatewaySettings", "create_app"]

log = logging.getLogger(__name__)

_ERRORS = {400: "invalid request", 404: "unknown model", 429: "rate limited or overloaded (Retry-After)",
           502: "the model failed", 503: "shed or unavailable (Retry-After)", 504: "deadline exceeded"}


def create_app(settings: GatewaySettings) -> Starlette:
    gw = Gateway(settings)
    probes, models, batch = _Probes(gw), Models(gw), BatchAPI(gw)
    # The one route table: it builds both the app and its OpenAPI document.
    table: list[tuple[str, str, Any, Doc]] = [
        ("GET", "/healthz", probes.healthz, Doc("liveness", auth=False)),
        ("GET", "/readyz", probes.readyz, Doc("readiness: Kafka, Redis and at least one model",
                                              responses={503: "not ready"}, auth=False)),
        ("GET", "/metrics", probes.metrics, Doc("Prometheus metrics", auth=False)),
        ("GET", "/v1/models", models.list_models, Doc("models with request topics")),
        ("GET", "/v1/models/{model}", models.retrieve,
         Doc("one model (OpenAI's models.retrieve)", responses={404: "not served"})),
        ("POST", "/v1/models/{model}/infer", gw.endpoint(native_api.INFER),
         Doc("one result", InferBody, _ERRORS, timeout_header=True)),
        ("POST", "/v1/models/{model}/stream", gw.endpoint(native_api.STREAM),
         Doc("generation as Server-Sent Events", StreamBody, _ERRORS, stream=True, timeout_header=True)),
        ("POST", "/v1/embeddings", gw.endpoint(openai_api.EMBEDDINGS),
         Doc("OpenAI-compatible embeddings", EmbeddingsBody, _ERRORS, timeout_header=True)),
        ("POST", "/v1/completions", gw.endpoint(openai_api.COMPLETIONS),
         Doc("OpenAI-compatible completions (stream: true for SSE)", CompletionsBody, _ERRORS, timeout_header=True)),
        ("POST", "/v1/chat/completions", gw.endpoint(openai_api.CHAT_COMPLETIONS),
         Doc("OpenAI-compatible chat completions (stream: true for SSE)", ChatCompletionsBody, _ERRORS,
             timeout_header=True)),
        ("POST", "/v1/files", batch.upload, Doc("upload a batch input file (multipart: purpose=batch, file)",
                                                 responses={400: "not a batch file", 413: "over 64 MiB"})),
        ("GET", "/v1/files", batch.list_files, Doc("the caller's files")),
        ("GET", "/v1/files/{file_id}", batch.get_file, Doc("one file", responses={404: "no such file"})),
        ("DELETE", "/v1/files/{file_id}", batch.delete_file, Doc("delete a file", responses={404: "no such file"})),
        ("GET", "/v1/files/{file_id}/content", batch.content,
         Doc("a file's bytes (a batch's output or error file)", responses={404: "no such file"})),
        ("POST", "/v1/batches", batch.create, Doc("start a batch", CreateBatchBody, {400: "invalid"})),
        ("GET", "/v1/batches", batch.list_batches, Doc("the caller's batches, newest first")),
        ("GET", "/v1/batches/{batch_id}", batch.get_batch, Doc("one batch", responses={404: "no such batch"})),
        ("POST", "/v1/batches/{batch_id}/cancel", batch.cancel,
         Doc("cancel a batch", responses={404: "no such batch", 409: "already ended"})),
    ]
    document = openapi("kinfer gateway", "1", [(m, p, d) for m, p, _, d in table], (MIN_TIMEOUT_MS, MAX_TIMEOUT_MS))

    async def openapi_json(request: Request) -> Response:
        return json_response(document)

    async def docs(request: Request) -> Response:
        return docs_page("kinfer gateway")

    routes: list[Any] = [Route(path, endpoint, methods=[method]) for method, path, endpoint, _ in table]
    routes += [Route("/openapi.json", openapi_json, methods=["GET"]), Route("/docs", docs, methods=["GET"]),
               WebSocketRoute("/v1/models/{model}/ws", WebSocketAPI(gw).serve)]
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with gw.lifespan(app):
            store = BatchStore(settings.bootstrap)
            await store.start()
            runner = BatchRunner(store, gw.client)
            runner.start()
            gw.batches = store
            try:
                yield
            finally:
                gw.batches = None
                await runner.close()
                await store.close()

    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        KinferError: _kinfer_error, BadBody: _bad_body, Unauthorized: _unauthorized, HTTPException: _http_error,
        ClientDisconnect: _client_gone, Exception: _internal,
    })


class _Probes:
    """Liveness, readiness and metrics: unauthenticated, and not counted as requests."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def healthz(self, request: Request) -> Response:
        return json_response({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        client = self.gateway.client
        status = await client.ping()
        models = await client.models() if status["kafka"] else []
        # Ready only with every reader running: reply readers, and the health watch admission obeys.
        ready = status["kafka"] and status["redis"] and status["replies"] and status["health"] and bool(models)
        return json_response({**status, "models": models, "ready": ready}, 200 if ready else 503)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


# -- errors as answers (the app's exception handlers) -------------------------------------------


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


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The caller hung up before its request was read whole: its doing, not an error of the gateway (counted
    as 499, nginx's "client closed request", one line at debug). Nobody reads the answer."""
    metrics.GATEWAY_ERRORS.labels("499", "ClientDisconnect").inc()
    log.debug("%s %s: the client hung up mid-request", request.method, request.url.path)
    return Response(status_code=499)


async def _internal(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    metrics.GATEWAY_ERRORS.labels("500", type(exc).__name__).inc()
    return json_response(error_body("internal", "internal error"), 500)
