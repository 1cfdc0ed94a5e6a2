"""The Batch API's lines (``producers.batches``): parsing an input file, and the output it answers with.

Input files are bytes from a caller: any line is a ``Line`` or a ``LineRefused`` naming its number,
never another exception (Hypothesis); a file is refused whole when any line is bad, as OpenAI does.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from kinfer.producers.batches import LineRefused, output_line, parse_file, parse_line
from kinfer.topics import Result, Status
from kinfer.topics.batches import MAX_BATCH_LINES, BatchObject

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
