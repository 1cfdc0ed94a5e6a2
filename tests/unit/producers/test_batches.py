"""The Batch API's lines (``producers.batches``): parsing an input file, and the output it answers with.

Input files are bytes from a caller: any line is a ``Line`` or a ``LineRefused`` naming its number,
never another exception (Hypothesis); a file is refused whole when any line is bad, as OpenAI does.
"""

from __future__ import annotations

import json

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from kinfer.producers.batches import (
    BatchRunner,
    BatchStore,
    LineRefused,
    output_line,
    parse_file,
    parse_line,
    request_counts_of,
)
from kinfer.topics import ReplyBatch, Result, Status, seal
from kinfer.topics.batches import BATCHES_TOPIC, FILES_TOPIC, MAX_BATCH_LINES, BatchObject, RequestCounts

EMB = "/v1/embeddings"


def line(custom_id: str = "a", url: str = EMB, **body: object) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": body or {"model": "minilm", "input": "hello"}}).encode()


def test_lines_of_each_endpoint_become_requests_in_their_routes_terms() -> None:
    emb = parse_line(EMB, line(input=["a", "b"], model="minilm"), 1)
    assert (emb.model, emb.inputs, emb.messages) == ("minilm", ("a", "b"), ())
    chat = parse_line("/v1/chat/completions", line(url="/v1/chat/completions", model="lm", max_tokens=5,
                                                   messages=[{"role": "user", "content": "hi"}]), 2)
    assert chat.inputs == () and chat.messages[0].content == "hi" and chat.params["max_new_tokens"] == 5
    text = parse_line("/v1/completions", line(url="/v1/completions", model="lm", prompt="once"), 3)
    assert text.inputs == ("once",) and text.params["max_new_tokens"] == 16


def test_a_file_with_bad_lines_names_each_and_keeps_none() -> None:
    data = b"\n".join([line("a"), line("b", url="/v1/completions"), line("a"), b"{nope", line("c", input=7),
                       line("d", url="/v1/completions"), b"", line("e", model="m", input="x", stream=True)])
    lines, errors = parse_file(EMB, data)
    assert [e.line for e in errors] == [2, 3, 4, 5, 6] and errors[1].code == "duplicate_custom_id"
    assert [ln.custom_id for ln in lines] == ["a", "e"]  # what was good: the batch still fails, on the errors
    assert parse_file(EMB, b"\n\n")[1][0].code == "empty_file"


def test_more_lines_than_a_batch_holds_fail_it() -> None:
    data = b"\n".join(line(f"id-{i}") for i in range(MAX_BATCH_LINES + 1))
    lines, errors = parse_file(EMB, data)
    assert len(lines) == MAX_BATCH_LINES and errors[-1].code == "too_many_requests"


def test_results_become_output_and_error_lines_in_openais_shape() -> None:
    parsed = parse_line(EMB, line("x", model="minilm", input=["a"]), 7)
    ok, text = output_line("batch_" + "0" * 24, parsed, Result("r", "m", Status.OK, outputs=[[0.5, 0.25]]))
    answer = json.loads(text)
    assert ok and answer["custom_id"] == "x" and answer["response"]["status_code"] == 200
    assert answer["response"]["body"]["data"][0]["embedding"] == [0.5, 0.25]
    assert answer["response"]["request_id"] == "batch_" + "0" * 24 + "-7"
    for status, code in ((Status.EXPIRED, 504), (Status.ERROR, 502), (Status.INVALID, 400)):
        ok, text = output_line("b", parsed, Result("r", "m", status, error="why"))
        assert not ok and json.loads(text)["response"]["status_code"] == code
    ok, text = output_line("b", parsed, Result("r", "m", Status.OK, outputs=[3]))  # not an embedding model
    assert not ok and json.loads(text)["response"]["status_code"] == 400


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(endpoint=st.sampled_from([EMB, "/v1/completions", "/v1/chat/completions"]),
       raw=st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode())
       | st.fixed_dictionaries({"custom_id": json_values, "method": st.sampled_from(["POST", "GET"]),
                                "url": st.sampled_from([EMB, "/v1/completions", "/v1/chat/completions", "x"]),
                                "body": json_values}).map(lambda v: json.dumps(v).encode()))
def test_any_line_is_a_request_or_a_refusal_naming_it(endpoint: str, raw: bytes) -> None:
    try:
        parsed = parse_line(endpoint, raw, 9)
    except LineRefused as exc:
        assert exc.number == 9
        return
    assert parsed.custom_id and parsed.model


@settings(max_examples=100, deadline=None)
@given(data=st.lists(st.binary(max_size=200) | st.text(max_size=3_000).map(str.encode), max_size=120))
def test_the_errors_of_any_file_fit_a_batch_state_that_reads_back(data: list[bytes]) -> None:
    _, errors = parse_file(EMB, b"\n".join(data))
    state = BatchObject("batch_" + "2" * 24, "t", EMB, "file-" + "3" * 24, 1, 2, "failed", b"k" * 16,
                        errors=errors[:100])
    assert BatchObject.unpack(state.pack()) == state


msgpack_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30) | st.binary(max_size=30),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=25,
)
record_values = (st.none() | st.binary(max_size=400) | msgpack_like.map(msgpack.packb)
                 | st.integers(1, 100_000).map(lambda depth: b"\x91" * depth + b"\xc0"))  # deep nesting
record_keys = (st.none() | st.binary(max_size=60)
               | st.sampled_from([b"f:file-" + b"0" * 24, b"c:file-" + b"0" * 24 + b":1", b"c:x:y", b"c:", b"f:",
                                  b"batch_" + b"1" * 24]))


@settings(max_examples=300, deadline=None)
@given(topic=st.sampled_from([FILES_TOPIC, BATCHES_TOPIC]), key=record_keys, value=record_values,
       offset=st.integers(0, 2**62))
def test_the_stores_view_takes_any_single_record_and_goes_on(topic: str, key: bytes | None, value: bytes | None,
                                                              offset: int) -> None:
    store = BatchStore("127.0.0.1:1")
    store._apply(topic, key, value, offset)  # never raises: the follower would meet the record again on restart
    good = BatchObject("batch_" + "1" * 24, "t", EMB, "file-" + "3" * 24, 1, 2, "validating", b"k" * 16)
    store._apply(BATCHES_TOPIC, good.id.encode(), good.pack(), offset + 1)
    assert store.view.batches[good.id] == good  # and the next record still counts


@settings(max_examples=300, deadline=None)
@given(value=record_values)
def test_a_batch_collects_only_results_sealed_with_its_key_whatever_its_reply_topic_holds(value: bytes | None) -> None:
    line = parse_line(EMB, line_of("x"), 1)
    ended: dict[str, tuple[bool, bytes]] = {}
    BatchRunner._take(value, "b", b"k" * 16, {"b-1": line}, ended)
    assert ended == {}  # nothing but a reply sealed with the batch's own key is ever taken


def test_a_line_ends_once_as_what_its_output_line_says() -> None:
    """A line counts when its result comes, as the output file will have it: an ``ok`` result whose answer
    cannot be given in the endpoint's shape is a failed line from the start, not a completed one that
    turns failed at the end."""
    line = parse_line(EMB, line_of("x"), 1)
    ended: dict[str, tuple[bool, bytes]] = {}
    shapeless = Result("b-1", "minilm", Status.OK, outputs=["not a vector"])
    BatchRunner._take(seal(ReplyBatch([shapeless, result_ok("b-1")]), b"k" * 16), "b", b"k" * 16, {"b-1": line},
                      ended)
    ok, text = ended["b-1"]
    assert not ok and json.loads(text)["response"]["status_code"] == 400  # the first result is the line's
    assert request_counts_of(1, ended) == RequestCounts(1, 0, 1)


def result_ok(rid: str) -> Result:
    return Result(rid, "minilm", Status.OK, outputs=[[0.5, 0.5]])


def line_of(custom_id: str) -> bytes:
    return line(custom_id, model="minilm", input="x")
