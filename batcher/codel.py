"""CoDel (RFC 8289) on queue sojourn time: shed only when a *standing* queue persists.

A burst that drains within ``interval`` costs nothing; a queue whose oldest request has been
waiting longer than ``target`` for a whole ``interval`` starts shedding, one request at a time,
at ``interval / sqrt(count)`` spacing, until the standing queue is gone.
"""

from __future__ import annotations

import math


class CoDel:
    def __init__(self, target_s: float, interval_s: float) -> None:
        if target_s <= 0 or interval_s <= 0:
            raise ValueError(f"target_s and interval_s must be > 0, got {target_s} and {interval_s}")
        self.target_s = target_s
        self.interval_s = interval_s
        self.dropping = False
        self.count = 0  # drops in the current dropping episode
        self._first_above: float | None = None
        self._drop_next = 0.0
        self._last_count = 0
        self._left_at = -math.inf

    def observe(self, standing_s: float, now: float) -> None:
        """Sojourn of the oldest request still queued (0 when the queue is empty)."""
        if standing_s < self.target_s:
            self._first_above = None
            if self.dropping:
                self.dropping = False
                self._last_count, self._left_at = self.count, now
            return
        if self._first_above is None:
            self._first_above = now + self.interval_s
        elif now >= self._first_above and not self.dropping:
            self.dropping = True
            # Re-entering soon after the last episode resumes near its drop rate (RFC 8289 §5.5).
            recent = now - self._left_at < 16 * self.interval_s
            self.count = max(1, self._last_count - 2) if recent else 1
            self._drop_next = now

    def should_drop(self, now: float) -> bool:
        """Whether to shed one request now; schedules the next drop when it says yes."""
        if not self.dropping or now < self._drop_next:
            return False
        self._drop_next = now + self.interval_s / math.sqrt(self.count)
        self.count += 1
        return True

    def spare(self) -> None:
        """The drop ``should_drop`` just allowed was not taken (nothing worth shedding): it does not count,
        so the next check comes as soon, not sooner, and a later drop starts at the rate reached so far."""
        self.count = max(1, self.count - 1)

    def next_drop_at(self) -> float | None:
        return self._drop_next if self.dropping else None
