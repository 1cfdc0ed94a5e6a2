"""Iteration-level (continuous) scheduling for generation: who joins and who leaves at each step.

A synchronous state machine in the style of vLLM's scheduler (``add``, ``schedule``, ``finish``),
with no torch and no clock. Each *step* is one forward pass: newly admitted sequences are
prefilled, running ones decode one token. Sequences join at any step boundary and leave as soon
as they finish, so a short request never waits for the longest one in its batch.

**KV memory policy: reserve, never preempt.** Admission reserves a sequence's worst case, prompt
tokens + ``max_new_tokens``, against ``kv_budget_tokens``; when the budget is full, newcomers wait
in the queue (in priority order, aging as in the dynamic batcher), and the running batch is never
preempted. The cost of this policy is memory reserved but unused when outputs end early (reported
as ``kv_reserved_unused``); its benefit is that no work is ever thrown away or recomputed —
preemption would have to recompute a victim's prefill and every token it had generated.

A request whose reservation exceeds the whole budget could never run: it is refused at once.

**Background work** (priority ``background_level`` and below: work that waits for idle capacity)
joins only when no other sequence waits, never ages, and holds at most ``background_share`` of the
running slots and of the KV budget. So an interactive request never waits behind it for more than one
step: it finds a free slot and room for a reservation up to ``1 - background_share`` of the budget,
and joins at the next step boundary. (A policy with fewer than ``1 / background_share`` running slots
has none for background work; a background request larger than its share of the budget is refused.)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal


class Finish(enum.StrEnum):
    """Why a sequence left the batch."""

    EOS = "eos"  # the model emitted its end-of-sequence token
    LENGTH = "length"  # max_new_tokens reached
    STOP = "stop"  # a stop sequence appeared
    DEADLINE = "deadline"  # its deadline passed (running or still queued)
    CANCELLED = "cancelled"  # the client went away
    TOO_LARGE = "too_large"  # its reservation exceeds the whole KV budget


@dataclass(frozen=True, slots=True)
class GenPolicy:
    # "continuous": join and leave at every step. "static": the baseline that batches until every
    # sequence in the batch has finished, admitting newcomers only into an empty batch.
    mode: Literal["continuous", "static"] = "continuous"
    max_running: int = 16  # sequences decoding together
    kv_budget_tokens: int = 65_536  # KV cache tokens reservable across the running batch
    max_prefill_tokens: int = 4_096  # prompt tokens admitted in one step (bounds that step's time)
    aging_ms: float = 1_000.0  # waiting this long improves a request by one priority level
    background_level: int = 3  # sequences of this priority or lower are background work
    background_share: float = 0.5  # of the running slots and of the KV budget background work may hold

    def __post_init__(self) -> None:
        if not 0.0 < self.background_share < 1.0:
            raise ValueError(f"background_share must be within (0, 1), got {self.background_share}")
        for name in ("max_running", "kv_budget_tokens", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"GenPolicy.{name} must be >= 1, got {getattr(self, name)}")
        if self.aging_ms <= 0:
            raise ValueError(f"aging_ms must be > 0, got {self.aging_ms}")
        if self.mode not in ("continuous", "static"):
            raise ValueError(f"mode must be 'continuous' or 'static', got {self.mode!r}")


@dataclass(slots=True)
class Sequence:
    """The scheduler's view of one generation request."""

    id: str
    prompt_tokens: int
    max_new_tokens: int
    priority: int = 1
    arrival: float = 0.0
    deadline: float = float("inf")
    generated: int = 0  # tokens produced so far
    steps: int = 0  # forward passes it took part in (prefill included)
    seq: int = 0  # arrival order

    @property
    def reserved(self) -> int:
        return self.prompt_tokens + self.max_new_tokens

    @property
    def used(self) -> int:
        return self.prompt_tokens + self.generated


@dataclass(frozen=True, slots=True)
class Step:
    admit: list[Sequence]  # prefill these this step (they produce their first token)
    decode: list[Sequence]  # already running: one more token each
    evict: list[tuple[Sequence, Finish]] = field(default_factory=list)  # leave now, with the reason


class ContinuousScheduler:
    def __init__(self, policy: GenPolicy | None = None) -> None:
        self.policy = policy or GenPolicy()
        self._waiting: dict[str, Sequence] = {}
        self._running: dict[str, Sequence] = {}
        self._cancelled: set[str] = set()
        self._next_seq = 0
        self.steps = 0

    # -- state -------------------------------------------------------------------------------

    @property
    def waiting(self) -> list[Sequence]:
        return list(self._waiting.values())

    @property
    def running(self) -> list[Sequence]:
        return list(self._running.values())

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def kv_reserved(self) -> int:
        return sum(s.reserved for s in self._running.values())

    @property
    def kv_reserved_unused(self) -> int:
        """Reserved for tokens that have not been generated (and may never be)."""
        return sum(s.reserved - s.used for s in self._running.values())

    def add(self, seq: Sequence) -> None:
        if seq.id in self._waiting or seq.id in self._running:
            raise ValueError(f"sequence {seq.id!r} is already scheduled")
        if seq.prompt_tokens < 1 or seq.max_new_tokens < 1:
            raise ValueError(f"{seq.id}: prompt_tokens and max_new_tokens must be >= 1")
        seq.seq = self._next_seq
        self._next_seq += 1
        self._waiting[seq.id] = seq

    def cancel(self, seq_id: str) -> bool:
        """Mark for eviction at the next step boundary; False if unknown (already finished)."""
        if seq_id in self._waiting or seq_id in self._running:
            self._cancelled.add(seq_id)
            return True
        return False

    def resume(self, seq_id: str) -> bool:
        """Undo a ``cancel`` that has not taken effect yet; False if there was none to undo."""
        if seq_id in self._cancelled:
            self._cancelled.discard(seq_id)
            return True
        return False

    # -- decisions ---------------------------------------------------------------------------

    def schedule(self, now: float) -> Step:
        evict: list[tuple[Sequence, Finish]] = []
        for pool in (self._waiting, self._running):
            for s in list(pool.values()):
                reason = self._leaving(s, now)
                if reason is not None:
                    del pool[s.id]
                    self._cancelled.discard(s.id)
                    evict.append((s, reason))
        admit: list[Sequence] = []
        p = self.policy
        reserved, prefill = self.kv_reserved, 0
        background = [s for s in self._running.values() if s.priority >= p.background_level]
        bg_slots, bg_reserved = len(background), sum(s.reserved for s in background)
        order = sorted(self._waiting.values(), key=lambda s: (self._level(s, now), s.seq))
        if p.mode == "static" and self._running:
            order = []  # the static baseline: nobody joins a batch that is still running
        for s in order:
            room = len(self._running) + len(admit) < p.max_running
            fits = reserved + s.reserved <= p.kv_budget_tokens
            cheap = not admit or prefill + s.prompt_tokens <= p.max_prefill_tokens
            if s.priority >= p.background_level:  # last in the order: nothing else waits
                room = room and bg_slots + 1 <= int(p.max_running * p.background_share)
                fits = fits and bg_reserved + s.reserved <= p.kv_budget_tokens * p.background_share
                bg_slots, bg_reserved = bg_slots + 1, bg_reserved + s.reserved
            if not (room and fits and cheap):
                break  # head-of-line: nothing overtakes the next in line, so big requests get their turn
            admit.append(s)
            reserved += s.reserved
            prefill += s.prompt_tokens
        decode = list(self._running.values())
        for s in admit:
            del self._waiting[s.id]
            self._running[s.id] = s
        for s in admit + decode:
            s.steps += 1
        if admit or decode:
            self.steps += 1
        return Step(admit, decode, evict)

    def _level(self, s: Sequence, now: float) -> int:
        """Its priority, improved by aging; background work keeps its own (it waits for idle capacity)."""
        if s.priority >= self.policy.background_level:
            return s.priority
        return max(0, s.priority - int((now - s.arrival) / (self.policy.aging_ms / 1000.0)))

    def advance(self, seq_id: str, tokens: int = 1) -> None:
        """Record tokens a running sequence produced this step."""
        self._running[seq_id].generated += tokens

    def finish(self, seq_id: str) -> Sequence:
        """A running sequence is done (EOS, length, stop): release its reservation."""
        self._cancelled.discard(seq_id)
        return self._running.pop(seq_id)

    def _leaving(self, s: Sequence, now: float) -> Finish | None:
        if s.id in self._cancelled:
            return Finish.CANCELLED
        if s.deadline <= now:
            return Finish.DEADLINE
        budget = self.policy.kv_budget_tokens
        if s.priority >= self.policy.background_level:
            budget = int(budget * self.policy.background_share)  # what background work may ever hold
        if s.reserved > budget:
            return Finish.TOO_LARGE
        return None
