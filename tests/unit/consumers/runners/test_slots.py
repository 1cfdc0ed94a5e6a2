"""The slot table's bookkeeping: which row each sequence holds, what moves where, which bucket runs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kinfer.consumers.runners.slots import SlotTable, bucket_sizes


def test_buckets_are_powers_of_two_up_to_the_slots() -> None:
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(8) == (1, 2, 4, 8)
    assert bucket_sizes(48) == (1, 2, 4, 8, 16, 32, 48)
    assert SlotTable(4, context=1000).windows == (64, 128, 256, 512, 1000)
    assert SlotTable(4, context=16).windows == (16,)
    with pytest.raises(ValueError):
        bucket_sizes(0)


def test_a_prompt_leaves_its_slot_room_for_one_token_and_a_full_table_refuses() -> None:
    table = SlotTable(2, context=8)
    with pytest.raises(ValueError):
        table.admit("long", 8)
    with pytest.raises(ValueError):
        table.admit("empty", 0)
    table.admit("a", 7)
    table.admit("b", 1)
    with pytest.raises(ValueError, match="held"):
        table.admit("c", 1)
    with pytest.raises(ValueError, match="already"):
        table.admit("a", 1)
    table.grow("a", 7)
    table.grow("a", 1)
    assert table.room("a") == 0
    with pytest.raises(ValueError, match="context"):
        table.grow("a", 1)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(1, 99)),
        st.tuples(st.just("grow"), st.integers(0, 30), st.integers(1, 40)),
        st.tuples(st.just("release"), st.integers(0, 30)),
    ),
    max_size=80,
)


@settings(max_examples=300)
@given(slots=st.integers(1, 9), ops=OPS)
def test_rows_stay_packed_and_every_sequence_keeps_its_own_columns_through_moves(
    slots: int, ops: list[tuple[int | str, ...]]
) -> None:
    """A simulated KV block follows the table's moves: whatever admits, growths (prefill chunks, decode
    steps), finishes, cancels and evictions come, each held sequence finds exactly its own columns in its
    row, the held rows are the first ones, and the bucket is the smallest that covers them."""
    context = 100
    table = SlotTable(slots, context)
    block: list[list[str | None]] = [[None] * context for _ in range(slots)]
    own: dict[str, list[str]] = {}  # what each sequence wrote, in order
    serial = 0
    for op in ops:
        held = table.ids
        if op[0] == "admit":
            if len(held) == slots:
                with pytest.raises(ValueError):
                    table.admit("x", 1)
                continue
            rid, serial = f"r{serial}", serial + 1
            slot = table.admit(rid, int(op[1]))
            assert slot == len(held)
            own[rid] = []
        elif op[0] == "grow" and held:
            rid = held[int(op[1]) % len(held)]
            n = min(int(op[2]), table.room(rid))
            slot, start = table.slot(rid), table.length(rid)
            for j in range(n):
                block[slot][start + j] = f"{rid}:{start + j}"
                own[rid].append(f"{rid}:{start + j}")
            table.grow(rid, n)
        elif op[0] == "release" and held:
            rid = held[int(op[1]) % len(held)]
            move = table.release(rid)
            del own[rid]
            if move is not None:
                assert move.src == len(held) - 1 and move.dst < move.src  # the last row fills the hole
                block[move.dst][: move.length] = block[move.src][: move.length]
        held = table.ids
        assert sorted(table.slot(r) for r in held) == list(range(len(held)))
        for rid in held:
            assert block[table.slot(rid)][: table.length(rid)] == own[rid]
            assert table.prefilled(rid) == (table.remaining_prompt(rid) == 0)
        bucket = table.bucket()
        assert bucket >= len(held)
        assert all(b < len(held) for b in table.buckets if b < bucket)
        window = table.window()  # every row's columns and the one it writes next, when it has room
        assert all(window >= min(table.length(r) + 1, context) for r in held)
        assert all(w < max((min(table.length(r) + 1, context) for r in held), default=1)
                   for w in table.windows if w < window)
