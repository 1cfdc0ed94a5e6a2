"""HTTP plumbing for the gateway: bodies decoded by msgspec under a size cap, JSON answers, one error shape,
and the OpenAPI document generated from the same route table the app is built from.

The gateway runs on Starlette without a framework above it: on the hot route a framework's dependency
solving and per-field validation cost more CPU than the whole Kafka round trip (measured with py-spy on
``kinfer bench transport --path http``). msgspec validates a body against its ``Struct`` in C while
parsing it, so a deep or oversized document is refused without being built.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kinfer.producers.metrics import GATEWAY_ERRORS

HEADER_TIMEOUT_S = 10.0  # a connection must send each request's headers within this
MAX_HEADER_BYTES = 64 * 1024  # a request line and headers, together: past it, 431 and the connection closed
BODY_IDLE_S = 10.0  # a body that sends nothing for this long is given up (408)
BODY_MIN_RATE = 64 * 1024  # bytes/s a body must average after its first BODY_IDLE_S seconds
MAX_BODY_BYTES = 2 * 1_048_576  # a request record is at most 1,000,000 bytes packed; JSON may be about twice that
MAX_FRAME_BYTES = MAX_BODY_BYTES  # one WebSocket message (uvicorn's ws_max_size; its default is 16 MiB)
_FIELD = re.compile(r"at `\$\.?([A-Za-z_][\w]*)")
_ENCODER = msgspec.json.Encoder()
T = TypeVar("T")


def return_freed_buffers(threshold: int = 128 * 1024) -> bool:
    """Make glibc give back to the system, when freed, every block of ``threshold`` bytes or more.

    glibc raises its mmap threshold each time a large block is freed (up to 32 MiB), so after the first
    upload or download the chunk-sized buffers of the next come from the heap, which fragments and does
    not shrink: stalled transfers then held 50 MiB of RSS that no transfer used. Setting the threshold
    fixes it. False where the C library is not glibc (the call is glibc's), and nothing changes."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    m_mmap_threshold = -3
    return bool(mallopt(m_mmap_threshold, threshold))


class BadBody(Exception):
    """The body does not parse, or does not match the route's schema: 422 (413 when too large)."""

    def __init__(self, message: str, field: str | None = None, status: int = 422) -> None:
        super().__init__(message)
        self.field = field
        self.status = status


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_ENCODER.encode(payload), status, headers, media_type="application/json")


def error_body(kind: str, message: str, field: str | None = None) -> dict[str, Any]:
    """The one error shape of every route, OpenAI's: ``{"error": {"type", "message", "param", "code"}}``,
    plus ``field`` (the same as ``param``) when a field is to blame."""
    error: dict[str, Any] = {"type": kind, "message": message, "param": field, "code": None}
    if field:
        error["field"] = field
    return {"error": error}


def ascii_int(raw: str, low: int, high: int) -> int | None:
    """``raw`` as an integer within [low, high] when it is one written in ASCII digits, else None.

    ``int()`` alone takes Unicode digits ("²" passes ``isdigit`` and fails ``int``), signs, spaces and
    underscores, and refuses more than 4,300 digits with a ValueError: none of that reaches it here.
    """
    if not (0 < len(raw) <= len(str(high)) and raw.isascii() and raw.isdigit()):
        return None
    value = int(raw)
    return value if low <= value <= high else None


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body, whole, at most ``limit`` bytes, read in time (``body_pieces``)."""
    data = bytearray()
    async for piece in body_pieces(request, limit):
        data += piece
    return bytes(data)


async def body_pieces(request: Request, limit: int = MAX_BODY_BYTES) -> AsyncIterator[bytes]:
    """The body as it arrives, at most ``limit`` bytes (413 past it), read in time: nothing for
    ``BODY_IDLE_S``, or less than ``BODY_MIN_RATE`` on average after that, and it is given up (408): a
    caller that stops half-way holds what it sent for seconds, not for ever."""
    length = request.headers.get("content-length")
    if length is not None and ascii_int(length, 0, limit) is None:
        if length.isascii() and length.isdigit():
            raise BadBody(f"the body is over {limit} bytes", status=413)
        raise BadBody("Content-Length is not a number of bytes", "Content-Length")
    size = 0
    loop = asyncio.get_running_loop()
    started = loop.time()
    pieces = request.stream().__aiter__()
    while True:
        due = max(BODY_IDLE_S, size / BODY_MIN_RATE) - (loop.time() - started)
        try:
            piece = await asyncio.wait_for(pieces.__anext__(), max(0.0, min(BODY_IDLE_S, due)))
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise BadBody(f"the body came too slowly (after {size} bytes)", status=408) from None
        size += len(piece)
        if size > limit:
            raise BadBody(f"the body is over {limit} bytes", status=413)
        yield piece


def decode(data: bytes | str, kind: type[T]) -> T:
    """Parse and validate in one pass: a value of ``kind``, or ``BadBody`` naming the offending field when
    there is one — nothing else, whatever ``data`` holds (the caller bounds its size first).

    Nesting is bounded by the interpreter's recursion limit (1,000 levels, less the stack in use): msgspec
    raises ``RecursionError`` past it, also inside an unknown field it skips; no schema here nests more
    than five levels, so a deeper document is never a valid one. JSON has no NaN or infinity, and a
    number beyond a double's range is refused as out of range: floats are finite.
    """
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as exc:
        found = _FIELD.search(str(exc))
        raise BadBody(str(exc), found.group(1) if found else None) from None
    except msgspec.DecodeError as exc:
        raise BadBody(f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadBody("the body nests deeper than the gateway reads (about 1,000 levels)") from None
    except UnicodeError:  # a str holding a lone surrogate cannot be UTF-8
        raise BadBody("the body is not valid UTF-8") from None


# -- the route table and its OpenAPI document -------------------------------------------------


@dataclass(frozen=True, slots=True)
class Doc:
    """What the OpenAPI document says about one route."""

    summary: str
    body: type | None = None  # a msgspec Struct
    responses: dict[int, str] | None = None  # status -> description, beyond 200
    stream: bool = False  # answers text/event-stream
    timeout_header: bool = False  # reads X-Request-Timeout-Ms
    auth: bool = True


Endpoint = Callable[[Request], Awaitable[Response]]

_BODY_ERRORS = {413: "body too large", 422: "body does not match the schema"}


def openapi(
    title: str, version: str, routes: list[tuple[str, str, Doc]], timeout_range: tuple[int, int]
) -> dict[str, Any]:
    bodies = [doc.body for _, _, doc in routes if doc.body is not None]
    refs, components = msgspec.json.schema_components(bodies, ref_template="#/components/schemas/{name}")
    by_type = dict(zip(bodies, refs, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for method, path, doc in routes:
        parameters: list[dict[str, Any]] = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
            for name in re.findall(r"{(\w+)}", path)
        ]
        if doc.timeout_header:
            low, high = timeout_range
            parameters.append({"name": "X-Request-Timeout-Ms", "in": "header", "required": False,
                               "schema": {"type": "integer", "minimum": low, "maximum": high}})
        content = "text/event-stream" if doc.stream else "application/json"
        responses: dict[str, Any] = {"200": {"description": "OK", "content": {content: {}}}}
        extra = {**(_BODY_ERRORS if doc.body is not None else {}), **(doc.responses or {})}
        if doc.auth:
            extra[401] = "missing or unknown API key"
        for status, description in sorted(extra.items()):
            responses[str(status)] = {"description": description}
        operation: dict[str, Any] = {"summary": doc.summary, "parameters": parameters, "responses": responses}
        if doc.body is not None:
            operation["requestBody"] = {"required": True,
                                        "content": {"application/json": {"schema": by_type[doc.body]}}}
        if doc.auth:
            operation["security"] = [{"bearer": []}, {"apiKey": []}]
        paths.setdefault(path, {})[method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"}},
        },
    }


def docs_page(title: str) -> HTMLResponse:
    """Swagger UI over ``/openapi.json`` (its scripts come from a CDN, as every framework's do)."""
    return HTMLResponse(f"""<!doctype html><html><head><title>{title}</title>
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"></head>
<body><div id="ui"></div><script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({{url: "/openapi.json", dom_id: "#ui"}})</script></body></html>""")


def guarded_protocol(header_timeout_s: float = HEADER_TIMEOUT_S) -> type[HttpToolsProtocol]:
    """uvicorn's HTTP protocol with a deadline on each request's headers.

    uvicorn closes a keep-alive connection that stays idle after a response (``timeout_keep_alive``),
    but not one that opens and says nothing, or sends its headers a byte at a time: a thousand of
    those hold a thousand sockets for ever. Here the headers of every request (the first, and each
    one after a response) must be complete within ``header_timeout_s``, or the connection is closed.
    A request that is being served has no deadline here (its own deadline governs it). The headers are
    bounded in size too: past ``MAX_HEADER_BYTES`` without their end, 431 and the connection is closed,
    so an unauthenticated caller cannot make the gateway hold a 16 MiB header to answer it 401.
    """

    class HeaderDeadline(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _header_bytes = 0  # read since the request began, its headers not complete yet

        def data_received(self, data: bytes) -> None:
            waiting = self._header_timer is not None
            super().data_received(data)
            if waiting and self._header_timer is not None:  # still no end of the headers
                self._header_bytes += len(data)
                if self._header_bytes > MAX_HEADER_BYTES:
                    self._refuse_headers()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.timeout_keep_alive_task is not None:  # idle now (no pipelined request was started)
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_bytes = 0
            self._header_timer = self.loop.call_later(header_timeout_s, self._expire)

        def _refuse_headers(self) -> None:
            """Headers past ``MAX_HEADER_BYTES``: 431 and the connection closed (nothing more of it is read)."""
            self._disarm()
            GATEWAY_ERRORS.labels("431", "HeadersTooLarge").inc()
            body = _ENCODER.encode(error_body("invalid", f"the request's headers are over {MAX_HEADER_BYTES} bytes"))
            if not self.transport.is_closing():
                self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json"
                                     b"\r\nconnection: close\r\ncontent-length: " + str(len(body)).encode()
                                     + b"\r\n\r\n" + body)
                self.transport.close()

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline
