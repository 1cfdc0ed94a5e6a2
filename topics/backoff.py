"""How long to wait before trying again: the one retry schedule every kinfer loop uses."""

from __future__ import annotations

import random


class Backoff:
    """Exponential backoff with jitter: ``first_s``, doubling up to ``max_s``, each delay drawn from
    its upper half (so many clients that failed together do not retry together); ``reset()`` after a
    success."""

    def __init__(self, first_s: float = 0.05, max_s: float = 2.0) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"need 0 < first_s <= max_s, got {first_s} and {max_s}")
        self.first_s = first_s
        self.max_s = max_s
        self._next = first_s

    def next_delay(self) -> float:
        delay = self._next
        self._next = min(self._next * 2.0, self.max_s)
        return delay * (0.5 + 0.5 * random.random())

    def reset(self) -> None:
        self._next = self.first_s
