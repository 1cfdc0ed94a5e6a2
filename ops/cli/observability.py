"""A command's logs and traces, as its environment asks.

Logs: text on stderr by default; ``KINFER_LOG_FORMAT=json`` makes each line one JSON object with
``ts``, ``level``, ``logger``, ``message`` (and ``exc`` with a traceback), plus, when the line was
written while a request was being handled, its ``request_id`` and the current span's ``trace_id``
and ``span_id`` (``topics.tracing``). A line says what kinfer wrote in its message and nothing else:
no request body, header, API key or signing secret is ever a field of a log line.

Traces: off unless ``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, ``console``, or any other
installed under the ``opentelemetry_traces_exporter`` entry point; ``none`` is off). ``otlp`` is
OTLP over HTTP/protobuf, which kinfer ships; ``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL=grpc`` asks for
gRPC, whose exporter package must then be installed. The SDK reads everything else itself:
``OTEL_SERVICE_NAME`` (default ``kinfer-<command>``), ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER`` and its argument, ``OTEL_EXPORTER_OTLP_*`` (endpoint, headers, timeout),
``OTEL_BSP_*`` (the batch span processor's delay and queue).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from importlib.metadata import entry_points
from typing import Any

from kinfer.topics import tracing


class JsonFormatter(logging.Formatter):
    """One JSON object per line; the request and trace a line was written under, when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or tracing.REQUEST_ID.get()
        if request_id is not None:
            line["request_id"] = request_id
        ids = tracing.current_ids()
        if ids is not None:
            line["trace_id"], line["span_id"] = ids
        elif (trace_id := getattr(record, "trace_id", None)) is not None:  # a line about one traced record
            line["trace_id"] = trace_id
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


class _TextIds(logging.Filter):
    """Text lines name their request too, when they have one."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = getattr(record, "request_id", None) or tracing.REQUEST_ID.get()
        record.ids = f" [{request_id}]" if request_id is not None else ""
        return True


def configure_logging(verbose: bool) -> None:
    """The root logger as ``KINFER_LOG_FORMAT`` (``text`` or ``json``) and ``--verbose`` say."""
    fmt = os.environ.get("KINFER_LOG_FORMAT", "text").strip().lower()
    if fmt not in ("text", "json"):
        raise ValueError(f"KINFER_LOG_FORMAT must be text or json, not {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.addFilter(_TextIds())
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s%(ids)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.getLogger("aiokafka").setLevel(logging.DEBUG if verbose else logging.WARNING)


def exporter_names() -> list[str]:
    """The entry-point names ``OTEL_TRACES_EXPORTER`` asks for (empty: tracing off)."""
    raw = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not raw or raw == "none":
        return []
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip()
    names = []
    for name in (n.strip() for n in raw.split(",")):
        if name == "otlp":
            if protocol not in ("http/protobuf", "grpc"):
                raise ValueError(f"OTLP protocol {protocol!r} is not one kinfer exports with (http/protobuf, grpc)")
            name = "otlp_proto_grpc" if protocol == "grpc" else "otlp_proto_http"
        if name and name != "none":
            names.append(name)
    return names


def configure_tracing(command: str) -> bool:
    """Install an SDK tracer provider with the exporters ``OTEL_TRACES_EXPORTER`` names; False when off.
    Spans leave through a batch span processor each, flushed when the process exits."""
    names = exporter_names()
    if not names:
        return False
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    available = {ep.name: ep for ep in entry_points(group="opentelemetry_traces_exporter")}
    missing = [n for n in names if n not in available]
    if missing:
        raise ValueError(f"OTEL_TRACES_EXPORTER: no exporter {', '.join(missing)} is installed "
                         f"(installed: {', '.join(sorted(available))})")
    named = "OTEL_SERVICE_NAME" in os.environ or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    resource = Resource.create({} if named else {"service.name": f"kinfer-{command}"})
    provider = TracerProvider(resource=resource)  # the sampler: OTEL_TRACES_SAMPLER (parent-based, always on)
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(available[name].load()()))
    trace.set_tracer_provider(provider)
    tracing.reset()
    return True


__all__ = ["JsonFormatter", "configure_logging", "configure_tracing", "exporter_names"]
