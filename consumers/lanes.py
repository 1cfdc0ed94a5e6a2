"""A worker's lanes: one per hosted model, holding what the worker knows about that model.

``BatchLane`` serves one-shot families (embedding): requests wait in a ``DynamicBatcher`` and run
in batches. ``GenLane`` serves generation: a ``ContinuousScheduler`` decides who joins and leaves
the running batch at every step, and the runner keeps the batch itself (KV caches included).
Both turn what happened into replies here, so the worker itself only moves bytes.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from batcher import ContinuousScheduler, DynamicBatcher, Finish, GenPolicy, Sequence, StepPlan
from consumers.offsets import OffsetTracker
from consumers.runners import BatchRunner, ModelSpec, Runner
from consumers.runners.generator import GeneratorRunner, GenInput, Sampling, TokenEvent
from topics import Chunk, InvalidRequest, Priority, Request, Result, Status


@dataclass(slots=True)
class Job:
    """A fetched, valid request and where it came from."""

    request: Request
    tp: TopicPartition
    offset: int
    queue_ms: float  # Kafka record timestamp → fetched
    fetched: float  # monotonic seconds


@dataclass(eq=False, kw_only=True)
class Lane(abc.ABC):
    """What every lane keeps (its consumer, offsets, paused priorities) and must answer."""

    spec: ModelSpec
    tracker: OffsetTracker[TopicPartition] = field(default_factory=OffsetTracker)
    consumer: AIOKafkaConsumer | None = None
    held: set[Priority] = field(default_factory=set)  # priorities whose partitions are paused

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    @abc.abstractmethod
    def model_runner(self) -> Runner: ...

    @abc.abstractmethod
    def buffered(self) -> int:
        """Work fetched and not started (inputs or requests): what flow control bounds."""

    @abc.abstractmethod
    def has_work(self) -> bool:
        """Anything to run or to answer."""


@dataclass(eq=False, kw_only=True)
class BatchLane(Lane):
    runner: BatchRunner
    batcher: DynamicBatcher[Job]

    @property
    def model_runner(self) -> Runner:
        return self.runner

    def buffered(self) -> int:
        return self.batcher.pending_inputs

    def has_work(self) -> bool:
        return bool(self.batcher)


_FINISH_STATUS = {
    Finish.DEADLINE: Status.EXPIRED,
    Finish.CANCELLED: Status.OK,  # the client asked for it; nobody is listening any more
    Finish.TOO_LARGE: Status.INVALID,
}


@dataclass(eq=False, kw_only=True)
class GenLane(Lane):
    runner: GeneratorRunner
    scheduler: ContinuousScheduler = field(default_factory=ContinuousScheduler)
    jobs: dict[str, Job] = field(default_factory=dict)
    texts: dict[str, list[str]] = field(default_factory=dict)  # non-streaming: text so far
    seqs: dict[str, int] = field(default_factory=dict)  # streaming: next chunk number
    inputs: dict[str, GenInput] = field(default_factory=dict)
    worker_id: str = ""
    drops: list[str] = field(default_factory=list)  # evicted, still to be removed from the runner's batch
    spec_seen: tuple[int, int] = (0, 0)  # speculation counters already exported (proposed, accepted)
    step_s: float = 0.0  # smoothed duration of a step: when a co-located lane's batch could start

    @property
    def model_runner(self) -> Runner:
        return self.runner

    @classmethod
    def create(cls, spec: ModelSpec, runner: GeneratorRunner, policy: GenPolicy, worker_id: str) -> GenLane:
        return cls(spec=spec, runner=runner, scheduler=ContinuousScheduler(policy), worker_id=worker_id)

    def buffered(self) -> int:
        return len(self.scheduler.waiting)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def admit(self, job: Job, now: float, deadline: float) -> None:
        """Validate a generation request and queue it; raises ``InvalidRequest``."""
        request = job.request
        if len(request.inputs) != 1:
            raise InvalidRequest("generation takes exactly one prompt in inputs", "inputs")
        try:
            sampling = Sampling.from_params(request.params)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"bad sampling parameters: {exc}", "params") from exc
        prompt = request.inputs[0]
        # An estimate that errs high (WordPiece/BPE average 3-4 characters a token): it only
        # reserves KV memory; the prompt itself is truncated to the runner's limit, never cut here.
        prompt_tokens = min(self.runner.max_prompt_tokens, len(prompt) // 3 + 2)
        self.scheduler.add(Sequence(
            request.id, prompt_tokens=prompt_tokens, max_new_tokens=sampling.max_new_tokens,
            priority=int(request.priority), arrival=now, deadline=deadline,
        ))
        self.jobs[request.id] = job
        self.inputs[request.id] = GenInput(request.id, prompt, sampling)

    def plan(self, now: float) -> tuple[StepPlan, list[tuple[Job, Result | Chunk]]]:
        """Who runs this step, and the final replies of those leaving before it."""
        plan = self.scheduler.schedule(now)
        replies = [self._ended(s.id, why) for s, why in plan.evict]
        self.drops += [s.id for s, _ in plan.evict]  # until the runner has dropped them
        return plan, replies

    def runnable(self, plan: StepPlan) -> bool:
        """Whether the runner has anything to do: compute, or evicted rows to let go of."""
        return bool(plan.admit or plan.decode or self.drops)

    def step_inputs(self, plan: StepPlan) -> tuple[list[GenInput], list[str]]:
        drops, self.drops = self.drops, []
        return [self.inputs.pop(s.id) for s in plan.admit], drops

    def apply(self, events: list[TokenEvent]) -> tuple[list[tuple[Job, Result | Chunk]], list[Job]]:
        """Turn a step's tokens into replies; returns them and the jobs that finished."""
        replies: list[tuple[Job, Result | Chunk]] = []
        finished: list[Job] = []
        for e in events:
            job = self.jobs[e.id]
            self.scheduler.advance(e.id)
            if e.finish is not None:
                self.scheduler.finish(e.id)
            if job.request.stream:
                replies.append((job, self._chunk(job, e.text, [e.token], e)))
            else:
                self.texts.setdefault(e.id, []).append(e.text)
                if e.finish is not None:
                    output = {"text": "".join(self.texts.pop(e.id)), "finish": e.finish,
                              "prompt_tokens": e.prompt_tokens, "completion_tokens": e.generated}
                    replies.append((job, Result(e.id, self.name, Status.OK, outputs=[output], worker=self.worker_id)))
            if e.finish is not None:
                finished.append(self._forget(e.id))
        return replies, finished

    def _chunk(self, job: Job, text: str, tokens: list[int], e: TokenEvent | None = None, **final: Any) -> Chunk:
        seq = self.seqs.get(job.request.id, 0)
        self.seqs[job.request.id] = seq + 1
        done = e is not None and e.finish is not None
        return Chunk(
            id=job.request.id, model=self.name, seq=seq, text=text, tokens=tokens,
            final=done or bool(final), status=Status.OK if done else final.get("status"),
            finish=e.finish if e is not None and done else final.get("finish"),
            prompt_tokens=e.prompt_tokens if e is not None else 0,
            completion_tokens=e.generated if e is not None else 0,
            error=final.get("error"), worker=self.worker_id,
        )

    def _ended(self, rid: str, why: Finish) -> tuple[Job, Result | Chunk]:
        job = self.jobs[rid]
        status = _FINISH_STATUS.get(why, Status.ERROR)
        error = f"generation ended: {why.value}"
        self.texts.pop(rid, None)
        self.inputs.pop(rid, None)
        reply: Result | Chunk
        if job.request.stream:
            reply = self._chunk(job, "", [], status=status, finish=why.value, error=error)
        else:
            reply = Result(rid, self.name, status, error=error, worker=self.worker_id)
        self._forget(rid)
        return job, reply

    def _forget(self, rid: str) -> Job:
        self.seqs.pop(rid, None)
        return self.jobs.pop(rid)
