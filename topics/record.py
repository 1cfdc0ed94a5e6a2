"""One codec for kinfer's own records (health, stats, decisions), driven by their field definitions.

A record is a frozen ``msgspec.Struct``: its fields (types, defaults, ranges) are the contract, and
``pack``/``unpack``/``to_wire`` come from them — nothing to keep in step by hand. Records are
msgpack maps (an ``array_like`` record is a msgpack array, in field order). Fields added later
carry defaults, so an older record still decodes; unknown keys are ignored.

``unpack`` is total: whatever bytes (or ``None``, a Kafka tombstone) it is given, it returns a record
or raises ``MalformedRecord`` — never anything else. The size is checked first (``max_bytes`` of the
record's class), then msgspec decodes and validates in C: every number finite and within the range
its field states, names matching their pattern, strings and containers within their lengths.
Nesting deeper than the interpreter's recursion limit (1,000 frames), even under a key that is
skipped, is a ``RecursionError`` inside the decoder, and refused like the rest. A malformed record
is a bug or a forgery, never a caller's bad request: readers count it (``readers.refused``) and go on.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, TypeVar

import msgspec

from kinfer.topics.errors import MalformedRecord
from kinfer.topics.names import MODEL_PATTERN, WORKER_PATTERN, exact

R = TypeVar("R", bound="Record")

MAX_RECORD_BYTES = 1_000_000  # what Kafka's default limits carry with their overhead (see envelope.Limits)

# -- the ranges records' fields are held to --------------------------------------------------------

MAX_DURATION_MS = 3_600_000.0  # waits, service and swap-in times: an hour (a deadline is at most minutes)
MAX_RATE_RPS = 10_000_000.0  # records or inputs per second
MAX_COUNT = 2**63 - 1  # offsets, lags, totals: what Kafka counts in
MAX_BYTES = 1 << 50  # memory sizes (1 PiB)
MAX_WALL_MS = 4_102_444_800_000  # wall-clock ms: before 2100-01-01 (a reader judges nearness to now itself)
# A record dated later than now + this is not believed: clocks differ by less, and a record dated an
# hour ahead would otherwise outlive every staleness rule.
MAX_SKEW_MS = 2_000
MAX_LABEL_CHARS = 32  # a short word that keys a dict (shed reason, tier)
MAX_LABELS = 16  # entries of such a dict

# ``$`` also matches before a trailing newline; a record's names end where the string ends.
MODEL_NAME_PATTERN = exact(MODEL_PATTERN)
WORKER_NAME_PATTERN = exact(WORKER_PATTERN)  # a worker id: hostname-pid, or an instance id
LABEL_PATTERN = r"^[a-z][a-z0-9_-]{0,31}\Z"

ModelName = Annotated[str, msgspec.Meta(pattern=MODEL_NAME_PATTERN)]
WorkerName = Annotated[str, msgspec.Meta(pattern=WORKER_NAME_PATTERN)]
Label = Annotated[str, msgspec.Meta(pattern=LABEL_PATTERN)]
Millis = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_DURATION_MS)]  # finite: NaN and inf are refused
Rate = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_RATE_RPS)]
Ratio = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_RATE_RPS)]  # an average of counts (inputs per batch)
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
SmallCount = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]  # replicas, batches, requests of one flush
Bytes = Annotated[int, msgspec.Meta(ge=0, le=MAX_BYTES)]
WallMs = Annotated[int, msgspec.Meta(ge=0, le=MAX_WALL_MS)]
Counts = Annotated[dict[Label, Count], msgspec.Meta(max_length=MAX_LABELS)]  # by a short word: sheds by reason

_encoder = msgspec.msgpack.Encoder()


class Record(msgspec.Struct, frozen=True):
    # The largest encoded record ``unpack`` reads; a record class whose records are small says so.
    max_bytes: ClassVar[int] = MAX_RECORD_BYTES
    # The wall-clock field that dates a record, if it has one: a reader refuses one dated ahead of it.
    dated_by: ClassVar[str | None] = None
    _decoders: ClassVar[dict[type, msgspec.msgpack.Decoder[Any]]] = {}

    def pack(self) -> bytes:
        return _encoder.encode(self)

    def to_wire(self) -> dict[str, Any]:
        """The record as plain data (JSON-friendly: string keys)."""
        wire: dict[str, Any] = msgspec.to_builtins(self, str_keys=True)
        return wire

    @classmethod
    def unpack(cls: type[R], data: object) -> R:
        """The record ``data`` holds, or ``MalformedRecord`` (with a ``reason``) — nothing else."""
        name = cls.__name__
        if data is None:
            raise MalformedRecord(f"{name}: no value (a tombstone)", name, "tombstone")
        if not isinstance(data, bytes | bytearray | memoryview):
            raise MalformedRecord(f"{name}: expected bytes, got {type(data).__name__}", name, "type")
        size = data.nbytes if isinstance(data, memoryview) else len(data)
        if size > cls.max_bytes:
            raise MalformedRecord(f"{name} of {size} bytes, over {cls.max_bytes}", name, "size")
        decoder = Record._decoders.get(cls)
        if decoder is None:
            decoder = Record._decoders[cls] = msgspec.msgpack.Decoder(cls)
        try:
            record: R = decoder.decode(data)
        except RecursionError:
            raise MalformedRecord(f"{name}: nested too deep", name, "depth") from None
        except MemoryError:
            raise MalformedRecord(f"{name}: too large to decode", name, "memory") from None
        except msgspec.ValidationError as exc:
            raise MalformedRecord(f"malformed {name}: {exc}", name, "schema") from exc
        except msgspec.MsgspecError as exc:
            raise MalformedRecord(f"malformed {name}: {exc}", name, "syntax") from exc
        return record
