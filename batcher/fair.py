"""Fair sharing of one executor between co-located models: weighted deficit round-robin.

The currency is measured compute time, not requests: a model whose batches take 40 ms is charged
40 ms per batch. Each round, every model with work gets ``quantum_s × weight`` of credit; a model
runs while its credit is positive and is charged what its batch actually took. A model whose
traffic jumps 10× therefore grows only its own queue: the others still get their share of the
executor, and a model with little traffic is served as soon as it has work (it has credit).
A model with nothing queued keeps no credit, so idleness cannot be banked for a later burst.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class DeficitRoundRobin(Generic[K]):
    def __init__(self, quantum_s: float = 0.05) -> None:
        if quantum_s <= 0:
            raise ValueError(f"quantum_s must be > 0, got {quantum_s}")
        self.quantum_s = quantum_s
        self._weights: dict[K, float] = {}
        self._deficit: dict[K, float] = {}
        self._order: list[K] = []
        self._next = 0  # round-robin position

    def add(self, lane: K, weight: float = 1.0) -> None:
        if weight <= 0:
            raise ValueError(f"weight of {lane!r} must be > 0, got {weight}")
        if lane not in self._weights:
            self._order.append(lane)
        self._weights[lane] = weight
        self._deficit.setdefault(lane, 0.0)

    def credit(self, lane: K) -> float:
        return self._deficit[lane]

    def pick(self, ready: Collection[K]) -> K | None:
        """The lane to run next among those with work queued (None if none has)."""
        for lane in self._order:
            if lane not in ready:
                self._deficit[lane] = 0.0  # idle lanes keep no credit
        candidates = [lane for lane in self._order if lane in ready]
        if not candidates:
            return None
        while True:
            n = len(self._order)
            for step in range(n):
                lane = self._order[(self._next + step) % n]
                if lane in ready and self._deficit[lane] > 0:
                    self._next = (self._next + step) % n
                    return lane
            # Nobody has credit left: a new round.
            for lane in candidates:
                self._deficit[lane] += self.quantum_s * self._weights[lane]

    def charge(self, lane: K, seconds: float) -> None:
        """Record what the lane's batch actually cost; it keeps its turn while credit remains."""
        self._deficit[lane] -= seconds
        if self._deficit[lane] <= 0:
            self._next = (self._order.index(lane) + 1) % len(self._order)
