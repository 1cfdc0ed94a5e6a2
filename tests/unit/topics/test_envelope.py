"""The wire contract: round trips, validation naming the field, limits enforced before allocation."""

from __future__ import annotations

from pathlib import Path

import msgpack
import msgspec
import pytest

import kinfer.topics
from kinfer.topics import (
    Chunk,
    DeadlineExceeded,
    InvalidRequest,
    Limits,
    ModelError,
    Priority,
    ReplyRoute,
    Request,
    Result,
    Shed,
    Status,
    Timings,
    Turn,
    decode_request,
    decode_result,
    pack,
)
from kinfer.topics.envelope import salvage_route


def make_request(**overrides: object) -> Request:
    fields: dict[str, object] = {
        "id": "req-1",
        "model": "minilm",
        "priority": Priority.P1,
        "tenant": "team-a",
        "created_ms": 1_700_000_000_000,
        "deadline_ms": 1_700_000_001_000,
        "inputs": ("hello world",),
        "reply": ReplyRoute.channel("kinfer:reply:abc"),
        "params": {"normalize": True},
    }
    fields.update(overrides)
    return Request(**fields)  # type: ignore[arg-type]


def wire(**overrides: object) -> bytes:
    obj = msgpack.unpackb(pack(make_request()))
    for key, value in overrides.items():
        if value is KeyError:
            del obj[key]
        else:
            obj[key] = value
    return msgpack.packb(obj)


def test_request_round_trip() -> None:
    req = make_request(priority=Priority.P0, inputs=("a", "b" * 100))
    assert decode_request(pack(req)) == req


def test_result_round_trip_keeps_float32_embeddings() -> None:
    res = Result("r", "minilm", Status.OK, outputs=[[0.5, -0.25, 0.1]], timings=Timings(1.0, 2.0, 3.0, 4))
    back = decode_result(pack(res))
    assert back.id == "r" and back.status is Status.OK and back.timings.batch_size == 4
    assert back.outputs[0][:2] == [0.5, -0.25]
    assert back.outputs[0][2] == pytest.approx(0.1, rel=1e-6)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"id": ""}, "id"),
        ({"id": "has space"}, "id"),
        ({"id": KeyError}, "id"),
        ({"model": "Bad.Model"}, "model"),
        ({"priority": 4}, "priority"),
        ({"priority": True}, "priority"),
        ({"tenant": ""}, "tenant"),
        ({"deadline_ms": 1_600_000_000_000}, "deadline_ms"),
        ({"created_ms": "yesterday"}, "created_ms"),
        ({"inputs": []}, "inputs"),
        ({"inputs": [1, 2]}, "inputs"),
        ({"inputs": "not a list"}, "inputs"),
        ({"params": {"nested": {"a": 1}}}, "params"),
        ({"stream": "yes"}, "stream"),
        ({"reply": {"smtp": "x"}}, "reply"),
        ({"reply": {"redis": "bad channel name"}}, "reply"),
        ({"v": 2}, "v"),
        ({"t": "res"}, "t"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "inputs"),  # a chat carries no inputs
        ({"inputs": [], "messages": [{"role": "tool", "content": "x"}]}, "messages"),
        ({"inputs": [], "messages": [{"role": "user"}]}, "messages"),
        ({"inputs": [], "messages": "hi"}, "messages"),
    ],
)
def test_invalid_fields_are_named(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        decode_request(wire(**overrides))
    assert info.value.field == field


def test_limits_inputs_and_text_length() -> None:
    limits = Limits(max_inputs=2, max_text_chars=10)
    with pytest.raises(InvalidRequest, match="over the limit of 2") as many:
        decode_request(pack(make_request(inputs=("a", "b", "c"))), limits)
    assert many.value.field == "inputs"
    with pytest.raises(InvalidRequest, match="over the limit of 10") as long:
        decode_request(pack(make_request(inputs=("x" * 11,))), limits)
    assert long.value.field == "inputs"
    with pytest.raises(InvalidRequest, match="over the limit of 10"):  # caught by the unpacker itself
        decode_request(pack(make_request(inputs=("x" * 41,))), limits)


def test_a_chat_is_its_turns_within_the_same_limits() -> None:
    turns = (Turn("system", "be brief"), Turn("user", "hello"), Turn("assistant", "hi"), Turn("user", "again"))
    chat = make_request(inputs=(), messages=turns)
    assert decode_request(pack(chat)).messages == turns
    limits = Limits(max_inputs=3, max_text_chars=10)
    with pytest.raises(InvalidRequest, match="too many messages") as many:
        decode_request(pack(chat), limits)
    assert many.value.field == "messages"
    with pytest.raises(InvalidRequest, match=r"messages\[1\] has 11 characters") as long:
        decode_request(pack(make_request(inputs=(), messages=(Turn("user", "a"), Turn("user", "x" * 11)))), limits)
    assert long.value.field == "messages"
    with pytest.raises(InvalidRequest, match="12 characters together, over the limit of 10") as total:
        decode_request(pack(make_request(inputs=(), messages=(Turn("user", "x" * 6), Turn("user", "y" * 6)))), limits)
    assert total.value.field == "messages"


def test_message_size_checked_before_unpacking() -> None:
    with pytest.raises(InvalidRequest, match="over the limit") as info:
        decode_request(b"\x00" * 2000, Limits(max_message_bytes=1000))
    assert info.value.field == "message"


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        b"not msgpack at all",
        msgpack.packb([1, 2, 3]),
        b"\xdd\xff\xff\xff\xff",  # array header claiming 4 billion elements
        b"\xdb\xff\xff\xff\xf0abc",  # str header claiming 4 GB
        msgpack.packb({"v": 1}) + b"trailing",
    ],
)
def test_garbage_is_invalid_not_a_crash(data: bytes) -> None:
    with pytest.raises(InvalidRequest):
        decode_request(data)


def test_salvage_route_of_an_invalid_request() -> None:
    data = wire(inputs=[])
    assert salvage_route(data) == ("req-1", ReplyRoute.channel("kinfer:reply:abc"), None)
    assert salvage_route(b"garbage") is None
    assert salvage_route(wire(reply=KeyError)) is None


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (Status.EXPIRED, DeadlineExceeded),
        (Status.SHED, Shed),
        (Status.ERROR, ModelError),
        (Status.INVALID, InvalidRequest),
    ],
)
def test_raise_for_status(status: Status, error: type[Exception]) -> None:
    with pytest.raises(error, match="why"):
        Result("r", "m", status, error="why").raise_for_status()
    ok = Result("r", "m", Status.OK)
    assert ok.raise_for_status() is ok


def test_an_invalid_result_names_the_field_at_fault() -> None:
    back = decode_result(pack(Result("r", "m", Status.INVALID, error="does not chat", field="model")))
    with pytest.raises(InvalidRequest, match="does not chat") as info:
        back.raise_for_status()
    assert info.value.field == "model"


def test_error_flags() -> None:
    assert Shed.shed and Shed.retriable
    assert not InvalidRequest.retriable
    assert DeadlineExceeded.retriable and not DeadlineExceeded.shed


def test_requests_keep_double_precision_and_unencodable_text_is_invalid() -> None:
    req = make_request(params={"big": 4.5e300, "tiny": 2.2250738585072014e-308})
    assert decode_request(pack(req)).params == {"big": 4.5e300, "tiny": 2.2250738585072014e-308}
    with pytest.raises(InvalidRequest, match="cannot encode"):
        pack(make_request(inputs=("\ud836",)))  # a lone surrogate is not UTF-8


@pytest.mark.parametrize(("record", "form"), [(Request, "| `{}` |"), (Result, "| `{}` |"), (Chunk, "| `{}` |"),
                                             (Timings, "`{}`")])  # timings are listed in one cell
def test_the_wire_format_document_names_every_field(record: type[msgspec.Struct], form: str) -> None:
    doc = (Path(kinfer.topics.__file__).parent / "WIRE_FORMAT.md").read_text()
    missing = [f.encode_name for f in msgspec.structs.fields(record) if form.format(f.encode_name) not in doc]
    assert not missing, f"WIRE_FORMAT.md does not describe {record.__name__}.{missing}"
