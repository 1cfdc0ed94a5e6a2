"""One codec for kinfer's own records (health, stats, decisions), driven by their field definitions.

A record is a frozen ``msgspec.Struct``: its fields (types, defaults) are the contract, and
``pack``/``unpack``/``to_wire`` come from them — nothing to keep in step by hand. Records are
msgpack maps (an ``array_like`` record is a msgpack array, in field order). Fields added later
carry defaults, so an older record still decodes; unknown keys are ignored. A record that does not
decode raises ``MalformedRecord``: it is a bug or a forgery, never a caller's bad request.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import msgspec

from kinfer.topics.errors import MalformedRecord

R = TypeVar("R", bound="Record")

MAX_RECORD_BYTES = 1_000_000  # what Kafka's default limits carry with their overhead (see envelope.Limits)

_encoder = msgspec.msgpack.Encoder()


class Record(msgspec.Struct, frozen=True):
    _decoders: ClassVar[dict[type, msgspec.msgpack.Decoder[Any]]] = {}

    def pack(self) -> bytes:
        return _encoder.encode(self)

    def to_wire(self) -> dict[str, Any]:
        """The record as plain data (JSON-friendly: string keys)."""
        wire: dict[str, Any] = msgspec.to_builtins(self, str_keys=True)
        return wire

    @classmethod
    def unpack(cls: type[R], data: bytes) -> R:
        decoder = Record._decoders.get(cls)
        if decoder is None:
            decoder = Record._decoders[cls] = msgspec.msgpack.Decoder(cls)
        if len(data) > MAX_RECORD_BYTES:
            raise MalformedRecord(f"{cls.__name__} of {len(data)} bytes, over {MAX_RECORD_BYTES}", cls.__name__)
        try:
            record: R = decoder.decode(data)
        except msgspec.MsgspecError as exc:
            raise MalformedRecord(f"malformed {cls.__name__}: {exc}", cls.__name__) from exc
        return record
