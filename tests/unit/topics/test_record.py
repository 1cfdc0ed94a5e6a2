"""``Record.unpack`` is total: any bytes (or none) in, a record or ``MalformedRecord`` out, for every record type.

Arbitrary msgpack (Hypothesis ``st.recursive``), near-valid records with one field replaced by anything,
random bytes, nesting 100,000 deep built by hand, huge container headers, NaN and ±inf in every float
field, wrong types and tombstones. What decodes is within its ranges: finite numbers, names by pattern.
"""

from __future__ import annotations

import math
import re
import tracemalloc
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kinfer.ops.control.scaling import ScaleDecision, ScaleState
from kinfer.topics import MalformedRecord
from kinfer.topics.batches import BatchError, BatchObject, FileObject, RequestCounts
from kinfer.topics.health import HealthState, Level, LevelChange
from kinfer.topics.progress import MAX_POSITIONS, Answered, Position
from kinfer.topics.record import MAX_DURATION_MS, MODEL_NAME_PATTERN, Record
from kinfer.topics.residency import Demand, ModelResidency, WorkerResidency
from kinfer.topics.stats import BatchStats, ModelStats

# One valid record of each type: the starting point of near-valid mutations.
VALID: list[Record] = [
    HealthState("m", Level.SHEDDING, 180.5, 2000, 42, 90.0, 60.0, 1_700_000_000_000, (2, 10, 30), 12.5, 75.0,
                (1.0, 2.0, 3.0), 0, 1850.0),
    LevelChange(1_700_000_000_000, "m", Level.OK, Level.SHEDDING, 42, 180.0),
    ModelResidency("m", "host", 1 << 20, {"host": 120.0, "disk": 900.0}),
    WorkerResidency("host-1.example-42", 1_700_000_000_000, 1 << 30,
                    [ModelResidency("a", "disk", 1, {"disk": 900.0}), ModelResidency("b", "device", 2)]),
    Demand("m"),
    BatchStats("m", "w1", 1_700_000_000_000, size=8, requests=3, tokens=90, compute_ms=12.5, predicted_ms=11.0,
               shed={"codel": 2}, step=True, batches=2),
    ModelStats("m", 10.0, 50.0, 6.0, 8.3, 21.0, {8: 20.0, 16: 30.0}, {"expired": 1}, 900, 5, workers=2,
               requests_per_batch=3.5, steps_rps=1.0),
    ScaleState("m", "local", 3, 3, 1, 6, 210.0, 100.0, 10_000, restarts=1),
    ScaleDecision(9_000, "m", 1, 3, "up", 210.0, 100.0, 400.0, 4000.0),
    Position(2, 17, 123_456),
    Answered("host-1.example-42", 1_700_000_000_000, [Position(0, 0, 5), Position(2, 17, 123_456)]),
    FileObject("file-" + "0" * 24, "acme", "batch", "input.jsonl", 1_234, 1_700_000_000, 1),
    BatchObject("batch_" + "1" * 24, "acme", "/v1/embeddings", "file-" + "0" * 24, 1_700_000_000, 1_700_086_400,
                "in_progress", b"k" * 16, published=True, request_counts=RequestCounts(3, 1, 1),
                errors=[BatchError("invalid_request", "bad", 2, "url")], metadata={"job": "nightly"}),
]
TYPES = [type(r) for r in VALID]

scalars = (
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=80) | st.binary(max_size=40)
    | st.sampled_from(["m", "host", "disk", "device", "loading", "codel", "a\n", "M", "", "x" * 200])
)
values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=6)
    | st.dictionaries(st.text(max_size=12) | st.integers(-5, 70), children, max_size=6),
    max_leaves=40,
)


def outcome(cls: type[Record], data: object) -> Record | MalformedRecord:
    """The record, or the refusal; any other exception fails the test that called it."""
    try:
        return cls.unpack(data)
    except MalformedRecord as exc:
        assert exc.reason in {"size", "depth", "syntax", "schema", "memory", "tombstone", "type"}, exc.reason
        return exc


def within_ranges(value: Any) -> None:
    """Every number a decoded record holds is finite and non-negative-or-bounded; names match."""
    if isinstance(value, float):
        assert math.isfinite(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            within_ranges(k)
            within_ranges(v)
        if isinstance(value.get("model"), str):
            assert re.search(MODEL_NAME_PATTERN, value["model"])
    elif isinstance(value, list | tuple):
        for v in value:
            within_ranges(v)


def check(cls: type[Record], data: object) -> None:
    got = outcome(cls, data)
    if isinstance(got, Record):
        assert isinstance(got, cls)
        within_ranges(got.to_wire())


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cls=st.sampled_from(TYPES), value=values)
def test_any_msgpack_value_is_a_record_or_refused(cls: type[Record], value: Any) -> None:
    check(cls, msgpack.packb(value, use_bin_type=True))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(index=st.integers(0, len(VALID) - 1), data=st.data())
def test_a_valid_record_with_one_field_replaced_by_anything_is_a_record_or_refused(index: int,
                                                                                 data: st.DataObject) -> None:
    record = VALID[index]
    wire: Any = msgspec_builtins(record)
    fields = list(wire) if isinstance(wire, dict) else list(range(len(wire)))
    key = data.draw(st.sampled_from([*fields, "unknown"]) if isinstance(wire, dict) else st.sampled_from(fields))
    wire[key] = data.draw(values)
    check(type(record), msgpack.packb(wire, use_bin_type=True))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(cls=st.sampled_from(TYPES), data=st.binary(max_size=3_000))
def test_random_bytes_are_a_record_or_refused(cls: type[Record], data: bytes) -> None:
    check(cls, data)


def msgspec_builtins(record: Record) -> Any:
    """The record as msgpack would carry it (a map, or an array for an ``array_like`` record)."""
    return msgpack.unpackb(record.pack(), strict_map_key=False)


@pytest.mark.parametrize("record", VALID, ids=lambda r: type(r).__name__)
def test_every_record_round_trips(record: Record) -> None:
    assert type(record).unpack(record.pack()) == record


DEPTH = 100_000


def nested(depth: int, opener: bytes) -> bytes:
    """``depth`` containers, each holding the next: built as bytes, never as Python objects."""
    return opener * depth + b"\xc0"


def map_with_one_more(entries: dict[str, object]) -> bytes:
    """``entries`` as a msgpack map whose header counts one entry more, for the caller to append."""
    n = len(entries) + 1
    header = bytes([0x80 + n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")
    return header + b"".join(msgpack.packb(k) + msgpack.packb(v, use_bin_type=True) for k, v in entries.items())


@pytest.mark.parametrize("cls", TYPES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("opener", [b"\x91", b"\x81\xa1k"], ids=["arrays", "maps"])
def test_nesting_100000_deep_is_refused_wherever_it_hides(cls: type[Record], opener: bytes) -> None:
    deep = nested(DEPTH, opener)
    whole = outcome(cls, deep)
    assert isinstance(whole, MalformedRecord)
    wire = msgspec_builtins(next(r for r in VALID if type(r) is cls))
    # Under an unknown key (skipped, yet skipping recursed), and in place of each known field.
    if isinstance(wire, dict):
        places = ["zzz", *wire]
        for place in places:
            rest = {k: v for k, v in wire.items() if k != place}
            data = map_with_one_more(rest) + msgpack.packb(place) + deep
            got = outcome(cls, data)
            assert isinstance(got, MalformedRecord), place
            # Too long for the record, too deep, or not of the field's type at the first level.
            assert got.reason in {"depth", "size", "schema"}, (place, got.reason)
    else:
        for i in range(len(wire)):
            parts = [msgpack.packb(v, use_bin_type=True) for v in wire]
            parts[i] = deep
            data = bytes([0x90 + len(wire)]) + b"".join(parts)
            assert isinstance(outcome(cls, data), MalformedRecord), i


@pytest.mark.parametrize("cls", TYPES, ids=lambda c: c.__name__)
def test_nesting_as_deep_as_fits_under_an_unknown_key_is_refused_as_too_deep(cls: type[Record]) -> None:
    """Within the record's size limit, so the decoder does recurse (skipping the key) until it gives up."""
    wire = msgspec_builtins(next(r for r in VALID if type(r) is cls))
    if not isinstance(wire, dict):
        return  # an array_like record has no unknown keys (an extra element is refused as such)
    head = map_with_one_more(wire)
    depth = min(DEPTH, cls.max_bytes - len(head) - 8)
    data = head + b"\xa3zzz" + nested(depth, b"\x91")
    got = outcome(cls, data)
    if depth > 2_000:  # beyond the interpreter's recursion limit
        assert isinstance(got, MalformedRecord) and got.reason == "depth"
    else:  # shallow enough to skip: the record stands
        assert isinstance(got, cls)


def test_deep_nesting_inside_an_entry_of_a_list_of_records_is_refused() -> None:
    """A residency report whose ``models`` entry hides 60,000 levels under an unknown key: the decoder
    is two typed levels down when it starts skipping."""
    def pack(*items: Any) -> bytes:
        return b"".join(msgpack.packb(item) for item in items)

    entry = b"\x83" + pack("model", "a", "tier", "disk", "zzz") + nested(60_000, b"\x91")
    data = b"\x83" + pack("worker", "w", "updated_ms", 1, "models") + b"\x91" + entry
    assert len(data) <= WorkerResidency.max_bytes
    assert outcome(WorkerResidency, data).reason == "depth"  # type: ignore[union-attr]
    shallow = b"\x83" + pack("model", "a", "tier", "disk", "zzz") + nested(100, b"\x91")
    report = outcome(WorkerResidency, b"\x83" + pack("worker", "w", "updated_ms", 1, "models") + b"\x91" + shallow)
    assert isinstance(report, WorkerResidency) and report.models[0].model == "a"


@pytest.mark.parametrize("cls", TYPES, ids=lambda c: c.__name__)
def test_huge_container_headers_and_oversize_records_are_refused_within_a_memory_bound(cls: type[Record]) -> None:
    tracemalloc.start()
    try:
        for header in (b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
                       b"\xc6\xff\xff\xff\xff"):  # array32, map32, str32, bin32 of 4 G entries, truncated
            assert isinstance(outcome(cls, header + b"\x00" * 64), MalformedRecord)
        # As many empty arrays as fit under an unknown key: skipped, in the record's size limit.
        room = cls.max_bytes - 32
        many = b"\x81\xa3zzz\xdd" + room.to_bytes(4, "big") + b"\x90" * room
        assert isinstance(outcome(cls, many), MalformedRecord)  # the required fields are missing
        over = outcome(cls, b"\x90" * (cls.max_bytes + 1))
        assert isinstance(over, MalformedRecord) and over.reason == "size"
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * cls.max_bytes + (1 << 20), f"decoding peaked at {peak} bytes"


FLOAT_FIELDS = {
    HealthState: ["predicted_wait_ms", "arrival_rps", "drain_rps", "service_ms", "capacity_rps", "cold_start_ms"],
    BatchStats: ["compute_ms", "predicted_ms"],
    ModelStats: ["window_s", "inputs_rps", "batches_rps", "mean_batch", "service_ms", "requests_per_batch",
                 "steps_rps"],
    ScaleState: ["load_rps", "replica_rps"],
    ScaleDecision: ["load_rps", "replica_rps", "queued", "wait_ms"],
}


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0, MAX_DURATION_MS * 1e6],
                         ids=["nan", "inf", "-inf", "negative", "huge"])
def test_nan_inf_and_out_of_range_numbers_are_refused_in_every_float_field(bad: float) -> None:
    for record in VALID:
        wire = msgspec_builtins(record)
        if isinstance(wire, list):  # LevelChange: its wait is the last element
            wire[-1] = bad
            assert outcome(type(record), msgpack.packb(wire)).reason == "schema"  # type: ignore[union-attr]
            continue
        names = list(FLOAT_FIELDS.get(type(record), []))
        if isinstance(record, ModelResidency | WorkerResidency):
            target = wire if isinstance(record, ModelResidency) else wire["models"][0]
            target["swap_in_ms"]["disk"] = bad
            assert outcome(type(record), msgpack.packb(wire)).reason == "schema"  # type: ignore[union-attr]
            continue
        for name in names:
            if bad == MAX_DURATION_MS * 1e6 and name == "queued":
                continue  # a record count may be that large
            got = outcome(type(record), msgpack.packb({**wire, name: bad}))
            assert isinstance(got, MalformedRecord) and got.reason == "schema", (type(record).__name__, name, bad)
    nested_tuple = msgspec_builtins(VALID[0])
    nested_tuple["arrival_by_priority"] = [0.0, math.nan, 0.0]
    assert outcome(HealthState, msgpack.packb(nested_tuple)).reason == "schema"  # type: ignore[union-attr]


@pytest.mark.parametrize("field, value", [
    ("model", "Bad Name"), ("model", "a\n"), ("model", "x" * 64), ("model", ""), ("model", 7),
    ("level", 9), ("lag", -1), ("lag", 2**64 - 1), ("updated_ms", 2**62), ("updated_ms", 1.5),
    ("warm_replicas", -2), ("retry_after_ms", 10**12), ("lag_by_priority", [1, 2]),
])
def test_wrong_types_and_out_of_range_fields_are_refused(field: str, value: Any) -> None:
    wire = {**msgspec_builtins(VALID[0]), field: value}
    got = outcome(HealthState, msgpack.packb(wire))
    assert isinstance(got, MalformedRecord) and got.reason == "schema"


def test_names_lengths_and_tiers_are_held_to_their_patterns() -> None:
    base = msgspec_builtins(VALID[3])
    for bad in ({"worker": "bad worker"}, {"worker": "x" * 200}, {"models": [{"model": "a", "tier": "ram"}]},
                {"models": [{"model": "a", "tier": "disk", "swap_in_ms": {"tape": 1.0}}]},
                {"models": [{"model": "a", "tier": "disk"}] * 257}):
        assert outcome(WorkerResidency, msgpack.packb({**base, **bad})).reason in {"schema", "size"}  # type: ignore[union-attr]
    answered = msgspec_builtins(VALID[-1])
    for bad in ({"positions": [[4, 0, 1]]}, {"positions": [[0, -1, 1]]}, {"positions": [[0, 0, -1]]},
                {"positions": [[0, 0, 2**63]]}, {"positions": [[0, 0]]}, {"worker": "bad worker"},
                {"positions": [[0, 0, 1]] * (MAX_POSITIONS + 1)}):
        assert outcome(Answered, msgpack.packb({**answered, **bad})).reason in {"schema", "size"}  # type: ignore[union-attr]
    stats = msgspec_builtins(VALID[5])
    for bad in ({"shed": {f"r{i}": 1 for i in range(17)}}, {"shed": {"Not A Reason": 1}}, {"size": 2**31}):
        assert outcome(BatchStats, msgpack.packb({**stats, **bad})).reason == "schema"  # type: ignore[union-attr]


@pytest.mark.parametrize("cls", TYPES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("data, reason", [(None, "tombstone"), ("text", "type"), (7, "type"), (b"", "syntax")])
def test_tombstones_and_non_bytes_are_refused(cls: type[Record], data: object, reason: str) -> None:
    got = outcome(cls, data)
    assert isinstance(got, MalformedRecord) and got.reason == reason
    assert isinstance(outcome(cls, bytearray(next(r for r in VALID if type(r) is cls).pack())), cls)
