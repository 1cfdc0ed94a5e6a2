"""The reply decoder is total and the seal is confidential: whatever bytes arrive on a reply channel
or topic, ``decode_replies`` returns replies or refuses them (``ReplyRefused``), never raises anything
else; nothing but the holder of the reply key reads a sealed reply, and nothing it did not seal opens."""

from __future__ import annotations

import hmac
import math
import os
import tracemalloc
from typing import Any

import msgpack
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kinfer.consumers.replies import Delivery
from kinfer.topics import Chunk, ReplyBatch, ReplyRoute, Result, Sealed, Status, Timings, Usage, pack, seal
from kinfer.topics.auth import seal_box
from kinfer.topics.envelope import (
    MAX_PLAIN_REPLY_BYTES,
    MAX_REPLY_BYTES,
    REFUSALS,
    Opened,
    ReplyRefused,
    decode_replies,
    decode_result,
)

KEY = bytes(range(16))
OTHER = bytes(range(16, 32))
DEEP = 100_000
FUZZ = settings(derandomize=True, max_examples=300, deadline=None)


def sealed_bytes(body: bytes, key: bytes = KEY) -> bytes:
    """Any bytes in a seal that opens with ``key``: what only a worker (or a bug in one) could send."""
    return msgspec.msgpack.encode(Sealed(*seal_box(key, body)))


def legacy_seal(body: bytes, key: bytes = KEY, mac: bytes | None = None) -> bytes:
    """The older seal (v 1), as a worker not yet upgraded sends it."""
    mac = hmac.digest(key, body, "sha256") if mac is None else mac
    return msgpack.packb({"v": 1, "t": "sealed", "mac": mac, "body": body})


def outcome(data: bytes, key: bytes | None) -> Opened | str:
    """What the decoder did: the replies, or the reason it refused; any other exception fails the test."""
    try:
        opened = decode_replies(data, key)
    except ReplyRefused as exc:
        assert exc.reason in REFUSALS
        return exc.reason
    assert isinstance(opened, Opened) and all(isinstance(r, Result | Chunk) for r in opened.replies)
    return opened


def refused(data: bytes, key: bytes | None = KEY) -> str:
    got = outcome(data, key)
    assert isinstance(got, str), f"expected a refusal, got {got}"
    return got


RESULT = Result("req-7f3a", "minilm", Status.OK, outputs=[[0.25, -1.5, 3.0]], timings=Timings(1.0, 2.0, 3.0, 4),
                worker="w-1", tokens=9)


# -- the seal ---------------------------------------------------------------------------------------


def test_results_chunks_and_batches_open_with_their_key_and_only_with_it() -> None:
    chunk = Chunk("s", "tiny", 3, text="hi", tokens=[5, 6], final=True, status=Status.OK, finish="eos",
                  usage=Usage(4, 2))
    error = Result("bad", "m", Status.INVALID, error="no inputs", field="inputs")  # invalid replies alike
    for message, replies in ((RESULT, [RESULT]), (chunk, [chunk]), (error, [error]),
                             (ReplyBatch([RESULT, chunk]), [RESULT, chunk])):
        data = seal(message, KEY)
        assert decode_replies(data, KEY) == (replies, 2)
        assert refused(data, OTHER) == "unopened"  # another client's key
        assert refused(data, None) == "malformed"  # a reader without a key cannot open a seal
    assert decode_result(seal(RESULT, KEY), KEY) == RESULT


def test_a_sealed_reply_shows_nothing_of_what_it_holds() -> None:
    secret = Result("id-that-must-stay-secret", "model-name-secret", Status.ERROR, outputs=["output-secret"],
                    error="error-text-secret", worker="worker-secret")
    a, b = seal(secret, KEY), seal(secret, KEY)
    assert a != b  # a fresh salt each time: two seals of one reply cannot be matched
    for data in (a, b):
        for clear in (b"id-that-must-stay-secret", b"model-name-secret", b"output-secret", b"error-text-secret",
                      b"worker-secret", b"secret", pack(secret)):
            assert clear not in data
    # What a reader of the topic sees: the seal's version and random-looking bytes of the body's length.
    outer = msgpack.unpackb(a)
    assert set(outer) == {"t", "v", "salt", "box"} and outer["t"] == "sealed" and outer["v"] == 2
    assert len(outer["salt"]) == 16 and len(outer["box"]) == len(pack(secret)) + 16


def test_the_record_key_of_a_sealed_reply_is_not_its_request_id() -> None:
    route = ReplyRoute.topic("replies.default")
    plain, sealed = Delivery(route, RESULT), Delivery(route, RESULT, key=KEY)
    assert plain.record_key() == RESULT.id.encode()
    assert RESULT.id.encode() not in sealed.record_key()
    assert sealed.record_key() == Delivery(route, Chunk(RESULT.id, "m", 0), key=KEY).record_key()  # one partition
    assert sealed.record_key() != Delivery(route, RESULT, key=OTHER).record_key()


def test_every_changed_bit_and_every_cut_of_a_seal_is_refused() -> None:
    data = seal(RESULT, KEY)
    for i in range(len(data)):
        for bit in range(8):
            changed = bytearray(data)
            changed[i] ^= 1 << bit
            refused(bytes(changed))
    for n in range(len(data)):
        refused(data[:n])
    refused(data + b"\x00")  # trailing bytes


def test_a_seal_opened_elsewhere_is_not_taken_as_this_key_s() -> None:
    salt, box = seal_box(KEY, pack(RESULT))
    for bad in ({"t": "sealed", "v": 2, "salt": salt[:15], "box": box},  # short salt
                {"t": "sealed", "v": 2, "salt": salt, "box": box[:15]},  # shorter than a tag
                {"t": "sealed", "v": 2, "salt": os.urandom(16), "box": box},  # another salt
                {"t": "sealed", "v": 2, "box": box},  # no salt
                {"t": "sealed", "v": 3, "salt": salt, "box": box}):  # a version nobody knows
        assert refused(msgpack.packb(bad)) in ("unopened", "malformed")


def test_the_older_hmac_seal_is_still_read_and_only_with_the_right_mac() -> None:
    body = pack(RESULT)
    assert decode_replies(legacy_seal(body), KEY) == ([RESULT], 1)
    assert refused(legacy_seal(body, OTHER)) == "unopened"
    assert refused(legacy_seal(body, mac=b"\x00" * 32)) == "unopened"
    assert refused(legacy_seal(b"\xc1")) == "malformed"  # authentic, but not a reply inside


def test_a_plain_reply_is_refused_by_a_reader_with_a_key_and_read_by_one_without() -> None:
    assert refused(pack(RESULT)) == "unsealed"
    assert decode_replies(pack(RESULT), None) == ([RESULT], 0)


# -- totality ---------------------------------------------------------------------------------------


def nested(depth: int, leaf: bytes = b"\xc0", opener: bytes = b"\x91") -> bytes:
    """``depth`` one-element arrays (or, with opener ``\\x81\\xa1k``, maps) around ``leaf``."""
    return opener * depth + leaf


def plain(**fields: Any) -> bytes:
    return msgpack.packb({"v": 1, "t": "res", "id": "r", "model": "m", "status": "ok", **fields})


def with_raw(prefix: dict[str, Any], key: str, raw: bytes) -> bytes:
    """A msgpack map with ``prefix``'s entries, then ``key`` holding ``raw`` (msgpack bytes, spliced in)."""
    head = bytearray(msgpack.packb(prefix))
    assert 0x80 <= head[0] <= 0x8E
    head[0] += 1
    return bytes(head) + msgpack.packb(key) + raw


DEEP_MESSAGES = {
    "arrays": nested(DEEP),
    "maps": nested(DEEP, opener=b"\x81\xa1k"),
    "unknown key": with_raw({"v": 1, "t": "res", "id": "r", "model": "m", "status": "ok"}, "x", nested(DEEP)),
    "unknown key first": with_raw({}, "x", nested(DEEP)),
    "outputs": with_raw({"v": 1, "t": "res", "id": "r", "model": "m", "status": "ok"}, "outputs",
                        b"\x91" + nested(DEEP)),
    "batch": with_raw({"v": 1, "t": "batch"}, "replies", nested(DEEP)),
    "seal field": with_raw({"v": 2, "t": "sealed"}, "salt", nested(DEEP)),
    "seal, unknown key": with_raw({"v": 2, "t": "sealed"}, "x", nested(DEEP, opener=b"\x81\xa1k")),
}


@pytest.mark.parametrize("name", sorted(DEEP_MESSAGES))
def test_nesting_a_hundred_thousand_deep_is_refused_not_a_crash(name: str) -> None:
    data = DEEP_MESSAGES[name]
    assert refused(data) in ("malformed", "unsealed")
    assert refused(data, None) == "malformed"
    assert refused(sealed_bytes(data)) == "malformed"  # even inside a seal that opens


def test_outputs_nest_at_most_three_containers_deep() -> None:
    ok = [[[1.5]], {"labels": [{"label": "a", "score": 0.5}]}, "text", 3, None, True]
    assert decode_result(seal(Result("r", "m", Status.OK, outputs=ok), KEY), KEY).outputs == ok
    assert refused(sealed_bytes(plain(outputs=[[[[[1]]]]]))) == "malformed"
    assert refused(sealed_bytes(plain(outputs=[{"a": {"b": {"c": {"d": 1}}}}]))) == "malformed"


def test_the_outputs_of_every_runner_family_fit_the_reply_type() -> None:
    outputs = [
        [0.5] * 384,  # embedding
        {"label": "pos", "score": 0.75, "labels": [{"label": "pos", "score": 0.75}, {"label": "neg", "score": 0.25}]},
        {"text": "hi", "finish": "eos", "prompt_tokens": 3, "completion_tokens": 1},  # generation
        11,  # noop
    ]
    got = decode_result(seal(Result("r", "m", Status.OK, outputs=outputs), KEY), KEY).outputs
    assert got == outputs


@pytest.mark.parametrize("header", [b"\xdc\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xde\xff\xff", b"\xdf\xff\xff\xff\xff",
                                    b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01"])
def test_containers_claiming_more_than_the_message_holds_are_refused(header: bytes) -> None:
    for data in (header, plain(x=1)[:-1] + header, with_raw({"t": "sealed", "v": 2}, "box", header)):
        refused(data)
        refused(data, None)
        refused(sealed_bytes(data))


def test_size_is_checked_first() -> None:
    assert refused(b"\x00" * (MAX_REPLY_BYTES + 1)) == "oversize"
    assert refused(b"\x00" * (MAX_PLAIN_REPLY_BYTES + 1), None) == "oversize"
    # a sealed reply may be larger than a plain one: its body is decoded only once it opened
    big = Result("r", "m", Status.OK, outputs=["x" * (2 * MAX_PLAIN_REPLY_BYTES)])
    assert decode_result(seal(big, KEY), KEY) == big


def empty_maps(n: int) -> bytes:
    """A plain result whose outputs are ``n`` empty maps: ~1 byte each on the wire, ~64 in memory."""
    return with_raw({"v": 1, "t": "res", "id": "r", "model": "m", "status": "ok"}, "outputs",
                    b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n)


def peak_bytes(data: bytes, key: bytes | None) -> tuple[Opened | str, int]:
    tracemalloc.start()
    try:
        got = outcome(data, key)
        return got, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_is_bounded_before_a_reply_is_authenticated() -> None:
    # A reader with a key decodes nothing of a message that is not a seal that opens: 16 MB of empty
    # maps cost it no memory at all (the message is skipped over, never built).
    got, peak = peak_bytes(empty_maps(16_000_000), KEY)
    assert got == "unsealed" and peak < 100_000, peak
    got, peak = peak_bytes(msgpack.packb({"t": "sealed", "v": 2, "salt": b"s" * 16, "box": b"\x00" * 16_000_000}),
                           KEY)
    assert got == "unopened" and peak < 16_000_000 * 1.1, peak  # the box, opened in place: at most its size once
    # A reader without a key decodes a plain message whole, so its bound is small: 1 MB of empty maps,
    # ~64 bytes of objects per byte.
    got, peak = peak_bytes(empty_maps(MAX_PLAIN_REPLY_BYTES - 100), None)
    assert isinstance(got, Opened) and peak < 80 * MAX_PLAIN_REPLY_BYTES, peak
    assert refused(empty_maps(MAX_PLAIN_REPLY_BYTES), None) == "oversize"


def test_nan_and_infinities_are_values_not_errors() -> None:
    odd = Result("r", "m", Status.OK, outputs=[[math.nan, math.inf, -math.inf]],
                 timings=Timings(math.nan, math.inf, -math.inf, 0))
    got = decode_result(seal(odd, KEY), KEY)
    assert math.isnan(got.outputs[0][0]) and got.outputs[0][1:] == [math.inf, -math.inf]
    assert math.isinf(got.timings.batch_wait_ms)


# -- properties ---------------------------------------------------------------------------------------

FIELDS = ["v", "t", "id", "model", "status", "outputs", "error", "timings", "worker", "tokens", "field", "seq",
          "text", "final", "finish", "usage", "replies", "salt", "box", "mac", "body", "queue_ms", "batch_size"]
scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=12)
           | st.binary(max_size=24)
           | st.sampled_from(["res", "chunk", "batch", "sealed", "req", "ok", "invalid", 1, 2]))
keys = st.sampled_from(FIELDS) | st.text(max_size=6) | st.integers(-5, 5) | st.binary(max_size=4) | st.none()


def containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(children, max_size=6) | st.dictionaries(keys, children, max_size=8)


values = st.recursive(scalars, containers, max_leaves=40)
# Maps shaped like replies (a known type, a version, some real field names) reach deeper into the decoder.
reply_like = st.builds(
    lambda head, rest: {**head, **rest},
    st.fixed_dictionaries({"t": st.sampled_from(["res", "chunk", "batch", "sealed", "x"]),
                           "v": st.sampled_from([1, 2, 0, "1", None])}),
    st.dictionaries(st.sampled_from(FIELDS[2:]), values, max_size=6),
)
messages = values | reply_like


@FUZZ
@given(messages)
def test_any_msgpack_value_gives_replies_or_a_refusal(value: Any) -> None:
    data = msgpack.packb(value)
    outcome(data, KEY)
    outcome(data, None)
    outcome(sealed_bytes(data), KEY)  # as the body of a seal that opens (a worker's bug, not a forgery)
    outcome(legacy_seal(data), KEY)


@FUZZ
@given(st.binary(max_size=512))
def test_any_bytes_give_replies_or_a_refusal(data: bytes) -> None:
    outcome(data, KEY)
    outcome(data, None)
    outcome(sealed_bytes(data), KEY)


@FUZZ
@given(st.binary(max_size=40), st.binary(max_size=300), st.sampled_from([2, 1, 3]))
def test_a_forged_seal_never_opens(salt: bytes, box: bytes, version: int) -> None:
    forged = msgpack.packb({"t": "sealed", "v": version, "salt": salt, "box": box, "mac": salt, "body": box})
    assert refused(forged) in ("unopened", "malformed")


@FUZZ
@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=4), st.integers(0, 10_000))
def test_a_changed_or_cut_seal_never_opens(positions: list[int], cut: int) -> None:
    original = seal(RESULT, KEY)
    data = bytearray(original)
    for p in positions:
        data[p % len(data)] ^= 1 + p % 255
    if bytes(data) != original:  # two changes at one place may undo each other
        refused(bytes(data))
    refused(original[: cut % len(original)])
