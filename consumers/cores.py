"""Engine cores: one per hosted model, synchronous, no I/O, no threads, no clock of their own.

A core is the whole decision state of one model in a worker (in the spirit of vLLM v1's engine
core and TGI's ``State::next_batch``). The worker shell feeds it and moves bytes; the core decides,
and says everything it decided as values:

    admit(job, now)              queue a decoded request (False: a copy of one in progress, which
                                   answers for both), or raise ``InvalidRequest``
    shed(now, free_at)           → replies for what it refuses now (expired, cannot make it, CoDel)
    next(now, max_s)             → ``Next``: work for the executor (or None), and replies that are
                                   due before it (generation: sequences leaving the batch)
    complete(work, outcome)      → replies for what the work produced (or its failure)
    revoke(partitions)           drop everything from partitions this worker lost, without replies:
                                   the partitions' new owner answers them
    cancel(request_id, mac, now) its sender needs no answer any more: a stream ends (generation); the
                                   queued copies of a hedged request answered elsewhere leave unrun
                                   (returned, no reply), and a copy fetched later is not admitted

Every admitted request leaves a core exactly once, as a terminal reply (``Outgoing.terminal``) or
through ``revoke``. Facts worth counting go to an ``Observer`` (see ``consumers.observer``) once,
where they are decided.
"""

from __future__ import annotations

import abc
import hmac
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from kinfer.batcher import (
    Batch,
    BatchPolicy,
    BusyShare,
    ContinuousScheduler,
    DynamicBatcher,
    Finish,
    GenPolicy,
    Pending,
    Reason,
    Sequence,
)
from kinfer.consumers.observer import BatchFacts, Observer, StepFacts
from kinfer.consumers.runners.base import BatchRunner, Runner, StepRunner
from kinfer.consumers.runners.registry import ModelSpec
from kinfer.consumers.runners.sampling import GenInput, Sampling, TokenEvent
from kinfer.topics import Chunk, InvalidRequest, ModelError, Request, Result, Status, Timings, Usage
from kinfer.topics.auth import cancel_mac


@dataclass(slots=True)
class Job:
    """A fetched, valid request and where it came from."""

    request: Request
    partition: Hashable  # the Kafka partition it was read from (opaque here)
    offset: int
    queue_ms: float  # Kafka record timestamp → fetched
    fetched: float  # monotonic seconds
    deadline: float  # monotonic seconds: the request's wall-clock deadline on the local clock
    trace: Any = None  # the request's trace context when it is traced (``topics.tracing.incoming``), else None


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A reply to publish. ``terminal``: the request is done once it is out (its offset may commit)."""

    job: Job
    message: Result | Chunk
    terminal: bool = True


@dataclass(slots=True)
class Work:
    """One call for the executor thread: a batch's forward pass or a generation step."""

    call: Callable[[], Any]  # blocking: runs off the event loop
    predicted_s: float  # how long it should take (when the executor is free again)
    state: Any = None  # the core's own record of what it started


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the executor made of a ``Work``."""

    value: Any  # the call's return value (None when it raised)
    error: BaseException | None
    started: float  # monotonic seconds
    took_s: float


@dataclass(frozen=True, slots=True)
class Next:
    """What a core says to do next: work for the executor (or None), and replies due before it."""

    work: Work | None
    replies: list[Outgoing] = field(default_factory=list)


_SHED_STATUS = {Reason.EXPIRED: Status.EXPIRED, Reason.DEADLINE: Status.EXPIRED, Reason.CODEL: Status.SHED}
_SHED_TEXT = {
    Reason.EXPIRED: "deadline passed while queued",
    Reason.DEADLINE: "cannot finish by its deadline (predicted queue + compute)",
    Reason.CODEL: "shed under overload: the standing queue would make it late (lowest priority first)",
}


def proven(request: Request, mac: bytes | None) -> bool:
    """Whether a cancel note's ``mac`` comes from the sender of ``request`` (or the request carries no
    reply key, and anyone may cancel it)."""
    key = request.reply_key
    return key is None or (mac is not None and hmac.compare_digest(cancel_mac(key, request.id), mac))


class EngineCore(abc.ABC):
    """What the worker shell needs of a model, whatever its family."""

    cancellable = False  # whether ``cancel`` can do anything

    def __init__(self, spec: ModelSpec, worker_id: str, observer: Observer) -> None:
        self.spec = spec
        self.worker_id = worker_id
        self.observer = observer

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    @abc.abstractmethod
    def runner(self) -> Runner: ...

    @abc.abstractmethod
    def admit(self, job: Job, now: float) -> bool:
        """Queue a decoded request; raises ``InvalidRequest`` for what this model cannot take.

        False: this copy needs no reply of its own (its offset is done): a request with the same id is
        in progress here (a redelivered copy), which answers the id, or its sender already has its answer
        (``cancel``).
        """

    def shed(self, now: float, free_at: float) -> list[Outgoing]:
        """Refuse now what cannot be served in time; ``free_at``: when the executor is free."""
        return []

    @abc.abstractmethod
    def next(self, now: float, max_s: float | None = None) -> Next:
        """The next work to run (``max_s``: a co-located neighbour waits, stay within it)."""

    @abc.abstractmethod
    def complete(self, work: Work, outcome: Outcome) -> list[Outgoing]:
        """Replies for what ``work`` produced."""

    @abc.abstractmethod
    def revoke(self, partitions: set[Any]) -> int:
        """Forget every request from ``partitions`` (no replies); returns how many."""

    def cancel(self, request_id: str, mac: bytes | None, now: float) -> list[Job]:
        """The sender of ``request_id`` needs no answer any more (a stream's client went away, or a hedged
        request was answered through another copy); ``mac`` proves it is the sender (``proven``).

        Returns the copies that leave now without a reply (their offsets are done). A stream leaves at
        the next step instead, with its final reply; a request unknown here, finished or not proven is
        left alone."""
        return []

    @abc.abstractmethod
    def buffered(self) -> int:
        """Work fetched and not started (inputs or requests): what flow control bounds."""

    def background_buffered(self) -> int:
        """Of ``buffered``, background work (p3)."""
        return 0

    def background_room(self) -> int:
        """How much background work to hold here (inputs or requests): enough for the next slice when
        one ends; 0 takes none."""
        return 0

    def background_allowed(self, now: float) -> bool:
        """Whether background work may run now (interactive work leaves room for it)."""
        return True

    @abc.abstractmethod
    def has_work(self) -> bool:
        """Anything to run or to answer."""

    def wake_at(self, now: float, idle: bool) -> float | None:
        """When a decision could change with no new event (None: only events matter)."""
        return None

    def _result(self, job: Job, status: Status, *, outputs: list[Any] | None = None, error: str | None = None,
                timings: Timings | None = None, tokens: int = 0) -> Result:
        return Result(id=job.request.id, model=self.name, status=status, outputs=outputs or [], error=error,
                      timings=timings or Timings(queue_ms=job.queue_ms), worker=self.worker_id, tokens=tokens)


# -- one-shot families (embedding, classification) ----------------------------------------------

MAX_ERROR_CHARS = 1_000  # of a model error's text in a reply (an exception may print a whole tensor)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:MAX_ERROR_CHARS]


@dataclass(frozen=True, slots=True)
class _Ran:
    """What a one-shot batch's call gave: per request, its (outputs, tokens) or the exception it met."""

    answers: list[tuple[list[Any], int] | BaseException]
    split: bool  # the batch failed whole and its requests ran again one by one


class Notes:
    """The cancel notes a worker has seen, for the copies it has not fetched yet: a hedged request's
    stalled copy reaches its partition's worker after the answer through another copy, sometimes
    seconds later (a broker's failover). Kept ``keep_s`` each, at most ``most`` (the oldest go first):
    what a flood of forged notes can cost is that a copy runs again, as without notes."""

    MACS = 4  # kept for one id: a note forged for it first does not hide its sender's

    def __init__(self, keep_s: float = 60.0, most: int = 32_768) -> None:
        self.keep_s, self.most = keep_s, most
        self._notes: dict[str, tuple[tuple[bytes | None, ...], float]] = {}  # id -> (MACs, until); oldest first

    def __len__(self) -> int:
        return len(self._notes)

    def add(self, request_id: str, mac: bytes | None, now: float) -> None:
        notes = self._notes
        kept = request_id in notes  # a note for a kept id takes no room of its own
        while notes:  # the oldest first: the expired, and beyond the bound
            oldest = next(iter(notes))
            if notes[oldest][1] > now and (kept or len(notes) < self.most):
                break
            del notes[oldest]
        macs, until = notes.get(request_id, ((), now + self.keep_s))
        if mac not in macs and len(macs) < self.MACS:
            notes[request_id] = (*macs, mac), until

    def covers(self, request: Request, now: float) -> bool:
        """Whether a note from ``request``'s sender says it needs no answer."""
        note = self._notes.get(request.id) if self._notes else None
        return note is not None and note[1] > now and any(proven(request, mac) for mac in note[0])


class BatchCore(EngineCore):
    """Requests wait in a ``DynamicBatcher`` and run in batches; each gets one result.

    A cancel note drops the request's queued copies unrun, and is kept (``Notes``) so that a copy
    fetched later is not run either: the sender has its answer. Background work is never hedged, so
    only the interactive queue is looked at."""

    cancellable = True

    def __init__(self, spec: ModelSpec, runner: BatchRunner, policy: BatchPolicy, worker_id: str,
                 observer: Observer) -> None:
        super().__init__(spec, worker_id, observer)
        self._runner = runner
        self._counted = getattr(runner, "run_counted", None)  # runners that report each text's tokens
        self.batcher: DynamicBatcher[Job] = DynamicBatcher(policy)
        # Background work (p3) waits apart, and runs only when the batcher above is empty, one slice at a
        # time (``batcher.dynamic``): the two learn one service-time model.
        self.background: DynamicBatcher[Job] = DynamicBatcher(policy.for_background(), self.batcher.service)
        self._slice_s = policy.background_slice_ms / 1000.0
        self._slice_started: float | None = None  # a background slice is running since (monotonic)
        self._interactive_busy = BusyShare()
        self._max_busy = policy.background_max_busy
        self.notes = Notes()

    @property
    def runner(self) -> Runner:
        return self._runner

    def admit(self, job: Job, now: float) -> bool:
        request = job.request
        if request.stream:
            raise InvalidRequest(f"model {self.name!r} ({self.spec.family}) does not stream", "stream")
        if request.messages:
            raise InvalidRequest(f"model {self.name!r} ({self.spec.family}) does not chat: send inputs", "model")
        if self.notes.covers(request, now):
            self.observer.answered_elsewhere(self.name, 1)
            return False
        count = self._runner.count_tokens
        background = request.priority.background
        (self.background if background else self.batcher).add(
            job, priority=0 if background else int(request.priority), size=len(request.inputs),
            longest=max(count(t) for t in request.inputs), deadline=job.deadline, now=now,
        )
        return True  # a copy is computed again: replies are idempotent by id, and a batch is cheap

    def cancel(self, request_id: str, mac: bytes | None, now: float) -> list[Job]:
        self.notes.add(request_id, mac, now)
        gone = self.batcher.remove(lambda p: p.payload.request.id == request_id and proven(p.payload.request, mac))
        if gone:
            self.observer.answered_elsewhere(self.name, len(gone))
        return [p.payload for p in gone]

    def shed(self, now: float, free_at: float) -> list[Outgoing]:
        dropped = self.batcher.shed(now, free_at=free_at)
        if self.background:  # only what its window has passed, or would pass before it could run
            dropped += self.background.shed(now, free_at=free_at)
        self.observer.codel(self.name, self.batcher.shedding)
        replies = []
        for d in dropped:
            job = d.pending.payload
            self.observer.shed(self.name, job.request.priority, d.reason.value)
            replies.append(Outgoing(job, self._result(job, _SHED_STATUS[d.reason], error=_SHED_TEXT[d.reason])))
        return replies

    def next(self, now: float, max_s: float | None = None) -> Next:
        # The executor is free whenever the shell asks (one batch at a time): work-conserving.
        batch = self.batcher.next_batch(now, max_batch_s=max_s)
        if batch is None and self.background and self.background_allowed(now):  # one slice of background work
            slice_s = self._slice_s if max_s is None else min(max_s, self._slice_s)
            batch = self.background.next_batch(now, max_batch_s=slice_s)
            self._slice_started = now if batch is not None else None
        if batch is None:
            return Next(None)
        groups = [job.request.inputs for job in batch.payloads]
        return Next(Work(partial(self._run, groups), batch.predicted_s, batch))

    def _run(self, groups: list[tuple[str, ...]]) -> _Ran:
        """The forward pass over every request's inputs (in the executor thread).

        When it raises and the batch holds several requests, each runs once more alone, so an input
        that breaks the model fails its own request and not its neighbours' (a failure that is not
        the inputs' fails each of them again, and each gets it).
        """
        try:
            return _Ran(self._answers(groups), split=False)
        except Exception as exc:
            if len(groups) == 1:
                return _Ran([exc], split=False)
        alone: list[tuple[list[Any], int] | BaseException] = []
        for group in groups:
            try:
                alone += self._answers([group])
            except Exception as exc:
                alone.append(exc)
        return _Ran(alone, split=True)

    def _answers(self, groups: list[tuple[str, ...]]) -> list[tuple[list[Any], int] | BaseException]:
        """One call for all ``groups``: each request's outputs, and its texts' tokens where the runner
        counts them (its tokenizer's, for usage), else 0."""
        texts = [t for g in groups for t in g]
        if self._counted is not None:
            outputs, tokens = self._counted(texts)
        else:
            outputs, tokens = self._runner.run(texts), None
        if len(outputs) != len(texts):
            raise ModelError(f"the model gave {len(outputs)} outputs for {len(texts)} inputs")
        answers: list[tuple[list[Any], int] | BaseException] = []
        i = 0
        for g in groups:
            answers.append((list(outputs[i : i + len(g)]), sum(tokens[i : i + len(g)]) if tokens is not None else 0))
            i += len(g)
        return answers

    def complete(self, work: Work, outcome: Outcome) -> list[Outgoing]:
        batch: Batch[Job] = work.state
        jobs = batch.payloads
        took = outcome.took_s
        if self._slice_started is not None:  # a background slice ended: who came meanwhile waited for it
            ended, self._slice_started = outcome.started + took, None
            if came := [p.arrival for p in self.batcher]:
                self.observer.behind_background(self.name, max(0.0, ended - min(came)))
        else:
            self._interactive_busy.add(outcome.started + took, took)
        if outcome.error is not None:  # the call itself failed, beyond what ``_run`` answers for
            answers: list[tuple[list[Any], int] | BaseException] = [outcome.error] * len(jobs)
            split = False
        else:
            ran: _Ran = outcome.value
            answers, split = ran.answers, ran.split
        failed = sum(isinstance(a, BaseException) for a in answers)
        if not failed and not split:  # a call that failed (or ran again split) says nothing about a batch's cost
            self.batcher.observe(batch, took)
        size = batch.size
        self.observer.batch(self.name, BatchFacts(
            size=size, requests=len(jobs), tokens=batch.real_tokens, compute_s=took, predicted_s=batch.predicted_s,
            padding_ratio=batch.padding_ratio, errors=failed,
            waits=[(p.payload.request.priority, outcome.started - p.arrival) for p in batch.items],
        ))
        replies = []
        compute_ms = took * 1000.0
        for job, answer in zip(jobs, answers, strict=True):
            timings = Timings(job.queue_ms, (outcome.started - job.fetched) * 1000.0, compute_ms, size)
            if isinstance(answer, BaseException):
                result = self._result(job, Status.ERROR, error=_describe(answer), timings=timings)
            else:
                outputs, tokens = answer
                result = self._result(job, Status.OK, outputs=outputs, timings=timings, tokens=tokens)
            replies.append(Outgoing(job, result))
        return replies

    def revoke(self, partitions: set[Any]) -> int:
        def lost(p: Pending[Job]) -> bool:
            return p.payload.partition in partitions
        return len(self.batcher.remove(lost)) + len(self.background.remove(lost))

    def buffered(self) -> int:
        return self.batcher.pending_inputs + self.background.pending_inputs

    def background_buffered(self) -> int:
        return self.background.pending_inputs

    def background_allowed(self, now: float) -> bool:
        return self._interactive_busy.share(now) < self._max_busy

    def background_room(self) -> int:
        # Slices enough to cover a fetch's round trip (the broker holds an empty fetch up to 50 ms).
        return 4 * self.batcher.policy.max_batch_size

    def has_work(self) -> bool:
        return bool(self.batcher) or bool(self.background)

    def wake_at(self, now: float, idle: bool) -> float | None:
        times = [t for t in (self.batcher.wake_at(now, idle=idle), self.background.wake_at(now, idle=idle))
                 if t is not None]
        if self.background and not self.background_allowed(now):
            times.append(now + 0.1)  # held back by the interactive load: see again whether it has eased
        return min(times, default=None)


# -- generation ---------------------------------------------------------------------------------


_FINISH_STATUS = {
    Finish.DEADLINE: Status.EXPIRED,
    Finish.CANCELLED: Status.OK,  # the client asked for it; nobody is listening any more
    Finish.TOO_LARGE: Status.INVALID,
}


@dataclass(slots=True)
class _Running:
    """What the core keeps per admitted generation request."""

    job: Job
    prompt: GenInput | None  # until it is handed to the runner
    text: list[str] = field(default_factory=list)  # not streamed: the text so far
    seq: int = 0  # streamed: the next chunk number
    usage: Usage = field(default_factory=Usage)  # tokens so far (prompt, generated)
    revoked: bool = False  # its partition moved: stop without a reply
    first_step: float | None = None  # monotonic start of its first step (the end of its batch wait)
    compute_s: float = 0.0  # the steps it took part in, summed
    batch_size: int = 0  # the largest running batch it stepped in

    def timings(self) -> Timings:
        """For generation: batch wait until the first step, compute = its steps summed, the largest batch."""
        job = self.job
        waited = 0.0 if self.first_step is None else max(0.0, self.first_step - job.fetched) * 1000.0
        return Timings(job.queue_ms, waited, self.compute_s * 1000.0, self.batch_size)


class GenCore(EngineCore):
    """Continuous batching: a ``ContinuousScheduler`` decides who joins and leaves at every step; the
    runner keeps the batch itself (KV caches included)."""

    cancellable = True

    def __init__(self, spec: ModelSpec, runner: StepRunner, policy: GenPolicy, worker_id: str,
                 observer: Observer) -> None:
        super().__init__(spec, worker_id, observer)
        self._runner = runner
        # A slot engine's slots are its running batch, and its block of slots x context the KV it has:
        # the scheduler runs that many sequences, each reserving no more than the context it can hold.
        self._context = runner.max_sequence_tokens
        if runner.max_rows is not None and self._context is not None:
            policy = replace(policy, max_running=runner.max_rows, kv_budget_tokens=runner.max_rows * self._context)
        self.scheduler = ContinuousScheduler(policy)
        self._seqs: dict[str, _Running] = {}
        self._drops: list[str] = []  # evicted, still to be removed from the runner's batch
        self._spec_seen = (0, 0)  # speculation counters already reported (proposed, accepted)
        self.step_s = 0.0  # smoothed duration of a step: when a co-located lane's batch could start

    @property
    def runner(self) -> Runner:
        return self._runner

    def admit(self, job: Job, now: float) -> bool:
        request = job.request
        if len(request.inputs) != 1 and not request.messages:
            raise InvalidRequest("generation takes exactly one prompt in inputs, or a chat in messages", "inputs")
        running = self._seqs.get(request.id)
        if running is not None:
            # A revoked sequence lingers until the next step. When its request comes back (an eager
            # rebalance handed the partition straight back), it carries on and answers under the new
            # record; any other copy is answered by the one in progress.
            if running.revoked and self.scheduler.resume(request.id):
                running.revoked, running.job = False, job
                return True
            return False
        try:
            sampling = Sampling.from_params(request.params)
        except ValueError as exc:
            raise InvalidRequest(f"bad sampling parameters: {exc}", "params") from exc
        templated = bool(request.messages)
        if templated:
            try:
                prompt, stops = self._runner.render_chat([(m.role, m.content) for m in request.messages])
            except ValueError as exc:
                raise InvalidRequest(str(exc), "messages") from exc
            try:
                sampling = replace(sampling, stop=sampling.stop + stops)
            except ValueError as exc:  # the template's stops took it past the limit
                raise InvalidRequest(f"bad sampling parameters: {exc}", "params") from exc
        else:
            prompt = request.inputs[0]
        # An estimate that errs high (WordPiece/BPE average 3-4 characters a token): it only
        # reserves KV memory; the prompt itself is truncated to the runner's limit, never cut here.
        prompt_tokens = min(self._runner.max_prompt_tokens, len(prompt) // 3 + 2)
        max_new = sampling.max_new_tokens
        if self._context is not None:  # it reserves its slot's columns at most: the output ends there
            max_new = max(1, min(max_new, self._context - prompt_tokens))
        self.scheduler.add(Sequence(
            request.id, prompt_tokens=prompt_tokens, max_new_tokens=max_new,
            priority=int(request.priority), arrival=now, deadline=job.deadline,
        ))
        self._seqs[request.id] = _Running(job, GenInput(request.id, prompt, sampling, templated))
        return True

    def next(self, now: float, max_s: float | None = None) -> Next:
        step = self.scheduler.schedule(now)
        replies = [r for s, why in step.evict if (r := self._ended(s.id, why)) is not None]
        self._drops += [s.id for s, _ in step.evict]  # until the runner has dropped them
        if step.evict or step.admit:  # the running batch changed before the step (complete reports after it)
            self._report_batch()
        if not (step.admit or step.decode or self._drops):
            return Next(None, replies)
        admit = [self._take_prompt(s.id) for s in step.admit]
        drops, self._drops = self._drops, []
        return Next(Work(partial(self._runner.step, admit, drops), self.step_s, len(admit)), replies)

    def _report_batch(self) -> None:
        s = self.scheduler
        self.observer.generation(self.name, len(s.running), s.kv_reserved, s.kv_reserved_unused)

    def _take_prompt(self, rid: str) -> GenInput:
        running = self._seqs[rid]
        prompt, running.prompt = running.prompt, None
        assert prompt is not None
        return prompt

    def complete(self, work: Work, outcome: Outcome) -> list[Outgoing]:
        if outcome.error is not None:
            return self._failed(outcome)
        events: list[TokenEvent] = outcome.value
        took = outcome.took_s
        self.step_s = took if self.step_s == 0 else self.step_s + 0.2 * (took - self.step_s)
        runner = self._runner
        proposed, accepted = runner.spec_proposed, runner.spec_accepted
        batch = runner.batch
        self.observer.step(self.name, StepFacts(
            running=len(self.scheduler.running), admitted=work.state, tokens=len(events), compute_s=took,
            kv_padding=(1.0 - batch.real_tokens / batch.cache_tokens) if batch is not None and batch.cache_tokens
            else None,
            spec_proposed=proposed - self._spec_seen[0], spec_accepted=accepted - self._spec_seen[1],
        ))
        self._spec_seen = (proposed, accepted)
        replies = self._apply(events, outcome.started, took, len(self.scheduler.running))
        self._report_batch()
        return replies

    def _failed(self, outcome: Outcome) -> list[Outgoing]:
        """A step raised: the runner's batch (KV caches, rows) is in an unknown state, so it starts
        over empty, and every sequence that was in the step ends with an ``error`` reply naming the
        failure. Those still waiting were not in it: they run at the next step."""
        self._runner.reset()
        self._drops = []  # nothing is left in the runner to drop
        assert outcome.error is not None
        error = "generation failed: " + _describe(outcome.error)
        replies = []
        for seq in self.scheduler.running:  # counted as error results where replies are counted
            self.scheduler.finish(seq.id)
            state = self._seqs.pop(seq.id)
            if state.revoked:  # its partition's new owner answers it
                continue
            job = state.job
            if job.request.stream and state.seq > 0:  # it has streamed: end the stream in band
                message: Result | Chunk = Chunk(
                    id=seq.id, model=self.name, seq=state.seq, final=True, status=Status.ERROR, finish="error",
                    usage=state.usage, error=error, worker=self.worker_id)
            else:
                message = self._result(job, Status.ERROR, error=error, timings=state.timings())
            replies.append(Outgoing(job, message))
        self._report_batch()
        return replies

    def _apply(self, events: list[TokenEvent], started: float, took: float, batch: int) -> list[Outgoing]:
        replies: list[Outgoing] = []
        stepped: set[str] = set()
        for e in events:
            running = self._seqs[e.id]
            running.usage = Usage(e.prompt_tokens, e.generated)
            if e.id not in stepped:  # one step, however many tokens it gave this sequence (speculation)
                stepped.add(e.id)
                if running.first_step is None:
                    running.first_step = started
                running.compute_s += took
                running.batch_size = max(running.batch_size, batch)
            self.scheduler.advance(e.id)
            done = e.finish is not None
            if done:
                self.scheduler.finish(e.id)
                del self._seqs[e.id]
            if running.revoked:
                continue
            job = running.job
            if job.request.stream:
                chunk = Chunk(id=e.id, model=self.name, seq=running.seq, text=e.text, tokens=[e.token], final=done,
                              status=Status.OK if done else None, finish=e.finish, usage=running.usage,
                              worker=self.worker_id)
                running.seq += 1
                replies.append(Outgoing(job, chunk, terminal=done))
            else:
                running.text.append(e.text)
                if done:
                    output = {"text": "".join(running.text), "finish": e.finish,
                              "prompt_tokens": e.prompt_tokens, "completion_tokens": e.generated}
                    replies.append(Outgoing(job, self._result(job, Status.OK, outputs=[output],
                                                              timings=running.timings())))
        return replies

    def _ended(self, rid: str, why: Finish) -> Outgoing | None:
        """The final reply of a sequence leaving before it finished (None: revoked, nobody to tell)."""
        running = self._seqs.pop(rid)
        if running.revoked:
            return None
        job = running.job
        status = _FINISH_STATUS.get(why, Status.ERROR)
        if why is Finish.DEADLINE:
            self.observer.shed(self.name, job.request.priority, Reason.DEADLINE.value)
        if why is Finish.CANCELLED:
            self.observer.cancelled(self.name)
        error = f"generation ended: {why.value}"
        if job.request.stream and running.seq > 0:  # it has streamed: end the stream in band
            return Outgoing(job, Chunk(id=rid, model=self.name, seq=running.seq, final=True, status=status,
                                       finish=why.value, usage=running.usage, error=error, worker=self.worker_id))
        return Outgoing(job, self._result(job, status, error=error, timings=running.timings()))

    def cancel(self, request_id: str, mac: bytes | None, now: float) -> list[Job]:
        running = self._seqs.get(request_id)
        if running is not None and proven(running.job.request, mac):  # only its sender may stop it
            self.scheduler.cancel(request_id)  # it leaves at the next step, with its final reply
        return []

    def revoke(self, partitions: set[Any]) -> int:
        gone = [r for r in self._seqs.values() if r.job.partition in partitions and not r.revoked]
        for running in gone:
            running.revoked = True
            self.scheduler.cancel(running.job.request.id)  # leaves at the next step, silently
        return len(gone)

    def buffered(self) -> int:
        return len(self.scheduler.waiting)

    def background_buffered(self) -> int:
        level = self.scheduler.policy.background_level
        return sum(1 for s in self.scheduler.waiting if s.priority >= level)

    def background_room(self) -> int:
        p = self.scheduler.policy
        return 2 * int(p.max_running * p.background_share)  # a sequence for each slot, and the next

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._drops)


def build_core(spec: ModelSpec, runner: Runner, *, policy: BatchPolicy, gen_policy: GenPolicy, worker_id: str,
               observer: Observer) -> EngineCore:
    """The core for a runner's family."""
    if runner.family == "generator":
        return GenCore(spec, runner, gen_policy, worker_id, observer)  # type: ignore[arg-type]
    return BatchCore(spec, runner, policy, worker_id, observer)  # type: ignore[arg-type]
