"""The background tier's share between tenants (``batcher.share``): a window per model that follows the
measured rate, deficit round robin by tenant, withdrawn batches gone."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kinfer.batcher.share import BackgroundShare


def lines(batch: str, n: int, model: str = "m", cost: int = 1) -> list[tuple[str, str, int, str]]:
    return [(f"{batch}-{i}", model, cost, f"{batch}-{i}") for i in range(n)]


def test_a_small_batch_waits_behind_one_window_not_behind_a_big_one() -> None:
    share: BackgroundShare[str] = BackgroundShare(min_window=16)
    share.add("big", "a", lines("big", 10_000))
    first = share.take(0.0)
    assert len(first) == 16 and share.waiting() == 10_000 - 16  # one window out, the rest waits
    share.add("small", "b", lines("small", 2))
    taken: list[str] = []
    for batch, line_id, _ in first:  # as the window's lines end, the turns alternate by tenant
        share.ended(batch, line_id, 0.0)
        taken += [line_id for _, line_id, _ in share.take(0.0)]
    # Deficit round robin charges a turn of 8 inputs: the small batch's both lines come within a turn of
    # the big one's, not after its 9,984 waiting lines.
    assert {"small-0", "small-1"} <= set(taken[:10])


def test_a_withdrawn_batch_publishes_nothing_more_and_frees_its_window() -> None:
    share: BackgroundShare[str] = BackgroundShare(min_window=4)
    share.add("x", "a", lines("x", 100))
    assert len(share.take(0.0)) == 4 and share.take(0.0) == []  # the window is full
    assert share.withdraw("x", 0.0) == 96 and share.waiting() == 0 and share.in_flight() == 0
    share.ended("x", "x-0", 0.0)  # a late result of a withdrawn batch changes nothing
    share.add("y", "a", lines("y", 10))
    assert [line_id for _, line_id, _ in share.take(0.0)] == ["y-0", "y-1", "y-2", "y-3"]


def test_a_line_that_could_not_be_published_goes_back_first() -> None:
    share: BackgroundShare[str] = BackgroundShare(min_window=2)
    share.add("x", "a", lines("x", 5))
    taken = share.take(0.0)
    share.failed(*taken[1], 0.0)
    share.ended("x", taken[0][1], 0.0)
    assert [line_id for _, line_id, _ in share.take(0.0)] == ["x-1", "x-2"]


def test_models_have_windows_of_their_own() -> None:
    share: BackgroundShare[str] = BackgroundShare(min_window=3)
    share.add("x", "a", lines("x", 10, model="m1") + lines("z", 10, model="m2"))
    out = Counter(line_id[0] for _, line_id, _ in share.take(0.0))
    assert out == {"x": 3, "z": 3} and share.in_flight("m1") == share.in_flight("m2") == 3


def test_the_window_grows_to_a_slice_of_the_measured_rate() -> None:
    """Workers that end every line 50 ms after it is published, 400 at a time (8,000 lines/s): the window
    grows from its floor until a slice (1 s) of their work is queued, and no further."""
    share: BackgroundShare[str] = BackgroundShare(min_window=64, max_window=100_000, slice_s=1.0)
    share.add("x", "a", lines("x", 200_000))
    flying: list[tuple[float, str]] = []
    now = 0.0
    for _ in range(400):  # 20 s in 50 ms steps
        for _, line_id, _ in share.take(now):
            flying.append((now, line_id))
        now += 0.05
        capacity = 400  # the workers' lines per 50 ms
        while flying and flying[0][0] <= now - 0.05 and capacity:
            share.ended("x", flying.pop(0)[1], now)
            capacity -= 1
    assert 6_000 <= share.window("m") <= 10_000  # about a second of 8,000/s


def test_a_model_that_stays_idle_keeps_its_rate() -> None:
    share: BackgroundShare[str] = BackgroundShare(min_window=2, slice_s=1.0)
    share.add("x", "a", lines("x", 1_000))
    now = 0.0
    for _ in range(40):  # 10 lines/s while busy
        for batch, line_id, _ in share.take(now):
            now += 0.1
            share.ended(batch, line_id, now)
    before = share.window("m")
    share.withdraw("x", now)
    share.take(now + 3600.0)  # an hour with nothing in flight
    assert share.window("m") == before


batch_specs = st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 30), st.integers(1, 5)),
                       min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(batches=batch_specs, ends=st.lists(st.integers(0, 50), max_size=200), withdraw=st.sets(st.integers(0, 5)))
def test_every_line_is_taken_once_in_its_batch_order_within_the_window(
        batches: list[tuple[str, int, int]], ends: list[int], withdraw: set[int]) -> None:
    share: BackgroundShare[str] = BackgroundShare(min_window=5)
    added: dict[str, list[str]] = {}
    for n, (tenant, count, cost) in enumerate(batches):
        added[f"b{n}"] = [line_id for line_id, *_ in lines(f"b{n}", count)]
        share.add(f"b{n}", tenant, lines(f"b{n}", count, cost=cost))
    gone = {f"b{n}" for n in withdraw if n < len(batches)}
    for batch in gone:
        share.withdraw(batch, 0.0)
    taken: dict[str, list[str]] = {}
    flying: list[tuple[str, str]] = []
    now = 0.0
    for step in [*ends, *[0] * 400]:
        now += step / 10
        for batch, line_id, _ in share.take(now):
            taken.setdefault(batch, []).append(line_id)
            flying.append((batch, line_id))
        assert share.in_flight("m") <= share.window("m")
        if flying:
            share.ended(*flying.pop(step % len(flying)), now)
    assert set(taken) == set(added) - gone
    for batch, got in taken.items():
        assert got == added[batch]  # each line once, in order, none of a withdrawn batch
    assert share.waiting() == 0


@settings(max_examples=200, deadline=None)
@given(big=st.integers(50, 400), small=st.integers(1, 20), cost=st.integers(1, 6))
def test_two_tenants_with_lines_waiting_alternate_by_inputs(big: int, small: int, cost: int) -> None:
    """While both wait, what the two tenants have taken differs by at most one turn (8 inputs) and a line."""
    share: BackgroundShare[str] = BackgroundShare(min_window=1)
    share.add("big", "a", lines("big", big))
    share.add("small", "b", lines("small", small, cost=cost))
    used = {"a": 0, "b": 0}
    taken = {"big": 0, "small": 0}
    while taken["small"] < small:
        ((batch, line_id, _),) = share.take(0.0)
        taken[batch] += 1
        used["a" if batch == "big" else "b"] += 1 if batch == "big" else cost
        if taken["big"] < big and taken["small"] < small:
            assert abs(used["a"] - used["b"]) <= 8 + cost
        share.ended(batch, line_id, 0.0)
    assert used["a"] <= small * cost + 8 + cost  # the small batch was done after about its own share


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        BackgroundShare(min_window=0)
    with pytest.raises(ValueError):
        BackgroundShare(slice_s=0)
