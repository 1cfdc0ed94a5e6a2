"""The worker's at-least-once bookkeeping across rebalances, as a state machine over a model.

The model holds what the worker shell and aiokafka do around ``OffsetTracker``, each step a rule
Hypothesis may take in any order:

- the broker: records appended per partition; one committed offset per partition, overwritten by
  every commit it accepts (a late commit may move it back); a partition this worker does not own
  may be served and committed meanwhile by another worker;
- the consumer: an assignment; after a rebalance a partition's position is read from the committed
  offset (whenever that read happens), and nothing is fetched from the start of a revocation until
  the next assignment (aiokafka's fetcher waits while a reassignment is in progress);
- the shell: each fetched record tracked and queued; queued records run in batches; a finished
  batch's replies published later (tracker ``done`` after the publish, whatever happened meanwhile:
  completions from before a revocation land after it); commits computed from ``committable`` and
  answered later, accepted or refused, in any order (a commit computed before a revocation may be
  answered after the next assignment); a revocation commits what is done, drops the queued records of
  its partitions and forgets them; the next assignment is the same partitions, others, or none;
- a worker paused past its session timeout (a long batch, a GC pause, SIGSTOP): out of the group, the
  commit it sends on resuming is refused, its revocation's commit is accepted (the broker takes a
  commit from no member while the group is empty), and the same partitions come back to it;
- the process stopping (SIGKILL, the OOM killer): records fetched and not dispatched, batches running,
  replies not out yet go with it; commits it sent may still land; a new process starts from the
  committed offsets with a new tracker.

Checked at every step: no committed offset passes a record whose reply is not published. At the end
every partition comes back to this worker, everything is drained, and every record ever written is
published and committed: whatever was fetched was published or fetched again.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kinfer.consumers.offsets import OffsetTracker

PARTITIONS = ("a", "b", "c")
Record = tuple[str, int]

SETTINGS = settings(max_examples=200, stateful_step_count=60, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class WorkerModel(RuleBasedStateMachine):
    """One worker, its tracker (the real one), and the broker and consumer it talks to."""

    tracker_class: type[OffsetTracker[str]] = OffsetTracker

    def __init__(self) -> None:
        super().__init__()
        self.tracker = self.tracker_class()
        self.log_end = dict.fromkeys(PARTITIONS, 0)  # records written
        self.committed: dict[str, int] = {}  # the broker's committed offsets
        # What the consumer reports (the old assignment while revoking); it starts with every partition.
        self.assignment = frozenset(PARTITIONS)
        self.fetchable: frozenset[str] | None = self.assignment  # None: a reassignment is in progress
        self.position: dict[str, int | None] = dict.fromkeys(PARTITIONS)  # None: read from the committed offset
        self.queued: set[Record] = set()  # in the core, not started
        self.running: list[frozenset[Record]] = []  # batches in the executor
        self.publishing: list[frozenset[Record]] = []  # replies made, not yet out
        self.published: set[Record] = set()
        self.commits: list[dict[str, int]] = []  # sent, not yet answered
        self.revoke_commit: dict[str, int] | None = None  # the revocation's own commit, awaited
        self.revoking: frozenset[str] | None = None
        self.orphans: list[dict[str, int]] = []  # commits a stopped process sent: they may still land
        # One of them landed below a later commit: the live process does not know, and commits again only
        # when its positions move (records below are answered again after its next stop: never lost).
        self.moved_back = False

    # -- the broker and the consumer ----------------------------------------------------------

    @rule(tp=st.sampled_from(PARTITIONS), n=st.integers(1, 4))
    def produce(self, tp: str, n: int) -> None:
        self.log_end[tp] += n

    def _fetchable(self) -> list[str]:
        """Assigned partitions with records past the consumer's position (or its committed offset)."""
        return [tp for tp in sorted(self.fetchable or ()) if self._at(tp) < self.log_end[tp]]

    def _at(self, tp: str) -> int:
        position = self.position[tp]
        return self.committed.get(tp, 0) if position is None else position

    @precondition(lambda self: bool(self._fetchable()))
    @rule(data=st.data(), n=st.integers(1, 5))
    def fetch_some(self, data: st.DataObject, n: int) -> None:
        self.fetch(data.draw(st.sampled_from(self._fetchable())), n)

    def fetch(self, tp: str, n: int) -> None:
        assert self.fetchable is not None and tp in self.fetchable
        position = self.position[tp]
        if position is None:  # the first fetch after an assignment reads the committed offset
            position = self.committed.get(tp, 0)
        for offset in range(position, min(position + n, self.log_end[tp])):
            self.tracker.track(tp, offset)
            self.queued.add((tp, offset))
            position = offset + 1
        self.position[tp] = position

    @precondition(lambda self: any(self.position.get(tp, 0) is None for tp in self.fetchable or ()))
    @rule(data=st.data())
    def read_committed(self, data: st.DataObject) -> None:
        """aiokafka resets a freshly assigned partition to its committed offset, read at some point."""
        tp = data.draw(st.sampled_from(sorted(tp for tp in self.fetchable or () if self.position[tp] is None)))
        self.position[tp] = self.committed.get(tp, 0)

    def _elsewhere(self) -> list[str]:
        return [tp for tp in PARTITIONS if tp not in (self.revoking or self.assignment)
                and self.committed.get(tp, 0) < self.log_end[tp]]

    @precondition(lambda self: bool(self._elsewhere()))
    @rule(data=st.data(), n=st.integers(1, 5))
    def another_worker_serves(self, data: st.DataObject, n: int) -> None:
        """A partition this worker does not own is served by another one: answered, then committed."""
        tp = data.draw(st.sampled_from(self._elsewhere()))
        start = self.committed.get(tp, 0)
        end = min(start + n, self.log_end[tp])
        self.published |= {(tp, off) for off in range(start, end)}
        self.committed[tp] = end

    # -- the shell ----------------------------------------------------------------------------

    @precondition(lambda self: bool(self.queued))
    @rule(data=st.data())
    def start_batch(self, data: st.DataObject) -> None:
        batch = data.draw(st.sets(st.sampled_from(sorted(self.queued)), min_size=1, max_size=6))
        self.queued -= batch
        self.running.append(frozenset(batch))

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def complete_batch(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.running) - 1))
        self.publishing.append(self.running.pop(i))

    @precondition(lambda self: bool(self.publishing))
    @rule(data=st.data())
    def publish(self, data: st.DataObject) -> None:
        """Replies out, then their offsets are done: possibly long after the assignment they were fetched in."""
        i = data.draw(st.integers(0, len(self.publishing) - 1))
        replies = self.publishing.pop(i)
        self.published |= replies
        for tp, offset in replies:
            self.tracker.done(tp, offset)

    @rule()
    def send_commit(self) -> None:
        positions = self.tracker.committable(self.assignment)
        if positions:
            self.commits.append(positions)

    @precondition(lambda self: bool(self.commits))
    @rule(data=st.data(), accepted=st.booleans())
    def answer_commit(self, data: st.DataObject, accepted: bool) -> None:
        i = data.draw(st.integers(0, len(self.commits) - 1))
        positions = self.commits.pop(i)
        if accepted:
            self._accept(positions)

    def _accept(self, positions: dict[str, int]) -> None:
        self.committed.update(positions)
        self.tracker.mark_committed(positions)

    # -- a rebalance: the revocation (commit what is done, drop, forget), then an assignment -----

    @precondition(lambda self: self.revoking is None and self.fetchable is not None)
    @rule()
    def begin_revocation(self) -> None:
        self.fetchable = None  # the fetcher holds everything back from here on
        self.revoking = self.assignment
        self.revoke_commit = self.tracker.positions(self.assignment)  # handing over: moved or not

    @precondition(lambda self: self.revoking is not None)
    @rule(accepted=st.booleans())
    def end_revocation(self, accepted: bool) -> None:
        assert self.revoking is not None and self.revoke_commit is not None
        if accepted and self.revoke_commit:
            self._accept(self.revoke_commit)
        self.queued = {(tp, off) for tp, off in self.queued if tp not in self.revoking}
        self.tracker.forget(self.revoking)
        self.revoking = self.revoke_commit = None

    @precondition(lambda self: self.fetchable is not None and self.revoking is None)
    @rule()
    def expelled_and_rejoined(self) -> None:
        """Resumed after its session expired: the commit it sends is refused (not applied), the group
        rejoins, the revocation's commit lands, and the same partitions are assigned again."""
        self.tracker.committable(self.assignment)  # computed and sent, refused by the broker
        self.begin_revocation()
        self.end_revocation(accepted=True)
        self.assign(self.assignment)

    @rule()
    def process_stops(self) -> None:
        """The process dies with whatever it held; a new one (a new tracker) is assigned the partitions
        later. Commits it had sent may still land, at any time (``orphan_commit_lands``)."""
        self.queued, self.running, self.publishing = set(), [], []
        self.orphans += self.commits
        self.commits = []
        self.revoking = self.revoke_commit = None
        self.tracker = self.tracker_class()
        self.fetchable = None

    @precondition(lambda self: bool(self.orphans))
    @rule(data=st.data())
    def orphan_commit_lands(self, data: st.DataObject) -> None:
        positions = self.orphans.pop(data.draw(st.integers(0, len(self.orphans) - 1)))
        self.moved_back |= any(pos < self.committed.get(tp, 0) for tp, pos in positions.items())
        self.committed.update(positions)

    @precondition(lambda self: self.fetchable is None and self.revoking is None)
    @rule(tps=st.frozensets(st.sampled_from(PARTITIONS)))
    def assign(self, tps: frozenset[str]) -> None:
        self.assignment = self.fetchable = tps
        self.position = dict.fromkeys(tps)

    # -- what must hold -----------------------------------------------------------------------

    @invariant()
    def committed_offsets_never_pass_an_unpublished_record(self) -> None:
        for tp, position in self.committed.items():
            missing = [off for off in range(position) if (tp, off) not in self.published]
            assert not missing, f"{tp} committed at {position}, unpublished below it: {missing}"

    def teardown(self) -> None:
        """Every partition comes back to this worker and everything drains: all of it published."""
        for positions in self.orphans:  # a stopped process's commits land at last (before the drain reads them)
            self.committed.update(positions)
        self.orphans = []
        if self.revoking is not None:
            self.end_revocation(accepted=False)
        elif self.fetchable is not None and self.fetchable != frozenset(PARTITIONS):
            self.begin_revocation()
            self.end_revocation(accepted=False)
        if self.fetchable is None:
            self.assign(frozenset(PARTITIONS))
        while True:
            for batch in self.running:
                self.publishing.append(batch)
            self.running = []
            for replies in self.publishing:
                self.published |= replies
                for tp, offset in replies:
                    self.tracker.done(tp, offset)
            self.publishing = []
            for tp in self._fetchable():
                self.fetch(tp, self.log_end[tp])
            if self.queued:
                self.running.append(frozenset(self.queued))
                self.queued = set()
                continue
            break
        self.commits = []
        self._accept(self.tracker.committable(self.assignment))
        self.committed_offsets_never_pass_an_unpublished_record()
        written = {(tp, off) for tp in PARTITIONS for off in range(self.log_end[tp])}
        assert written <= self.published, sorted(written - self.published)
        if not self.moved_back:
            assert all(self.committed.get(tp, 0) == self.log_end[tp] for tp in PARTITIONS), (self.committed,
                                                                                             self.log_end)
        assert self.tracker.in_flight() == 0


def test_bookkeeping_across_rebalances_loses_nothing() -> None:
    run_state_machine_as_test(WorkerModel, settings=SETTINGS)


# -- the model catches the mistakes it is there for --------------------------------------------


class _DoneOnForget(OffsetTracker[str]):
    """Positions advanced for the records dropped at a revocation (counted done instead of forgotten)."""

    def forget(self, tps: Iterable[str]) -> None:
        for tp in tps:
            for offset in list(self._open.get(tp, ())):
                self.done(tp, offset)


class _IgnoresOpen(OffsetTracker[str]):
    """Commits up to what was fetched, answered or not."""

    def committable(self, assigned: Iterable[str] | None = None) -> dict[str, int]:
        return {tp: max(pos, self._next[tp]) for tp, pos in super().committable(assigned).items()}


def _with_tracker(tracker: type[OffsetTracker[str]]) -> type[WorkerModel]:
    return type(f"WorkerModelWith{tracker.__name__}", (WorkerModel,), {"tracker_class": tracker})


@pytest.mark.parametrize("broken", [_with_tracker(_DoneOnForget), _with_tracker(_IgnoresOpen)],
                         ids=["done-on-forget", "ignores-open"])
def test_the_model_finds_broken_bookkeeping(broken: type[WorkerModel]) -> None:
    # Not shrunk, and not derandomized: a fixed seed, so that the examples do not depend on what the
    # test session ran before (derandomized, this search came out differently after other modules).
    found = settings(SETTINGS, max_examples=1_000, report_multiple_bugs=False, phases=[Phase.generate],
                     derandomize=False, database=None)
    broken = seed(20261202)(broken)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(broken, settings=found)
