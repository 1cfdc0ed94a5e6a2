"""What a worker reports, said once: the ``Observer`` interface and its two sinks.

The engine cores and the worker shell call an observer with *facts* where they decide them (a batch
ran, a request was shed, a reply went out). ``Observers`` hands each fact to every sink:

- ``PrometheusSink`` — the worker's ``/metrics`` (``--metrics-port``), for scraping and alerts;
- ``StatsSink`` — the telemetry stream (``kinfer.stats``), for the stream processor's windowed
  tables and, through them, the lag monitor's service-time estimate.

A sink ignores the facts it has no use for. Facts that happen per request are cheap to report:
Prometheus children are resolved once per label set, and counts are reported per batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from consumers import metrics
from consumers.telemetry import StatsReporter
from topics import Priority, Status


@dataclass(frozen=True, slots=True)
class BatchFacts:
    """One forward pass of a one-shot model."""

    size: int  # inputs
    requests: int
    tokens: int  # real tokens (estimated)
    compute_s: float
    predicted_s: float  # the service-time model's forecast
    padding_ratio: float  # padded / real tokens
    errors: int  # requests the batch failed
    waits: list[tuple[Priority, float]]  # per request: fetched → its batch started, seconds


@dataclass(frozen=True, slots=True)
class StepFacts:
    """One continuous-batching step of a generative model."""

    running: int  # sequences in the batch
    admitted: int  # sequences prefilled this step
    tokens: int  # tokens generated
    compute_s: float
    kv_padding: float | None  # share of the batch's KV cache that is padding (None: no batch)
    spec_proposed: int  # speculative draft tokens verified this step
    spec_accepted: int


class Observer:
    """The facts a worker reports; every method is a no-op here, so a sink implements what it uses."""

    def fetched(self, model: str, priority: Priority, queue_s: float) -> None:
        """A valid request was fetched, ``queue_s`` after its record was written."""

    def dead_letter(self, model: str, field: str) -> None:
        """A record was refused and sent to the dead-letter topic."""

    def shed(self, model: str, priority: Priority, reason: str) -> None:
        """A request was refused before compute (expired, deadline, codel)."""

    def batch(self, model: str, facts: BatchFacts) -> None: ...

    def step(self, model: str, facts: StepFacts) -> None: ...

    def replied(self, model: str, outcomes: Counter[tuple[Priority, Status]]) -> None:
        """Terminal replies went out, counted by priority and status."""

    def buffered(self, model: str, inputs: int) -> None: ...

    def paused(self, model: str, priorities: set[Priority]) -> None:
        """The priorities whose partitions are paused now (flow control)."""

    def codel(self, model: str, dropping: bool) -> None: ...

    def generation(self, model: str, running: int, kv_reserved: int) -> None: ...

    def cancelled(self, model: str) -> None:
        """A streaming client went away and its sequence was dropped."""


class Observers(Observer):
    """Every fact to every sink that takes it (a sink that leaves a fact as the no-op is skipped)."""

    def __init__(self, sinks: Iterable[Observer]) -> None:
        self.sinks = list(sinks)
        for name, noop in vars(Observer).items():
            if callable(noop) and not name.startswith("_"):
                takers = [getattr(s, name) for s in self.sinks if getattr(type(s), name) is not noop]
                setattr(self, name, _fan_out(takers))


def _fan_out(methods: list[Callable[..., None]]) -> Callable[..., None]:
    if len(methods) == 1:
        return methods[0]

    def call_all(*args: Any) -> None:
        for method in methods:
            method(*args)

    return call_all


class PrometheusSink(Observer):
    def __init__(self) -> None:
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def fetched(self, model: str, priority: Priority, queue_s: float) -> None:
        self._child(metrics.QUEUE_WAIT, model, priority.label).observe(queue_s)

    def dead_letter(self, model: str, field: str) -> None:
        self._child(metrics.DEAD_LETTERS, model, field).inc()

    def shed(self, model: str, priority: Priority, reason: str) -> None:
        self._child(metrics.SHED, model, priority.label, reason).inc()

    def batch(self, model: str, facts: BatchFacts) -> None:
        self._child(metrics.COMPUTE, model).observe(facts.compute_s)
        self._child(metrics.PREDICTED, model).observe(facts.predicted_s)
        self._child(metrics.BATCH_SIZE, model).observe(facts.size)
        self._child(metrics.PADDING, model).observe(facts.padding_ratio)
        for priority, wait in facts.waits:
            self._child(metrics.BATCH_WAIT, model, priority.label).observe(wait)

    def step(self, model: str, facts: StepFacts) -> None:
        self._child(metrics.GEN_STEP, model).observe(facts.compute_s)
        self._child(metrics.GEN_TOKENS, model).inc(facts.tokens)
        self._child(metrics.SPEC_PROPOSED, model).inc(facts.spec_proposed)
        self._child(metrics.SPEC_ACCEPTED, model).inc(facts.spec_accepted)
        if facts.kv_padding is not None:
            self._child(metrics.KV_PADDING, model).observe(facts.kv_padding)

    def replied(self, model: str, outcomes: Counter[tuple[Priority, Status]]) -> None:
        for (priority, status), n in outcomes.items():
            self._child(metrics.RESULTS, model, priority.label, status.value).inc(n)

    def buffered(self, model: str, inputs: int) -> None:
        self._child(metrics.BUFFERED, model).set(inputs)

    def paused(self, model: str, priorities: set[Priority]) -> None:
        for priority in Priority:
            self._child(metrics.PAUSED, model, priority.label).set(int(priority in priorities))

    def codel(self, model: str, dropping: bool) -> None:
        self._child(metrics.CODEL_DROPPING, model).set(int(dropping))

    def generation(self, model: str, running: int, kv_reserved: int) -> None:
        self._child(metrics.GEN_RUNNING, model).set(running)
        self._child(metrics.KV_RESERVED, model).set(kv_reserved)

    def cancelled(self, model: str) -> None:
        self._child(metrics.GEN_CANCELLED, model).inc()


class StatsSink(Observer):
    """Batches, steps and sheds to the telemetry stream (through the reporter's bounded buffer)."""

    def __init__(self, reporter: StatsReporter) -> None:
        self.reporter = reporter

    def shed(self, model: str, priority: Priority, reason: str) -> None:
        self.reporter.shed(model, reason)

    def batch(self, model: str, facts: BatchFacts) -> None:
        self.reporter.batch(model, facts.size, facts.requests, facts.tokens, facts.compute_s, facts.predicted_s,
                            errors=facts.errors)

    def step(self, model: str, facts: StepFacts) -> None:
        self.reporter.batch(model, facts.running, facts.admitted, facts.tokens, facts.compute_s, step=True)
