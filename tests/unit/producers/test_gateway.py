"""The gateway's decoders are total: any body, frame or header gives a value or the boundary's refusal.

Each route's body passes ``producers.http.decode`` (``openai_decode`` on the OpenAI routes) after its
size is checked; a header with a number passes ``ascii_int``. Fuzzed here with Hypothesis: arbitrary
JSON (deep, wide, wrong types, numbers out of range), JSON-shaped objects with each route's own keys,
and random bytes. Whatever a generation body that passes says, the workers' sampling accepts.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kinfer.consumers.runners import sampling
from kinfer.consumers.runners.sampling import Sampling
from kinfer.producers import http, openai_api
from kinfer.producers.http import MAX_BODY_BYTES, BadBody, ascii_int, decode
from kinfer.producers.native_api import InferBody, StreamBody, WsMessage
from kinfer.producers.openai_api import ChatCompletionsBody, CompletionsBody, EmbeddingsBody, openai_decode
from kinfer.producers.streams import MAX_STREAM_CHUNKS
from kinfer.topics import DEFAULT_LIMITS, InvalidRequest

NATIVE = [InferBody, StreamBody, WsMessage]
OPENAI = [EmbeddingsBody, CompletionsBody, ChatCompletionsBody]
FUZZ = settings(max_examples=100, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])

NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e-400", "5e-324", "1e-40", "1e-300",
           "18446744073709551616", "-9223372036854775809", "1" * 5_000, "0.0000001", "-0", "2", "1e308"]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False,
                                                                                      allow_infinity=False),
    st.text(max_size=30), st.sampled_from(["user", "system", "text", "function", "\x1f", "base64", "float", "\ud800"]),
)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)


def field_names(kind: type[msgspec.Struct]) -> list[str]:
    return list(kind.__struct_fields__)


def objects_for(kind: type[msgspec.Struct]) -> st.SearchStrategy[dict[str, Any]]:
    """JSON objects made of the route's own keys (and a few others), each with any value."""
    keys = st.sampled_from([*field_names(kind), "role", "content", "messages", "extra"])
    return st.dictionaries(keys, json_values, max_size=10)


def encode(value: Any) -> bytes:
    return json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8", "surrogatepass")


def total(kind: type[Any], data: bytes | str) -> Any:
    """The boundary's promise: a value of ``kind``, or its refusal (422 or 413 natively, 400 on OpenAI's)."""
    try:
        value = openai_decode(data, kind) if kind in OPENAI else decode(data, kind)
    except BadBody as exc:
        assert exc.status in (413, 422) and str(exc)
        return None
    except InvalidRequest as exc:
        assert kind in OPENAI and exc.field and str(exc)
        return None
    assert isinstance(value, kind)
    return value


def deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("kind", NATIVE + OPENAI, ids=lambda k: k.__name__)
@FUZZ
@given(value=json_values)
def test_any_json_value_is_a_value_or_a_refusal(kind: type[Any], value: Any) -> None:
    total(kind, encode(value))


@pytest.mark.parametrize("kind", NATIVE + OPENAI, ids=lambda k: k.__name__)
@FUZZ
@given(data=st.data())
def test_any_object_of_the_routes_own_keys_is_a_value_or_a_refusal(kind: type[Any], data: st.DataObject) -> None:
    obj = data.draw(objects_for(kind))
    body = total(kind, encode(obj))
    if isinstance(body, (CompletionsBody, ChatCompletionsBody)) and body.unsupported() is None \
            and body.out_of_range() is None:
        # What the gateway sends on, the workers take: sampling parameters within their ranges.
        Sampling.from_params(body.params(16))


@pytest.mark.parametrize("kind", NATIVE + OPENAI, ids=lambda k: k.__name__)
@FUZZ
@given(data=st.binary(max_size=300))
def test_random_bytes_are_a_value_or_a_refusal(kind: type[Any], data: bytes) -> None:
    total(kind, data)
    total(kind, data.decode("utf-8", "surrogateescape"))  # a text frame that is not UTF-8 at all


@pytest.mark.parametrize("kind", NATIVE + OPENAI, ids=lambda k: k.__name__)
@pytest.mark.parametrize("where", ["top", "known", "unknown", "inside"])
def test_nesting_100000_deep_anywhere_is_refused(kind: type[Any], where: str) -> None:
    first = field_names(kind)[0]
    body = {
        "top": deep(100_000),
        "known": b'{"' + first.encode() + b'": ' + deep(100_000) + b"}",
        "unknown": b'{"metadata": ' + deep(100_000) + b"}",
        "inside": b'{"tools": [{"type": "function", "function": {"name": "f", "parameters": {"x": '
                  + deep(100_000) + b"}}}]}",
    }[where]
    assert total(kind, body) is None


@pytest.mark.parametrize("number", NUMBERS)
@pytest.mark.parametrize("key", ["temperature", "top_p", "seed", "max_tokens", "n", "presence_penalty"])
def test_numbers_out_of_range_or_not_json_are_refused_or_finite(number: str, key: str) -> None:
    data = f'{{"model": "m", "prompt": "x", "{key}": {number}}}'.encode()
    body = total(CompletionsBody, data)
    if body is not None:
        value = getattr(body, key)
        assert not isinstance(value, float) or math.isfinite(value)
        if body.unsupported() is None and body.out_of_range() is None:
            Sampling.from_params(body.params(body.max_tokens))
    params = total(InferBody, f'{{"inputs": "x", "params": {{"{key}": {number}}}}}'.encode())
    if params is not None:
        assert all(not isinstance(v, float) or math.isfinite(v) for v in params.params.values())


def test_the_openai_routes_refuse_what_sampling_cannot_use_by_name() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for extra, field in (({"temperature": 1e-40}, "temperature"), ({"top_p": 1e-300}, "top_p"),
                         ({"top_p": 0}, "top_p"), ({"temperature": 3}, "temperature")):
        try:
            body = openai_decode(encode({**base, **extra}), ChatCompletionsBody)
        except InvalidRequest as exc:
            assert exc.field == field
            continue
        refused = body.out_of_range()
        assert refused is not None and refused.field == field


def test_wide_bodies_are_refused_by_count_and_unknown_fields_skipped_without_building_them() -> None:
    inputs = b'{"inputs": [' + b'"a",' * DEFAULT_LIMITS.max_inputs + b'"a"]}'
    with pytest.raises(BadBody, match="length <= 256") as refused:
        decode(inputs, InferBody)
    assert refused.value.field == "inputs"
    assert decode(b'{"inputs": [' + b'"a",' * 255 + b'"a"]}', InferBody).inputs == ["a"] * 256
    with pytest.raises(BadBody, match="length <= 32"):
        decode(b'{"inputs": "x", "params": {' + b",".join(b'"k%d": 1' % i for i in range(33)) + b"}}", InferBody)
    with pytest.raises(BadBody, match="length <= 1024"):
        decode(b'{"inputs": "x", "params": {"stop": "' + b"s" * 1_025 + b'"}}', InferBody)
    # An unknown OpenAI field is skipped, however wide, up to the body's size.
    wide = b'{"model": "m", "prompt": "x", "metadata": [' + b"0," * ((MAX_BODY_BYTES - 100) // 2) + b"0]}"
    assert len(wide) <= MAX_BODY_BYTES
    assert openai_decode(wide, CompletionsBody).prompt == "x"
    # Fields kinfer refuses are typed, never ``Any``: their unknown parts are skipped too.
    tools = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
             "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
             "response_format": {"type": "json_schema", "json_schema": {"schema": {"a": [1, {"b": None}]}}}}
    assert openai_decode(encode(tools), ChatCompletionsBody).unsupported() == "tools"


@settings(max_examples=500, derandomize=True, deadline=None)
@given(raw=st.one_of(st.text(max_size=12), st.integers(-10, 10**8).map(str),
                     st.sampled_from(["²", "٣", "1_000", " 1000", "1000 ", "+1000", "1" * 5_000, "", "0001000"])))
def test_a_header_number_is_ascii_digits_in_range_or_none(raw: str) -> None:
    value = ascii_int(raw, 1_000, 600_000)
    if value is None:
        assert not (raw.isascii() and raw.isdigit() and len(raw) <= 6 and 1_000 <= int(raw) <= 600_000)
    else:
        assert raw.isascii() and raw.isdigit() and value == int(raw) and 1_000 <= value <= 600_000


def test_the_producers_bounds_are_the_workers() -> None:
    assert openai_api.MIN_TEMPERATURE == sampling.MIN_TEMPERATURE
    assert openai_api.MIN_TOP_P == sampling.MIN_TOP_P
    assert sampling.MAX_TEMPERATURE >= 2.0  # OpenAI's top temperature
    assert MAX_STREAM_CHUNKS == sampling.MAX_NEW_TOKENS + 1  # a chunk per token, and the final one
    assert openai_api.MAX_OPENAI_STOPS <= sampling.MAX_STOPS - 2  # room for the plain template's two stops
    joined = openai_api.MAX_OPENAI_STOPS * (openai_api.MAX_OPENAI_STOP_CHARS + 1) - 1
    assert joined <= DEFAULT_LIMITS.max_param_chars and openai_api.MAX_OPENAI_STOP_CHARS <= sampling.MAX_STOP_CHARS


class FaultyClient:
    """A client whose call fails with a bug of ours (not a KinferError, not the caller leaving)."""

    async def infer(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug in the client path")


def test_a_websocket_request_that_hits_a_bug_is_answered_500_and_the_socket_stays_open() -> None:
    """Only the caller leaving goes unanswered; any fault of ours is said on the socket."""
    from starlette.applications import Starlette
    from starlette.routing import WebSocketRoute
    from starlette.testclient import TestClient

    from kinfer.producers.gateway_pipeline import Gateway, GatewaySettings
    from kinfer.producers.native_api import WebSocketAPI

    gateway = Gateway(GatewaySettings("127.0.0.1:1", "redis://127.0.0.1:1/0"))
    gateway._client = FaultyClient()  # type: ignore[assignment]
    app = Starlette(routes=[WebSocketRoute("/v1/models/{model}/ws", WebSocketAPI(gateway).serve)])
    with TestClient(app).websocket_connect("/v1/models/m/ws") as ws:
        for rid in ("a", "b"):
            ws.send_text(f'{{"id": "{rid}", "inputs": ["x"]}}')
            answer = ws.receive_json()
            assert answer["id"] == rid and answer["code"] == 500, answer


class _Trickle:
    """A request whose body sends ``pieces`` and then nothing more."""

    def __init__(self, pieces: list[bytes], length: int) -> None:
        self.headers = {"content-length": str(length)}
        self._pieces = pieces

    async def stream(self) -> Any:
        for piece in self._pieces:
            yield piece
        await asyncio.Event().wait()  # the caller went quiet, its connection open


async def test_a_body_that_stops_half_way_is_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http, "BODY_IDLE_S", 0.05)
    with pytest.raises(BadBody) as refused:
        await http.read_body(_Trickle([b"x" * 1000, b"y" * 1000], 60_000), 100_000)  # type: ignore[arg-type]
    assert refused.value.status == 408 and "2000 bytes" in str(refused.value)
