"""A minimal OTLP/HTTP trace receiver: what a collector's ``otlp`` receiver does with ``POST /v1/traces``
(protobuf, optionally gzip), and no more. It keeps the spans it was sent, flattened, so a test can read
one request's trace across processes, and ``kinfer bench transport --trace-ratio`` has a receiver that
costs the exporters what a real one would (an HTTP round trip per batch of spans).

Loopback only; it trusts its senders (the processes the test or the bench started).
"""

from __future__ import annotations

import gzip
import threading
import zlib
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

MAX_BODY_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    service: str  # the sender's service.name
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root span
    kind: int  # OTLP's SpanKind: 1 internal, 2 server, 3 client, 4 producer, 5 consumer
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: tuple[tuple[str, str], ...]  # (trace id, span id) of each link


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return None if kind is None else getattr(v, kind)


def flatten(request: ExportTraceServiceRequest) -> list[ReceivedSpan]:
    spans = []
    for rs in request.resource_spans:
        service = next((str(_value(a.value)) for a in rs.resource.attributes if a.key == "service.name"), "")
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(ReceivedSpan(
                    service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.kind,
                    s.start_time_unix_nano, s.end_time_unix_nano, {a.key: _value(a.value) for a in s.attributes},
                    tuple((link.trace_id.hex(), link.span_id.hex()) for link in s.links),
                ))
    return spans


class OtlpSink:
    """``with OtlpSink() as sink``: listening on ``sink.endpoint`` (for ``OTEL_EXPORTER_OTLP_ENDPOINT``)."""

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep  # False: count the spans, keep none (a long benchmark)
        self.spans: list[ReceivedSpan] = []
        self.received = 0  # spans
        self.requests = 0  # export calls
        self.refused = 0  # bodies that were not export requests
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                try:  # a body that is not an export request is refused, and the receiver goes on
                    length = int(self.headers.get("content-length") or 0)
                    if not 0 <= length <= MAX_BODY_BYTES:
                        raise ValueError(f"a body of {length} bytes")
                    body = self.rfile.read(length)
                    if self.headers.get("content-encoding") == "gzip":
                        body = gzip.decompress(body)
                    message = ExportTraceServiceRequest()
                    message.ParseFromString(body)
                except (ValueError, OSError, EOFError, zlib.error, DecodeError) as exc:
                    sink.refused += 1
                    self.send_error(400, explain=type(exc).__name__)
                    return
                sink._take(message)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-sink", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _take(self, message: ExportTraceServiceRequest) -> None:
        spans = flatten(message)
        with self._lock:
            self.requests += 1
            self.received += len(spans)
            if self.keep:
                self.spans.extend(spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        """The spans of one trace received so far, by start time."""
        with self._lock:
            return sorted((s for s in self.spans if s.trace_id == trace_id), key=lambda s: s.start_ns)

    def __enter__(self) -> OtlpSink:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


__all__ = ["OtlpSink", "ReceivedSpan", "flatten"]
