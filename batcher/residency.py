"""Which models a worker keeps on its device when they do not all fit (pure; ``now`` passed in).

A worker *registers* every model it may serve and keeps a subset *resident* under a device-memory
budget. Weights live in one of three tiers: on the device (served), in host RAM (pinned on CUDA: a
copy away) or only on disk (a load away). The shell (``consumers.swapping``) tells this policy what
it sees — each model's records waiting in Kafka, whether it has work in this process, how many warm
replicas the fleet has — and executes the moves it gets back, one at a time, evictions first.

The rule:

- A model with records waiting and no place on the device is *wanted*, the longest-waiting first:
  at the first record when nobody has it warm (it is cold), or, when other workers have it warm, once
  ``prefetch_lag`` records wait and the lag has risen ``prefetch_polls`` polls in a row — a queue
  forming behind them (prefetch, before it is long; a busy model's steady lag is its work in flight).
- It takes free room, else the room of resident models that are **idle** (nothing in this process)
  and worth less than ``protect_ratio`` times it: the least valuable first, value being the model's
  demand (requests written to its topics, resident or not, decayed with ``half_life_s``; the waiting
  one's claim is at least its waiting records) times its load weight, then least recently used. So
  with equal weights it is LRU; a hot model, idle for a moment between two requests, keeps its place
  against a rarely used one. A cheaper resident model that is busy right now is waited for, not
  skipped: the room goes to the least valuable, so the slot beside the hot models changes hands and
  the hot ones stay.
- When every resident model has work, a model that has waited ``quantum_s`` may take the place of
  one that has held the device at least that long (time slicing, so nobody starves): that one is
  first *drained* — the shell stops fetching it, finishes what it holds — and evicted once idle.
- Never evicted: a model with work in this process, or one whose fleet would drop below
  ``keep_warm`` warm replicas without this worker.
- An evicted model goes to host RAM when the host budget has room (pushing the least valuable host
  model to disk), else to disk. Nothing is ever placed over a budget; a model larger than the
  device budget is never made resident (``Swaps.unservable``).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field


class Tier(enum.IntEnum):
    DEVICE = 0  # on the accelerator (or, on a CPU worker, loaded and served)
    HOST = 1  # in host RAM, pinned on CUDA: a copy away
    DISK = 2  # on disk only: a load away


@dataclass(frozen=True, slots=True)
class ResidencyPolicy:
    device_budget: int  # bytes of weights the device may hold
    host_budget: int = 0  # bytes of weights kept in host RAM off the device (0: no host tier)
    half_life_s: float = 30.0  # how fast past demand stops counting
    quantum_s: float = 10.0  # a model with work keeps the device this long before a waiting one may take it
    keep_warm: int = 0  # never evict a model whose warm replicas (this worker included) are this many or fewer
    # Records waiting before a model that others have warm is wanted here too (a cold one: the first).
    # Below it the lag is their work in flight (commits are coalesced), not a queue.
    prefetch_lag: int = 100
    prefetch_polls: int = 3  # ... and the lag has risen this many plans in a row (a queue forming, not noise)
    # An idle model keeps its place against a waiting one worth less than 1/this of it (hysteresis).
    protect_ratio: float = 4.0

    def __post_init__(self) -> None:
        if self.device_budget <= 0:
            raise ValueError(f"device_budget must be > 0 bytes, got {self.device_budget}")
        if self.host_budget < 0:
            raise ValueError(f"host_budget must be >= 0 bytes, got {self.host_budget}")
        if self.half_life_s <= 0 or self.quantum_s < 0:
            raise ValueError("half_life_s must be > 0 and quantum_s >= 0")
        if self.keep_warm < 0:
            raise ValueError(f"keep_warm must be >= 0, got {self.keep_warm}")
        if self.prefetch_lag < 1 or self.prefetch_polls < 1 or self.protect_ratio <= 0:
            raise ValueError("prefetch_lag and prefetch_polls must be >= 1 and protect_ratio > 0")


@dataclass(frozen=True, slots=True)
class Demand:
    """What the shell sees of one model when it asks for swaps."""

    waiting: int = 0  # records waiting for it in Kafka (its consumer group's lag)
    busy: bool = False  # requests of it buffered or running in this process
    replicas: int = 0  # warm replicas in the fleet (its group's members), this worker included; -1: unknown


@dataclass(frozen=True, slots=True)
class Move:
    model: str
    source: Tier
    to: Tier


@dataclass(frozen=True, slots=True)
class Swaps:
    moves: list[Move] = field(default_factory=list)  # in order: evictions, then promotions
    drain: frozenset[str] = frozenset()  # resident models to stop fetching: their place is wanted
    unservable: frozenset[str] = frozenset()  # waiting, but larger than the whole device budget


@dataclass(slots=True)
class _Model:
    name: str
    footprint: int
    weight: float
    tier: Tier
    demand: float = 0.0  # decayed request count, as of ``demand_at``
    demand_at: float = 0.0
    last_used: float = -math.inf
    tier_since: float = 0.0  # when it entered its tier
    waiting_since: float | None = None  # off the device with records waiting, since
    last_waiting: int = 0  # records waiting at the last decision
    rising: int = 0  # plans in a row that saw its lag rise
    ends: tuple[int, ...] | None = None  # highest end offsets of its topics seen, per priority


class Residency:
    def __init__(self, policy: ResidencyPolicy) -> None:
        self.policy = policy
        self._models: dict[str, _Model] = {}

    # -- what is where ---------------------------------------------------------------------

    def register(self, name: str, footprint: int, weight: float = 1.0, tier: Tier = Tier.DISK) -> None:
        if footprint < 0 or weight <= 0:
            raise ValueError(f"{name}: footprint must be >= 0 and weight > 0")
        if name in self._models:
            raise ValueError(f"{name} is registered already")
        self._models[name] = _Model(name, footprint, weight, tier)

    def tier(self, name: str) -> Tier:
        return self._models[name].tier

    def footprint(self, name: str) -> int:
        return self._models[name].footprint

    def resize(self, name: str, footprint: int) -> None:
        """The footprint measured once loaded (it was an estimate). Over budget now: the next swaps evict."""
        self._models[name].footprint = max(0, footprint)

    def used(self, tier: Tier) -> int:
        return sum(m.footprint for m in self._models.values() if m.tier == tier)

    def models(self, tier: Tier | None = None) -> list[str]:
        return [m.name for m in self._models.values() if tier is None or m.tier == tier]

    def place(self, name: str, tier: Tier, now: float) -> None:
        """The model is in ``tier`` whatever was planned (a move failed, or was not made): the shell says so."""
        m = self._models[name]
        m.tier, m.tier_since = tier, now

    def touch(self, name: str, now: float, requests: int = 1) -> None:
        """``requests`` for the model arrived (the shell counts records written to its topics, so a model
        off the device, or one a worker just started with, is valued by its traffic, not by what it served)."""
        m = self._models[name]
        m.demand = self._decayed(m, now) + requests
        m.demand_at = now
        m.last_used = now

    def written(self, name: str, now: float, ends: tuple[int, ...]) -> int:
        """The end offsets of the model's topics (per priority), read with its lag: what was written
        since the last look is demand (0 at the first look). Against the highest ends seen, so a topic
        missing from one read (an election: it reads as 0) does not bring its whole history back as one
        poll's arrivals. Returns how many arrived."""
        m = self._models[name]
        seen, m.ends = m.ends, tuple(ends) if m.ends is None else tuple(map(max, ends, m.ends))
        arrived = 0 if seen is None else sum(max(0, e - s) for e, s in zip(ends, seen, strict=True))
        if arrived:
            self.touch(name, now, arrived)
        return arrived

    def value(self, name: str, now: float) -> float:
        m = self._models[name]
        return m.weight * self._decayed(m, now)

    def _decayed(self, m: _Model, now: float) -> float:
        return m.demand * math.pow(0.5, max(0.0, now - m.demand_at) / self.policy.half_life_s)

    # -- decisions ---------------------------------------------------------------------------

    def initial(self, now: float) -> list[Move]:
        """At start: the device, then host RAM, filled in registration order; the rest stays on disk."""
        moves = []
        for m in self._models.values():
            if m.tier != Tier.DISK:
                continue
            if m.footprint <= self.policy.device_budget - self.used(Tier.DEVICE):
                moves.append(self._move(m, Tier.DEVICE, now))
            elif m.footprint <= self.policy.host_budget - self.used(Tier.HOST):
                moves.append(self._move(m, Tier.HOST, now))
        return moves

    def swaps(self, now: float, seen: Mapping[str, Demand]) -> Swaps:
        """The moves to make now, given what the shell sees (a model it does not mention: idle)."""
        idle = Demand()
        moves: list[Move] = []
        for m in self._models.values():
            d = seen.get(m.name, idle)
            m.rising = m.rising + 1 if d.waiting > m.last_waiting else 0
            m.last_waiting = d.waiting
            if d.replicas > 0:  # warm elsewhere: only a queue forming behind them
                queue = d.waiting >= self.policy.prefetch_lag and m.rising >= self.policy.prefetch_polls
            else:
                queue = d.waiting >= 1
            if m.tier == Tier.DEVICE or not (queue or (m.waiting_since is not None and d.waiting > 0)):
                m.waiting_since = None
            elif m.waiting_since is None:
                m.waiting_since = now
        # A footprint measured larger than its estimate can leave the device over budget: shed first.
        while self.used(Tier.DEVICE) > self.policy.device_budget:
            victims = [m for m, now_ok in self._evictable(now, seen, idle_only=True) if now_ok]
            if not victims:
                break
            moves += self._evict(victims[0], now)
        wanted = sorted(
            (m for m in self._models.values() if m.tier != Tier.DEVICE and m.waiting_since is not None),
            key=lambda m: (m.waiting_since, -self.value(m.name, now)),
        )
        drain: set[str] = set()
        unservable: set[str] = set()
        for w in wanted:
            if w.footprint > self.policy.device_budget:
                unservable.add(w.name)
                continue
            need = w.footprint - (self.policy.device_budget - self.used(Tier.DEVICE))
            if need <= 0:
                moves.append(self._move(w, Tier.DEVICE, now))
                continue
            starved = w.waiting_since is not None and now - w.waiting_since >= self.policy.quantum_s
            # Its demand counts its waiting records already (they were written); a waiting count above it
            # is a caller refused as cold (a demand note) that never reached Kafka.
            claim = w.weight * max(self._decayed(w, now), seen.get(w.name, idle).waiting)
            candidates = self._evictable(now, seen, idle_only=not starved,
                                         worth_below=claim * self.policy.protect_ratio)
            chosen: list[_Model] = []
            room = 0
            for v, now_ok in candidates:
                if room >= need or not now_ok:
                    break  # enough room, or the next cheapest is busy: wait for it, take no dearer one
                chosen.append(v)
                room += v.footprint
            if room < need:
                continue  # not enough room yet: wait (maybe a drained model becomes idle)
            if any(seen.get(v.name, idle).busy for v in chosen):
                # All of them stop fetching, the idle ones too: drained one by one, each would start
                # again while the next finishes, and they might never be idle together.
                drain.update(v.name for v in chosen)
                continue
            for v in chosen:
                moves += self._evict(v, now)
            moves.append(self._move(w, Tier.DEVICE, now))
        # A model drained for one waiting model may have been evicted for another later in these swaps.
        drain = {name for name in drain if self._models[name].tier == Tier.DEVICE}
        return Swaps(moves, frozenset(drain), frozenset(unservable))

    def _evictable(self, now: float, seen: Mapping[str, Demand], idle_only: bool,
                   worth_below: float = math.inf) -> list[tuple[_Model, bool]]:
        """Resident models that could give up their place, cheapest first (value, then least recently
        used), each with whether it may go now.

        Those worth less than ``worth_below`` count: idle ones (nothing in this process) may go now,
        busy ones not yet (the caller waits for them rather than take a dearer one) — records of theirs
        still in Kafka (lag counts what is fetched and not yet committed, and other workers' queue)
        do not make them busy here. With
        ``idle_only`` False (the waiting model is starved), any that has held the device for a quantum
        may go, whatever it is worth (busy ones are drained before they go). Never one whose fleet would
        be left with fewer than ``keep_warm`` warm replicas.
        """
        idle = Demand()
        out: list[tuple[float, float, _Model, bool]] = []
        for m in self._models.values():
            if m.tier != Tier.DEVICE:
                continue
            d = seen.get(m.name, idle)
            if self.policy.keep_warm and d.replicas <= self.policy.keep_warm:
                continue
            held = now - m.tier_since >= self.policy.quantum_s
            value = self.value(m.name, now)
            if (not idle_only and held) or value < worth_below:
                out.append((value, m.last_used, m, (not idle_only and held) or not d.busy))
        out.sort(key=lambda entry: entry[:2])
        return [(m, now_ok) for _, _, m, now_ok in out]

    def _evict(self, m: _Model, now: float) -> list[Move]:
        """Off the device: to host RAM when it fits there (pushing less valuable models to disk)."""
        moves: list[Move] = []
        budget = self.policy.host_budget
        if 0 < m.footprint <= budget or (m.footprint == 0 and budget > 0):
            hosted = sorted((h for h in self._models.values() if h.tier == Tier.HOST),
                            key=lambda h: (self.value(h.name, now), h.last_used))
            while self.used(Tier.HOST) + m.footprint > budget and hosted:
                h = hosted.pop(0)
                if self.value(h.name, now) > self.value(m.name, now):
                    break  # what is there is worth more: this one goes to disk instead
                moves.append(self._move(h, Tier.DISK, now))
            if self.used(Tier.HOST) + m.footprint <= budget:
                moves.append(self._move(m, Tier.HOST, now))
                return moves
        moves.append(self._move(m, Tier.DISK, now))
        return moves

    @staticmethod
    def _move(m: _Model, to: Tier, now: float) -> Move:
        move = Move(m.name, m.tier, to)
        m.tier, m.tier_since = to, now
        if to == Tier.DEVICE:
            m.waiting_since = None
        return move


__all__ = ["Demand", "Move", "Residency", "ResidencyPolicy", "Swaps", "Tier"]
