"""The delivery guard: marks in committed metadata pin down a record that stops workers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kinfer.consumers.poison import CarefulToken, DeliveryGuard, Mark, Verdict, mark_text, parse_mark

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
        assert guard.metadata(TP, 13) == mark_text(Mark.OWNED) and guard.handing(TP, 13) == mark_text(Mark.HANDED)


def test_after_an_owner_stopped_records_are_worked_one_at_a_time() -> None:
    guard, taken = take(mark_text(Mark.OWNED), careful=2)
    assert taken == {TP: (10, mark_text(Mark.CAREFUL, 1))}
    assert guard.verdict(TP, 10) is Verdict.MARK and guard.in_flight_mark(TP) == mark_text(Mark.IN_FLIGHT, 1)
    assert guard.verdict(TP, 11) is Verdict.DEFER and guard.held() == {TP} and guard.quiet  # alone
    assert guard.refetch_from(TP, 11) == 11
    assert guard.awaiting_commit()
    assert guard.metadata(TP, 10) == mark_text(Mark.IN_FLIGHT, 1)  # no commit at its offset unmarks it
    guard.committed(TP, 10)  # the in-flight mark itself does not release it
    assert guard.held() == {TP}
    guard.committed(TP, 11)  # its reply is out and committed
    assert guard.held() == set() and not guard.quiet and guard.metadata(TP, 11) == mark_text(Mark.CAREFUL, 1)
    assert guard.verdict(TP, 11) is Verdict.MARK
    guard.committed(TP, 12)
    assert not guard.careful(TP)  # the careful stretch is over
    assert guard.verdict(TP, 12) is Verdict.RUN and guard.metadata(TP, 13) == mark_text(Mark.OWNED)


def test_a_record_that_stopped_a_careful_owner_is_poison() -> None:
    guard, taken = take(mark_text(Mark.IN_FLIGHT, 1))
    assert taken == {TP: (10, mark_text(Mark.IN_FLIGHT, 2))}  # kept, should this owner stop before it
    assert guard.verdict(TP, 10) is Verdict.POISON and guard.crashes(TP) == 2
    assert guard.metadata(TP, 10) == mark_text(Mark.IN_FLIGHT, 2)  # kept until it is committed past
    guard.committed(TP, 11)  # dead-lettered and committed: the stretch goes on after it
    assert guard.verdict(TP, 11) is Verdict.MARK


def test_a_careful_owner_that_stopped_between_records_leaves_no_poison() -> None:
    guard, taken = take(mark_text(Mark.CAREFUL, 1))
    assert taken == {TP: (10, mark_text(Mark.CAREFUL, 2))}
    assert guard.verdict(TP, 10) is Verdict.MARK  # careful again, nobody dead-lettered


def test_a_position_past_the_mark_is_taken_and_one_before_it_fetched_from_the_mark() -> None:
    guard, _ = take(mark_text(Mark.OWNED))
    assert guard.verdict(TP, 8) is Verdict.DEFER and guard.refetch_from(TP, 8) == 10
    assert guard.verdict(TP, 15) is Verdict.MARK  # retention removed 10..14


def test_one_careful_record_in_flight_in_the_whole_worker() -> None:
    token = CarefulToken()
    a: DeliveryGuard[str] = DeliveryGuard(4, token)
    b: DeliveryGuard[str] = DeliveryGuard(4, token)
    a.assigned({"a/0": (0, mark_text(Mark.OWNED)), "a/1": (0, mark_text(Mark.OWNED))})
    b.assigned({"b/0": (0, mark_text(Mark.OWNED)), "b/1": (0, "")})
    assert a.verdict("a/0", 0) is Verdict.MARK
    assert a.verdict("a/1", 0) is Verdict.DEFER and b.verdict("b/0", 0) is Verdict.DEFER
    assert b.quiet and a.held() == {"a/0", "a/1"} and b.held() == {"b/0"}
    assert b.verdict("b/1", 0) is Verdict.RUN  # fetched before the worker went quiet: runs as usual
    a.forget(["a/0"])  # revoked while in flight: the token goes with it
    assert not token.busy and b.verdict("b/0", 0) is Verdict.MARK


def test_a_careful_partition_handed_over_stays_careful_and_a_poison_stays_marked() -> None:
    guard, _ = take(mark_text(Mark.OWNED))  # 1 stopped
    assert guard.handing(TP, 10) == mark_text(Mark.CAREFUL, 0)  # the next owner counts the same 1
    assert guard.verdict(TP, 10) is Verdict.MARK
    assert guard.handing(TP, 10) == mark_text(Mark.CAREFUL, 0)  # merely running here: not marked
    poisoned, _ = take(mark_text(Mark.IN_FLIGHT, 1))
    assert poisoned.handing(TP, 10) == mark_text(Mark.IN_FLIGHT, 1)
    again, taken = take(poisoned.handing(TP, 10))
    assert taken == {TP: (10, mark_text(Mark.IN_FLIGHT, 2))} and again.verdict(TP, 10) is Verdict.POISON


def test_off_means_off() -> None:
    guard, taken = take(mark_text(Mark.IN_FLIGHT, 3), careful=0)
    assert guard.verdict(TP, 10) is Verdict.RUN and taken == {TP: (10, mark_text(Mark.OWNED))}


def test_no_committed_position_is_taken_unmarked() -> None:
    guard: DeliveryGuard[str] = DeliveryGuard()
    guard.assigning([TP])
    assert guard.assigned({TP: (-1, None)}) == {} and guard.held() == set() and guard.taken([TP]) == {}
    guard.assigning([TP])
    guard.forget([TP])  # assigned and gone before its mark was read: not held for ever
    assert guard.held() == set()


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.text(max_size=40) | st.sampled_from(["kinfer:careful=", "kinfer:inflight=99999999", "kinfer:careful=²"]))
def test_any_metadata_parses(text: str) -> None:
    mark, count = parse_mark(text)
    assert isinstance(mark, Mark) and 0 <= count < 1_000_000


@settings(max_examples=400, derandomize=True, deadline=None)
@given(st.lists(st.sampled_from(["fetch", "done", "crash", "handover"]), max_size=60), st.integers(0, 6))
def test_a_record_never_stops_more_than_two_workers(steps: list[str], poison_at: int) -> None:
    """A model of owners coming and going over one partition with one poison record: whatever the
    interleaving of fetches, completions, clean handovers and crashes of other kinds, the poison stops
    at most two workers, and is dead-lettered once it has stopped two."""
    committed, metadata = 0, ""
    stopped_by_poison = 0
    guard: DeliveryGuard[str] | None = None
    running: int | None = None
    dead_lettered = False
    position = 0
    for step in [*steps, *["fetch", "done"] * 40]:
        if guard is None:
            guard = DeliveryGuard(8)
            guard.assigning([TP])
            taken = guard.assigned({TP: (committed, metadata)})
            (committed, metadata), = taken.values()
            position, running = committed, None
        if step == "crash" or (running == poison_at and step == "done"):
            if running == poison_at:
                stopped_by_poison += 1
            guard, running = None, None
            continue
        if step == "handover":  # revoked: the safe position committed as handed (a running record is not)
            safe = running if running is not None else position
            committed, metadata = safe, guard.handing(TP, safe)
            guard, running = None, None
            continue
        if step == "fetch" and running is None:
            verdict = guard.verdict(TP, position)
            if verdict is Verdict.DEFER:
                continue
            if verdict is Verdict.MARK:
                committed, metadata = position, guard.in_flight_mark(TP)
            if verdict is Verdict.POISON:
                dead_lettered = dead_lettered or position == poison_at
                position += 1
                committed, metadata = position, guard.metadata(TP, position)
                guard.committed(TP, position)
                continue
            running = position
        elif step == "done" and running is not None:
            position, running = running + 1, None
            committed, metadata = position, guard.metadata(TP, position)
            guard.committed(TP, position)
    assert stopped_by_poison <= 2
    assert dead_lettered or stopped_by_poison < 2
