"""The delivery guard: marks in committed metadata pin down a record that stops workers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kinfer.consumers.poison import DeliveryGuard, Mark, Verdict, mark_text, parse_mark

TP = "infer.m.p1/0"


def take(mark: str, position: int = 10, careful: int = 4) -> tuple[DeliveryGuard[str], dict[str, tuple[int, str]]]:
    guard: DeliveryGuard[str] = DeliveryGuard(careful)
    guard.assigning([TP])
    assert guard.held() == {TP}  # nothing is fetched before the mark is read
    taken = guard.assigned({TP: (position, mark)})
    return guard, taken


def test_a_partition_handed_over_cleanly_is_worked_as_usual() -> None:
    for mark in ("", mark_text(Mark.HANDED), "someone else's metadata"):
        guard, taken = take(mark)
        assert taken == {TP: (10, mark_text(Mark.OWNED))} and guard.held() == set()
        assert [guard.verdict(TP, o) for o in (10, 11, 12)] == [Verdict.RUN] * 3
        assert guard.metadata(TP) == mark_text(Mark.OWNED)


def test_after_an_owner_stopped_records_are_worked_one_at_a_time() -> None:
    guard, taken = take(mark_text(Mark.OWNED), careful=2)
    assert taken == {TP: (10, mark_text(Mark.CAREFUL, 1))}
    assert guard.verdict(TP, 10) is Verdict.MARK and guard.in_flight_mark(TP) == mark_text(Mark.IN_FLIGHT, 1)
    assert guard.verdict(TP, 11) is Verdict.DEFER and guard.held() == {TP}  # one at a time
    assert guard.awaiting_commit()
    guard.committed(TP, 10)  # the in-flight mark itself does not release it
    assert guard.held() == {TP}
    guard.committed(TP, 11)  # its reply is out and committed
    assert guard.held() == set() and guard.metadata(TP) == mark_text(Mark.CAREFUL, 1)
    assert guard.verdict(TP, 11) is Verdict.MARK
    guard.committed(TP, 12)
    assert not guard.careful(TP)  # the careful stretch is over
    assert guard.verdict(TP, 12) is Verdict.RUN and guard.metadata(TP) == mark_text(Mark.OWNED)


def test_a_record_that_stopped_a_careful_owner_is_poison() -> None:
    guard, taken = take(mark_text(Mark.IN_FLIGHT, 1))
    assert taken == {TP: (10, mark_text(Mark.IN_FLIGHT, 2))}  # kept, should this owner stop before it
    assert guard.verdict(TP, 10) is Verdict.POISON and guard.crashes(TP) == 2
    guard.committed(TP, 11)  # dead-lettered and committed: the stretch goes on after it
    assert guard.verdict(TP, 11) is Verdict.MARK


def test_a_careful_owner_that_stopped_between_records_leaves_no_poison() -> None:
    guard, _ = take(mark_text(Mark.CAREFUL, 1))
    assert guard.verdict(TP, 10) is Verdict.MARK  # careful again, nobody dead-lettered


def test_a_position_past_the_mark_is_taken() -> None:
    guard, _ = take(mark_text(Mark.OWNED))
    assert guard.verdict(TP, 15) is Verdict.MARK  # retention removed 10..14


def test_off_means_off() -> None:
    guard, taken = take(mark_text(Mark.IN_FLIGHT, 3), careful=0)
    assert guard.verdict(TP, 10) is Verdict.RUN and taken == {TP: (10, mark_text(Mark.OWNED))}


def test_no_committed_position_is_taken_unmarked() -> None:
    guard: DeliveryGuard[str] = DeliveryGuard()
    guard.assigning([TP])
    assert guard.assigned({TP: (-1, None)}) == {} and guard.held() == set() and guard.taken([TP]) == {}


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.text(max_size=40) | st.sampled_from(["kinfer:careful=", "kinfer:inflight=99999999", "kinfer:careful=²"]))
def test_any_metadata_parses(text: str) -> None:
    mark, count = parse_mark(text)
    assert isinstance(mark, Mark) and 0 <= count < 1_000_000


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.lists(st.sampled_from(["fetch", "done", "crash"]), max_size=60), st.integers(0, 30))
def test_a_record_never_stops_more_than_two_workers(steps: list[str], poison_at: int) -> None:
    """A model of owners coming and going over one partition with one poison record: whatever the
    interleaving of fetches, completions and crashes of other kinds, the poison stops at most two."""
    committed, metadata = 0, ""
    stopped_by_poison = 0
    guard: DeliveryGuard[str] | None = None
    running: int | None = None
    dead_lettered = False
    for step in [*steps, *["fetch", "done"] * 80]:
        if guard is None:
            guard = DeliveryGuard(8)
            guard.assigning([TP])
            (committed, metadata), = guard.assigned({TP: (committed, metadata)}).values()
            position, running = committed, None
        if step == "crash" or (running == poison_at and step == "done"):
            if running == poison_at:
                stopped_by_poison += 1
            guard, running = None, None
            continue
        if step == "fetch" and running is None:
            verdict = guard.verdict(TP, position)
            if verdict is Verdict.DEFER:
                continue
            if verdict is Verdict.MARK:
                committed, metadata = position, guard.in_flight_mark(TP)
            if verdict is Verdict.POISON:
                dead_lettered = position == poison_at
                position += 1
                committed, metadata = position, guard.metadata(TP)
                guard.committed(TP, position)
                continue
            running = position
        elif step == "done" and running is not None:
            position, running = running + 1, None
            committed, metadata = position, guard.metadata(TP)
            guard.committed(TP, position)
    assert stopped_by_poison <= 2
    assert dead_lettered or stopped_by_poison < 2
