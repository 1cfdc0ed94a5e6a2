"""The engine cores (``consumers.cores``) driven by hand: no Kafka, no Redis, no threads, no torch model.

Each test plays the worker shell itself: it admits jobs, asks ``shed`` and ``next``, runs the
planned call (``plan.work.call()``) and hands the result to ``complete`` in an ``Outcome``. Time is
a number passed in, never read from a clock, so every assertion is about counts and order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kinfer.batcher import BatchPolicy, GenPolicy
from kinfer.consumers.cores import BatchCore, GenCore, Job, Next, Notes, Outcome, Outgoing, Work
from kinfer.consumers.observer import BatchFacts, Observer, StepFacts
from kinfer.consumers.runners import ModelSpec
from kinfer.consumers.runners.generator import GeneratorRunner, GenInput, TokenEvent
from kinfer.consumers.runners.noop import NoopRunner
from kinfer.topics import Chunk, InvalidRequest, Priority, Request, Result, Status, Turn
from kinfer.topics.auth import cancel_mac, new_reply_key
from kinfer.topics.envelope import ReplyRoute

ROUTE = ReplyRoute.channel("kinfer:reply:x")
T0 = 1_000.0  # monotonic seconds: where every test's clock starts
FAR = T0 + 3_600.0  # a deadline nothing here gets near


# -- doubles ------------------------------------------------------------------------------------


@dataclass
class RecordingObserver(Observer):
    """Records every fact a core reports, in order."""

    calls: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)

    def shed(self, model: str, priority: Priority, reason: str) -> None:
        self.calls.append(("shed", (model, priority, reason)))

    def batch(self, model: str, facts: BatchFacts) -> None:
        self.calls.append(("batch", (model, facts)))

    def step(self, model: str, facts: StepFacts) -> None:
        self.calls.append(("step", (model, facts)))

    def codel(self, model: str, dropping: bool) -> None:
        self.calls.append(("codel", (model, dropping)))

    def generation(self, model: str, running: int, kv_reserved: int, kv_unused: int) -> None:
        self.calls.append(("generation", (model, running, kv_reserved)))

    def cancelled(self, model: str) -> None:
        self.calls.append(("cancelled", (model,)))

    def answered_elsewhere(self, model: str, copies: int) -> None:
        self.calls.append(("answered_elsewhere", (model, copies)))

    def of(self, name: str) -> list[tuple[Any, ...]]:
        return [args for n, args in self.calls if n == name]


class FakeBatchRunner(NoopRunner):
    """The noop model, recording its calls: each output names its input; a batch holding "boom" fails."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[str]] = []

    def run(self, texts: list[str]) -> list[Any]:
        self.calls.append(list(texts))
        if any("boom" in t for t in texts):
            raise RuntimeError("boom")
        return [f"out({t})" for t in texts]


class FakeGenerator:
    """A generation runner that keeps its own rows, like ``GeneratorRunner.step``.

    Every step drops the rows it is told to, decodes one token for each running row, then
    prefills the admitted ones (their first token); a row finishes with "length" after its
    ``max_new_tokens``. Token ``n`` of request ``r`` has the text ``"r.n "``.
    """

    family = "generator"
    device = "cpu"

    def __init__(self, max_prompt_tokens: int = 256, fail: bool = False) -> None:
        self.max_prompt_tokens = max_prompt_tokens
        self.max_rows: int | None = None
        self.max_sequence_tokens: int | None = None
        self.spec_proposed = 0
        self.spec_accepted = 0
        self.batch = None
        self.fail = fail
        self.resets = 0  # times ``reset`` was called
        self.rows: dict[str, tuple[GenInput, int]] = {}  # id → (input, tokens generated)
        self.steps: list[tuple[list[str], list[str]]] = []  # (admitted ids, dropped ids) per call
        self.ever: set[str] = set()
        self.admitted: dict[str, GenInput] = {}  # every input the runner was given, by id

    def load(self) -> None:
        pass

    def warmup(self) -> None:
        pass

    def count_tokens(self, text: str) -> int:
        return len(text) // 3 + 1

    def render_chat(self, turns: list[tuple[str, str]]) -> tuple[str, tuple[str, ...]]:
        """``[role] content`` per turn, then ``[bot]``; stops at ``[user]``; refuses an empty turn."""
        if any(not content for _, content in turns):
            raise ValueError("the template refuses an empty turn")
        return "".join(f"[{role}] {content} " for role, content in turns) + "[bot]", ("[user]",)

    def reset(self) -> None:
        self.resets += 1
        self.rows.clear()

    def step(self, admit: list[GenInput], drop: list[str]) -> list[TokenEvent]:
        self.steps.append(([a.id for a in admit], list(drop)))
        if self.fail:
            raise RuntimeError("CUDA error: device-side assert triggered")
        for rid in drop:
            self.rows.pop(rid, None)
        events = [self._token(rid) for rid in list(self.rows)]
        for a in admit:
            assert a.id not in self.rows, f"{a.id} admitted while it is still a row"
            self.admitted[a.id] = a
            self.rows[a.id] = (a, 0)
            self.ever.add(a.id)
            events.append(self._token(a.id))
        for e in events:
            if e.finish is not None:
                del self.rows[e.id]
        return events

    def _token(self, rid: str) -> TokenEvent:
        gen_input, n = self.rows[rid]
        n += 1
        self.rows[rid] = (gen_input, n)
        finish = "length" if n >= gen_input.sampling.max_new_tokens else None
        return TokenEvent(rid, token=n, text=f"{rid}.{n} ", finish=finish, prompt_tokens=7, generated=n)


def full_text(rid: str, tokens: int) -> str:
    return "".join(f"{rid}.{n} " for n in range(1, tokens + 1))


# -- builders -----------------------------------------------------------------------------------


def request(rid: str, inputs: tuple[str, ...] = ("hello",), *, priority: Priority = Priority.P1,
            stream: bool = False, params: dict[str, Any] | None = None, model: str = "m",
            messages: tuple[Turn, ...] = (), reply_key: bytes | None = None) -> Request:
    return Request(id=rid, model=model, priority=priority, tenant="t", created_ms=1, deadline_ms=2,
                   inputs=() if messages else inputs, reply=ROUTE, params=params or {}, stream=stream,
                   messages=messages, reply_key=reply_key)


def job(req: Request, *, partition: Hashable = "tp0", offset: int = 0, deadline: float = FAR,
        fetched: float = T0, queue_ms: float = 0.0) -> Job:
    return Job(req, partition, offset, queue_ms, fetched, deadline)


def batch_core(policy: BatchPolicy | None = None) -> tuple[BatchCore, FakeBatchRunner, RecordingObserver]:
    runner, observer = FakeBatchRunner(), RecordingObserver()
    core = BatchCore(ModelSpec("m", "noop"), runner, policy or BatchPolicy(), "w1", observer)
    return core, runner, observer


def gen_core(policy: GenPolicy | None = None, *, fail: bool = False
             ) -> tuple[GenCore, FakeGenerator, RecordingObserver]:
    runner, observer = FakeGenerator(fail=fail), RecordingObserver()
    core = GenCore(ModelSpec("m", "generator"), cast(GeneratorRunner, runner), policy or GenPolicy(), "w1", observer)
    return core, runner, observer


def execute(work: Work, started: float, took_s: float = 0.01) -> Outcome:
    """What the worker's executor does with a ``Work``: call it, and say how it went."""
    try:
        return Outcome(work.call(), None, started, took_s)
    except Exception as exc:
        return Outcome(None, exc, started, took_s)


def drain_batches(core: BatchCore, now: float, took_s: float = 0.01) -> list[Outgoing]:
    """The dispatch loop until the core has nothing left: shed, next, run, complete."""
    out: list[Outgoing] = []
    for _ in range(1_000):
        out += core.shed(now, now)
        plan = core.next(now)
        out += plan.replies
        if plan.work is None:
            assert not core.has_work()
            return out
        out += core.complete(plan.work, execute(plan.work, now, took_s))
        now += took_s
    raise AssertionError("the batch core never ran dry")


def gen_step(core: GenCore, now: float) -> tuple[Next, list[Outgoing]]:
    """One generation step: the plan, and every reply it gave (the plan's own, then the step's)."""
    plan = core.next(now)
    out = list(plan.replies)
    if plan.work is not None:
        out += core.complete(plan.work, execute(plan.work, now))
    return plan, out


def drain_gen(core: GenCore, now: float, limit: int = 200) -> list[Outgoing]:
    out: list[Outgoing] = []
    for i in range(limit):
        if not core.has_work():
            return out
        out += gen_step(core, now + i * 0.01)[1]
    raise AssertionError("the generation core never ran dry")


def by_id(replies: list[Outgoing]) -> dict[str, list[Result | Chunk]]:
    grouped: dict[str, list[Result | Chunk]] = {}
    for r in replies:
        assert r.message.id == r.job.request.id
        grouped.setdefault(r.message.id, []).append(r.message)
    return grouped


def terminals(replies: list[Outgoing]) -> Counter[str]:
    return Counter(r.message.id for r in replies if r.terminal)


# -- BatchCore ----------------------------------------------------------------------------------


def test_batch_every_request_gets_one_ok_result_with_its_outputs_in_order_across_batches() -> None:
    core, runner, observer = batch_core(BatchPolicy(max_batch_size=4))
    sizes = {"a": 1, "b": 3, "c": 2, "d": 1, "e": 4, "f": 2}
    for i, (rid, n) in enumerate(sizes.items()):
        assert core.admit(job(request(rid, tuple(f"{rid}-{k}" for k in range(n))), offset=i), T0)
    assert core.buffered() == sum(sizes.values()) and core.has_work()

    replies = drain_batches(core, T0)

    assert len(runner.calls) >= 3  # 13 inputs, at most 4 a batch
    assert all(len(texts) <= 4 for texts in runner.calls)
    assert terminals(replies) == dict.fromkeys(sizes, 1)
    for rid, n in sizes.items():
        [message] = by_id(replies)[rid]
        assert isinstance(message, Result)
        assert message.status is Status.OK and message.error is None
        assert message.outputs == [f"out({rid}-{k})" for k in range(n)]
        assert message.model == "m" and message.worker == "w1"
    assert core.buffered() == 0 and not core.has_work()
    facts = [f for _, f in observer.of("batch")]
    assert len(facts) == len(runner.calls)
    assert [f.size for f in facts] == [len(t) for t in runner.calls]
    assert sum(f.requests for f in facts) == len(sizes) and sum(f.errors for f in facts) == 0


def test_batch_a_cancel_note_drops_the_queued_copies_unrun_and_keeps_out_a_copy_fetched_later() -> None:
    core, runner, observer = batch_core()
    key = new_reply_key()
    hedged = request("h", ("twice",), reply_key=key)
    assert core.admit(job(hedged, partition="tp0", offset=0), T0)
    assert core.admit(job(request("o", ("other",), reply_key=key), partition="tp0", offset=1), T0)

    # Only the request's sender can make the note: a forged MAC, or none, drops nothing.
    assert core.cancel("h", cancel_mac(new_reply_key(), "h"), T0) == []
    assert core.cancel("h", None, T0) == []
    assert core.buffered() == 2

    mac = cancel_mac(key, "h")
    [dropped] = core.cancel("h", mac, T0 + 0.1)
    assert (dropped.request.id, dropped.partition, dropped.offset) == ("h", "tp0", 0)  # its offset is done
    assert core.buffered() == 1
    # The copy on the partition that stalled comes later: not admitted (no reply of its own), not run.
    assert not core.admit(job(hedged, partition="tp2", offset=7), T0 + 5)
    replies = drain_batches(core, T0 + 5)
    assert terminals(replies) == {"o": 1} and runner.calls == [["other"]]
    assert observer.of("answered_elsewhere") == [("m", 1), ("m", 1)]
    # Kept a while, not for ever: a copy after that runs (and is answered, as before).
    assert core.admit(job(hedged, partition="tp1", offset=9), T0 + 0.1 + core.notes.keep_s)
    assert terminals(drain_batches(core, T0 + 70)) == {"h": 1}


def test_batch_a_note_for_a_request_without_a_reply_key_is_taken_from_anyone() -> None:
    core, runner, _ = batch_core()
    core.cancel("plain", None, T0)
    assert not core.admit(job(request("plain")), T0)
    assert not core.has_work() and runner.calls == []


@settings(max_examples=60, deadline=None)
@given(notes=st.lists(st.tuples(st.sampled_from("abcdefgh"), st.floats(0.0, 5.0)), max_size=40),
       most=st.integers(1, 5))
def test_notes_are_bounded_and_each_lasts_its_time_at_most(notes: list[tuple[str, float]], most: int) -> None:
    kept = Notes(keep_s=2.0, most=most)
    now, first_at = T0, {}
    for rid, step in notes:
        now += step
        first_at = {r: at for r, at in first_at.items() if kept.covers(request(r), now)}
        kept.add(rid, None, now)
        if rid in first_at:  # a second note for a kept id makes no room: nothing else kept goes
            assert all(kept.covers(request(r), now) for r in first_at)
        first_at.setdefault(rid, now)
        assert len(kept) <= most and kept.covers(request(rid), now)  # the newest is always kept
    for rid in "abcdefgh":  # a note covers only within keep_s of the first one kept for it
        if kept.covers(request(rid), now):
            assert now - first_at[rid] < 2.0


def test_batch_a_failing_batch_runs_again_one_by_one_and_only_the_culprit_fails() -> None:
    core, runner, observer = batch_core(BatchPolicy(max_batch_size=3))
    for i, rid in enumerate(["a", "b", "c"]):
        core.admit(job(request(rid, (f"{rid} boom" if rid == "b" else rid,)), offset=i), T0)
    first = drain_batches(core, T0)
    assert runner.calls == [["a", "b boom", "c"], ["a"], ["b boom"], ["c"]]
    assert terminals(first) == {"a": 1, "b": 1, "c": 1}
    results = {r.message.id: r.message for r in first}
    assert all(isinstance(m, Result) for m in results.values())
    assert results["b"].status is Status.ERROR and results["b"].error == "RuntimeError: boom"
    assert results["b"].outputs == []
    assert [results[k].outputs for k in "ac"] == [["out(a)"], ["out(c)"]]
    assert [f.errors for _, f in observer.of("batch")] == [1]

    # A lone request that fails is not run again; the core keeps working afterwards.
    core.admit(job(request("d", ("d boom",)), offset=10), T0 + 1)
    assert [r.message.status for r in drain_batches(core, T0 + 1)] == [Status.ERROR]  # type: ignore[union-attr]
    assert runner.calls[-1] == ["d boom"] and len(runner.calls) == 5
    for i, rid in enumerate(["e", "f"]):
        core.admit(job(request(rid, (rid,)), offset=20 + i), T0 + 2)
    second = drain_batches(core, T0 + 2)
    assert terminals(second) == {"e": 1, "f": 1}
    assert all(isinstance(r.message, Result) and r.message.status is Status.OK for r in second)
    assert [f.errors for _, f in observer.of("batch")] == [1, 1, 0]


def test_batch_a_stream_request_is_refused() -> None:
    core, _, _ = batch_core()
    with pytest.raises(InvalidRequest) as refused:
        core.admit(job(request("s", stream=True)), T0)
    assert refused.value.field == "stream"
    assert not core.has_work() and core.buffered() == 0


def test_batch_a_chat_is_refused_naming_the_model() -> None:
    core, _, _ = batch_core()
    with pytest.raises(InvalidRequest, match="does not chat") as refused:
        core.admit(job(request("c", messages=(Turn("user", "hi"),))), T0)
    assert refused.value.field == "model"
    assert not core.has_work()


def test_batch_an_expired_request_is_shed_once_and_never_runs() -> None:
    core, runner, observer = batch_core()
    core.admit(job(request("late", ("late",), priority=Priority.P2), offset=0, deadline=T0 + 1.0), T0)
    core.admit(job(request("ok1", ("ok1",)), offset=1), T0)
    core.admit(job(request("ok2", ("ok2",)), offset=2), T0)

    now = T0 + 1.0  # the deadline is now: too late
    shed = core.shed(now, now)
    assert [r.message.id for r in shed] == ["late"]
    [out] = shed
    assert out.terminal and isinstance(out.message, Result)
    assert out.message.status is Status.EXPIRED and out.message.outputs == []
    assert observer.of("shed") == [("m", Priority.P2, "expired")]
    assert core.shed(now, now) == []  # said once
    assert core.buffered() == 2

    rest = drain_batches(core, now)
    assert terminals(rest) == {"ok1": 1, "ok2": 1}
    assert all(isinstance(r.message, Result) and r.message.status is Status.OK for r in rest)
    assert not any("late" in t for texts in runner.calls for t in texts)
    assert len(observer.of("shed")) == 1


def test_batch_records_that_come_late_but_are_served_as_they_come_are_never_shed() -> None:
    """Each record written 300 ms before its fetch (a slow broker, or a worker whose clock runs 300 ms
    ahead of the producer's): far over CoDel's 50 ms target, for ten times its interval. The worker's own
    queue never stands, so nothing is shed and every request is answered."""
    core, runner, observer = batch_core(BatchPolicy(max_batch_size=1, codel_target_ms=50, codel_interval_ms=100))
    now, replies = T0, []
    for i in range(100):  # one every 10 ms, for a second; the one before it runs then: one always waits
        core.admit(job(request(f"r{i}", (f"r{i}",)), offset=i, fetched=now, queue_ms=300.0), now)
        replies += core.shed(now, now)
        if i:
            plan = core.next(now)
            assert plan.work is not None
            replies += core.complete(plan.work, execute(plan.work, now))
            assert runner.calls[-1] == [f"r{i - 1}"]
        now += 0.01
    replies += drain_batches(core, now)
    assert observer.of("shed") == []
    assert terminals(replies) == {f"r{i}": 1 for i in range(100)}
    assert all(isinstance(r.message, Result) and r.message.status is Status.OK for r in replies)


def test_batch_revoke_drops_the_lost_partitions_without_replies() -> None:
    core, runner, _ = batch_core()
    for i in range(6):
        core.admit(job(request(f"r{i}", (f"r{i}",)), partition=f"tp{i % 2}", offset=i), T0)

    assert core.revoke({"tp0"}) == 3
    assert core.buffered() == 3
    assert core.revoke({"tp0", "tp9"}) == 0  # nothing left of them

    replies = drain_batches(core, T0)
    assert terminals(replies) == {"r1": 1, "r3": 1, "r5": 1}
    assert {t for texts in runner.calls for t in texts} == {"r1", "r3", "r5"}


# -- GenCore ------------------------------------------------------------------------------------


def test_gen_a_plain_request_gets_one_result_with_the_whole_text() -> None:
    core, runner, observer = gen_core()
    assert core.admit(job(request("a", params={"max_new_tokens": 3})), T0)
    assert core.admit(job(request("b", params={"max_new_tokens": 5}), offset=1), T0)
    assert core.buffered() == 2

    replies = drain_gen(core, T0)

    assert [r.message.id for r in replies] == ["a", "b"]  # a is shorter: it leaves first
    assert all(r.terminal for r in replies)
    for r, n in zip(replies, (3, 5), strict=True):
        assert isinstance(r.message, Result) and r.message.status is Status.OK
        assert r.message.outputs == [{"text": full_text(r.message.id, n), "finish": "length", "prompt_tokens": 7,
                                      "completion_tokens": n}]
    assert not runner.rows and not core.has_work()
    assert sum(f.tokens for _, f in observer.of("step")) == 8
    assert sum(f.admitted for _, f in observer.of("step")) == 2
    # Timings: no batch wait (admitted at the first step), compute = its steps (10 ms each), batch of 2.
    a, b = (r.message.timings for r in replies)
    assert (a.batch_wait_ms, a.batch_size, b.batch_size) == (0.0, 2, 2)
    assert b.compute_ms > a.compute_ms > 0 and a.compute_ms == pytest.approx(3 * 10.0)


def test_gen_a_stream_comes_in_order_with_one_final_chunk() -> None:
    core, _, _ = gen_core()
    core.admit(job(request("s", stream=True, params={"max_new_tokens": 4})), T0)
    core.admit(job(request("p", params={"max_new_tokens": 2}), offset=1), T0)

    replies = drain_gen(core, T0)

    grouped = by_id(replies)
    assert all(isinstance(c, Chunk) for c in grouped["s"])
    chunks = cast(list[Chunk], grouped["s"])
    assert [c.seq for c in chunks] == [0, 1, 2, 3]
    assert [c.final for c in chunks] == [False, False, False, True]
    assert [c.status for c in chunks] == [None, None, None, Status.OK]
    assert chunks[-1].finish == "length" and chunks[-1].usage.completion_tokens == 4
    assert "".join(c.text for c in chunks) == full_text("s", 4)
    assert [r.terminal for r in replies if r.message.id == "s"] == [False, False, False, True]
    assert terminals(replies) == {"s": 1, "p": 1}
    [plain] = grouped["p"]
    assert isinstance(plain, Result) and plain.outputs[0]["text"] == full_text("p", 2)


def test_gen_cancel_ends_a_stream_in_band_and_the_runner_drops_it() -> None:
    core, runner, observer = gen_core()
    core.admit(job(request("s", stream=True, params={"max_new_tokens": 50})), T0)
    core.admit(job(request("o", params={"max_new_tokens": 6}), offset=1), T0)
    out: list[Outgoing] = []
    for i in range(2):
        out += gen_step(core, T0 + i)[1]
    assert [r.message.id for r in out] == ["s", "s"]

    assert core.cancel("s", None, T0 + 2) == []  # it leaves at its next step, with its final reply
    plan, more = gen_step(core, T0 + 2)
    [ended] = plan.replies
    assert ended.terminal and isinstance(ended.message, Chunk)
    assert ended.message.seq == 2 and ended.message.final
    assert ended.message.status is Status.OK and ended.message.finish == "cancelled"
    assert runner.steps[-1][1] == ["s"]  # told to drop it, in the very next step
    assert "s" not in runner.rows
    assert observer.of("cancelled") == [("m",)]
    core.cancel("s", None, T0 + 2)  # gone: nothing more to end

    out += more + drain_gen(core, T0 + 3)
    assert terminals(out) == {"s": 1, "o": 1}
    s_chunks = cast(list[Chunk], by_id(out)["s"])
    assert [c.seq for c in s_chunks] == [0, 1, 2]
    assert [c.final for c in s_chunks] == [False, False, True]
    [other] = by_id(out)["o"]
    assert isinstance(other, Result) and other.outputs[0]["text"] == full_text("o", 6)
    assert len(observer.of("cancelled")) == 1


def test_gen_a_duplicate_of_a_request_in_progress_is_not_admitted_and_gets_no_reply() -> None:
    core, runner, _ = gen_core()
    original = request("d", params={"max_new_tokens": 3})
    assert core.admit(job(original, offset=5), T0)
    gen_step(core, T0)
    assert not core.admit(job(original, offset=5), T0 + 0.5)  # a redelivered copy
    assert core.buffered() == 0

    replies = drain_gen(core, T0 + 1)

    assert terminals(replies) == {"d": 1}
    assert len(replies) == 1
    assert [admitted for admitted, _ in runner.steps].count(["d"]) == 1


def test_gen_a_sequence_whose_deadline_passes_before_it_starts_gets_an_expired_result() -> None:
    core, runner, observer = gen_core(GenPolicy(max_running=1))
    core.admit(job(request("long", params={"max_new_tokens": 5})), T0)
    core.admit(job(request("late", stream=True, params={"max_new_tokens": 5}), offset=1, deadline=T0 + 2), T0)
    out: list[Outgoing] = []
    for i in range(2):  # "late" waits: one sequence at a time
        out += gen_step(core, T0 + i)[1]
    assert core.buffered() == 1

    plan, more = gen_step(core, T0 + 2)  # its deadline
    [expired] = plan.replies
    assert expired.terminal
    assert isinstance(expired.message, Result)  # nothing was streamed: a plain result, not a chunk
    assert expired.message.status is Status.EXPIRED
    assert observer.of("shed") == [("m", Priority.P1, "deadline")]

    assert more[0] is expired
    out += more + drain_gen(core, T0 + 3)
    assert terminals(out) == {"long": 1, "late": 1}
    assert [type(m) for m in by_id(out)["late"]] == [Result]
    assert "late" not in runner.ever
    assert len(observer.of("shed")) == 1


def test_gen_a_request_too_large_for_the_kv_budget_is_invalid() -> None:
    core, runner, _ = gen_core(GenPolicy(kv_budget_tokens=64))
    core.admit(job(request("big", params={"max_new_tokens": 100})), T0)
    replies = drain_gen(core, T0)
    [r] = replies
    assert r.terminal and isinstance(r.message, Result) and r.message.status is Status.INVALID
    assert "big" not in runner.ever


def test_gen_a_slot_engine_runs_as_many_sequences_as_slots_each_within_its_context() -> None:
    """A runner with slots: the scheduler runs that many at once, whatever the policy said, and a request
    asking for more tokens than a slot holds is served (its output ends where the slot is full), not
    refused as too large for a KV budget."""
    runner, observer = FakeGenerator(), RecordingObserver()
    runner.max_rows, runner.max_sequence_tokens = 3, 40
    core = GenCore(ModelSpec("m", "generator"), cast(GeneratorRunner, runner),
                   GenPolicy(max_running=16, kv_budget_tokens=64), "w1", observer)
    assert (core.scheduler.policy.max_running, core.scheduler.policy.kv_budget_tokens) == (3, 120)
    for i in range(5):
        assert core.admit(job(request(f"r{i}", params={"max_new_tokens": 1000}), offset=i), T0)
    core.next(T0)
    assert len(core.scheduler.running) == 3
    assert all(s.reserved == 40 for s in core.scheduler.running)


def test_gen_a_failing_step_fails_the_sequences_in_it_and_the_core_serves_on() -> None:
    core, runner, observer = gen_core(GenPolicy(max_running=2))
    core.admit(job(request("s", stream=True, params={"max_new_tokens": 50})), T0)
    core.admit(job(request("p", params={"max_new_tokens": 50}), offset=1), T0)
    core.admit(job(request("w", params={"max_new_tokens": 2}), offset=2), T0)  # waits: the batch is full
    out: list[Outgoing] = []
    for i in range(2):
        out += gen_step(core, T0 + i)[1]
    assert [r.message.id for r in out] == ["s", "s"]

    runner.fail = True
    plan, failed = gen_step(core, T0 + 2)
    assert plan.work is not None and not plan.replies
    assert terminals(failed) == {"s": 1, "p": 1}
    by = {r.message.id: r.message for r in failed}
    stream_end, plain = by["s"], by["p"]
    assert isinstance(stream_end, Chunk) and stream_end.final and stream_end.seq == 2  # in band, after 2 chunks
    assert stream_end.status is Status.ERROR and "device-side assert" in (stream_end.error or "")
    assert isinstance(plain, Result) and plain.status is Status.ERROR and plain.outputs == []
    assert plain.error == "generation failed: RuntimeError: CUDA error: device-side assert triggered"
    assert runner.resets == 1 and not runner.rows  # the runner's batch starts over empty
    assert core.has_work() and [s.id for s in core.scheduler.waiting] == ["w"]
    assert len(observer.of("step")) == 2  # a failed step is no step to learn timings from

    runner.fail = False
    core.admit(job(request("n", params={"max_new_tokens": 3}), offset=3), T0 + 3)
    rest = drain_gen(core, T0 + 3)
    assert terminals(rest) == {"w": 1, "n": 1}
    assert all(isinstance(r.message, Result) and r.message.status is Status.OK for r in rest)
    assert by_id(rest)["n"][0].outputs[0]["text"] == full_text("n", 3)  # type: ignore[union-attr]
    core.cancel("s", None, T0 + 4)
    core.cancel("p", None, T0 + 4)
    assert not core.has_work() and observer.of("cancelled") == []


def test_gen_a_failing_step_sends_nothing_for_a_sequence_revoked_during_it() -> None:
    core, runner, _ = gen_core()
    core.admit(job(request("gone", params={"max_new_tokens": 9}), partition="tp1"), T0)
    core.admit(job(request("kept", params={"max_new_tokens": 9}), offset=1), T0)
    gen_step(core, T0)
    plan = core.next(T0 + 1)
    assert plan.work is not None
    runner.fail = True
    outcome = execute(plan.work, T0 + 1)
    assert core.revoke({"tp1"}) == 1  # while its step runs: the partition's new owner answers it
    [failed] = core.complete(plan.work, outcome)
    assert failed.message.id == "kept" and failed.message.status is Status.ERROR
    assert not core.has_work()


def test_gen_bad_requests_are_refused() -> None:
    core, _, _ = gen_core()
    with pytest.raises(InvalidRequest) as two:
        core.admit(job(request("x", ("a", "b"))), T0)
    assert two.value.field == "inputs"
    with pytest.raises(InvalidRequest) as bad:
        core.admit(job(request("y", params={"max_new_tokens": 0})), T0)
    assert bad.value.field == "params"
    assert not core.has_work()


def test_gen_a_chat_is_rendered_by_the_runner_with_its_template_stops() -> None:
    core, runner, _ = gen_core()
    chat = (Turn("system", "be brief"), Turn("user", "hello"))
    assert core.admit(job(request("c", messages=chat, params={"max_new_tokens": 2, "stop": "END"})), T0)
    drain_gen(core, T0)
    admitted = runner.admitted["c"]
    assert admitted.prompt == "[system] be brief [user] hello [bot]" and admitted.templated
    assert admitted.sampling.stop == ("END", "[user]")  # the caller's stops, then the template's
    with pytest.raises(InvalidRequest, match="refuses an empty turn") as refused:
        core.admit(job(request("e", messages=(Turn("user", ""),))), T0)
    assert refused.value.field == "messages"
    assert core.admit(job(request("p", ("plain",), params={"max_new_tokens": 1})), T0)
    drain_gen(core, T0)
    assert not runner.admitted["p"].templated and runner.admitted["p"].prompt == "plain"


def test_gen_revoke_stops_a_running_sequence_silently() -> None:
    core, runner, _ = gen_core()
    core.admit(job(request("lost", stream=True, params={"max_new_tokens": 20}), partition="tp0"), T0)
    core.admit(job(request("kept", params={"max_new_tokens": 6}), partition="tp1", offset=1), T0)
    core.admit(job(request("kept2", stream=True, params={"max_new_tokens": 4}), partition="tp1", offset=2), T0)
    before: list[Outgoing] = []
    for i in range(2):
        before += gen_step(core, T0 + i)[1]
    assert "lost" in runner.rows

    assert core.revoke({"tp0"}) == 1
    assert core.revoke({"tp0"}) == 0  # already going
    steps_before = len(runner.steps)
    after = drain_gen(core, T0 + 2)

    assert all(r.message.id != "lost" for r in after)
    assert any("lost" in dropped for _, dropped in runner.steps[steps_before:])
    assert "lost" not in runner.rows
    assert terminals(before + after) == {"kept": 1, "kept2": 1}
    [kept] = by_id(after)["kept"]
    assert isinstance(kept, Result) and kept.outputs[0]["text"] == full_text("kept", 6)
    kept2 = cast(list[Chunk], by_id(before + after)["kept2"])
    assert [c.seq for c in kept2] == [0, 1, 2, 3] and [c.final for c in kept2] == [False, False, False, True]


def test_gen_revoke_while_its_step_is_running_drops_what_that_step_made() -> None:
    core, runner, _ = gen_core()
    core.admit(job(request("lost", stream=True, params={"max_new_tokens": 20}), partition="tp0"), T0)
    core.admit(job(request("kept", params={"max_new_tokens": 3}), partition="tp1", offset=1), T0)
    gen_step(core, T0)
    plan = core.next(T0 + 1)  # a step starts...
    assert plan.work is not None
    assert core.revoke({"tp0"}) == 1  # ...the partition goes while it runs
    during = core.complete(plan.work, execute(plan.work, T0 + 1))
    assert [r.message.id for r in during] == []  # "kept" has one more to go; "lost" says nothing

    after = drain_gen(core, T0 + 2)
    assert terminals(after) == {"kept": 1} and all(r.message.id == "kept" for r in after)
    assert any("lost" in dropped for _, dropped in runner.steps)
    assert not runner.rows and not core.has_work()


def test_gen_a_copy_of_a_revoked_request_is_still_answered() -> None:
    """An eager rebalance revokes a partition and hands it straight back: its uncommitted requests are
    fetched again. A revoked sequence stays in the core until the next ``next()``; a copy admitted
    before then is refused as "in progress", yet the one in progress will never reply."""
    core, _, _ = gen_core()
    original = request("r", params={"max_new_tokens": 3})
    core.admit(job(original, partition="tp0", offset=7), T0)
    gen_step(core, T0)
    core.revoke({"tp0"})
    admitted = core.admit(job(original, partition="tp0", offset=7), T0 + 0.1)  # the partition came back
    replies = drain_gen(core, T0 + 1)
    assert admitted or terminals(replies)["r"] == 1, "the copy was refused, and nothing answers the request"
    assert terminals(replies) == {"r": 1}


# -- BatchCore, as a property ---------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One request of a generated mix."""

    size: int
    priority: int
    deadline_in: float  # seconds after its admission (<= 0: already expired)
    queue_ms: float
    partition: int
    poison: bool  # its inputs make the batch fail


specs = st.builds(
    Spec,
    size=st.integers(1, 5),
    priority=st.integers(0, 2),
    deadline_in=st.one_of(st.floats(-1.0, 0.0), st.floats(0.001, 0.5), st.just(3_600.0)),
    queue_ms=st.one_of(st.just(0.0), st.floats(0.0, 2_000.0)),
    partition=st.integers(0, 2),
    poison=st.sampled_from([False, False, False, True]),
)
admit_op = st.tuples(st.just("admit"), st.lists(specs, min_size=1, max_size=6))  # a burst of arrivals
step_op = st.tuples(st.sampled_from(["shed", "start", "complete"]), st.none())
ops = st.lists(  # weighted: mostly arrivals and dispatch, now and then a rebalance
    st.one_of(
        admit_op, admit_op, admit_op, step_op, step_op, step_op,
        st.tuples(st.just("revoke"), st.frozensets(st.integers(0, 2), min_size=1, max_size=1)),
        st.tuples(st.just("tick"), st.floats(0.0, 0.3)),
    ),
    min_size=10,
    max_size=60,
)
policies = st.builds(
    BatchPolicy,
    max_batch_size=st.integers(1, 8),
    max_batch_tokens=st.sampled_from([8, 64, 8_192]),
    codel_target_ms=st.sampled_from([5.0, 50.0]),
    codel_interval_ms=st.sampled_from([20.0, 500.0]),
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, policy=policies)
def test_batch_every_admitted_request_leaves_exactly_once(ops: list[tuple[str, Any]], policy: BatchPolicy) -> None:
    core, runner, observer = batch_core(policy)
    now = T0
    admitted: dict[str, Job] = {}
    left: Counter[str] = Counter()  # id → times it left (a terminal reply or a revoke)
    queued: set[str] = set()  # admitted, not yet in a batch (as far as the test can tell)
    revoked: set[str] = set()
    in_flight: tuple[Work, Outcome, set[str]] | None = None  # one executor, like the worker

    def ids_in(texts: list[str]) -> set[str]:
        return {t.split("/")[0] for t in texts}

    def take(replies: list[Outgoing]) -> None:
        for r in replies:
            assert r.terminal and isinstance(r.message, Result)
            rid = r.message.id
            assert rid in admitted and rid not in revoked, f"{rid}: a reply it should never get"
            left[rid] += 1
            queued.discard(rid)
            inputs = admitted[rid].request.inputs
            if r.message.status is Status.OK:
                assert r.message.outputs == [f"out({t})" for t in inputs]
                assert not any("boom" in t for t in inputs)
            else:
                assert r.message.outputs == []
                # A failing batch runs again request by request: only a poisoned request fails.
                assert r.message.status is not Status.ERROR or any("boom" in t for t in inputs)

    def start() -> None:
        nonlocal in_flight
        plan = core.next(now)
        take(plan.replies)
        if plan.work is not None:
            before = len(runner.calls)
            outcome = execute(plan.work, now)  # run at once: the texts say which requests it took
            running = ids_in([t for call in runner.calls[before:] for t in call])
            assert running <= queued, "a batch took a request twice, or one that had left"
            queued.difference_update(running)
            in_flight = (plan.work, outcome, running)

    def complete() -> None:
        nonlocal in_flight
        assert in_flight is not None
        work, outcome, running = in_flight
        in_flight = None
        replies = core.complete(work, outcome)
        assert {r.message.id for r in replies} == running
        take(replies)

    for n, (op, arg) in enumerate(ops):
        if op == "admit":
            burst: list[Spec] = arg
            for k, spec in enumerate(burst):
                rid = f"r{n}-{k}"
                texts = tuple(f"{rid}/{i}" + (" boom" if spec.poison else "") for i in range(spec.size))
                j = job(request(rid, texts, priority=Priority(spec.priority)), partition=spec.partition,
                        offset=len(admitted), deadline=now + spec.deadline_in, fetched=now, queue_ms=spec.queue_ms)
                assert core.admit(j, now)
                admitted[rid] = j
                queued.add(rid)
        elif op == "shed":
            take(core.shed(now, now if in_flight is None else now + in_flight[0].predicted_s))
        elif op == "start" and in_flight is None:
            start()
        elif op == "complete" and in_flight is not None:
            complete()
        elif op == "revoke":
            lost = {rid for rid in queued if admitted[rid].partition in arg}
            assert core.revoke(set(arg)) == len(lost)
            for rid in lost:
                left[rid] += 1
            revoked.update(lost)
            queued.difference_update(lost)
        elif op == "tick":
            now += arg
        assert core.buffered() == sum(len(admitted[rid].request.inputs) for rid in queued)

    # The worker drains: whatever is still inside comes out.
    if in_flight is not None:
        complete()
    for _ in range(1_000):
        take(core.shed(now, now))
        if in_flight is None and not core.has_work():
            break
        start()
        if in_flight is not None:
            complete()
        now += 0.01

    assert not queued and not core.has_work() and core.buffered() == 0
    assert left == dict.fromkeys(admitted, 1), "every admitted request leaves exactly once"
    replied = len(admitted) - len(revoked)
    shed_facts = len(observer.of("shed"))
    batched = sum(f.requests for _, f in observer.of("batch"))
    assert shed_facts + batched == replied  # each reply counted once: shed, or in its batch
