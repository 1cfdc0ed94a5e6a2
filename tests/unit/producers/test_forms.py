"""The upload form parsed as it arrives (``producers.forms``): the same fields and file bytes however the
body is cut into pieces, bounded fields, one file, and nothing but ``FormRefused`` for any bytes."""

from __future__ import annotations

import contextlib
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kinfer.producers.forms import FormRefused, StreamedForm

KIND = "multipart/form-data; boundary=XyZ"


def form(*parts: tuple[str, str | None, bytes]) -> bytes:
    out = b""
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        out += f"--XyZ\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n"
    return out + b"--XyZ--\r\n"


def parse(body: bytes, cuts: list[int], kind: str = KIND) -> tuple[dict[str, str], str | None, bytes]:
    parsed = StreamedForm(kind)
    data = b""
    edges = sorted({0, len(body), *(c % (len(body) + 1) for c in cuts)})
    for start, end in itertools.pairwise(edges):
        data += b"".join(parsed.feed(body[start:end]))
    parsed.finish()
    return parsed.fields, parsed.filename, data


@settings(max_examples=300, deadline=None)
@given(content=st.binary(max_size=3_000), purpose=st.text(max_size=40), cuts=st.lists(st.integers(0, 10_000),
                                                                                         max_size=30))
def test_any_cut_of_the_body_gives_the_same_form(content: bytes, purpose: str, cuts: list[int]) -> None:
    body = form(("purpose", None, purpose.encode()), ("file", "in.jsonl", content))
    fields, filename, data = parse(body, cuts)
    assert fields == {"purpose": purpose.encode().decode()} and filename == "in.jsonl" and data == content


def test_the_file_comes_out_as_it_arrives_not_at_the_end() -> None:
    parsed = StreamedForm(KIND)
    head = form(("purpose", None, b"batch"), ("file", "f.jsonl", b"A" * 100_000))[:-20_000]
    assert sum(len(p) for p in parsed.feed(head)) > 60_000  # before the body has ended


def test_a_filename_in_the_forms_charset_is_decoded_with_it() -> None:
    _, filename, _ = parse(form(("file", "+2AA-in.jsonl", b"x")), [], KIND + "; charset=utf-7")
    assert filename == "\ud800in.jsonl"  # a lone surrogate: the caller cleans what it keeps


@pytest.mark.parametrize(("body", "kind", "why"), [
    (form(("a", None, b"1"), ("b", "x", b"2"), ("c", "y", b"3")), KIND, "more than one file"),
    (form(*[(f"f{i}", None, b"v") for i in range(9)]), KIND, "more than 8 fields"),
    (form(*[("same", None, b"v")] * 9), KIND, "more than 8 fields"),
    (form(("purpose", None, b"b" * 1_025)), KIND, "over 1024 bytes"),
    (b"--XyZ\r\nContent-Type: text/plain\r\n\r\nx\r\n--XyZ--\r\n", KIND, 'no Content-Disposition "name"'),
    (form(("file", "f", b"x"))[:-12], KIND, "ends in the middle"),
    (b"", "multipart/form-data", "no boundary"),
    (b"", "application/json", "multipart/form-data"),
])
def test_what_the_form_may_not_be_is_refused_saying_why(body: bytes, kind: str, why: str) -> None:
    with pytest.raises(FormRefused, match=why):
        parse(body, [7, 50], kind)


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=2_000) | st.builds(lambda a, b: a + b, st.just(form(("file", "f", b"x"))[:40]),
                                                  st.binary(max_size=500)),
       cuts=st.lists(st.integers(0, 3_000), max_size=10))
def test_any_bytes_are_a_form_or_refused(body: bytes, cuts: list[int]) -> None:
    with contextlib.suppress(FormRefused):
        parse(body, cuts)
