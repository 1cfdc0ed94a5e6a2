"""A multipart/form-data body parsed as it arrives, a piece at a time: no I/O.

The Batch API's upload is such a form (``purpose`` and one ``file``). Its file can be 64 MiB, so it is
not read whole: ``StreamedForm.feed`` takes each piece of the body as it comes, and returns the bytes
of the file that were in it, for the caller to pass on (to Kafka, a chunk at a time). Its other fields
are small and kept (``fields``). python-multipart's push parser does the framing; what it finds is
bounded here: at most ``max_fields`` fields of ``max_field_bytes`` each, one file, and headers as
python-multipart bounds them (8 a part, 4,224 bytes each). Anything else is ``FormRefused``.
"""

from __future__ import annotations

import codecs

from python_multipart import MultipartParser
from python_multipart.multipart import parse_options_header


class FormRefused(ValueError):
    """Not a form the caller may send: the message says why."""


def _decode(raw: bytes, charset: str) -> str:
    """A name as the form's charset says (Latin-1 where it cannot): what Starlette does, so a name can hold
    anything, a lone surrogate included; the caller cleans what it keeps."""
    try:
        return raw.decode(charset)
    except (UnicodeDecodeError, LookupError):
        return raw.decode("latin-1")


class StreamedForm:
    def __init__(self, content_type: str, max_fields: int = 8, max_field_bytes: int = 1_024) -> None:
        kind, params = parse_options_header(content_type)
        if kind != b"multipart/form-data":
            raise FormRefused("the body must be a multipart/form-data form")
        boundary = params.get(b"boundary")
        if not boundary:
            raise FormRefused("the form's Content-Type has no boundary")
        charset = params.get(b"charset", b"utf-8").decode("latin-1")
        try:
            self._charset = codecs.lookup(charset).name
        except LookupError:
            self._charset = "latin-1"
        self.max_fields, self.max_field_bytes = max_fields, max_field_bytes
        self.fields: dict[str, str] = {}
        self._field_parts = 0
        self.file_field: str | None = None  # the file's field name, once its part has begun
        self.filename: str | None = None
        self.file_ended = False
        self._header_name = self._header_value = b""
        self._disposition = b""
        self._in_file = False
        self._field: str | None = None
        self._value = bytearray()
        self._out: list[bytes] = []
        self._parser = MultipartParser(boundary, {
            "on_part_begin": self._part_begin, "on_part_data": self._part_data, "on_part_end": self._part_end,
            "on_header_field": self._header_field, "on_header_value": self._header_value_part,
            "on_header_end": self._header_end, "on_headers_finished": self._headers_finished,
        })

    def feed(self, piece: bytes) -> list[bytes]:
        """The file's bytes that ``piece`` held (in order; empty if none)."""
        try:
            self._parser.write(piece)
        except FormRefused:
            raise
        except Exception as exc:  # python-multipart's errors on a malformed form: the caller's
            raise FormRefused(f"not a multipart form ({type(exc).__name__})") from None
        out, self._out = self._out, []
        return out

    def finish(self) -> None:
        """The body has ended: it must have ended the form."""
        try:
            self._parser.finalize()
        except Exception as exc:
            raise FormRefused(f"not a multipart form ({type(exc).__name__})") from None
        if self._in_file or self._field is not None:
            raise FormRefused("the form ends in the middle of a part")

    # -- python-multipart's callbacks -------------------------------------------------------------

    def _part_begin(self) -> None:
        self._disposition = b""

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _header_value_part(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        if self._header_name.lower() == b"content-disposition":
            self._disposition = self._header_value
        self._header_name = self._header_value = b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if b"name" not in options:
            raise FormRefused('a part has no Content-Disposition "name"')
        name = _decode(options[b"name"], self._charset)
        if b"filename" in options:
            if self.file_field is not None:
                raise FormRefused("the form has more than one file")
            self.file_field, self.filename = name, _decode(options[b"filename"], self._charset)
            self._in_file = True
        else:
            self._field_parts += 1
            if self._field_parts > self.max_fields:
                raise FormRefused(f"the form has more than {self.max_fields} fields")
            self._field = name
            self._value.clear()

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._in_file:
            self._out.append(bytes(data[start:end]))
            return
        self._value += data[start:end]
        if len(self._value) > self.max_field_bytes:
            raise FormRefused(f"field {self._field!r} is over {self.max_field_bytes} bytes")

    def _part_end(self) -> None:
        if self._in_file:
            self._in_file, self.file_ended = False, True
        elif self._field is not None:
            self.fields[self._field] = _decode(bytes(self._value), self._charset)
            self._field = None


__all__ = ["FormRefused", "StreamedForm"]
