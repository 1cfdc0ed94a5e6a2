"""kinfer's own routes: one result as JSON, a generation as Server-Sent Events, many requests on a WebSocket.

    POST /v1/models/{model}/infer     one result, synchronous JSON (``INFER``)
    POST /v1/models/{model}/stream    generation as Server-Sent Events (``STREAM``)
    WS   /v1/models/{model}/ws        requests in, results and stream chunks out, on one socket (``WebSocketAPI``)

The two HTTP routes go through ``Gateway.serve``. The WebSocket authenticates once per socket, then
admits each request on it (route ``ws``) and answers every error on the socket, which stays open.
Bodies are refused while they are parsed: unknown fields too (a misspelt field is an error here,
not a default).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import msgspec
from msgspec import Meta
from starlette.websockets import WebSocket, WebSocketDisconnect

from kinfer.producers.gateway_pipeline import (
    DEFAULT_TIMEOUT_MS,
    MAX_NAME_CHARS,
    MAX_TIMEOUT_MS,
    MIN_TIMEOUT_MS,
    Admitted,
    Gateway,
    Route,
    Streamed,
    Text,
    Texts,
    Unauthorized,
    error_payload,
    priority_for,
    sse_response,
)
from kinfer.producers.http import MAX_FRAME_BYTES, BadBody, decode, error_body, json_response
from kinfer.producers.tenants import Tenant
from kinfer.topics import Chunk, KinferError, Result
from kinfer.topics.envelope import DEFAULT_LIMITS

log = logging.getLogger(__name__)

WS_IN_FLIGHT = 64  # requests one WebSocket may have outstanding; more wait for a slot

PriorityField = Annotated[int, Meta(ge=0, le=2, description="0 interactive, 1 standard, 2 batch")]
TimeoutField = Annotated[int, Meta(ge=MIN_TIMEOUT_MS, le=MAX_TIMEOUT_MS, description="deadline, ms from now")]
ParamKey = Annotated[str, Meta(max_length=MAX_NAME_CHARS)]
ParamValue = Annotated[str, Meta(max_length=DEFAULT_LIMITS.max_param_chars)] | int | float | bool | None
Params = Annotated[dict[ParamKey, ParamValue], Meta(max_length=DEFAULT_LIMITS.max_params)]


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


def result_json(result: Result) -> dict[str, Any]:
    return {"id": result.id, "model": result.model, "status": result.status.value, "outputs": result.outputs,
            "timings": result.timings, "worker": result.worker}


def chunk_json(chunk: Chunk) -> dict[str, Any]:
    return {"id": chunk.id, "model": chunk.model, "seq": chunk.seq, "text": chunk.text, "tokens": chunk.tokens,
            "final": chunk.final, "status": chunk.status, "finish": chunk.finish, "usage": chunk.usage}


# -- the HTTP routes ------------------------------------------------------------------------


async def _infer(call: Admitted, body: InferBody) -> Result:
    return await call.infer(call.request.path_params["model"], body.inputs, priority=call.priority(body.priority),
                            deadline_ms=call.deadline_ms(body.timeout_ms), params=body.params)


async def _stream(call: Admitted, body: StreamBody) -> Streamed:
    return await call.stream(call.request.path_params["model"], body.prompt, priority=call.priority(body.priority),
                             deadline_ms=call.deadline_ms(body.timeout_ms), params=body.params)


INFER: Route[InferBody, Result] = Route(
    "infer", lambda data: decode(data, InferBody), _infer, lambda body, result: json_response(result_json(result)),
)
STREAM: Route[StreamBody, Streamed] = Route(
    "stream", lambda data: decode(data, StreamBody), _stream,
    lambda body, stream: sse_response(stream, lambda chunk: [chunk_json(chunk)]),
)


# -- the WebSocket --------------------------------------------------------------------------

Send = Callable[[dict[str, Any]], Awaitable[None]]


class WebSocketAPI:
    """``WS /v1/models/{model}/ws``: requests in, results and chunks out; several requests in flight at
    once, answers as they finish.

    A text frame that is not a request gets an error message (the socket stays open); a binary frame
    closes the socket with 1003 (unsupported data).
    """

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def serve(self, ws: WebSocket) -> None:
        await ws.accept()
        try:
            who = self.gateway.authenticate(ws.headers)
        except Unauthorized:
            await ws.close(code=4401, reason="missing or unknown API key")
            return
        model = ws.path_params["model"]
        sending = asyncio.Lock()
        slots = asyncio.Semaphore(WS_IN_FLIGHT)
        tasks: set[asyncio.Task[None]] = set()

        async def send(payload: dict[str, Any]) -> None:
            async with sending:
                try:
                    await ws.send_text(msgspec.json.encode(payload).decode())
                except RuntimeError as exc:  # Starlette's word for a socket that closed under the send
                    raise WebSocketDisconnect(1006) from exc

        async def serve(message: WsMessage) -> None:
            try:
                await self._request(model, message, who, send)
            except WebSocketDisconnect:  # the caller left before its answer: nobody to tell
                pass
            except Exception:  # a fault of ours, RuntimeError included: said on the socket as a 500 would be
                log.exception("unexpected error on a WebSocket request to %s", model)
                with contextlib.suppress(WebSocketDisconnect):
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

    async def _request(self, model: str, message: WsMessage, who: Tenant | None, send: Send) -> None:
        """One request from the socket, answered on it: the result, or each chunk, or the error."""
        rid = str(message.id) if message.id is not None else uuid.uuid4().hex
        try:
            name = await self.gateway.admit(who, "ws")
            deadline = message.timeout_ms or DEFAULT_TIMEOUT_MS
            priority = priority_for(who, message.priority)
            if message.stream:
                if message.prompt is None:
                    raise BadBody("a stream request needs a prompt", "prompt")
                async for chunk in self.gateway.client.stream(model, message.prompt, priority=priority,
                                                              deadline_ms=deadline, params=message.params,
                                                              tenant=name):
                    await send({**chunk_json(chunk), "id": rid, "request_id": chunk.id})
            else:
                if message.inputs is None:
                    raise BadBody("a request needs inputs", "inputs")
                result = await self.gateway.client.infer(model, message.inputs, priority=priority,
                                                         deadline_ms=deadline, params=message.params, tenant=name)
                await send({**result_json(result), "id": rid, "request_id": result.id})
        except KinferError as exc:
            code, payload, _ = error_payload(exc)
            await send({"id": rid, "code": code, **payload})
        except BadBody as exc:
            await send({"id": rid, "code": 422, **error_body("invalid", str(exc), exc.field)})
