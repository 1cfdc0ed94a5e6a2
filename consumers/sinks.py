"""The observer's sinks: Prometheus (``--metrics-port``), the telemetry stream (``kinfer.stats``), and the
worker's log, which says once a second why it refused what it refused."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from kinfer.batcher import Reason
from kinfer.consumers import metrics
from kinfer.consumers.observer import BatchFacts, Observer, StepFacts
from kinfer.consumers.stats_reporter import StatsReporter
from kinfer.topics import Priority, Status
from kinfer.topics.residency import TIERS

log = logging.getLogger(__name__)


class PrometheusSink(Observer):
    def __init__(self) -> None:
        self._children: dict[tuple[Any, ...], Any] = {}
        self._longest_behind: dict[str, float] = {}  # by model: the longest wait for a background slice

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def hosted(self, model: str, generative: bool) -> None:
        """Every series of a known label set starts at zero: a counter born at its first event would
        hide that event from ``rate()``, and a panel or alert over it would show nothing until then."""
        for priority in Priority:
            for status in Status:
                self._child(metrics.RESULTS, model, priority.label, status.value)
            for reason in Reason:
                self._child(metrics.SHED, model, priority.label, reason.value)
            self._child(metrics.PAUSED, model, priority.label).set(0)
        self._child(metrics.UNDELIVERED, model)
        self._child(metrics.BUFFERED, model).set(0)
        self._child(metrics.CODEL_DROPPING, model).set(0)
        if generative:
            for counter in (metrics.GEN_TOKENS, metrics.GEN_CANCELLED, metrics.SPEC_PROPOSED, metrics.SPEC_ACCEPTED):
                self._child(counter, model)
            self.generation(model, 0, 0, 0)

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

    def undelivered(self, model: str, replies: int) -> None:
        self._child(metrics.UNDELIVERED, model).inc(replies)

    def buffered(self, model: str, inputs: int) -> None:
        self._child(metrics.BUFFERED, model).set(inputs)

    def paused(self, model: str, priorities: set[Priority]) -> None:
        for priority in Priority:
            self._child(metrics.PAUSED, model, priority.label).set(int(priority in priorities))

    def codel(self, model: str, dropping: bool) -> None:
        self._child(metrics.CODEL_DROPPING, model).set(int(dropping))

    def behind_background(self, model: str, seconds: float) -> None:
        self._child(metrics.BACKGROUND_WAIT, model).observe(seconds)
        if seconds > self._longest_behind.get(model, -1.0):
            self._longest_behind[model] = seconds
            self._child(metrics.BACKGROUND_WAIT_MAX, model).set(seconds)

    def generation(self, model: str, running: int, kv_reserved: int, kv_unused: int) -> None:
        self._child(metrics.GEN_RUNNING, model).set(running)
        self._child(metrics.KV_RESERVED, model).set(kv_reserved)
        self._child(metrics.KV_UNUSED, model).set(kv_unused)

    def cancelled(self, model: str) -> None:
        self._child(metrics.GEN_CANCELLED, model).inc()

    def answered_elsewhere(self, model: str, copies: int) -> None:
        self._child(metrics.COPIES_DROPPED, model).inc(copies)

    def resident(self, model: str, tier: str, footprint_bytes: int) -> None:
        self._child(metrics.MODEL_BYTES, model).set(footprint_bytes)
        for name in TIERS:
            self._child(metrics.MODEL_TIER, model, name).set(int(name == tier))

    def swapped_in(self, model: str, source: str, seconds: float) -> None:
        self._child(metrics.SWAP_IN, model, source).observe(seconds)


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


class _Second:
    """What one model's worker refused in the second under way, and the longest wait at fetch in it."""

    __slots__ = ("shed", "since", "waited")

    def __init__(self, since: float) -> None:
        self.since, self.waited, self.shed = since, 0.0, Counter[str]()


class ShedLog(Observer):
    """One warning a second, per model, while a worker refuses requests before compute: how many and
    why (expired while queued, could not make its deadline, CoDel), and the longest a request it
    fetched in that second had waited on the broker. A reader tells a worker that fetched late (the
    broker held the records: "expired" with a long wait at fetch) from one whose queue was too long
    ("deadline" or CoDel with short waits)."""

    def __init__(self, every_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self._clock = every_s, clock
        self._seconds: dict[str, _Second] = {}

    def fetched(self, model: str, priority: Priority, queue_s: float) -> None:
        second = self._second(model)
        if queue_s > second.waited:
            second.waited = queue_s

    def shed(self, model: str, priority: Priority, reason: str) -> None:
        self._second(model).shed[reason] += 1

    def _second(self, model: str) -> _Second:
        """The model's second under way; the one before is said first if it is over (at the model's next
        fact: a quiet worker says it late)."""
        now = self._clock()
        second = self._seconds.get(model)
        if second is not None and now - second.since < self.every_s:
            return second
        if second is not None and second.shed:
            why = ", ".join(f"{reason} {n}" for reason, n in sorted(second.shed.items()))
            log.warning("%s: %d refused before compute in the last %.1f s (%s); the longest wait at fetch %.0f ms",
                        model, second.shed.total(), now - second.since, why, second.waited * 1000.0)
        second = self._seconds[model] = _Second(now)
        return second
