"""The worker's intake boundary: any record in, a request or the record's refusal out — nothing else.

Hypothesis plays every producer: arbitrary msgpack values, valid requests with one field replaced by
anything, nesting far past the interpreter's recursion limit (under an unknown key, in params, in a
chat turn, in the reply route), non-finite numbers, random bytes, odd headers.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kinfer.consumers.intake import read_record
from kinfer.topics import InvalidRequest, Limits, Priority, ReplyRoute, Request, pack
from kinfer.topics.auth import TenantRule, Verifier, new_secret, parse_secrets
from kinfer.topics.cancel import CancelNote
from kinfer.topics.envelope import salvage_route
from kinfer.topics.errors import MalformedRecord

MODEL = "minilm"
FUZZ = settings(max_examples=300, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def request_map(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = msgpack.unpackb(pack(Request(
        id="r-1", model=MODEL, priority=Priority.P1, tenant="team", created_ms=1_700_000_000_000,
        deadline_ms=1_700_000_010_000, inputs=("hello",), reply=ReplyRoute.channel("kinfer:reply:team:c1"),
        params={"k": 1},
    )))
    base.update(overrides)
    return base


def nested(depth: int, leaf: bytes = b"\xc0") -> bytes:
    """``depth`` arrays of one element around ``leaf``, as msgpack bytes (no recursion to build)."""
    return b"\x91" * depth + leaf


def with_raw(obj: dict[str, Any], key: str, raw: bytes) -> bytes:
    """The map ``obj`` with ``key`` holding the msgpack bytes ``raw`` as they are."""
    rest = {k: v for k, v in obj.items() if k != key}
    body = b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in rest.items())
    return b"\xde" + (len(rest) + 1).to_bytes(2, "big") + body + msgpack.packb(key) + raw


def verdict(value: bytes | None, headers: list[tuple[str, bytes | None]] | None = None,
            verifier: Verifier | None = None) -> Request | InvalidRequest:
    """What intake makes of a record; any other exception fails the test."""
    try:
        return read_record(value, headers or [], MODEL, Priority.P1, verifier=verifier,
                           topic_missing=lambda topic: topic == "replies.gone")
    except InvalidRequest as exc:
        return exc


scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20) \
    | st.binary(max_size=20)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                      | st.dictionaries(st.text(max_size=8) | st.integers(-9, 9), inner, max_size=5), max_leaves=30)


@FUZZ
@given(st.binary(max_size=2_000))
def test_random_bytes_are_refused_or_read(data: bytes) -> None:
    assert isinstance(verdict(data), Request | InvalidRequest)
    salvage_route(data)  # never raises either


@FUZZ
@given(values)
def test_any_msgpack_value_is_refused_or_read(value: Any) -> None:
    assert isinstance(verdict(msgpack.packb(value)), Request | InvalidRequest)


@FUZZ
@given(st.sampled_from([*sorted(request_map()), "messages", "unknown", "stream", "batch_reply", "reply_key"]), values)
def test_a_valid_request_with_any_field_replaced_is_refused_or_read(key: str, value: Any) -> None:
    got = verdict(msgpack.packb(request_map(**{key: value})))
    assert isinstance(got, Request | InvalidRequest)
    if isinstance(got, Request):  # whatever was accepted is within the contract
        assert got.model == MODEL and got.inputs and got.deadline_ms - got.created_ms <= Limits().max_deadline_span_ms
        assert all(not isinstance(v, float) or math.isfinite(v) for v in got.params.values())


@pytest.mark.parametrize("where", ["unknown", "params", "messages", "reply", "inputs", "id", "reply_key"])
@pytest.mark.parametrize("depth", [100, 1_000, 100_000])
def test_nesting_anywhere_is_a_refusal(where: str, depth: int) -> None:
    deep = nested(depth)
    if where == "params":
        raw = b"\x81\xa1k" + deep
    elif where == "messages":
        raw = b"\x91\x82" + msgpack.packb("role") + msgpack.packb("user") + msgpack.packb("content") + deep
    elif where == "reply":
        raw = b"\x81" + msgpack.packb("redis") + deep
    else:
        raw = deep
    obj = request_map(inputs=[]) if where == "messages" else request_map()
    data = with_raw(obj, where, raw)
    got = verdict(data)
    if where == "unknown" and depth < 500:
        assert isinstance(got, Request)  # unknown keys are skipped, whatever they hold
    else:
        assert isinstance(got, InvalidRequest)
    salvage_route(data)


def test_a_refusal_still_salvages_the_route_of_a_deep_record() -> None:
    data = with_raw(request_map(), "unknown", nested(100_000))
    assert isinstance(verdict(data), InvalidRequest)
    # salvage reads the same bytes: it skips the unknown key with the same recursion, so it finds nothing
    # rather than raising — the record is dead-lettered either way.
    assert salvage_route(data) in (None, ("r-1", ReplyRoute.channel("kinfer:reply:team:c1"), None))


@pytest.mark.parametrize("route", [
    {"redis": "kinfer:demand"}, {"redis": "kinfer:health"}, {"redis": "kinfer:cancel"},
    {"kafka": "infer.minilm.p0"}, {"kafka": "infer.dlq"}, {"kafka": "kinfer.stats"}, {"kafka": "kinfer.health"},
    {"kafka": "kinfer-telemetry-stats-changelog"}, {"kafka": "replies.x:y"}, {"redis": "kinfer:reply:"},
    {"redis": "kinfer:reply:ok", "kafka": "infer.dlq"},
])
def test_reply_routes_outside_their_prefixes_are_refused(route: dict[str, str]) -> None:
    got = verdict(msgpack.packb(request_map(reply=route)))
    assert isinstance(got, InvalidRequest) and got.field == "reply"


def test_reply_routes_inside_their_prefixes_are_read() -> None:
    for route in ({"redis": "kinfer:reply:t:c"}, {"kafka": "replies.default"},
                  {"redis": "kinfer:reply:t:c", "kafka": "replies.team-a"}):
        assert isinstance(verdict(msgpack.packb(request_map(reply=route))), Request)
    got = verdict(msgpack.packb(request_map(reply={"kafka": "replies.gone"})))
    assert isinstance(got, InvalidRequest) and got.field == "reply"


def test_deadlines_are_bounded() -> None:
    span = Limits().max_deadline_span_ms
    created = 1_700_000_000_000
    assert isinstance(verdict(msgpack.packb(request_map(deadline_ms=created + span))), Request)
    for deadline in (created + span + 1, 2**63 - 1, 2**64 - 1, float("inf"), created):
        got = verdict(msgpack.packb(request_map(deadline_ms=deadline)))
        assert isinstance(got, InvalidRequest) and got.field == "deadline_ms", deadline


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_params_hold_finite_numbers_only(value: float) -> None:
    got = verdict(msgpack.packb(request_map(params={"temperature": value})))
    assert isinstance(got, InvalidRequest) and got.field == "params"


def test_a_tombstone_is_a_refusal() -> None:
    got = verdict(None)
    assert isinstance(got, InvalidRequest) and "tombstone" in str(got)


def verifier() -> Verifier:
    return Verifier(parse_secrets(new_secret()), {"team": TenantRule(max_priority=1)})


headers = st.lists(st.tuples(st.sampled_from(["kinfer-kid", "kinfer-sig", "x"]), st.none() | st.binary(max_size=40)),
                   max_size=4)


@FUZZ
@given(headers)
def test_any_headers_are_refused_or_read(found: list[tuple[str, bytes | None]]) -> None:
    got = verdict(msgpack.packb(request_map()), found, verifier())
    assert isinstance(got, InvalidRequest) and got.field == "signature"


def read_cancel(data: bytes) -> tuple[str, str, bytes | None] | None:
    try:
        note = CancelNote.unpack(data)
    except MalformedRecord:
        return None
    return note.model, note.id, note.mac


@FUZZ
@given(st.binary(max_size=600) | values.map(msgpack.packb))
def test_cancel_notes_are_read_or_dropped(data: bytes) -> None:
    note = read_cancel(data)
    assert note is None or (isinstance(note[0], str) and isinstance(note[1], str))


def test_cancel_notes_are_bounded_before_they_are_read() -> None:
    good = msgpack.packb({"id": "r-1", "model": MODEL, "mac": b"m" * 32})
    assert read_cancel(good) == (MODEL, "r-1", b"m" * 32)
    assert read_cancel(CancelNote("r-1", MODEL).pack()) == (MODEL, "r-1", None)
    assert read_cancel(b"\xdd" + (30_000_000).to_bytes(4, "big") + b"\xc0" * 1_000) is None  # a 30 M array header
    assert read_cancel(msgpack.packb({"id": "r-1", "model": MODEL, "pad": "x" * CancelNote.max_bytes})) is None
    assert read_cancel(nested(100_000)) is None
    assert read_cancel(msgpack.packb({"id": "r-1\n", "model": MODEL})) is None
