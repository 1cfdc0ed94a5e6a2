"""Trace context: the W3C codec (any bytes in, a context or None out), each hop's span with tracing on
(an SDK provider with an in-memory exporter, never the global one), nothing at all with it off, and the
per-second bound on what senders can make a worker trace."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, TraceFlags

from kinfer.ops.bench.otlp_sink import OtlpSink
from kinfer.ops.cli.observability import JsonFormatter, configure_tracing, exporter_names
from kinfer.topics import tracing
from kinfer.topics.tracing import Parent, format_traceparent, parse_traceparent

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    monkeypatch.setenv("KINFER_TRACE_MAX_PER_S", "1000")
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    yield exporter
    tracing.reset()


def named(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    found = [s for s in exporter.get_finished_spans() if s.name == name]
    assert len(found) == 1, [s.name for s in exporter.get_finished_spans()]
    return found[0]


# -- the codec -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "expected"), [
    (f"00-{TRACE}-{SPAN}-01", Parent(int(TRACE, 16), int(SPAN, 16), 1)),
    (f"00-{TRACE}-{SPAN}-00".encode(), Parent(int(TRACE, 16), int(SPAN, 16), 0)),
    (f"01-{TRACE}-{SPAN}-09-later-fields", Parent(int(TRACE, 16), int(SPAN, 16), 9)),  # a later version
    (f"00-{TRACE}-{SPAN}-01-extra", None),  # version 00 has four fields exactly
    (f"ff-{TRACE}-{SPAN}-01", None),  # version ff is invalid
    (f"00-{'0' * 32}-{SPAN}-01", None),  # all-zero trace id
    (f"00-{TRACE}-{'0' * 16}-01", None),  # all-zero span id
    (f"00-{TRACE.upper()}-{SPAN}-01", None),  # hex is lower case
    (f"00-{TRACE}-{SPAN}-1", None),
    (b"\xff\xfe", None),
    ("", None),
    (None, None),
    ("00-" + "a" * 600, None),
])
def test_traceparent_values(raw: str | bytes | None, expected: Parent | None) -> None:
    assert parse_traceparent(raw) == expected


@given(st.binary(max_size=80) | st.text(max_size=80))
def test_any_value_is_a_parent_or_none(raw: bytes | str) -> None:
    parent = parse_traceparent(raw)
    assert parent is None or (parent.trace_id > 0 and parent.span_id > 0 and 0 <= parent.flags <= 255)


@given(st.integers(1, 2**128 - 1), st.integers(1, 2**64 - 1), st.integers(0, 255))
def test_format_and_parse_round_trip(trace_id: int, span_id: int, flags: int) -> None:
    text = format_traceparent(SpanContext(trace_id, span_id, is_remote=False, trace_flags=TraceFlags(flags)))
    assert parse_traceparent(text) == Parent(trace_id, span_id, flags)


# -- off ---------------------------------------------------------------------------------------------


def test_off_nothing_is_traced_and_headers_are_left_alone() -> None:
    tracing.reset()
    assert tracing.tracer() is None  # no SDK provider installed in this process
    headers = [("kinfer-kid", b"abcd1234")]
    with tracing.send_span("infer.m.p1", "r1", None, headers) as carried:
        assert carried is headers
    with tracing.request_span("m", "r1", 1) as span:
        assert span is None and tracing.REQUEST_ID.get() == "r1"
    assert tracing.REQUEST_ID.get() is None
    sampled = [("traceparent", f"00-{TRACE}-{SPAN}-01".encode())]
    assert tracing.incoming(sampled, "infer.m.p1", 0, 7, "r1", 1, 2) is None


# -- on ----------------------------------------------------------------------------------------------


def test_the_client_publishes_with_the_send_span_as_the_records_parent(spans: InMemorySpanExporter) -> None:
    with tracing.request_span("m", "r1", 1), tracing.send_span("infer.m.p1", "r1", 2, None) as carried:
        assert carried is not None
        parent = parse_traceparent(dict(carried)[tracing.TRACEPARENT])
    send, call = named(spans, "send infer.m.p1"), named(spans, "infer m")
    assert parent is not None and parent.sampled  # (bit 1 may say the trace id is random: W3C level 2)
    assert (parent.trace_id, parent.span_id) == (send.context.trace_id, send.context.span_id)
    assert send.parent is not None and send.parent.span_id == call.context.span_id
    assert send.attributes is not None and send.attributes["messaging.destination.partition.id"] == "2"


def test_the_worker_follows_the_senders_sampling_decision(spans: InMemorySpanExporter) -> None:
    unsampled = [("traceparent", f"00-{TRACE}-{SPAN}-00".encode())]
    assert tracing.incoming(unsampled, "infer.m.p1", 0, 1, "r1", 1_000, 2_000_000_000) is None
    assert spans.get_finished_spans() == ()
    sampled = [("traceparent", f"00-{TRACE}-{SPAN}-01".encode()), ("tracestate", b"k=v")]
    context = tracing.incoming(sampled, "infer.m.p1", 0, 1, "r2", 1_000, 2_000_000_000)
    assert context is not None
    queue = named(spans, "queue infer.m.p1")
    assert queue.context.trace_id == int(TRACE, 16) and queue.parent is not None
    assert queue.parent.span_id == int(SPAN, 16)
    assert (queue.start_time, queue.end_time) == (1_000_000_000, 2_000_000_000)  # record timestamp → fetched


@given(st.lists(st.tuples(st.sampled_from(["traceparent", "tracestate", "x"]), st.none() | st.binary(max_size=600)),
                max_size=4))
def test_no_header_a_sender_can_write_stops_the_worker(headers: list[tuple[str, bytes | None]]) -> None:
    provider = TracerProvider()
    tracing.use(provider)
    try:
        tracing.incoming(headers, "infer.m.p1", 0, 1, "r1", 1_000, 2_000_000_000)
    finally:
        tracing.reset()


def test_a_record_without_trace_context_is_traced_from_the_worker_on(spans: InMemorySpanExporter) -> None:
    context = tracing.incoming([("traceparent", b"garbage")], "infer.m.p1", 0, 1, "r1", 1_000, 2_000_000_000)
    assert context is not None
    queue = named(spans, "queue infer.m.p1")
    assert queue.parent is None  # a root: the worker's own sampler decided


def test_senders_cannot_make_a_worker_trace_more_than_its_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KINFER_TRACE_MAX_PER_S", "3")
    tracing.use(TracerProvider())
    try:
        sampled = [("traceparent", f"00-{TRACE}-{SPAN}-01".encode())]
        traced = [tracing.incoming(sampled, "t", 0, i, "r", 1, 2) is not None for i in range(10)]
        assert traced == [True] * 3 + [False] * 7  # within one second: three, then none
    finally:
        tracing.reset()


def test_a_batch_links_every_traced_request_and_each_compute_links_the_batch(spans: InMemorySpanExporter) -> None:
    contexts = []
    for i in range(3):
        parent = [("traceparent", f"00-{i + 1:032x}-{i + 1:016x}-01".encode())]
        context = tracing.incoming(parent, "infer.m.p1", 0, i, f"r{i}", 1_000, 2_000_000_000)
        assert context is not None
        contexts.append(context)
    ran = [tracing.Ran(c, f"r{i}", 2_000_000_000, 3_000_000_000, 4_000_000_000, 7, 5) for i, c in enumerate(contexts)]
    tracing.batch("m", ran)
    batch = named(spans, "batch m")
    assert [(link.context.trace_id, link.context.span_id) for link in batch.links] == [(i, i) for i in (1, 2, 3)]
    assert batch.context.trace_id == 1  # in the first request's trace
    computes = [s for s in spans.get_finished_spans() if s.name == "compute"]
    assert sorted(s.context.trace_id for s in computes) == [1, 2, 3]
    for s in computes:
        assert [link.context.span_id for link in s.links] == [batch.context.span_id]
        assert s.attributes is not None
        assert s.attributes["kinfer.batch.size"] == 7 and s.attributes["kinfer.tokens"] == 5
    waits = [s for s in spans.get_finished_spans() if s.name == "batch wait"]
    assert {(s.start_time, s.end_time) for s in waits} == {(2_000_000_000, 3_000_000_000)}


def test_the_reply_carries_the_reply_span_and_the_client_receives_under_it(spans: InMemorySpanExporter) -> None:
    context = tracing.incoming([("traceparent", f"00-{TRACE}-{SPAN}-01".encode())], "t", 0, 1, "r1", 1, 2)
    assert context is not None
    reply = tracing.reply_span(context, "r1", "ok")
    assert reply is not None
    carried = format_traceparent(reply.get_span_context())
    reply.end()
    tracing.received("redis", "r1", carried)
    tracing.received("redis", "r1", "not a traceparent")  # ignored
    tracing.received("redis", "r1", f"00-{TRACE}-{SPAN}-00")  # not sampled: ignored
    receive = named(spans, "receive redis")
    assert receive.parent is not None and receive.parent.span_id == reply.get_span_context().span_id


# -- logs and configuration --------------------------------------------------------------------------


def test_json_log_lines_name_the_request_and_trace_they_were_written_under(spans: InMemorySpanExporter) -> None:
    formatter = JsonFormatter()
    record = logging.LogRecord("kinfer.x", logging.WARNING, __file__, 1, "took %d ms", (5,), None)
    assert json.loads(formatter.format(record)).keys() == {"ts", "level", "logger", "message"}
    with tracing.request_span("m", "r-42", 1) as span:
        assert span is not None
        line = json.loads(formatter.format(record))
    assert line["request_id"] == "r-42" and line["message"] == "took 5 ms"
    assert line["trace_id"] == f"{span.get_span_context().trace_id:032x}"
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        failed = logging.LogRecord("kinfer.x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    assert "ValueError: boom" in json.loads(formatter.format(failed))["exc"]


@pytest.mark.parametrize(("env", "names"), [
    ({}, []),
    ({"OTEL_TRACES_EXPORTER": "none"}, []),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp_proto_http"]),
    ({"OTEL_TRACES_EXPORTER": "otlp,console", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, ["otlp_proto_grpc", "console"]),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
      "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}, ["otlp_proto_http"]),  # the signal's own wins
])
def test_exporters_from_the_standard_variables(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                               names: list[str]) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert exporter_names() == names


def test_an_exporter_that_is_not_installed_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ValueError, match="no exporter zipkin is installed"):
        configure_tracing("worker")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        exporter_names()


def test_wall_clock_of_a_monotonic_instant() -> None:
    assert tracing.wall_ns(10.0, now_mono=12.5, now_wall_ns=5_000_000_000) == 2_500_000_000
    assert abs(tracing.wall_ns(time.monotonic()) - time.time_ns()) < 50_000_000


def test_a_request_not_sampled_records_nothing_and_tells_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    try:
        with tracing.server_span("infer", "POST", "/v1/x", {}) as server, tracing.request_span("m", "r1", 1) as call, \
                tracing.send_span("infer.m.p1", "r1", None, None) as carried:
            assert server is None and call is None and carried is not None
            parent = parse_traceparent(dict(carried)[tracing.TRACEPARENT])
            assert parent is not None and not parent.sampled  # the worker skips it
        caller = {"traceparent": f"00-{TRACE}-{SPAN}-00"}  # the caller decided: not sampled, passed on
        with tracing.server_span("infer", "POST", "/v1/x", caller), \
                tracing.send_span("infer.m.p1", "r2", None, None) as carried:
            assert carried is not None
            assert parse_traceparent(dict(carried)[tracing.TRACEPARENT]) == Parent(int(TRACE, 16), int(SPAN, 16), 0)
        assert exporter.get_finished_spans() == ()
    finally:
        tracing.reset()


def test_a_line_about_one_traced_record_names_its_request_and_trace(spans: InMemorySpanExporter) -> None:
    context = tracing.incoming([("traceparent", f"00-{TRACE}-{SPAN}-01".encode())], "t", 0, 1, "r9", 1, 2)
    record = logging.LogRecord("kinfer.x", logging.ERROR, __file__, 1, "admitting failed", (), None)
    record.__dict__.update({"request_id": "r9", **tracing.log_ids(context)})
    line = json.loads(JsonFormatter().format(record))
    assert (line["request_id"], line["trace_id"]) == ("r9", TRACE)
    assert tracing.log_ids(None) == {}


# -- what comes in from outside: any header, any reply ``trace``, any export body ----------------------


_ANY = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=600)
                    | st.binary(max_size=600), lambda inner: st.lists(inner, max_size=3), max_leaves=20)


@given(st.dictionaries(st.sampled_from(["traceparent", "tracestate", "baggage", "x"]), st.text(max_size=700),
                       max_size=4))
def test_a_gateway_span_survives_any_caller_headers(headers: dict[str, str]) -> None:
    tracing.use(TracerProvider())
    try:
        with tracing.server_span("infer", "POST", "/v1/x", headers), tracing.request_span("m", "r", 1), \
                tracing.send_span("infer.m.p1", "r", None, None) as carried:
            assert carried is not None and parse_traceparent(dict(carried)[tracing.TRACEPARENT]) is not None
    finally:
        tracing.reset()


@given(_ANY)
def test_a_replys_trace_is_a_short_string_or_the_reply_is_refused(value: object) -> None:
    """Whatever a reply's ``trace`` holds (deep, NaN, huge, not text), the reply decodes with a string of
    at most 512 characters there, or is refused as malformed; the client's receipt never raises."""
    import msgpack

    from kinfer.topics import Result, decode_replies
    from kinfer.topics.envelope import ReplyRefused

    body = {"t": "res", "v": 1, "id": "r1", "model": "m", "status": "ok", "trace": value}
    try:
        data = msgpack.packb(body, use_bin_type=True)
    except (OverflowError, ValueError):
        return  # not msgpack at all
    try:
        opened = decode_replies(data)
    except ReplyRefused:
        return
    (reply,) = opened.replies
    assert isinstance(reply, Result)
    assert reply.trace is None or (isinstance(reply.trace, str) and len(reply.trace) <= 512)
    tracing.use(TracerProvider())
    try:
        tracing.received("redis", reply.id, reply.trace)
    finally:
        tracing.reset()


def test_deep_nesting_in_a_replys_trace_is_refused_not_a_crash() -> None:
    from kinfer.topics import decode_replies
    from kinfer.topics.envelope import ReplyRefused

    head = b"\x86\xa1t\xa3res\xa2id\xa2r1\xa5model\xa1m\xa6status\xa2ok\xa1v\x01"
    with pytest.raises(ReplyRefused):
        decode_replies(head[:1].replace(b"\x86", b"\x87") + head[1:] + b"\xa5trace" + b"\x91" * 100_000 + b"\xc0")


def test_a_kinfer_trace_budget_that_is_not_a_number_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw in ("abc", "nan", "-1", "inf"):
        monkeypatch.setenv("KINFER_TRACE_MAX_PER_S", raw)
        with pytest.raises(ValueError, match="KINFER_TRACE_MAX_PER_S"):
            tracing.use(TracerProvider())
    tracing.reset()


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpSink]:
    with OtlpSink() as sink:
        yield sink


def _post(sink: OtlpSink, data: bytes, gzipped: bool = False) -> int:
    import urllib.error
    import urllib.request

    headers = {"content-type": "application/x-protobuf", **({"content-encoding": "gzip"} if gzipped else {})}
    request = urllib.request.Request(f"{sink.endpoint}/v1/traces", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code


@settings(deadline=None, max_examples=50)
@given(st.binary(max_size=2_000))
def test_the_otlp_receiver_refuses_any_body_that_is_not_an_export_and_serves_on(receiver: OtlpSink,
                                                                                 body: bytes) -> None:
    import gzip
    import zlib

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    try:
        gzip.decompress(body)
        expected = {200, 400}  # gzip after all: then it is a message or not
    except (OSError, EOFError, zlib.error):
        expected = {400}
    assert _post(receiver, body, gzipped=True) in expected
    assert _post(receiver, body) in (200, 400)  # protobuf reads many byte strings as an (odd) message
    assert _post(receiver, ExportTraceServiceRequest().SerializeToString()) == 200  # and it still serves


def test_a_tracing_failure_serves_the_record_untraced(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    provider = TracerProvider()
    tracing.use(provider)
    try:
        assert tracing._tracer is not None

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("an exporter bug")

        monkeypatch.setattr(tracing._tracer, "start_span", broken)
        sampled = [("traceparent", f"00-{TRACE}-{SPAN}-01".encode())]
        with caplog.at_level(logging.ERROR):
            assert tracing.incoming(sampled, "infer.m.p1", 0, 7, "r1", 1, 2) is None
        assert "served untraced" in caplog.text
    finally:
        tracing.reset()
