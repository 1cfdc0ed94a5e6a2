"""Commit positions never pass an offset whose reply is not out."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kinfer.consumers.offsets import OffsetTracker


def test_out_of_order_completion() -> None:
    t: OffsetTracker[str] = OffsetTracker()
    for off in range(5):
        t.track("p0", off)
    t.done("p0", 3)
    t.done("p0", 1)
    assert t.committable() == {"p0": 0}  # offset 0 still open
    t.done("p0", 0)
    assert t.committable() == {"p0": 2}
    t.mark_committed({"p0": 2})
    assert t.committable() == {}  # nothing moved
    t.done("p0", 2)
    t.done("p0", 4)
    assert t.committable() == {"p0": 5}
    assert t.in_flight() == 0


def test_only_assigned_partitions_and_forget() -> None:
    t: OffsetTracker[str] = OffsetTracker()
    t.track("a", 10)
    t.track("b", 20)
    t.done("a", 10)
    t.done("b", 20)
    assert t.committable(assigned={"a"}) == {"a": 11}
    t.forget(["b"])
    assert t.committable() == {"a": 11}


def test_a_commit_that_lands_after_a_later_one_is_followed_by_the_later_one_again() -> None:
    """aiokafka retries a commit refused for a transient reason: an earlier position can land last, and
    the broker keeps it. The tracker believes the broker, so the later position is offered again."""
    t: OffsetTracker[str] = OffsetTracker()
    for off in range(5):
        t.track("p", off)
    for off in range(3):
        t.done("p", off)
    early = t.committable()
    t.done("p", 3)
    t.done("p", 4)
    late = t.committable()
    assert (early, late) == ({"p": 3}, {"p": 5})
    t.mark_committed(late)
    assert t.committable() == {}
    t.mark_committed(early)  # answered last: the broker now holds 3
    assert t.committable() == {"p": 5}


@given(st.lists(st.integers(0, 50), unique=True, min_size=1), st.data())
def test_commit_position_is_safe(offsets: list[int], data: st.DataObject) -> None:
    t: OffsetTracker[str] = OffsetTracker()
    for off in sorted(offsets):
        t.track("p", off)
    finished: set[int] = set()
    for off in data.draw(st.permutations(offsets)):
        t.done("p", off)
        finished.add(off)
        position = t.committable().get("p")
        if position is not None:
            # Every tracked offset below the position is finished.
            assert all(o in finished for o in offsets if o < position)
            t.mark_committed({"p": position})
    assert t.committable() == {} or t.committable() == {"p": max(offsets) + 1}


@given(st.lists(st.sampled_from(["fetch-a", "fetch-b", "publish", "commit"]), max_size=200), st.randoms())
def test_coalesced_commits_never_pass_an_unpublished_reply(steps: list[str], rng: object) -> None:
    """Fetches, out-of-order publishes and commits interleaved in any order, as a worker coalescing its
    commits sees them: no committed position ever passes a reply that is not out, and what a crash
    right after a commit would replay is exactly what was published at or past that position."""
    import random

    assert isinstance(rng, random.Random)
    t: OffsetTracker[str] = OffsetTracker()
    next_offset = {"a": 0, "b": 0}
    open_: set[tuple[str, int]] = set()
    published: set[tuple[str, int]] = set()
    committed = {"a": 0, "b": 0}
    for step in [*steps, "commit"]:
        if step.startswith("fetch"):
            tp = step[-1]
            t.track(tp, next_offset[tp])
            open_.add((tp, next_offset[tp]))
            next_offset[tp] += 1
        elif step == "publish" and open_:
            done = rng.choice(sorted(open_))
            open_.discard(done)
            published.add(done)
            t.done(*done)
        elif step == "commit":
            positions = t.committable()
            for tp, position in positions.items():
                assert all(off >= position for p, off in open_ if p == tp), (tp, position, open_)
            t.mark_committed(positions)
            committed.update(positions)
    replay = {(tp, off) for tp, off in published if off >= committed[tp]}
    assert replay == {(tp, off) for tp, off in published if off > min(
        [o for p, o in open_ if p == tp], default=next_offset[tp])}
