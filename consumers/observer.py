"""What a worker reports, said once: the ``Observer`` interface (its sinks: ``consumers.sinks``).

The engine cores and the worker shell call an observer with *facts* where they decide them (a batch
ran, a request was shed, a reply went out). ``Observers`` hands each fact to every sink:

- ``PrometheusSink`` — the worker's ``/metrics`` (``--metrics-port``), for scraping and alerts;
- ``StatsSink`` — the telemetry stream (``kinfer.stats``), for the stream processor's windowed
  tables and, through them, the lag monitor's service-time estimate;
- ``ShedLog`` — the worker's log: once a second while it refuses requests, how many, why, and the
  longest a request had waited on the broker when fetched.

A sink ignores the facts it has no use for. Facts that happen per request are cheap to report:
Prometheus children are resolved once per label set, and counts are reported per batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kinfer.topics import Priority, Status


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

    def hosted(self, model: str, generative: bool) -> None:
        """The worker serves ``model`` (a generative one: in steps). Said once, before anything else."""

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

    def undelivered(self, model: str, replies: int) -> None:
        """Replies that reached nobody and cannot be retried (no subscriber and no fallback, or no such topic)."""

    def buffered(self, model: str, inputs: int) -> None: ...

    def paused(self, model: str, priorities: set[Priority]) -> None:
        """The priorities whose partitions are paused now (flow control)."""

    def codel(self, model: str, dropping: bool) -> None: ...

    def behind_background(self, model: str, seconds: float) -> None:
        """A background slice ended; the interactive requests that came while it ran waited at most
        ``seconds`` for it (reported only when some came)."""

    def generation(self, model: str, running: int, kv_reserved: int, kv_unused: int) -> None:
        """The running batch now: sequences, KV tokens reserved, and of those not (yet) used."""

    def cancelled(self, model: str) -> None:
        """A streaming client went away and its sequence was dropped."""

    def answered_elsewhere(self, model: str, copies: int) -> None:
        """Copies of a request whose sender already has its answer (a hedged request answered through
        another copy) were dropped unrun."""

    def resident(self, model: str, tier: str, footprint_bytes: int) -> None:
        """Where the model's weights are now (device, host, disk) and how much device memory they take."""

    def swapped_in(self, model: str, source: str, seconds: float) -> None:
        """The model came to the device from ``source`` (host, disk) and is serving, ``seconds`` later."""


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
